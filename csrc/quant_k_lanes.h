// The AVX-512 building blocks of the k-quant GEMM shared by csrc/quant_k.cpp's VNNI int8
// tiles and csrc/quant_k_amx.cpp's AMX-INT8 tiles, so both read the k8 layout (drawn in
// csrc/quant_k.cpp's header) into the same four-element weight lanes and the same integer
// scales: a pair of 8-row groups' super-block header and scales, and a sub-block chunk's
// lanes (16 weight rows, lanes 0-7 group a, 8-15 group c; lane L of a 32-block pairs with
// the activations' lane L, csrc/quant_k.cpp reorder_q8).
#pragma once

#include <cstdint>

#include "quant_act.h"
#include "quant_k_layout.h"
#include "simd.h"

#ifdef TS_X86
namespace tokenserve::kquant {

using qact::pair16;

// 32 bytes at a and 32 at c as one zmm.
TS_TARGET_AVX512VNNI inline __m512i load2x32(const uint8_t* a, const uint8_t* c) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)), 1);
}

// A pair of Q4_K / Q5_K groups' super-block header (ga, gc: the two groups' bytes): d, dmin
// (16 lanes) and lane r's 6-bit scales / mins as bytes (ggml's kmask trick): sc[0] / mn[0]
// sub-blocks 0..3, sc[1] / mn[1] sub-blocks 4..7.
struct Q45Header512 {
  __m512 d, dmin;
  __m512i sc[2], mn[2];
};

TS_TARGET_AVX512VNNI inline Q45Header512 q45k_header512(const uint8_t* ga, const uint8_t* gc) {
  const __m512i k1 = _mm512_set1_epi32(0x3f3f3f3f), k2 = _mm512_set1_epi32(0x0f0f0f0f),
                k3 = _mm512_set1_epi32(0x03030303);
  Q45Header512 h;
  h.d = _mm512_cvtph_ps(pair16(ga, gc));
  h.dmin = _mm512_cvtph_ps(pair16(ga + 16, gc + 16));
  const __m512i u0 = load2x32(ga + 32, gc + 32), u1 = load2x32(ga + 64, gc + 64), u2 = load2x32(ga + 96, gc + 96);
  h.sc[0] = _mm512_and_si512(u0, k1);
  h.sc[1] = _mm512_or_si512(_mm512_and_si512(u2, k2),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), k3), 4));
  h.mn[0] = _mm512_and_si512(u1, k1);
  h.mn[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), k2),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), k3), 4));
  return h;
}

// A Q4_K / Q5_K super-block's integer scales for 16 lanes (two groups): sc[j] = sub-block
// j's 6-bit scale as int32 lanes (stored: the tiles read them once per sub-block), mp[i] =
// the mins of sub-blocks 2i, 2i + 1 as int16 pairs per lane (vpdpwssd against the
// activations' 32-element sums bs[2i], bs[2i + 1]: the super-block's msum in 4 instructions).
struct Q45Ints512 {
  alignas(64) int32_t sc[8][16];
  __m512i mp[4];
};

TS_TARGET_AVX512VNNI inline void q45k_ints512(const Q45Header512& h, Q45Ints512& s) {
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m512i sel = _mm512_broadcast_i32x4(_mm_setr_epi8(j % 4, -1, -1, -1, 4 + j % 4, -1, -1, -1, 8 + j % 4,
                                                             -1, -1, -1, 12 + j % 4, -1, -1, -1));
    _mm512_store_si512(s.sc[j], _mm512_shuffle_epi8(h.sc[j / 4], sel));
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const int k = 2 * (i % 2);
    const __m512i sel = _mm512_broadcast_i32x4(_mm_setr_epi8(k, -1, k + 1, -1, 4 + k, -1, 5 + k, -1, 8 + k, -1,
                                                             9 + k, -1, 12 + k, -1, 13 + k, -1));
    s.mp[i] = _mm512_shuffle_epi8(h.mn[i / 2], sel);
  }
}

// Q5_K: the fifth bits of sub-block (sa, sc_) as lane bytes: bit p of byte 0 / 1 of a lane
// serves chunk p's low elements, of byte 2 / 3 its high ones.
TS_TARGET_AVX512VNNI inline __m512i q5k_fifth512(const uint8_t* sa, const uint8_t* sc_) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(pair16(sa + 128, sc_ + 128)),
                         _mm512_slli_epi32(_mm512_cvtepu16_epi32(pair16(sa + 144, sc_ + 144)), 16));
}

// Q4_K / Q5_K chunk p (0..7) of sub-block (sa, sc_) as 16 lanes [e 2p, 2p+1, 16+2p, 17+2p]
// of unsigned quants (hb: q5k_fifth512, ignored for Q4_K).
template <int QT>
TS_TARGET_AVX512VNNI inline __m512i q45k_lane512(const uint8_t* sa, const uint8_t* sc_, __m512i hb, int p) {
  const __m512i nib = _mm512_set1_epi32(0x0f0f0f0f), bit4 = _mm512_set1_epi32(0x10101010);
  // lane [b0, b1, 0, 0] -> [b0 & 15, b1 & 15, b0 >> 4, b1 >> 4]
  const __m512i t = _mm512_cvtepu16_epi32(pair16(sa + 16 * p, sc_ + 16 * p));
  __m512i w = _mm512_ternarylogic_epi32(t, _mm512_slli_epi32(t, 12), nib, 0xA8);  // (a | b) & c
  if constexpr (QT == Q5_K) {  // bit p of each fifth-bit byte, moved to bit 4 (one shift)
    const __m512i hp = p < 4 ? _mm512_slli_epi32(hb, 4 - p) : p > 4 ? _mm512_srli_epi32(hb, p - 4) : hb;
    w = _mm512_ternarylogic_epi32(w, hp, bit4, 0xF8);  // a | (b & c)
  }
  return w;
}

// Q6_K's lane constants (made once per tile, outside its loops).
struct Q6Lanes512 {
  __m512i nib, ma, mb, sha, shb, pab, pdup;
};

TS_TARGET_AVX512VNNI inline Q6Lanes512 q6k_lane_consts512() {
  Q6Lanes512 k;
  k.nib = _mm512_set1_epi32(0x0f0f0f0f);
  k.ma = _mm512_set1_epi32(0x0c0c0303);
  k.mb = _mm512_set1_epi32(int32_t(0xc0c03030u));
  k.sha = _mm512_set1_epi32(0x00020004);
  k.shb = _mm512_set1_epi32(0x00020000);
  // word indices: lane r = [a word r, b word r] (two-source), [word r, word r] (one source)
  k.pab = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
                           35, 3, 34, 2, 33, 1, 32, 0);
  k.pdup = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3,
                            2, 2, 1, 1, 0, 0);
  return k;
}

// Q6_K 32-block (ba, bc: the two groups' 192 bytes), c = 0..3: wa = sub-block A's lane
// [2c, 2c+1, 8+2c, 9+2c], wb = sub-block B's [16+2c, 17+2c, 24+2c, 25+2c], unsigned 0..63.
TS_TARGET_AVX512VNNI inline void q6k_lanes512(const Q6Lanes512& k, const uint8_t* ba, const uint8_t* bc, int c,
                                              __m512i& wa, __m512i& wb) {
  // lane [ta0, ta1, tb0, tb1] (low chunks c, c + 4) and [h0, h1, h0, h1] (high chunk c)
  const __m512i t = _mm512_permutex2var_epi16(_mm512_castsi256_si512(pair16(ba + 16 * c, bc + 16 * c)), k.pab,
                                              _mm512_castsi256_si512(pair16(ba + 16 * (c + 4), bc + 16 * (c + 4))));
  const __m512i h = _mm512_permutexvar_epi16(k.pdup, _mm512_castsi256_si512(pair16(ba + 128 + 16 * c, bc + 128 + 16 * c)));
  // A: low nibbles | high bits t = 0 (bytes 0, 1: << 4) and t = 1 (bytes 2, 3: << 2)
  wa = _mm512_ternarylogic_epi32(t, k.nib, _mm512_sllv_epi16(_mm512_and_si512(h, k.ma), k.sha), 0xEA);  // (a & b) | c
  // B: high nibbles | high bits t = 2 (in place) and t = 3 (bytes 2, 3: >> 2)
  wb = _mm512_ternarylogic_epi32(_mm512_srli_epi32(t, 4), k.nib, _mm512_srlv_epi16(_mm512_and_si512(h, k.mb), k.shb),
                                 0xEA);
}

// Q6_K 32-block bl's two sub-block scales (2 bl, 2 bl + 1) as int32 lanes (16: two groups).
TS_TARGET_AVX512VNNI inline void q6k_iscales512(const uint8_t* ga, const uint8_t* gc, int bl, __m512i& sa,
                                                __m512i& sb) {
  sa = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ga + 16 + 16 * bl)),
                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(gc + 16 + 16 * bl))));
  sb = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ga + 24 + 16 * bl)),
                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(gc + 24 + 16 * bl))));
}

}  // namespace tokenserve::kquant
#endif  // TS_X86
