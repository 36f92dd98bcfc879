// Paged attention on the CPU, read straight from the block-paged KV cache: no gathered copy of K
// and V. Registered as torch.ops.eaglebatch.paged_attention; the cpu backend sends it every
// row of a step: decode, draft verification, draft steps and prompt chunks alike.
//
// Work item = (sequence, tile of up to 16 query tokens) with all query heads (or, in small
// batches, the query heads of one KV head); query head h reads KV head h / (heads / kv_heads)
// (GQA). Query i of a sequence with q_len queries and kv_len cached tokens sits at position
// kv_len - q_len + i and sees keys 0..position (and, with a sliding window W, only keys >
// position - W). Scores, softmax and the weighted sum of values are computed in float32 per
// query, over its visible keys in order: a query's result does not depend on the other queries
// of its tile, its sequence's chunking, or the other sequences in the batch. So a prompt gives
// the same bits whether it is prefilled in one chunk or cut into several (by the token budget,
// a prefix-cache hit or a recompute after preemption), which torch's SDPA does not: it rounds
// by the chunk's shape.
//
// Speed: a tile gets its scores 16 keys at a time (dot16: 16 FMA chains, then one transposed
// reduction in the same pairwise order as dot(), so the same bits) while the next 16 keys' rows
// are fetched, and its values per KV head with the outputs of all that head's query vectors in
// registers (each value row read once for them). With few tiles (small batches) each KV head is
// a work item of its own, so both cores work. All paths give the same bits (checked against the
// previous kernel on float32 / bfloat16 / float16, head sizes 8-128, GQA groups, windows, 1-2000
// cached tokens). Measured on 2 threads, 30 layers: one query per sequence as fast as before
// (batch 64 at 110 cached tokens); 3 queries (draft verification) at batch 16 ~15% and at
// batch 1 ~40% faster. Later, with the fetch loop below free of integer divisions (two per cache
// line, which had cost more than the arithmetic): batch 64 at 112 cached tokens 23.8 -> 18.4 ms
// (Xeon). An earlier version streamed spans too long for L2 key by key (K, then V) and kept
// such spans in one work item; on the AMD EPYC (2 threads, interleaved, heads 9/3, dim 64) the
// 16-key path was as fast or faster at every span tried (one query at batch 16: 0.78-0.84x the
// time at 500-3000 keys, 1.00x at 6000; batch 64 at 600-3000: 0.66-0.81x), and splitting a
// lone sequence's KV heads 0.68-0.77x at 1500-8000 keys, so both went. Prefill of the default
// model against SDPA: 48 / 256 / 1,024 / 2,000 prompt tokens 0.88x / 0.99x / 1.14x / 1.17x.
// Then tiles of 2+ query tokens with 8+ query vectors per KV head got their scores with the
// keys in the lanes (lanes_dot16: no permutes, each transposed chunk shared by the vectors),
// and a tile whose scores would pass 256 KB an item per KV head: prefill of the default model
// at 48 / 256 / 1,024 / 2,000 tokens 0.99x / 0.95x / 0.82x / 0.82x the time (EPYC, 2 threads,
// interleaved; against SDPA now 0.85x / 0.93x / 0.90x / 0.87x); the kernel alone on random
// data, heads 9/3 to 32/8, dim 32-128, 0.63x-0.88x for prompt chunks and 0.82x-0.97x for 3-4-row
// verifications (9/3) at batch 16-64; one query per sequence takes the path it took before.
//
// On AVX2 CPUs (no AVX-512) the scores of a query vector come 8 keys at a time (dot8: dot()'s
// chains, its tree shared by 4 keys and a horizontal add for 8) and the values go to outputs
// held in registers for up to 3 query vectors (weighted_sums8); before, each key's score ran
// dot()'s tree alone and each value row went through axpy() per vector, reading and writing the
// output every time. The same bits (checked against the previous build: decode, verification,
// prompt chunks, dims 16-128, windows, bfloat16 / float16). 30 layers, heads 9/3, dim 64, 160
// cached tokens, 2 threads, AMD EPYC (AVX2): batch 64, one query each 60.6 -> 35.9 ms; batch 16,
// 3 queries 35.6 -> 17.0; batch 1, 3 queries 1.94 -> 1.57; a 48-token prompt 4.7 -> 3.4. The
// softmax's exponentials then run 8 at a time (exp_nonpositive8: the compiler had left the
// scalar loop unvectorised; the same bits): 35.9 -> 26.6, 17.0 -> 11.5, 1.57 -> 0.98, 3.4 -> 2.4.
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

namespace {

constexpr int kLanes = 16;
constexpr int64_t kTile = 16;  // query tokens per work item
constexpr int64_t kFetchAhead = 4;  // K rows fetched before a tile's first scores
constexpr int64_t kLanesVectors = 8;  // query vectors per KV head from which lanes_dot16 runs
constexpr int64_t kScoreBytes = 256 * 1024;  // a tile's scores past this: one KV head per item

inline float dot(const float* a, const float* b, int64_t n) {
#ifdef __AVX512F__
  if (n % kLanes == 0) {  // the same FMA chain per lane and the same pairwise tree as below
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += kLanes)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (n % kLanes == 0) {  // lanes 0-7 and 8-15 in two registers, then the tree below: 8, 4, 2, 1
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += kLanes) {
      lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), lo);
      hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), hi);
    }
    const __m256 v = _mm256_add_ps(lo, hi);
    __m128 w = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    w = _mm_add_ps(w, _mm_movehl_ps(w, w));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));
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
#if defined(__AVX2__) && defined(__FMA__)
  // maxps(a, b) is a > b ? a : b, the comparison below, lane by lane (the loop was not
  // vectorised)
  __m256 lo = _mm256_loadu_ps(part), hi = _mm256_loadu_ps(part + 8);
  for (; j + kLanes <= n; j += kLanes) {
    lo = _mm256_max_ps(lo, _mm256_loadu_ps(x + j));
    hi = _mm256_max_ps(hi, _mm256_loadu_ps(x + j + 8));
  }
  _mm256_storeu_ps(part, lo);
  _mm256_storeu_ps(part + 8, hi);
#endif
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

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive() of 8 values: its operations in its order (no fused multiply-add: the
// scalar code is compiled without contraction), so the same bits. The compiler left the scalar
// loop unvectorised: a decode step's softmax took one call per key and query vector.
inline __m256 exp_nonpositive8(__m256 x) {
  const auto c = [](float v) { return _mm256_set1_ps(v); };
  x = _mm256_max_ps(c(-87.0f), x);  // std::max(x, -87.0f): x unless it is below
  const __m256 t = _mm256_add_ps(_mm256_mul_ps(x, c(1.44269504088896341f)), c(12582912.0f));
  const __m256 n = _mm256_sub_ps(t, c(12582912.0f));
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, c(0.693359375f))),
                                 _mm256_mul_ps(n, c(2.12194440e-4f)));
  __m256 p = c(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), c(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), c(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), c(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), c(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), c(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), c(1.0f));
  const __m256i scale = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B400000)),
                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

// row[j] = exp_nonpositive(row[j] - peak) for j in [j0, j1)
inline void exp_shifted(float* row, int64_t j0, int64_t j1, float peak) {
  int64_t j = j0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 shift = _mm256_set1_ps(peak);
  for (; j + 8 <= j1; j += 8)
    _mm256_storeu_ps(row + j, exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift)));
#endif
  for (; j < j1; ++j) row[j] = exp_nonpositive(row[j] - peak);
}

// While alive, the calling thread's float arithmetic flushes subnormal results to zero and reads
// subnormal inputs as zero (x86's FTZ and DAZ bits), as every thread of the kernel runs. A
// peaked softmax leaves many keys at exp(-87) ~ 1.6e-38 or below, and their weights times the
// values are subnormal: on Intel's cores each such product and sum took a microcode assist
// (the default model's drafter, 5 query rows at 53 keys: weighted_sums was a quarter of its
// layers' time). Such a term is below 2^-126 and changes a sum only where the sum itself is that
// small; a query's result still depends on nothing but its own inputs.
class FlushSubnormals {
 public:
#if defined(__SSE2__)
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

 private:
  unsigned int saved_;
#else
  FlushSubnormals() {}  // elsewhere the arithmetic keeps subnormals (and the test is skipped)
#endif
};

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

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Levels 4 and 2 of dot()'s tree for 4 keys at once, from each key's lanes 0-7 after level 8
// (lo + hi): lanes 0-1 and 2-3 of the low half of the result are keys 0 and 2, of the high half
// keys 1 and 3 (each the 2 sums level 1 adds).
inline __m256 tree_4_2(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  const __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20),
                                   _mm256_permute2f128_ps(v0, v1, 0x31));
  const __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(v2, v3, 0x20),
                                   _mm256_permute2f128_ps(v2, v3, 0x31));
  return _mm256_add_ps(_mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
}

// dot(q, rows[m], dim) for 8 rows at once (dim a multiple of 16), in lane m: dot()'s
// two FMA chains per key and its tree, the tree's levels shared by 4 keys, then level 1 of 8
// keys in one horizontal add: the same bits (on AVX2 a decode step's scores took one tree of
// shuffles per key and query vector).
inline __m256 dot8(const float* q, const float* const* rows, int64_t dim) {
  __m256 t[2];
  for (int g = 0; g < 2; ++g) {
    const float* const* r = rows + 4 * g;
    __m256 lo[4], hi[4];
    for (int m = 0; m < 4; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += kLanes) {
      const __m256 q_lo = _mm256_loadu_ps(q + d), q_hi = _mm256_loadu_ps(q + d + 8);
      for (int m = 0; m < 4; ++m) {
        lo[m] = _mm256_fmadd_ps(q_lo, _mm256_loadu_ps(r[m] + d), lo[m]);
        hi[m] = _mm256_fmadd_ps(q_hi, _mm256_loadu_ps(r[m] + d + 8), hi[m]);
      }
    }
    t[g] = tree_4_2(_mm256_add_ps(lo[0], hi[0]), _mm256_add_ps(lo[1], hi[1]),
                    _mm256_add_ps(lo[2], hi[2]), _mm256_add_ps(lo[3], hi[3]));
  }
  // hadd: keys 0, 2, 4, 6 in the low half, 1, 3, 5, 7 in the high one
  return _mm256_permutevar8x32_ps(_mm256_hadd_ps(t[0], t[1]),
                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
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
#elif defined(__AVX2__) && defined(__FMA__)
  if (dim % kLanes == 0 && n > 1) {
    const float* padded[kLanes];
    for (int m = 0; m < kLanes; ++m) padded[m] = m < n ? rows[m] + offset : zeros;
    alignas(32) float s[kLanes];
    const __m256 f = _mm256_set1_ps(scale);
    _mm256_store_ps(s, _mm256_mul_ps(dot8(q, padded, dim), f));
    if (n > 8) _mm256_store_ps(s + 8, _mm256_mul_ps(dot8(q, padded + 8, dim), f));
    std::memcpy(out, s, n * sizeof(float));
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) out[j] = dot(q, rows[j] + offset, dim) * scale;
}

#ifdef __AVX512F__
// The n <= 16 keys of one chunk, one KV head, transposed: kt[d * 16 + m] = rows[m][offset + d]
// (0 for m >= n), so that 16 keys sit in the lanes of one vector per dimension.
inline void transpose_keys(const float* const* rows, int64_t offset, int64_t n, int64_t dim,
                           float* kt) {
  for (int64_t d0 = 0; d0 < dim; d0 += kLanes) {
    __m512 r[kLanes];
    for (int m = 0; m < kLanes; ++m)
      r[m] = m < n ? _mm512_loadu_ps(rows[m] + offset + d0) : _mm512_setzero_ps();
    // 16 x 16 transpose: 32-bit, then 64-bit interleaves, then 128-bit lane shuffles
    __m512 t[kLanes];
    for (int m = 0; m < kLanes; m += 2) {
      t[m] = _mm512_unpacklo_ps(r[m], r[m + 1]);
      t[m + 1] = _mm512_unpackhi_ps(r[m], r[m + 1]);
    }
    for (int m = 0; m < kLanes; m += 4)
      for (int i = 0; i < 2; ++i) {
        r[m + i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[m + i]),
                                                       _mm512_castps_pd(t[m + 2 + i])));
        r[m + 2 + i] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[m + i]),
                                                           _mm512_castps_pd(t[m + 2 + i])));
      }
    // 128-bit lane L of r[4b + s] now holds keys 4b .. 4b + 3 at dimension 4L + j, where s is
    // j with 1 and 2 swapped; the 128-bit lanes are gathered into one vector per dimension
    for (int j = 0; j < 4; ++j) {
      const int s = j == 1 ? 2 : j == 2 ? 1 : j;
      const __m512 a = _mm512_shuffle_f32x4(r[s], r[4 + s], 0x88);  // lanes 0, 2: keys 0-3, 4-7
      const __m512 b = _mm512_shuffle_f32x4(r[8 + s], r[12 + s], 0x88);  // keys 8-11, 12-15
      const __m512 c = _mm512_shuffle_f32x4(r[s], r[4 + s], 0xDD);  // lanes 1, 3
      const __m512 e = _mm512_shuffle_f32x4(r[8 + s], r[12 + s], 0xDD);
      _mm512_storeu_ps(kt + (d0 + j) * kLanes, _mm512_shuffle_f32x4(a, b, 0x88));       // L0
      _mm512_storeu_ps(kt + (d0 + 4 + j) * kLanes, _mm512_shuffle_f32x4(c, e, 0x88));   // L1
      _mm512_storeu_ps(kt + (d0 + 8 + j) * kLanes, _mm512_shuffle_f32x4(a, b, 0xDD));   // L2
      _mm512_storeu_ps(kt + (d0 + 12 + j) * kLanes, _mm512_shuffle_f32x4(c, e, 0xDD));  // L3
    }
  }
}

// dot16() of each of Count (1 or 2) query vectors against the 16 keys of transpose_keys()' kt,
// sharing each load of kt: lane m of partial l is the same FMA chain over d = l, l + 16, ...
// (q[d] * k_m[d], in that order, from 0) as dot16()'s lane l for key m, and the partials are
// summed in dot16()'s tree (l + 8, then + 4, + 2, + 1): the same bits, without the transposed
// reduction's permutes.
template <int Count>
inline void lanes_dot16(const float* const* q, const float* kt, int64_t dim, __m512* out) {
  __m512 half[Count][8];
  for (int l = 0; l < 8; ++l) {
    __m512 lo[Count], hi[Count];
    for (int v = 0; v < Count; ++v) lo[v] = hi[v] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += kLanes) {
      const __m512 k_lo = _mm512_loadu_ps(kt + (d + l) * kLanes);
      const __m512 k_hi = _mm512_loadu_ps(kt + (d + l + 8) * kLanes);
      for (int v = 0; v < Count; ++v) {
        lo[v] = _mm512_fmadd_ps(_mm512_set1_ps(q[v][d + l]), k_lo, lo[v]);
        hi[v] = _mm512_fmadd_ps(_mm512_set1_ps(q[v][d + l + 8]), k_hi, hi[v]);
      }
    }
    for (int v = 0; v < Count; ++v) half[v][l] = _mm512_add_ps(lo[v], hi[v]);
  }
  for (int v = 0; v < Count; ++v) {
    for (int l = 0; l < 4; ++l) half[v][l] = _mm512_add_ps(half[v][l], half[v][l + 4]);
    for (int l = 0; l < 2; ++l) half[v][l] = _mm512_add_ps(half[v][l], half[v][l + 2]);
    out[v] = _mm512_add_ps(half[v][0], half[v][1]);
  }
}
#endif

#ifdef __AVX512F__
// For Count query vectors at once: out[m] += p[m][j] * (rows[j] + offset) for the keys j in
// [j0, j1) where p[m][j] != 0, in order of j: axpy()'s products and sums for each output value
// (a masked add skips a zero weight as axpy()'s caller does), with the outputs in registers and
// each value row read once for all Count vectors (rows in cache).
template <int Chunks, int Count>
void weighted_sums(const float* const* p, const float* const* rows, int64_t offset, int64_t j0,
                   int64_t j1, float* const* out) {
  __m512 acc[Count][Chunks];
  for (int m = 0; m < Count; ++m)
    for (int c = 0; c < Chunks; ++c) acc[m][c] = _mm512_loadu_ps(out[m] + c * kLanes);
  for (int64_t j = j0; j < j1; ++j) {
    const float* v = rows[j] + offset;
    __m512 vc[Chunks];
    for (int c = 0; c < Chunks; ++c) vc[c] = _mm512_loadu_ps(v + c * kLanes);
    for (int m = 0; m < Count; ++m) {
      const float pj = p[m][j];
      const __mmask16 keep = pj != 0.f ? 0xFFFF : 0;
      const __m512 w = _mm512_set1_ps(pj);
      for (int c = 0; c < Chunks; ++c)
        acc[m][c] = _mm512_mask_add_ps(acc[m][c], keep, acc[m][c], _mm512_mul_ps(w, vc[c]));
    }
  }
  for (int m = 0; m < Count; ++m)
    for (int c = 0; c < Chunks; ++c) _mm512_storeu_ps(out[m] + c * kLanes, acc[m][c]);
}

// weighted_sums for n <= 6 vectors (n <= 3 at 8 chunks: 24 accumulators at most; the
// 8-chunk cases of 4 to 6 vectors are never called and only instantiated with Count 1).
template <int Chunks>
void weighted_sums_n(int64_t n, const float* const* p, const float* const* rows, int64_t offset,
                     int64_t j0, int64_t j1, float* const* out) {
  switch (n) {
    case 1: return weighted_sums<Chunks, 1>(p, rows, offset, j0, j1, out);
    case 2: return weighted_sums<Chunks, 2>(p, rows, offset, j0, j1, out);
    case 3: return weighted_sums<Chunks, 3>(p, rows, offset, j0, j1, out);
    case 4: return weighted_sums<Chunks, (Chunks > 4 ? 1 : 4)>(p, rows, offset, j0, j1, out);
    case 5: return weighted_sums<Chunks, (Chunks > 4 ? 1 : 5)>(p, rows, offset, j0, j1, out);
    default: return weighted_sums<Chunks, (Chunks > 4 ? 1 : 6)>(p, rows, offset, j0, j1, out);
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// For Count <= 3 query vectors at once and 32 values of each row (rows[j] + offset ..): out[m]
// += p[m][j] * row for the keys j in [j0, j1) where p[m][j] != 0, in order of j: axpy()'s
// products and sums (a product, then a sum, each rounded), the outputs in registers instead of
// read and written for every key (on AVX2 a decode step's values cost that per key and vector).
template <int Count>
void weighted_sums8(const float* const* p, const float* const* rows, int64_t offset, int64_t j0,
                    int64_t j1, float* const* out) {
  constexpr int kChunks = 4;  // 12 accumulators at most
  __m256 acc[Count][kChunks];
  for (int m = 0; m < Count; ++m)
    for (int c = 0; c < kChunks; ++c) acc[m][c] = _mm256_loadu_ps(out[m] + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const float* v = rows[j] + offset;
    for (int m = 0; m < Count; ++m) {
      const float pj = p[m][j];
      if (pj == 0.f) continue;
      const __m256 w = _mm256_set1_ps(pj);
      for (int c = 0; c < kChunks; ++c)
        acc[m][c] = _mm256_add_ps(acc[m][c], _mm256_mul_ps(w, _mm256_loadu_ps(v + 8 * c)));
    }
  }
  for (int m = 0; m < Count; ++m)
    for (int c = 0; c < kChunks; ++c) _mm256_storeu_ps(out[m] + 8 * c, acc[m][c]);
}
#endif

// out[m] += p[m][j] * (rows[j] + offset) for m < n and the keys j in [j0, j1) with
// p[m][j] != 0, in order of j (rows outside a vector's visible keys hold 0 in its p).
inline void weighted_sum(int64_t n, const float* const* p, const float* const* rows,
                         int64_t offset, int64_t j0, int64_t j1, int64_t dim, float* const* out) {
#ifdef __AVX512F__
  const int64_t most = dim == 128 ? 3 : 6;
  if (dim == 32 || dim == 64 || dim == 128) {
    for (int64_t m = 0; m < n; m += most) {
      const int64_t count = std::min(most, n - m);
      if (dim == 32) weighted_sums_n<2>(count, p + m, rows, offset, j0, j1, out + m);
      if (dim == 64) weighted_sums_n<4>(count, p + m, rows, offset, j0, j1, out + m);
      if (dim == 128) weighted_sums_n<8>(count, p + m, rows, offset, j0, j1, out + m);
    }
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (dim % 32 == 0) {
    for (int64_t m = 0; m < n; m += 3) {
      const int64_t count = std::min<int64_t>(3, n - m);
      for (int64_t d = 0; d < dim; d += 32) {
        float* part[3];
        for (int64_t i = 0; i < count; ++i) part[i] = out[m + i] + d;
        if (count == 3) weighted_sums8<3>(p + m, rows, offset + d, j0, j1, part);
        else if (count == 2) weighted_sums8<2>(p + m, rows, offset + d, j0, j1, part);
        else weighted_sums8<1>(p + m, rows, offset + d, j0, j1, part);
      }
    }
    return;
  }
#endif
  for (int64_t m = 0; m < n; ++m)
    for (int64_t j = j0; j < j1; ++j)
      if (p[m][j] != 0.f) axpy(p[m][j], rows[j] + offset, out[m], dim);
}

template <typename T>
void paged_attention_impl(const at::Tensor& query,   // [num_tokens, heads, dim]
                     const at::Tensor& kv_cache,     // [2, blocks, block_size, kv_heads, dim]
                     at::Tensor& out,                // [num_tokens, heads, dim]
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
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* q_lens = query_lens.data_ptr<int64_t>();
  const int64_t* kv_lens = seq_lens.data_ptr<int64_t>();
  const int32_t* tables = block_table.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const int64_t token_stride = kv_heads * dim;  // between consecutive slots of the cache

  // Work items: (sequence, tile of up to kTile query tokens, range of KV heads). A tile reads the
  // keys its queries see; a cached token's K (and V) for all KV heads is one contiguous run of
  // kv_heads * dim floats, so each block is read front to back once per tile. With fewer tiles
  // than a few per thread (small batches, long contexts) each KV head is an item of its own, so
  // every thread has work. A query's arithmetic (its visible keys, in order) depends neither on
  // the tile nor on the split, so neither on how a prompt was cut into chunks.
  struct Item {
    int64_t seq, t0, g0, g1;  // sequence, first query token of the tile, KV heads [g0, g1)
  };
  // The keys [lo, hi) that the tile of sequence s starting at query token t0 reads: every key
  // one of its queries sees.
  auto tile_keys = [&](int64_t s, int64_t t0) {
    const int64_t first_pos = kv_lens[s] - q_lens[s];  // position of the sequence's query 0
    const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos + t0 - window + 1) : 0;
    return std::make_pair(lo, first_pos + std::min(q_lens[s], t0 + kTile));
  };
  std::vector<Item> items;
  for (int64_t seq = 0; seq < query_lens.size(0); ++seq)  // every sequence of the step
    for (int64_t t = 0; t < q_lens[seq]; t += kTile) items.push_back({seq, t, 0, 0});
  const bool few = static_cast<int64_t>(items.size()) < 4 * at::get_num_threads();
  std::vector<Item> work;
  for (const Item& it : items) {
    const auto [lo, hi] = tile_keys(it.seq, it.t0);
    const int64_t tile_len = std::min(q_lens[it.seq] - it.t0, kTile);
    // (a long prompt chunk's scores for all heads would not stay in L2)
    const bool split = few || (hi - lo) * tile_len * heads * 4 > kScoreBytes;
    for (int64_t g = 0; g < kv_heads; g += split ? 1 : kv_heads)
      work.push_back({it.seq, it.t0, g, split ? g + 1 : kv_heads});
  }
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t begin, int64_t end) {
    const FlushSubnormals flush;
    std::vector<float> scores, acc, q_wide, k_wide, v_wide, kt;
    std::vector<const float*> k_rows, v_rows, weights, q_ptrs;
    std::vector<int64_t> kv_offsets;
    std::vector<std::vector<int64_t>> head_vectors;
    std::vector<float*> outs;
    const std::vector<float> zeros(dim, 0.f);
    for (int64_t w = begin; w < end; ++w) {
      const auto [s, t0, g0, g1] = work[w];
      const int64_t kv_len = kv_lens[s], q0 = starts[s];
      const int64_t t1 = std::min(q_lens[s], t0 + kTile), tile_len = t1 - t0;
      const int64_t first_pos = kv_len - q_lens[s];  // position of the sequence's query 0
      // visible keys of query token i: [first_key(i), first_pos + i]
      auto first_key = [&](int64_t i) {
        return window > 0 ? std::max<int64_t>(0, first_pos + i - window + 1) : int64_t{0};
      };
      const auto [lo, hi] = tile_keys(s, t0);
      const int64_t span = hi - lo;
      // The item's query heads [h0, h0 + hq); query vector a = (i - t0) * hq + (h - h0).
      const int64_t h0 = g0 * group, hq = (g1 - g0) * group, nq = tile_len * hq;
      const int64_t part = (g1 - g0) * dim;  // floats of a cached row that the item reads
      scores.resize(nq * span);
      acc.assign(nq * dim, 0.f);
      const int32_t* table = tables + s * table_width;
      q_wide.resize(tile_len * heads * dim);
      const float* q_tile = as_floats(q_base + (q0 + t0) * heads * dim, tile_len * heads * dim,
                                      q_wide.data());
      // per query vector: its query, and where its KV head sits in the item's part of a row
      q_ptrs.resize(nq);
      kv_offsets.resize(nq);
      head_vectors.assign(g1 - g0, {});  // the query vectors of each of the item's KV heads
      for (int64_t a = 0; a < nq; ++a) {
        q_ptrs[a] = q_tile + ((a / hq) * heads + h0 + a % hq) * dim;
        kv_offsets[a] = ((h0 + a % hq) / group - g0) * dim;
        head_vectors[(h0 + a % hq) / group - g0].push_back(a);
      }
      // Each key's and value's KV heads [g0, g1) as float32: in the cache itself for float32,
      // widened into scratch for 16-bit caches.
      k_rows.resize(span);
      v_rows.resize(span);
      if constexpr (!std::is_same_v<T, float>) {
        k_wide.resize(span * part);
        v_wide.resize(span * part);
      }
      // (slots block by block: a division per key cost more than its scores at batch 64)
      for (int64_t j = lo, block = lo / block_size, within = lo % block_size; j < hi; ++j) {
        const int64_t slot = static_cast<int64_t>(table[block]) * block_size + within;
        if (++within == block_size) within = 0, ++block;
        const int64_t at = slot * token_stride + g0 * dim, r = j - lo;
        k_rows[r] = as_floats(k_base + at, part, k_wide.empty() ? nullptr : &k_wide[r * part]);
        v_rows[r] = as_floats(v_base + at, part, v_wide.empty() ? nullptr : &v_wide[r * part]);
        if (r < std::min<int64_t>(kLanes, kFetchAhead)) prefetch_row(k_rows[r], part * 4);
      }
      // Scores of every query vector against every key of the tile's span (those a query does
      // not see are overwritten with 0 by the softmax below), 16 keys at a time; meanwhile the
      // next 16 keys' K and V rows are fetched (blocks are scattered, and hardware prefetchers
      // do not follow a sequence from one block to the next), a share of their lines between
      // the query vectors.
#ifdef __AVX512F__
      // With several query tokens and enough query vectors per KV head (prompt chunks,
      // verifications of 3+ rows with heads 9/3, 2+ with 32/8), each chunk of 16 keys is
      // transposed once per KV head and the vectors' scores come from lanes_dot16(), the same
      // bits as chunk_scores() below, which keeps the rest: one query per sequence (decoding;
      // with 7 query heads per KV head, dim 128, batch 64, lanes took ~1.3x the time) and
      // 6-vector tiles (2 rows at 9/3: ~1.15x), where the transposes cost more than they save.
      if (dim % kLanes == 0 && tile_len > 1 && tile_len * group >= kLanesVectors) {
        kt.resize(dim * kLanes);
        const int64_t row_lines = (part * 4 + 63) / 64;
        for (int64_t c0 = 0; c0 < span; c0 += kLanes) {
          const int64_t n = std::min<int64_t>(kLanes, span - c0);
          for (int64_t r = c0 + kLanes; r < std::min(span, c0 + 2 * kLanes); ++r)
            for (int64_t l = 0; l < row_lines; ++l) {
              __builtin_prefetch(k_rows[r] + 16 * l, 0, 2);
              __builtin_prefetch(v_rows[r] + 16 * l, 0, 2);
            }
          const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
          for (int64_t g = g0; g < g1; ++g) {
            transpose_keys(k_rows.data() + c0, (g - g0) * dim, n, dim, kt.data());
            const std::vector<int64_t>& mine = head_vectors[g - g0];
            for (size_t i = 0; i < mine.size(); i += 2) {
              const int count = i + 1 < mine.size() ? 2 : 1;
              const float* qs[2] = {q_ptrs[mine[i]], q_ptrs[mine[i + count - 1]]};
              __m512 sc[2];
              if (count == 2) lanes_dot16<2>(qs, kt.data(), dim, sc);
              else lanes_dot16<1>(qs, kt.data(), dim, sc);
              for (int v = 0; v < count; ++v)
                _mm512_mask_storeu_ps(scores.data() + mine[i + v] * span + c0, keep,
                                      _mm512_mul_ps(sc[v], _mm512_set1_ps(fscale)));
            }
          }
        }
      } else
#endif
      {
        const int64_t row_lines = (part * 4 + 63) / 64;  // cache lines of a row's part
        for (int64_t c0 = 0; c0 < span; c0 += kLanes) {
          const int64_t next =
              std::max<int64_t>(0, std::min(span, c0 + 2 * kLanes) - c0 - kLanes);
          const int64_t lines = 2 * row_lines * next;
          const int64_t n = std::min<int64_t>(kLanes, span - c0);
          for (int64_t a = 0; a < nq; ++a) {
            // lines [l0, l1) of the next keys' rows: K row r's lines, then its V row's; stepped
            // through without a division per line (that cost more than the arithmetic)
            const int64_t l0 = lines * a / nq, l1 = lines * (a + 1) / nq;
            int64_t r = c0 + kLanes + l0 / (2 * row_lines), line = l0 % (2 * row_lines);
            for (int64_t l = l0; l < l1; ++l) {
              const float* row = line < row_lines ? k_rows[r] : v_rows[r];
              __builtin_prefetch(row + 16 * (line < row_lines ? line : line - row_lines), 0, 2);
              if (++line == 2 * row_lines) line = 0, ++r;
            }
            chunk_scores(q_ptrs[a], k_rows.data() + c0, kv_offsets[a], n, dim, fscale,
                         zeros.data(), scores.data() + a * span + c0);
          }
        }
      }
      for (int64_t a = 0; a < nq; ++a) {  // softmax over the visible keys; the rest become 0
        const int64_t i = t0 + a / hq;
        float* row = scores.data() + a * span;
        const int64_t v0 = first_key(i) - lo, v1 = first_pos + i + 1 - lo;  // [v0, v1)
        const float peak = lane_max(row + v0, v1 - v0);
        exp_shifted(row, v0, v1, peak);
        const float inv = 1.f / lane_sum(row + v0, v1 - v0);
        for (int64_t j = v0; j < v1; ++j) row[j] *= inv;
        for (int64_t j = 0; j < v0; ++j) row[j] = 0.f;
        for (int64_t j = v1; j < span; ++j) row[j] = 0.f;
      }
      // Values: per KV head, its query vectors (every query token, every head of its group)
      // together, so each value row is read once for all of them.
      for (int64_t g = g0; g < g1; ++g) {
        weights.clear();
        outs.clear();
        for (const int64_t a : head_vectors[g - g0]) {
          weights.push_back(scores.data() + a * span);
          outs.push_back(acc.data() + a * dim);
        }
        weighted_sum(static_cast<int64_t>(weights.size()), weights.data(), v_rows.data(),
                     (g - g0) * dim, 0, span, dim, outs.data());
      }
      for (int64_t a = 0; a < nq; ++a) {  // one rounding per output value
        T* o = o_base + ((q0 + t0 + a / hq) * heads + h0 + a % hq) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[a * dim + d]);
      }
    }
  });
}


void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
                     const at::Tensor& query_starts, const at::Tensor& query_lens,
                     const at::Tensor& seq_lens,
                     const at::Tensor& block_table, double scale, int64_t window) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(kv_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_attention: query, cache and output of one dtype");
  switch (dtype) {
    case at::kFloat:
      return paged_attention_impl<float>(query, kv_cache, out, query_starts, query_lens,
                                         seq_lens, block_table, scale, window);
    case at::kBFloat16:
      return paged_attention_impl<c10::BFloat16>(query, kv_cache, out, query_starts,
                                                 query_lens, seq_lens, block_table, scale, window);
    case at::kHalf:
      return paged_attention_impl<c10::Half>(query, kv_cache, out, query_starts,
                                             query_lens, seq_lens, block_table, scale, window);
    default:
      TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16 tensors, not ", dtype);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglebatch, m) {
  m.def("paged_attention(Tensor query, Tensor kv_cache, Tensor(a!) out, "
        "Tensor query_starts, Tensor query_lens, Tensor seq_lens, Tensor block_table, "
        "float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(eaglebatch, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
