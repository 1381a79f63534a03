// The GGUF block GEMM of csrc/quant.cpp (Q4_0, Q4_1, Q8_0 on x8-packed weights) on Intel
// AMX-INT8 tiles, with csrc/quant.cpp's bits: quant_gemm hands a GEMM of at least
// kAmxIntMinRows rows here where the CPU and OS allow (csrc/quant_amx_int.h).
//
// The block formula (csrc/quant.cpp's header) needs, per output element and 32-block, the
// exact integer dot isum = sum_k qw[k] * qx[k]; then the same fp32 steps as the VNNI tiles:
//
//     acc = fma(fl(dw_b * dx_b), float(isum_b), acc)     b = 0 .. nb - 1, in order
//     summ = fma(mw_b, sx_b, summ)                         (Q4 formats)
//     y = round(acc + summ (+ bias))
//
// The activations are int12 (|qx| <= 2047, csrc/quant_act.h), so qx = 16 h + l exactly with
// h a signed byte and l = 0..15, and the int8 tile product gives isum exactly (int32):
//
//   Q4 (q = 0..15): A (activations, signed bytes) holds per row and block 16 quads
//     (l_j, h_j, l_{16+j}, h_{16+j}); B (weights, unsigned bytes) holds per weight row the
//     quad (q_j, 16 q_j, q_{16+j}, 16 q_{16+j}) (16 q <= 240), so one tdpbsud sums
//     q_j (l_j + 16 h_j) + q_{16+j} (...) = q_j qx_j + q_{16+j} qx_{16+j}: one tile product
//     per 16 rows x 16 weight rows x block. A GGUF byte j holds q_j (low nibble) and q_{16+j}
//     (high), so each B quad is one weight byte spread out (vpermt2b, vpmultishiftqb, and).
//   Q8_0 (q signed): the l and h planes are two A tiles (k in order), B the quants as they
//     are; isum = tdpbusd(l, q) + 16 tdpbssd(h, q).
//
// The C tile (int32) of each block is stored and the vector units do the fp32 steps row by
// row: the block's scales differ per weight row and activation row, so the tile unit cannot
// sum across blocks. A block's tile product is issued a step before it is stored and two
// steps before its sums are read back, so the tile unit works while the vector units scale.
// Where the time goes (Sapphire Rapids, one thread, gate_up [3072, 576] at 64 rows, weights
// in cache, each part left out in turn): 448 us = tile loads, products and C stores ~180,
// the fp32 steps ~90, the Q4 offset sums ~45, spreading the weight bytes ~45, quantising
// and packing x and storing y ~60 (the VNNI tiles: 923 us; csrc/quant_amx.cpp's bf16
// tiles, other bits: 285 us). Tried, no gain: AVX-512 stores of y, prefetching A a block
// ahead, 2 or 1 slices per unit (A in L1, B rebuilt more often: slower).
// In a real step the weights come from DRAM (the KV and the other layers' weights evict
// them), and a unit reads its tile's bytes in one burst (building B) before the products:
// the burst waited on memory while the tile unit idled (gate_up at 64 rows, 2 threads, 240
// distinct weights: 0.321 ms a call vs 0.229 with one weight in cache). So while a tile's
// products run, the thread prefetches the next unit's weight bytes into L2, a few lines a
// step: 0.247 ms a call from DRAM; the decode step at 64 rows 45.2 -> 40.1 ms.
//
// Tiles: Q4 - 0, 1: C (even, odd blocks); 2, 3: A; 4, 5: B; all 16 rows x 64 bytes.
//        Q8_0 - 0-3: C (l and h, even and odd blocks); 4, 5: A l, h (16 x 32 bytes);
//        6: B (8 rows x 64 bytes).
#include "quant_amx_int.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_int.h"
#include "cpu_features.h"
#include "parallel.h"
#include "simd.h"


namespace tokenserve {

bool quant_amx_int_available() {
#ifdef TS_HAVE_AMX_INT
  return cpu_features().amx_int8 && amx_tiles_permitted();
#else
  return false;
#endif
}

#ifdef TS_HAVE_AMX_INT
namespace {

using x8::kGroupBytes;
using x8::kQuantOffset;
using x8::Q4_0;
using x8::Q4_1;
using x8::Q8_0;
constexpr int64_t QK = 32;
constexpr int64_t kMtChunk = 8;  // 16-row slices of x per work unit (their B tiles built once)
constexpr int64_t kPrefetchBlocks = 8;  // weight blocks ahead in each group stream

TS_TARGET_AMX_INT void tiles_configure(int qt) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  if (qt == Q8_0) {
    c.colsb[4] = c.colsb[5] = 32;  // A: 16 rows x 32 k (bytes)
    c.rows[6] = 8;                 // B: 8 k-quads x 16 weight rows x 4 bytes
    c.rows[7] = 0, c.colsb[7] = 0;
  }
  asm volatile("" ::"r"(&c) : "memory");  // GCC may drop stores to a struct only ldtilecfg reads
  _tile_loadconfig(&c);
}

// Activations: xq [M, K] int16 (|q| <= 2047) -> xa [nmt][nb][1024 bytes] (rows past M zero).
//   Q4: row r of a block at 64 r: quads (l_j, h_j, l_{16+j}, h_{16+j}), j = 0..15
//   Q8: l plane at 32 r, h plane at 512 + 32 r, k in order
// Units [u0, u1) of (slice mt, block b) = u / nb, u % nb.
TS_TARGET_AMX_INT void pack_a(int qt, const int16_t* xq, int64_t M, int64_t K, int8_t* xa, int64_t u0, int64_t u1) {
  const int64_t nb = K / QK;
  const __m512i lo4 = _mm512_set1_epi16(0x0f);
  // word j of the quad vector: element j / 2 + 16 (j & 1)  (dword j = words j, 16 + j)
  alignas(64) uint16_t perm[32];
  for (int j = 0; j < 32; ++j) perm[j] = uint16_t(j / 2 + 16 * (j & 1));
  const __m512i quad = _mm512_load_si512(perm);
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t mt = u / nb, b = u % nb;
    int8_t* o = xa + u * 1024;
    const int64_t rows = std::min<int64_t>(16, M - 16 * mt);
    if (rows < 16) std::memset(o, 0, 1024);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i x = _mm512_loadu_si512(xq + (16 * mt + r) * K + b * QK);
      const __m512i l = _mm512_and_si512(x, lo4), h = _mm512_srai_epi16(x, 4);
      if (qt == Q8_0) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * r), _mm512_cvtepi16_epi8(l));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 512 + 32 * r), _mm512_cvtepi16_epi8(h));
      } else {
        const __m512i lh = _mm512_or_si512(l, _mm512_slli_epi16(h, 8));  // bytes (l_k, h_k)
        _mm512_storeu_si512(o + 64 * r, _mm512_permutexvar_epi16(quad, lh));
      }
    }
  }
}

// Byte-gather tables of the B tiles (vpermt2b over a zmm of group g0 and one of g1).
struct BTables {
  __m512i q4[8];  // Q4: B row j (mod 8) from chunks 0-3 (j < 8) or 4-7: byte 0 of dword n
  __m512i q8[2];  // Q8: B row j from chunks 2j, 2j + 1 (zmm j / 2), by j & 1
};

TS_TARGET_AMX_INT BTables make_tables() {
  BTables t;
  alignas(64) uint8_t idx[64];
  for (int jj = 0; jj < 8; ++jj) {  // Q4 x8 chunk p: row r's qs bytes 2p, 2p + 1 at 2r, 2r + 1
    for (int n = 0; n < 16; ++n) {
      idx[4 * n] = uint8_t(16 * (jj / 2) + 2 * (n & 7) + (jj & 1) + (n >= 8 ? 64 : 0));
      idx[4 * n + 1] = idx[4 * n + 2] = idx[4 * n + 3] = 0;
    }
    t.q4[jj] = _mm512_load_si512(idx);
  }
  for (int odd = 0; odd < 2; ++odd) {  // Q8 chunk p: row r's quants 2p, 2p + 1 at 2r, 2r + 1
    for (int n = 0; n < 16; ++n)
      for (int i = 0; i < 4; ++i)
        idx[4 * n + i] = uint8_t(16 * (2 * odd + i / 2) + 2 * (n & 7) + (i & 1) + (n >= 8 ? 64 : 0));
    t.q8[odd] = _mm512_load_si512(idx);
  }
  return t;
}

// One block of a 16-row weight tile (group-blocks g0, g1) -> B at dst (1 KB Q4, 512 B Q8),
// and its scales: dw[16], mw[16] fp32 (Q4_0: -8 dw, as csrc/quant.cpp's tiles compute it).
TS_TARGET_AMX_INT inline void build_b(int qt, const BTables& t, const uint8_t* g0, const uint8_t* g1,
                                      uint8_t* dst, float* dw, float* mw) {
  const __m512 d = _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g0))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(g1)), 1));
  _mm512_store_ps(dw, d);
  if (qt == Q4_1) {
    _mm512_store_ps(mw, _mm512_cvtph_ps(_mm256_inserti128_si256(
                            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g0 + 16))),
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(g1 + 16)), 1)));
  } else if (qt == Q4_0) {
    _mm512_store_ps(mw, _mm512_mul_ps(d, _mm512_set1_ps(-8.f)));
  }
  const int64_t qo = kQuantOffset[qt];
  if (qt == Q8_0) {
    for (int z = 0; z < 4; ++z) {
      const __m512i s0 = _mm512_loadu_si512(g0 + qo + 64 * z), s1 = _mm512_loadu_si512(g1 + qo + 64 * z);
      _mm512_store_si512(dst + 64 * (2 * z), _mm512_permutex2var_epi8(s0, t.q8[0], s1));
      _mm512_store_si512(dst + 64 * (2 * z + 1), _mm512_permutex2var_epi8(s0, t.q8[1], s1));
    }
    return;
  }
  // the weight byte p in byte 0 of its dword -> (p & 15, p << 4, p >> 4, p & 0xf0): bytes of
  // the qword at bit offsets (0, -4, 4, 0) and (32, 28, 36, 32), then a mask
  const __m512i ctrl = _mm512_set1_epi64(0x20241c2000043c00LL);
  const __m512i mask = _mm512_set1_epi32(int(0xF0FFFF0Fu));
  for (int half = 0; half < 2; ++half) {
    const __m512i s0 = _mm512_loadu_si512(g0 + qo + 64 * half), s1 = _mm512_loadu_si512(g1 + qo + 64 * half);
#pragma GCC unroll 8
    for (int jj = 0; jj < 8; ++jj) {
      const __m512i p = _mm512_maskz_permutex2var_epi8(0x1111111111111111ULL, s0, t.q4[jj], s1);
      _mm512_store_si512(dst + 64 * (8 * half + jj), _mm512_and_si512(_mm512_multishift_epi64_epi8(ctrl, p), mask));
    }
  }
}

struct Problem {
  int qt;
  const int8_t* xa;  // pack_a
  const float* xds;  // [M, nb, 2]
  int64_t M, N, nb, nmt, nnt;
  const uint8_t* w;
  int64_t gstride;
  const float* bias;
  void* y;
  bool y_bf16;
};

// The tile products of block b of 16-row slice mt into C tiles (b & 1): Q4 one, Q8_0 two.
TS_TARGET_AMX_INT inline void tile_block(const Problem& p, const int8_t* xm, const uint8_t* bbuf, int64_t b) {
  const int8_t* a = xm + 1024 * b;
  if (p.qt == Q8_0) {
    const uint8_t* bb = bbuf + 512 * b;
    _tile_loadd(6, bb, 64);
    if (b & 1) {
      _tile_zero(2); _tile_zero(3);
      _tile_loadd(4, a, 32); _tile_loadd(5, a + 512, 32);
      _tile_dpbusd(2, 4, 6); _tile_dpbssd(3, 5, 6);
    } else {
      _tile_zero(0); _tile_zero(1);
      _tile_loadd(4, a, 32); _tile_loadd(5, a + 512, 32);
      _tile_dpbusd(0, 4, 6); _tile_dpbssd(1, 5, 6);
    }
    return;
  }
  const uint8_t* bb = bbuf + 1024 * b;
  if (b & 1) {
    _tile_zero(1); _tile_loadd(3, a, 64); _tile_loadd(5, bb, 64); _tile_dpbsud(1, 3, 5);
  } else {
    _tile_zero(0); _tile_loadd(2, a, 64); _tile_loadd(4, bb, 64); _tile_dpbsud(0, 2, 4);
  }
}

TS_TARGET_AMX_INT inline void store_block(int qt, int64_t b, int32_t* cb) {
  if (qt == Q8_0) {
    if (b & 1) { _tile_stored(2, cb, 64); _tile_stored(3, cb + 256, 64); }
    else { _tile_stored(0, cb, 64); _tile_stored(1, cb + 256, 64); }
  } else {
    if (b & 1) _tile_stored(1, cb, 64);
    else _tile_stored(0, cb, 64);
  }
}

// Weight tile nt (16 rows: groups 2 nt, 2 nt + 1) x 16-row slices [mt0, mt1) of x.
// scratch: B (nb KB), dw and mw (nb x 16 fp32 each), two C buffers (2 KB each).
// next, next_bytes: the weight bytes of the tile this thread runs next (null: none), fetched
// into L2 while this tile's products run, a few lines per step.
template <int QT>
TS_TARGET_AMX_INT void run_tile(const Problem& p, const BTables& t, int64_t nt, int64_t mt0, int64_t mt1,
                                uint8_t* bbuf, float* dwv, float* mwv, int32_t* cbuf,
                                const uint8_t* next, int64_t next_bytes) {
  constexpr bool q8 = QT == Q8_0;
  const int64_t nb = p.nb, GB = kGroupBytes[QT];
  const int64_t NG = (p.N + 7) / 8;
  alignas(64) static const uint8_t zero_group[272] = {};  // a missing second group: d = 0, q = 0
  const uint8_t* g0 = p.w + 2 * nt * p.gstride;
  const bool has_g1 = 2 * nt + 1 < NG;
  constexpr int64_t bstride = q8 ? 512 : 1024;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t o = 0; o < GB; o += 64) {  // the two group streams, kPrefetchBlocks ahead
      _mm_prefetch(reinterpret_cast<const char*>(g0 + (b + kPrefetchBlocks) * GB + o), _MM_HINT_T0);
      if (has_g1) _mm_prefetch(reinterpret_cast<const char*>(g0 + p.gstride + (b + kPrefetchBlocks) * GB + o), _MM_HINT_T0);
    }
    build_b(QT, t, g0 + b * GB, has_g1 ? g0 + p.gstride + b * GB : zero_group, bbuf + bstride * b,
            dwv + 16 * b, mwv + 16 * b);
  }
  const int64_t steps = (mt1 - mt0) * (nb + 2);
  const int64_t lines = next ? (next_bytes + 63) / 64 : 0, per_step = (lines + steps - 1) / steps;
  int64_t line = 0;
  for (int64_t i = 0; i < mt1 - mt0; ++i) {
    // odd weight tiles walk the slices backwards: the slice just done is still in L1
    const int64_t mt = (nt & 1) ? mt1 - 1 - i : mt0 + i;
    const int8_t* xm = p.xa + mt * nb * 1024;
    const float* xds = p.xds + 16 * mt * nb * 2;
    const int64_t rows = std::min<int64_t>(16, p.M - 16 * mt);
    __m512 acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    // step s: block s's tile product, block s - 1's store, block s - 2's fp32 steps
    for (int64_t s = 0; s < nb + 2; ++s) {
      for (int64_t e = std::min(lines, line + per_step); line < e; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(next + 64 * line), _MM_HINT_T1);
      if (s < nb) tile_block(p, xm, bbuf, s);
      if (s >= 1 && s <= nb) store_block(QT, s - 1, cbuf + 512 * ((s - 1) & 1));
      if (s >= 2) {
        const int64_t b = s - 2;
        const int32_t* c = cbuf + 512 * (b & 1);
        const __m512 dw = _mm512_load_ps(dwv + 16 * b);
        const float* dx = xds + 2 * b;
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) {
          __m512i is = _mm512_load_si512(c + 16 * r);
          if constexpr (q8) is = _mm512_add_epi32(is, _mm512_slli_epi32(_mm512_load_si512(c + 256 + 16 * r), 4));
          const __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nb * 2]));
          acc[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(is), acc[r]);
        }
      }
    }
    alignas(64) float out[256];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) _mm512_store_ps(out + 16 * r, acc[r]);
    __m512 summ[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) summ[r] = _mm512_setzero_ps();
    if constexpr (!q8) {
      for (int64_t b = 0; b < nb; ++b) {  // 16 independent chains, b in order in each
        const __m512 mw = _mm512_load_ps(mwv + 16 * b);
        const float* sx = xds + 2 * b + 1;
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) summ[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * nb * 2]), summ[r]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) _mm512_store_ps(out + 16 * r, _mm512_add_ps(_mm512_load_ps(out + 16 * r), summ[r]));
    amx::store_out16(out, rows, 16 * mt, 16 * nt, p.N, p.bias, p.y, p.y_bf16);
  }
}

// Task t's share of the work units (unit u: chunk u / nnt of 16-row slices x weight tile
// u % nnt; its own range first, then what is left of the others', csrc/parallel.h), its
// tiles configured for the call and released after it.
TS_TARGET_AMX_INT void run_task(const Problem& p, StealingRanges& ranges, int64_t t) {
  const int64_t nb = p.nb;
  thread_local std::vector<uint8_t> scratch;
  const size_t need = size_t(nb) * (1024 + 128) + 2048 * 2 + 128;
  if (scratch.size() < need) scratch.resize(need);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  float* dwv = reinterpret_cast<float*>(base + nb * 1024);
  float* mwv = dwv + 16 * nb;
  int32_t* cbuf = reinterpret_cast<int32_t*>(mwv + 16 * nb);
  const BTables tb = make_tables();
  tiles_configure(p.qt);
  const int64_t NG = (p.N + 7) / 8;
  for (int64_t k = 0, u, end; (u = ranges.claim(t, k, &end)) >= 0;) {
    const int64_t chunk = u / p.nnt, nt = u % p.nnt;
    const int64_t mt0 = chunk * kMtChunk, mt1 = std::min(p.nmt, (chunk + 1) * kMtChunk);
    // the weight groups of the range's next unit (the next tile's, or the first tile's for
    // the next chunk), most likely this thread's next
    const uint8_t* next = nullptr;
    int64_t next_bytes = 0;
    if (u + 1 < end) {
      const int64_t g = 2 * ((u + 1) % p.nnt);
      next = p.w + g * p.gstride;
      next_bytes = (std::min<int64_t>(NG, g + 2) - g) * p.gstride;
    }
    if (p.qt == Q4_0) run_tile<Q4_0>(p, tb, nt, mt0, mt1, base, dwv, mwv, cbuf, next, next_bytes);
    else if (p.qt == Q4_1) run_tile<Q4_1>(p, tb, nt, mt0, mt1, base, dwv, mwv, cbuf, next, next_bytes);
    else run_tile<Q8_0>(p, tb, nt, mt0, mt1, base, dwv, mwv, cbuf, next, next_bytes);
  }
  _tile_release();  // back to the init state: a context switch saves no tile data
}

}  // namespace
#endif  // TS_HAVE_AMX_INT

void quant_amx_int_gemm(int qt, const int16_t* xq, const float* xds, int64_t M, int64_t K,
                        const uint8_t* w, int64_t N, const float* bias, void* y, bool y_bf16) {
  assert(quant_amx_int_available() && K % QK == 0 && qt >= 0 && qt <= 2);
#ifdef TS_HAVE_AMX_INT
  const int64_t nb = K / QK, nmt = (M + 15) / 16, nnt = (N + 15) / 16;
  // the packed activations, per calling thread, grown and reused (pack_a writes every byte;
  // a fresh zeroed vector cost a memset of up to 200 KB a call)
  thread_local std::vector<int8_t> xbuf;
  if (xbuf.size() < size_t(nmt * nb * 1024 + 64)) xbuf.resize(size_t(nmt * nb * 1024 + 64));
  int8_t* xa = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(xbuf.data()) + 63) & ~uintptr_t(63));
  // tens of ns per 16 x 32 block (a 64-row GEMM at K = 576 packs in ~3 us): a parallel
  // region (a barrier, and a wait for a descheduled worker on a shared host) only pays off
  // for long prompts
  at::parallel_for(0, nmt * nb, 4096, [&](int64_t u0, int64_t u1) { pack_a(qt, xq, M, K, xa, u0, u1); });
  // the scales of the rows past M (read by the full 16-row fp32 steps, never stored): zero
  std::vector<float> dsbuf;
  if (M % 16) {
    dsbuf.assign(size_t(nmt * 16 * nb * 2), 0.f);
    std::memcpy(dsbuf.data(), xds, sizeof(float) * size_t(M * nb * 2));
    xds = dsbuf.data();
  }
  const Problem p{qt, xa, xds, M, N, nb, nmt, nnt, w, nb * kGroupBytes[qt], bias, y, y_bf16};
  // work units: (chunk of up to kMtChunk 16-row slices, weight tile), weight tiles inner; a
  // unit builds its weight tile's B once for its slices. A range per thread, the idle one
  // taking the others' units (csrc/parallel.h)
  const int64_t units = (nmt + kMtChunk - 1) / kMtChunk * nnt;
  const int64_t grain = std::max<int64_t>(1, 64 / (nb * std::min<int64_t>(nmt, kMtChunk)));
  parallel_tasks(units, std::min<int64_t>(at::get_num_threads(), (units + grain - 1) / grain),
                 [&](int64_t t, StealingRanges& ranges) { run_task(p, ranges, t); });
#else
  (void)xq; (void)xds; (void)M; (void)w; (void)N; (void)bias; (void)y; (void)y_bf16;
#endif
}

}  // namespace tokenserve
