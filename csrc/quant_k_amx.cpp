// The k-quant GEMM of csrc/quant_k.cpp (Q4_K, Q5_K, Q6_K) on Intel AMX-INT8 tiles, with its
// bits (csrc/quant_k_amx.h).
//
// The super-block formula (csrc/quant_k.cpp's header) needs, per output element and
// super-block, the exact integers isum = sum_s sc_s * dot_s and (Q4_K / Q5_K) msum =
// sum_s m_s * bs_s, then two fp32 fmas.
//   Q4_K / Q5_K: the 6-bit scales go into the B operand, so the tile unit sums a whole
//     super-block: sc = 8 h + l (h, l = 0..7), and B_h = q * h, B_l = q * l are bytes
//     (q <= 31: <= 217; vpmullw on the lane's 16-bit words gives them, no carry between
//     bytes). Per pair of sub-blocks one A tile (16 activation rows x 64 bytes: two 32-blocks
//     of the activations as the VNNI int8 tiles store them, reorder_q8, read in place with
//     stride K) and two tdpbsud (signed activations x unsigned B) into C_h and C_l; after
//     the super-block's four pairs isum = 8 C_h + C_l. msum (the mins against the
//     activations' 32-element sums) is four vpdpwssd per row, then the fp32 step.
//   Q6_K (16-weight sub-blocks, int8 scales of either sign): the product p = (q - 32) * sc
//     of a weight and its sub-block's scale is exact in int16 (|p| <= 4096), and p = 256 hi +
//     lo splits into a signed byte hi (-16..15) and an unsigned lo: B_h = hi, B_l = lo
//     (q6k_fold512), tdpbssd into C_h and tdpbsud into C_l per 64 deep, isum = 256 C_h + C_l,
//     then the fp32 step (one fma: no mins).
//   Not folded (Q4_K / Q5_K on one 16-row slice, where the folded B costs more to build than
//     it saves): one tdpbsud per 32-weight sub-block, its C tile stored and scaled into isum
//     by the vector units (vpmulld), the fp32 step once per super-block.
// A (super-)block's tile products are issued a step before their C tiles are stored and two
// steps before the stores are read back, so the tile unit works while the vector units
// scale. A work unit (one 16-row weight tile x up to kMtChunk 16-row slices of x) builds its
// tile's B and scales once, a super-block at a time into a ring of three slots that stays in
// L1, while the previous super-block's products run; each super-block serves all the unit's
// slices in turn (their fp32 accumulators in memory). While its products run it prefetches
// the weight bytes of the unit this thread runs next into L2 (csrc/quant_amx_int.cpp's
// scheme).
//
// Tiles, fold: 0, 1: C_h, C_l (even super-blocks); 2, 3: (odd); 4: A; 5, 6: B_h, B_l. Not
// fold: 0, 1: C (even, odd sub-blocks); 2, 3: A; 4, 5: B.
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

// fold: the scales in B (K = 64 products); else one product per 32-weight sub-block
// (Q4_K / Q5_K).
TS_TARGET_AMX_INT void tiles_configure(bool fold) {
  TileConfig c;
  if (!fold) {
    const int ks = 32;
    for (int t = 0; t < 2; ++t) c.rows[t] = 16, c.colsb[t] = 64;      // C: 16 x 16 int32
    for (int t = 2; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = ks;      // A: 16 rows x ks bytes
    for (int t = 4; t < 6; ++t) c.rows[t] = ks / 4, c.colsb[t] = 64;  // B: ks / 4 dwords x 16 rows
  } else {
    for (int t = 0; t < 7; ++t) c.rows[t] = 16, c.colsb[t] = 64;  // C 16 x 16 int32; A 16 x 64; B 16 x 16 x 4
  }
  asm volatile("" ::"r"(&c) : "memory");  // GCC may drop stores to a struct only ldtilecfg reads
  _tile_loadconfig(&c);
}

struct Problem {
  int qt;
  const int8_t* q8;    // tiled: [nmt, K / 64, 16, 64] (a_tile)
  const float* xd;     // [nmt * 16, nsb]
  const int16_t* xbs;  // [nmt * 16, nb]
  int64_t M, N, K, nsb, nb, nmt, nnt;
  bool fold;  // the scales folded into B (Q6_K always, Q4_K / Q5_K from two 16-row slices)
  const uint8_t* w;
  int64_t gstride;  // bytes of one 8-row group
  const float* bias;
  void* y;
  bool y_bf16;
};

// Per super-block of a weight tile: the bytes of its B tiles, and of its scales (hdr).
//   Q4_K / Q5_K, fold: B_h then B_l, each 8 sub-blocks x 8 lanes x 64 bytes (a pair's B
//     tile: 1 KB at 1024 i); not fold: the lanes as they are, 8 sub-blocks x 512 bytes.
//     hdr: d, dmin (16 fp32 each), the min pairs mp[4], the sub-block scales sc[8] (16 int32
//     each).
//   Q6_K (always folded): B_h then B_l, each 16 sub-blocks x 4 lanes x 64 bytes (a 64-deep B
//     tile: 1 KB at 1024 i); hdr: d (16 fp32).
template <int QT>
struct Super {
  static constexpr int64_t kB = 2 * 4096;
  static constexpr int64_t kHdr = QT == Q6_K ? 16 * 4 : (16 + 16 + 4 * 16 + 8 * 16) * 4;
  static constexpr int64_t kSc = 384;  // Q4_K / Q5_K: hdr offset of sub-block 0's scales
};
// Super-blocks whose B a work unit holds at once (run_tile's ring: building, in products,
// being stored) and the scratch they take per thread (run_task).
constexpr int64_t kRing = 3;
constexpr int64_t kRingHdr = std::max(Super<Q4_K>::kHdr, Super<Q6_K>::kHdr);

// Q6_K's fold: a lane of weights v = q - 32 (signed bytes, -32..31) times its column's scale
// (sc: int32 lanes, -128..127) is p = v * sc, |p| <= 4096, exact in int16 (vpmullw on the even
// and the odd bytes as words); p = 256 hi + lo with hi = p >> 8 a signed byte (-16..15) and lo =
// p & 255 an unsigned one, stored to bh and bl: the tiles' 256 C_h + C_l is sum_s sc_s * dot_s.
TS_TARGET_AMX_INT inline void q6k_fold512(__m512i v, __m512i sc, uint8_t* bh, uint8_t* bl) {
  const __m512i sw = _mm512_or_si512(_mm512_and_si512(sc, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(sc, 16));
  const __m512i pe = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), sw);  // even bytes
  const __m512i po = _mm512_mullo_epi16(_mm512_srai_epi16(v, 8), sw);                        // odd bytes
  const __m512i lo8 = _mm512_set1_epi16(0x00ff), hi8 = _mm512_set1_epi16(int16_t(0xff00));
  _mm512_store_si512(bl, _mm512_ternarylogic_epi32(pe, _mm512_slli_epi16(po, 8), lo8, 0xEC));  // (a & c) | b
  _mm512_store_si512(bh, _mm512_ternarylogic_epi32(_mm512_srli_epi16(pe, 8), po, hi8, 0xF8));  // a | (b & c)
}

// Super-block of the weight tile's two groups (ga, gc) -> its B tiles at bb and scales at hdr
// (Super<QT>).
template <int QT>
TS_TARGET_AMX_INT inline void build_b(const uint8_t* ga, const uint8_t* gc, uint8_t* bb, uint8_t* hdr,
                                      const Q6Lanes512& lanes, bool fold) {
  if constexpr (QT == Q6_K) {
    assert(fold);
    const __m512i k32 = _mm512_set1_epi8(32);
#pragma GCC unroll 2
    for (int bl = 0; bl < 8; ++bl) {
      const uint8_t* ba = ga + 144 + 192 * bl;
      const uint8_t* bc = gc + 144 + 192 * bl;
      __m512i sa, sb;
      q6k_iscales512(ga, gc, bl, sa, sb);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {  // sub-blocks 2 bl, 2 bl + 1: 256 bytes each, a lane per c
        __m512i wa, wb;
        q6k_lanes512(lanes, ba, bc, c, wa, wb);
        uint8_t* oa = bb + 256 * (2 * bl) + 64 * c;
        uint8_t* ob = bb + 256 * (2 * bl + 1) + 64 * c;
        q6k_fold512(_mm512_sub_epi8(wa, k32), sa, oa, oa + 4096);
        q6k_fold512(_mm512_sub_epi8(wb, k32), sb, ob, ob + 4096);
      }
    }
    _mm512_store_ps(reinterpret_cast<float*>(hdr), _mm512_cvtph_ps(pair16(ga, gc)));
  } else {
    (void)lanes;
    constexpr int64_t SB = sub_bytes(QT);
    static_assert(Super<QT>::kSc == 384);
    const Q45Header512 h = q45k_header512(ga, gc);
    Q45Ints512 in;
    q45k_ints512(h, in);
    const __m512i k7 = _mm512_set1_epi32(7);
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sa = ga + 128 + SB * j;
      const uint8_t* sc_ = gc + 128 + SB * j;
      const __m512i hb = QT == Q5_K ? q5k_fifth512(sa, sc_) : _mm512_setzero_si512();
      const __m512i sc = _mm512_load_si512(in.sc[j]);
      _mm512_store_si512(hdr + 384 + 64 * j, sc);
      if (!fold) {
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) _mm512_store_si512(bb + 512 * j + 64 * p, q45k_lane512<QT>(sa, sc_, hb, p));
        continue;
      }
      const __m512i hi = _mm512_srli_epi32(sc, 3), lo = _mm512_and_si512(sc, k7);
      const __m512i hw = _mm512_or_si512(hi, _mm512_slli_epi32(hi, 16));  // (h, h) 16-bit words
      const __m512i lw = _mm512_or_si512(lo, _mm512_slli_epi32(lo, 16));
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const __m512i w = q45k_lane512<QT>(sa, sc_, hb, p);
        _mm512_store_si512(bb + 512 * j + 64 * p, _mm512_mullo_epi16(w, hw));
        _mm512_store_si512(bb + 4096 + 512 * j + 64 * p, _mm512_mullo_epi16(w, lw));
      }
    }
    _mm512_store_ps(reinterpret_cast<float*>(hdr), h.d);
    _mm512_store_ps(reinterpret_cast<float*>(hdr + 64), h.dmin);
    for (int i = 0; i < 4; ++i) _mm512_store_si512(hdr + 128 + 64 * i, in.mp[i]);
  }
}

// The activations' A tiles: 16 rows x 64 bytes contiguous, a slice's in depth order. Read in
// place with stride K, the 16 rows of a tile fall in one or two L1 sets (K = 8192: one) and
// evict each other; copied once per GEMM (M x K bytes) the products run 3-14 % faster
// (bench/README.md "Q6_K's scales in the AMX tiles").
TS_TARGET_AMX_INT void tile_rows_q8(const int8_t* q8, int64_t nmt, int64_t K, int8_t* out) {
  for (int64_t mt = 0; mt < nmt; ++mt)
    for (int64_t kb = 0; kb < K / 64; ++kb)
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r)
        _mm512_store_si512(out + ((mt * (K / 64) + kb) * 16 + r) * 64,
                           _mm512_loadu_si512(q8 + (16 * mt + r) * K + 64 * kb));
}

// The A tile of slice mt at depth k (a multiple of 32) in the tiled activations (stride 64).
inline const int8_t* a_tile(const int8_t* q8, int64_t K, int64_t mt, int64_t k) {
  return q8 + (mt * (K / 64) + k / 64) * 1024 + k % 64;
}

// fold: super-block sb's four 64-deep products into C pair (parity): A at a (tiled: the
// next 64 deep 1 KB on), B_h at b, B_l at b + 4096 (Q6_K's B_h signed: tdpbssd).
template <int QT>
TS_TARGET_AMX_INT inline void tile_super(const int8_t* a, const uint8_t* b, int64_t parity) {
#define TS_KQ_PAIRS(CH, CL)                                         \
  _tile_zero(CH);                                                   \
  _tile_zero(CL);                                                   \
  for (int i = 0; i < 4; ++i) {                                     \
    _tile_loadd(4, a + 1024 * i, 64);                               \
    _tile_loadd(5, b + 1024 * i, 64);                               \
    _tile_loadd(6, b + 4096 + 1024 * i, 64);                        \
    if constexpr (QT == Q6_K) _tile_dpbssd(CH, 4, 5);               \
    else _tile_dpbsud(CH, 4, 5);                                    \
    _tile_dpbsud(CL, 4, 6);                                         \
  }
  if (parity) {
    TS_KQ_PAIRS(2, 3)
  } else {
    TS_KQ_PAIRS(0, 1)
  }
#undef TS_KQ_PAIRS
}

TS_TARGET_AMX_INT inline void store_c2(int64_t parity, int32_t* cb) {
  if (parity) {
    _tile_stored(2, cb, 64);
    _tile_stored(3, cb + 256, 64);
  } else {
    _tile_stored(0, cb, 64);
    _tile_stored(1, cb + 256, 64);
  }
}

// One product per sub-block (Q4_K / Q5_K, not fold): sub-block product into C tile (parity):
// A at a (tiled, stride 64), B at b; signed activations x unsigned quants.
TS_TARGET_AMX_INT inline void tile_sub(const int8_t* a, const uint8_t* b, int64_t parity) {
  if (parity) {
    _tile_zero(1);
    _tile_loadd(3, a, 64);
    _tile_loadd(5, b, 64);
    _tile_dpbsud(1, 3, 5);
  } else {
    _tile_zero(0);
    _tile_loadd(2, a, 64);
    _tile_loadd(4, b, 64);
    _tile_dpbsud(0, 2, 4);
  }
}

TS_TARGET_AMX_INT inline void store_c1(int64_t parity, int32_t* cb) {
  if (parity) _tile_stored(1, cb, 64);
  else _tile_stored(0, cb, 64);
}

// A Q4_K / Q5_K super-block's fp32 step for one activation row (hd: its hdr, bs: the row's
// 8 32-element sums, dx: its scale): msum from the min pairs, then the two fmas onto acc.
TS_TARGET_AMX_INT inline __m512 q45_step(const uint8_t* hd, __m512i isum, const int16_t* bs, float dx, __m512 acc) {
  __m512i ms = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_load_si512(hd + 128), qact::xpair512(bs, 0));
  for (int k = 1; k < 4; ++k)
    ms = _mm512_dpwssd_epi32(ms, _mm512_load_si512(hd + 128 + 64 * k), qact::xpair512(bs, 2 * k));
  const __m512 vdx = _mm512_set1_ps(dx);
  const __m512 d = _mm512_load_ps(reinterpret_cast<const float*>(hd));
  const __m512 dmin = _mm512_load_ps(reinterpret_cast<const float*>(hd + 64));
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, vdx), _mm512_cvtepi32_ps(isum), acc);
  return _mm512_fnmadd_ps(_mm512_mul_ps(dmin, vdx), _mm512_cvtepi32_ps(ms), acc);
}

// Weight tile nt (16 rows: groups 2 nt, 2 nt + 1) x 16-row slices [mt0, mt1) of x.
// scratch: B and hdr (Super<QT> per super-block), two C buffers (2 KB each). next,
// next_bytes: the weight bytes of the tile this thread runs next (null: none), fetched into
// L2 while this tile's products run, a few lines per step.
template <int QT>
TS_TARGET_AMX_INT void run_tile(const Problem& p, int64_t nt, int64_t mt0, int64_t mt1, uint8_t* bbuf,
                                uint8_t* hbuf, int32_t* cbuf, const uint8_t* next, int64_t next_bytes) {
  using S = Super<QT>;
  constexpr int64_t GB = group_bytes(QT);
  alignas(64) static const uint8_t zero_group[group_bytes(Q6_K)] = {};  // a missing second group: d = 0
  const int64_t nsb = p.nsb, nb = p.nb, NG = (p.N + 7) / 8;
  const uint8_t* g0 = p.w + 2 * nt * p.gstride;
  const bool has_g1 = 2 * nt + 1 < NG;
  const Q6Lanes512 lanes = q6k_lane_consts512();
  // Super-block B's B tiles and scales are built once, in ring slot B % kRing, while the
  // products of the super-block before run, and every slice reads them from L1 (the whole
  // tile's B, 32-64 KB per 2048 of K, would be read back from L2 per slice).
  auto slot = [](int64_t B) { return B % kRing; };
  auto build = [&](int64_t B) {
    for (int64_t o = 0; o < GB; o += 64) {  // both group streams, two super-blocks ahead
      _mm_prefetch(reinterpret_cast<const char*>(g0 + (B + 2) * GB + o), _MM_HINT_T0);
      if (has_g1) _mm_prefetch(reinterpret_cast<const char*>(g0 + p.gstride + (B + 2) * GB + o), _MM_HINT_T0);
    }
    build_b<QT>(g0 + B * GB, has_g1 ? g0 + p.gstride + B * GB : zero_group, bbuf + slot(B) * S::kB,
                hbuf + slot(B) * S::kHdr, lanes, p.fold);
  };
  build(0);
  const int64_t nm = mt1 - mt0;
  constexpr int64_t per_super = 8;  // not fold: product steps (sub-blocks) per super-block
  constexpr int64_t KS = QKK / 8;   // weights per sub-block (not fold)
  const int64_t ns = p.fold ? nsb * nm : nsb * per_super;  // product steps
  const int64_t steps = ns + 2;
  const int64_t lines = next ? (next_bytes + 63) / 64 : 0, per_step = (lines + steps - 1) / steps;
  int64_t line = 0;
  auto prefetch_next = [&] {  // this step's share of the next unit's lines
    for (int64_t e = std::min(lines, line + per_step); line < e; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(next + 64 * line), _MM_HINT_T1);
  };
  // odd weight tiles walk the slices backwards: the slice just done is still in cache
  auto mt_at = [&](int64_t i) { return (nt & 1) ? mt1 - 1 - i : mt0 + i; };
  if (p.fold) {
    // super-blocks outer: step t = (super-block t / nm, slice t % nm): its tile products,
    // t - 1's C stores, t - 2's fp32 step into that slice's accumulators (in memory); each
    // super-block's B built at its predecessor's first step (6-23 % faster at 32-128 rows
    // than slices outer with the whole tile's B built up front)
    alignas(64) float acc[kMtChunk][256];
    for (int64_t i = 0; i < nm; ++i)
      for (int r = 0; r < 16; ++r) _mm512_store_ps(acc[i] + 16 * r, _mm512_setzero_ps());
    constexpr int kH = QT == Q6_K ? 8 : 3;  // isum = C_h << kH + C_l
    for (int64_t t = 0; t < ns + 2; ++t) {
      prefetch_next();
      if (t < ns) tile_super<QT>(a_tile(p.q8, p.K, mt_at(t % nm), QKK * (t / nm)), bbuf + S::kB * slot(t / nm), t & 1);
      if (t >= 1 && t <= ns) store_c2((t - 1) & 1, cbuf + 512 * ((t - 1) & 1));
      if (t >= 2) {
        const int64_t u = t - 2, B = u / nm, mt = mt_at(u % nm);
        const int32_t* c = cbuf + 512 * (u & 1);
        const uint8_t* hd = hbuf + slot(B) * S::kHdr;
        const float* xd = p.xd + 16 * mt * nsb;
        const int16_t* xbs = p.xbs + 16 * mt * nb;
        float* a = acc[u % nm];
        const __m512 d = _mm512_load_ps(reinterpret_cast<const float*>(hd));  // Q6_K's (Q4_K / Q5_K: q45_step's)
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) {
          const __m512i is = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c + 16 * r), kH),
                                              _mm512_load_si512(c + 256 + 16 * r));
          const __m512 ar = _mm512_load_ps(a + 16 * r);
          if constexpr (QT == Q6_K)
            _mm512_store_ps(a + 16 * r, _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xd[r * nsb + B])),
                                                        _mm512_cvtepi32_ps(is), ar));
          else
            _mm512_store_ps(a + 16 * r, q45_step(hd, is, xbs + r * nb + 8 * B, xd[r * nsb + B], ar));
        }
      }
      // the next super-block's B at this one's first step, into the slot of super-block
      // t / nm - 2, whose products are stored and whose scales were read (one slice: this
      // step's fp32 step, above)
      if (t < ns && t % nm == 0 && t / nm + 1 < nsb) build(t / nm + 1);
    }
    for (int64_t i = 0; i < nm; ++i) {
      const int64_t mt = mt_at(i);
      amx::store_out16(acc[i], std::min<int64_t>(16, p.M - 16 * mt), 16 * mt, 16 * nt, p.N, p.bias, p.y, p.y_bf16);
    }
    return;
  }
  // not fold (Q4_K / Q5_K, one slice): step s: sub-block s's tile product, s - 1's store,
  // s - 2's scaling (and at the end of a super-block its fp32 step)
  if constexpr (QT != Q6_K) {
    assert(nm == 1);
    const int64_t mt = mt_at(0);
    const float* xd = p.xd + 16 * mt * nsb;
    const int16_t* xbs = p.xbs + 16 * mt * nb;
    alignas(64) float out[256];
    for (int r = 0; r < 16; ++r) _mm512_store_ps(out + 16 * r, _mm512_setzero_ps());
    __m512i isb[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) isb[r] = _mm512_setzero_si512();
    for (int64_t s = 0; s < ns + 2; ++s) {
      prefetch_next();
      if (s < ns)
        tile_sub(a_tile(p.q8, p.K, mt, KS * s), bbuf + S::kB * slot(s / per_super) + KS * 16 * (s % per_super), s & 1);
      if (s >= 1 && s <= ns) store_c1((s - 1) & 1, cbuf + 256 * ((s - 1) & 1));
      // the next super-block's B, while this one's products run (its slot's last products,
      // super-block s / per_super - 2's, were stored two super-blocks ago)
      if (s < ns && s % per_super == 0 && s / per_super + 1 < nsb) build(s / per_super + 1);
      if (s >= 2) {
        const int64_t sb = s - 2, B = sb / per_super;
        const int32_t* c = cbuf + 256 * (sb & 1);
        const uint8_t* hd = hbuf + slot(B) * S::kHdr;
        const __m512i sc = _mm512_load_si512(hd + S::kSc + 64 * (sb % per_super));
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r)
          isb[r] = _mm512_add_epi32(isb[r], _mm512_mullo_epi32(_mm512_load_si512(c + 16 * r), sc));
        if (sb % per_super == per_super - 1) {  // the super-block's fp32 step
#pragma GCC unroll 4
          for (int r = 0; r < 16; ++r) {
            _mm512_store_ps(out + 16 * r, q45_step(hd, isb[r], xbs + r * nb + 8 * B, xd[r * nsb + B],
                                                   _mm512_load_ps(out + 16 * r)));
            isb[r] = _mm512_setzero_si512();
          }
        }
      }
    }
    amx::store_out16(out, std::min<int64_t>(16, p.M - 16 * mt), 16 * mt, 16 * nt, p.N, p.bias, p.y, p.y_bf16);
  }
}

// Task t's share of the work units (unit u: chunk u / nnt of 16-row slices x weight tile
// u % nnt; its own range first, then what is left of the others', csrc/parallel.h), its
// tiles configured for the call and released after it.
TS_TARGET_AMX_INT void run_task(const Problem& p, StealingRanges& ranges, int64_t t) {
  thread_local std::vector<uint8_t> scratch;
  // B and hdr: the ring's super-blocks (run_tile); C: 4 KB
  const size_t bbytes = kRing * Super<Q4_K>::kB, hbytes = kRing * kRingHdr;
  const size_t need = bbytes + hbytes + 4096 + 128;
  if (scratch.size() < need) scratch.resize(need);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  uint8_t* hbuf = base + bbytes;
  int32_t* cbuf = reinterpret_cast<int32_t*>(hbuf + (hbytes + 63) / 64 * 64);
  tiles_configure(p.fold);
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
    if (p.qt == Q4_K) run_tile<Q4_K>(p, nt, mt0, mt1, base, hbuf, cbuf, next, next_bytes);
    else if (p.qt == Q5_K) run_tile<Q5_K>(p, nt, mt0, mt1, base, hbuf, cbuf, next, next_bytes);
    else run_tile<Q6_K>(p, nt, mt0, mt1, base, hbuf, cbuf, next, next_bytes);
  }
  _tile_release();  // back to the init state: a context switch saves no tile data
}

}  // namespace
#endif  // TS_HAVE_AMX_INT

void quant_k_amx_gemm(int qt, const int8_t* q8, const float* xd, const int16_t* xbs, int64_t M, int64_t K,
                      const uint8_t* w, int64_t N, const float* bias, void* y, bool y_bf16) {
  assert(quant_amx_int_available() && K % kquant::QKK == 0 && kquant::is_k_type(qt));
#ifdef TS_HAVE_AMX_INT
  const int64_t nsb = K / kquant::QKK, nmt = (M + 15) / 16, nnt = (N + 15) / 16;
  // Q4_K / Q5_K on one 16-row slice: each weight tile's B serves one product step, and the
  // unscaled lanes (one product per sub-block, the scales applied to its C tile) cost less to
  // build than the folded ones save; Q6_K's 16-weight sub-blocks would need a C store each
  const bool fold = qt == kquant::Q6_K || nmt >= kAmxKFoldSlices;
  // the calling thread's, grown and reused (tile_rows_q8 writes every byte read; resize
  // down and up again would zero the regrown part on every call): [nmt, K / 64, 16, 64]
  thread_local std::vector<int8_t> tiled;
  if (tiled.size() < size_t(nmt) * 16 * K + 64) tiled.resize(size_t(nmt) * 16 * K + 64);
  int8_t* qa = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(tiled.data()) + 63) & ~uintptr_t(63));
  tile_rows_q8(q8, nmt, K, qa);
  const Problem p{qt,   qa,   xd, xbs, M, N, K, nsb, K / 32, nmt, nnt, fold, w, nsb * kquant::group_bytes(qt),
                  bias, y,    y_bf16};
  // work units: (chunk of up to kMtChunk 16-row slices, weight tile), weight tiles inner; a
  // range per thread, the idle one taking the others' units (csrc/parallel.h)
  const int64_t units = (nmt + kMtChunk - 1) / kMtChunk * nnt;
  const int64_t grain = std::max<int64_t>(1, 8 / (nsb * std::min<int64_t>(nmt, kMtChunk)));
  parallel_tasks(units, std::min<int64_t>(at::get_num_threads(), (units + grain - 1) / grain),
                 [&](int64_t t, StealingRanges& ranges) { run_task(p, ranges, t); });
#else
  (void)q8; (void)xd; (void)xbs; (void)M; (void)w; (void)N; (void)bias; (void)y; (void)y_bf16;
#endif
}

}  // namespace tokenserve
