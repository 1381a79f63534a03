// CPU paged attention that reads K/V in place through the block table (no gather, no
// padding), for decode rows and prefill chunks behind a cached prefix alike.
//
// KV cache layout, one tensor per layer for K and one for V:
//
//   k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]   (contiguous, q's dtype)
//   or, int8 cache:   [num_blocks, num_kv_heads, block_size, head_dim + 4] int8: each row is
//                     the token's head_dim int8 values x_q then its fp32 scale s (4 bytes, little
//                     endian), x ~ s * x_q (csrc/cache_ops.cpp writes them)
//
// Token at position p of sequence s lives in block block_tables[s][p / block_size], row
// p % block_size; one (block, kv head) is a contiguous [block_size, head_dim] tile.
//
// Sequence s owns query rows [qsl[s], qsl[s+1]) of the step's token axis; with
// q_len = qsl[s+1] - qsl[s] and ctx = context_lens[s] (>= q_len, all of it in the cache),
// its query j sits at absolute position p = ctx - q_len + j and attends keys 0..p:
//
//   keys     0 1 2 3 4 5 6 7            (ctx = 8, q_len = 3: cached prefix 0..4)
//   query 0  x x x x x x . .            p = 5
//   query 1  x x x x x x x .            p = 6
//   query 2  x x x x x x x x            p = 7
//
// Work item = (sequence, kv head, tile of up to TQ query rows); a tile holds the G = H/Hkv
// query heads of the group for each of its rows (M = rows * G query vectors), so each K/V
// block is read once per tile. Keys are visited block by block in ascending order with an
// fp32 online softmax (running max / sum, fp32 accumulators), one rounding at the end.
// An int8 cache's scales enter at fixed points: a score is (dot(q, k_q) * s_k) * scale, and
// the P.V update adds (p * s_v) * v_q, with the softmax sum over the unscaled p (exact int8 ->
// fp32 conversions everywhere, so staged and in-place reads give the same bits).
//
// Sliding window (window > 0, Mistral / Gemma / Qwen2 layers): query p sees keys
// p - window + 1 .. p; each row's key range in a block is [st, nv), and blocks before the
// tile's first row's window are never touched (the scheduler may have freed them). Logit
// soft-capping (softcap > 0, Gemma 2): a score s becomes softcap * tanh(s / softcap).
//
// Batch invariance: every query vector's arithmetic depends only on its own q, its own key
// range (0..p, or its window), block_size and head_dim: scores are per-(row, key) dot products with a fixed
// reduction order; the softmax update of a block uses only the row's own valid keys; the
// P.V accumulation is a per-element chain over the row's own keys in ascending order
// (rows of a group are never padded with masked keys). No row's key range is split across
// threads. Hence the same query gives the same bits as a decode, inside a whole prefill, or
// inside a chunk after a cached prefix, whatever the tile position, batch, or thread count.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "kernels.h"
#include "registry.h"
#include "simd.h"

namespace tokenserve {
namespace {

constexpr int kRowGroup = 3;      // query vectors per micro-kernel call
constexpr int kTileVectors = 48;  // target query vectors (rows * G) per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using tokenserve::bf16_to_f32;  // csrc/simd.h

// Element type of the cache rows: fp32, bf16, or int8 with a per-row fp32 scale.
enum class Kv { F32, BF16, I8 };

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// The per-block operations of one code path. Rows are query vectors of the tile's fp32
// copy of q (row stride ldq); K/V rows are of type kt with row stride ld (elements).
struct Ops {
  // S[r * lds + j] = dot(Q[r], K[j]) * scale, or (dot(Q[r], K[j]) * ks[j]) * scale when ks is
  // given (int8 rows), for r < rows (1..kRowGroup), j < nk (the vector path also writes
  // j < round_up(nk, 4), from key nk - 1 and ks[j]: ignored by callers).
  void (*qk)(const float* Q, int ldq, int rows, const void* K, int ldk, Kv kt, int nk,
             int Dp, float scale, const float* ks, float* S, int lds);
  // Online-softmax update of one row from its n valid scores S[0..n): turns S into
  // P = exp(S - m_new), updates *m, *l, and rescales acc[0..Dp) by exp(m_old - m_new).
  void (*softmax)(float* S, int n, float* m, float* l, float* acc, int Dp);
  // acc[r * ldacc + d] += P[r * ldp + k] * V[k][d] for r < rows, k in [k0, k1) ascending.
  void (*pv)(const float* P, int ldp, int rows, const void* V, int ldv, Kv kt, int k0,
             int k1, int Dp, float* acc, int ldacc);
  // dst[j * Dp + d] = fp32 src[j * ld + d] for j < n, d < D (exact); 0 for D <= d < Dp.
  // Also the tile's fp32 copy of each query vector (n = 1, kt = q's dtype).
  void (*stage)(const void* src, Kv kt, int n, int D, int ld, int Dp, float* dst);
  // One output vector: dst[d] = acc[d] / l, rounded once to bf16 (RNE) or kept fp32.
  void (*store_out)(const float* acc, float l, int D, bool bf16, void* dst);
  bool vector;  // Dp = round_up(D, 8) with K/V staged to padded fp32 when D % 8 != 0
};

// ---------------------------------------------------------------- portable path

inline float load_kv(const void* p, int64_t i, Kv kt) {
  switch (kt) {
    case Kv::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case Kv::I8: return float(static_cast<const int8_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

void qk_scalar(const float* Q, int ldq, int rows, const void* K, int ldk, Kv kt, int nk,
               int Dp, float scale, const float* ks, float* S, int lds) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < nk; ++j) {
      float acc = 0.f;
      for (int d = 0; d < Dp; ++d) acc += Q[r * ldq + d] * load_kv(K, int64_t(j) * ldk + d, kt);
      S[r * lds + j] = ks ? (acc * ks[j]) * scale : acc * scale;
    }
}

void softmax_scalar(float* S, int n, float* m, float* l, float* acc, int Dp) {
  float mb = kNegInf;
  for (int j = 0; j < n; ++j) mb = std::max(mb, S[j]);
  const float m_old = *m, m_new = std::max(m_old, mb);
  const float alpha = m_old == kNegInf ? 0.f : std::exp(m_old - m_new);
  float sum = 0.f;
  for (int j = 0; j < n; ++j) {
    S[j] = std::exp(S[j] - m_new);
    sum += S[j];
  }
  *l = *l * alpha + sum;
  *m = m_new;
  if (alpha != 1.f)
    for (int d = 0; d < Dp; ++d) acc[d] *= alpha;
}

void pv_scalar(const float* P, int ldp, int rows, const void* V, int ldv, Kv kt, int k0,
               int k1, int Dp, float* acc, int ldacc) {
  for (int r = 0; r < rows; ++r)
    for (int k = k0; k < k1; ++k) {
      const float p = P[r * ldp + k];
      for (int d = 0; d < Dp; ++d) acc[r * ldacc + d] += p * load_kv(V, int64_t(k) * ldv + d, kt);
    }
}

void stage_scalar(const void* src, Kv kt, int n, int D, int ld, int Dp, float* dst) {
  for (int j = 0; j < n; ++j)
    for (int d = 0; d < Dp; ++d) dst[j * Dp + d] = d < D ? load_kv(src, int64_t(j) * ld + d, kt) : 0.f;
}

void store_out_scalar(const float* acc, float l, int D, bool bf16, void* dst) {
  for (int d = 0; d < D; ++d) store1(dst, d, acc[d] / l, bf16);  // bf16: round to nearest even
}

constexpr Ops kScalarOps{qk_scalar, softmax_scalar, pv_scalar, stage_scalar, store_out_scalar,
                         false};

// ---------------------------------------------------------------- AVX2 + FMA path
#ifdef TS_X86

// load8 (8 fp32 or bf16 -> fp32), hsum8 (((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7))), hmax8,
// exp8: csrc/simd.h.

TS_TARGET_AVX2 inline __m256 tail_mask(int valid) {  // lanes < valid set
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid), idx));
}

// Scores of R rows against keys j..j+3 at a time. Each (row, key) is its own 8-lane FMA
// chain over head_dim chunks, reduced by the same hadd tree whatever its neighbours.
template <int R, typename KT>
TS_TARGET_AVX2 void qk_avx2_kernel(const float* Q, int ldq, const KT* K, int ldk, int nk, int Dp,
                                   float scale, const float* ks, float* S, int lds) {
  const int nc = Dp / 8;
  const __m128 vs = _mm_set1_ps(scale);
  for (int j = 0; j < nk; j += 4) {
    const KT* kp[4];
    for (int u = 0; u < 4; ++u) kp[u] = K + int64_t(std::min(j + u, nk - 1)) * ldk;
    __m256 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) a[r][u] = _mm256_setzero_ps();
    for (int c = 0; c < nc; ++c) {  // 12 accumulators + 3 q + 1 k: fits 16 ymm registers
      __m256 qv[R];
      for (int r = 0; r < R; ++r) qv[r] = _mm256_loadu_ps(Q + r * ldq + c * 8);
      for (int u = 0; u < 4; ++u) {
        const __m256 kv = load8(kp[u] + c * 8);
        for (int r = 0; r < R; ++r) a[r][u] = _mm256_fmadd_ps(qv[r], kv, a[r][u]);
      }
    }
    for (int r = 0; r < R; ++r) {
      // lane u of the result: ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7)) of a[r][u]
      __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      if (ks) s = _mm_mul_ps(s, _mm_loadu_ps(ks + j));
      _mm_storeu_ps(S + r * lds + j, _mm_mul_ps(s, vs));
    }
  }
}

TS_TARGET_AVX2 void qk_avx2(const float* Q, int ldq, int rows, const void* K, int ldk, Kv kt,
                            int nk, int Dp, float scale, const float* ks, float* S, int lds) {
#define TS_QK(R)                                                                                          \
  (kt == Kv::BF16 ? qk_avx2_kernel<R>(Q, ldq, static_cast<const uint16_t*>(K), ldk, nk, Dp, scale, ks, S, lds) \
   : kt == Kv::I8 ? qk_avx2_kernel<R>(Q, ldq, static_cast<const int8_t*>(K), ldk, nk, Dp, scale, ks, S, lds)   \
                  : qk_avx2_kernel<R>(Q, ldq, static_cast<const float*>(K), ldk, nk, Dp, scale, ks, S, lds))
  switch (rows) {
    case 1: TS_QK(1); break;
    case 2: TS_QK(2); break;
    default: TS_QK(3); break;
  }
#undef TS_QK
}

TS_TARGET_AVX2 void softmax_avx2(float* S, int n, float* m, float* l, float* acc, int Dp) {
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  __m256 vmax = ninf;
  for (int j = 0; j < n; j += 8) {
    __m256 x = _mm256_loadu_ps(S + j);
    if (n - j < 8) x = _mm256_blendv_ps(ninf, x, tail_mask(n - j));
    vmax = _mm256_max_ps(vmax, x);
  }
  const float m_old = *m, m_new = std::max(m_old, hmax8(vmax));
  const float alpha = m_old == kNegInf ? 0.f : std::exp(m_old - m_new);
  const __m256 vm = _mm256_set1_ps(m_new);
  __m256 vsum = _mm256_setzero_ps();
  for (int j = 0; j < n; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(S + j), vm));
    if (n - j < 8) e = _mm256_and_ps(e, tail_mask(n - j));
    _mm256_storeu_ps(S + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  *l = *l * alpha + hsum8(vsum);
  *m = m_new;
  if (alpha != 1.f) {
    const __m256 va = _mm256_set1_ps(alpha);
    for (int d = 0; d < Dp; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), va));
  }
}

// acc rows (R <= 3 of them, NV <= 2 vectors of 8 dims) += P[r][k] * V[k] for k in
// [k0, k1), ascending. Named accumulators: GCC kept an array of them on the stack.
template <int R, int NV, typename VT>
TS_TARGET_AVX2 void pv_avx2_kernel(const float* P, int ldp, const VT* V, int ldv, int k0, int k1,
                                   float* acc, int ldacc) {
  static_assert(R >= 1 && R <= 3 && NV >= 1 && NV <= 2);
  float* a0p = acc;
  float* a1p = acc + (R > 1 ? ldacc : 0);
  float* a2p = acc + (R > 2 ? 2 * ldacc : 0);
  __m256 a00 = _mm256_loadu_ps(a0p), a01 = NV > 1 ? _mm256_loadu_ps(a0p + 8) : a00;
  __m256 a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  if constexpr (R > 1) { a10 = _mm256_loadu_ps(a1p); if constexpr (NV > 1) a11 = _mm256_loadu_ps(a1p + 8); }
  if constexpr (R > 2) { a20 = _mm256_loadu_ps(a2p); if constexpr (NV > 1) a21 = _mm256_loadu_ps(a2p + 8); }
  const float* p0 = P;
  const float* p1 = P + (R > 1 ? ldp : 0);
  const float* p2 = P + (R > 2 ? 2 * ldp : 0);
  for (int k = k0; k < k1; ++k) {
    const VT* vk = V + int64_t(k) * ldv;
    const __m256 v0 = load8(vk);
    const __m256 b0 = _mm256_broadcast_ss(p0 + k);
    a00 = _mm256_fmadd_ps(b0, v0, a00);
    __m256 b1, b2;
    if constexpr (R > 1) { b1 = _mm256_broadcast_ss(p1 + k); a10 = _mm256_fmadd_ps(b1, v0, a10); }
    if constexpr (R > 2) { b2 = _mm256_broadcast_ss(p2 + k); a20 = _mm256_fmadd_ps(b2, v0, a20); }
    if constexpr (NV > 1) {
      const __m256 v1 = load8(vk + 8);
      a01 = _mm256_fmadd_ps(b0, v1, a01);
      if constexpr (R > 1) a11 = _mm256_fmadd_ps(b1, v1, a11);
      if constexpr (R > 2) a21 = _mm256_fmadd_ps(b2, v1, a21);
    }
  }
  _mm256_storeu_ps(a0p, a00);
  if constexpr (NV > 1) _mm256_storeu_ps(a0p + 8, a01);
  if constexpr (R > 1) { _mm256_storeu_ps(a1p, a10); if constexpr (NV > 1) _mm256_storeu_ps(a1p + 8, a11); }
  if constexpr (R > 2) { _mm256_storeu_ps(a2p, a20); if constexpr (NV > 1) _mm256_storeu_ps(a2p + 8, a21); }
}

template <int R, typename VT>
TS_TARGET_AVX2 void pv_avx2_rows(const float* P, int ldp, const VT* V, int ldv, int k0, int k1, int Dp,
                                 float* acc, int ldacc) {
  for (int d0 = 0; d0 < Dp; d0 += 16) {
    if (Dp - d0 >= 16)
      pv_avx2_kernel<R, 2>(P, ldp, V + d0, ldv, k0, k1, acc + d0, ldacc);
    else
      pv_avx2_kernel<R, 1>(P, ldp, V + d0, ldv, k0, k1, acc + d0, ldacc);
  }
}

TS_TARGET_AVX2 void pv_avx2(const float* P, int ldp, int rows, const void* V, int ldv, Kv kt,
                            int k0, int k1, int Dp, float* acc, int ldacc) {
#define TS_PV(R)                                                                                               \
  (kt == Kv::BF16 ? pv_avx2_rows<R>(P, ldp, static_cast<const uint16_t*>(V), ldv, k0, k1, Dp, acc, ldacc) \
   : kt == Kv::I8 ? pv_avx2_rows<R>(P, ldp, static_cast<const int8_t*>(V), ldv, k0, k1, Dp, acc, ldacc)   \
                  : pv_avx2_rows<R>(P, ldp, static_cast<const float*>(V), ldv, k0, k1, Dp, acc, ldacc))
  switch (rows) {
    case 1: TS_PV(1); break;
    case 2: TS_PV(2); break;
    default: TS_PV(3); break;
  }
#undef TS_PV
}

template <typename T>
TS_TARGET_AVX2 void stage_rows_avx2(const T* s, int n, int D, int ld, float* dst) {
  for (int j = 0; j < n; ++j)
    for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + j * D + d, load8(s + int64_t(j) * ld + d));
}

TS_TARGET_AVX2 void stage_avx2(const void* src, Kv kt, int n, int D, int ld, int Dp, float* dst) {
  if (kt == Kv::F32 || D % 8 != 0) return stage_scalar(src, kt, n, D, ld, Dp, dst);
  if (kt == Kv::BF16) stage_rows_avx2(static_cast<const uint16_t*>(src), n, D, ld, dst);
  else stage_rows_avx2(static_cast<const int8_t*>(src), n, D, ld, dst);
}

// The same IEEE division and bf16 rounding as store_out_scalar, 8 lanes at a time.
TS_TARGET_AVX2 void store_out_avx2(const float* acc, float l, int D, bool bf16, void* dst) {
  if (D % 8 != 0) return store_out_scalar(acc, l, D, bf16, dst);
  const __m256 vl = _mm256_set1_ps(l);
  for (int d = 0; d < D; d += 8) {
    const __m256 o = _mm256_div_ps(_mm256_loadu_ps(acc + d), vl);
    if (bf16) store8(static_cast<uint16_t*>(dst) + d, o);
    else store8(static_cast<float*>(dst) + d, o);
  }
}

constexpr Ops kAvx2Ops{qk_avx2, softmax_avx2, pv_avx2, stage_avx2, store_out_avx2, true};

#endif  // TS_X86

// ---------------------------------------------------------------- driver

struct Problem {
  const char* q;        // [T, H, D] (row stride q_stride0 elements)
  int64_t q_stride0;
  const char* k_cache;  // [num_blocks, Hkv, bs, ldkv]
  const char* v_cache;
  char* out;            // [T, H, D] contiguous
  const int32_t* bt;    // [S, max_blocks]
  int64_t bt_stride;
  const int32_t* qsl;   // [S + 1]
  const int32_t* ctx;   // [S]
  int H, Hkv, G, D, bs;
  size_t esize;         // bytes per element of q and out (2: bf16, 4: fp32)
  bool bf16;            // q and out are bf16
  Kv kv;                // cache row type
  int ldkv;             // cache row stride, elements (D; int8: D + kKvScaleBytes)
  size_t kv_esize;      // bytes per cache element
  float scale;
  int window;           // sliding window (keys p - window + 1 .. p), 0 = none
  float softcap;        // logit soft-capping c * tanh(s / c), 0 = none
};

struct Item {
  int s, kvh, i0, i1;  // sequence, kv head, query rows [i0, i1) of the sequence
  int64_t cost;
};

struct Scratch {
  std::vector<float> Q, S, acc, m, l, Kst, Vst, ks, vs;
  std::vector<int> nv, st;
};

void run_tile(const Problem& P, const Ops& ops, int Dp, const Item& it, Scratch& w) {
  const int G = P.G, D = P.D, bs = P.bs, M = (it.i1 - it.i0) * G;
  const int lds = round_up(bs, 8);
  const int q_begin = P.qsl[it.s], q_len = P.qsl[it.s + 1] - q_begin;
  const int base = P.ctx[it.s] - q_len;  // position of query 0
  float* Qf = w.Q.data();
  float* S = w.S.data();
  float* acc = w.acc.data();
  float* mrow = w.m.data();
  float* lrow = w.l.data();
  int* nv = w.nv.data();  // a row's keys in this block end at nv[m] (exclusive) ...
  int* st = w.st.data();  // ... and start at st[m] (its sliding window; 0 without one)

  for (int m = 0; m < M; ++m) {  // fp32 copy of the tile's queries, zero-padded to Dp
    const int t = q_begin + it.i0 + m / G, h = it.kvh * G + m % G;
    ops.stage(P.q + (int64_t(t) * P.q_stride0 + int64_t(h) * D) * P.esize, P.bf16 ? Kv::BF16 : Kv::F32,
              1, D, D, Dp, Qf + m * Dp);
    mrow[m] = kNegInf;
    lrow[m] = 0.f;
  }
  std::memset(acc, 0, sizeof(float) * size_t(M) * Dp);
  const bool i8 = P.kv == Kv::I8;
  float* ksc = i8 ? w.ks.data() : nullptr;  // the block's K / V row scales (int8 cache)
  float* vsc = w.vs.data();

  // Stage K/V to fp32 when the vector path needs padding (D % 8) or when many rows reuse
  // the block (prefill tiles): conversion is exact, so results do not depend on it.
  const bool stage = ops.vector && (D % 8 != 0 || (P.kv != Kv::F32 && M > kRowGroup));
  const int kend = base + it.i1;  // keys 0..kend-1 are needed by the tile's last row
  // With a window the tile's first row sees keys from kbeg on (later rows start later):
  // blocks before kbeg's are never read, not even prefetched (they may have been freed).
  const int kbeg = P.window > 0 ? std::max(0, base + it.i0 - P.window + 1) : 0;
  const int64_t head_elems = int64_t(bs) * P.ldkv;
  for (int b = kbeg / bs, kb0 = b * bs; kb0 < kend; ++b, kb0 += bs) {
    const int nk = std::min(bs, kend - kb0);
    const int64_t blk = P.bt[it.s * P.bt_stride + b];
    const int64_t off = (blk * P.Hkv + it.kvh) * head_elems * int64_t(P.kv_esize);
    const void* K = P.k_cache + off;
    const void* V = P.v_cache + off;
#ifdef TS_X86
    // The block's K rows to L1 and V rows to L2 before they are read: a block of a (block,
    // kv head) is one contiguous run ([nk, D]) in a cache scattered over ~1 GiB, whose 4 KB
    // pages the hardware prefetchers do not cross, so without this the reads wait on one
    // miss after another. Decode at 64 rows, context 80, 30 layers' own caches (Intel
    // Sapphire Rapids, 2 threads, bench/README.md): 9.0-11.7 -> 6.8-7.0 ms per step.
    for (int64_t o = 0, bytes = int64_t(nk) * P.ldkv * int64_t(P.kv_esize); o < bytes; o += 64) {
      _mm_prefetch(static_cast<const char*>(K) + o, _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(V) + o, _MM_HINT_T1);
    }
#endif
    if (i8) {
      for (int k = 0; k < nk; ++k) {
        std::memcpy(ksc + k, static_cast<const int8_t*>(K) + int64_t(k) * P.ldkv + D, sizeof(float));
        std::memcpy(vsc + k, static_cast<const int8_t*>(V) + int64_t(k) * P.ldkv + D, sizeof(float));
      }
      for (int k = nk; k < round_up(nk, 4); ++k) ksc[k] = 0.f;  // read by the vector qk, unused
    }
    int ldkv = P.ldkv;
    Kv kt = P.kv;
    if (stage) {
      ops.stage(K, P.kv, nk, D, P.ldkv, Dp, w.Kst.data());
      ops.stage(V, P.kv, nk, D, P.ldkv, Dp, w.Vst.data());
      K = w.Kst.data();
      V = w.Vst.data();
      ldkv = Dp;
      kt = Kv::F32;
    }
    for (int m = 0; m < M; ++m) {
      const int p = base + it.i0 + m / G;  // the row's position
      nv[m] = std::clamp(p + 1 - kb0, 0, nk);
      st[m] = P.window > 0 ? std::clamp(p - P.window + 1 - kb0, 0, nv[m]) : 0;
    }

    for (int r0 = 0; r0 < M; r0 += kRowGroup) {
      const int R = std::min(kRowGroup, M - r0);
      const int nmax = *std::max_element(nv + r0, nv + r0 + R);
      if (nmax > 0) ops.qk(Qf + r0 * Dp, Dp, R, K, ldkv, kt, nmax, Dp, P.scale, ksc, S + r0 * lds, lds);
    }
    for (int m = 0; m < M; ++m)
      if (nv[m] > st[m]) {
        float* Sm = S + m * lds;
        if (P.softcap > 0.f)  // Gemma 2: c * tanh(s / c), per (row, key), before the softmax
          for (int k = st[m]; k < nv[m]; ++k) Sm[k] = P.softcap * std::tanh(Sm[k] / P.softcap);
        ops.softmax(Sm + st[m], nv[m] - st[m], mrow + m, lrow + m, acc + m * Dp, Dp);
        if (i8)  // p * s_v: the V rows' scales, applied once per (row, key) before P.V
          for (int k = st[m]; k < nv[m]; ++k) Sm[k] *= vsc[k];
      }
    // P.V: each row's own keys st..nv in ascending order, whatever the group: the keys all
    // rows of a group share in one call, the others row by row before and after them.
    for (int r0 = 0; r0 < M; r0 += kRowGroup) {
      const int R = std::min(kRowGroup, M - r0);
      const int lo = *std::max_element(st + r0, st + r0 + R);
      const int hi = *std::min_element(nv + r0, nv + r0 + R);
      if (hi > lo) {
        for (int r = r0; r < r0 + R; ++r)
          if (st[r] < lo) ops.pv(S + r * lds, lds, 1, V, ldkv, kt, st[r], lo, Dp, acc + r * Dp, Dp);
        ops.pv(S + r0 * lds, lds, R, V, ldkv, kt, lo, hi, Dp, acc + r0 * Dp, Dp);
        for (int r = r0; r < r0 + R; ++r)
          if (nv[r] > hi) ops.pv(S + r * lds, lds, 1, V, ldkv, kt, hi, nv[r], Dp, acc + r * Dp, Dp);
      } else {
        for (int r = r0; r < r0 + R; ++r)
          if (nv[r] > st[r]) ops.pv(S + r * lds, lds, 1, V, ldkv, kt, st[r], nv[r], Dp, acc + r * Dp, Dp);
      }
    }
  }

  for (int m = 0; m < M; ++m) {
    const int t = q_begin + it.i0 + m / G, h = it.kvh * G + m % G;
    ops.store_out(acc + m * Dp, lrow[m], D, P.bf16, P.out + (int64_t(t) * P.H + h) * D * P.esize);
  }
}

void paged_attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                          const torch::Tensor& query_start_loc, const torch::Tensor& context_lens,
                          double scale, int64_t window, double softcap, bool allow_vector) {
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_attention: window and softcap must be >= 0");
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu() && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu() && block_tables.device().is_cpu() &&
                  query_start_loc.device().is_cpu() && context_lens.device().is_cpu(),
              "paged_attention: all tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3, "paged_attention: q must be [T, H, D], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4, "paged_attention: k_cache must be [num_blocks, Hkv, block_size, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_attention: k_cache and v_cache shapes differ");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "paged_attention: q must be bf16 or fp32");
  const bool kv_i8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(out.scalar_type() == dtype && (kv_i8 || k_cache.scalar_type() == dtype) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention: out must have q's dtype, k_cache and v_cache q's dtype or int8");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), Hkv = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D + (kv_i8 ? kKvScaleBytes : 0), "paged_attention: cache rows of ",
              k_cache.size(3), " elements do not fit q's head_dim ", D, kv_i8 ? " + 4 scale bytes" : "");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "paged_attention: H=", H, " not a multiple of Hkv=", Hkv);
  TORCH_CHECK(bs > 0 && D > 0, "paged_attention: block_size and head_dim must be positive");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  TORCH_CHECK(T == 0 || (q.stride(2) == 1 && (H == 1 || q.stride(1) == D)),
              "paged_attention: q needs stride(2) == 1 and stride(1) == D");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "paged_attention: out must be contiguous [T, H, D]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "paged_attention: block_tables must be contiguous int32 [S, max_blocks]");
  const int64_t S = block_tables.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.scalar_type() == at::kInt &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) == S + 1,
              "paged_attention: query_start_loc must be contiguous int32 [S + 1]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kInt &&
                  context_lens.is_contiguous() && context_lens.size(0) == S,
              "paged_attention: context_lens must be contiguous int32 [S]");

  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int G = int(H / Hkv);
  const int tq = std::max(1, kTileVectors / G);
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int q0 = qsl[s], q1 = qsl[s + 1];
    TORCH_CHECK(q0 >= 0 && q1 >= q0 && q1 <= T, "paged_attention: query_start_loc[", s, "..", s + 1,
                "] = ", q0, "..", q1, " not a non-decreasing range within [0, ", T, "]");
    const int q_len = q1 - q0;
    if (q_len == 0) continue;
    TORCH_CHECK(ctx[s] >= q_len && int64_t(ctx[s]) <= max_blocks * bs, "paged_attention: context_lens[", s,
                "] = ", ctx[s], " must be in [q_len = ", q_len, ", max_blocks * block_size = ", max_blocks * bs, "]");
    const int64_t nb = (ctx[s] + bs - 1) / bs;
    for (int64_t b = 0; b < nb; ++b) {
      const int32_t blk = bt[s * max_blocks + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_attention: block_tables[", s, "][", b, "] = ", blk,
                  " out of range [0, ", num_blocks, ")");
    }
    for (int i0 = 0; i0 < q_len; i0 += tq) {
      const int i1 = std::min(q_len, i0 + tq);
      const int64_t keys = ctx[s] - q_len + i1;
      for (int kvh = 0; kvh < Hkv; ++kvh) items.push_back({int(s), kvh, i0, i1, keys * (i1 - i0)});
    }
  }
  if (items.empty()) return;
  // Largest first, handed out dynamically: balances load; results do not depend on it.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  Problem P;
  P.q = static_cast<const char*>(q.data_ptr());
  P.q_stride0 = q.stride(0);
  P.k_cache = static_cast<const char*>(k_cache.data_ptr());
  P.v_cache = static_cast<const char*>(v_cache.data_ptr());
  P.out = static_cast<char*>(out.data_ptr());
  P.bt = bt;
  P.bt_stride = max_blocks;
  P.qsl = qsl;
  P.ctx = ctx;
  P.H = int(H);
  P.Hkv = int(Hkv);
  P.G = G;
  P.D = int(D);
  P.bs = int(bs);
  P.bf16 = dtype == at::kBFloat16;
  P.esize = P.bf16 ? 2 : 4;
  P.kv = kv_i8 ? Kv::I8 : P.bf16 ? Kv::BF16 : Kv::F32;
  P.ldkv = int(k_cache.size(3));
  P.kv_esize = kv_i8 ? 1 : P.esize;
  P.scale = float(scale);
  P.window = int(window);
  P.softcap = float(softcap);

  const Ops* ops = &kScalarOps;
#ifdef TS_X86
  if (allow_vector && cpu_features().avx2_fma) ops = &kAvx2Ops;
#endif
  const int Dp = ops->vector ? round_up(int(D), 8) : int(D);
  const int Mmax = tq * G;
  const int n_items = int(items.size());
  std::atomic<int> next{0};
  const int workers = std::max(1, std::min<int>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // Per-thread buffers kept across calls and only grown: a decode step calls this once
    // per layer, and zero-filling ~100 KiB of fresh vectors each time cost as much as the
    // attention itself at batch 1. run_tile writes every element before reading it.
    thread_local Scratch w;
    auto grow = [](auto& v, size_t n) {
      if (v.size() < n) v.resize(n);
    };
    grow(w.Q, size_t(Mmax) * Dp);
    grow(w.acc, size_t(Mmax) * Dp);
    grow(w.S, size_t(Mmax) * round_up(int(bs), 8) + 8);
    grow(w.m, size_t(Mmax));
    grow(w.l, size_t(Mmax));
    grow(w.nv, size_t(Mmax));
    grow(w.st, size_t(Mmax));
    if (ops->vector) {
      grow(w.Kst, size_t(bs) * Dp);
      grow(w.Vst, size_t(bs) * Dp);
    }
    grow(w.ks, size_t(round_up(int(bs), 4)));
    grow(w.vs, size_t(bs));
    for (int i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_items;)
      run_tile(P, *ops, Dp, items[i], w);
  });
}

}  // namespace

// out: [T, H, D] contiguous, q's dtype (written); q: [T, H, D] bf16|fp32, stride(2) == 1,
// stride(1) == D; k_cache, v_cache: [num_blocks, Hkv, block_size, D] contiguous, q's dtype,
// or [num_blocks, Hkv, block_size, D + 4] int8 (rows of int8 values and an fp32 scale);
// block_tables: int32 [S, max_blocks]; query_start_loc: int32 [S + 1]; context_lens: int32 [S].
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor context_lens,
                     double scale) {
  paged_attention_impl(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, 0, 0.0,
                       true);
}

// The same with a sliding window (a query at position p sees keys p - window + 1 .. p; 0 = none)
// and logit soft-capping (s -> softcap * tanh(s / softcap) before the softmax; 0 = none).
void paged_attention_ex(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor block_tables, torch::Tensor query_start_loc,
                        torch::Tensor context_lens, double scale, int64_t window, double softcap) {
  paged_attention_impl(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window,
                       softcap, true);
}

// Same, forced onto the portable (non-SIMD) path: for tests of the fallback.
void paged_attention_portable(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                              torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor query_start_loc, torch::Tensor context_lens, double scale,
                              int64_t window, double softcap) {
  paged_attention_impl(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, window,
                       softcap, false);
}

}  // namespace tokenserve

TOKENSERVE_REGISTER(attention) {
  m.def("paged_attention", &tokenserve::paged_attention_ex, tokenserve::ReleaseGil(),
        "paged_attention(out[T,H,D], q[T,H,D], k_cache[nb,Hkv,bs,D], v_cache, block_tables int32[S,maxb], "
        "query_start_loc int32[S+1], context_lens int32[S], scale) -> None. Causal attention of each "
        "sequence's queries (aligned to the end of its context) over its paged K/V, read in place; "
        "fp32 online softmax, batch-invariant. Rows of out owned by no sequence are not written. "
        "window > 0: a query at position p sees keys p - window + 1 .. p (blocks before every row's "
        "window are never read); softcap > 0: scores -> softcap * tanh(score / softcap).",
        pybind11::arg("out"), pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("block_tables"), pybind11::arg("query_start_loc"), pybind11::arg("context_lens"),
        pybind11::arg("scale"), pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0);
  m.def("paged_attention_portable", &tokenserve::paged_attention_portable, tokenserve::ReleaseGil(),
        "paged_attention on the portable (scalar) path regardless of CPU features; for tests.",
        pybind11::arg("out"), pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("block_tables"), pybind11::arg("query_start_loc"), pybind11::arg("context_lens"),
        pybind11::arg("scale"), pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0);
}
