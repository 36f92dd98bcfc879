// y = x W^T + b on a copy of W packed in panels of 64 output columns: panel p holds columns
// 64p .. 64p + 63 of W^T (zero past N) for k = 0 .. K-1, in strips of kStrip columns (below), so a
// product streams each panel front to back once per 192 rows of x: at a few rows (decode, draft
// verification) it runs at the speed of reading the weights. Registered as
// torch.ops.eaglebatch.panel_linear.
//
// Each output y[m, n] is one chain of fused multiply-adds over k = 0 .. K-1 in order, then + b[n],
// whatever the number of rows and wherever row m falls in its tile: a row's result does not depend
// on the other rows in the product (a single-token step and a k-draft verification compute the
// same values for the same hidden state). FMA rounds once, so the AVX-512 and the portable code
// give the same bits.
//
// Panels may also be bfloat16 (weights that are exactly bfloat16 values, e.g. a drafter stored in
// bfloat16): each weight is widened to float32 on load, so the products are the same bits as with
// float32 panels, reading half the bytes (a product at a few rows runs at the speed of memory).
//
// Or int8 with one float32 scale per output column (a drafter quantized on load, where only the
// speed of drafting depends on the weights: verification keeps outputs exact): y[m, n] is the same
// FMA chain over the int8 values widened to float32, times scale[n], then + b[n]. A quarter of the
// bytes of float32 panels; the AVX-512 and portable code still give the same bits.

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// Whether this CPU is Intel's: the kernels that stream weights fetch further ahead there (see
// kFarRows here and kFetchAhead in head_int8.cpp). Shared by the sources of the library.
bool eaglebatch_cpu_is_intel() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
#else
  return false;
#endif
}

namespace {

constexpr int64_t kPanel = 64;   // output columns per panel
constexpr int64_t kMaxRows = 6;  // rows per register tile (6 x 4 accumulators of 16 floats)
constexpr int64_t kChunk = 192;  // rows per pass over the panels (prefill; 96 -> 192: 30
                                 // layers at 192 rows ~145 -> ~138 ms, Xeon, 2 threads)
constexpr int64_t kFarBytes = 16384;  // bytes fetched into L2 ahead (see tile)

// A single tile of kFarRows or more rows fetches kFarBytes ahead (see tile): every one on
// Intel's cores, 5 rows or more on others (AMD's). Read once, when the library loads.
const int kFarRows = eaglebatch_cpu_is_intel() ? 1 : 5;

// On Intel's cores a tile that fetches kFarBytes ahead into L2 also fetches kNearBytes ahead into
// L1 (30 layers of the default model's float32 products, 2 threads, huge pages, interleaved in
// one process, medians of 15 rounds: 1 / 3 / 4 / 7 / 16 rows 13.25 / 13.79 / 14.42 / 15.06 /
// 16.90 -> 12.92 / 13.19 / 13.10 / 14.39 / 16.40 ms; 6 KB or 8 KB ahead within 1% of 4 KB, 16
// KB slower than none; int8 panels at 1 row 2.38 -> 2.27-2.33 ms, at 2-16 rows the same): a
// single tile of 2-6 rows now costs what one row does (before, each row added ~0.3 ms to the 30
// layers). AMD's cores lost with a near fetch (see tile()). Read once, when the library loads.
constexpr int64_t kNearBytes = 4096;
const bool kFetchNear = eaglebatch_cpu_is_intel();

// A panel is stored as strips of kStrip columns, one after the other: strip s holds columns
// 64p + kStrip s .. 64p + kStrip (s + 1) - 1 for k = 0 .. K-1 ([K, kStrip]), so the panels
// tensor is [ceil(N / 64), 64 / kStrip, K, kStrip] (runtime.weight_panels.pack_panels asks
// panel_strip()). With AVX-512 and in the portable code one strip is the whole panel; with AVX2 a
// strip is one register's 8 columns (see tile_avx2).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kStrip = 8;
#else
constexpr int64_t kStrip = kPanel;
#endif
constexpr int64_t kStrips = kPanel / kStrip;

using bf16_bits = uint16_t;  // a bfloat16 value: the high 16 bits of a float32

inline float widen(float w) { return w; }
inline float widen(int8_t w) { return static_cast<float>(w); }
inline float widen(bf16_bits w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef __AVX512F__
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const bf16_bits* w) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const int8_t* w) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const bf16_bits* w) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline __m256 load8(const int8_t* w) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// AVX2 has 16 vector registers of 8 floats, and the panels come in strips of 8 columns (kStrip):
// a pass over S strips keeps S accumulators a row and reads S streams of weights at once. A
// single tile runs whole-panel passes over as many strips as its accumulators fit (1 row: all 8;
// 2-3 rows: 4 + 4; 4 rows: 3 + 3 + 2; 5-6 rows: 2 x 4): every weight is read once, from memory,
// by one pass, and each pass keeps S streams in flight. Each output is still one FMA chain over c
// in order: the same bits as the AVX-512 and portable code.
//
// Several streams are what make this fast: 30 layers of the default model's products (2 threads,
// AMD EPYC Zen 3 without AVX-512) took 9.5 ms at one row when a pass read one stream of whole
// 256-byte panel rows, 7.4 ms with 8 strips of 8 columns; 3 rows 12.6 -> 8.1, 4 rows 13.0 -> 9.0
// (the old layout's spans of 32 panel rows read the rest of a span from L1 after its first pass,
// and while a core computes over L1 its memory does not stream).

// One pass over panel rows c0 .. c1-1 of strips s0 .. s0 + S - 1 (columns 8 s0 .. 8 (s0 + S) - 1)
// of Rows rows, continuing the sums in out. With Next, it also fetches rows phase, phase + every,
// ... (countdown) of the panel `next` into L2, as a panel row's worth of its bytes each. Unrolled
// by 2 (a 6-row tile on a panel in L2: 31.6 -> 29.3 cycles a panel row; 30 layers at 64 rows
// 97.5-99.0 -> 92.6-94.0 ms).
template <int Rows, int S, bool Next, typename W>
inline __attribute__((always_inline)) void strip_pass(
    const float* x, int64_t k, const W* panel, float (&out)[Rows][kPanel], int64_t s0,
    int64_t c0, int64_t c1, const W* next, int64_t& countdown, int64_t every) {
  constexpr int64_t lines = (sizeof(W) * kPanel + 63) / 64;  // cache lines a panel row's worth
  const W* base = panel + s0 * k * kStrip;
  const int64_t gap = k * kStrip;  // from one strip to the next
  __m256 acc[Rows][S];
  for (int m = 0; m < Rows; ++m)
    for (int i = 0; i < S; ++i) acc[m][i] = _mm256_loadu_ps(out[m] + kStrip * (s0 + i));
#pragma GCC unroll 2
  for (int64_t c = c0; c < c1; ++c) {
    if constexpr (Next) {
      if (next != nullptr && --countdown == 0) {
        countdown = every;
        for (int64_t line = 0; line < lines; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(next + c * kPanel) + 64 * line,
                       _MM_HINT_T1);
      }
    }
    const W* w = base + c * kStrip;
    if constexpr (Rows * S + S + 1 <= 16) {  // the strips' weights, then a row at a time
      __m256 wv[S];
      for (int i = 0; i < S; ++i) wv[i] = load8(w + i * gap);
#pragma GCC unroll 8
      for (int m = 0; m < Rows; ++m) {
        const __m256 b = _mm256_set1_ps(x[m * k + c]);
        for (int i = 0; i < S; ++i) acc[m][i] = _mm256_fmadd_ps(b, wv[i], acc[m][i]);
      }
    } else {  // the rows' broadcasts, then a strip's weights at a time
      __m256 b[Rows];
      for (int m = 0; m < Rows; ++m) b[m] = _mm256_set1_ps(x[m * k + c]);
#pragma GCC unroll 8
      for (int i = 0; i < S; ++i) {
        const __m256 wv = load8(w + i * gap);
        for (int m = 0; m < Rows; ++m) acc[m][i] = _mm256_fmadd_ps(b[m], wv, acc[m][i]);
      }
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (int i = 0; i < S; ++i) _mm256_storeu_ps(out[m] + kStrip * (s0 + i), acc[m][i]);
}

template <int Rows, typename W>
void tile_avx2(const float* x, int64_t k, const W* panel, float (&out)[Rows][kPanel],
               const W* next, int64_t phase, int64_t every) {
  constexpr int S = Rows == 1 ? 8 : (Rows <= 3 ? 4 : (Rows == 4 ? 3 : 2));  // strips a pass
  constexpr int kRest = kStrips % S;  // strips of the last pass, when S does not divide 8
  int64_t countdown = phase + 1;  // the first pass fetches rows phase, phase + every, ... of next
  for (int m = 0; m < Rows; ++m) std::fill(out[m], out[m] + kPanel, 0.f);
  strip_pass<Rows, S, true>(x, k, panel, out, 0, 0, k, next, countdown, every);
  for (int64_t s0 = S; s0 + S <= kStrips; s0 += S)
    strip_pass<Rows, S, false>(x, k, panel, out, s0, 0, k, next, countdown, every);
  if constexpr (kRest != 0)
    strip_pass<Rows, kRest, false>(x, k, panel, out, kStrips - kRest, 0, k, next, countdown,
                                   every);
}
#endif

// A tile's float32 sums out[m] (m < Rows), times scale[j] and + bias[j] where given, stored to
// y[m][0 .. cols-1] (row stride ldy).
template <int Rows>
void store_tile(float (&out)[Rows][kPanel], const float* scale, const float* bias, float* y,
                int64_t ldy, int64_t cols) {
  for (int m = 0; m < Rows; ++m) {
    if (scale != nullptr)
      for (int64_t j = 0; j < cols; ++j) out[m][j] *= scale[j];
    if (bias != nullptr)
      for (int64_t j = 0; j < cols; ++j) out[m][j] += bias[j];
    std::memcpy(y + m * ldy, out[m], cols * sizeof(float));
  }
}

// Calls f(std::integral_constant<int, R>{}) for R = rows (1 .. kMaxRows): a tile function's
// template argument from a run-time row count.
template <typename F>
void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// The sums of `count` tiles of a panel (tile t: rows 6t .. of `rows`, sums[t]) to y, as
// store_tile does for one.
inline void store_tiles(float (*sums)[kMaxRows][kPanel], int64_t count, int64_t rows,
                        const float* scale, const float* bias, float* y, int64_t ldy,
                        int64_t cols) {
  for (int64_t t = 0; t < count; ++t) {
    const int64_t m = t * kMaxRows;
    with_rows(std::min(kMaxRows, rows - m), [&](auto tile_rows) {
      constexpr int R = decltype(tile_rows)::value;
      store_tile<R>(reinterpret_cast<float (&)[R][kPanel]>(sums[t]), scale, bias, y + m * ldy,
                    ldy, cols);
    });
  }
}

#ifdef __AVX512F__
// One input c of a tile: acc[m][i] = fma(x[m][c], w_i, acc[m][i]) for its rows m and the panel
// row's four 16-column parts w_i. Every panel kernel (float32, bfloat16, int8 and 4-bit weights)
// runs this same chain, which is what makes their results the same bits.
template <int Rows>
inline __attribute__((always_inline)) void fma_rows(__m512 (&acc)[Rows][4], const float* x,
                                                    int64_t k, int64_t c, __m512 w0, __m512 w1,
                                                    __m512 w2, __m512 w3) {
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m) {
    const __m512 b = _mm512_set1_ps(x[m * k + c]);
    acc[m][0] = _mm512_fmadd_ps(b, w0, acc[m][0]);
    acc[m][1] = _mm512_fmadd_ps(b, w1, acc[m][1]);
    acc[m][2] = _mm512_fmadd_ps(b, w2, acc[m][2]);
    acc[m][3] = _mm512_fmadd_ps(b, w3, acc[m][3]);
  }
}

// The accumulators to out[m][0 .. 63].
template <int Rows>
inline void store_acc(const __m512 (&acc)[Rows][4], float (&out)[Rows][kPanel]) {
  for (int m = 0; m < Rows; ++m)
    for (int i = 0; i < 4; ++i) _mm512_store_ps(out[m] + 16 * i, acc[m][i]);
}

// A tile's chains over panel rows c0 .. c1-1 (fma_rows' chain) for the V 16-column parts that
// `panel` starts at (V = 4: the whole panel; 2: half of it), fetching meanwhile: with fetch_far,
// those parts' cache lines kFarBytes ahead in this panel into L2 (and on Intel's cores kNearBytes
// ahead into L1), and with `next`, rows of that panel into L2, one every `every` panel rows (the
// first when countdown reaches 0).
template <int Rows, int V, typename W>
inline __attribute__((always_inline)) void chain_rows(__m512 (&acc)[Rows][V], const float* x,
                                                      int64_t k, const W* panel, int64_t c0,
                                                      int64_t c1, bool fetch_far, const W* next,
                                                      int64_t& countdown, int64_t every) {
  constexpr int64_t lines = (sizeof(W) * kPanel + 63) / 64;  // cache lines per panel row
  static_assert(V == 4 || V == 2, "a whole panel row or half of it");
  constexpr int64_t own_lines = (sizeof(W) * 16 * V + 63) / 64;  // of the V parts
  constexpr int64_t far = kFarBytes / (64 * lines);    // panel rows in kFarBytes
  constexpr int64_t near = kNearBytes / (64 * lines);  // and in kNearBytes
  for (int64_t c = c0; c < c1; ++c) {
    const W* w = panel + c * kPanel;
    if (fetch_far)
      for (int64_t line = 0; line < own_lines; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(w + far * kPanel) + 64 * line, _MM_HINT_T1);
    if (fetch_far && kFetchNear)
      for (int64_t line = 0; line < own_lines; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(w + near * kPanel) + 64 * line, _MM_HINT_T0);
    if (next != nullptr && --countdown == 0) {
      countdown = every;
      for (int64_t line = 0; line < lines; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(next + c * kPanel) + 64 * line, _MM_HINT_T1);
    }
    if constexpr (V == 4) {
      fma_rows<Rows>(acc, x, k, c, load16(w), load16(w + 16), load16(w + 32), load16(w + 48));
    } else {  // the same chain over two parts
      const __m512 w0 = load16(w), w1 = load16(w + 16);
#pragma GCC unroll 8
      for (int m = 0; m < Rows; ++m) {
        const __m512 b = _mm512_set1_ps(x[m * k + c]);
        acc[m][0] = _mm512_fmadd_ps(b, w0, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(b, w1, acc[m][1]);
      }
    }
  }
}

// Columns 32h .. 32h + 31 of a single tile's panel (h = 0 or 1): tile()'s chains for those
// columns alone (the same bits), written to y[m][32h .. 32h + cols - 1]. run_panels gives the
// panel that straddles two threads to both, a half each, where a single tile's panels do not
// divide evenly among them.
template <int Rows, typename W>
void half_tile(const float* x, int64_t k, const W* panel, int64_t h, const float* scale,
               const float* bias, float* y, int64_t ldy, int64_t cols) {
  alignas(64) float out[Rows][kPanel];
  __m512 acc[Rows][2];
  for (int m = 0; m < Rows; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t from = (kPanel / 2) * h;
  int64_t countdown = 0;  // (no next panel)
  chain_rows<Rows, 2, W>(acc, x, k, panel + from, 0, k, Rows >= kFarRows, nullptr, countdown, 1);
  for (int m = 0; m < Rows; ++m) {
    _mm512_store_ps(out[m], acc[m][0]);
    _mm512_store_ps(out[m] + 16, acc[m][1]);
  }
  store_tile<Rows>(out, scale != nullptr ? scale + from : nullptr,
                   bias != nullptr ? bias + from : nullptr, y + from, ldy, cols);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same with AVX2: strips 4h .. 4h + 3 of the panel, in strip_pass passes of 4 strips at 1-3
// rows and 2 at 4-6 (where tile_avx2 takes 8 at 1 row and 3 at 4), each output one FMA chain
// over c in order, as there.
template <int Rows, typename W>
void half_tile(const float* x, int64_t k, const W* panel, int64_t h, const float* scale,
               const float* bias, float* y, int64_t ldy, int64_t cols) {
  constexpr int S = Rows <= 3 ? 4 : 2;
  alignas(32) float out[Rows][kPanel];
  for (int m = 0; m < Rows; ++m) std::fill(out[m], out[m] + kPanel / 2, 0.f);
  const int64_t from = (kPanel / 2) * h;
  const W* half = panel + (kStrips / 2) * h * k * kStrip;
  int64_t countdown = 0;  // (no next panel)
  for (int64_t s0 = 0; s0 < kStrips / 2; s0 += S)
    strip_pass<Rows, S, false, W>(x, k, half, out, s0, 0, k, nullptr, countdown, 1);
  store_tile<Rows>(out, scale != nullptr ? scale + from : nullptr,
                   bias != nullptr ? bias + from : nullptr, y + from, ldy, cols);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Several tiles on one panel (rows first .. last-1 of x, at least kBlockedTiles tiles): k-block
// by k-block, and in each, two strips (16 columns) at a time, every tile passes over the same
// weights, which stay in L1, their sums waiting in `sums` between passes. Each output is still one
// FMA chain over c in order: the same bits as tile(). Each tile's first pass of a k-block fetches
// its share of `next` into L2. Against one tile after the other (then in spans of 32 panel rows of
// whole 64-column rows), interleaved in one process on the AMD EPYC with AVX2 (2 threads, 30
// layers of the default model's products with their own weights, and its head): 64 rows 123.3 ->
// 106.7 ms; 32 rows +6%; 192 rows +18%. The k-block's length barely matters (64 to 576 rows
// within 2%). With 2-3 tiles, one tile after the other (tile_avx2) stays faster: in strips, 8 /
// 12 / 16 rows took 22.9 / 27.0 / 34.9 ms that way and 24.8 / 28.5 / 35.6 k-blocked, hence
// kBlockedTiles.
constexpr int64_t kBlockK = 128;  // panel rows a k-block: 8 KB of 16 columns
constexpr int64_t kMaxTiles = kChunk / kMaxRows;
constexpr int64_t kBlockedTiles = 4;
template <typename W>
void tiles_avx2(const float* xp, int64_t k, const W* panel, const float* scale,
                const float* bias, float* y, int64_t ldy, int64_t cols, int64_t first,
                int64_t last, const W* next) {
  alignas(64) static thread_local float sums[kMaxTiles][kMaxRows][kPanel];
  const int64_t count = (last - first + kMaxRows - 1) / kMaxRows;
  for (int64_t t = 0; t < count; ++t)
    for (int m = 0; m < kMaxRows; ++m) std::fill(sums[t][m], sums[t][m] + kPanel, 0.f);
  for (int64_t c0 = 0; c0 < k; c0 += kBlockK) {
    const int64_t c1 = std::min(k, c0 + kBlockK);
    for (int64_t j0 = 0; j0 < kPanel; j0 += 16) {
      for (int64_t t = 0; t < count; ++t) {
        const int64_t m = first + t * kMaxRows;
        const float* xm = xp + m * k;
        int64_t countdown = t + 1;
        with_rows(std::min(kMaxRows, last - m), [&](auto rows) {
          constexpr int R = decltype(rows)::value;
          auto& out = reinterpret_cast<float (&)[R][kPanel]>(sums[t]);
          if (j0 == 0)
            strip_pass<R, 2, true>(xm, k, panel, out, j0 / kStrip, c0, c1, next, countdown,
                                   count);
          else
            strip_pass<R, 2, false>(xm, k, panel, out, j0 / kStrip, c0, c1, next, countdown,
                                    count);
        });
      }
    }
  }
  store_tiles(sums, count, last - first, scale, bias, y, ldy, cols);
}
#endif

// Rows x 64 outputs of one panel, written to y[0 .. Rows-1][0 .. cols-1]. `next`: a panel of k
// rows to fetch into L2 meanwhile (the next one this thread multiplies), or nullptr.
//
// Fetching ahead: a panel's tiles (7+ rows) bring the thread's next panel into L2 while they
// compute, each a share of its rows (see run_panels), so its tiles then read it from L2, bound by
// arithmetic, while memory streams the panel after it (16 rows: 31.7 -> 24.0 ms for the 30
// layers of the default model on 2 cores). With AVX-512, the first tile of such a pass, and a
// single tile of kFarRows or more rows, also fetch kFarBytes ahead into L2 (without it a 5-row
// product took ~30% longer than a 4-row one, AMD EPYC). On AMD's cores a single tile of 1-4 rows
// fetches nothing: the hardware prefetchers stream its panel, and with the weights in huge pages
// (runtime/huge_pages.py) its own fetches only cost: dropping them (and a near fetch 8 rows ahead
// into L1 that every tile made) gave, in one process alternating both kernels, batch 1 plain
// +5-11% and drafted +11-15% tokens/s (8 prompts, 3 runs; with 4 KiB pages +0.5-7% and +1.5-7%),
// the same at 5-48 rows. Intel's cores need the far fetch, huge pages or not: 30 layers'
// products (2 threads, Xeon with AMX, huge pages, interleaved) at 2 / 3 / 4 rows took 15.3 /
// 17.2 / 19.6 ms without it, 14.0 / 14.3 / 14.8 with it (1 row 13.5 either way; 8 or 32 KB
// ahead instead of 16 within 1%); on int8 panels 1 row 3.29 -> 2.84 ms. Of a several-tile pass
// only the first tile fetches ahead (the panel is in L2 for the others: the far fetches only took
// load slots from the products: 30 layers at 48 / 64 rows 47.0 / 57.9 -> 44.1 / 54.8 ms, Xeon, 2
// threads).
template <int Rows, typename W>
void tile(const float* x, int64_t k, const W* panel, const float* scale, const float* bias,
          float* y, int64_t ldy, int64_t cols, const W* next, int64_t phase, int64_t every) {
  alignas(64) float out[Rows][kPanel];
#ifdef __AVX512F__
  static_assert(kStrip == kPanel, "the AVX-512 tile reads whole panel rows");
  int64_t countdown = phase + 1;  // fetches rows phase, phase + every, ... of `next`
  // a single tile of kFarRows+ rows, or a pass's first (always a full one)
  const bool fetch_far = Rows >= kFarRows && (every == 1 || phase == 0);
  __m512 acc[Rows][4];
  for (int m = 0; m < Rows; ++m)
    for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_ps();
  chain_rows<Rows, 4, W>(acc, x, k, panel, 0, k, fetch_far, next, countdown, every);
  store_acc<Rows>(acc, out);
#elif defined(__AVX2__) && defined(__FMA__)
  tile_avx2<Rows>(x, k, panel, out, next, phase, every);
#else
  static_assert(kStrip == kPanel, "the portable tile reads whole panel rows");
  (void)next, (void)phase, (void)every;
  for (int m = 0; m < Rows; ++m) std::fill(out[m], out[m] + kPanel, 0.f);
  for (int64_t c = 0; c < k; ++c) {
    const W* w = panel + c * kPanel;
    for (int m = 0; m < Rows; ++m) {
      const float b = x[m * k + c];
      for (int64_t j = 0; j < kPanel; ++j) out[m][j] = std::fma(b, widen(w[j]), out[m][j]);
    }
  }
#endif
  store_tile<Rows>(out, scale, bias, y, ldy, cols);
}

#ifdef __AVX512F__
// Two to kMaxBlockedTiles512 tiles of float32 panels on one panel (rows first .. last-1 of x),
// k-block by k-block: in each, every tile passes over the same kBlockK512 panel rows, which stay
// in L1, its sums waiting in `sums` between blocks. Each output is still one FMA chain over c in
// order: the same bits as tile(). As in tile(), the first tile fetches kFarBytes ahead (a 6-row
// one, or any on Intel's cores), and tile t fetches rows t, t + count, ... of `next` into L2.
// Against one whole-panel tile after the other, interleaved in one process (2 threads, Xeon with
// AMX, 30 layers of the default model's products, random weights, medians of 7 rounds; ms):
//
//   rows          7      13     16     32     48     64     192
//   one by one    14.05  15.13  16.85  24.82  29.20  35.83  93.80
//   k-blocked     13.67  13.90  15.85  22.38  28.64  (35.50  93.60: one by one, above 8 tiles)
//
// Past 8 tiles it lost (64 / 192 rows +3% / +9% in the same kind of run), and on int8 panels,
// bound by widening the weights rather than by reading them, it gained nothing (16 / 32 / 48
// rows +1-3%). In the engine, batch 16 over 64 prompts (the target's forward at 13.3 rows a step
// without drafts, 31.6 with k = 2, two runs of each, alternating): 19.6-20.2 -> 19.1-19.2 ms and
// 32.1-32.9 -> 30.7-31.1 ms. A k-block of 128 panel rows (32 KB) instead of 64 was within noise.
constexpr int64_t kBlockK512 = 64;  // panel rows a k-block: 16 KB of float32 weights
constexpr int64_t kMaxBlockedTiles512 = 8;

// Tile t (Rows rows of x) over panel rows c0 .. c1-1, continuing its sums in out.
template <int Rows>
inline __attribute__((always_inline)) void block_pass(
    const float* x, int64_t k, const float* panel, float (&out)[Rows][kPanel], int64_t c0,
    int64_t c1, bool fetch_far, const float* next, int64_t t, int64_t count) {
  __m512 acc[Rows][4];
  for (int m = 0; m < Rows; ++m)
    for (int i = 0; i < 4; ++i)
      acc[m][i] = c0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(out[m] + 16 * i);
  // the first c >= c0 with c = t (mod count): this tile's rows of `next`
  int64_t countdown = (t - c0 % count + count) % count + 1;
  chain_rows<Rows, 4, float>(acc, x, k, panel, c0, c1, fetch_far, next, countdown, count);
  store_acc<Rows>(acc, out);
}

void tiles_avx512(const float* xp, int64_t k, const float* panel, const float* scale,
                  const float* bias, float* y, int64_t ldy, int64_t cols, int64_t first,
                  int64_t last, const float* next) {
  alignas(64) static thread_local float sums[kMaxBlockedTiles512][kMaxRows][kPanel];
  const int64_t count = (last - first + kMaxRows - 1) / kMaxRows;
  for (int64_t c0 = 0; c0 < k; c0 += kBlockK512) {
    const int64_t c1 = std::min(k, c0 + kBlockK512);
    for (int64_t t = 0; t < count; ++t) {
      const int64_t m = first + t * kMaxRows;
      with_rows(std::min(kMaxRows, last - m), [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        block_pass<R>(xp + m * k, k, panel, reinterpret_cast<float (&)[R][kPanel]>(sums[t]), c0,
                      c1, t == 0 && R >= kFarRows, next, t, count);
      });
    }
  }
  store_tiles(sums, count, last - first, scale, bias, y, ldy, cols);
}
#endif

// Where each panel's row 0 goes and its row stride: column 64p of a plain [rows, n] output, or,
// with parts, the panel's first column within its part's own [rows, width] output.
struct Destinations {
  std::vector<float*> row0;
  std::vector<int64_t> stride;
};

Destinations plain_destinations(float* y, int64_t n, int64_t num_panels) {
  Destinations d{std::vector<float*>(num_panels), std::vector<int64_t>(num_panels, n)};
  for (int64_t p = 0; p < num_panels; ++p) d.row0[p] = y + p * kPanel;
  return d;
}

template <typename W>
void run_panels(const float* xp, const W* wp, const float* sc, const float* b, int64_t rows,
                int64_t k, int64_t n, int64_t num_panels, const Destinations& to) {
  const int64_t threads = at::get_num_threads();
  for (int64_t m0 = 0; m0 < rows; m0 += kChunk) {
    const int64_t m1 = std::min(rows, m0 + kChunk);
    const int64_t tiles = (m1 - m0 + kMaxRows - 1) / kMaxRows;
    // Work items are (panel, group of row tiles). When the panels do not divide evenly among the
    // threads (9 panels of a 576-wide product on 2 threads), each panel's tiles are split among
    // them too, so no thread idles while another finishes its extra panel; one thread's items
    // are contiguous, so only a panel that straddles two threads is read twice. At a single tile
    // the panels are not split (there, reading the weights is the cost).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    // A single tile (decode, a few drafts' verification) whose panels do not divide evenly among
    // the threads (9 panels on 2): work items are half panels, so the panel that straddles two
    // threads is read half by each instead of whole by one, while the other waits. 60 products
    // of K = 1536 at 1 row, 2 threads, huge pages: 512 / 576 / 640 outputs (8 / 9 / 10 panels)
    // took 4.92 / 5.48 / 5.16 ms (9 panels slower than 10), with halves 5.12 / 5.30 / 5.42. The
    // default model's o_proj and down_proj have 9 panels, its fused q/k/v 15. Batch-1 steps
    // (`benchmarks/step_breakdown.py --num-prompts 8 --k 2`, alternating with the previous
    // library, Xeon): plain 12.07 / 11.67 -> 11.04 / 11.22 ms, drafted 14.25 / 13.84 -> 13.09 /
    // 13.22 ms. The AVX2 build (-march=haswell on that Xeon, alternating with the previous
    // library): the 60 products 7.49-7.58 -> 6.61-6.82 ms at 1 row, 9.66-10.29 -> 7.84-8.63 at
    // 4; 30 layers of the default model at 1 / 3 rows 10.13-10.86 / 12.15-12.97 -> 9.95-10.33 /
    // 11.72-12.14 ms. (Not measured on AMD's CPUs.)
    if (tiles == 1 && threads > 1 && num_panels % threads != 0) {
      const W* none = nullptr;  // no next panel to fetch
      at::parallel_for(0, 2 * num_panels, 1, [&](int64_t h0, int64_t h1) {
        for (int64_t p = h0 / 2; 2 * p < h1; ++p) {
          const int64_t lo = std::max(h0, 2 * p), hi = std::min(h1, 2 * p + 2);
          const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
          const W* panel = wp + p * k * kPanel;
          const float* bp = b != nullptr ? b + col : nullptr;
          const float* sp = sc != nullptr ? sc + col : nullptr;
          const int64_t ld = to.stride[p];
          float* ym = to.row0[p] + m0 * ld;
          const int64_t h = lo - 2 * p, half_cols = std::min(kPanel / 2, cols - kPanel / 2 * h);
          with_rows(m1 - m0, [&](auto rows) {
            constexpr int R = decltype(rows)::value;
            if (hi - lo == 2)
              tile<R>(xp + m0 * k, k, panel, sp, bp, ym, ld, cols, none, 0, 1);
            else if (half_cols > 0)
              half_tile<R>(xp + m0 * k, k, panel, h, sp, bp, ym, ld, half_cols);
          });
        }
      });
      continue;
    }
#endif
    const int64_t groups =
        threads > 1 && num_panels % threads != 0 ? std::min(threads, tiles) : 1;
    at::parallel_for(0, num_panels * groups, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t p = i / groups, g = i % groups;
        const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
        const W* panel = wp + p * k * kPanel;
        const float* bp = b != nullptr ? b + col : nullptr;
        const float* sp = sc != nullptr ? sc + col : nullptr;
        const int64_t first = m0 + kMaxRows * (tiles * g / groups);
        const int64_t last = std::min(m1, m0 + kMaxRows * (tiles * (g + 1) / groups));
        // With several tiles, they fetch this thread's next panel into L2 meanwhile, each a
        // share of its rows (tile t: rows t, t + count, ...), so memory streams while they
        // compute. A single tile streams its own panel from memory and fetches nothing else.
        const int64_t count = (last - first + kMaxRows - 1) / kMaxRows;
        const W* next =
            count > 1 && i + 1 < i1 && (i + 1) / groups != p ? panel + k * kPanel : nullptr;
#ifdef __AVX512F__
        if constexpr (std::is_same_v<W, float>) {
          if (count >= 2 && count <= kMaxBlockedTiles512) {
            tiles_avx512(xp, k, panel, sp, bp, to.row0[p] + first * to.stride[p], to.stride[p],
                         cols, first, last, next);
            continue;
          }
        }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        if (count >= kBlockedTiles) {
          tiles_avx2(xp, k, panel, sp, bp, to.row0[p] + first * to.stride[p], to.stride[p],
                     cols, first, last, next);
          continue;
        }
#endif
        for (int64_t m = first; m < last; m += kMaxRows) {
          const float* xm = xp + m * k;
          const int64_t ld = to.stride[p];
          float* ym = to.row0[p] + m * ld;
          const int64_t t = (m - first) / kMaxRows;
          with_rows(std::min(kMaxRows, last - m), [&](auto rows) {
            tile<decltype(rows)::value>(xm, k, panel, sp, bp, ym, ld, cols, next, t, count);
          });
        }
      }
    });
  }
}

// The bias's data ([n] float32, checked), or nullptr without one.
const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == n,
              op, ": bias must be [n] float32");
  return bias->data_ptr<float>();
}

// The panels' pointer cast for run_panels: float32, bfloat16 or int8 weights.
void run_any(const at::Tensor& x, const at::Tensor& panels, const float* sc, const float* b,
             int64_t n, const Destinations& to) {
  const int64_t rows = x.size(0), k = x.size(1), num_panels = panels.size(0);
  const float* xp = x.data_ptr<float>();
  if (panels.scalar_type() == at::kBFloat16)
    run_panels(xp, reinterpret_cast<const bf16_bits*>(panels.data_ptr()), sc, b, rows, k, n,
               num_panels, to);
  else if (panels.scalar_type() == at::kChar)
    run_panels(xp, panels.data_ptr<int8_t>(), sc, b, rows, k, n, num_panels, to);
  else
    run_panels(xp, panels.data_ptr<float>(), sc, b, rows, k, n, num_panels, to);
}

// Checks x, panels and scales (the scales' data, or nullptr) for a product of n columns.
const float* check_product(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                           const c10::optional<at::Tensor>& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "panel_linear: x must be a contiguous 2-d float32 tensor");
  const int64_t k = x.size(1), num_panels = panels.size(0);
  const auto type = panels.scalar_type();
  TORCH_CHECK(panels.is_contiguous() &&
              (type == at::kFloat || type == at::kBFloat16 || type == at::kChar) &&
              panels.dim() == 4 && panels.size(1) == kStrips && panels.size(2) == k &&
              panels.size(3) == kStrip && num_panels * kPanel >= n &&
              (num_panels - 1) * kPanel < n,
              "panel_linear: panels must be [ceil(n / 64), 64 / strip, in_features, strip] "
              "float32, bfloat16 or int8 (strip: panel_strip())");
  const bool scaled = scales.has_value() && scales->defined();
  TORCH_CHECK(scaled == (type == at::kChar),
              "panel_linear: int8 panels need scales, and only int8 panels take them");
  if (!scaled) return nullptr;
  TORCH_CHECK(scales->is_contiguous() && scales->scalar_type() == at::kFloat &&
              scales->numel() == num_panels * kPanel,
              "panel_linear: scales must be [panels * 64] float32");
  return scales->data_ptr<float>();
}

at::Tensor panel_linear(const at::Tensor& x,        // [rows, K] float32, contiguous
                        const at::Tensor& panels,   // [ceil(N / 64), 64 / strip, K, strip]
                        const c10::optional<at::Tensor>& bias,  // [N] or None
                        int64_t n,
                        const c10::optional<at::Tensor>& scales) {  // [panels * 64]: int8 only
  const float* sc = check_product(x, panels, n, scales);
  const float* b = bias_data(bias, n, "panel_linear");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  run_any(x, panels, sc, b, n, plain_destinations(y.data_ptr<float>(), n, panels.size(0)));
  return y;
}

// One [rows, width] output per part, appended to `out`, and where each panel's columns go in them.
Destinations part_destinations(const at::Tensor& x, at::IntArrayRef parts, int64_t num_panels,
                               std::vector<at::Tensor>& out) {
  const int64_t rows = x.size(0);
  Destinations to{std::vector<float*>(num_panels), std::vector<int64_t>(num_panels)};
  int64_t start = 0;
  for (const int64_t width : parts) {
    out.push_back(at::empty({rows, width}, x.options()));
    float* y = out.back().data_ptr<float>();
    for (int64_t col = start; col < start + width; col += kPanel) {
      to.row0[col / kPanel] = y + (col - start);
      to.stride[col / kPanel] = width;
    }
    start += width;
  }
  return to;
}

// panel_linear's product, its columns returned as separate [rows, width] tensors, one per part
// (whole panels each, but the last): q, k and v of a fused product, or gate and up, each
// contiguous at any row count. The same values as panel_linear's columns.
std::vector<at::Tensor> panel_linear_parts(const at::Tensor& x, const at::Tensor& panels,
                                           const c10::optional<at::Tensor>& bias,
                                           at::IntArrayRef parts,
                                           const c10::optional<at::Tensor>& scales) {
  int64_t n = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    TORCH_CHECK(parts[i] > 0 && (i + 1 == parts.size() || parts[i] % kPanel == 0),
                "panel_linear_parts: parts must be whole panels (multiples of 64), but the last");
    n += parts[i];
  }
  const float* sc = check_product(x, panels, n, scales);
  const float* b = bias_data(bias, n, "panel_linear_parts");
  std::vector<at::Tensor> out;
  const Destinations to = part_destinations(x, parts, panels.size(0), out);
  run_any(x, panels, sc, b, n, to);
  return out;
}

// y[r_i, c_i] for a few (row, column) pairs only, with panel_linear's arithmetic (the same FMA
// chain over k in order, then + bias; float32 or bfloat16 panels, no scales): the same bits as
// those entries of the full product. The exact greedy head (runtime.greedy_head) recomputes its
// candidates with it.
template <typename W>
void run_entries(const float* xp, const W* wp, const float* b, float* yp,
                 const int64_t* row_ids, const int64_t* col_ids, int64_t count, int64_t k) {
  for (int64_t e = 0; e < count; ++e) {
    const int64_t col = col_ids[e];
    const float* x = xp + row_ids[e] * k;
    const int64_t j = col % kPanel;  // the column in its panel
    const W* w = wp + (col / kPanel) * k * kPanel + (j / kStrip) * k * kStrip + j % kStrip;
    float acc = 0.f;
    for (int64_t c = 0; c < k; ++c) acc = std::fma(x[c], widen(w[c * kStrip]), acc);
    if (b != nullptr) acc += b[col];
    yp[e] = acc;
  }
}

at::Tensor panel_entries(const at::Tensor& x, const at::Tensor& panels,
                         const c10::optional<at::Tensor>& bias, int64_t n,
                         const at::Tensor& row_ids, const at::Tensor& col_ids) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "panel_entries: x must be a contiguous 2-d float32 tensor");
  const int64_t k = x.size(1);
  TORCH_CHECK(panels.is_contiguous() && panels.dim() == 4 && panels.size(1) == kStrips &&
              panels.size(2) == k && panels.size(3) == kStrip && panels.size(0) * kPanel >= n &&
              (panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16),
              "panel_entries: panels must be [ceil(n / 64), 64 / strip, in_features, strip] "
              "float32 or bfloat16 (strip: panel_strip())");
  TORCH_CHECK(row_ids.scalar_type() == at::kLong && col_ids.scalar_type() == at::kLong &&
              row_ids.is_contiguous() && col_ids.is_contiguous() &&
              row_ids.numel() == col_ids.numel(), "panel_entries: int64 row and column ids");
  const int64_t count = row_ids.numel();
  const int64_t* rows = row_ids.data_ptr<int64_t>();
  const int64_t* cols = col_ids.data_ptr<int64_t>();
  for (int64_t e = 0; e < count; ++e)
    TORCH_CHECK(rows[e] >= 0 && rows[e] < x.size(0) && cols[e] >= 0 && cols[e] < n,
                "panel_entries: row or column out of range");
  const float* b = bias_data(bias, n, "panel_entries");
  at::Tensor y = at::empty({count}, x.options());
  if (panels.scalar_type() == at::kBFloat16)
    run_entries(x.data_ptr<float>(), reinterpret_cast<const bf16_bits*>(panels.data_ptr()), b,
                y.data_ptr<float>(), rows, cols, count, k);
  else
    run_entries(x.data_ptr<float>(), panels.data_ptr<float>(), b, y.data_ptr<float>(), rows,
                cols, count, k);
  return y;
}


// 4-bit panels of weights that are exactly fma(d, q, m) (q in 0..15, one float32 d and m per 32
// inputs and output column: GGUF's Q4_1, dequantized to float32 on load): row c of a panel holds
// 32 bytes, byte j = q of column j | q of column j + 32 << 4, and dm[c / 32] holds d of the 64
// columns, then m. Each weight is rebuilt as fma(d, q, m), which is exactly the float32 weight
// (runtime.weight_panels.q4_panels checks every one), then enters the same FMA chain as in tile(): the
// same bits as float32 panels, reading 3/16 of their bytes (0.5 byte + 8 bytes per 32 weights).
// For products of up to kQ4MaxRows rows (two tiles: the second reads the panel from L2), where
// reading the weights is most of the cost.
constexpr int64_t kQ4MaxRows = 2 * kMaxRows;
constexpr int64_t kQ4Block = 32;         // inputs per d and m
constexpr int64_t kQ4RowBytes = kPanel / 2;  // bytes per panel row

template <int Rows>
void tile_q4(const float* x, int64_t k, const uint8_t* nib, const float* dm, const float* bias,
             float* y, int64_t ldy, int64_t cols) {
  alignas(64) float out[Rows][kPanel];
#ifdef __AVX512F__
  constexpr int64_t ahead = 16;  // panel rows (512 bytes) fetched into L1 ahead
  constexpr int64_t far = kFarBytes / kQ4RowBytes;  // and rows fetched into L2 ahead
  __m512 acc[Rows][4];
  for (int m = 0; m < Rows; ++m)
    for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi32(0xF);
  for (int64_t b = 0; b < k / kQ4Block; ++b) {
    const float* d = dm + b * 2 * kPanel;
    const __m512 d0 = _mm512_loadu_ps(d), d1 = _mm512_loadu_ps(d + 16);
    const __m512 d2 = _mm512_loadu_ps(d + 32), d3 = _mm512_loadu_ps(d + 48);
    const __m512 m0 = _mm512_loadu_ps(d + 64), m1 = _mm512_loadu_ps(d + 80);
    const __m512 m2 = _mm512_loadu_ps(d + 96), m3 = _mm512_loadu_ps(d + 112);
    for (int64_t line = 0; line < 8; ++line)  // the d and m of the block after next
      _mm_prefetch(reinterpret_cast<const char*>(d + 4 * kPanel + 16 * line), _MM_HINT_T1);
    for (int64_t c = b * kQ4Block; c < (b + 1) * kQ4Block; ++c) {
      const uint8_t* row = nib + c * kQ4RowBytes;
      if ((c & 1) == 0) {  // one 64-byte line holds two rows
        _mm_prefetch(reinterpret_cast<const char*>(row + ahead * kQ4RowBytes), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(row + far * kQ4RowBytes), _MM_HINT_T1);
      }
      const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
      const __m512i hi =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16)));
      const __m512 w0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_and_si512(lo, nibble)), m0);
      const __m512 w1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_and_si512(hi, nibble)), m1);
      const __m512 w2 = _mm512_fmadd_ps(d2, _mm512_cvtepi32_ps(_mm512_srli_epi32(lo, 4)), m2);
      const __m512 w3 = _mm512_fmadd_ps(d3, _mm512_cvtepi32_ps(_mm512_srli_epi32(hi, 4)), m3);
      fma_rows<Rows>(acc, x, k, c, w0, w1, w2, w3);
    }
  }
  store_acc<Rows>(acc, out);
#else
  for (int m = 0; m < Rows; ++m) std::fill(out[m], out[m] + kPanel, 0.f);
  for (int64_t c = 0; c < k; ++c) {
    const uint8_t* row = nib + c * kQ4RowBytes;
    const float* d = dm + (c / kQ4Block) * 2 * kPanel;
    for (int64_t j = 0; j < kPanel; ++j) {
      const int q = j < kPanel / 2 ? row[j] & 0xF : row[j - kPanel / 2] >> 4;
      const float w = std::fma(d[j], static_cast<float>(q), d[kPanel + j]);
      for (int m = 0; m < Rows; ++m) out[m][j] = std::fma(x[m * k + c], w, out[m][j]);
    }
  }
#endif
  store_tile<Rows>(out, nullptr, bias, y, ldy, cols);
}

// Checks a 4-bit product of n columns: x [rows <= kQ4MaxRows, K], nibbles [panels, K, 32] uint8,
// dm [panels, K / 32, 2, 64] float32.
void check_q4(const at::Tensor& x, const at::Tensor& nib, const at::Tensor& dm, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
              x.size(0) >= 1 && x.size(0) <= kQ4MaxRows,
              "panel_linear_q4: x must be a contiguous [1..12, K] float32 tensor");
  const int64_t k = x.size(1), num_panels = nib.size(0);
  TORCH_CHECK(k % kQ4Block == 0 && nib.is_contiguous() && nib.scalar_type() == at::kByte &&
              nib.dim() == 3 && nib.size(1) == k && nib.size(2) == kQ4RowBytes &&
              num_panels * kPanel >= n && (num_panels - 1) * kPanel < n,
              "panel_linear_q4: nibbles must be [ceil(n / 64), K, 32] uint8, K a multiple of 32");
  TORCH_CHECK(dm.is_contiguous() && dm.scalar_type() == at::kFloat && dm.dim() == 4 &&
              dm.size(0) == num_panels && dm.size(1) == k / kQ4Block && dm.size(2) == 2 &&
              dm.size(3) == kPanel, "panel_linear_q4: dm must be [panels, K / 32, 2, 64] float32");
}

void run_q4(const at::Tensor& x, const at::Tensor& nib, const at::Tensor& dm, const float* b,
            int64_t n, const Destinations& to) {
  const int64_t rows = x.size(0), k = x.size(1), num_panels = nib.size(0);
  const float* xp = x.data_ptr<float>();
  const uint8_t* np = nib.data_ptr<uint8_t>();
  const float* dp = dm.data_ptr<float>();
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
      const uint8_t* panel = np + p * k * kQ4RowBytes;
      const float* pdm = dp + p * (k / kQ4Block) * 2 * kPanel;
      const float* bp = b != nullptr ? b + col : nullptr;
      const int64_t ld = to.stride[p];
      for (int64_t m = 0; m < rows; m += kMaxRows) {
        const float* xm = xp + m * k;
        float* y = to.row0[p] + m * ld;
        with_rows(std::min(kMaxRows, rows - m), [&](auto r) {
          tile_q4<decltype(r)::value>(xm, k, panel, pdm, bp, y, ld, cols);
        });
      }
    }
  });
}

at::Tensor panel_linear_q4(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& dm,
                           const c10::optional<at::Tensor>& bias, int64_t n) {
  check_q4(x, nibbles, dm, n);
  const float* b = bias_data(bias, n, "panel_linear_q4");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  run_q4(x, nibbles, dm, b, n, plain_destinations(y.data_ptr<float>(), n, nibbles.size(0)));
  return y;
}

std::vector<at::Tensor> panel_linear_parts_q4(const at::Tensor& x, const at::Tensor& nibbles,
                                              const at::Tensor& dm,
                                              const c10::optional<at::Tensor>& bias,
                                              at::IntArrayRef parts) {
  int64_t n = 0;
  for (const int64_t width : parts) n += width;
  check_q4(x, nibbles, dm, n);
  const float* b = bias_data(bias, n, "panel_linear_parts_q4");
  std::vector<at::Tensor> out;
  const Destinations to = part_destinations(x, parts, nibbles.size(0), out);
  run_q4(x, nibbles, dm, b, n, to);
  return out;
}

// The columns of a strip in this build's panels (see kStrip).
int64_t panel_strip() { return kStrip; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglebatch, m) {
  m.def("panel_strip() -> int", &panel_strip);
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int n, Tensor? scales=None) "
        "-> Tensor");
  m.def("panel_linear_parts(Tensor x, Tensor panels, Tensor? bias, int[] parts, "
        "Tensor? scales=None) -> Tensor[]");
  m.def("panel_entries(Tensor x, Tensor panels, Tensor? bias, int n, Tensor row_ids, "
        "Tensor col_ids) -> Tensor");
  m.def("panel_linear_q4(Tensor x, Tensor nibbles, Tensor dm, Tensor? bias, int n) -> Tensor");
  m.def("panel_linear_parts_q4(Tensor x, Tensor nibbles, Tensor dm, Tensor? bias, int[] parts) "
        "-> Tensor[]");
}

TORCH_LIBRARY_IMPL(eaglebatch, CPU, m) {
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_linear_parts", &panel_linear_parts);
  m.impl("panel_entries", &panel_entries);
  m.impl("panel_linear_q4", &panel_linear_q4);
  m.impl("panel_linear_parts_q4", &panel_linear_parts_q4);
}
