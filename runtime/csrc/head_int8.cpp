// Integer products for the exact greedy head's candidates (runtime.greedy_head): each row of x
// rounded to 16-bit integers with one scale (s_x = max |x| / 32767), each output's weights int8
// with one scale (s_v), the products summed exactly in integers, a_v = float(sum_k p_k q_vk) *
// (s_x * s_v). Registered as torch.ops.eaglebatch.head_int8_dots.
//
// With AVX-512 VNNI one instruction (vpdpbusd) multiplies 64 pairs of an unsigned and a signed
// byte and adds them in groups of four to 16 int32 sums, where the float32 kernels widen every
// weight and run one FMA per weight and row: at the 3-7 rows of a draft verification the float32
// int8 product is bound by those instructions, this one by reading the bytes (2 threads, AMD
// EPYC, 49k x 576 head, caches flushed: 1 / 3 / 4 / 6 / 7 rows 0.66 / 0.95 / 1.16 / 1.60 / 2.13
// -> 0.72 / 0.77 / 0.95 / 1.20 / 1.31 ms). A row is two bytes per value, p = 256 h + l with l in
// 0..255 and h in -128..127, stored as l and h + 128; the two sums of a row (h's less 128 *
// sum_k q_vk) give sum_k p_k q_vk = 256 * hs + ls exactly. (One byte per value, with max |x| /
// 127 as the scale, was tried first: hidden states have a few large coordinates, so rounding
// moved the products so much that the default model's rows had a median of 37 candidates, up to
// 8,065, against 3 and 22 from the float32 product; with two bytes, 3 and 23.)
//
// Every sum is exact whatever the order (each at most K * 255 * 127, below 2^31 for K <= 65,536),
// and the two paths (VNNI, portable) convert and scale them alike: the same bits. Converting the
// combined sum to float32 and scaling it rounds three times: a_v is within 3 * 2^-24 of the exact
// s_x s_v sum, relative.
//
// Besides a_v the op returns, per row, an upper bound on |x - s_x p| (Euclidean, in double then
// rounded up), the term the head's bound needs for rounding x (greedy_head's module docstring).
// A row with a value that is not finite gets NaN in every a_v (the caller takes the full head).
//
// Packed weights (pack_int8_dots in runtime/greedy_head.py): int8 [P, K4, 64, 4] for P = ceil(n /
// 64) panels of 64 outputs and K4 = ceil(K / 4) groups of 4 inputs: panel p, group g holds
// q[64p + j][4g + i] at [p][g][j][i] (zero past n and K), so a panel streams front to back.

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

bool eaglebatch_cpu_is_intel();  // linear.cpp

namespace {

constexpr int64_t kOut = 64;     // outputs per panel
constexpr int64_t kGroup = 4;    // inputs per vpdpbusd lane
constexpr int64_t kTileRows = 3; // rows per pass over a panel (24 accumulators)
constexpr float kLevels = 32767.f;
constexpr int64_t kMaxInputs = 65536;  // K up to which every int32 sum is exact (see the top)

// On Intel's cores a pass fetches its panel kFarBytes ahead into L2 (the hardware prefetchers
// alone stream it too slowly there: 2 threads, Xeon with AMX, 49k x 576 head, 1 / 3 / 6 rows
// 1.04 / 1.68 / 2.05 -> 0.88 / 1.05 / 1.44 ms; 8 or 32 KB ahead within noise of 16). AMD's
// cores were measured without it (above). Read once, when the library loads.
constexpr int64_t kFarBytes = 16384;
const bool kFetchAhead = eaglebatch_cpu_is_intel();

// One row of x as two byte strings (p = 256 h + l: l, and h + 128; K4 * 4 of each, p = 0 past
// K), its scale s_x, and the rounded-up norm of x - s_x p; finite is false when x has a NaN or
// an infinity.
struct RowQuant {
  std::vector<uint8_t> low, high;
  float scale = 0.f;
  float residual = 0.f;
  bool finite = true;
};

RowQuant quantize_row(const float* x, int64_t k, int64_t k4) {
  RowQuant q;
  q.low.assign(k4 * kGroup, 0);
  q.high.assign(k4 * kGroup, 128);
  float peak = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    if (!std::isfinite(x[i])) {
      q.finite = false;
      return q;
    }
    peak = std::max(peak, std::fabs(x[i]));
  }
  q.scale = peak / kLevels;
  double sum = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    float level = 0.f;
    if (q.scale > 0.f) level = std::clamp(std::nearbyint(x[i] / q.scale), -kLevels, kLevels);
    const int32_t p = static_cast<int32_t>(level);
    const int32_t h = p >= 0 ? p / 256 : -((-p + 255) / 256);  // floor(p / 256)
    q.low[i] = static_cast<uint8_t>(p - 256 * h);
    q.high[i] = static_cast<uint8_t>(h + 128);
    // s_x * p is exact in double (24 + 16 bits), so is the difference up to one rounding
    const double r = static_cast<double>(x[i]) - static_cast<double>(q.scale) * level;
    sum += r * r;
  }
  // the sum's and the root's roundings (2^-53 each, K of them) are far below 2^-20
  const float norm = static_cast<float>(std::sqrt(sum) * (1.0 + 0x1p-20));
  q.residual = std::nextafter(norm, std::numeric_limits<float>::infinity());
  return q;
}

// Sums of rows [0, Rows) of one panel, before the 128 * column-sum correction of the high
// bytes: lo[m][j] = sum_k low_m[k] q[64p + j][k], hi[m][j] likewise over high_m. Rows is a
// template argument so that the accumulators stay in registers.
template <bool Native, int Rows>
void panel_sums(const int8_t* panel, int64_t k4, const RowQuant* const* rows,
                int32_t (*lo)[kOut], int32_t (*hi)[kOut]) {
#ifdef __AVX512VNNI__
  if constexpr (Native) {
    __m512i sl[Rows][4], sh[Rows][4];
    for (int m = 0; m < Rows; ++m)
      for (int i = 0; i < 4; ++i) sl[m][i] = sh[m][i] = _mm512_setzero_si512();
    const uint8_t* xl[Rows];
    const uint8_t* xh[Rows];
    for (int m = 0; m < Rows; ++m) xl[m] = rows[m]->low.data(), xh[m] = rows[m]->high.data();
    for (int64_t g = 0; g < k4; ++g) {
      const int8_t* w = panel + g * kOut * kGroup;
      if (kFetchAhead)
        for (int line = 0; line < 4; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(w + kFarBytes) + 64 * line, _MM_HINT_T1);
      const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
      const __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
#pragma GCC unroll 4
      for (int m = 0; m < Rows; ++m) {
        int32_t l4, h4;
        std::memcpy(&l4, xl[m] + g * kGroup, sizeof l4);
        std::memcpy(&h4, xh[m] + g * kGroup, sizeof h4);
        const __m512i bl = _mm512_set1_epi32(l4), bh = _mm512_set1_epi32(h4);
        sl[m][0] = _mm512_dpbusd_epi32(sl[m][0], bl, w0);
        sl[m][1] = _mm512_dpbusd_epi32(sl[m][1], bl, w1);
        sl[m][2] = _mm512_dpbusd_epi32(sl[m][2], bl, w2);
        sl[m][3] = _mm512_dpbusd_epi32(sl[m][3], bl, w3);
        sh[m][0] = _mm512_dpbusd_epi32(sh[m][0], bh, w0);
        sh[m][1] = _mm512_dpbusd_epi32(sh[m][1], bh, w1);
        sh[m][2] = _mm512_dpbusd_epi32(sh[m][2], bh, w2);
        sh[m][3] = _mm512_dpbusd_epi32(sh[m][3], bh, w3);
      }
    }
    for (int m = 0; m < Rows; ++m)
      for (int i = 0; i < 4; ++i) {
        _mm512_storeu_si512(reinterpret_cast<__m512i*>(lo[m] + 16 * i), sl[m][i]);
        _mm512_storeu_si512(reinterpret_cast<__m512i*>(hi[m] + 16 * i), sh[m][i]);
      }
    return;
  }
#endif
  for (int m = 0; m < Rows; ++m) {
    std::fill(lo[m], lo[m] + kOut, 0);
    std::fill(hi[m], hi[m] + kOut, 0);
    const uint8_t* xl = rows[m]->low.data();
    const uint8_t* xh = rows[m]->high.data();
    for (int64_t g = 0; g < k4; ++g) {
      const int8_t* w = panel + g * kOut * kGroup;
      for (int64_t j = 0; j < kOut; ++j)
        for (int64_t i = 0; i < kGroup; ++i) {
          lo[m][j] += static_cast<int32_t>(xl[g * kGroup + i]) * w[j * kGroup + i];
          hi[m][j] += static_cast<int32_t>(xh[g * kGroup + i]) * w[j * kGroup + i];
        }
    }
  }
}

// y[j] = float(256 * (hi[j] - 128 * col_sums[j]) + lo[j]) * (scale * scales[j]) for j < cols
// (a vector version of this made no measurable difference: the products dominate).
void finish(const int32_t* lo, const int32_t* hi, const int32_t* col_sums, const float* scales,
            float scale, int64_t cols, float* y) {
  for (int64_t j = 0; j < cols; ++j) {
    const int64_t sum = 256 * (static_cast<int64_t>(hi[j]) - 128 * col_sums[j]) + lo[j];
    y[j] = static_cast<float>(sum) * (scale * scales[j]);
  }
}

template <bool Native>
void run(const std::vector<RowQuant>& quant, const int8_t* packed, const int32_t* col_sums,
         const float* scales, int64_t n, int64_t k4, float* out) {
  const int64_t panels = (n + kOut - 1) / kOut, rows = static_cast<int64_t>(quant.size());
  std::vector<const RowQuant*> live;  // rows with finite values
  for (const RowQuant& q : quant)
    if (q.finite) live.push_back(&q);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t lo[kTileRows][kOut], hi[kTileRows][kOut];
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* panel = packed + p * k4 * kOut * kGroup;
      const int64_t cols = std::min(kOut, n - p * kOut);
      for (int64_t t = 0; t < static_cast<int64_t>(live.size()); t += kTileRows) {
        const int64_t count = std::min<int64_t>(kTileRows, live.size() - t);
        const RowQuant* const* tile = live.data() + t;
        if (count == 3) panel_sums<Native, 3>(panel, k4, tile, lo, hi);
        else if (count == 2) panel_sums<Native, 2>(panel, k4, tile, lo, hi);
        else panel_sums<Native, 1>(panel, k4, tile, lo, hi);
        for (int64_t m = 0; m < count; ++m) {
          const RowQuant& q = *live[t + m];
          finish(lo[m], hi[m], col_sums + p * kOut, scales + p * kOut, q.scale, cols,
                 out + (&q - quant.data()) * n + p * kOut);
        }
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r)
    if (!quant[r].finite)
      std::fill(out + r * n, out + (r + 1) * n, std::numeric_limits<float>::quiet_NaN());
}

// (a [rows, n] float32, residual norms [rows] float32) for x [rows, K] float32; see the top.
// native=false runs the portable loop even where VNNI is built in (tests compare the two).
std::tuple<at::Tensor, at::Tensor> head_int8_dots(const at::Tensor& x, const at::Tensor& packed,
                                                  const at::Tensor& col_sums,
                                                  const at::Tensor& scales, int64_t n,
                                                  bool native) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "head_int8_dots: x must be a contiguous [rows, K] float32 tensor");
  const int64_t rows = x.size(0), k = x.size(1), k4 = (k + kGroup - 1) / kGroup;
  const int64_t panels = (n + kOut - 1) / kOut;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() &&
              packed.numel() == panels * k4 * kOut * kGroup,
              "head_int8_dots: packed must be int8 [ceil(n / 64), ceil(K / 4), 64, 4]");
  TORCH_CHECK(col_sums.scalar_type() == at::kInt && col_sums.is_contiguous() &&
              col_sums.numel() >= n && scales.scalar_type() == at::kFloat &&
              scales.is_contiguous() && scales.numel() >= n,
              "head_int8_dots: int32 column sums and float32 scales, n of each");
  TORCH_CHECK(k <= kMaxInputs, "head_int8_dots: K too large for exact int32 sums");
  std::vector<RowQuant> quant;
  quant.reserve(rows);
  for (int64_t r = 0; r < rows; ++r)
    quant.push_back(quantize_row(x.data_ptr<float>() + r * k, k, k4));
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor residual = at::empty({rows}, x.options());
  for (int64_t r = 0; r < rows; ++r)
    residual.data_ptr<float>()[r] =
        quant[r].finite ? quant[r].residual : std::numeric_limits<float>::quiet_NaN();
  (native ? run<true> : run<false>)(quant, packed.data_ptr<int8_t>(),
                                    col_sums.data_ptr<int32_t>(), scales.data_ptr<float>(), n,
                                    k4, out.data_ptr<float>());
  return {out, residual};
}

// Whether head_int8_dots runs on VNNI instructions here (else its portable loop, slower than
// the float32 int8 panels: the head then keeps those).
bool head_int8_dots_native() {
#ifdef __AVX512VNNI__
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglebatch, m) {
  m.def("head_int8_dots(Tensor x, Tensor packed, Tensor col_sums, Tensor scales, int n, "
        "bool native=True) -> (Tensor, Tensor)");
  m.def("head_int8_dots_native() -> bool", &head_int8_dots_native);
}

TORCH_LIBRARY_IMPL(eaglebatch, CPU, m) {
  m.impl("head_int8_dots", &head_int8_dots);
}
