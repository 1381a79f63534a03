// Weight-only int8 GEMM (--quantization int8): y = (x @ Q^T) * s (+ b), Q int8 [N, K] with one
// fp32 scale per output row (symmetric, per channel). Pure-torch oracle:
// tokenserve.ops.quant_int8 (quantize_int8, pack_int8, int8_linear_ref).
//
// The weights are dequantised in registers (int8 -> int32 -> fp32, exact) and multiplied with
// fp32 FMAs against the unquantised activations, like csrc/gemm.cpp on bf16: half its bytes,
// no activation rounding. (The int16-activation vpmaddwd path of csrc/quant.cpp does no more
// multiply-adds per cycle on AVX2 without VNNI: bench/README.md "Quantised weights".)
//
// Packed layout (pack_int8): q int8 [NP = ceil(N / 16), K, 16], the 16 columns of one (panel, k)
// in natural order, zero rows past N; scale fp32 [NP * 16], zero past N.
//
// Per output element y[m, n], in every tile shape, in the portable code, whatever the batch
// and the thread partition (threads own whole tiles; no reduction is split):
//
//     acc = 0; for k in 0..K-1: acc = fma(x[m, k], float(q[n, k]), acc)
//     y = round(fl(acc * s[n]) (+ b[n]))          (fp32 ops, then one rounding to out dtype)
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>

#include "cpu_features.h"
#include "kernels.h"
#include "registry.h"
#include "simd.h"
#include "tiles.h"

namespace tokenserve {
namespace {

std::atomic<bool> g_force_portable{false};

// Portable: MR rows x one panel over all K, into acc [mr][16].
void panel_scalar(const float* x, int64_t K, int64_t mr, const int8_t* wq, float* acc) {
  for (int64_t r = 0; r < mr; ++r) {
    float a[NR] = {};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < NR; ++c) a[c] = std::fma(x[r * K + k], float(wq[k * NR + c]), a[c]);
    std::copy(a, a + NR, acc + r * NR);
  }
}

#ifdef TS_X86
// AVX2 + FMA: fma_tile (csrc/tiles.h) on the int8 panels; per panel and k, one 16-byte weight
// load (2 x vpmovsxbd + 2 x vcvtdq2ps: exact).
struct I8Panel {
  using T = int8_t;
  TS_TARGET_AVX2 static void load(const int8_t* p, __m256* w) {
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  }
};
#endif  // TS_X86

// x fp32 [M, K] contiguous -> y [M, N]. Tiles of fma_tile_shape(M) rows x panels, scheduled
// as csrc/gemm.cpp's (csrc/tiles.h; speed only: every shape gives the same bits).
void int8_gemm_impl(const float* x, int64_t M, int64_t K, const int8_t* wq, const float* scale,
                    int64_t N, const float* bias, void* y, bool y_bf16) {
  const int64_t NP = (N + NR - 1) / NR, pstride = K * NR;
  const bool avx2 = avx2_enabled(g_force_portable);
  for_each_tile(M, NP, K, K * 4, fma_tile_shape(M), [&](int64_t m, int64_t rows, int64_t p0, int64_t np,
                                                         float* acc) {
    const int64_t n0 = p0 * NR, ncols = std::min(N - n0, np * NR);
    const int8_t* wp = wq + p0 * pstride;
    const float* xr = x + m * K;
    bool done = false;
#ifdef TS_X86
    if (avx2) {
      if (FmaTileFn fn = pick_fma_tile<I8Panel>(int(rows), int(np))) {
        fn(xr, K, wp, pstride, K, acc, np * NR);
      } else {  // shape not instantiated: one panel at a time (same bits)
        FmaTileFn f1 = pick_fma_tile<I8Panel>(int(rows), 1);
        for (int64_t p = 0; p < np; ++p) f1(xr, K, wp + p * pstride, pstride, K, acc + p * NR, np * NR);
      }
      done = true;
    }
#endif
    if (!done) {
      float pa[kMaxTileRows * NR];
      for (int64_t p = 0; p < np; ++p) {
        panel_scalar(xr, K, rows, wp + p * pstride, pa);
        for (int64_t r = 0; r < rows; ++r) std::copy(pa + r * NR, pa + (r + 1) * NR, acc + r * np * NR + p * NR);
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < ncols; ++j) {
        float v = acc[r * np * NR + j] * scale[n0 + j];
        if (bias) v += bias[n0 + j];
        store1(y, (m + r) * N + n0 + j, v, y_bf16);
      }
  });
}

}  // namespace

// y = (x @ Q^T) * scale (+ bias).
//   x:     [M, K] bf16 or fp32
//   q:     int8 [ceil(N / 16), K, 16] (tokenserve.ops.quant_int8.pack_int8)
//   scale: fp32 [ceil(N / 16) * 16], one per output row
//   bias:  [N] or None (used as fp32);  out_dtype: bf16 | fp32 (None: x's dtype)
// Returns [M, N].
torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale, int64_t N,
                        const std::optional<torch::Tensor>& bias, std::optional<at::ScalarType> out_dtype) {
  check_gemm_x("int8_gemm", x);
  const int64_t M = x.size(0), K = x.size(1), NP = (N + NR - 1) / NR;
  TORCH_CHECK(N >= 0 && q.device().is_cpu() && q.scalar_type() == at::kChar && q.is_contiguous() && q.dim() == 3 &&
                  q.size(0) == NP && q.size(1) == K && q.size(2) == NR,
              "int8_gemm: q must be contiguous int8 [", NP, ", ", K, ", 16] (pack_int8), got ", q.sizes());
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.dim() == 1 && scale.size(0) == NP * NR,
              "int8_gemm: scale must be contiguous fp32 [", NP * NR, "], got ", scale.sizes());
  const GemmIo io = gemm_io("int8_gemm", x, N, bias, out_dtype);
  const at::ScalarType odt = io.dtype;
  const torch::Tensor& b = io.bias;
  auto y = torch::empty({M, N}, x.options().dtype(odt));
  if (M == 0 || N == 0) return y;
  auto xf = x.to(at::kFloat).contiguous();
  int8_gemm_impl(xf.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), scale.data_ptr<float>(), N,
                 b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr(), odt == at::kBFloat16);
  return y;
}

}  // namespace tokenserve

TOKENSERVE_REGISTER(int8_gemm) {
  m.def("int8_gemm", &tokenserve::int8_gemm, tokenserve::ReleaseGil(), pybind11::arg("x"), pybind11::arg("q"), pybind11::arg("scale"),
        pybind11::arg("N"), pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_dtype") = pybind11::none(),
        "int8_gemm(x: Tensor[M, K] bf16|fp32, q: int8 [ceil(N/16), K, 16] (pack_int8), scale: fp32 "
        "[ceil(N/16)*16], N, bias=None, out_dtype=None) -> Tensor[M, N]: (x @ Q^T) * scale (+ bias), "
        "weights dequantised in registers, fp32 FMA chain over k, row-invariant bits.");
  m.def("_int8_force_portable", [](bool on) { return tokenserve::g_force_portable.exchange(on); },
        "Test hook: True forces the portable (non-AVX2) path of int8_gemm; returns the old value.");
}
