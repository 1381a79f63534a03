// Row-invariant CPU GEMM for the model's linear layers: y = x @ W^T (+ b).
//
// Weights are stored as bf16 (or fp32) and computed with fp32 FMAs, like llama.cpp: half the
// bytes of an fp32 weight, and none of the slowness of torch's bf16 matmul on CPUs without
// native bf16.
//
// Packed weight layout (gemm_prepack): [NP = ceil(N/16), K, 16], same dtype as W, zero padded
// past N. For a bf16 weight the 16 values of one (panel, k) are interleaved so that one 32-byte
// load converts to fp32 with two integer ops: position 2j holds column j, position 2j+1 holds
// column 8+j (so `v << 16` gives columns 0..7 and `v & 0xffff0000` gives columns 8..15).
// fp32 panels are in natural column order.
//
// Row invariance by construction: every output element y[m, n] is
//     acc = 0; for k in 0..K-1: acc = fma(x[m,k], w[n,k], acc);  y = round(acc + b[n])
// in this exact order, in every tile shape (MR rows x NPB panels, tails included), in the
// scalar fallback (std::fma), and whatever the thread partition (threads own whole output
// tiles; no reduction is ever split). So a row's result never depends on M, on its position
// in the batch, or on the thread count.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TS_X86 1
#endif

#include "cpu_features.h"
#include "bf16.h"
#include "kernels.h"
#include "registry.h"

namespace tokenserve {
namespace {

constexpr int64_t NR = 16;  // columns per packed panel

// Test hook: force the portable path on machines with AVX2 (see _gemm_force_portable).
std::atomic<bool> g_force_portable{false};

// fp32 <-> bf16 exactly as c10::BFloat16 does (csrc/bf16.h)
inline uint16_t f32_to_bf16_bits(float f) { return tokenserve::f32_to_bf16(f); }
inline float bf16_bits_to_f32(uint16_t b) { return tokenserve::bf16_to_f32(b); }

// Position of column c (0..15) inside a packed bf16 16-group (see the layout above).
inline int64_t bf16_slot(int64_t c) { return c < 8 ? 2 * c : 2 * (c - 8) + 1; }

// ---------------------------------------------------------------------------------------
// Epilogue: tile accumulators [MR][NPB*16] (fp32, row stride ldacc) -> y rows, + bias,
// rounded once. Same arithmetic (one fp32 add, one rounding) for every tile shape.
// ---------------------------------------------------------------------------------------
inline void store_row_scalar(const float* acc, int64_t ncols, const float* bias,
                             void* y, bool y_bf16) {
  if (y_bf16) {
    auto* yp = static_cast<uint16_t*>(y);
    for (int64_t j = 0; j < ncols; ++j)
      yp[j] = f32_to_bf16_bits(bias ? acc[j] + bias[j] : acc[j]);
  } else {
    auto* yp = static_cast<float*>(y);
    for (int64_t j = 0; j < ncols; ++j) yp[j] = bias ? acc[j] + bias[j] : acc[j];
  }
}

// ---------------------------------------------------------------------------------------
// Portable fallback: same per-element FMA chain (std::fma is the correctly rounded fused
// multiply-add, bit-equal to vfmadd).
// ---------------------------------------------------------------------------------------
void panel_scalar(const float* x, int64_t ldx, int64_t mr, const void* wp, bool w_bf16,
                  int64_t K, float* acc /* [mr][16] */) {
  for (int64_t r = 0; r < mr; ++r) {
    float a[NR];
    for (int64_t c = 0; c < NR; ++c) a[c] = 0.f;
    const float* xr = x + r * ldx;
    for (int64_t k = 0; k < K; ++k) {
      const float xv = xr[k];
      if (w_bf16) {
        const auto* w = static_cast<const uint16_t*>(wp) + k * NR;
        for (int64_t c = 0; c < NR; ++c) a[c] = std::fma(xv, bf16_bits_to_f32(w[bf16_slot(c)]), a[c]);
      } else {
        const auto* w = static_cast<const float*>(wp) + k * NR;
        for (int64_t c = 0; c < NR; ++c) a[c] = std::fma(xv, w[c], a[c]);
      }
    }
    std::memcpy(acc + r * NR, a, sizeof(a));
  }
}

#ifdef TS_X86
// ---------------------------------------------------------------------------------------
// AVX2 + FMA micro-kernel: MR rows x NPB panels (16 columns each). Register tile of
// MR * 2 * NPB accumulators; per k: MR broadcasts of x, NPB weight loads (bf16: 1 load +
// shift + and), MR * 2 * NPB FMAs. Each accumulator lane is one output element's chain.
// ---------------------------------------------------------------------------------------
template <int MR, int NPB, bool BF16W>
__attribute__((target("avx2,fma"))) void tile_avx2(
    const float* __restrict x, int64_t ldx,     // [MR, K] rows, stride ldx
    const void* __restrict wp, int64_t pstride,  // first panel [K, 16]; panel stride (elements)
    int64_t K, float* __restrict out, int64_t ldo) {  // out: [MR, NPB*16] fp32, stride ldo
  __m256 acc[MR][2 * NPB];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NPB; ++j) acc[r][j] = _mm256_setzero_ps();
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[2 * NPB];
#pragma GCC unroll 8
    for (int p = 0; p < NPB; ++p) {
      if constexpr (BF16W) {
        const auto* wb = static_cast<const uint16_t*>(wp) + p * pstride + k * NR;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb));
        w[2 * p] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        w[2 * p + 1] = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
      } else {
        const auto* wf = static_cast<const float*>(wp) + p * pstride + k * NR;
        w[2 * p] = _mm256_loadu_ps(wf);
        w[2 * p + 1] = _mm256_loadu_ps(wf + 8);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < 2 * NPB; ++j) acc[r][j] = _mm256_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NPB; ++j) _mm256_storeu_ps(out + r * ldo + 8 * j, acc[r][j]);
}

// fp32 [8] -> bf16 [8], round to nearest even, NaN -> 0x7FC0 (c10::BFloat16 semantics).
__attribute__((target("avx2,fma"))) inline __m128i cvt_f32_bf16_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // pack 8 x u32 (values < 2^16) -> 8 x u16
  const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  return _mm_packus_epi32(lo, hi);
}

__attribute__((target("avx2,fma"))) void store_row_avx2(const float* acc, int64_t ncols,
                                                         const float* bias, void* y, bool y_bf16) {
  int64_t j = 0;
  for (; j + 8 <= ncols; j += 8) {
    __m256 v = _mm256_loadu_ps(acc + j);
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j));
    if (y_bf16)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(y) + j), cvt_f32_bf16_avx2(v));
    else
      _mm256_storeu_ps(static_cast<float*>(y) + j, v);
  }
  if (j < ncols)
    store_row_scalar(acc + j, ncols - j, bias ? bias + j : nullptr,
                     y_bf16 ? static_cast<void*>(static_cast<uint16_t*>(y) + j)
                            : static_cast<void*>(static_cast<float*>(y) + j), y_bf16);
}

using TileFn = void (*)(const float*, int64_t, const void*, int64_t, int64_t, float*, int64_t);

template <bool BF16W>
TileFn pick_tile(int mr, int npb) {
#define TS_T(a, b) if (mr == a && npb == b) return &tile_avx2<a, b, BF16W>;
  TS_T(1, 1) TS_T(2, 1) TS_T(3, 1) TS_T(4, 1) TS_T(5, 1) TS_T(6, 1)
  TS_T(1, 2) TS_T(2, 2) TS_T(3, 2)
  TS_T(1, 3) TS_T(2, 3)
  TS_T(1, 4)
#undef TS_T
  return nullptr;
}
#endif  // TS_X86

// Tile shape: rows per tile (MR) and panels per tile (NPB), from the batch size. Any choice
// gives the same bits (see the header); this only affects speed.
struct Shape {
  int mr, npb;
};
inline Shape tile_shape(int64_t M) {
  if (M <= 1) return {1, 4};
  if (M == 2) return {2, 3};
  if (M == 3) return {3, 2};
  return {6, 1};
}

// The GEMM proper on fp32 rows x: [M, K] (row stride ldx) -> y [M, N] (contiguous).
void gemm_impl(const float* x, int64_t ldx, int64_t M, const void* wp, bool w_bf16, int64_t K,
               int64_t N, const float* bias, void* y, bool y_bf16) {
  const int64_t NP = (N + NR - 1) / NR;
  const int64_t pstride = K * NR;  // elements per panel
  const Shape sh = tile_shape(M);
  const int64_t npb = sh.npb, mr = sh.mr;
  const int64_t ngroups = (NP + npb - 1) / npb;
  // M chunks keep a chunk of x rows in L2 while every panel streams over it; chunks and the
  // MR-row blocks inside them are balanced (64 rows: 6,6,6,6,5,5,... not 6 x 10 + 4).
  const int64_t mc_max = std::max<int64_t>(mr, (196608 / std::max<int64_t>(K * 4, 1)) / mr * mr);
  const int64_t nchunks = (M + mc_max - 1) / mc_max;
  const int64_t mc_rows = (M + nchunks - 1) / nchunks;
  const int64_t units = nchunks * ngroups;
  const size_t ysz = y_bf16 ? 2 : 4;
  const bool use_avx2 =
#ifdef TS_X86
      cpu_features().avx2_fma && !g_force_portable.load();
#else
      false;
#endif
  // Threads pull batches of units from a shared counter (dynamic scheduling): on a shared
  // or oversubscribed host a descheduled thread does not hold back the others' work. Which
  // thread computes a unit never changes its arithmetic. Tasks get at least ~32K
  // multiply-adds so that tiny GEMMs stay on one thread.
  const int64_t work_per_unit = std::max<int64_t>(1, std::min(M, mc_rows) * npb * NR * K);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / work_per_unit);
  const int64_t ntasks = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), (units + grain - 1) / grain));
  const int64_t batch = std::max<int64_t>(1, units / (ntasks * 8));  // ~8 batches per thread
  std::atomic<int64_t> next{0};
  at::parallel_for(0, ntasks, 1, [&](int64_t, int64_t) {
    alignas(64) float acc[6 * 4 * NR];
    for (int64_t u0 = next.fetch_add(batch); u0 < units; u0 = next.fetch_add(batch))
    for (int64_t u = u0, u1 = std::min(units, u0 + batch); u < u1; ++u) {
      const int64_t chunk = u / ngroups, g = u % ngroups;
      const int64_t m_lo = chunk * M / nchunks, m_hi = (chunk + 1) * M / nchunks;
      const int64_t p0 = g * npb, np = std::min(npb, NP - p0);
      const int64_t n0 = p0 * NR, ncols = std::min(N - n0, np * NR);
      const char* wpanel = static_cast<const char*>(wp) + p0 * pstride * (w_bf16 ? 2 : 4);
      const int64_t nblk = (m_hi - m_lo + mr - 1) / std::max<int64_t>(mr, 1);
      for (int64_t blk = 0, m = m_lo; blk < nblk; ++blk) {
        const int64_t rows = (m_hi - m_lo) / nblk + (blk < (m_hi - m_lo) % nblk ? 1 : 0);
        const int64_t m_next = m + rows;
        const float* xr = x + m * ldx;
#ifdef TS_X86
        if (use_avx2) {
          TileFn fn = w_bf16 ? pick_tile<true>(int(rows), int(np)) : pick_tile<false>(int(rows), int(np));
          if (fn == nullptr) {  // shape not instantiated: one panel at a time (same bits)
            TileFn f1 = w_bf16 ? pick_tile<true>(int(rows), 1) : pick_tile<false>(int(rows), 1);
            for (int64_t p = 0; p < np; ++p)
              f1(xr, ldx, wpanel + p * pstride * (w_bf16 ? 2 : 4), pstride, K, acc + p * NR, np * NR);
          } else {
            fn(xr, ldx, wpanel, pstride, K, acc, np * NR);
          }
          for (int64_t r = 0; r < rows; ++r)
            store_row_avx2(acc + r * np * NR, ncols, bias ? bias + n0 : nullptr,
                           static_cast<char*>(y) + ((m + r) * N + n0) * ysz, y_bf16);
          m = m_next;
          continue;
        }
#endif
        for (int64_t p = 0; p < np; ++p) {
          panel_scalar(xr, ldx, rows, wpanel + p * pstride * (w_bf16 ? 2 : 4), w_bf16, K, acc);
          const int64_t nc = std::min<int64_t>(NR, N - (n0 + p * NR));
          for (int64_t r = 0; r < rows; ++r)
            store_row_scalar(acc + r * NR, nc, bias ? bias + n0 + p * NR : nullptr,
                             static_cast<char*>(y) + ((m + r) * N + n0 + p * NR) * ysz, y_bf16);
        }
        m = m_next;
      }
    }
  });
}

}  // namespace

// Packs a weight once for gemm().
//   w: [N, K] bf16 or fp32 (any strides) -> [ceil(N/16), K, 16] same dtype, zero padded.
torch::Tensor gemm_prepack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "gemm_prepack: weight must be 2-D [N, K], got ", w.sizes());
  TORCH_CHECK(w.device().is_cpu(), "gemm_prepack: weight must be on CPU");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat,
              "gemm_prepack: weight dtype must be bfloat16 or float32, got ", w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1), NP = (N + NR - 1) / NR;
  auto wc = w.contiguous();
  auto packed = torch::zeros({NP, K, NR}, w.options());
  if (w.scalar_type() == at::kBFloat16) {
    const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
    auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
    at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t c = 0; c < NR && p * NR + c < N; ++c)
          for (int64_t k = 0; k < K; ++k)
            dst[(p * K + k) * NR + bf16_slot(c)] = src[(p * NR + c) * K + k];
    });
  } else {
    const float* src = wc.data_ptr<float>();
    float* dst = packed.data_ptr<float>();
    at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t c = 0; c < NR && p * NR + c < N; ++c)
          for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * NR + c] = src[(p * NR + c) * K + k];
    });
  }
  return packed;
}

// y = x @ W^T (+ bias), written into out.
//   x:      [M, K] bf16 or fp32, stride(1) == 1 (rows may be strided; otherwise copied)
//   packed: [ceil(N/16), K, 16] from gemm_prepack (bf16 or fp32, independent of x's dtype)
//   bias:   [N] any float dtype (used as fp32) or None
//   out:    [M, N] bf16 or fp32, contiguous
// fp32 accumulation, one rounding to out's dtype. Returns out.
torch::Tensor gemm_out(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                       const std::optional<torch::Tensor>& bias, torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 2, "gemm: x must be 2-D [M, K], got ", x.sizes());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR, "gemm: packed must be [NP, K, 16] from gemm_prepack, got ",
              packed.sizes());
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && out.device().is_cpu(),
              "gemm: tensors must be on CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "gemm: x dtype must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kFloat,
              "gemm: packed dtype must be bfloat16 or float32, got ", packed.scalar_type());
  TORCH_CHECK(packed.is_contiguous(), "gemm: packed must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(1) == K, "gemm: x has K=", K, " but packed weight has K=", packed.size(1));
  TORCH_CHECK(N >= 0 && (N + NR - 1) / NR == packed.size(0), "gemm: N=", N,
              " does not match packed panels ", packed.size(0));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.is_contiguous(),
              "gemm: out must be a contiguous [", M, ", ", N, "] tensor, got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat,
              "gemm: out dtype must be bfloat16 or float32, got ", out.scalar_type());
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "gemm: bias must be [N=", N, "], got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  if (M == 0 || N == 0) return out;
  if (K == 0) {
    if (b.defined()) out.copy_(b.unsqueeze(0).expand({M, N}));
    else out.zero_();
    return out;
  }
  torch::Tensor xf = x;
  if (x.scalar_type() != at::kFloat || x.stride(1) != 1 || x.stride(0) < K)
    xf = x.to(at::kFloat).contiguous();
  gemm_impl(xf.data_ptr<float>(), xf.stride(0), M, packed.data_ptr(), packed.scalar_type() == at::kBFloat16,
            K, N, b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr(),
            out.scalar_type() == at::kBFloat16);
  return out;
}

// y = x @ W^T (+ bias) as a new [M, N] tensor of out_dtype (None: x's dtype).
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                   const std::optional<torch::Tensor>& bias, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.dim() == 2, "gemm: x must be 2-D [M, K], got ", x.sizes());
  auto out = torch::empty({x.size(0), N}, x.options().dtype(out_dtype.value_or(x.scalar_type())));
  return gemm_out(x, packed, N, bias, out);
}

}  // namespace tokenserve

TOKENSERVE_REGISTER(gemm) {
  m.def("gemm_prepack", &tokenserve::gemm_prepack, pybind11::arg("w"),
        "gemm_prepack(w: Tensor[N, K] bf16|fp32) -> Tensor[ceil(N/16), K, 16] (same dtype): the weight "
        "packed once for gemm().");
  m.def("gemm", &tokenserve::gemm, tokenserve::ReleaseGil(), pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("N"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_dtype") = pybind11::none(),
        "gemm(x: Tensor[M, K] bf16|fp32, packed, N, bias: Tensor[N] | None, out_dtype: bf16|fp32|None) "
        "-> Tensor[M, N]: x @ W^T (+ bias), fp32 accumulation, row-invariant bits.");
  m.def("gemm_out", &tokenserve::gemm_out, tokenserve::ReleaseGil(), pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("N"),
        pybind11::arg("bias"), pybind11::arg("out"),
        "gemm_out(x, packed, N, bias, out: Tensor[M, N] bf16|fp32 contiguous) -> out: gemm() into out.");
  m.def("_gemm_force_portable", [](bool on) { return tokenserve::g_force_portable.exchange(on); },
        "Test hook: True forces the portable (non-AVX2) path of gemm; returns the old value.");
}
