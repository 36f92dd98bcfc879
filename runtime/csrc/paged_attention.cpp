// Paged attention on the CPU, read straight from the block-paged KV cache: no gathered copy of K
// and V. Registered as torch.ops.eaglebatch.paged_attention; the cpu backend sends it decode and
// draft-verification rows (up to 16 queries), where it beats a gather + SDPA.
//
// Work item = (sequence, tile of up to 16 query tokens) with all query heads; query head h reads KV
// head h / (heads / kv_heads) (GQA). Query i of a sequence with q_len queries and kv_len cached
// tokens sits at position kv_len - q_len + i and sees keys 0..position (and, with a sliding window
// W, only keys > position - W). Scores, softmax and the weighted sum of values are computed in
// float32 per query, over its visible keys in order: a query's result does not depend on the other
// queries of its tile, its sequence's chunking, or the other sequences in the batch.
//
// float32, bfloat16 and float16 tensors (query, cache and output of one dtype): 16-bit values are
// widened to float32 as they are read (exact) and the result rounded once when stored, so a
// 16-bit run gives the float32 kernel's result on the widened inputs, rounded.

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;
constexpr int64_t kAhead = 4;  // tokens prefetched ahead
constexpr int64_t kTile = 16;  // query tokens per work item

inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  if (n % kLanes == 0) {  // the same FMA chain per lane and the same pairwise tree as below
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += kLanes)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(a[d + l], b[d + l], acc[l]);
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {  // pairwise, so it vectorises
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  }
  float sum = acc[0];
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// Sum and max of x[0 .. n-1] in a fixed order that vectorises: kLanes running partials (lane l
// takes x[l], x[l + kLanes], ...), the pairwise tree of dot(), then the tail in order.
inline float lane_sum(const float* x, int64_t n) {
  float part[kLanes] = {0.f};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += x[j + l];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) part[l] += part[l + width];
  float sum = part[0];
  for (; j < n; ++j) sum += x[j];
  return sum;
}

inline float lane_max(const float* x, int64_t n) {  // scores are finite: no NaN rules needed
  float part[kLanes];
  std::fill(part, part + kLanes, -std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] = part[l] > x[j + l] ? part[l] : x[j + l];
  float peak = part[0];
  for (int l = 1; l < kLanes; ++l) peak = peak > part[l] ? peak : part[l];
  for (; j < n; ++j) peak = peak > x[j] ? peak : x[j];
  return peak;
}

// exp(x) for x <= 0 (softmax after subtracting the row's peak): 2^n * p(r), |r| <= ln2/2, with a
// degree-6 polynomial (relative error ~1e-7); plain float arithmetic, so loops over it vectorise.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f + 12582912.0f;  // round to nearest via 1.5 * 2^23
  const float n = t - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  int32_t scale_bits = (bits - 0x4B400000 + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
}

// Asks for a cached token's row (all KV heads) ahead of use: blocks are scattered, and hardware
// prefetchers do not follow a sequence from one block to the next.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// n values of src as float32: src itself for float, else widened into scratch (exact).
template <typename T>
inline const float* as_floats(const T* src, int64_t n, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // a bfloat16 is a float's top half
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
      std::memcpy(scratch + i, &wide, sizeof wide);
    }
    return scratch;
  } else {
    for (int64_t i = 0; i < n; ++i) scratch[i] = static_cast<float>(src[i]);
    return scratch;
  }
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += alpha * x[d];
}

template <typename T>
void paged_attention_impl(const at::Tensor& query,   // [num_tokens, heads, dim]
                     const at::Tensor& kv_cache,     // [2, blocks, block_size, kv_heads, dim]
                     at::Tensor& out,                // [num_tokens, heads, dim]
                     const at::Tensor& rows,         // [R] int64: sequences to compute
                     const at::Tensor& query_starts, // [S] int64
                     const at::Tensor& query_lens,   // [S] int64
                     const at::Tensor& seq_lens,     // [S] int64: cached tokens after this step
                     const at::Tensor& block_table,  // [S, max_blocks] int32
                     double scale, int64_t window) {
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && out.is_contiguous() &&
              block_table.is_contiguous(), "paged_attention: contiguous tensors only");
  TORCH_CHECK(block_table.scalar_type() == at::kInt, "paged_attention: int32 block table");
  const int64_t heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == dim && heads % kv_heads == 0, "paged_attention: shapes");
  const int64_t group = heads / kv_heads;
  const int64_t table_width = block_table.size(1);
  const T* q_base = query.data_ptr<T>();
  const T* k_base = kv_cache.data_ptr<T>();
  const T* v_base = k_base + num_blocks * block_size * kv_heads * dim;
  T* o_base = out.data_ptr<T>();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* q_lens = query_lens.data_ptr<int64_t>();
  const int64_t* kv_lens = seq_lens.data_ptr<int64_t>();
  const int32_t* tables = block_table.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const int64_t token_stride = kv_heads * dim;  // between consecutive slots of the cache
  const int64_t row_bytes = token_stride * static_cast<int64_t>(sizeof(T));

  // Work items: (sequence, tile of up to kTile query tokens). A tile reads the keys its queries
  // see; a cached token's K (and V) for all KV heads is one contiguous run of kv_heads * dim
  // floats, so each block is read front to back once per tile. A query's arithmetic (its visible
  // keys, in order) does not depend on the tile, so neither on how a prompt was cut into chunks.
  std::vector<std::pair<int64_t, int64_t>> items;  // (sequence, first query token of the tile)
  for (int64_t r = 0; r < rows.size(0); ++r)
    for (int64_t t = 0; t < q_lens[row_ids[r]]; t += kTile) items.emplace_back(row_ids[r], t);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, q_wide, kv_wide(token_stride);
    for (int64_t item = begin; item < end; ++item) {
      const auto [s, t0] = items[item];
      const int64_t kv_len = kv_lens[s], q0 = starts[s];
      const int64_t t1 = std::min(q_lens[s], t0 + kTile), tile_len = t1 - t0;
      const int64_t first_pos = kv_len - q_lens[s];  // position of the sequence's query 0
      // visible keys of query token i: [first_key(i), first_pos + i]
      auto first_key = [&](int64_t i) {
        return window > 0 ? std::max<int64_t>(0, first_pos + i - window + 1) : int64_t{0};
      };
      const int64_t lo = first_key(t0), hi = first_pos + t1;  // keys [lo, hi) of the tile
      const int64_t span = hi - lo;
      const int64_t nq = tile_len * heads;  // query vector a = (i - t0) * heads + h
      scores.resize(nq * span);
      acc.assign(nq * dim, 0.f);
      const int32_t* table = tables + s * table_width;
      q_wide.resize(nq * dim);
      const float* q_tile = as_floats(q_base + (q0 + t0) * heads * dim, nq * dim, q_wide.data());
      auto slot_of = [&](int64_t j) {
        return static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size;
      };
      for (int64_t j = lo; j < hi; ++j) {
        if (j + kAhead < hi)
          prefetch_row(k_base + slot_of(j + kAhead) * token_stride, row_bytes);
        const float* k = as_floats(k_base + slot_of(j) * token_stride, token_stride,
                                   kv_wide.data());
        for (int64_t i = t0; i < t1; ++i) {
          if (j > first_pos + i || j < first_key(i)) continue;
          for (int64_t h = 0; h < heads; ++h) {
            const int64_t a = (i - t0) * heads + h;
            scores[a * span + (j - lo)] =
                dot(q_tile + a * dim, k + (h / group) * dim, dim) * fscale;
          }
        }
      }
      for (int64_t a = 0; a < nq; ++a) {  // softmax over the visible keys; the rest become 0
        const int64_t i = t0 + a / heads;
        float* row = scores.data() + a * span;
        const int64_t v0 = first_key(i) - lo, v1 = first_pos + i + 1 - lo;  // [v0, v1)
        const float peak = lane_max(row + v0, v1 - v0);
        for (int64_t j = v0; j < v1; ++j) row[j] = exp_nonpositive(row[j] - peak);
        const float inv = 1.f / lane_sum(row + v0, v1 - v0);
        for (int64_t j = v0; j < v1; ++j) row[j] *= inv;
        for (int64_t j = 0; j < v0; ++j) row[j] = 0.f;
        for (int64_t j = v1; j < span; ++j) row[j] = 0.f;
      }
      for (int64_t j = lo; j < hi; ++j) {
        if (j + kAhead < hi)
          prefetch_row(v_base + slot_of(j + kAhead) * token_stride, row_bytes);
        const float* v = as_floats(v_base + slot_of(j) * token_stride, token_stride,
                                   kv_wide.data());
        for (int64_t a = 0; a < nq; ++a) {
          const float p = scores[a * span + (j - lo)];
          if (p != 0.f) axpy(p, v + ((a % heads) / group) * dim, acc.data() + a * dim, dim);
        }
      }
      T* o_tile = o_base + (q0 + t0) * heads * dim;
      for (int64_t e = 0; e < nq * dim; ++e) o_tile[e] = static_cast<T>(acc[e]);  // one rounding
    }
  });
}


void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
                     const at::Tensor& rows, const at::Tensor& query_starts,
                     const at::Tensor& query_lens, const at::Tensor& seq_lens,
                     const at::Tensor& block_table, double scale, int64_t window) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(kv_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_attention: query, cache and output of one dtype");
  switch (dtype) {
    case at::kFloat:
      return paged_attention_impl<float>(query, kv_cache, out, rows, query_starts, query_lens,
                                         seq_lens, block_table, scale, window);
    case at::kBFloat16:
      return paged_attention_impl<c10::BFloat16>(query, kv_cache, out, rows, query_starts,
                                                 query_lens, seq_lens, block_table, scale, window);
    case at::kHalf:
      return paged_attention_impl<c10::Half>(query, kv_cache, out, rows, query_starts,
                                             query_lens, seq_lens, block_table, scale, window);
    default:
      TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16 tensors, not ", dtype);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglebatch, m) {
  m.def("paged_attention(Tensor query, Tensor kv_cache, Tensor(a!) out, Tensor rows, "
        "Tensor query_starts, Tensor query_lens, Tensor seq_lens, Tensor block_table, "
        "float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(eaglebatch, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
