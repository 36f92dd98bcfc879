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
// Speed: a tile's scores come 16 keys at a time (dot16: 16 FMA chains, then one transposed
// reduction in the same pairwise order as dot(), so the same bits), while the next 16 keys' rows
// are fetched; the weighted sum of values keeps each query's output in registers. For one query
// per sequence this reads the cache about as fast as the per-key loop it replaced (batch 64,
// 110 cached tokens, 30 layers: bound by memory); for 2-16 queries (draft verification, the
// drafter's first step) it is ~25% faster, and a batch-16 run with k = 2 drafts ~5%.
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

#ifdef __AVX512F__
// Lanes l and l + w of each 2w-lane group of a and of b, for w = 8, 4, 2, 1: the index vectors
// of one level of the transposed reduction in dot16().
template <int W>
inline __m512i half_lanes(int second) {
  alignas(64) int32_t idx[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    const int source = l < kLanes / 2 ? 0 : kLanes;  // a's lanes first, then b's
    const int m = l % (kLanes / 2);
    idx[l] = source + (m / W) * 2 * W + m % W + second * W;
  }
  return _mm512_load_si512(idx);
}

// The sums of 16 vectors' lanes, one per lane of the result: level by level, lane l of each
// vector is added to lane l + 8, then l + 4, l + 2 and l + 1, the tree _mm512_reduce_add_ps and
// dot() use, so lane m is the bits dot() gives for vector m.
template <int W>
inline void reduce_level(__m512* v, int count) {
  static const __m512i first = half_lanes<W>(0), second = half_lanes<W>(1);
  for (int m = 0; m < count / 2; ++m)
    v[m] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * m], first, v[2 * m + 1]),
                         _mm512_permutex2var_ps(v[2 * m], second, v[2 * m + 1]));
}

// dot(q, rows[m] + offset, dim) for 16 rows at once (dim a multiple of 16), in lane m.
inline __m512 dot16(const float* q, const float* const* rows, int64_t offset, int64_t dim) {
  __m512 acc[kLanes];
  for (int m = 0; m < kLanes; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += kLanes) {
    const __m512 qd = _mm512_loadu_ps(q + d);
    for (int m = 0; m < kLanes; ++m)
      acc[m] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(rows[m] + offset + d), acc[m]);
  }
  reduce_level<8>(acc, 16);
  reduce_level<4>(acc, 8);
  reduce_level<2>(acc, 4);
  reduce_level<1>(acc, 2);
  return acc[0];
}
#endif

// out[j] = dot(q, rows[j] + offset, dim) * scale for the n <= 16 keys of one chunk; `zeros`: a
// row of dim zeros that pads a short chunk.
inline void chunk_scores(const float* q, const float* const* rows, int64_t offset, int64_t n,
                         int64_t dim, float scale, const float* zeros, float* out) {
#ifdef __AVX512F__
  if (dim % kLanes == 0) {
    const float* padded[kLanes];
    for (int m = 0; m < kLanes; ++m) padded[m] = m < n ? rows[m] + offset : zeros;
    const __m512 s = _mm512_mul_ps(dot16(q, padded, 0, dim), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), s);
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) out[j] = dot(q, rows[j] + offset, dim) * scale;
}

#ifdef __AVX512F__
// axpy() over keys [j0, j1) with the output held in registers: the same products and sums, in
// the same order, per output value.
template <int Chunks>
inline void weighted_sum_regs(const float* p, const float* const* rows, int64_t offset,
                              int64_t j0, int64_t j1, float* out) {
  __m512 acc[Chunks];
  for (int c = 0; c < Chunks; ++c) acc[c] = _mm512_loadu_ps(out + c * kLanes);
  for (int64_t j = j0; j < j1; ++j) {
    if (p[j] == 0.f) continue;
    const __m512 pj = _mm512_set1_ps(p[j]);
    const float* v = rows[j] + offset;
    for (int c = 0; c < Chunks; ++c)
      acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(pj, _mm512_loadu_ps(v + c * kLanes)));
  }
  for (int c = 0; c < Chunks; ++c) _mm512_storeu_ps(out + c * kLanes, acc[c]);
}
#endif

// out += p[j] * (rows[j] + offset) for the keys j in [j0, j1) with p[j] != 0, in order.
inline void weighted_sum(const float* p, const float* const* rows, int64_t offset, int64_t j0,
                         int64_t j1, int64_t dim, float* out) {
#ifdef __AVX512F__
  switch (dim) {
    case 32: return weighted_sum_regs<2>(p, rows, offset, j0, j1, out);
    case 64: return weighted_sum_regs<4>(p, rows, offset, j0, j1, out);
    case 128: return weighted_sum_regs<8>(p, rows, offset, j0, j1, out);
    default: break;
  }
#endif
  for (int64_t j = j0; j < j1; ++j)
    if (p[j] != 0.f) axpy(p[j], rows[j] + offset, out, dim);
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

  // Work items: (sequence, tile of up to kTile query tokens). A tile reads the keys its queries
  // see; a cached token's K (and V) for all KV heads is one contiguous run of kv_heads * dim
  // floats, so each block is read front to back once per tile. A query's arithmetic (its visible
  // keys, in order) does not depend on the tile, so neither on how a prompt was cut into chunks.
  std::vector<std::pair<int64_t, int64_t>> items;  // (sequence, first query token of the tile)
  for (int64_t r = 0; r < rows.size(0); ++r)
    for (int64_t t = 0; t < q_lens[row_ids[r]]; t += kTile) items.emplace_back(row_ids[r], t);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, q_wide, k_wide, v_wide;
    std::vector<const float*> k_rows, v_rows;
    const std::vector<float> zeros(dim, 0.f);
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
      // Each key's and value's row (all KV heads) as float32: in the cache itself for float32,
      // widened into scratch for 16-bit caches.
      k_rows.resize(span);
      v_rows.resize(span);
      if constexpr (!std::is_same_v<T, float>) {
        k_wide.resize(span * token_stride);
        v_wide.resize(span * token_stride);
      }
      for (int64_t j = lo; j < hi; ++j) {
        const int64_t slot = slot_of(j), r = j - lo;
        float* k_scratch = k_wide.empty() ? nullptr : k_wide.data() + r * token_stride;
        float* v_scratch = v_wide.empty() ? nullptr : v_wide.data() + r * token_stride;
        k_rows[r] = as_floats(k_base + slot * token_stride, token_stride, k_scratch);
        v_rows[r] = as_floats(v_base + slot * token_stride, token_stride, v_scratch);
        if (r < kLanes) {
          prefetch_row(k_rows[r], token_stride * 4);
          prefetch_row(v_rows[r], token_stride * 4);
        }
      }
      // Scores of every query vector against every key of the tile's span (those a query does
      // not see are overwritten with 0 by the softmax below), 16 keys at a time; meanwhile the
      // next 16 keys' K and V rows are fetched (blocks are scattered, and hardware prefetchers
      // do not follow a sequence from one block to the next).
      const int64_t row_lines = (token_stride * 4 + 63) / 64;  // cache lines of a row
      for (int64_t c0 = 0; c0 < span; c0 += kLanes) {
        // the next chunk's K and V lines, fetched a share at a time between the query vectors
        const int64_t next = std::max<int64_t>(0, std::min(span, c0 + 2 * kLanes) - c0 - kLanes);
        const int64_t lines = 2 * row_lines * next;
        const int64_t n = std::min<int64_t>(kLanes, span - c0);
        for (int64_t a = 0; a < nq; ++a) {
          for (int64_t l = lines * a / nq; l < lines * (a + 1) / nq; ++l) {
            const int64_t r = c0 + kLanes + l / (2 * row_lines), part = l % (2 * row_lines);
            const float* row = part < row_lines ? k_rows[r] : v_rows[r];
            __builtin_prefetch(row + 16 * (part % row_lines), 0, 2);
          }
          const int64_t offset = ((a % heads) / group) * dim;  // this head's KV head in a row
          chunk_scores(q_tile + a * dim, k_rows.data() + c0, offset, n, dim, fscale,
                       zeros.data(), scores.data() + a * span + c0);
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
        const int64_t offset = ((a % heads) / group) * dim;
        weighted_sum(row, v_rows.data(), offset, v0, v1, dim, acc.data() + a * dim);
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
