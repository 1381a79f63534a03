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
// Pair layout (gemm_prepack(w, pairs=True), bf16 weights on CPUs with AVX512_BF16): [NP, KP =
// ceil(K/2), 32] bf16, element (p, kp, 2c + h) = W[16p + c, 2kp + h] (zero past N and K): each
// 32-bit lane holds one column's pair of consecutive k, what vdpbf16ps multiplies with a pair of
// bf16 activations. Computed by the pair-dot path below; activations are taken in bf16.
//
// Row invariance by construction: every output element y[m, n] is
//     acc = 0; for k in 0..K-1: acc = fma(x[m,k], w[n,k], acc);  y = round(acc + b[n])
// in this exact order, in every tile shape (MR rows x NPB panels, tails included), in the
// scalar fallback (std::fma), and whatever the thread partition (threads own whole output
// tiles; no reduction is ever split). So a row's result never depends on M, on its position
// in the batch, or on the thread count. The pair-dot path keeps the same property with
// another chain: acc = 0; for kp in 0..KP-1: acc = vdpbf16ps(acc, x[m, 2kp:2kp+2], w[n, 2kp:2kp+2]);
// y = round(acc + b[n]), the same instructions in the same order for every tile shape and
// thread partition (vdpbf16ps is deterministic: denormal inputs and outputs flushed to zero,
// round to nearest even). Its bits differ from the FMA chain's in the last places, so one
// machine always uses one of the two for a given weight (chosen at prepack).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#include "cpu_features.h"
#include "kernels.h"
#include "registry.h"
#include "simd.h"
#include "tiles.h"

namespace tokenserve {
namespace {

// Test hook: force the portable path on machines with AVX2 (see _gemm_force_portable).
std::atomic<bool> g_force_portable{false};

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
      yp[j] = f32_to_bf16(bias ? acc[j] + bias[j] : acc[j]);
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
        for (int64_t c = 0; c < NR; ++c) a[c] = std::fma(xv, bf16_to_f32(w[bf16_slot(c)]), a[c]);
      } else {
        const auto* w = static_cast<const float*>(wp) + k * NR;
        for (int64_t c = 0; c < NR; ++c) a[c] = std::fma(xv, w[c], a[c]);
      }
    }
    std::memcpy(acc + r * NR, a, sizeof(a));
  }
}

#ifdef TS_X86
// AVX2 + FMA: fma_tile (csrc/tiles.h) on the k16 panels. Per panel and k, W::load widens the 16
// weights to 2 ymm of fp32 (bf16: 1 load + shift + and).
struct Bf16Panel {  // interleaved bf16 (see the layout above)
  using T = uint16_t;
  TS_TARGET_AVX2 static void load(const uint16_t* p, __m256* w) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    w[0] = bf16_even_f32(v);  // columns 0..7
    w[1] = bf16_odd_f32(v);   // columns 8..15
  }
};
struct F32Panel {  // natural column order
  using T = float;
  TS_TARGET_AVX2 static void load(const float* p, __m256* w) {
    w[0] = _mm256_loadu_ps(p);
    w[1] = _mm256_loadu_ps(p + 8);
  }
};

TS_TARGET_AVX2 void store_row_avx2(const float* acc, int64_t ncols, const float* bias, void* y,
                                   bool y_bf16) {
  int64_t j = 0;
  for (; j + 8 <= ncols; j += 8) {
    __m256 v = _mm256_loadu_ps(acc + j);
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j));
    if (y_bf16)
      store8(static_cast<uint16_t*>(y) + j, v);
    else
      store8(static_cast<float*>(y) + j, v);
  }
  if (j < ncols)
    store_row_scalar(acc + j, ncols - j, bias ? bias + j : nullptr,
                     y_bf16 ? static_cast<void*>(static_cast<uint16_t*>(y) + j)
                            : static_cast<void*>(static_cast<float*>(y) + j), y_bf16);
}

// ---------------------------------------------------------------------------------------
// AVX-512 BF16 pair-dot micro-kernel on the pair layout: MR rows x NPB panels, one zmm
// accumulator (16 columns, natural order) per row and panel. Per k pair: NPB 64-byte weight
// loads, MR broadcasts of a bf16 activation pair, MR * NPB vdpbf16ps. An odd K ends with
// the pair (x[K-1], 0) against the zero-padded (w[K-1], 0).
// ---------------------------------------------------------------------------------------
template <int MR, int NPB>
TS_TARGET_AVX512BF16 void tile_dp(
    const uint16_t* __restrict x, int64_t ldx,      // [MR, K] bf16 rows, stride ldx
    const uint16_t* __restrict wp, int64_t pstride,  // first panel [KP, 32]; panel stride
    int64_t K, float* __restrict out, int64_t ldo) {  // out: [MR, NPB*16] fp32, stride ldo
  __m512 acc[MR][NPB];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NPB; ++p) acc[r][p] = _mm512_setzero_ps();
  const int64_t KP = (K + 1) / 2;
  for (int64_t kp = 0; kp < KP; ++kp) {
    const bool full = 2 * kp + 1 < K;
    __m512bh w[NPB];
#pragma GCC unroll 8
    for (int p = 0; p < NPB; ++p)
      w[p] = (__m512bh)_mm512_loadu_si512(wp + p * pstride + kp * 2 * NR);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      uint32_t pair = x[r * ldx + 2 * kp];
      if (full) pair |= uint32_t(x[r * ldx + 2 * kp + 1]) << 16;
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 8
      for (int p = 0; p < NPB; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, w[p]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NPB; ++p) _mm512_storeu_ps(out + r * ldo + NR * p, acc[r][p]);
}

using DpTileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*, int64_t);

DpTileFn pick_dp_tile(int mr, int npb) {
#define TS_T(a, b) if (mr == a && npb == b) return &tile_dp<a, b>;
  TS_T(1, 1) TS_T(2, 1) TS_T(3, 1) TS_T(4, 1)
  TS_T(1, 2) TS_T(2, 2) TS_T(3, 2) TS_T(4, 2)
  TS_T(1, 3) TS_T(2, 3) TS_T(3, 3) TS_T(4, 3)
  TS_T(1, 4) TS_T(2, 4) TS_T(3, 4) TS_T(4, 4)
#undef TS_T
  return nullptr;
}
#endif  // TS_X86

// Tile shapes: rows per tile (MR) and panels per tile (NPB), from the batch size. Any choice
// gives the same bits (see the header); this only affects speed. The FMA chain's is
// fma_tile_shape (csrc/tiles.h, shared with csrc/int8_gemm.cpp); the pair-dot chain's:
// 4 rows x 4 panels: 16 zmm accumulators of 32; 6x4, 4x3, 3x6, 6x2 and 2x6 measured no faster on
// Zen 4 (a step's GEMMs at M = 1, 16, 64, 256 within the host's noise, 6x2 slower; at M = 1,
// 2 to 8 panels alike: the step streams its weights from DRAM).
inline Shape dp_tile_shape(int64_t M) {
  return {static_cast<int>(std::min<int64_t>(std::max<int64_t>(M, 1), 4)), 4};
}

// Tile accumulators [rows][np*16] -> y rows m.., columns 16*p0.., + bias, rounded once.
inline void store_tile(const float* acc, int64_t m, int64_t rows, int64_t p0, int64_t np,
                       int64_t N, const float* bias, void* y, bool y_bf16, bool vec) {
  const int64_t n0 = p0 * NR, ncols = std::min(N - n0, np * NR);
  const size_t ysz = y_bf16 ? 2 : 4;
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = acc + r * np * NR;
    void* yr = static_cast<char*>(y) + ((m + r) * N + n0) * ysz;
#ifdef TS_X86
    if (vec) {
      store_row_avx2(a, ncols, bias ? bias + n0 : nullptr, yr, y_bf16);
      continue;
    }
#endif
    store_row_scalar(a, ncols, bias ? bias + n0 : nullptr, yr, y_bf16);
  }
}

// The FMA-chain GEMM on fp32 rows x: [M, K] (row stride ldx), k16 panels -> y [M, N].
void gemm_impl(const float* x, int64_t ldx, int64_t M, const void* wp, bool w_bf16, int64_t K,
               int64_t N, const float* bias, void* y, bool y_bf16) {
  const int64_t NP = (N + NR - 1) / NR;
  const int64_t pstride = K * NR;  // elements per panel
  const size_t wsz = w_bf16 ? 2 : 4;
  const bool use_avx2 = avx2_enabled(g_force_portable);
  for_each_tile(M, NP, K, K * 4, fma_tile_shape(M), [&](int64_t m, int64_t rows, int64_t p0, int64_t np,
                                                     float* acc) {
    const char* wpanel = static_cast<const char*>(wp) + p0 * pstride * wsz;
    const float* xr = x + m * ldx;
#ifdef TS_X86
    if (use_avx2) {
      FmaTileFn fn = w_bf16 ? pick_fma_tile<Bf16Panel>(int(rows), int(np))
                            : pick_fma_tile<F32Panel>(int(rows), int(np));
      if (fn == nullptr) {  // shape not instantiated: one panel at a time (same bits)
        FmaTileFn f1 = w_bf16 ? pick_fma_tile<Bf16Panel>(int(rows), 1) : pick_fma_tile<F32Panel>(int(rows), 1);
        for (int64_t p = 0; p < np; ++p)
          f1(xr, ldx, wpanel + p * pstride * wsz, pstride, K, acc + p * NR, np * NR);
      } else {
        fn(xr, ldx, wpanel, pstride, K, acc, np * NR);
      }
      store_tile(acc, m, rows, p0, np, N, bias, y, y_bf16, true);
      return;
    }
#endif
    for (int64_t p = 0; p < np; ++p) {
      panel_scalar(xr, ldx, rows, wpanel + p * pstride * wsz, w_bf16, K, acc);
      store_tile(acc, m, rows, p0 + p, 1, N, bias, y, y_bf16, false);
    }
  });
}

#ifdef TS_X86
// The pair-dot GEMM on bf16 rows x: [M, K] (row stride ldx), pair panels -> y [M, N].
void gemm_dp_impl(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* wp, int64_t K,
                  int64_t N, const float* bias, void* y, bool y_bf16) {
  const int64_t NP = (N + NR - 1) / NR;
  const int64_t pstride = (K + 1) / 2 * 2 * NR;  // elements per panel
  for_each_tile(M, NP, K, K * 2, dp_tile_shape(M), [&](int64_t m, int64_t rows, int64_t p0,
                                                       int64_t np, float* acc) {
    pick_dp_tile(int(rows), int(np))(x + m * ldx, ldx, wp + p0 * pstride, pstride, K, acc, np * NR);
    store_tile(acc, m, rows, p0, np, N, bias, y, y_bf16, true);
  });
}
#endif
}  // namespace

// dst[pos(p, c, k)] = W[16p + c, k] for every column c < N and k < K; panels in parallel.
template <class T, class Pos>
void scatter_panels(const T* src, T* dst, int64_t N, int64_t K, const Pos& pos) {
  at::parallel_for(0, (N + NR - 1) / NR, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < NR && p * NR + c < N; ++c)
        for (int64_t k = 0; k < K; ++k) dst[pos(p, c, k)] = src[(p * NR + c) * K + k];
  });
}

// Packs a weight once for gemm().
//   w: [N, K] bf16 or fp32 (any strides), pairs false -> k16 panels [ceil(N/16), K, 16], same
//   dtype, zero padded; pairs true (bf16 only, for the pair-dot path) -> [ceil(N/16),
//   ceil(K/2), 32] bf16, zero padded past N and K.
torch::Tensor gemm_prepack(const torch::Tensor& w, bool pairs) {
  TORCH_CHECK(w.dim() == 2, "gemm_prepack: weight must be 2-D [N, K], got ", w.sizes());
  TORCH_CHECK(w.device().is_cpu(), "gemm_prepack: weight must be on CPU");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat,
              "gemm_prepack: weight dtype must be bfloat16 or float32, got ", w.scalar_type());
  TORCH_CHECK(!pairs || w.scalar_type() == at::kBFloat16,
              "gemm_prepack: the pair layout takes a bfloat16 weight, got ", w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1), NP = (N + NR - 1) / NR, KP = (K + 1) / 2;
  auto wc = w.contiguous();
  auto packed = pairs ? torch::zeros({NP, KP, 2 * NR}, w.options())
                      : torch::zeros({NP, K, NR}, w.options());
  if (w.scalar_type() == at::kFloat) {
    scatter_panels(wc.data_ptr<float>(), packed.data_ptr<float>(), N, K,
                   [&](int64_t p, int64_t c, int64_t k) { return (p * K + k) * NR + c; });
    return packed;
  }
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (pairs)
    scatter_panels(src, dst, N, K, [&](int64_t p, int64_t c, int64_t k) {
      return (p * KP + k / 2) * 2 * NR + 2 * c + (k & 1);
    });
  else
    scatter_panels(src, dst, N, K,
                   [&](int64_t p, int64_t c, int64_t k) { return (p * K + k) * NR + bf16_slot(c); });
  return packed;
}

// y = x @ W^T (+ bias), written into out.
//   x:      [M, K] bf16 or fp32, stride(1) == 1 (rows may be strided; otherwise copied)
//   packed: from gemm_prepack: k16 panels [ceil(N/16), K, 16] (bf16 or fp32, independent of
//           x's dtype; the FMA chain), or pair panels [ceil(N/16), ceil(K/2), 32] bf16 (the
//           pair-dot chain, CPUs with AVX512_BF16 only; x is taken in bf16, an fp32 x is
//           rounded to bf16 first)
//   bias:   [N] any float dtype (used as fp32) or None
//   out:    [M, N] bf16 or fp32, contiguous
// fp32 accumulation, one rounding to out's dtype. Returns out.
torch::Tensor gemm_out(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                       const std::optional<torch::Tensor>& bias, torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 2, "gemm: x must be 2-D [M, K], got ", x.sizes());
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == NR || packed.size(2) == 2 * NR),
              "gemm: packed must be [NP, K, 16] or [NP, ceil(K/2), 32] from gemm_prepack, got ",
              packed.sizes());
  const bool pairs = packed.size(2) == 2 * NR;
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && out.device().is_cpu(),
              "gemm: tensors must be on CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "gemm: x dtype must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kFloat,
              "gemm: packed dtype must be bfloat16 or float32, got ", packed.scalar_type());
  TORCH_CHECK(packed.is_contiguous(), "gemm: packed must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(1) == (pairs ? (K + 1) / 2 : K), "gemm: x has K=", K,
              " but packed weight has ", packed.size(1), pairs ? " k pairs" : " k");
  TORCH_CHECK(!pairs || packed.scalar_type() == at::kBFloat16, "gemm: pair panels must be bfloat16");
#ifdef TS_X86
  TORCH_CHECK(!pairs || cpu_features().avx512bf16,
              "gemm: pair panels need a CPU with AVX512_BF16 (pack with pairs=False)");
#else
  TORCH_CHECK(!pairs, "gemm: pair panels need an x86 CPU with AVX512_BF16");
#endif
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
#ifdef TS_X86
  if (pairs) {
    torch::Tensor xb = x;
    if (x.scalar_type() != at::kBFloat16 || x.stride(1) != 1 || x.stride(0) < K)
      xb = x.to(at::kBFloat16).contiguous();
    gemm_dp_impl(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), xb.stride(0), M,
                 reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), K, N,
                 b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr(),
                 out.scalar_type() == at::kBFloat16);
    return out;
  }
#endif
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
  m.def("gemm_prepack", &tokenserve::gemm_prepack, pybind11::arg("w"), pybind11::arg("pairs") = false,
        "gemm_prepack(w: Tensor[N, K] bf16|fp32, pairs=False) -> Tensor[ceil(N/16), K, 16] (same dtype), "
        "or with pairs=True (bf16, AVX512_BF16 CPUs) Tensor[ceil(N/16), ceil(K/2), 32]: the weight "
        "packed once for gemm(); the layout chooses the FMA chain or the pair-dot chain.");
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
