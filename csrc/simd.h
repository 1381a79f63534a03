// SIMD and bf16 helpers shared by the kernels: the target attribute of each ISA level, bf16
// <-> fp32 conversions (scalar and 8 lanes), loads and stores of fp32 / bf16 / fp16 rows,
// horizontal reductions, exp8; their 16-lane AVX-512 twins (load16, store16, exp16).
//
// Nothing here needs a -m flag: every vector helper carries its ISA level's target attribute,
// so one build for generic x86-64 serves every CPU and the kernels pick their code path at
// run time (csrc/cpu_features.h). A helper of a lower level inlines into a kernel of a higher
// one (its features are a subset of the kernel's); never the other way round.
//
// Every conversion is bit-exact with c10::BFloat16: bf16 is the top half of an fp32; fp32 ->
// bf16 rounds to nearest even, NaN -> 0x7FC0. The scalar and vector versions give the same bits.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TS_X86 1
#endif

// The ISA levels the kernels dispatch on (cpu_features(): avx2_fma, avx512bf16).
#define TS_TARGET_AVX2 __attribute__((target("avx2,fma")))
// AVX2 + FMA with F16C (vcvtph2ps: the fp16 scales of the GGUF quant formats).
#define TS_TARGET_AVX2_F16C __attribute__((target("avx2,fma,f16c")))
// AVX-512 with the bf16 pair dot product (vdpbf16ps).
#define TS_TARGET_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
// AVX-512 foundation (with AVX2 + FMA): 16-lane versions of the AVX2 helpers (load16, store16, exp16).
#define TS_TARGET_AVX512 __attribute__((target("avx2,fma,avx512f")))
// AVX-512 with the int16 pair dot product (vpdpwssd), F16C and FMA: the block-quantised GEMMs.
#define TS_TARGET_AVX512VNNI \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

namespace tokenserve {

// ------------------------------------------------------------------------- scalar

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// One element of a float or at::BFloat16 buffer as fp32, and back (rounded once).
inline float load1(const float* p) { return *p; }
inline float load1(const at::BFloat16* p) {
  return bf16_to_f32(reinterpret_cast<const uint16_t&>(*p));
}
inline void store1(float* p, float v) { *p = v; }
inline void store1(at::BFloat16* p, float v) {
  reinterpret_cast<uint16_t&>(*p) = f32_to_bf16(v);
}
// Element i of an output that is bf16 (y_bf16) or fp32, set to v (rounded once).
inline void store1(void* y, int64_t i, float v, bool y_bf16) {
  if (y_bf16) static_cast<uint16_t*>(y)[i] = f32_to_bf16(v);
  else static_cast<float*>(y)[i] = v;
}

#ifdef TS_X86
// ------------------------------------------------------------------------- AVX2: loads

// 8 consecutive elements as fp32 (bf16: shifted into the top half of an fp32, exact).
TS_TARGET_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
TS_TARGET_AVX2 inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
TS_TARGET_AVX2 inline __m256 load8(const at::BFloat16* p) {
  return load8(reinterpret_cast<const uint16_t*>(p));
}
// 8 int8 (the int8 KV cache's rows) as fp32, exact.
TS_TARGET_AVX2 inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 16 bf16 loaded as one vector, two per 32-bit lane (the interleaved panels of csrc/gemm.cpp):
// the 8 in the low halves (even positions) and the 8 in the high halves (odd), as fp32.
TS_TARGET_AVX2 inline __m256 bf16_even_f32(__m256i v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
TS_TARGET_AVX2 inline __m256 bf16_odd_f32(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// 16 bytes (unaligned).
TS_TARGET_AVX2 inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// 8 IEEE halves (little-endian bytes at p) as fp32 (F16C).
TS_TARGET_AVX2_F16C inline __m256 load8_fp16(const uint8_t* p) { return _mm256_cvtph_ps(load16(p)); }

// One pair of int16 (x[e], x[e+1]) broadcast to every 32-bit lane: the activation operand of
// vpmaddwd against 8 rows x 2 elements of widened weights (csrc/quant.cpp, csrc/quant_k.cpp).
TS_TARGET_AVX2 inline __m256i xpair(const int16_t* x, int e) {
  int32_t v;
  std::memcpy(&v, x + e, 4);
  return _mm256_set1_epi32(v);
}

// ------------------------------------------------------------------------- AVX2: stores

// fp32 bits -> bf16 bits in the low 16 of each 32-bit lane (RNE, NaN -> 0x7FC0).
TS_TARGET_AVX2 inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// fp32 [8] -> bf16 [8] (RNE, NaN -> 0x7FC0), packed in element order.
TS_TARGET_AVX2 inline __m128i f32_to_bf16_8(__m256 v) {
  const __m256i r = bf16_bits(v);  // values < 2^16: packus keeps them
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// 8 fp32 to 8 consecutive elements (bf16: rounded once).
TS_TARGET_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
TS_TARGET_AVX2 inline void store8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f32_to_bf16_8(v));
}
TS_TARGET_AVX2 inline void store8(at::BFloat16* p, __m256 v) {
  store8(reinterpret_cast<uint16_t*>(p), v);
}

// ------------------------------------------------------------------------- AVX2: reductions
// Each in one fixed order (the kernels' bits depend on it; see each kernel's header).

// Sum of 8 lanes as ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7)).
TS_TARGET_AVX2 inline float hsum8(__m256 v) {
  __m256 h = _mm256_hadd_ps(v, v);
  h = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// Sum of 4 x 8 lanes: s = (a0+a1)+(a2+a3) lane-wise, t_j = s_j + s_{j+4},
// then (t0+t2)+(t1+t3).
TS_TARGET_AVX2 inline float hsum8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));                   // t0+t2, t1+t3
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));   // (t0+t2)+(t1+t3)
}

// Maximum of 8 lanes (NaN lanes as _mm_max_ps treats them).
TS_TARGET_AVX2 inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

// Sum of 8 int32 lanes (wrapping, so any order gives the same value).
TS_TARGET_AVX2 inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// Sum of 4 int64 lanes.
TS_TARGET_AVX2 inline int64_t hsum4_epi64(__m256i v) {
  alignas(32) int64_t a[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(a), v);
  return a[0] + a[1] + a[2] + a[3];
}

// ------------------------------------------------------------------------- AVX2: math

// exp(x) of 8 floats: Cephes expf polynomial (~1 ulp); x > 88.38 gives +inf, x < -88.38
// gives 0, NaN stays NaN.
TS_TARGET_AVX2 inline __m256 exp8(__m256 x0) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  __m256 x = _mm256_min_ps(_mm256_max_ps(x0, lo), hi);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201E-1f));
  __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x0, hi, _CMP_GT_OQ));
  return _mm256_blendv_ps(y, x0, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q));
}

// ------------------------------------------------------------------------- AVX-512
// The AVX2 helpers on 16 lanes, lane for lane the same operations (so the same bits): a
// kernel's AVX-512 path gives what its AVX2 path gives.

TS_TARGET_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TS_TARGET_AVX512 inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
TS_TARGET_AVX512 inline __m512 load16(const at::BFloat16* p) {
  return load16(reinterpret_cast<const uint16_t*>(p));
}

// fp32 bits -> bf16 bits in the low 16 of each 32-bit lane (as bf16_bits).
TS_TARGET_AVX512 inline __m512i bf16_bits16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

TS_TARGET_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
TS_TARGET_AVX512 inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
TS_TARGET_AVX512 inline void store16(at::BFloat16* p, __m512 v) {
  store16(reinterpret_cast<uint16_t*>(p), v);
}

// exp8 on 16 lanes: the same operations in the same order.
TS_TARGET_AVX512 inline __m512 exp16(__m512 x0) {
  const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-88.3762626647949f);
  __m512 x = _mm512_min_ps(_mm512_max_ps(x0, lo), hi);
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(5.0000001201E-1f));
  __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  __m512i n = _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127));
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(n, 23)));
  y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x0, hi, _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q), x0);
}
#endif  // TS_X86

}  // namespace tokenserve
