// What the two AMX-INT8 GEMMs share (csrc/quant_amx_int.cpp: Q4_0 / Q4_1 / Q8_0;
// csrc/quant_k_amx.cpp: Q4_K / Q5_K / Q6_K): the target, and the store of a 16 x 16 fp32
// output tile with the VNNI tiles' additions and roundings (csrc/quant_act.h store_tile16).
#pragma once

#include <algorithm>
#include <cstdint>

#include "simd.h"

#if defined(TS_X86) && defined(__linux__) && defined(__GNUC__) && __GNUC__ >= 12
#define TS_HAVE_AMX_INT 1
#define TS_TARGET_AMX_INT                                                                     \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,"      \
                        "amx-tile,amx-int8")))
#endif

#ifdef TS_HAVE_AMX_INT
namespace tokenserve::amx {

// 16 fp32 -> bf16 bits in the low half of each lane: round to nearest even, NaN -> 0x7FC0
// (simd.h's f32_to_bf16, lane for lane).
TS_TARGET_AMX_INT inline __m256i bf16_16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// out [16 rows][16] fp32 (+ bias [N]) -> y [., N] (bf16 or fp32) rows m0 .. m0 + rows - 1,
// columns n0 .. min(n0 + 16, N) - 1 (csrc/quant_act.h store_tile16: the same additions and
// roundings).
TS_TARGET_AMX_INT inline void store_out16(const float* out, int64_t rows, int64_t m0, int64_t n0, int64_t N,
                                          const float* bias, void* y, bool y_bf16) {
  const int64_t ncols = std::min<int64_t>(16, N - n0);
  const __mmask16 k = __mmask16((1u << ncols) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    __m512 v = _mm512_load_ps(out + r * 16);
    if (bias) v = _mm512_add_ps(v, bv);
    const int64_t i = (m0 + r) * N + n0;
    if (y_bf16) _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + i, k, bf16_16(v));
    else _mm512_mask_storeu_ps(static_cast<float*>(y) + i, k, v);
  }
}

}  // namespace tokenserve::amx
#endif  // TS_HAVE_AMX_INT
