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

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TS_X86 1
#endif

#include "bf16.h"
#include "cpu_features.h"
#include "kernels.h"
#include "registry.h"

namespace tokenserve {
namespace {

constexpr int64_t NR = 16;  // columns per panel
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
// MR rows x NPB panels: MR * 2 * NPB accumulators; per k, NPB 16-byte weight loads
// (2 x vpmovsxbd + 2 x vcvtdq2ps each), MR broadcasts, MR * 2 * NPB FMAs.
template <int MR, int NPB>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* __restrict x, int64_t K,
                                                   const int8_t* __restrict wq, int64_t pstride,
                                                   float* __restrict out, int64_t ldo) {
  __m256 acc[MR][2 * NPB];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NPB; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[2 * NPB];
#pragma GCC unroll 8
    for (int p = 0; p < NPB; ++p) {
      const int8_t* src = wq + p * pstride + k * NR;
      w[2 * p] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))));
      w[2 * p + 1] =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8))));
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < 2 * NPB; ++j) acc[r][j] = _mm256_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NPB; ++j) _mm256_storeu_ps(out + r * ldo + 8 * j, acc[r][j]);
}

using TileFn = void (*)(const float*, int64_t, const int8_t*, int64_t, float*, int64_t);

TileFn pick_tile(int mr, int npb) {
#define TS_T(a, b) if (mr == a && npb == b) return &tile_avx2<a, b>;
  TS_T(1, 1) TS_T(2, 1) TS_T(3, 1) TS_T(4, 1) TS_T(5, 1) TS_T(6, 1)
  TS_T(1, 2) TS_T(2, 2) TS_T(3, 2)
  TS_T(1, 3) TS_T(2, 3)
  TS_T(1, 4)
#undef TS_T
  return nullptr;
}
#endif  // TS_X86

// Rows per tile and panels per tile from M (speed only: every shape gives the same bits).
inline void tile_shape(int64_t M, int64_t& mr, int64_t& npb) {
  mr = M <= 1 ? 1 : M == 2 ? 2 : M == 3 ? 3 : 6;
  npb = M <= 1 ? 4 : M == 2 ? 3 : M == 3 ? 2 : 1;
}

// x fp32 [M, K] contiguous -> y [M, N].
void int8_gemm_impl(const float* x, int64_t M, int64_t K, const int8_t* wq, const float* scale,
                    int64_t N, const float* bias, void* y, bool y_bf16) {
  const int64_t NP = (N + NR - 1) / NR, pstride = K * NR;
  int64_t mr, npb;
  tile_shape(M, mr, npb);
  const int64_t ngroups = (NP + npb - 1) / npb;
  // M chunks keep their x rows in L2 while the panels stream past (as csrc/gemm.cpp)
  const int64_t mc_max = std::max<int64_t>(mr, (196608 / std::max<int64_t>(K * 4, 1)) / mr * mr);
  const int64_t nchunks = (M + mc_max - 1) / mc_max;
  const int64_t units = nchunks * ngroups;
  const bool avx2 =
#ifdef TS_X86
      cpu_features().avx2_fma && !g_force_portable.load();
#else
      false;
#endif
  // Dynamic scheduling over (row chunk, panel group) units; at least ~32K multiply-adds a
  // task so that small GEMMs stay on one thread. Which thread computes a unit never
  // changes its arithmetic.
  const int64_t work = std::max<int64_t>(1, std::min(M, (M + nchunks - 1) / nchunks) * npb * NR * K);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / work);
  const int64_t ntasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (units + grain - 1) / grain));
  const int64_t batch = std::max<int64_t>(1, units / (ntasks * 8));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, ntasks, 1, [&](int64_t, int64_t) {
    alignas(64) float acc[6 * 4 * NR];
    for (int64_t u0 = next.fetch_add(batch); u0 < units; u0 = next.fetch_add(batch))
      for (int64_t u = u0, u1 = std::min(units, u0 + batch); u < u1; ++u) {
        const int64_t chunk = u / ngroups, g = u % ngroups;
        const int64_t m_lo = chunk * M / nchunks, m_hi = (chunk + 1) * M / nchunks;
        const int64_t p0 = g * npb, np = std::min(npb, NP - p0), n0 = p0 * NR;
        const int64_t ncols = std::min(N - n0, np * NR);
        const int8_t* wp = wq + p0 * pstride;
        const int64_t nblk = (m_hi - m_lo + mr - 1) / mr;
        for (int64_t blk = 0, m = m_lo; blk < nblk; ++blk) {
          const int64_t rows = (m_hi - m_lo) / nblk + (blk < (m_hi - m_lo) % nblk ? 1 : 0);
          const float* xr = x + m * K;
          bool done = false;
#ifdef TS_X86
          if (avx2) {
            if (TileFn fn = pick_tile(int(rows), int(np))) {
              fn(xr, K, wp, pstride, acc, np * NR);
            } else {  // shape not instantiated: one panel at a time (same bits)
              TileFn f1 = pick_tile(int(rows), 1);
              for (int64_t p = 0; p < np; ++p) f1(xr, K, wp + p * pstride, pstride, acc + p * NR, np * NR);
            }
            done = true;
          }
#endif
          if (!done) {
            float pa[6 * NR];
            for (int64_t p = 0; p < np; ++p) {
              panel_scalar(xr, K, rows, wp + p * pstride, pa);
              for (int64_t r = 0; r < rows; ++r) std::copy(pa + r * NR, pa + (r + 1) * NR, acc + r * np * NR + p * NR);
            }
          }
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < ncols; ++j) {
              float v = acc[r * np * NR + j] * scale[n0 + j];
              if (bias) v += bias[n0 + j];
              const int64_t o = (m + r) * N + n0 + j;
              if (y_bf16) reinterpret_cast<uint16_t*>(y)[o] = f32_to_bf16(v);
              else static_cast<float*>(y)[o] = v;
            }
          m += rows;
        }
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
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "int8_gemm: x must be a 2-D CPU tensor [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "int8_gemm: x must be bfloat16 or float32, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), NP = (N + NR - 1) / NR;
  TORCH_CHECK(N >= 0 && q.device().is_cpu() && q.scalar_type() == at::kChar && q.is_contiguous() && q.dim() == 3 &&
                  q.size(0) == NP && q.size(1) == K && q.size(2) == NR,
              "int8_gemm: q must be contiguous int8 [", NP, ", ", K, ", 16] (pack_int8), got ", q.sizes());
  TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.dim() == 1 && scale.size(0) == NP * NR,
              "int8_gemm: scale must be contiguous fp32 [", NP * NR, "], got ", scale.sizes());
  const auto odt = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(odt == at::kBFloat16 || odt == at::kFloat, "int8_gemm: out dtype must be bf16 or fp32");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "int8_gemm: bias must be [N=", N, "]");
    b = bias->to(at::kFloat).contiguous();
  }
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
