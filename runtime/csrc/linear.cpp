// y = x W^T + b on a copy of W packed in panels of 64 output columns: panel p is a [K, 64] block
// holding columns 64p .. 64p + 63 of W^T (zero past N), so a product streams each panel front to
// back once per 192 rows of x: at a few rows (decode, draft verification) it runs at the speed of
// reading the weights. Registered as torch.ops.eaglebatch.panel_linear.
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
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 64;   // output columns per panel
constexpr int64_t kMaxRows = 6;  // rows per register tile (6 x 4 accumulators of 16 floats)
constexpr int64_t kChunk = 192;  // rows per pass over the panels (prefill; 96 -> 192: 30
                                 // layers at 192 rows ~145 -> ~138 ms, Xeon, 2 threads)
constexpr int64_t kAhead = 8;    // panel rows prefetched ahead (one 256-byte row per input)
constexpr int64_t kFarBytes = 16384;  // and bytes fetched into L2 ahead (see tile)

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

// Rows x 64 outputs of one panel, written to y[0 .. Rows-1][0 .. cols-1]. `next`: a panel of k
// rows to fetch into L2 meanwhile (the next one this thread multiplies), or nullptr.
//
// Fetching ahead: a panel's tiles (7+ rows) bring the thread's next panel into L2 while they
// compute, each a share of its rows (see run_panels), so its tiles then read it from L2, bound by
// arithmetic, while memory streams the panel after it (16 rows: 31.7 -> 24.0 ms for the 30
// layers of the default model on 2 cores). A single tile (1-6 rows) streams its own panel from
// memory and also fetches kFarBytes ahead into L2, besides the near prefetch: without it a
// 5-row product took ~30% longer than a 4-row one (AMD EPYC), and on a Xeon 3 / 4 rows took
// 1.0 / 2.2 ms longer than 1 row for the 30 layers (20.4 / 21.6 ms against 19.4; with it 19.5 /
// 19.5, 1 row unchanged: what verifying 2-3 drafts at batch 1 costs). Of a several-tile pass
// only the first tile does (the panel is in L2 for the others: the far fetches only took load
// slots from the products: 30 layers at 48 / 64 rows 47.0 / 57.9 -> 44.1 / 54.8 ms, Xeon, 2
// threads).
template <int Rows, typename W>
void tile(const float* x, int64_t k, const W* panel, const float* scale, const float* bias,
          float* y, int64_t ldy, int64_t cols, const W* next, int64_t phase, int64_t every) {
  alignas(64) float out[Rows][kPanel];
#ifdef __AVX512F__
  constexpr int64_t lines = (sizeof(W) * kPanel + 63) / 64;  // cache lines per panel row
  constexpr int64_t ahead = kAhead * 4 / lines;        // the same bytes ahead for either type
  constexpr int64_t far = kFarBytes / (64 * lines);    // panel rows in kFarBytes
  int64_t countdown = phase + 1;  // fetches rows phase, phase + every, ... of `next`
  const bool fetch_far = every == 1 || phase == 0;  // a single tile, or a pass's first
  __m512 acc[Rows][4];
  for (int m = 0; m < Rows; ++m)
    for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; ++c) {
    const W* w = panel + c * kPanel;
    for (int64_t line = 0; line < lines; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(w + ahead * kPanel) + 64 * line, _MM_HINT_T0);
    if (fetch_far)
      for (int64_t line = 0; line < lines; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(w + far * kPanel) + 64 * line, _MM_HINT_T1);
    if (next != nullptr && --countdown == 0) {
      countdown = every;
      for (int64_t line = 0; line < lines; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(next + c * kPanel) + 64 * line, _MM_HINT_T1);
    }
    const __m512 w0 = load16(w), w1 = load16(w + 16);
    const __m512 w2 = load16(w + 32), w3 = load16(w + 48);
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      const __m512 b = _mm512_set1_ps(x[m * k + c]);
      acc[m][0] = _mm512_fmadd_ps(b, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(b, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(b, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(b, w3, acc[m][3]);
    }
  }
  for (int m = 0; m < Rows; ++m)
    for (int i = 0; i < 4; ++i) _mm512_store_ps(out[m] + 16 * i, acc[m][i]);
#else
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
  for (int m = 0; m < Rows; ++m) {
    if (scale != nullptr)
      for (int64_t j = 0; j < cols; ++j) out[m][j] *= scale[j];
    if (bias != nullptr)
      for (int64_t j = 0; j < cols; ++j) out[m][j] += bias[j];
    std::memcpy(y + m * ldy, out[m], cols * sizeof(float));
  }
}

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
        for (int64_t m = first; m < last; m += kMaxRows) {
          const float* xm = xp + m * k;
          const int64_t ld = to.stride[p];
          float* ym = to.row0[p] + m * ld;
          const int64_t t = (m - first) / kMaxRows;
          switch (std::min(kMaxRows, last - m)) {
            case 6: tile<6>(xm, k, panel, sp, bp, ym, ld, cols, next, t, count); break;
            case 5: tile<5>(xm, k, panel, sp, bp, ym, ld, cols, next, t, count); break;
            case 4: tile<4>(xm, k, panel, sp, bp, ym, ld, cols, next, t, count); break;
            case 3: tile<3>(xm, k, panel, sp, bp, ym, ld, cols, next, t, count); break;
            case 2: tile<2>(xm, k, panel, sp, bp, ym, ld, cols, next, t, count); break;
            default: tile<1>(xm, k, panel, sp, bp, ym, ld, cols, next, t, count); break;
          }
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
              panels.dim() == 3 && panels.size(1) == k && panels.size(2) == kPanel &&
              num_panels * kPanel >= n && (num_panels - 1) * kPanel < n,
              "panel_linear: panels must be [ceil(n / 64), in_features, 64] float32, bfloat16 "
              "or int8");
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
                        const at::Tensor& panels,   // [ceil(N / 64), K, 64] float32, bf16 or int8
                        const c10::optional<at::Tensor>& bias,  // [N] or None
                        int64_t n,
                        const c10::optional<at::Tensor>& scales) {  // [panels * 64]: int8 only
  const float* sc = check_product(x, panels, n, scales);
  const float* b = bias_data(bias, n, "panel_linear");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  run_any(x, panels, sc, b, n, plain_destinations(y.data_ptr<float>(), n, panels.size(0)));
  return y;
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
  const int64_t rows = x.size(0);
  std::vector<at::Tensor> out;
  Destinations to{std::vector<float*>(panels.size(0)), std::vector<int64_t>(panels.size(0))};
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
    const W* w = wp + (col / kPanel) * k * kPanel + col % kPanel;
    float acc = 0.f;
    for (int64_t c = 0; c < k; ++c) acc = std::fma(x[c], widen(w[c * kPanel]), acc);
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
  TORCH_CHECK(panels.is_contiguous() && panels.dim() == 3 && panels.size(1) == k &&
              panels.size(2) == kPanel && panels.size(0) * kPanel >= n &&
              (panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16),
              "panel_entries: panels must be [ceil(n / 64), in_features, 64] float32 or bfloat16");
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglebatch, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int n, Tensor? scales=None) "
        "-> Tensor");
  m.def("panel_linear_parts(Tensor x, Tensor panels, Tensor? bias, int[] parts, "
        "Tensor? scales=None) -> Tensor[]");
  m.def("panel_entries(Tensor x, Tensor panels, Tensor? bias, int n, Tensor row_ids, "
        "Tensor col_ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(eaglebatch, CPU, m) {
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_linear_parts", &panel_linear_parts);
  m.impl("panel_entries", &panel_entries);
}
