// The decoder's small per-token operations in one pass each, instead of torch's chains of
// temporaries (at 64 decode rows they cost ~10 ms of a ~115 ms step on 2 cores; a pass here is
// about a tenth of that). Both work on each row alone, so a row's result does not depend on the
// other rows. Registered as torch.ops.eaglebatch.rms_norm and torch.ops.eaglebatch.rope; with them
// torch.ops.eaglebatch.write_kv, which stores a step's K and V at their cache slots (one copy
// pass instead of two index_copy_ calls per layer; any dtype, K and V in the cache's).
//
// rms_norm: y = weight * (x * (1 / sqrt(mean(x^2) + eps))), the two products rounded in that
// order as in runtime.model.RMSNorm's torch path; the sum of squares runs in 16 lanes, then a
// pairwise tree (so it may differ from torch's in the last bits), on AVX-512 and AVX2 alike.
//
// rope: q * cos + rotate_half(q) * sin (and the same for k), each product and the sum rounded on
// its own (the extension is compiled with -ffp-contract=off: no fused multiply-add), so the bits
// are torch's for the same cos/sin rows.

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRowGrain = 8;  // rows per parallel work item

float sum_of_squares(const float* x, int64_t n) {
  int64_t j = 0;
  float total = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  // the same 16 lanes in two registers and the same tree (lane l + l + 8, + 4, + 2, + 1), so
  // AVX2 CPUs get the AVX-512 bits (a sequential sum before: other bits, and 3 cycles a value)
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + 8);
    lo = _mm256_add_ps(lo, _mm256_mul_ps(a, a));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(b, b));
  }
  const __m256 v = _mm256_add_ps(hi, lo);
  __m128 w = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  w = _mm_add_ps(w, _mm_movehl_ps(w, w));
  total = _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));
#endif
  for (; j < n; ++j) total += x[j] * x[j];
  return total;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "rms_norm: x must be a contiguous 2-d float32 tensor");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
              weight.numel() == n, "rms_norm: weight must be [hidden] float32");
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * n;
      float* yr = yp + r * n;
      const float scale = 1.f / std::sqrt(sum_of_squares(xr, n) / static_cast<float>(n) + e);
      for (int64_t j = 0; j < n; ++j) {
        const float normed = xr[j] * scale;
        yr[j] = wp[j] * normed;
      }
    }
  });
  return y;
}

// One [heads, dim] row of q or k at one position: out = v * c + rotate_half(v) * s.
void rotate_row(const float* v, const float* c, const float* s, float* out, int64_t heads,
                int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* vh = v + h * dim;
    float* oh = out + h * dim;
    for (int64_t j = 0; j < half; ++j) {
      const float a = vh[j] * c[j];
      const float b = -vh[j + half] * s[j];
      oh[j] = a + b;
    }
    for (int64_t j = half; j < dim; ++j) {
      const float a = vh[j] * c[j];
      const float b = vh[j - half] * s[j];
      oh[j] = a + b;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q,          // [n, heads, dim]
                                        const at::Tensor& k,          // [n, kv_heads, dim]
                                        const at::Tensor& cos,        // [max_positions, dim]
                                        const at::Tensor& sin,        // [max_positions, dim]
                                        const at::Tensor& positions)  // [n] int64
{
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.is_contiguous() && k.is_contiguous() &&
              q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
              q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "rope: q and k must be contiguous [n, heads, dim] float32 with one even dim");
  const int64_t n = q.size(0), dim = q.size(2);
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) == dim &&
              cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat, "rope: cos and sin must be [positions, dim] "
              "float32");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == n &&
              positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "rope: positions must be [n] int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_positions = cos.size(0);
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions, "rope: position ", pos[t],
                " outside the table of ", max_positions);
  at::Tensor q_out = at::empty_like(q), k_out = at::empty_like(k);
  const int64_t hq = q.size(1), hk = k.size(1);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qo = q_out.data_ptr<float>(), *ko = k_out.data_ptr<float>();
  at::parallel_for(0, n, kRowGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + pos[t] * dim;
      const float* s = sp + pos[t] * dim;
      rotate_row(qp + t * hq * dim, c, s, qo + t * hq * dim, hq, dim);
      rotate_row(kp + t * hk * dim, c, s, ko + t * hk * dim, hk, dim);
    }
  });
  return {q_out, k_out};
}

void write_kv(at::Tensor& kv_cache,            // [2, blocks, block_size, kv_heads, dim]
              const at::Tensor& key,           // [n, kv_heads, dim]
              const at::Tensor& value,         // [n, kv_heads, dim]
              const at::Tensor& slot_mapping)  // [n] int64
{
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_kv: a contiguous [2, blocks, block_size, kv_heads, dim] cache");
  const int64_t row = kv_cache.size(3) * kv_cache.size(4);
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2), n = slot_mapping.numel();
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous() &&
              key.scalar_type() == kv_cache.scalar_type() &&
              value.scalar_type() == kv_cache.scalar_type() && key.numel() == n * row &&
              value.numel() == n * row,
              "write_kv: contiguous [n, kv_heads, dim] K and V of the cache's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "write_kv: int64 slots");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "write_kv: slot ", slot[t], " outside the cache");
  const int64_t bytes = row * static_cast<int64_t>(kv_cache.element_size());  // a plain copy
  char* k_cache = static_cast<char*>(kv_cache.data_ptr());
  char* v_cache = k_cache + slots * bytes;
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(k_cache + slot[t] * bytes, kp + t * bytes, bytes);
    std::memcpy(v_cache + slot[t] * bytes, vp + t * bytes, bytes);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglebatch, m) {
  m.def("write_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor positions) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(eaglebatch, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
  m.impl("write_kv", &write_kv);
}
