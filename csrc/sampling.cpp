// Fused next-token sampling over float32 logits: penalties -> greedy | temperature ->
// top-k -> top-p -> min-p -> inverse-CDF draw, one row per task.
//
// The exact contract (arithmetic included) is the module docstring of
// tokenserve/ops/sampling.py; sample_tensors_ref() there is the reference this kernel must
// match token for token given the same uniforms. Key points for the implementation:
//  * weights w = float(exp(double(max((x - m) / T, -32)))) are rounded once from a float64
//    exp, so this file's exp and torch's agree on the float32 weight;
//  * masses are integers q = trunc(w * 2^30) summed in int64: exact, so any summation
//    order (vector lanes, blocks) gives the reference's value;
//  * top-k / top-p select a sorted prefix without a full sort: the n-th largest chunk
//    maximum bounds the n-th largest logit from below, so only chunks above it are read.
// Every row is computed by one thread with the same arithmetic whatever the batch.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "cpu_features.h"
#include "parallel.h"
#include "registry.h"
#include "simd.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")  // the penalty arithmetic must not fuse into FMAs
#endif

namespace tokenserve {
namespace {

constexpr float kQScale = 1073741824.0f;  // 2^30
constexpr float kZMin = -32.0f;
constexpr int64_t kMaxVocab = int64_t(1) << 23;
constexpr int64_t kBlock = 256;  // ids per block of the draw's block sums
constexpr int64_t kTopPWidths[] = {64, 512, 4096};

struct Scratch {
  std::vector<float> x;         // [V] penalised row
  std::vector<float> w;         // [V] weights
  std::vector<int32_t> counts;  // [V] generated-id counts, all zero between rows
  std::vector<int64_t> blocks;  // [V / kBlock + 1] block masses
  std::vector<float> cmax, tmp;
  std::vector<int32_t> cand;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

inline int32_t qmass(float w) { return static_cast<int32_t>(w * kQScale); }

inline float weight_scalar(float x, float m, float t) {
  float z = (x - m) / t;
  z = std::max(z, kZMin);  // also maps -inf to kZMin
  return static_cast<float>(std::exp(static_cast<double>(z)));
}

// ---------------------------------------------------------------- portable scans

// NaN or +inf anywhere in x[0, n).
bool has_bad_scalar(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i]) || x[i] == INFINITY) return true;
  return false;
}

float max_scalar(const float* x, int64_t n) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

int64_t first_equal_scalar(const float* x, int64_t n, float v) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == v) return i;
  return n;
}

// w[j] for j in [0, n); returns sum of q over ids with w >= min_p (min_p <= 0: all),
// and block masses blocks[j / kBlock] when blocks != nullptr.
int64_t weights_scalar(const float* x, int64_t n, float m, float t, float min_p, float* w,
                       int64_t* blocks) {
  int64_t total = 0;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    int64_t s = 0;
    for (int64_t j = b0; j < std::min(n, b0 + kBlock); ++j) {
      w[j] = weight_scalar(x[j], m, t);
      if (w[j] >= min_p) s += qmass(w[j]);
    }
    if (blocks) blocks[b0 / kBlock] = s;
    total += s;
  }
  return total;
}

void chunk_max_scalar(const float* x, int64_t n, int64_t c, float* out) {
  for (int64_t b0 = 0, i = 0; b0 < n; b0 += c, ++i) out[i] = max_scalar(x + b0, std::min(c, n - b0));
}

// ---------------------------------------------------------------- AVX2 + FMA scans
#ifdef TS_X86
// hmax8, hsum4_epi64: csrc/simd.h

TS_TARGET_AVX2 bool has_bad_avx2(const float* x, int64_t n) {
  const __m256 inf = _mm256_set1_ps(INFINITY);
  __m256 bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q),
                                         _mm256_cmp_ps(v, inf, _CMP_EQ_OQ)));
  }
  return _mm256_movemask_ps(bad) != 0 || has_bad_scalar(x + i, n - i);
}

TS_TARGET_AVX2 float max_avx2(const float* x, int64_t n) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
  }
  for (; i + 8 <= n; i += 8) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
  return std::max(hmax8(_mm256_max_ps(m0, m1)), max_scalar(x + i, n - i));
}

TS_TARGET_AVX2 int64_t first_equal_avx2(const float* x, int64_t n, float v) {
  const __m256 vv = _mm256_set1_ps(v);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vv, _CMP_EQ_OQ));
    if (mask) return i + __builtin_ctz(mask);
  }
  return i + first_equal_scalar(x + i, n - i, v);
}

// exp of 4 doubles in [-32, 0]: 2^k * P(r), r = z - k ln2 in [-ln2/2, ln2/2], P the
// degree-13 Taylor polynomial (truncation < 1e-17 relative), Horner with FMA.
TS_TARGET_AVX2 inline __m256d exp_pd(__m256d z) {
  const __m256d log2e = _mm256_set1_pd(1.4426950408889634);
  const __m256d ln2hi = _mm256_set1_pd(6.93147180369123816490e-01);
  const __m256d ln2lo = _mm256_set1_pd(1.90821492927058770002e-10);
  __m256d k = _mm256_round_pd(_mm256_mul_pd(z, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256d r = _mm256_fnmadd_pd(k, ln2hi, z);
  r = _mm256_fnmadd_pd(k, ln2lo, r);
  static constexpr double c[14] = {1.0,
                                   1.0,
                                   1.0 / 2,
                                   1.0 / 6,
                                   1.0 / 24,
                                   1.0 / 120,
                                   1.0 / 720,
                                   1.0 / 5040,
                                   1.0 / 40320,
                                   1.0 / 362880,
                                   1.0 / 3628800,
                                   1.0 / 39916800,
                                   1.0 / 479001600,
                                   1.0 / 6227020800.0};
  __m256d p = _mm256_set1_pd(c[13]);
  for (int i = 12; i >= 0; --i) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(c[i]));
  // 2^k: k + 1.5*2^52 puts k in the low mantissa bits; add the bias and shift to the exponent.
  __m256i kb = _mm256_castpd_si256(_mm256_add_pd(k, _mm256_set1_pd(6755399441055744.0)));
  __m256i e = _mm256_slli_epi64(_mm256_add_epi64(kb, _mm256_set1_epi64x(1023)), 52);
  return _mm256_mul_pd(p, _mm256_castsi256_pd(e));
}

TS_TARGET_AVX2 inline __m256 weight8(__m256 x, __m256 m, __m256 t) {
  __m256 z = _mm256_max_ps(_mm256_div_ps(_mm256_sub_ps(x, m), t), _mm256_set1_ps(kZMin));
  __m128 lo = _mm256_cvtpd_ps(exp_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(z))));
  __m128 hi = _mm256_cvtpd_ps(exp_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(z, 1))));
  return _mm256_set_m128(hi, lo);
}

// Sum of the 8 int32 lanes of q (each < 2^31) as int64, added to acc (4 x int64).
TS_TARGET_AVX2 inline __m256i add_q(__m256i acc, __m256i q) {
  acc = _mm256_add_epi64(acc, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(q)));
  return _mm256_add_epi64(acc, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(q, 1)));
}

TS_TARGET_AVX2 int64_t weights_avx2(const float* x, int64_t n, float m, float t, float min_p,
                                    float* w, int64_t* blocks) {
  const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(t), pv = _mm256_set1_ps(min_p);
  const __m256 scale = _mm256_set1_ps(kQScale), zcut = _mm256_set1_ps(-21.0f);
  int64_t total = 0;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t end = std::min(n, b0 + kBlock);
    __m256i acc = _mm256_setzero_si256();
    int64_t j = b0;
    for (; j + 8 <= end; j += 8) {
      const __m256 xv = _mm256_loadu_ps(x + j);
      // All 8 at least 21 nats under the maximum: q = trunc(w * 2^30) = 0 whatever the
      // exact w (e^-21 * 2^30 < 1), so store 0 and skip the exp (common for LM logits).
      if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_div_ps(_mm256_sub_ps(xv, mv), tv), zcut,
                                           _CMP_GE_OQ)) == 0) {
        _mm256_storeu_ps(w + j, _mm256_setzero_ps());
        continue;
      }
      __m256 wv = weight8(xv, mv, tv);
      _mm256_storeu_ps(w + j, wv);
      __m256i q = _mm256_cvttps_epi32(_mm256_mul_ps(wv, scale));
      q = _mm256_and_si256(q, _mm256_castps_si256(_mm256_cmp_ps(wv, pv, _CMP_GE_OQ)));
      acc = add_q(acc, q);
    }
    int64_t s = hsum4_epi64(acc);
    for (; j < end; ++j) {
      w[j] = weight_scalar(x[j], m, t);
      if (w[j] >= min_p) s += qmass(w[j]);
    }
    if (blocks) blocks[b0 / kBlock] = s;
    total += s;
  }
  return total;
}

TS_TARGET_AVX2 void chunk_max_avx2(const float* x, int64_t n, int64_t c, float* out) {
  int64_t b0 = 0, i = 0;
  for (; b0 + c <= n; b0 += c, ++i) {
    __m256 m = _mm256_loadu_ps(x + b0);
    for (int64_t j = 8; j < c; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + b0 + j));
    out[i] = hmax8(m);
  }
  if (b0 < n) out[i] = max_scalar(x + b0, n - b0);
}
#endif  // TS_X86

// The AVX2 path unless the CPU lacks it or TOKENSERVE_SAMPLING_PORTABLE=1 (read once; lets
// tests run the portable path on an AVX2 machine).
bool use_avx2() {
#ifdef TS_X86
  static const bool on = [] {
    const char* env = std::getenv("TOKENSERVE_SAMPLING_PORTABLE");
    return cpu_features().avx2_fma && !(env && env[0] && std::strcmp(env, "0") != 0);
  }();
  return on;
#else
  return false;
#endif
}

bool has_bad(const float* x, int64_t n) {
#ifdef TS_X86
  if (use_avx2()) return has_bad_avx2(x, n);
#endif
  return has_bad_scalar(x, n);
}
float row_max(const float* x, int64_t n) {
#ifdef TS_X86
  if (use_avx2()) return max_avx2(x, n);
#endif
  return max_scalar(x, n);
}
int64_t first_equal(const float* x, int64_t n, float v) {
#ifdef TS_X86
  if (use_avx2()) return first_equal_avx2(x, n, v);
#endif
  return first_equal_scalar(x, n, v);
}
int64_t weights(const float* x, int64_t n, float m, float t, float min_p, float* w,
                int64_t* blocks) {
#ifdef TS_X86
  if (use_avx2()) return weights_avx2(x, n, m, t, min_p, w, blocks);
#endif
  return weights_scalar(x, n, m, t, min_p, w, blocks);
}
void chunk_max(const float* x, int64_t n, int64_t c, float* out) {
#ifdef TS_X86
  if (use_avx2() && c % 8 == 0) return chunk_max_avx2(x, n, c, out);
#endif
  chunk_max_scalar(x, n, c, out);
}

// ---------------------------------------------------------------- selection

// cand <- the first n ids of the order (x descending, id ascending), in that order.
// x has no NaN; 1 <= n <= V.
void top_sorted(const float* x, int64_t V, int64_t n, Scratch& s) {
  auto before = [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  auto& cand = s.cand;
  cand.clear();
  int64_t c = 0;
  for (int64_t cs : {64, 32, 16, 8})
    if ((V + cs - 1) / cs >= 4 * n) {
      c = cs;
      break;
    }
  if (c == 0) {  // n is a large part of the row: select among all ids
    cand.resize(V);
    std::iota(cand.begin(), cand.end(), 0);
  } else {
    // tau = n-th largest chunk maximum <= n-th largest logit; ids below tau are out.
    const int64_t nc = (V + c - 1) / c;
    s.cmax.resize(nc);
    chunk_max(x, V, c, s.cmax.data());
    s.tmp.assign(s.cmax.begin(), s.cmax.end());
    std::nth_element(s.tmp.begin(), s.tmp.begin() + (n - 1), s.tmp.end(), std::greater<float>());
    const float tau = s.tmp[n - 1];
    for (int64_t ci = 0; ci < nc; ++ci) {
      if (!(s.cmax[ci] >= tau)) continue;
      const int64_t end = std::min(V, (ci + 1) * c);
      for (int64_t j = ci * c; j < end; ++j)
        if (x[j] >= tau) cand.push_back(static_cast<int32_t>(j));
    }
  }
  if (static_cast<int64_t>(cand.size()) > n) {
    std::nth_element(cand.begin(), cand.begin() + (n - 1), cand.end(), before);
    cand.resize(n);
  }
  std::sort(cand.begin(), cand.end(), before);
}

// Draw among ids[0, n) (ascending) with masses q(w[id]); returns the id or -1.
int64_t draw_sorted(const int32_t* ids, int64_t n, const float* w, float min_p, float u) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i)
    if (w[ids[i]] >= min_p) total += qmass(w[ids[i]]);
  const double target = static_cast<double>(u) * static_cast<double>(total);
  int64_t cum = 0, last = -1;
  for (int64_t i = 0; i < n; ++i) {
    const float wi = w[ids[i]];
    if (!(wi >= min_p)) continue;
    const int32_t q = qmass(wi);
    if (q == 0) continue;
    cum += q;
    last = ids[i];
    if (static_cast<double>(cum) > target) return ids[i];
  }
  return last;
}

// Draw over every id j in [0, V) with keep(j), masses q(w[j]) (min-p already in `total`
// and `blocks` when blocks != nullptr).
template <class Keep>
int64_t draw_all(int64_t V, const float* w, float min_p, float u, int64_t total,
                 const int64_t* blocks, Keep keep) {
  const double target = static_cast<double>(u) * static_cast<double>(total);
  int64_t cum = 0, last = -1, b0 = 0;
  if (blocks) {  // skip whole blocks while the cdf stays <= target (exact integer sums)
    for (; b0 < V; b0 += kBlock) {
      const int64_t bs = blocks[b0 / kBlock];
      if (static_cast<double>(cum + bs) > target) break;
      cum += bs;
    }
    if (b0 >= V) b0 = 0, cum = 0;  // cannot happen (target < total); walk everything
  }
  for (int64_t j = b0; j < V; ++j) {
    if (!(w[j] >= min_p) || !keep(j)) continue;
    const int32_t q = qmass(w[j]);
    if (q == 0) continue;
    cum += q;
    last = j;
    if (static_cast<double>(cum) > target) return j;
  }
  return last;
}

struct Args {
  const float* logits;
  const bool* greedy;
  const float *temperature, *top_p, *min_p, *rep, *pres, *freq, *uniforms;
  const int32_t *top_k, *hist, *num_prompt;
  const int64_t* offsets;
  int64_t V;
};

inline float clampf(float v, float lo, float hi) { return std::min(std::max(v, lo), hi); }

int64_t sample_row(const Args& a, int64_t b, Scratch& s) {
  const int64_t V = a.V;
  const float* in = a.logits + b * V;
  if (has_bad(in, V)) return -1;
  const int32_t* hist = a.hist + a.offsets[b];
  const int64_t nh = a.offsets[b + 1] - a.offsets[b];
  const bool rep_on = a.rep[b] != 1.0f && nh > 0;
  const bool pf_on = (a.pres[b] != 0.0f || a.freq[b] != 0.0f) && nh > a.num_prompt[b];
  const float* x = in;
  if (rep_on || pf_on) {
    s.x.resize(V);
    std::memcpy(s.x.data(), in, V * sizeof(float));
    float* px = s.x.data();
    if (rep_on) {  // idempotent per id (reads the input): repeated ids penalised once
      const float p = clampf(a.rep[b], FLT_MIN, FLT_MAX);
      for (int64_t i = 0; i < nh; ++i) {
        const float v = in[hist[i]];
        px[hist[i]] = v > 0.0f ? std::min(v / p, FLT_MAX) : v * p;
      }
    }
    if (pf_on) {
      if (static_cast<int64_t>(s.counts.size()) < V) s.counts.assign(V, 0);
      int32_t* cnt = s.counts.data();
      const int32_t* gen = hist + a.num_prompt[b];
      const int64_t ng = nh - a.num_prompt[b];
      for (int64_t i = 0; i < ng; ++i) ++cnt[gen[i]];
      const float fr = a.freq[b], pr = a.pres[b];
      for (int64_t i = 0; i < ng; ++i) {
        const int32_t id = gen[i];
        if (cnt[id] == 0) continue;
        float sub = fr * static_cast<float>(cnt[id]);
        sub = clampf(sub + pr, -FLT_MAX, FLT_MAX);
        float v = px[id] - sub;
        px[id] = v == INFINITY ? FLT_MAX : v;
        cnt[id] = 0;  // leaves counts all zero for the next row
      }
    }
    x = px;
  }
  const float m = row_max(x, V);
  if (m == -INFINITY) return -1;
  if (a.greedy[b]) return first_equal(x, V, m);

  const float t = clampf(a.temperature[b], FLT_MIN, FLT_MAX);
  const float u = a.uniforms[b];
  const float min_p = a.min_p[b];
  const bool k_on = a.top_k[b] > 0 && a.top_k[b] < V;
  const bool p_on = a.top_p[b] < 1.0f;
  s.w.resize(V);
  float* w = s.w.data();

  if (!k_on && !p_on) {  // every id: one weights pass with block masses, then the walk
    s.blocks.resize(V / kBlock + 1);
    const int64_t total = weights(x, V, m, t, min_p, w, s.blocks.data());
    return draw_all(V, w, min_p, u, total, s.blocks.data(), [](int64_t) { return true; });
  }

  int64_t n;
  if (k_on) {
    top_sorted(x, V, a.top_k[b], s);
    n = a.top_k[b];
    int64_t mass = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t id = s.cand[i];
      w[id] = weight_scalar(x[id], m, t);
      mass += qmass(w[id]);
    }
    if (p_on) {
      const double thr = static_cast<double>(a.top_p[b]) * static_cast<double>(mass);
      int64_t cum = 0, i = 0;
      for (; i < n - 1; ++i) {
        cum += qmass(w[s.cand[i]]);
        if (static_cast<double>(cum) >= thr) break;
      }
      n = i + 1;
    }
  } else {  // top-p alone: the whole row's mass, then a growing sorted prefix
    const int64_t mass = weights(x, V, m, t, -INFINITY, w, nullptr);
    const double thr = static_cast<double>(a.top_p[b]) * static_cast<double>(mass);
    n = 0;
    for (int64_t width : {kTopPWidths[0], kTopPWidths[1], kTopPWidths[2], V}) {
      width = std::min(width, V);
      top_sorted(x, V, width, s);
      int64_t cum = 0, i = 0;
      for (; i < width; ++i) {
        cum += qmass(w[s.cand[i]]);
        if (static_cast<double>(cum) >= thr) break;
      }
      if (i < width) {
        n = i + 1;
        break;
      }
      if (width == V) {
        n = V;
        break;
      }
    }
  }
  if (n <= 4096) {
    std::sort(s.cand.begin(), s.cand.begin() + n);
    return draw_sorted(s.cand.data(), n, w, min_p, u);
  }
  // Large kept set: walk the row with the prefix's membership test instead of sorting.
  const int32_t last_id = s.cand[n - 1];
  const float tau = x[last_id];
  int64_t total = 0;
  auto keep = [x, tau, last_id](int64_t j) {
    return x[j] > tau || (x[j] == tau && j <= last_id);
  };
  for (int64_t j = 0; j < V; ++j)
    if (w[j] >= min_p && keep(j)) total += qmass(w[j]);
  return draw_all(V, w, min_p, u, total, nullptr, keep);
}

void check_vec(const torch::Tensor& t, int64_t n, c10::ScalarType dt, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.size(0) == n && t.scalar_type() == dt &&
                  t.is_contiguous(),
              "sample: ", name, " must be a contiguous CPU ", c10::toString(dt), " tensor [", n,
              "], got ", t.scalar_type(), " ", t.sizes());
}

// tokens[b] for logits[b] given its parameters and uniform; see tokenserve/ops/sampling.py.
torch::Tensor sample(const torch::Tensor& logits,              // [B, V] float32, contiguous
                     const torch::Tensor& greedy,              // [B] bool
                     const torch::Tensor& temperature,         // [B] float32, >= 0
                     const torch::Tensor& top_k,               // [B] int32, 0 = off
                     const torch::Tensor& top_p,               // [B] float32, 1 = off
                     const torch::Tensor& min_p,               // [B] float32, 0 = off
                     const torch::Tensor& repetition_penalty,  // [B] float32 >= 0, 1 = off
                     const torch::Tensor& presence,            // [B] float32
                     const torch::Tensor& frequency,           // [B] float32
                     const torch::Tensor& history_ids,         // [N] int32 in [0, V)
                     const torch::Tensor& history_offsets,     // [B + 1] int64
                     const torch::Tensor& num_prompt,          // [B] int32
                     const torch::Tensor& uniforms) {          // [B] float32 in [0, 1)
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 &&
                  logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "sample: logits must be a contiguous CPU float32 [B, V] tensor");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1 && V <= kMaxVocab, "sample: vocabulary must be in [1, 2^23], got ", V);
  check_vec(greedy, B, torch::kBool, "greedy");
  check_vec(temperature, B, torch::kFloat32, "temperature");
  check_vec(top_k, B, torch::kInt32, "top_k");
  check_vec(top_p, B, torch::kFloat32, "top_p");
  check_vec(min_p, B, torch::kFloat32, "min_p");
  check_vec(repetition_penalty, B, torch::kFloat32, "repetition_penalty");
  check_vec(presence, B, torch::kFloat32, "presence");
  check_vec(frequency, B, torch::kFloat32, "frequency");
  check_vec(num_prompt, B, torch::kInt32, "num_prompt");
  check_vec(uniforms, B, torch::kFloat32, "uniforms");
  check_vec(history_offsets, B + 1, torch::kInt64, "history_offsets");
  TORCH_CHECK(history_ids.dim() == 1 && history_ids.scalar_type() == torch::kInt32 &&
                  history_ids.is_contiguous(),
              "sample: history_ids must be a contiguous int32 [N] tensor");
  const int64_t N = history_ids.size(0);
  Args a{logits.data_ptr<float>(),      greedy.data_ptr<bool>(),
         temperature.data_ptr<float>(), top_p.data_ptr<float>(),
         min_p.data_ptr<float>(),       repetition_penalty.data_ptr<float>(),
         presence.data_ptr<float>(),    frequency.data_ptr<float>(),
         uniforms.data_ptr<float>(),    top_k.data_ptr<int32_t>(),
         history_ids.data_ptr<int32_t>(), num_prompt.data_ptr<int32_t>(),
         history_offsets.data_ptr<int64_t>(), V};
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(a.offsets[b] >= 0 && a.offsets[b] <= a.offsets[b + 1] && a.offsets[b + 1] <= N,
                "sample: history_offsets must be non-decreasing within [0, ", N, "]");
    TORCH_CHECK(a.num_prompt[b] >= 0 && a.num_prompt[b] <= a.offsets[b + 1] - a.offsets[b],
                "sample: num_prompt[", b, "] outside its history");
    TORCH_CHECK(a.temperature[b] >= 0.0f && a.rep[b] >= 0.0f,  // 0 (underflow) -> FLT_MIN
                "sample: temperature and repetition_penalty must be >= 0 (row ", b, ")");
    TORCH_CHECK(!std::isnan(a.top_p[b]) && a.min_p[b] >= 0.0f && a.min_p[b] <= 1.0f &&
                    std::isfinite(a.pres[b]) && std::isfinite(a.freq[b]),
                "sample: top_p must not be NaN, min_p must be in [0, 1], presence and "
                "frequency finite (row ", b, ")");
  }
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(a.hist[i] >= 0 && a.hist[i] < V, "sample: history id ", a.hist[i],
                " outside [0, ", V, ")");
  auto out = torch::empty({B}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  parallel_units(B, at::get_num_threads(), [&](int64_t b) { o[b] = sample_row(a, b, scratch()); });
  return out;
}

}  // namespace
}  // namespace tokenserve

TOKENSERVE_REGISTER(sampling) {
  m.def("sample", &tokenserve::sample, tokenserve::ReleaseGil(),
        "sample(logits f32 [B,V], greedy bool [B], temperature f32 [B], top_k i32 [B], "
        "top_p f32 [B], min_p f32 [B], repetition_penalty f32 [B], presence f32 [B], "
        "frequency f32 [B], history_ids i32 [N], history_offsets i64 [B+1], num_prompt i32 "
        "[B], uniforms f32 [B]) -> int64 [B]: next token per row (-1: row with NaN/+inf "
        "logits). Contract: tokenserve/ops/sampling.py.",
        pybind11::arg("logits"), pybind11::arg("greedy"), pybind11::arg("temperature"),
        pybind11::arg("top_k"), pybind11::arg("top_p"), pybind11::arg("min_p"),
        pybind11::arg("repetition_penalty"), pybind11::arg("presence"),
        pybind11::arg("frequency"), pybind11::arg("history_ids"),
        pybind11::arg("history_offsets"), pybind11::arg("num_prompt"),
        pybind11::arg("uniforms"));
}
