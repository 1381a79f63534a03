// The small fused kernels of one decoder layer: RMSNorm, fused residual add + RMSNorm,
// and the SiLU-gated MLP activation. References: tokenserve/ops/layer_ref.py.
//
// Numerics follow Hugging Face Llama in the model dtype (bf16 or fp32):
//   rms_norm:  y = dt(w * dt(r * 1/sqrt(sum(r^2)/n + eps)))      r = float(x)
//   fused_add: residual = dt(residual + x); then rms_norm of it into x
//   silu_and_mul: out = dt(silu(g) * u), g, u in fp32, ONE rounding (torch's bf16
//     `F.silu(g) * u` rounds twice: after the silu and after the product).
//   gelu_tanh_and_mul: out = dt(gelu_tanh(g) * u), fp32, one rounding (Gemma's MLP).
//     gelu_tanh(g) = 0.5 g (1 + tanh(c (g + 0.044715 g^3))), c = sqrt(2 / pi) (torch's
//     F.gelu(approximate="tanh")), computed as the equal g / (1 + exp(-2 c (g + 0.044715
//     g^3))) (0.5 (1 + tanh(v)) = sigmoid(2 v)): the exp of silu_and_mul, and no
//     cancellation in 1 + tanh for negative g.
// dt() rounds to the dtype (a no-op for fp32). The sum of squares of a row runs in fp32 in
// one fixed order (32 lanes, lane j takes elements j, j+32, ...; then a fixed tree), the
// same on the AVX-512, AVX2 and portable paths, whatever the batch or thread partitioning:
// a row's output is bit-identical whatever else is in the batch. The AVX-512 paths are the
// AVX2 ones on 16 lanes (exp16 = exp8 lane for lane), so they give the AVX2 bits; at 64 rows
// of SmolLM2 (Sapphire Rapids, 2 threads) silu_and_mul 41 -> 27 us, fused_add_rms_norm
// 15 -> 10 us per call.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu_features.h"
#include "kernels.h"
#include "parallel.h"
#include "registry.h"
#include "simd.h"

// GCC contracts a*b+c into an FMA in C++ by default (-ffp-contract=fast), also across
// intrinsics; that would make the AVX2 and portable paths (and torch) round differently.
// Where an FMA is wanted it is written explicitly (_mm256_fmadd_ps).
#pragma GCC optimize("fp-contract=off")

namespace {

using at::BFloat16;
using namespace tokenserve;  // bf16 <-> fp32 (bit-exact), load8 / store8, hsum8x4, exp8: csrc/simd.h

// Test hooks: force the portable path on machines with AVX2 (_layer_ops_force_portable), or
// the AVX2 one on machines with AVX-512 (_layer_ops_force_avx2).
std::atomic<bool> g_force_portable{false};
std::atomic<bool> g_force_avx2{false};

bool use_avx2() { return avx2_enabled(g_force_portable); }
// The AVX-512 paths: the AVX2 ones on 16 lanes, the same operations per lane (same bits).
bool use_avx512() { return use_avx2() && cpu_features().avx512f && !g_force_avx2.load(); }

// Round an fp32 value to T and back (identity for float).
template <typename T> inline float round_to(float v);
template <> inline float round_to<float>(float v) { return v; }
template <> inline float round_to<BFloat16>(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// The fixed reduction tree over 32 lane sums (the AVX2 path's 4 x 8-lane accumulators).
inline float reduce32(const float* acc) {
  float s[8], t[4];
  for (int j = 0; j < 8; ++j) s[j] = (acc[j] + acc[8 + j]) + (acc[16 + j] + acc[24 + j]);
  for (int j = 0; j < 4; ++j) t[j] = s[j] + s[j + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
}

inline float inv_rms(float sumsq, int64_t n, float eps) {
  return 1.0f / std::sqrt(sumsq / float(n) + eps);
}

#ifdef TS_X86
// Round 8 fp32 to T and back (identity for float).
template <typename T> TS_TARGET_AVX2 inline __m256 round8(__m256 v);
template <> TS_TARGET_AVX2 inline __m256 round8<float>(__m256 v) { return v; }
template <> TS_TARGET_AVX2 inline __m256 round8<BFloat16>(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}
// The same on 16 lanes (the AVX-512 paths).
template <typename T> TS_TARGET_AVX512 inline __m512 round16(__m512 v);
template <> TS_TARGET_AVX512 inline __m512 round16<float>(__m512 v) { return v; }
template <> TS_TARGET_AVX512 inline __m512 round16<BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}
#endif

// ---------------------------------------------------------------------------------------
// RMSNorm row kernels. Pass 1: r = x (or r = dt(residual + x), stored to residual) and the
// sum of r^2; pass 2: out = dt(w * dt(r * inv)).
// ---------------------------------------------------------------------------------------

template <typename T, bool FUSED>
float sumsq_scalar(const T* x, T* res, int64_t n) {
  float acc[32] = {};
  for (int64_t i = 0; i < n; ++i) {
    float r;
    if constexpr (FUSED) {
      r = round_to<T>(load1(res + i) + load1(x + i));
      store1(res + i, r);
    } else {
      r = load1(x + i);
    }
    acc[i & 31] += r * r;
  }
  return reduce32(acc);
}

template <typename T>
void normalize_scalar(T* out, const T* r, const T* w, int64_t n, float inv) {
  for (int64_t i = 0; i < n; ++i) store1(out + i, load1(w + i) * round_to<T>(load1(r + i) * inv));
}

#ifdef TS_X86
// The last n - i (< 32) elements of a row into the 4 x 8-lane sums acc, zero-padded to 32
// lanes (adding 0*0 changes no lane sum), then the fixed tree: the end of every vector path.
template <typename T, bool FUSED>
TS_TARGET_AVX2 float sumsq_tail(const T* x, T* res, int64_t i, int64_t n, __m256* acc) {
  if (i < n) {
    alignas(32) float buf[32] = {};
    for (int64_t j = i; j < n; ++j) {
      float r;
      if constexpr (FUSED) {
        r = round_to<T>(load1(res + j) + load1(x + j));
        store1(res + j, r);
      } else {
        r = load1(x + j);
      }
      buf[j - i] = r;
    }
    for (int k = 0; k < 4; ++k) {
      __m256 r = _mm256_load_ps(buf + 8 * k);
      acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(r, r));
    }
  }
  return hsum8x4(acc[0], acc[1], acc[2], acc[3]);
}

template <typename T, bool FUSED>
TS_TARGET_AVX2 float sumsq_avx2(const T* x, T* res, int64_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      __m256 r;
      if constexpr (FUSED) {
        r = round8<T>(_mm256_add_ps(load8(res + i + 8 * k), load8(x + i + 8 * k)));
        store8(res + i + 8 * k, r);
      } else {
        r = load8(x + i + 8 * k);
      }
      acc[k] = _mm256_add_ps(acc[k], _mm256_mul_ps(r, r));  // no FMA: same as portable path
    }
  }
  return sumsq_tail<T, FUSED>(x, res, i, n, acc);
}

// sumsq_avx2 with the 4 x 8-lane accumulators as 2 x 16 lanes (lane j of the pair is lane
// j % 8 of accumulator j / 8, element i + j): the same sums.
template <typename T, bool FUSED>
TS_TARGET_AVX512 float sumsq_avx512(const T* x, T* res, int64_t n) {
  __m512 a01 = _mm512_setzero_ps(), a23 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512 r0, r1;
    if constexpr (FUSED) {
      r0 = round16<T>(_mm512_add_ps(load16(res + i), load16(x + i)));
      r1 = round16<T>(_mm512_add_ps(load16(res + i + 16), load16(x + i + 16)));
      store16(res + i, r0);
      store16(res + i + 16, r1);
    } else {
      r0 = load16(x + i);
      r1 = load16(x + i + 16);
    }
    a01 = _mm512_add_ps(a01, _mm512_mul_ps(r0, r0));  // no FMA: same as the other paths
    a23 = _mm512_add_ps(a23, _mm512_mul_ps(r1, r1));
  }
  __m256 acc[4] = {_mm512_castps512_ps256(a01), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a01), 1)),
                   _mm512_castps512_ps256(a23), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a23), 1))};
  return sumsq_tail<T, FUSED>(x, res, i, n, acc);  // the tail and tree of the AVX2 path
}

template <typename T>
TS_TARGET_AVX512 void normalize_avx512(T* out, const T* r, const T* w, int64_t n, float inv) {
  const __m512 vinv = _mm512_set1_ps(inv);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    store16(out + i, _mm512_mul_ps(load16(w + i), round16<T>(_mm512_mul_ps(load16(r + i), vinv))));
  if (i < n) normalize_scalar(out + i, r + i, w + i, n - i, inv);  // same exact ops
}

template <typename T>
TS_TARGET_AVX2 void normalize_avx2(T* out, const T* r, const T* w, int64_t n, float inv) {
  const __m256 vinv = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    store8(out + i, _mm256_mul_ps(load8(w + i), round8<T>(_mm256_mul_ps(load8(r + i), vinv))));
  if (i < n) normalize_scalar(out + i, r + i, w + i, n - i, inv);  // same exact ops
}
#endif

template <typename T, bool FUSED>
void rms_norm_rows(T* out, int64_t out_stride, const T* x, int64_t x_stride, T* res,
                   int64_t res_stride, const T* w, int64_t rows, int64_t n, float eps) {
  const bool avx2 = use_avx2(), avx512 = use_avx512();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  parallel_for_stealing(rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = x + t * x_stride;
      T* rr = FUSED ? res + t * res_stride : nullptr;
      T* orow = out + t * out_stride;
      const T* src = FUSED ? rr : xr;  // what is normalized (residual after the add)
#ifdef TS_X86
      if (avx512) {
        float inv = inv_rms(sumsq_avx512<T, FUSED>(xr, rr, n), n, eps);
        normalize_avx512(orow, src, w, n, inv);
        continue;
      }
      if (avx2) {
        float inv = inv_rms(sumsq_avx2<T, FUSED>(xr, rr, n), n, eps);
        normalize_avx2(orow, src, w, n, inv);
        continue;
      }
#endif
      float inv = inv_rms(sumsq_scalar<T, FUSED>(xr, rr, n), n, eps);
      normalize_scalar(orow, src, w, n, inv);
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name, const torch::Tensor& like) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [T, hidden], got ", t.sizes());
  TORCH_CHECK(t.sizes() == like.sizes(), name, " shape ", t.sizes(), " != ", like.sizes());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " dtype ", t.scalar_type(),
              " != ", like.scalar_type());
  TORCH_CHECK(t.numel() == 0 || t.stride(1) == 1, name,
              " rows must be contiguous (stride(1) == 1)");
}

void check_weight(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D [T, hidden]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && weight.device().is_cpu(),
              "weight must be a contiguous [", x.size(1), "] tensor of x's dtype");
  TORCH_CHECK(x.size(1) > 0, "hidden size must be > 0");
}

}  // namespace

namespace tokenserve {

// out:    [T, Hd] (stride(1) == 1; may be x itself)
// x:      [T, Hd] bf16/fp32 (stride(1) == 1)
// weight: [Hd] x's dtype, contiguous
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  check_weight(x, weight);
  check_rows(x, "x", x);
  check_rows(out, "out", x);
  const int64_t T_ = x.size(0), n = x.size(1);
  if (T_ == 0) return;
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows<BFloat16, false>(out.data_ptr<BFloat16>(), out.stride(0), x.data_ptr<BFloat16>(),
                                   x.stride(0), nullptr, 0, weight.data_ptr<BFloat16>(), T_, n,
                                   float(eps));
  else
    rms_norm_rows<float, false>(out.data_ptr<float>(), out.stride(0), x.data_ptr<float>(),
                                x.stride(0), nullptr, 0, weight.data_ptr<float>(), T_, n,
                                float(eps));
}

// x:        [T, Hd] bf16/fp32 (stride(1) == 1); on return rms_norm(residual) * weight
// residual: [T, Hd] x's dtype (stride(1) == 1), distinct from x; on return residual + x
// weight:   [Hd] x's dtype, contiguous
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                        double eps) {
  check_weight(x, weight);
  check_rows(x, "x", x);
  check_rows(residual, "residual", x);
  const int64_t T_ = x.size(0), n = x.size(1);
  if (T_ == 0) return;
  TORCH_CHECK(x.data_ptr() != residual.data_ptr(), "x and residual must not alias");
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows<BFloat16, true>(x.data_ptr<BFloat16>(), x.stride(0), x.data_ptr<BFloat16>(),
                                  x.stride(0), residual.data_ptr<BFloat16>(), residual.stride(0),
                                  weight.data_ptr<BFloat16>(), T_, n, float(eps));
  else
    rms_norm_rows<float, true>(x.data_ptr<float>(), x.stride(0), x.data_ptr<float>(),
                               x.stride(0), residual.data_ptr<float>(), residual.stride(0),
                               weight.data_ptr<float>(), T_, n, float(eps));
}

}  // namespace tokenserve

namespace {

// ---------------------------------------------------------------------------------------
// act_and_mul: out = dt(act(g) * u), g = x[:, :I], u = x[:, I:], fp32, one rounding. One
// set of row kernels for both activations; an activation is a struct whose members give
// act(g) * u on one float (the portable path, std::exp), on 8 lanes (AVX2) and on 16
// (AVX-512, the 8-lane operations lane for lane: exp16 = exp8).
// ---------------------------------------------------------------------------------------

// silu_and_mul: silu(g) * u = g / (1 + exp(-g)) * u.
struct SiluMul {
  static float one(float a, float u) { return a / (1.0f + std::exp(-a)) * u; }
#ifdef TS_X86
  TS_TARGET_AVX2 static __m256 lanes8(__m256 g, __m256 u) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
  }
  TS_TARGET_AVX512 static __m512 lanes16(__m512 g, __m512 u) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
  }
#endif
};

// gelu_tanh_and_mul: out = g / (1 + exp(g * (kGeluA + kGeluB * g^2))) * u, the ops in this
// order on every path (the AVX2 and AVX-512 ones share exp8 lane for lane; the portable one
// takes std::exp).
constexpr float kGeluA = -1.5957691216057308f;   // -2 sqrt(2 / pi)
constexpr float kGeluB = -0.071354816272602f;    // -2 sqrt(2 / pi) * 0.044715

struct GeluTanhMul {
  static float one(float a, float u) {
    float z = a * (kGeluA + kGeluB * (a * a));
    return a / (1.0f + std::exp(z)) * u;
  }
#ifdef TS_X86
  TS_TARGET_AVX2 static __m256 lanes8(__m256 g, __m256 u) {
    const __m256 z = _mm256_mul_ps(
        g, _mm256_add_ps(_mm256_set1_ps(kGeluA), _mm256_mul_ps(_mm256_set1_ps(kGeluB), _mm256_mul_ps(g, g))));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(z))), u);
  }
  TS_TARGET_AVX512 static __m512 lanes16(__m512 g, __m512 u) {
    const __m512 z = _mm512_mul_ps(
        g, _mm512_add_ps(_mm512_set1_ps(kGeluA), _mm512_mul_ps(_mm512_set1_ps(kGeluB), _mm512_mul_ps(g, g))));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(z))), u);
  }
#endif
};

template <typename Act, typename T>
void act_mul_scalar(T* out, const T* g, const T* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store1(out + i, Act::one(load1(g + i), load1(u + i)));
}

#ifdef TS_X86
template <typename Act, typename T>
TS_TARGET_AVX2 void act_mul_avx2(T* out, const T* g, const T* u, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(out + i, Act::lanes8(load8(g + i), load8(u + i)));
  if (i < n) {  // tail through a zero-padded buffer: the same vector math as the body
    alignas(32) float gb[8] = {}, ub[8] = {}, ob[8];
    for (int64_t j = i; j < n; ++j) gb[j - i] = load1(g + j), ub[j - i] = load1(u + j);
    _mm256_store_ps(ob, Act::lanes8(_mm256_load_ps(gb), _mm256_load_ps(ub)));
    for (int64_t j = i; j < n; ++j) store1(out + j, ob[j - i]);
  }
}

template <typename Act, typename T>
TS_TARGET_AVX512 void act_mul_avx512(T* out, const T* g, const T* u, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(out + i, Act::lanes16(load16(g + i), load16(u + i)));
  if (i < n) act_mul_avx2<Act>(out + i, g + i, u + i, n - i);  // the same lane operations
}
#endif

template <typename Act, typename T>
void act_and_mul_rows(T* out, int64_t out_stride, const T* x, int64_t x_stride, int64_t rows,
                      int64_t n) {
  const bool avx2 = use_avx2(), avx512 = use_avx512();
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(n, 1));
  parallel_for_stealing(rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = x + t * x_stride;
#ifdef TS_X86
      if (avx512) {
        act_mul_avx512<Act>(out + t * out_stride, g, g + n, n);
        continue;
      }
      if (avx2) {
        act_mul_avx2<Act>(out + t * out_stride, g, g + n, n);
        continue;
      }
#endif
      act_mul_scalar<Act>(out + t * out_stride, g, g + n, n);
    }
  });
}

// silu_and_mul and gelu_tanh_and_mul: the argument checks, then the rows of the dtype.
// out: [T, I] (stride(1) == 1), x's dtype
// x:   [T, 2*I] bf16/fp32 (stride(1) == 1): gate = x[:, :I], up = x[:, I:]
template <typename Act>
void act_and_mul(torch::Tensor& out, const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2*I], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "x must be bfloat16 or float32, got ", x.scalar_type());
  const int64_t T_ = x.size(0), n = x.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T_ && out.size(1) == n &&
                  out.scalar_type() == x.scalar_type(),
              "out must be [", T_, ", ", n, "] of x's dtype, got ", out.sizes(), " ",
              out.scalar_type());
  TORCH_CHECK(x.numel() == 0 || x.stride(1) == 1, "x rows must be contiguous");
  TORCH_CHECK(out.numel() == 0 || out.stride(1) == 1, "out rows must be contiguous");
  if (T_ == 0 || n == 0) return;
  if (x.scalar_type() == at::kBFloat16)
    act_and_mul_rows<Act, BFloat16>(out.data_ptr<BFloat16>(), out.stride(0),
                                    x.data_ptr<BFloat16>(), x.stride(0), T_, n);
  else
    act_and_mul_rows<Act, float>(out.data_ptr<float>(), out.stride(0), x.data_ptr<float>(),
                                 x.stride(0), T_, n);
}

}  // namespace

namespace tokenserve {

void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  act_and_mul<SiluMul>(out, x, "silu_and_mul");
}

void gelu_tanh_and_mul(torch::Tensor out, torch::Tensor x) {
  act_and_mul<GeluTanhMul>(out, x, "gelu_tanh_and_mul");
}

}  // namespace tokenserve

TOKENSERVE_REGISTER(layer_ops) {
  m.def("rms_norm", &tokenserve::rms_norm,
        "rms_norm(out [T,Hd], x [T,Hd], weight [Hd], eps) -> None. out = w * dt(x * "
        "rsqrt(mean(x^2) + eps)) in fp32 with HF Llama's two roundings (bf16 or fp32; rows "
        "may be strided, stride(1) == 1; out may be x). RuntimeError on bad shapes/dtypes.",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("fused_add_rms_norm", &tokenserve::fused_add_rms_norm,
        "fused_add_rms_norm(x [T,Hd], residual [T,Hd], weight [Hd], eps) -> None. In place: "
        "residual = dt(residual + x); x = rms_norm(residual). RuntimeError on bad shapes, "
        "dtypes or aliasing.",
        pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"),
        pybind11::arg("eps"));
  m.def("silu_and_mul", &tokenserve::silu_and_mul,
        "silu_and_mul(out [T,I], x [T,2I]) -> None. out = silu(x[:, :I]) * x[:, I:] in fp32, "
        "rounded once to the dtype (torch's bf16 F.silu(g) * u rounds twice).",
        pybind11::arg("out"), pybind11::arg("x"));
  m.def("gelu_tanh_and_mul", &tokenserve::gelu_tanh_and_mul,
        "gelu_tanh_and_mul(out [T,I], x [T,2I]) -> None. out = gelu_tanh(x[:, :I]) * x[:, I:] "
        "(torch's F.gelu(approximate='tanh')) in fp32, rounded once to the dtype.",
        pybind11::arg("out"), pybind11::arg("x"));
  m.def("_layer_ops_force_portable", [](bool on) { return g_force_portable.exchange(on); },
        "Test hook: True forces the portable (non-AVX2) paths of layer_ops; returns the old "
        "value.");
  m.def("_layer_ops_force_avx2", [](bool on) { return g_force_avx2.exchange(on); },
        "Test hook: True keeps layer_ops off its AVX-512 paths (the AVX2 ones run); returns "
        "the old value.");
}
