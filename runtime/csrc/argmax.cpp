// Row-wise argmax of float32 logits, the greedy sampler's one reduction (about 4x faster than
// torch's on one thread for a 49k vocabulary). Same answer as torch.argmax(dim=-1): the first
// index of the row's maximum, or of its first NaN when it has one. Registered as
// torch.ops.eaglebatch.argmax_rows.

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

int64_t first_nan(const float* row, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (row[j] != row[j]) return j;
  return -1;
}

int64_t argmax_row(const float* row, int64_t n) {
  float peak = -std::numeric_limits<float>::infinity();
  int64_t best = 0, j = 0;
  bool nan = false;
#ifdef __AVX512F__
  // One pass, 16 lanes: each lane keeps its first maximum and where it was; then the first
  // index among the lanes that hold the overall maximum.
  if (n >= 16 && n < (int64_t{1} << 31)) {
    __m512 lane_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i lane_idx = _mm512_setzero_si512();
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nans = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 v = _mm512_loadu_ps(row + j);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, lane_max, _CMP_GT_OQ);
      nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      lane_max = _mm512_mask_blend_ps(greater, lane_max, v);
      lane_idx = _mm512_mask_blend_epi32(greater, lane_idx, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    nan = nans != 0;
    alignas(64) float maxima[16];
    alignas(64) int32_t where[16];
    _mm512_store_ps(maxima, lane_max);
    _mm512_store_si512(where, lane_idx);
    peak = maxima[0];
    best = where[0];
    for (int l = 1; l < 16; ++l) {
      if (maxima[l] > peak || (maxima[l] == peak && where[l] < best)) {
        peak = maxima[l];
        best = where[l];
      }
    }
  }
#endif
  for (; j < n; ++j) {  // the tail (or the whole row without AVX-512)
    if (row[j] > peak) {
      peak = row[j];
      best = j;
    }
    nan |= row[j] != row[j];
  }
  if (nan) return first_nan(row, n);
  return best;  // every value -inf: 0, as torch
}

at::Tensor argmax_rows(const at::Tensor& logits) {  // [rows, n] float32 -> [rows] int64
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat &&
              logits.size(1) > 0, "argmax_rows: a contiguous non-empty [rows, n] float32 tensor");
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglebatch, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(eaglebatch, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
}
