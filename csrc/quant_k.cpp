// GEMM on GGUF k-quant weights (Q4_K, Q5_K, Q6_K): y = x @ W^T (+ b).
// Pure-torch oracle: tokenserve.ops.quant (quant_k_linear_ref, repack_k8, dequantize_k_ref).
//
// Weights: the GGUF's own super-blocks (256 weights; ggml ggml-common.h block_q4_K /
// block_q5_K / block_q6_K), regrouped once at load into the "k8" layout
// (tokenserve.ops.quant.repack_k8): 8 output rows interleaved per super-block, the same byte
// count as the file. Per group g of 8 rows and super-block B, GB bytes:
//
//   Q4_K 1152 | d[8] fp16 | dmin[8] fp16 | scale words: row r's 12 packed 6-bit scale/min
//             bytes as 3 u32 words, word w at 32 + 32w + 4r | 8 sub-blocks x 128 |
//   Q5_K 1408   as Q4_K, sub-blocks of 160: 128 nibble bytes then 2 x 16 fifth-bit bytes
//   Q6_K 1680 | d[8] fp16 | scales: sub-block s (0..15), row r: int8 at 16 + 8s + r |
//             8 blocks of 32 weights x 192: 8 x 16 low-nibble bytes, 4 x 16 high-2-bit bytes
//
// Every "chunk" is 16 bytes: row r's two bytes at 2r, 2r + 1, byte j serving the j-th
// element of a pair. Widened to int16, a chunk is 8 rows x 2 elements, so vpmaddwd against
// a broadcast activation pair gives 8 rows' dot products at once (as csrc/quant.cpp).
//   Q4_K/Q5_K sub-block chunk p = 0..7: byte j = q[2p + j] | q[16 + 2p + j] << 4 (low 4
//       bits); Q5_K fifth-bit chunk h = 0, 1: byte j bit i = q[16h + 2i + j] >> 4.
//   Q6_K (q unsigned 0..63, element numbers within the 32-block): low chunk p = 0..7:
//       byte j = lo4(q[2p + j]) | lo4(q[16 + 2p + j]) << 4; high chunk c = 0..3: byte j
//       bits 2t..2t+1 = hi2(q[2c + j + 8t]), t = 0..3.
// Rows past N are zero (d = 0).
//
// Activations: int8 per row and 256-element super-block (csrc/quant_act.h quantize_row_k:
// d = amax / 127, q = round_half_even(x / d), plus the exact sums bs of each 32 quants),
// llama.cpp's Q8_K. Q6_K's "q - 32" is applied as isum - 32 * sum16(qx) (exact integers;
// sum16 per row and 16-block, computed once per row). Int8, not csrc/quant.cpp's int12: the
// weights' quants are unsigned, so vpdpbusd (u8 x s8, four products a lane) does what two
// vpdpwssd do, and on AVX2 vpmaddubsw sums eight chunks in int16 before one vpmaddwd widens
// them (Q4_K / Q5_K; Q6_K's AVX2 tile stays on int16).
//
// Per output element y[m, n], in every path (AVX2, AVX-512 VNNI int16 and int8 tiles of any
// shape, the one-row tiles, the AMX-INT8 tiles of csrc/quant_k_amx.cpp, the portable code),
// whatever the batch and thread partition (batch invariance), super-blocks B in k order:
//
//     isum = sum_s sc_s * dot_s     dot_s = sum qw * qx over sub-block s (32 weights;
//                                   Q6_K: 16, qw - 32); sc_s its 6-bit (Q6_K: int8) scale
//     msum = sum_s m_s * bs_s       (Q4_K / Q5_K: the 6-bit mins, bs_s the activations'
//                                   32-element sums)                      both exact int32
//     acc  = fma(fl(d * dx_B), float(isum), acc)
//     acc  = fma(-fl(dmin * dx_B), float(msum), acc)                      (Q4_K / Q5_K)
//     y = round(acc (+ b[n]))
//
// (ggml's vec_dot_q4_K_q8_K has this shape.) One fp32 step per super-block, the scales
// applied in integers: the AMX tiles fold the 6-bit scales into their B operand (two 3-bit
// halves) and sum a super-block's sub-blocks in the C tile. |isum| < 2^31 (Q5_K: 8 x 63 x 32
// x 31 x 127; Q6_K: 16 x 128 x 16 x 32 x 127); float(isum) is correctly rounded, a fixed
// function of the row's data. The AVX2 and int16 AVX-512 tiles read the int8 quants as
// int16 (csrc/quant.cpp's loops). Pure-torch oracle: tokenserve.ops.quant.quant_k_linear_ref.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

#include "cpu_features.h"
#include "quant_act.h"
#include "quant_amx_int.h"
#include "quant_k_amx.h"
#include "quant_k_layout.h"
#include "quant_k_lanes.h"
#include "kernels.h"
#include "registry.h"
#include "simd.h"
#include "tiles.h"

namespace tokenserve {
namespace {

using namespace kquant;  // QKK, KType, group_bytes, sub_bytes (QB, RG: csrc/tiles.h)

std::atomic<bool> g_force_portable{false};
std::atomic<bool> g_no_avx512{false};  // test hook: the AVX2 tiles on an AVX-512 VNNI CPU
std::atomic<bool> g_no_int8{false};    // test hook: the int16 tiles instead of the int8 ones
std::atomic<bool> g_no_tile16{false};  // test hook: 16-row blocks on the 8-row AVX-512 tiles
std::atomic<bool> g_no_row_tile{false};  // test hook: a one-row GEMM on the AVX2 tiles, not the one-row ones
std::atomic<int64_t> g_amx_min_rows{kAmxKMinRows};  // test hook: rows from which AMX-INT8 runs
std::atomic<int64_t> g_amx_calls{0};  // GEMMs run on the AMX-INT8 tiles (read by the tests)

using qact::fp16_to_f32;
#ifdef TS_X86
using qact::pair16;
using qact::xpair512;
#endif

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes (ggml's
// get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* b, int& sc, int& m) {
  if (j < 4) {
    sc = b[j] & 63;
    m = b[j + 4] & 63;
  } else {
    sc = (b[j + 4] & 0x0f) | ((b[j - 4] >> 6) << 4);
    m = (b[j + 4] >> 4) | ((b[j] >> 6) << 4);
  }
}

// Row r (0..7) of a group-super-block in integers: d, dmin (0 for Q6_K), the sub-block
// scales sc (Q4_K / Q5_K 8 x 6-bit; Q6_K 16 x int8), mins m (Q4_K / Q5_K) and the quants in
// element order (Q4_K / Q5_K unsigned, 8 x 32; Q6_K signed q - 32, 16 x 16).
struct RowSuper {
  float d, dmin;
  int32_t sc[16], m[8], q[QKK];
};

void unpack_row(int qt, const uint8_t* gb, int r, RowSuper& o) {
  o.d = fp16_to_f32(gb + 2 * r);
  if (qt == Q6_K) {
    o.dmin = 0.f;
    for (int s = 0; s < 16; ++s) o.sc[s] = int8_t(gb[16 + 8 * s + r]);
    for (int s = 0; s < 8; ++s) o.m[s] = 0;
    for (int b = 0; b < 8; ++b) {
      const uint8_t* blk = gb + 144 + 192 * b;
      for (int e = 0; e < 32; ++e) {
        const int half = e / 16, i = e % 16, p = i / 2, j = i % 2;
        const int lo = (blk[16 * p + 2 * r + j] >> (4 * half)) & 15;
        const int c = (e % 8) / 2, t = e / 8;  // e = 2c + j + 8t
        const int hi = (blk[128 + 16 * c + 2 * r + j] >> (2 * t)) & 3;
        o.q[32 * b + e] = (lo | hi << 4) - 32;
      }
    }
    return;
  }
  o.dmin = fp16_to_f32(gb + 16 + 2 * r);
  uint8_t sc12[12];
  for (int w = 0; w < 3; ++w) std::memcpy(sc12 + 4 * w, gb + 32 + 32 * w + 4 * r, 4);
  const int64_t SB = sub_bytes(qt);
  for (int s = 0; s < 8; ++s) {
    scale_min_k4(s, sc12, o.sc[s], o.m[s]);
    const uint8_t* sub = gb + 128 + SB * s;
    for (int i = 0; i < 16; ++i) {
      const uint8_t byte = sub[16 * (i / 2) + 2 * r + i % 2];
      int lo = byte & 15, hi = byte >> 4;
      if (qt == Q5_K) {
        lo |= ((sub[128 + 2 * r + i % 2] >> (i / 2)) & 1) << 4;
        hi |= ((sub[144 + 2 * r + i % 2] >> (i / 2)) & 1) << 4;
      }
      o.q[32 * s + i] = lo;
      o.q[32 * s + 16 + i] = hi;
    }
  }
}

// Portable: one output element (row n = lane r of a group), the header's arithmetic.
// xq [K], xd [K / 256], xbs [K / 32]: one activation row.
float dot_scalar(int qt, const int16_t* xq, const float* xd, const int16_t* xbs, int64_t K, const uint8_t* wg,
                 int r) {
  const int64_t nsb = K / QKK, GB = group_bytes(qt);
  const int L = qt == Q6_K ? 16 : 32, S = qt == Q6_K ? 16 : 8;
  float acc = 0.f;
  RowSuper w;
  for (int64_t B = 0; B < nsb; ++B) {
    unpack_row(qt, wg + B * GB, r, w);
    int32_t isum = 0, msum = 0;
    for (int s = 0; s < S; ++s) {
      const int16_t* xs = xq + B * QKK + s * L;
      int32_t dot = 0;
      for (int i = 0; i < L; ++i) dot += w.q[s * L + i] * int32_t(xs[i]);
      isum += w.sc[s] * dot;
    }
    acc = std::fma(w.d * xd[B], float(isum), acc);
    if (qt != Q6_K) {
      for (int s = 0; s < 8; ++s) msum += w.m[s] * int32_t(xbs[B * 8 + s]);
      acc = std::fma(-(w.dmin * xd[B]), float(msum), acc);
    }
  }
  return acc;
}

#ifdef TS_X86
// A Q4_K / Q5_K group's super-block header on AVX2 (8 lanes, one per row): d, dmin and row
// r's 6-bit scales / mins as bytes of lane r (ggml's kmask trick): sc[0] / mn[0] sub-blocks
// 0..3, sc[1] / mn[1] 4..7.
struct Q45Header256 {
  __m256 d, dmin;
  __m256i sc[2], mn[2];
};

TS_TARGET_AVX2_F16C inline Q45Header256 q45k_header256(const uint8_t* gb) {
  const __m256i k1 = _mm256_set1_epi32(0x3f3f3f3f), k2 = _mm256_set1_epi32(0x0f0f0f0f),
                k3 = _mm256_set1_epi32(0x03030303);
  const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 32));
  const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 64));
  const __m256i u2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 96));
  Q45Header256 h;
  h.d = load8_fp16(gb);
  h.dmin = load8_fp16(gb + 16);
  h.sc[0] = _mm256_and_si256(u0, k1);
  h.sc[1] = _mm256_or_si256(_mm256_and_si256(u2, k2),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), k3), 4));
  h.mn[0] = _mm256_and_si256(u1, k1);
  h.mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), k2),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), k3), 4));
  return h;
}

// The one-group tiles' prefetch (AVX2, one-row): a sub-block's (Q6_K: a 32-block's) bytes
// two super-blocks ahead in the group's stream, which the tile reads in order.
template <int QT>
TS_TARGET_AVX2_F16C inline void prefetch_ahead(const uint8_t* p) {
  constexpr int64_t GB = group_bytes(QT);
  _mm_prefetch(reinterpret_cast<const char*>(p + 2 * GB), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + 2 * GB + 64), _MM_HINT_T0);
  if constexpr (QT != Q4_K) _mm_prefetch(reinterpret_cast<const char*>(p + 2 * GB + 128), _MM_HINT_T0);
}

// byte k of each 32-bit lane -> the lane's low byte, zero above (vpshufb selectors, k = j % 4)
alignas(32) constexpr int8_t kScaleSel256[4][32] = {
    {0, -1, -1, -1, 4, -1, -1, -1, 8, -1, -1, -1, 12, -1, -1, -1, 0, -1, -1, -1, 4, -1, -1, -1, 8, -1, -1, -1, 12, -1, -1, -1},
    {1, -1, -1, -1, 5, -1, -1, -1, 9, -1, -1, -1, 13, -1, -1, -1, 1, -1, -1, -1, 5, -1, -1, -1, 9, -1, -1, -1, 13, -1, -1, -1},
    {2, -1, -1, -1, 6, -1, -1, -1, 10, -1, -1, -1, 14, -1, -1, -1, 2, -1, -1, -1, 6, -1, -1, -1, 10, -1, -1, -1, 14, -1, -1, -1},
    {3, -1, -1, -1, 7, -1, -1, -1, 11, -1, -1, -1, 15, -1, -1, -1, 3, -1, -1, -1, 7, -1, -1, -1, 11, -1, -1, -1, 15, -1, -1, -1}};
// bytes 2k, 2k + 1 of each 32-bit lane -> its two 16-bit words (k = 0, 1)
alignas(32) constexpr int8_t kPairSel256[2][32] = {
    {0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1, 0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1},
    {2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1, 2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1}};

// Sub-block j's 6-bit scales for the 8 rows as int32 lanes.
TS_TARGET_AVX2_F16C inline __m256i q45k_iscale256(const Q45Header256& h, int j) {
  return _mm256_shuffle_epi8(h.sc[j / 4], _mm256_load_si256(reinterpret_cast<const __m256i*>(kScaleSel256[j % 4])));
}

// The super-block's mins of sub-blocks 2i, 2i + 1 as int16 pairs per lane (vpmaddwd against
// the activations' 32-element sums bs[2i], bs[2i + 1]).
TS_TARGET_AVX2_F16C inline __m256i q45k_mpair256(const Q45Header256& h, int i) {
  return _mm256_shuffle_epi8(h.mn[i / 2], _mm256_load_si256(reinterpret_cast<const __m256i*>(kPairSel256[i % 2])));
}

// The fp32 step of a Q4_K / Q5_K super-block (the header's, 8 lanes): msum from the mins and
// the row's 32-element sums xbs (8 for this super-block), then the two fmas.
TS_TARGET_AVX2_F16C inline __m256 q45k_fp32_step256(const Q45Header256& h, const __m256i* mp, __m256i isum,
                                                     float dx, const int16_t* xbs, __m256 acc) {
  __m256i ms = _mm256_madd_epi16(mp[0], xpair(xbs, 0));
  for (int i = 1; i < 4; ++i) ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mp[i], xpair(xbs, 2 * i)));
  const __m256 vdx = _mm256_set1_ps(dx);
  acc = _mm256_fmadd_ps(_mm256_mul_ps(h.d, vdx), _mm256_cvtepi32_ps(isum), acc);
  return _mm256_fnmadd_ps(_mm256_mul_ps(h.dmin, vdx), _mm256_cvtepi32_ps(ms), acc);  // fma(-dm dx, msum, acc)
}

// Q4_K / Q5_K: MR activation rows x one group of 8 weight rows over all super-blocks:
// out[r * ldo + j] for rows r < MR, weight rows j < 8 (fp32, no bias). xd [., K / 256], xbs
// [., K / 32]: the rows' scales and 32-element sums (row strides K / 256, K / 32).
// A = int16_t: xq [K], vpmaddwd on widened weight pairs, the dots scaled with vpmulld;
// int8_t: q8 [K] in the AVX-512 int8 tiles' lane order (reorder_q8), vpmaddubsw on the u8
// quants' four-element lanes (u8 x s8 pairs <= 2 * 31 * 127, no saturation), summed in int16
// for up to 8 chunks (Q4_K: 8 x 3810; Q5_K: 4 x 7874 < 2^15) and widened with vpmaddwd
// against the sub-block's scale pair (sc, sc) (<= 2 x 32767 x 63): the scaled dot in one
// instruction. Exact either way: the same bits.
template <int QT, int MR, class A = int16_t>
TS_TARGET_AVX2_F16C void tile_q45k(const A* __restrict xa, const float* __restrict xd, const int16_t* __restrict xbs,
                                   const int32_t*, int64_t K, const uint8_t* __restrict wg, float* __restrict out,
                                   int64_t ldo) {
  constexpr bool I8 = std::is_same_v<A, int8_t>;
  const int64_t nsb = K / QKK, nb = K / QB;
  constexpr int64_t GB = group_bytes(QT), SB = sub_bytes(QT);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi16(0x0f), bit4 = _mm256_set1_epi16(0x10);
  const __m256i bit4x4 = _mm256_set1_epi32(0x10101010);  // int8 lanes (Q5_K)
  for (int64_t B = 0; B < nsb; ++B) {
    const uint8_t* gb = wg + B * GB;
    const Q45Header256 h = q45k_header256(gb);
    __m256i isb[MR];
    for (int r = 0; r < MR; ++r) isb[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sub = gb + 128 + SB * j;
      prefetch_ahead<QT>(sub);
      const __m256i scj = q45k_iscale256(h, j);
      if constexpr (I8) {
        const __m256i nib = _mm256_set1_epi32(0x0f0f0f0f);
        const __m256i scp = _mm256_or_si256(scj, _mm256_slli_epi32(scj, 16));  // (sc, sc) int16 pairs
        constexpr int WIDEN = QT == Q5_K ? 4 : 8;  // chunks summed in int16 before widening
        __m256i s16[MR];
        for (int r = 0; r < MR; ++r) s16[r] = _mm256_setzero_si256();
        __m256i hb = _mm256_setzero_si256();  // lane bytes: fifth bits of [2p + j] and [16 + 2p + j]
        if constexpr (QT == Q5_K)
          hb = _mm256_or_si256(_mm256_cvtepu16_epi32(load16(sub + 128)),
                               _mm256_slli_epi32(_mm256_cvtepu16_epi32(load16(sub + 144)), 16));
        const int8_t* q8b = xa + 32 * (B * 8 + j);
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
          // lane [b0, b1, 0, 0] -> [b0 & 15, b1 & 15, b0 >> 4, b1 >> 4]
          const __m256i t = _mm256_cvtepu16_epi32(load16(sub + 16 * p));
          __m256i w = _mm256_and_si256(_mm256_or_si256(t, _mm256_slli_epi32(t, 12)), nib);
          if constexpr (QT == Q5_K) {  // bit p of each fifth-bit byte, moved to bit 4 (one shift)
            const __m256i hp = p < 4 ? _mm256_slli_epi32(hb, 4 - p) : p > 4 ? _mm256_srli_epi32(hb, p - 4) : hb;
            w = _mm256_or_si256(w, _mm256_and_si256(hp, bit4x4));
          }
          for (int r = 0; r < MR; ++r) {
            int32_t v;
            std::memcpy(&v, q8b + r * K + 4 * p, 4);
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(v)));
          }
          if ((p + 1) % WIDEN == 0)
            for (int r = 0; r < MR; ++r) {
              isb[r] = _mm256_add_epi32(isb[r], _mm256_madd_epi16(s16[r], scp));
              s16[r] = _mm256_setzero_si256();
            }
        }
      } else {
        __m256i isum[MR];
        for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
        __m256i hl = _mm256_setzero_si256(), hh = _mm256_setzero_si256();
        if constexpr (QT == Q5_K) {
          hl = _mm256_slli_epi16(_mm256_cvtepu8_epi16(load16(sub + 128)), 4);
          hh = _mm256_slli_epi16(_mm256_cvtepu8_epi16(load16(sub + 144)), 4);
        }
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
          const __m256i t = _mm256_cvtepu8_epi16(load16(sub + 16 * p));
          __m256i wl = _mm256_and_si256(t, lo4), wh = _mm256_srli_epi16(t, 4);
          if constexpr (QT == Q5_K) {  // bit p of the fifth-bit bytes, moved to bit 4
            wl = _mm256_or_si256(wl, _mm256_and_si256(hl, bit4));
            wh = _mm256_or_si256(wh, _mm256_and_si256(hh, bit4));
            hl = _mm256_srli_epi16(hl, 1);
            hh = _mm256_srli_epi16(hh, 1);
          }
          for (int r = 0; r < MR; ++r) {
            const int16_t* xb = xa + r * K + B * QKK + QB * j;
            isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(wl, xpair(xb, 2 * p)),
                                                                 _mm256_madd_epi16(wh, xpair(xb, 16 + 2 * p))));
          }
        }
        for (int r = 0; r < MR; ++r) isb[r] = _mm256_add_epi32(isb[r], _mm256_mullo_epi32(isum[r], scj));
      }
    }
    __m256i mp[4];
    for (int i = 0; i < 4; ++i) mp[i] = q45k_mpair256(h, i);
    for (int r = 0; r < MR; ++r) acc[r] = q45k_fp32_step256(h, mp, isb[r], xd[r * nsb + B], xbs + r * nb + 8 * B, acc[r]);
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

// Q6_K 32-block bl's sub-block scales (2 bl, 2 bl + 1) of a group's 8 rows as int32 lanes.
TS_TARGET_AVX2 inline void q6k_iscales256(const uint8_t* gb, int bl, __m256i& sa, __m256i& sb) {
  sa = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gb + 16 + 16 * bl)));
  sb = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gb + 24 + 16 * bl)));
}

// Q6_K: as tile_q45k; xs16 = int32 [M, K / 16] sums of 16 activation quants.
template <int QT, int MR>
TS_TARGET_AVX2_F16C void tile_q6k(const int16_t* __restrict xq, const float* __restrict xd, const int16_t*,
                                  const int32_t* __restrict xs16, int64_t K, const uint8_t* __restrict wg,
                                  float* __restrict out, int64_t ldo) {
  static_assert(QT == Q6_K);
  const int64_t nsb = K / QKK;
  constexpr int64_t GB = group_bytes(Q6_K);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi16(0x0f), m03 = _mm256_set1_epi16(0x03), m0c = _mm256_set1_epi16(0x0c),
                m30 = _mm256_set1_epi16(0x30), mc0 = _mm256_set1_epi16(0xc0);
  for (int64_t B = 0; B < nsb; ++B) {
    const uint8_t* gb = wg + B * GB;
    const __m256 d = load8_fp16(gb);
    __m256i isb[MR];
    for (int r = 0; r < MR; ++r) isb[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int bl = 0; bl < 8; ++bl) {
      const uint8_t* blk = gb + 144 + 192 * bl;
      prefetch_ahead<Q6_K>(blk);
      const int64_t xo = B * QKK + QB * bl;
      __m256i ia[MR], ib[MR];
      for (int r = 0; r < MR; ++r) ia[r] = _mm256_setzero_si256(), ib[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256i h = _mm256_cvtepu8_epi16(load16(blk + 128 + 16 * c));
        const __m256i ta = _mm256_cvtepu8_epi16(load16(blk + 16 * c));
        const __m256i tb = _mm256_cvtepu8_epi16(load16(blk + 16 * (c + 4)));
        // elements (within the 32-block) 2c+j, 8+2c+j (sub-block A), 16+2c+j, 24+2c+j (B)
        const __m256i wa0 = _mm256_or_si256(_mm256_and_si256(ta, lo4), _mm256_slli_epi16(_mm256_and_si256(h, m03), 4));
        const __m256i wa1 = _mm256_or_si256(_mm256_and_si256(tb, lo4), _mm256_slli_epi16(_mm256_and_si256(h, m0c), 2));
        const __m256i wb0 = _mm256_or_si256(_mm256_srli_epi16(ta, 4), _mm256_and_si256(h, m30));
        const __m256i wb1 = _mm256_or_si256(_mm256_srli_epi16(tb, 4), _mm256_srli_epi16(_mm256_and_si256(h, mc0), 2));
        for (int r = 0; r < MR; ++r) {
          const int16_t* xb = xq + r * K + xo;
          ia[r] = _mm256_add_epi32(ia[r], _mm256_add_epi32(_mm256_madd_epi16(wa0, xpair(xb, 2 * c)),
                                                           _mm256_madd_epi16(wa1, xpair(xb, 8 + 2 * c))));
          ib[r] = _mm256_add_epi32(ib[r], _mm256_add_epi32(_mm256_madd_epi16(wb0, xpair(xb, 16 + 2 * c)),
                                                           _mm256_madd_epi16(wb1, xpair(xb, 24 + 2 * c))));
        }
      }
      __m256i sa, sb;
      q6k_iscales256(gb, bl, sa, sb);
      const int64_t b = B * 8 + bl;
      for (int r = 0; r < MR; ++r) {
        const int32_t* s16 = xs16 + r * (K / 16) + 2 * b;
        const __m256i a = _mm256_sub_epi32(ia[r], _mm256_set1_epi32(32 * s16[0]));
        const __m256i bb = _mm256_sub_epi32(ib[r], _mm256_set1_epi32(32 * s16[1]));
        isb[r] = _mm256_add_epi32(isb[r], _mm256_add_epi32(_mm256_mullo_epi32(a, sa), _mm256_mullo_epi32(bb, sb)));
      }
    }
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xd[r * nsb + B])), _mm256_cvtepi32_ps(isb[r]), acc[r]);
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

// The AVX-512 VNNI tiles: MR activation rows x TWO groups (16 weight rows, the groups at wg
// and wg + gstride), out[r * ldo + j] for j < 16. A chunk's 16 bytes of each group widen to
// one zmm (lanes 0-7 group g, 8-15 group g + 1) and vpdpbusd (int8 lanes, below) or
// vpdpwssd (int16 pairs) adds the dots into the int32 sub-block sums, exact whatever the
// order or number of partial sums (CH chains hide the instruction's latency when few rows
// share a weight vector). The fp32 steps are the AVX2 tiles', lane for lane, so all give the
// same bits (tests/unit/test_kernel_quant_k.py).
//
// The two group streams of a tile sit gstride apart, and a work unit's next tile reads the
// 2 gstride bytes after them (run_units walks groups in memory order). So at super-block B
// the tile prefetches the next pair's bytes at the rate it consumes its own: 2 GB bytes
// per super-block, one pair ahead. (A fixed distance within each stream, csrc/quant.cpp's
// way, fell on the other stream's current bytes at K = 2048: gate_up [16384, 2048] Q4_K at
// M = 1 ran at 13 GB/s against the one-stream AVX2 tile's 24.)
// Called once per sub-block j (0..7) of super-block B: an eighth of the pair's bytes each.
TS_TARGET_AVX512VNNI inline void prefetch_next_pair(const uint8_t* wg, int64_t gstride, int64_t B, int64_t GB,
                                                    int j) {
  const char* p = reinterpret_cast<const char*>(wg + 2 * gstride + 2 * B * GB) + j * GB / 4;
  const int n = int((GB / 4 + 63) / 64);  // lines a sub-block; a fixed count (no loop bounds to work out)
#pragma GCC unroll 8
  for (int i = 0; i < n; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T0);
}

// The int8 tiles (vpdpbusd: a 32-bit lane adds four u8 x s8 products): the weights' quants
// are unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63), the activations int8 (|q| <= 127), so
// one instruction does what two vpdpwssd do. A lane holds four elements of one weight row
// of one sub-block, and the activations are stored in the same order once per GEMM
// (reorder_q8 below), so the k8 layout is read as it is:
//   Q4_K / Q5_K chunk p: row r's two bytes hold elements 2p, 2p+1 (low nibbles) and
//       16+2p, 17+2p (high nibbles) -> lane [e 2p, 2p+1, 16+2p, 17+2p]
//   Q6_K, 32-block, c = 0..3: sub-block A lane [2c, 2c+1, 8+2c, 9+2c] from low chunks c and
//       c+4's low nibbles and high bits t = 0, 1; sub-block B lane [16+2c, 17+2c, 24+2c,
//       25+2c] from their high nibbles and t = 2, 3.
// The integer sums are the int16 tiles' (exact), and the fp32 steps are theirs lane for
// lane: with the same int8-valued activations every tile gives the same bits.
//
// q8 [K]: activation lane L of 32-block b at q8[32 b + 4 L .. + 3]. acc += w . (lane `lane`
// of 32-block b, broadcast to 16 lanes): one vpdpbusd with the activations as an
// embedded-broadcast memory operand ({1to16}), where GCC 12 makes _mm512_dpbusd_epi32 on an
// _mm512_set1_epi32 of them two instructions (a vpbroadcastd first). The same bits; Q6_K on
// the 8-row tiles at 5-8 rows 0.93-0.94 of the two-instruction form's time, on the 16-row
// ones 0.95-0.99, Q4_K 0.98-1.0 (Zen 4, one thread, in cache; bench/README.md "What a
// vpdpbusd cycle buys on Zen 4").
TS_TARGET_AVX512VNNI inline __m512i dpbusd_xquad512(__m512i acc, __m512i w, const int8_t* q8, int64_t b, int lane) {
  using quad = int32_t __attribute__((may_alias));
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const quad*>(q8 + 32 * b + 4 * lane)));
  return acc;
}

// A Q4_K / Q5_K super-block's fp32 step for one activation row, 16 lanes: msum from the
// mins and the row's eight 32-element sums bs (four vpdpwssd), then
// acc = fma(d dx, float(isum), acc), acc = fma(-(dmin dx), float(msum), acc) (the header's
// formula).
TS_TARGET_AVX512VNNI inline __m512 q45k_fp32_step512(const Q45Header512& h, const Q45Ints512& in, const int16_t* bs,
                                                     float xd, __m512i isum, __m512 acc) {
  __m512i ms = _mm512_dpwssd_epi32(_mm512_setzero_si512(), in.mp[0], xpair512(bs, 0));
  for (int i = 1; i < 4; ++i) ms = _mm512_dpwssd_epi32(ms, in.mp[i], xpair512(bs, 2 * i));
  const __m512 dx = _mm512_set1_ps(xd);
  acc = _mm512_fmadd_ps(_mm512_mul_ps(h.d, dx), _mm512_cvtepi32_ps(isum), acc);
  return _mm512_fnmadd_ps(_mm512_mul_ps(h.dmin, dx), _mm512_cvtepi32_ps(ms), acc);
}

// Q4_K / Q5_K, both activation widths: A = int16_t (xq [K], vpdpwssd, two per chunk) or
// int8_t (q8 [K] in lane order, vpdpbusd, one per chunk). A sub-block's dot is scaled
// (vpmulld) into the super-block's int32 sum; the fp32 step runs once per super-block.
template <int QT, int MR, class A>
TS_TARGET_AVX512VNNI void tile_q45k_512(const A* __restrict xa, const float* __restrict xd,
                                        const int16_t* __restrict xbs, const int32_t*, int64_t K,
                                        const uint8_t* __restrict wg, int64_t gstride, float* __restrict out,
                                        int64_t ldo) {
  constexpr bool I8 = std::is_same_v<A, int8_t>;
  constexpr int CH = MR <= 2 ? 4 : MR <= 4 ? 2 : 1;
  const int64_t nsb = K / QKK, nb = K / QB;
  constexpr int64_t GB = group_bytes(QT), SB = sub_bytes(QT);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i lo4w = _mm512_set1_epi16(0x0f), bit4w = _mm512_set1_epi16(0x10);  // int16 lanes
  for (int64_t B = 0; B < nsb; ++B) {
    const uint8_t* ga = wg + B * GB;
    const uint8_t* gc = ga + gstride;
    const Q45Header512 h = q45k_header512(ga, gc);
    Q45Ints512 in;
    q45k_ints512(h, in);
    __m512i isb[MR];
    for (int r = 0; r < MR; ++r) isb[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sa = ga + 128 + SB * j;
      const uint8_t* sc_ = gc + 128 + SB * j;
      prefetch_next_pair(wg, gstride, B, GB, j);
      const int64_t b = B * 8 + j;
      __m512i isum[MR][CH];
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < CH; ++c) isum[r][c] = _mm512_setzero_si512();
      if constexpr (I8) {
        const __m512i hb = QT == Q5_K ? q5k_fifth512(sa, sc_) : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
          const __m512i w = q45k_lane512<QT>(sa, sc_, hb, p);
          const int ch = p % CH;
          for (int r = 0; r < MR; ++r)
            isum[r][ch] = dpbusd_xquad512(isum[r][ch], w, xa + r * K, b, p);
        }
      } else {
        __m512i hl = _mm512_setzero_si512(), hh = _mm512_setzero_si512();
        if constexpr (QT == Q5_K) {
          hl = _mm512_slli_epi16(_mm512_cvtepu8_epi16(pair16(sa + 128, sc_ + 128)), 4);
          hh = _mm512_slli_epi16(_mm512_cvtepu8_epi16(pair16(sa + 144, sc_ + 144)), 4);
        }
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
          const __m512i t = _mm512_cvtepu8_epi16(pair16(sa + 16 * p, sc_ + 16 * p));
          __m512i wl = _mm512_and_si512(t, lo4w), wh = _mm512_srli_epi16(t, 4);
          if constexpr (QT == Q5_K) {
            wl = _mm512_or_si512(wl, _mm512_and_si512(hl, bit4w));
            wh = _mm512_or_si512(wh, _mm512_and_si512(hh, bit4w));
            hl = _mm512_srli_epi16(hl, 1);
            hh = _mm512_srli_epi16(hh, 1);
          }
          const int c_lo = (2 * p) % CH, c_hi = (2 * p + 1) % CH;
          for (int r = 0; r < MR; ++r) {
            const int16_t* xb = xa + r * K + QB * b;
            isum[r][c_lo] = _mm512_dpwssd_epi32(isum[r][c_lo], wl, xpair512(xb, 2 * p));
            isum[r][c_hi] = _mm512_dpwssd_epi32(isum[r][c_hi], wh, xpair512(xb, 16 + 2 * p));
          }
        }
      }
      const __m512i scj = _mm512_load_si512(in.sc[j]);
      for (int r = 0; r < MR; ++r) {
        __m512i is = isum[r][0];
        for (int c = 1; c < CH; ++c) is = _mm512_add_epi32(is, isum[r][c]);
        isb[r] = _mm512_add_epi32(isb[r], _mm512_mullo_epi32(is, scj));
      }
    }
    for (int r = 0; r < MR; ++r)
      acc[r] = q45k_fp32_step512(h, in, xbs + r * nb + 8 * B, xd[r * nsb + B], isb[r], acc[r]);
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

// Q6_K, both activation widths (A as tile_q45k_512; int16: four vpdpwssd per chunk
// c, int8: two vpdpbusd).
template <int QT, int MR, class A>
TS_TARGET_AVX512VNNI void tile_q6k_512(const A* __restrict xa, const float* __restrict xd, const int16_t*,
                                       const int32_t* __restrict xs16, int64_t K, const uint8_t* __restrict wg,
                                       int64_t gstride, float* __restrict out, int64_t ldo) {
  static_assert(QT == Q6_K);
  constexpr bool I8 = std::is_same_v<A, int8_t>;
  constexpr int CH = I8 ? (MR <= 2 ? 4 : MR <= 4 ? 2 : 1) : (MR <= 2 ? 2 : 1);
  const int64_t nsb = K / QKK;
  constexpr int64_t GB = group_bytes(Q6_K);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const Q6Lanes512 lanes = q6k_lane_consts512();
  const __m512i lo4 = _mm512_set1_epi16(0x0f), m03 = _mm512_set1_epi16(0x03), m0c = _mm512_set1_epi16(0x0c),
                m30 = _mm512_set1_epi16(0x30), mc0 = _mm512_set1_epi16(0xc0);  // int16 lanes
  for (int64_t B = 0; B < nsb; ++B) {
    const uint8_t* ga = wg + B * GB;
    const uint8_t* gc = ga + gstride;
    const __m512 d = _mm512_cvtph_ps(pair16(ga, gc));
    __m512i isb[MR];
    for (int r = 0; r < MR; ++r) isb[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int bl = 0; bl < 8; ++bl) {
      const uint8_t* ba = ga + 144 + 192 * bl;
      const uint8_t* bc = gc + 144 + 192 * bl;
      prefetch_next_pair(wg, gstride, B, GB, bl);
      const int64_t b = B * 8 + bl;
      // Q6_K's "- 32": the chains start at -32 x the row's 16-element sums (exact integers)
      __m512i ia[MR][CH], ib[MR][CH];
      for (int r = 0; r < MR; ++r) {
        const int32_t* s16 = xs16 + r * (K / 16) + 2 * b;
        ia[r][0] = _mm512_set1_epi32(-32 * s16[0]), ib[r][0] = _mm512_set1_epi32(-32 * s16[1]);
        for (int c = 1; c < CH; ++c) ia[r][c] = _mm512_setzero_si512(), ib[r][c] = _mm512_setzero_si512();
      }
      if constexpr (I8) {
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          __m512i wa, wb;
          q6k_lanes512(lanes, ba, bc, c, wa, wb);
          const int ch = c % CH;
          for (int r = 0; r < MR; ++r) {
            ia[r][ch] = dpbusd_xquad512(ia[r][ch], wa, xa + r * K, b, c);
            ib[r][ch] = dpbusd_xquad512(ib[r][ch], wb, xa + r * K, b, 4 + c);
          }
        }
      } else {
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m512i h = _mm512_cvtepu8_epi16(pair16(ba + 128 + 16 * c, bc + 128 + 16 * c));
          const __m512i ta = _mm512_cvtepu8_epi16(pair16(ba + 16 * c, bc + 16 * c));
          const __m512i tb = _mm512_cvtepu8_epi16(pair16(ba + 16 * (c + 4), bc + 16 * (c + 4)));
          const __m512i wa0 = _mm512_or_si512(_mm512_and_si512(ta, lo4), _mm512_slli_epi16(_mm512_and_si512(h, m03), 4));
          const __m512i wa1 = _mm512_or_si512(_mm512_and_si512(tb, lo4), _mm512_slli_epi16(_mm512_and_si512(h, m0c), 2));
          const __m512i wb0 = _mm512_or_si512(_mm512_srli_epi16(ta, 4), _mm512_and_si512(h, m30));
          const __m512i wb1 = _mm512_or_si512(_mm512_srli_epi16(tb, 4), _mm512_srli_epi16(_mm512_and_si512(h, mc0), 2));
          const int ch = c % CH;
          for (int r = 0; r < MR; ++r) {
            const int16_t* xb = xa + r * K + QB * b;
            ia[r][ch] = _mm512_dpwssd_epi32(ia[r][ch], wa0, xpair512(xb, 2 * c));
            ia[r][ch] = _mm512_dpwssd_epi32(ia[r][ch], wa1, xpair512(xb, 8 + 2 * c));
            ib[r][ch] = _mm512_dpwssd_epi32(ib[r][ch], wb0, xpair512(xb, 16 + 2 * c));
            ib[r][ch] = _mm512_dpwssd_epi32(ib[r][ch], wb1, xpair512(xb, 24 + 2 * c));
          }
        }
      }
      __m512i sa, sb;
      q6k_iscales512(ga, gc, bl, sa, sb);
      for (int r = 0; r < MR; ++r) {
        __m512i a = ia[r][0], bb = ib[r][0];
        for (int c = 1; c < CH; ++c) a = _mm512_add_epi32(a, ia[r][c]), bb = _mm512_add_epi32(bb, ib[r][c]);
        isb[r] = _mm512_add_epi32(isb[r], _mm512_add_epi32(_mm512_mullo_epi32(a, sa), _mm512_mullo_epi32(bb, sb)));
      }
    }
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xd[r * nsb + B])), _mm512_cvtepi32_ps(isb[r]), acc[r]);
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

// The 16-row int8 tiles: 16 activation rows against a pair of groups (16 weight rows).
// The 8-row tiles above build a sub-block's weight lanes once per 8 rows and keep two
// accumulators a row in registers (acc, isb, plus the dot chains), so 16 rows cost two lane
// builds; here the sub-block's lanes are built once into registers (Q4_K / Q5_K: 8 zmm;
// Q6_K: 2 x 4), each row's dot is a short vpdpbusd chain scaled into its isb (16 zmm), and
// the fp32 accumulators live in out (read and written once a super-block). The integer
// sums and fp32 steps are the 8-row tiles' lane for lane: the same bits. On Zen 4 (one
// zmm vpdpbusd a cycle) a 16-row GEMM on Llama-3.2-1B's shapes takes 0.78-0.90 of the 8-row
// tiles' time on Q6_K, whose lanes are costly to build, and 0.93-1.02 on Q4_K / Q5_K
// (bench/README.md "16-row int8 tiles").
template <int QT>
TS_TARGET_AVX512VNNI void tile_q45k_512x16(const int8_t* __restrict xa, const float* __restrict xd,
                                           const int16_t* __restrict xbs, const int32_t*, int64_t K,
                                           const uint8_t* __restrict wg, int64_t gstride, float* __restrict out,
                                           int64_t ldo) {
  constexpr int MR = 16;
  const int64_t nsb = K / QKK, nb = K / QB;
  constexpr int64_t GB = group_bytes(QT), SB = sub_bytes(QT);
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_setzero_ps());
  for (int64_t B = 0; B < nsb; ++B) {
    const uint8_t* ga = wg + B * GB;
    const uint8_t* gc = ga + gstride;
    const Q45Header512 h = q45k_header512(ga, gc);
    Q45Ints512 in;
    q45k_ints512(h, in);
    __m512i isb[MR];
    for (int r = 0; r < MR; ++r) isb[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sa = ga + 128 + SB * j;
      const uint8_t* sc_ = gc + 128 + SB * j;
      prefetch_next_pair(wg, gstride, B, GB, j);
      const int64_t b = B * 8 + j;
      const __m512i hb = QT == Q5_K ? q5k_fifth512(sa, sc_) : _mm512_setzero_si512();
      __m512i w[8];
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) w[p] = q45k_lane512<QT>(sa, sc_, hb, p);
      const __m512i scj = _mm512_load_si512(in.sc[j]);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {  // two chains of four a row
        const int8_t* xr = xa + r * K;
        __m512i i0 = dpbusd_xquad512(_mm512_setzero_si512(), w[0], xr, b, 0);
        __m512i i1 = dpbusd_xquad512(_mm512_setzero_si512(), w[1], xr, b, 1);
#pragma GCC unroll 3
        for (int p = 2; p < 8; p += 2) {
          i0 = dpbusd_xquad512(i0, w[p], xr, b, p);
          i1 = dpbusd_xquad512(i1, w[p + 1], xr, b, p + 1);
        }
        isb[r] = _mm512_add_epi32(isb[r], _mm512_mullo_epi32(_mm512_add_epi32(i0, i1), scj));
      }
    }
    for (int r = 0; r < MR; ++r)
      _mm512_storeu_ps(out + r * ldo, q45k_fp32_step512(h, in, xbs + r * nb + 8 * B, xd[r * nsb + B], isb[r],
                                                        _mm512_loadu_ps(out + r * ldo)));
  }
}

// Q6_K on 16 rows (as tile_q45k_512x16; a 32-block's two sub-blocks' lanes in 2 x 4 zmm).
TS_TARGET_AVX512VNNI void tile_q6k_512x16(const int8_t* __restrict xa, const float* __restrict xd, const int16_t*,
                                          const int32_t* __restrict xs16, int64_t K, const uint8_t* __restrict wg,
                                          int64_t gstride, float* __restrict out, int64_t ldo) {
  constexpr int MR = 16;
  const int64_t nsb = K / QKK;
  constexpr int64_t GB = group_bytes(Q6_K);
  const Q6Lanes512 lanes = q6k_lane_consts512();
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_setzero_ps());
  for (int64_t B = 0; B < nsb; ++B) {
    const uint8_t* ga = wg + B * GB;
    const uint8_t* gc = ga + gstride;
    const __m512 d = _mm512_cvtph_ps(pair16(ga, gc));
    __m512i isb[MR];
    for (int r = 0; r < MR; ++r) isb[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int bl = 0; bl < 8; ++bl) {
      const uint8_t* ba = ga + 144 + 192 * bl;
      const uint8_t* bc = gc + 144 + 192 * bl;
      prefetch_next_pair(wg, gstride, B, GB, bl);
      const int64_t b = B * 8 + bl;
      __m512i wa[4], wb[4];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) q6k_lanes512(lanes, ba, bc, c, wa[c], wb[c]);
      __m512i sa, sb;
      q6k_iscales512(ga, gc, bl, sa, sb);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {  // Q6_K's "- 32": the chains start at -32 x the 16-element sums
        const int8_t* xr = xa + r * K;
        const int32_t* s16 = xs16 + r * (K / 16) + 2 * b;
        __m512i ia = _mm512_set1_epi32(-32 * s16[0]), ib = _mm512_set1_epi32(-32 * s16[1]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          ia = dpbusd_xquad512(ia, wa[c], xr, b, c);
          ib = dpbusd_xquad512(ib, wb[c], xr, b, 4 + c);
        }
        isb[r] = _mm512_add_epi32(isb[r], _mm512_add_epi32(_mm512_mullo_epi32(ia, sa), _mm512_mullo_epi32(ib, sb)));
      }
    }
    for (int r = 0; r < MR; ++r) {
      __m512 acc = _mm512_loadu_ps(out + r * ldo);
      acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xd[r * nsb + B])), _mm512_cvtepi32_ps(isb[r]), acc);
      _mm512_storeu_ps(out + r * ldo, acc);
    }
  }
}

// The one-row tiles (a batch-1 GEMM) on AVX-512 VNNI CPUs: the int8 tiles' lanes and
// vpdpbusd on 256-bit vectors, one group of 8 weight rows per tile, so each thread reads one
// stream of weights (the two-group tiles' two streams read DRAM slower at one row), with
// about two thirds of the AVX2 int8 tile's instructions per weight (no int16 sums to
// widen): when the memory is fast, the one-row GEMM is bound by its instructions. The
// integer sums are those of every tile, the fp32 steps tile_q45k's / tile_q6k's lane for
// lane: the same bits. q8: one row in reorder_q8's lane order; xd, xbs: its scales and
// 32-element sums.
template <int QT>
TS_TARGET_AVX512VNNI void tile_q45k_row256(const int8_t* __restrict q8, const float* __restrict xd,
                                           const int16_t* __restrict xbs, int64_t K, const uint8_t* __restrict wg,
                                           float* __restrict out) {
  const int64_t nsb = K / QKK;
  constexpr int64_t GB = group_bytes(QT), SB = sub_bytes(QT);
  __m256 acc = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi32(0x0f0f0f0f), bit4 = _mm256_set1_epi32(0x10101010);
  for (int64_t B = 0; B < nsb; ++B) {
    const uint8_t* gb = wg + B * GB;
    const Q45Header256 h = q45k_header256(gb);
    __m256i isb = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      const uint8_t* sub = gb + 128 + SB * j;
      prefetch_ahead<QT>(sub);
      const int8_t* xb = q8 + QB * (B * 8 + j);
      __m256i is[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                       _mm256_setzero_si256()};
      __m256i hb = _mm256_setzero_si256();  // lane bytes: fifth bits of [2p + j] (low) and [16 + 2p + j]
      if constexpr (QT == Q5_K)
        hb = _mm256_or_si256(_mm256_cvtepu16_epi32(load16(sub + 128)),
                             _mm256_slli_epi32(_mm256_cvtepu16_epi32(load16(sub + 144)), 16));
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        // lane [b0, b1, 0, 0] -> [b0 & 15, b1 & 15, b0 >> 4, b1 >> 4]
        const __m256i t = _mm256_cvtepu16_epi32(load16(sub + 16 * p));
        __m256i w = _mm256_ternarylogic_epi32(t, _mm256_slli_epi32(t, 12), nib, 0xA8);  // (a | b) & c
        if constexpr (QT == Q5_K) {  // bit p of each fifth-bit byte, moved to bit 4 (one shift)
          const __m256i hp = p < 4 ? _mm256_slli_epi32(hb, 4 - p) : p > 4 ? _mm256_srli_epi32(hb, p - 4) : hb;
          w = _mm256_ternarylogic_epi32(w, hp, bit4, 0xF8);  // a | (b & c)
        }
        int32_t v;
        std::memcpy(&v, xb + 4 * p, 4);
        is[p % 4] = _mm256_dpbusd_epi32(is[p % 4], w, _mm256_set1_epi32(v));
      }
      const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(is[0], is[1]), _mm256_add_epi32(is[2], is[3]));
      isb = _mm256_add_epi32(isb, _mm256_mullo_epi32(isum, q45k_iscale256(h, j)));
    }
    __m256i mp[4];
    for (int i = 0; i < 4; ++i) mp[i] = q45k_mpair256(h, i);
    acc = q45k_fp32_step256(h, mp, isb, xd[B], xbs + 8 * B, acc);
  }
  _mm256_storeu_ps(out, acc);
}

// Q6_K's one-row tile (tile_q6k_512's int8 lanes on one group); xs16: the row's 16-element
// activation sums.
TS_TARGET_AVX512VNNI void tile_q6k_row256(const int8_t* __restrict q8, const float* __restrict xd,
                                          const int32_t* __restrict xs16, int64_t K, const uint8_t* __restrict wg,
                                          float* __restrict out) {
  const int64_t nsb = K / QKK;
  constexpr int64_t GB = group_bytes(Q6_K);
  __m256 acc = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi32(0x0f0f0f0f), ma = _mm256_set1_epi32(0x0c0c0303),
                mb = _mm256_set1_epi32(int32_t(0xc0c03030u)), sha = _mm256_set1_epi32(0x00020004),
                shb = _mm256_set1_epi32(0x00020000);
  // word indices: lane r = [a word r, b word r] (two sources), [word r, word r] (one source)
  const __m256i pab = _mm256_setr_epi16(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m256i pdup = _mm256_setr_epi16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t B = 0; B < nsb; ++B) {
    const uint8_t* gb = wg + B * GB;
    const __m256 d = load8_fp16(gb);
    __m256i isb = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int bl = 0; bl < 8; ++bl) {
      const uint8_t* blk = gb + 144 + 192 * bl;
      prefetch_ahead<Q6_K>(blk);
      const int64_t b = B * 8 + bl;
      const int8_t* xb = q8 + QB * b;
      // Q6_K's "- 32": the chains start at -32 x the row's 16-element sums (exact integers)
      __m256i ia[2] = {_mm256_set1_epi32(-32 * xs16[2 * b]), _mm256_setzero_si256()};
      __m256i ib[2] = {_mm256_set1_epi32(-32 * xs16[2 * b + 1]), _mm256_setzero_si256()};
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        // lane [ta0, ta1, tb0, tb1] (low chunks c, c + 4) and [h0, h1, h0, h1] (high chunk c)
        const __m256i t = _mm256_permutex2var_epi16(_mm256_castsi128_si256(load16(blk + 16 * c)), pab,
                                                    _mm256_castsi128_si256(load16(blk + 16 * (c + 4))));
        const __m256i h = _mm256_permutexvar_epi16(pdup, _mm256_castsi128_si256(load16(blk + 128 + 16 * c)));
        // A: low nibbles | high bits t = 0 (bytes 0, 1: << 4) and t = 1 (bytes 2, 3: << 2)
        const __m256i wa =
            _mm256_ternarylogic_epi32(t, nib, _mm256_sllv_epi16(_mm256_and_si256(h, ma), sha), 0xEA);
        // B: high nibbles | high bits t = 2 (in place) and t = 3 (bytes 2, 3: >> 2)
        const __m256i wb = _mm256_ternarylogic_epi32(_mm256_srli_epi32(t, 4), nib,
                                                     _mm256_srlv_epi16(_mm256_and_si256(h, mb), shb), 0xEA);
        int32_t va, vb;
        std::memcpy(&va, xb + 4 * c, 4);
        std::memcpy(&vb, xb + 16 + 4 * c, 4);
        ia[c % 2] = _mm256_dpbusd_epi32(ia[c % 2], wa, _mm256_set1_epi32(va));
        ib[c % 2] = _mm256_dpbusd_epi32(ib[c % 2], wb, _mm256_set1_epi32(vb));
      }
      __m256i sa, sb;
      q6k_iscales256(gb, bl, sa, sb);
      isb = _mm256_add_epi32(isb, _mm256_add_epi32(_mm256_mullo_epi32(_mm256_add_epi32(ia[0], ia[1]), sa),
                                                   _mm256_mullo_epi32(_mm256_add_epi32(ib[0], ib[1]), sb)));
    }
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xd[B])), _mm256_cvtepi32_ps(isb), acc);
  }
  _mm256_storeu_ps(out, acc);
}

// One row's quants q [K] (int16, values in -127..127) -> q8 [K] in the int8 tiles' lane
// order (above): 32-block b, lane L at q8[32 b + 4 L ..].
inline void reorder_q8(int qt, const int16_t* q, int64_t K, int8_t* q8) {
  for (int64_t b = 0; b < K / QB; ++b) {
    const int16_t* x = q + QB * b;
    int8_t* o = q8 + QB * b;
    for (int L = 0; L < 8; ++L) {
      int e0, e1;  // the lane's two element pairs (e0, e0 + 1), (e1, e1 + 1)
      if (qt == Q6_K) e0 = L < 4 ? 2 * L : 16 + 2 * (L - 4), e1 = e0 + 8;
      else e0 = 2 * L, e1 = 16 + 2 * L;
      o[4 * L] = int8_t(x[e0]), o[4 * L + 1] = int8_t(x[e0 + 1]);
      o[4 * L + 2] = int8_t(x[e1]), o[4 * L + 3] = int8_t(x[e1 + 1]);
    }
  }
}

// The AVX-512 VNNI tiles' signature for activations of type A (int16_t: vpdpwssd, int8_t:
// vpdpbusd), and their tables by qtype and row count.
template <class A>
using Tile512Fn = void (*)(const A*, const float*, const int16_t*, const int32_t*, int64_t, const uint8_t*, int64_t,
                           float*, int64_t);

template <int QT, class A, size_t... I>
constexpr std::array<Tile512Fn<A>, sizeof...(I)> avx512_tiles(std::index_sequence<I...>) {
  if constexpr (QT == Q6_K) return {&tile_q6k_512<QT, int(I) + 1, A>...};
  else return {&tile_q45k_512<QT, int(I) + 1, A>...};
}

template <class A>
constexpr std::array<std::array<Tile512Fn<A>, kQuantMrAvx512>, 3> avx512_table() {
  constexpr auto rows = std::make_index_sequence<size_t(kQuantMrAvx512)>{};
  return {avx512_tiles<Q4_K, A>(rows), avx512_tiles<Q5_K, A>(rows), avx512_tiles<Q6_K, A>(rows)};
}
constexpr auto kAvx512Tiles16 = avx512_table<int16_t>();
constexpr auto kAvx512Tiles8 = avx512_table<int8_t>();

// The AVX-512 VNNI tile of qtype qt for mr rows (1..kQuantMrAvx512) on int16 (vpdpwssd) or
// int8 (vpdpbusd) activations.
inline Tile512Fn<int16_t> pick_tile2(int qt, int mr) {
  return kAvx512Tiles16[qt - Q4_K][std::clamp<int>(mr, 1, kQuantMrAvx512) - 1];
}
inline Tile512Fn<int8_t> pick_tile8(int qt, int mr) {
  return kAvx512Tiles8[qt - Q4_K][std::clamp<int>(mr, 1, kQuantMrAvx512) - 1];
}

using TileFn = void (*)(const int16_t*, const float*, const int16_t*, const int32_t*, int64_t, const uint8_t*, float*,
                       int64_t);

using Tile8Fn = void (*)(const int8_t*, const float*, const int16_t*, const int32_t*, int64_t, const uint8_t*, float*,
                        int64_t);

// The AVX2 int8 tile (vpmaddubsw) of Q4_K / Q5_K for mr rows (1..kQuantMr).
template <int QT>
Tile8Fn pick_tile_i8(int mr) {
  switch (mr) {
    case 1: return &tile_q45k<QT, 1, int8_t>;
    case 2: return &tile_q45k<QT, 2, int8_t>;
    case 3: return &tile_q45k<QT, 3, int8_t>;
    default: return &tile_q45k<QT, 4, int8_t>;
  }
}

template <int QT>
TileFn pick_tile(int mr) {
  if constexpr (QT == Q6_K) {
    switch (mr) {
      case 1: return &tile_q6k<QT, 1>;
      case 2: return &tile_q6k<QT, 2>;
      case 3: return &tile_q6k<QT, 3>;
      default: return &tile_q6k<QT, 4>;
    }
  } else {
    switch (mr) {
      case 1: return &tile_q45k<QT, 1>;
      case 2: return &tile_q45k<QT, 2>;
      case 3: return &tile_q45k<QT, 3>;
      default: return &tile_q45k<QT, 4>;
    }
  }
}
#endif  // TS_X86

// A GEMM's quantised activations (all [M, .] row-major): xq int16 [K], q8 int8 [K] in the
// int8 tiles' lane order (or null: the int16 tiles), xd fp32 [K / 256], xbs int16 [K / 32],
// xs16 int32 [K / 16] (Q6_K's 16-element sums, else null).
struct Act {
  const int16_t* xq;
  const int8_t* q8;
  const float* xd;
  const int16_t* xbs;
  const int32_t* xs16;
  int64_t K;
  const int16_t* q(int64_t m) const { return xq + m * K; }
  const int8_t* q8r(int64_t m) const { return q8 + m * K; }
  const float* d(int64_t m) const { return xd + m * (K / QKK); }
  const int16_t* bs(int64_t m) const { return xbs + m * (K / QB); }
  const int32_t* s16(int64_t m) const { return xs16 ? xs16 + m * (K / 16) : nullptr; }
};

#ifdef TS_X86
// Rows [m0, m0 + rows) x weight-row groups [g0, g1) into y (+ bias) on AVX-512 VNNI: two
// groups per tile (an odd last group: the AVX2 tile, whose lanes give the same bits), rows
// in balanced blocks of at most kQuantMrAvx512 (any split gives the same bits); on int8
// activations (a.q8) whole blocks of 16 rows first go to the 16-row tiles (tile16: not
// under the _quant_k_no_tile16 test hook).
void compute_block_avx512(int qt, const Act& a, int64_t m0, int64_t rows, const uint8_t* w, int64_t g0, int64_t g1,
                          const float* bias, void* y, bool y_bf16, int64_t N, bool tile16) {
  const int64_t K = a.K, gstride = (K / QKK) * group_bytes(qt);
  if (tile16 && a.q8 && rows >= 16) {
    const int64_t r16 = rows / 16 * 16, gp = g0 + (g1 - g0) / 2 * 2;  // gp: past the last pair
    Tile512Fn<int8_t> fn = qt == Q6_K ? &tile_q6k_512x16 : qt == Q4_K ? &tile_q45k_512x16<Q4_K>
                                                                      : &tile_q45k_512x16<Q5_K>;
    alignas(64) float out[16 * 2 * RG];
    for (int64_t g = g0; g < gp; g += 2)
      for (int64_t m = m0; m < m0 + r16; m += 16) {
        fn(a.q8r(m), a.d(m), a.bs(m), a.s16(m), K, w + g * gstride, gstride, out, 2 * RG);
        qact::store_tile16(out, 16, std::min<int64_t>(2 * RG, N - g * RG), bias, y, y_bf16, N, m, g * RG);
      }
    if (gp < g1) compute_block_avx512(qt, a, m0, r16, w, gp, g1, bias, y, y_bf16, N, false);  // a lone group
    if (rows > r16) compute_block_avx512(qt, a, m0 + r16, rows - r16, w, g0, g1, bias, y, y_bf16, N, false);
    return;
  }
  qact::compute_group_pairs(
      m0, rows, w, gstride, g0, g1, bias, y, y_bf16, N,
      [&](int64_t m, int mr, const uint8_t* wg, float* out) {
        if (a.q8) pick_tile8(qt, mr)(a.q8r(m), a.d(m), a.bs(m), a.s16(m), K, wg, gstride, out, 2 * RG);
        else pick_tile2(qt, mr)(a.q(m), a.d(m), a.bs(m), a.s16(m), K, wg, gstride, out, 2 * RG);
      },
      [&](int64_t m, int mr, const uint8_t* wg, float* out) {
        for (int r0 = 0; r0 < mr; r0 += int(kQuantMr)) {  // AVX2 tiles of <= 4 rows
          const int r1 = std::min(mr, r0 + int(kQuantMr));
          TileFn fn = qt == Q4_K ? pick_tile<Q4_K>(r1 - r0) : qt == Q5_K ? pick_tile<Q5_K>(r1 - r0)
                                                                          : pick_tile<Q6_K>(r1 - r0);
          fn(a.q(m + r0), a.d(m + r0), a.bs(m + r0), a.s16(m + r0), K, wg, out + r0 * 2 * RG, 2 * RG);
        }
      });
}
#endif  // TS_X86

// Rows [m0, m0 + rows) x weight-row groups [g0, g1) into y (+ bias).
// a.q8: the int8 activations in lane order (AVX2 Q4_K / Q5_K int8 tiles), or null (int16 tiles).
// row256: a one-row GEMM on an AVX-512 VNNI CPU, on the one-row tiles (a.q8 given).
void compute_block(int qt, bool avx2, bool row256, const Act& a, int64_t m0, int64_t rows, const uint8_t* w,
                   int64_t g0, int64_t g1, const float* bias, void* y, bool y_bf16, int64_t N) {
  const int64_t K = a.K, gstride = (K / QKK) * group_bytes(qt);
  qact::compute_groups(m0, rows, kQuantMr, w, gstride, g0, g1, bias, y, y_bf16, N,
                       [&](int64_t m, int mr, int64_t ncols, const uint8_t* wg, float* tile) {
#ifdef TS_X86
    if (row256) {
      assert(m == 0 && mr == 1 && a.q8);
      if (qt == Q6_K) tile_q6k_row256(a.q8, a.xd, a.xs16, K, wg, tile);
      else (qt == Q4_K ? &tile_q45k_row256<Q4_K> : &tile_q45k_row256<Q5_K>)(a.q8, a.xd, a.xbs, K, wg, tile);
      return;
    }
    if (avx2 && a.q8) {  // Q4_K / Q5_K (quant_k_gemm passes no q8 for an AVX2 Q6_K)
      assert(qt != Q6_K);
      (qt == Q4_K ? pick_tile_i8<Q4_K>(mr) : pick_tile_i8<Q5_K>(mr))(a.q8r(m), a.d(m), a.bs(m), nullptr, K, wg,
                                                                    tile, RG);
      return;
    }
    if (avx2) {
      TileFn fn = qt == Q4_K ? pick_tile<Q4_K>(mr) : qt == Q5_K ? pick_tile<Q5_K>(mr) : pick_tile<Q6_K>(mr);
      fn(a.q(m), a.d(m), a.bs(m), a.s16(m), K, wg, tile, RG);
      return;
    }
#endif
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < ncols; ++j) tile[r * RG + j] = dot_scalar(qt, a.q(m + r), a.d(m + r), a.bs(m + r), K, wg, j);
  });
}

// A k8-packed weight of N rows (quant_k_gemm's w, quant_k_dequant_rows' table).
void check_k8(const char* fn, const torch::Tensor& w, int64_t qtype, int64_t N, int64_t K) {
  TORCH_CHECK(is_k_type(qtype), fn, ": qtype must be 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K), got ", qtype);
  TORCH_CHECK(K % QKK == 0, fn, ": K=", K, " is not a multiple of 256");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 &&
                  w.size(0) == (N + RG - 1) / RG && w.size(1) == K / QKK && w.size(2) == group_bytes(int(qtype)),
              fn, ": w must be contiguous uint8 [", (N + RG - 1) / RG, ", ", K / QKK, ", ", group_bytes(int(qtype)),
              "] (tokenserve.ops.quant.repack_k8), got ", w.sizes());
}

}  // namespace

// No FMA contraction here (GCC's C++ default -ffp-contract=fast would fuse fl(dw * q) + mw
// on an FMA target, e.g. -march=native): the two roundings are dequantize_k_ref's.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// Embedding lookup on a k8-packed k-quant table w (V rows): rows ids [T] dequantised as
// tokenserve.ops.quant.dequantize_k_ref does (fp32 fl(dw * q) + mw; Q6_K fl(dw * (q - 32))),
// [T, K] bf16 or fp32. The torch path decodes each id's whole 8-row group to int32 fields
// (~250 MB transient for a 500-token prefill of a 2048-wide table); this reads one row.
// Errors (RuntimeError): bad qtype, shapes, dtypes, or an id outside [0, V).
torch::Tensor quant_k_dequant_rows(const torch::Tensor& ids, const torch::Tensor& w, int64_t qtype, int64_t V,
                                   int64_t K, at::ScalarType out_dtype) {
  check_k8("quant_k_dequant_rows", w, qtype, V, K);
  TORCH_CHECK(K > 0, "quant_k_dequant_rows: K must be positive");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat, "quant_k_dequant_rows: bf16 or fp32 out");
  auto idx = ids.to(at::kLong).contiguous();
  const int64_t T = idx.numel(), nsb = K / QKK, GB = group_bytes(int(qtype));
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < V, "quant_k_dequant_rows: id ", ip[t], " out of range [0, ", V, ")");
  auto y = torch::empty({T, K}, w.options().dtype(out_dtype));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const bool bf = out_dtype == at::kBFloat16, q6 = qtype == Q6_K;
  void* yp = y.data_ptr();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    RowSuper rs;
    float dw[16], mw[8];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = ip[t] / RG, r = ip[t] % RG;
      for (int64_t B = 0; B < nsb; ++B) {
        unpack_row(int(qtype), wp + (g * nsb + B) * GB, int(r), rs);
        const int L = q6 ? 16 : 32;  // weights per sub-block
        for (int s = 0; s < QKK / L; ++s) dw[s] = rs.d * float(rs.sc[s]);
        for (int s = 0; s < 8; ++s) mw[s] = -(rs.dmin * float(rs.m[s]));
        for (int i = 0; i < QKK; ++i) {
          const float v = dw[i / L] * float(rs.q[i]);  // rounded, then the min added (no FMA)
          store1(yp, t * K + B * QKK + i, q6 ? v : v + mw[i / L], bf);
        }
      }
    }
  });
  return y;
}
#pragma GCC pop_options

// y = x @ W^T (+ bias) on k8-packed GGUF k-quant super-blocks.
//   x:     [M, K] bf16 or fp32 (K a multiple of 256)
//   w:     uint8 [ceil(N / 8), K / 256, group_bytes] (tokenserve.ops.quant.repack_k8)
//   qtype: 12 Q4_K, 13 Q5_K, 14 Q6_K (ggml's type ids)
//   bias:  [N] or None (used as fp32);  out_dtype: bf16 | fp32 (None: x's dtype)
// Returns [M, N]. Errors (RuntimeError): bad qtype, K, shapes or dtypes.
torch::Tensor quant_k_gemm(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                           const std::optional<torch::Tensor>& bias, std::optional<at::ScalarType> out_dtype) {
  check_gemm_x("quant_k_gemm", x);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(N >= 0, "quant_k_gemm: N must be >= 0");
  check_k8("quant_k_gemm", w, qtype, N, K);
  const GemmIo io = gemm_io("quant_k_gemm", x, N, bias, out_dtype);
  const at::ScalarType odt = io.dtype;
  const torch::Tensor& b = io.bias;
  auto y = torch::empty({M, N}, x.options().dtype(odt));
  if (M == 0 || N == 0) return y;
  const int64_t n16 = K / 16;
  const bool avx2 = avx2_enabled(g_force_portable);
  // AVX-512 VNNI tiles (two groups, up to 8 rows, or 16 on int8; vpdpbusd, or vpdpwssd under the test hook):
  // the same bits as the AVX2 ones. A one-row GEMM streams its weights from memory, and one
  // group stream per thread reads them faster than the two-group tiles' two (a Llama-3.2-1B
  // Q4_K_M batch-1 step 28.9 vs 32.5 ms on the AVX2 tiles, bench/README.md "K-quants on
  // int8 activations"), so it takes the one-row tiles (one group, vpdpbusd on 256 bits):
  // 21.5 vs 24.5 ms against the AVX2 tiles (medians, one process, alternated; "One-row
  // tiles" there).
  const bool vnni = avx2 && cpu_features().avx512vnni && !g_no_avx512.load();
  const bool avx512 = vnni && M > 1;
  const bool row256 = vnni && M == 1 && !g_no_int8.load() && !g_no_row_tile.load();
  const bool q6 = qtype == Q6_K;
  // The int8 tiles (test hook: the int16 ones); Q6_K has no AVX2 int8 tile, so off the
  // AVX-512 tiles its activations are read as int16 only (no lane-order copy made).
  const bool i8 = avx2 && !g_no_int8.load() && (avx512 || row256 || !q6);
  // From kAmxKMinRows rows on Intel AMX: the AMX-INT8 tiles (csrc/quant_k_amx.cpp), the same
  // bits, reading q8 and the scales of whole 16-row slices (the rows past M never stored).
  const bool amx = vnni && i8 && M >= g_amx_min_rows.load() && quant_amx_int_available();
  qact::ActBuffers& act = qact::act_buffers(amx ? (M + 15) / 16 * 16 : M, K, q6 && !amx, i8);
  const int16_t* qp = act.q.data();
  int8_t* q8p = i8 ? act.q8.data() : nullptr;
  const float* dp = act.ds.data();
  const int16_t* bsp = act.bs.data();
  int32_t* sp = q6 && !amx ? act.sums.data() : nullptr;  // AMX: the "- 32" is in the tile product
  qact::quantize_act_k(x.contiguous(), avx2, act, [&](int64_t m) {
    const int16_t* qm = qp + m * K;
    if (q8p) reorder_q8(int(qtype), qm, K, q8p + m * K);
    if (!sp) return;  // Q6_K's "-32": the sums of 16-element runs
    for (int64_t i = 0; i < n16; ++i) {
      int32_t s = 0;
      for (int e = 0; e < 16; ++e) s += qm[16 * i + e];
      sp[m * n16 + i] = s;
    }
  });
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  void* yp = y.data_ptr();
  const bool ybf = odt == at::kBFloat16;
  if (amx) {
    g_amx_calls.fetch_add(1, std::memory_order_relaxed);
    quant_k_amx_gemm(int(qtype), q8p, dp, bsp, M, K, wp, N, bp, yp, ybf);
    return y;
  }
  const Act a{qp, q8p, dp, bsp, sp, K};
  const bool tile16 = avx512 && i8 && !g_no_tile16.load();
  qact::run_units(M, N, K, tile16 ? 16 : avx512 ? kQuantMrAvx512 : kQuantMr,
                  [&](int64_t m_lo, int64_t m_hi, int64_t g0, int64_t g1) {
#ifdef TS_X86
    if (avx512) {
      compute_block_avx512(int(qtype), a, m_lo, m_hi - m_lo, wp, g0, g1, bp, yp, ybf, N, tile16);
      return;
    }
#endif
    compute_block(int(qtype), avx2, row256, a, m_lo, m_hi - m_lo, wp, g0, g1, bp, yp, ybf, N);
  }, i8 ? 1 : 2);  // the int8 tiles read one byte per activation: row chunks twice as tall
  return y;
}

}  // namespace tokenserve

TOKENSERVE_REGISTER(quant_k) {
  m.def("quant_k_gemm", &tokenserve::quant_k_gemm, tokenserve::ReleaseGil(), pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("qtype"),
        pybind11::arg("N"), pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_dtype") = pybind11::none(),
        "quant_k_gemm(x: Tensor[M, K] bf16|fp32, w: uint8 [ceil(N/8), K/256, group_bytes] k8-packed GGUF k-quant "
        "super-blocks, qtype: 12 Q4_K | 13 Q5_K | 14 Q6_K, N, bias=None, out_dtype=None) -> Tensor[M, N]: "
        "x @ W^T (+ bias), int8 activations per 256-element super-block, exact integer super-block sums, one fp32 "
        "step per super-block, "
        "row-invariant bits.");
  m.def("quant_k_dequant_rows", &tokenserve::quant_k_dequant_rows, pybind11::arg("ids"), pybind11::arg("w"),
        pybind11::arg("qtype"), pybind11::arg("V"), pybind11::arg("K"), pybind11::arg("out_dtype"),
        "quant_k_dequant_rows(ids: int [T], w: k8-packed k-quant table of V rows, qtype, V, K, out_dtype) -> "
        "Tensor[T, K]: an embedding lookup on a k-quant table, as dequantize_k_ref.");
  m.def("_quant_k_force_portable", [](bool on) { return tokenserve::g_force_portable.exchange(on); },
        "Test hook: True forces the portable (non-AVX2) path of quant_k_gemm; returns the old value.");
  m.def("_quant_k_force_int16", [](bool on) { return tokenserve::g_no_int8.exchange(on); },
        "Test hook: True runs quant_k_gemm on its int16 tiles (vpdpwssd, vpmaddwd) instead of the int8 ones "
        "(vpdpbusd, vpmaddubsw); the same bits. Returns the old value.");
  m.def("_quant_k_force_avx2", [](bool on) { return tokenserve::g_no_avx512.exchange(on); },
        "Test hook: True keeps quant_k_gemm on its AVX2 tiles on an AVX-512 VNNI CPU; returns the old value.");
  m.def("_quant_k_amx_rows", [](int64_t rows) { return tokenserve::g_amx_min_rows.exchange(rows); },
        "Test hook: quant_k_gemm runs on the AMX-INT8 tiles (where available) from this many rows "
        "(default kAmxKMinRows); returns the old value.");
  m.def("_quant_k_amx_calls", [] { return tokenserve::g_amx_calls.load(); },
        "Test hook: how many quant_k_gemm calls ran on the AMX-INT8 tiles so far.");
  m.def("_quant_k_no_tile16", [](bool on) { return tokenserve::g_no_tile16.exchange(on); },
        "Test hook: True runs quant_k_gemm's 16-row blocks of int8 activations on an AVX-512 VNNI CPU on the "
        "8-row tiles instead of the 16-row ones (tile_q45k_512x16, tile_q6k_512x16); the same bits. Returns the "
        "old value.");
  m.def("_quant_k_no_row_tile", [](bool on) { return tokenserve::g_no_row_tile.exchange(on); },
        "Test hook: True runs a one-row quant_k_gemm on an AVX-512 VNNI CPU on the AVX2 tiles instead of the "
        "one-row tiles (tile_q45k_row256, tile_q6k_row256); the same bits. Returns the old value.");
}
