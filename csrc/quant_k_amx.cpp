// The k-quant GEMM of csrc/quant_k.cpp (Q4_K, Q5_K, Q6_K) on Intel AMX-INT8 tiles, with its
// bits (csrc/quant_k_amx.h).
//
// The sub-block formula (csrc/quant_k.cpp's header) needs, per output element and sub-block,
// the exact integer dot isum; one tile product gives it for 16 activation rows x 16 weight
// rows (two k8 groups):
//   Q4_K / Q5_K (32-weight sub-blocks, quants unsigned 0..15 / 0..31): A (16 rows x 32
//     bytes) = the sub-block's 32-block of the activations as the VNNI int8 tiles store them
//     (reorder_q8: dword L holds lane L's four elements), read in place with stride K;
//     B row L = weight lane L of the 16 rows, the vector those tiles feed vpdpbusd
//     (csrc/quant_k_lanes.h); tdpbsud (signed activations x unsigned quants).
//   Q6_K (16-weight sub-blocks): A = 16 bytes (lanes 0-3 the 32-block's sub-block A, 4-7 its
//     sub-block B), B the lanes with 32 subtracted from each byte (q - 32 in -32..31),
//     tdpbssd: the "- 32" is in the product, the integer the VNNI tiles get by starting
//     from -32 x the activations' 16-element sum.
// The C tile (int32) of each sub-block is stored, and the vector units do the VNNI tiles'
// fp32 steps lane for lane, sub-blocks in k order:
//     acc = fma(fl(dw_s * dx_b), float(isum_s), acc);  summ = fnma(dm_s, sx_b, summ) (Q4/5_K)
//     y = round(acc + summ (+ bias))                     (Q6_K: acc + 0)
// A sub-block's tile product is issued a step before it is stored and two steps before its
// sums are read back, so the tile unit works while the vector units scale. A work unit (one
// 16-row weight tile x up to kMtChunk 16-row slices of x) builds its tile's B and scales
// once, for all its slices, and while its products run prefetches the weight bytes of the
// unit this thread runs next into L2 (csrc/quant_amx_int.cpp's scheme).
//
// Tiles: 0, 1: C (even, odd sub-blocks); 2, 3: A; 4, 5: B.
#include "quant_k_amx.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <vector>

#include "amx_int.h"
#include "cpu_features.h"
#include "parallel.h"
#include "quant_amx_int.h"
#include "quant_k_lanes.h"
#include "quant_k_layout.h"

namespace tokenserve {

#ifdef TS_HAVE_AMX_INT
namespace {

using namespace kquant;
constexpr int64_t kMtChunk = 8;  // 16-row slices of x per work unit (their B tiles built once)

// Per qtype: sub-blocks per super-block, activation bytes per sub-block (an A tile row) and
// bytes of a sub-block's B tile (KS / 4 dwords x 16 weight rows x 4 bytes).
template <int QT>
struct Sub {
  static constexpr int64_t S = QT == Q6_K ? 16 : 8;
  static constexpr int64_t KS = QKK / S;
  static constexpr int64_t BS = KS / 4 * 64;
};

TS_TARGET_AMX_INT void tiles_configure(int qt) {
  const int ks = qt == Q6_K ? 16 : 32;
  TileConfig c;
  for (int t = 0; t < 2; ++t) c.rows[t] = 16, c.colsb[t] = 64;      // C: 16 x 16 int32
  for (int t = 2; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = ks;      // A: 16 rows x ks bytes
  for (int t = 4; t < 6; ++t) c.rows[t] = ks / 4, c.colsb[t] = 64;  // B: ks / 4 dwords x 16 rows
  asm volatile("" ::"r"(&c) : "memory");  // GCC may drop stores to a struct only ldtilecfg reads
  _tile_loadconfig(&c);
}

struct Problem {
  int qt;
  const int8_t* q8;  // [nmt * 16, K]
  const float* xds;  // [nmt * 16, nb, 2]
  int64_t M, N, K, nsb, nb, nmt, nnt;
  const uint8_t* w;
  int64_t gstride;  // bytes of one 8-row group
  const float* bias;
  void* y;
  bool y_bf16;
};

// Super-block of the weight tile's two groups (ga, gc) -> its sub-blocks' B tiles at bb
// (Sub::BS bytes each) and fp32 scales dw (16 per sub-block; Q4_K / Q5_K also dm).
template <int QT>
TS_TARGET_AMX_INT inline void build_b(const uint8_t* ga, const uint8_t* gc, uint8_t* bb, float* dw, float* dm,
                                      const Q6Lanes512& lanes) {
  if constexpr (QT == Q6_K) {
    const __m512i k32 = _mm512_set1_epi8(32);
    const __m512 d = _mm512_cvtph_ps(pair16(ga, gc));
#pragma GCC unroll 2
    for (int bl = 0; bl < 8; ++bl) {
      const uint8_t* ba = ga + 144 + 192 * bl;
      const uint8_t* bc = gc + 144 + 192 * bl;
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m512i wa, wb;
        q6k_lanes512(lanes, ba, bc, c, wa, wb);
        _mm512_store_si512(bb + 256 * (2 * bl) + 64 * c, _mm512_sub_epi8(wa, k32));
        _mm512_store_si512(bb + 256 * (2 * bl + 1) + 64 * c, _mm512_sub_epi8(wb, k32));
      }
      __m512 dwa, dwb;
      q6k_scales512(d, ga, gc, bl, dwa, dwb);
      _mm512_store_ps(dw + 16 * (2 * bl), dwa);
      _mm512_store_ps(dw + 16 * (2 * bl + 1), dwb);
    }
  } else {
    (void)lanes;
    constexpr int64_t SB = sub_bytes(QT);
    Q45Scales512 scl;
    q45k_scales512(q45k_header512(ga, gc), scl);
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sa = ga + 128 + SB * j;
      const uint8_t* sc_ = gc + 128 + SB * j;
      const __m512i hb = QT == Q5_K ? q5k_fifth512(sa, sc_) : _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) _mm512_store_si512(bb + 512 * j + 64 * p, q45k_lane512<QT>(sa, sc_, hb, p));
      _mm512_store_ps(dw + 16 * j, scl.dw[j]);
      _mm512_store_ps(dm + 16 * j, scl.dm[j]);
    }
  }
}

// Sub-block product into C tile (parity): A at a (stride lda bytes), B at b.
template <int QT>
TS_TARGET_AMX_INT inline void tile_sub(const int8_t* a, int64_t lda, const uint8_t* b, int64_t parity) {
  if (parity) {
    _tile_zero(1);
    _tile_loadd(3, a, lda);
    _tile_loadd(5, b, 64);
    if constexpr (QT == Q6_K) _tile_dpbssd(1, 3, 5);
    else _tile_dpbsud(1, 3, 5);
  } else {
    _tile_zero(0);
    _tile_loadd(2, a, lda);
    _tile_loadd(4, b, 64);
    if constexpr (QT == Q6_K) _tile_dpbssd(0, 2, 4);
    else _tile_dpbsud(0, 2, 4);
  }
}

TS_TARGET_AMX_INT inline void store_c(int64_t parity, int32_t* cb) {
  if (parity) _tile_stored(1, cb, 64);
  else _tile_stored(0, cb, 64);
}

// Weight tile nt (16 rows: groups 2 nt, 2 nt + 1) x 16-row slices [mt0, mt1) of x.
// scratch: B (Sub::BS per sub-block), dw (16 fp32 per sub-block), dm (16 per 32-block), two
// C buffers (1 KB each). next, next_bytes: the weight bytes of the tile this thread runs
// next (null: none), fetched into L2 while this tile's products run, a few lines per step.
template <int QT>
TS_TARGET_AMX_INT void run_tile(const Problem& p, int64_t nt, int64_t mt0, int64_t mt1, uint8_t* bbuf, float* dwv,
                                float* dmv, int32_t* cbuf, const uint8_t* next, int64_t next_bytes) {
  using S = Sub<QT>;
  constexpr int64_t GB = group_bytes(QT);
  alignas(64) static const uint8_t zero_group[group_bytes(Q6_K)] = {};  // a missing second group: d = 0
  const int64_t nsb = p.nsb, nb = p.nb, NG = (p.N + 7) / 8;
  const uint8_t* g0 = p.w + 2 * nt * p.gstride;
  const bool has_g1 = 2 * nt + 1 < NG;
  const Q6Lanes512 lanes = q6k_lane_consts512();
  for (int64_t B = 0; B < nsb; ++B) {
    for (int64_t o = 0; o < GB; o += 64) {  // both group streams, two super-blocks ahead
      _mm_prefetch(reinterpret_cast<const char*>(g0 + (B + 2) * GB + o), _MM_HINT_T0);
      if (has_g1) _mm_prefetch(reinterpret_cast<const char*>(g0 + p.gstride + (B + 2) * GB + o), _MM_HINT_T0);
    }
    build_b<QT>(g0 + B * GB, has_g1 ? g0 + p.gstride + B * GB : zero_group, bbuf + B * S::S * S::BS,
                dwv + B * S::S * 16, dmv + B * 8 * 16, lanes);
  }
  const int64_t ns = nsb * S::S;  // sub-blocks in k order
  const int64_t steps = (mt1 - mt0) * (ns + 2);
  const int64_t lines = next ? (next_bytes + 63) / 64 : 0, per_step = (lines + steps - 1) / steps;
  int64_t line = 0;
  for (int64_t i = 0; i < mt1 - mt0; ++i) {
    // odd weight tiles walk the slices backwards: the slice just done is still in cache
    const int64_t mt = (nt & 1) ? mt1 - 1 - i : mt0 + i;
    const int8_t* xm = p.q8 + 16 * mt * p.K;
    const float* xds = p.xds + 16 * mt * nb * 2;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    // step s: sub-block s's tile product, s - 1's store, s - 2's fp32 steps
    for (int64_t s = 0; s < ns + 2; ++s) {
      for (int64_t e = std::min(lines, line + per_step); line < e; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(next + 64 * line), _MM_HINT_T1);
      if (s < ns) tile_sub<QT>(xm + S::KS * s, p.K, bbuf + S::BS * s, s & 1);
      if (s >= 1 && s <= ns) store_c((s - 1) & 1, cbuf + 256 * ((s - 1) & 1));
      if (s >= 2) {
        const int64_t sb = s - 2, b = QT == Q6_K ? sb / 2 : sb;
        const int32_t* c = cbuf + 256 * (sb & 1);
        const __m512 dw = _mm512_load_ps(dwv + 16 * sb);
        const float* dx = xds + 2 * b;
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) {
          const __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nb * 2]));
          acc[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)), acc[r]);
        }
      }
    }
    alignas(64) float out[256];
    if constexpr (QT == Q6_K) {
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) _mm512_store_ps(out + 16 * r, _mm512_add_ps(acc[r], _mm512_setzero_ps()));
    } else {
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) _mm512_store_ps(out + 16 * r, acc[r]);
      __m512 summ[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) summ[r] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {  // 16 independent chains, b in order in each
        const __m512 dm = _mm512_load_ps(dmv + 16 * b);
        const float* sx = xds + 2 * b + 1;
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) summ[r] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(sx[r * nb * 2]), summ[r]);
      }
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r)
        _mm512_store_ps(out + 16 * r, _mm512_add_ps(_mm512_load_ps(out + 16 * r), summ[r]));
    }
    amx::store_out16(out, std::min<int64_t>(16, p.M - 16 * mt), 16 * mt, 16 * nt, p.N, p.bias, p.y, p.y_bf16);
  }
}

// Task t's share of the work units (unit u: chunk u / nnt of 16-row slices x weight tile
// u % nnt; its own range first, then what is left of the others', csrc/parallel.h), its
// tiles configured for the call and released after it.
TS_TARGET_AMX_INT void run_task(const Problem& p, StealingRanges& ranges, int64_t t) {
  thread_local std::vector<uint8_t> scratch;
  // B: 16 bytes per weight (K x 16 rows); dw: 64 bytes per sub-block (<= K / 16); dm: 64 per 32-block
  const size_t need = size_t(p.K) * 16 + size_t(p.K) * 4 + size_t(p.K) * 2 + 2048 + 128;
  if (scratch.size() < need) scratch.resize(need);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  float* dwv = reinterpret_cast<float*>(base + p.K * 16);
  float* dmv = dwv + p.K;  // K / 16 sub-blocks x 16
  int32_t* cbuf = reinterpret_cast<int32_t*>(dmv + p.K / 2);
  tiles_configure(p.qt);
  const int64_t NG = (p.N + 7) / 8;
  for (int64_t k = 0, u, end; (u = ranges.claim(t, k, &end)) >= 0;) {
    const int64_t chunk = u / p.nnt, nt = u % p.nnt;
    const int64_t mt0 = chunk * kMtChunk, mt1 = std::min(p.nmt, (chunk + 1) * kMtChunk);
    // the weight groups of the range's next unit, most likely this thread's next
    const uint8_t* next = nullptr;
    int64_t next_bytes = 0;
    if (u + 1 < end) {
      const int64_t g = 2 * ((u + 1) % p.nnt);
      next = p.w + g * p.gstride;
      next_bytes = (std::min<int64_t>(NG, g + 2) - g) * p.gstride;
    }
    if (p.qt == Q4_K) run_tile<Q4_K>(p, nt, mt0, mt1, base, dwv, dmv, cbuf, next, next_bytes);
    else if (p.qt == Q5_K) run_tile<Q5_K>(p, nt, mt0, mt1, base, dwv, dmv, cbuf, next, next_bytes);
    else run_tile<Q6_K>(p, nt, mt0, mt1, base, dwv, dmv, cbuf, next, next_bytes);
  }
  _tile_release();  // back to the init state: a context switch saves no tile data
}

}  // namespace
#endif  // TS_HAVE_AMX_INT

void quant_k_amx_gemm(int qt, const int8_t* q8, const float* xds, int64_t M, int64_t K, const uint8_t* w,
                      int64_t N, const float* bias, void* y, bool y_bf16) {
  assert(quant_amx_int_available() && K % kquant::QKK == 0 && kquant::is_k_type(qt));
#ifdef TS_HAVE_AMX_INT
  const int64_t nsb = K / kquant::QKK, nmt = (M + 15) / 16, nnt = (N + 15) / 16;
  const Problem p{qt, q8, xds, M, N, K, nsb, K / 32, nmt, nnt, w, nsb * kquant::group_bytes(qt), bias, y, y_bf16};
  // work units: (chunk of up to kMtChunk 16-row slices, weight tile), weight tiles inner; a
  // range per thread, the idle one taking the others' units (csrc/parallel.h)
  const int64_t units = (nmt + kMtChunk - 1) / kMtChunk * nnt;
  const int64_t grain = std::max<int64_t>(1, 8 / (nsb * std::min<int64_t>(nmt, kMtChunk)));
  parallel_tasks(units, std::min<int64_t>(at::get_num_threads(), (units + grain - 1) / grain),
                 [&](int64_t t, StealingRanges& ranges) { run_task(p, ranges, t); });
#else
  (void)q8; (void)xds; (void)M; (void)w; (void)N; (void)bias; (void)y; (void)y_bf16;
#endif
}

}  // namespace tokenserve
