// AVX2 helpers shared by the kernels (x86 only; functions carry their own target
// attribute, so callers dispatch at run time).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <cmath>

#ifndef TS_AVX2
#define TS_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace tokenserve {

// exp(x) of 8 floats: Cephes expf polynomial (~1 ulp); x > 88.38 gives +inf, x < -88.38
// gives 0, NaN stays NaN.
TS_AVX2 inline __m256 exp8(__m256 x0) {
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

}  // namespace tokenserve
#endif
