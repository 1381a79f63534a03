// GEMM on GGUF block-quantised weights (Q4_0, Q4_1, Q8_0): y = x @ W^T (+ b).
// Pure-torch oracle: tokenserve.ops.quant (quant_linear_ref, repack_x8, dequantize_ref).
//
// Weights: the GGUF's own blocks (fp16 scale d, Q4_1 also fp16 offset m, 32 quants), with
// their bytes regrouped once at load ("x8" layout, as llama.cpp's CPU repack does for Q4_0):
// 8 output rows interleaved per 32-block, so one vector holds 8 rows' partial sums and one
// load brings 8 rows' scales. Per group g of 8 rows and block b, GB bytes:
//
//     | d[8] fp16 | (Q4_1) m[8] fp16 | quants |                 Q4_0 144, Q4_1 160, Q8_0 272
//     Q4 quants:  chunk p = 0..7, 16 bytes: row r's GGUF qs bytes 2p, 2p+1 at 2r, 2r+1
//                 (a qs byte holds element i in its low nibble and 16 + i in its high one)
//     Q8 quants:  chunk p = 0..15, 16 bytes: row r's int8 quants 2p, 2p+1 at 2r, 2r+1
//
// Rows past N are zero (d = 0). Widened to int16, a chunk is 8 rows x 2 elements, so
// vpmaddwd against a broadcast activation pair gives 8 rows' dot products at once.
//
// Activations are quantised per row and 32-block to int12, stored as int16 (d = amax / 2047,
// q = round_half_even(x / d), s = d * sum(q); csrc/quant_act.h). llama.cpp uses int8; on the
// default Q4_1 model that turns the README's chat answer into French word salad (as
// llama.cpp's own output on the file does); 12 bits keep the bf16 answer (mean KL 0.00069 vs
// int16's 0.00065 nats) and let the AMX-INT8 tiles compute the same block dots exactly.
//
// Per output element y[m, n], in every path (AVX2 and AVX-512 VNNI tiles of any shape, the
// portable code, and from kAmxIntMinRows rows the AMX-INT8 tiles of csrc/quant_amx_int.cpp),
// whatever the batch and thread partition (batch invariance):
//
//     w = dw * qw + mw      (Q4_0: qw = nibble 0..15, mw = -8 dw; Q4_1: mw = m; Q8_0: mw = 0)
//     acc = 0; summ = 0
//     for b in 0..nb-1:  isum = sum_{32} qw * qx                 (exact int32, any order)
//                        acc  = fma(fl(dw_b * dx_b), float(isum), acc)
//                        summ = fma(mw_b, sx_b, summ)           (Q4 formats only)
//     y = round(acc + summ (+ b[n]))
//
// float(isum) is exact (|isum| <= 32 * 15 * 2047 for Q4, 32 * 128 * 2047 for Q8_0, < 2^24);
// a fixed function of the row's own data.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#include "cpu_features.h"
#include "quant_act.h"
#include "quant_amx_int.h"
#include "kernels.h"
#include "registry.h"
#include "simd.h"
#include "tiles.h"

namespace tokenserve {
namespace {

constexpr int64_t QK = 32;  // weights per GGUF block
static_assert(QK == QB, "a weight block is one activation block (csrc/tiles.h)");
using x8::kGroupBytes;  // the layout's sizes: csrc/quant_amx_int.h
using x8::kQuantOffset;
using x8::Q4_0;
using x8::Q4_1;
using x8::Q8_0;

std::atomic<bool> g_force_portable{false};
std::atomic<bool> g_no_avx512{false};  // test hook: the AVX2 tiles on an AVX-512 VNNI CPU
std::atomic<int64_t> g_amx_min_rows{kAmxIntMinRows};  // test hook: rows from which AMX-INT8 runs

using qact::fp16_to_f32;  // csrc/quant_act.h
#ifdef TS_X86
using qact::pair16;
using qact::xpair512;
#endif

// Row r (0..7) of a group-block: scale, offset, and its 32 quants in element order.
inline void unpack_row(int qt, const uint8_t* gb, int r, float& d, float& m, int32_t* q) {
  d = fp16_to_f32(gb + 2 * r);
  m = qt == Q4_0 ? -8.f * d : qt == Q4_1 ? fp16_to_f32(gb + 16 + 2 * r) : 0.f;
  const uint8_t* qs = gb + kQuantOffset[qt];
  if (qt == Q8_0) {
    for (int p = 0; p < 16; ++p)
      for (int j = 0; j < 2; ++j) q[2 * p + j] = int8_t(qs[16 * p + 2 * r + j]);
  } else {
    for (int p = 0; p < 8; ++p)
      for (int j = 0; j < 2; ++j) {
        const uint8_t byte = qs[16 * p + 2 * r + j];
        q[2 * p + j] = byte & 0x0f;
        q[16 + 2 * p + j] = byte >> 4;
      }
  }
}

// Activation quantisation (x [M, K] bf16 or fp32 -> q int16 [M, K], ds fp32 [M, K / 32, 2]
// = (d, s), per-thread buffers): qact::quantize_act, csrc/quant_act.h.

// Portable: one output element (row n = lane r of a group), the header's arithmetic.
float dot_scalar(int qt, const int16_t* xq, const float* xds, int64_t K, const uint8_t* wg, int r) {
  const int64_t nb = K / QK, GB = kGroupBytes[qt];
  float acc = 0.f, summ = 0.f;
  int32_t q[QK];
  for (int64_t b = 0; b < nb; ++b) {
    float dw, mw;
    unpack_row(qt, wg + b * GB, r, dw, mw, q);
    const int16_t* xb = xq + b * QK;
    int32_t isum = 0;
    for (int i = 0; i < QK; ++i) isum += q[i] * int32_t(xb[i]);
    acc = std::fma(dw * xds[2 * b], float(isum), acc);
    if (qt != Q8_0) summ = std::fma(mw, xds[2 * b + 1], summ);
  }
  return acc + summ;
}

#ifdef TS_X86
// MR activation rows x one group of 8 weight rows over all nb blocks:
// out[r * ldo + j] for rows r < MR, weight rows j < 8 (fp32, no bias).
template <int QT, int MR>
TS_TARGET_AVX2_F16C void tile_avx2(const int16_t* __restrict xq, const float* __restrict xds, int64_t K,
                                   const uint8_t* __restrict wg, float* __restrict out, int64_t ldo) {
  const int64_t nb = K / QK;
  constexpr int64_t GB = kGroupBytes[QT], QO = kQuantOffset[QT];
  __m256 acc[MR], summ[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps(), summ[r] = _mm256_setzero_ps();
  const __m256i lo4 = _mm256_set1_epi16(0x0f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* gb = wg + b * GB;
    _mm_prefetch(reinterpret_cast<const char*>(gb + 4 * GB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(gb + 4 * GB + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(gb + 4 * GB + 128), _MM_HINT_T0);
    if constexpr (QT == Q8_0) _mm_prefetch(reinterpret_cast<const char*>(gb + 4 * GB + 192), _MM_HINT_T0);
    __m256i isum[MR];
    for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
    if constexpr (QT == Q8_0) {
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) {
        const __m256i w = _mm256_cvtepi8_epi16(load16(gb + QO + 16 * p));
        for (int r = 0; r < MR; ++r)
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(w, xpair(xq + r * K + b * QK, 2 * p)));
      }
    } else {
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const __m256i t = _mm256_cvtepu8_epi16(load16(gb + QO + 16 * p));
        const __m256i wl = _mm256_and_si256(t, lo4), wh = _mm256_srli_epi16(t, 4);
        for (int r = 0; r < MR; ++r) {
          const int16_t* xb = xq + r * K + b * QK;
          isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(wl, xpair(xb, 2 * p)),
                                                               _mm256_madd_epi16(wh, xpair(xb, 16 + 2 * p))));
        }
      }
    }
    const __m256 dw = load8_fp16(gb);
    __m256 mw = _mm256_setzero_ps();
    if constexpr (QT == Q4_1) mw = load8_fp16(gb + 16);
    if constexpr (QT == Q4_0) mw = _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));
    for (int r = 0; r < MR; ++r) {
      const float* xp = xds + (r * nb + b) * 2;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(xp)), _mm256_cvtepi32_ps(isum[r]), acc[r]);
      if constexpr (QT != Q8_0) summ[r] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(xp + 1), summ[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + r * ldo, _mm256_add_ps(acc[r], summ[r]));
}

using TileFn = void (*)(const int16_t*, const float*, int64_t, const uint8_t*, float*, int64_t);

// Blocks ahead of the one being computed that the AVX-512 tile prefetches in each of its two
// group streams (64 x 160 bytes, ~10 KB, for Q4_1): a batch-1 step streams ~66 MB of layer
// weights, and 4 blocks ahead (the AVX2 tile's distance) left it at ~13-18 GB/s where 64
// reached ~18-23 GB/s (Zen 4, 2 threads, 30 layers of the default model's shapes, each
// measured in one process alternating the two; 32 and 128 were between).
constexpr int64_t kPrefetchAhead = 64;

// The same tile on AVX-512 VNNI: MR activation rows x TWO groups (16 weight rows, the groups
// at wg and wg + gstride) per call, out[r * ldo + j] for j < 16. A chunk's 16 bytes of each
// group widen to one zmm (lanes 0-7 group g, 8-15 group g + 1); vpdpwssd adds the pair dots
// into the int32 block sums, which are exact whatever the order or the number of partial
// sums (CH chains, to hide the instruction's latency when few rows share a weight vector).
// The float steps are the AVX2 tile's, lane for lane, so both give the same bits.
template <int QT, int MR>
TS_TARGET_AVX512VNNI void tile_avx512(const int16_t* __restrict xq, const float* __restrict xds, int64_t K,
                                      const uint8_t* __restrict wg, int64_t gstride,
                                      float* __restrict out, int64_t ldo) {
  constexpr int CH = MR <= 2 ? 4 : MR <= 4 ? 2 : 1;  // independent int32 sums per row
  const int64_t nb = K / QK;
  constexpr int64_t GB = kGroupBytes[QT], QO = kQuantOffset[QT];
  __m512 acc[MR], summ[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps(), summ[r] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi16(0x0f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* ga = wg + b * GB;
    const uint8_t* gc = ga + gstride;
    for (int64_t o = 0; o < GB; o += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(ga + kPrefetchAhead * GB + o), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(gc + kPrefetchAhead * GB + o), _MM_HINT_T0);
    }
    __m512i isum[MR][CH];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < CH; ++c) isum[r][c] = _mm512_setzero_si512();
    if constexpr (QT == Q8_0) {
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) {
        const __m512i w = _mm512_cvtepi8_epi16(pair16(ga + QO + 16 * p, gc + QO + 16 * p));
        for (int r = 0; r < MR; ++r)
          isum[r][p % CH] = _mm512_dpwssd_epi32(isum[r][p % CH], w, xpair512(xq + r * K + b * QK, 2 * p));
      }
    } else {
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        const __m512i t = _mm512_cvtepu8_epi16(pair16(ga + QO + 16 * p, gc + QO + 16 * p));
        const __m512i wl = _mm512_and_si512(t, lo4), wh = _mm512_srli_epi16(t, 4);
        for (int r = 0; r < MR; ++r) {
          const int16_t* xb = xq + r * K + b * QK;
          // chains: (2p) % CH takes the low nibbles, (2p + 1) % CH the high ones
          const int c_lo = (2 * p) % CH, c_hi = (2 * p + 1) % CH;
          isum[r][c_lo] = _mm512_dpwssd_epi32(isum[r][c_lo], wl, xpair512(xb, 2 * p));
          isum[r][c_hi] = _mm512_dpwssd_epi32(isum[r][c_hi], wh, xpair512(xb, 16 + 2 * p));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(pair16(ga, gc));
    __m512 mw = _mm512_setzero_ps();
    if constexpr (QT == Q4_1) mw = _mm512_cvtph_ps(pair16(ga + 16, gc + 16));
    if constexpr (QT == Q4_0) mw = _mm512_mul_ps(dw, _mm512_set1_ps(-8.f));
    for (int r = 0; r < MR; ++r) {
      __m512i is = isum[r][0];
      for (int c = 1; c < CH; ++c) is = _mm512_add_epi32(is, isum[r][c]);
      const float* xp = xds + (r * nb + b) * 2;
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xp[0])), _mm512_cvtepi32_ps(is), acc[r]);
      if constexpr (QT != Q8_0) summ[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xp[1]), summ[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_add_ps(acc[r], summ[r]));
}

using Tile2Fn = void (*)(const int16_t*, const float*, int64_t, const uint8_t*, int64_t, float*, int64_t);

// Every row count of each tile kind, indexed [qtype][rows - 1]: the AVX2 tiles (1..6 rows,
// one group) and the AVX-512 VNNI tiles (1..8 rows, two groups).
template <int QT, size_t... I>
constexpr std::array<TileFn, sizeof...(I)> avx2_tiles(std::index_sequence<I...>) {
  return {&tile_avx2<QT, int(I) + 1>...};
}
template <int QT, size_t... I>
constexpr std::array<Tile2Fn, sizeof...(I)> avx512_tiles(std::index_sequence<I...>) {
  return {&tile_avx512<QT, int(I) + 1>...};
}
constexpr auto kAvx2Rows = std::make_index_sequence<size_t(kQuantMrCap)>{};
constexpr auto kAvx512Rows = std::make_index_sequence<size_t(kQuantMrAvx512)>{};
constexpr std::array<std::array<TileFn, kQuantMrCap>, 3> kAvx2Tiles = {
    avx2_tiles<Q4_0>(kAvx2Rows), avx2_tiles<Q4_1>(kAvx2Rows), avx2_tiles<Q8_0>(kAvx2Rows)};
constexpr std::array<std::array<Tile2Fn, kQuantMrAvx512>, 3> kAvx512Tiles = {
    avx512_tiles<Q4_0>(kAvx512Rows), avx512_tiles<Q4_1>(kAvx512Rows),
    avx512_tiles<Q8_0>(kAvx512Rows)};

// The AVX2 tile of qtype qt for mr rows (1..kQuantMrCap).
inline TileFn pick_tile(int qt, int mr) { return kAvx2Tiles[qt][std::clamp<int>(mr, 1, kQuantMrCap) - 1]; }
// The AVX-512 VNNI tile of qtype qt for mr rows (1..kQuantMrAvx512).
inline Tile2Fn pick_tile2(int qt, int mr) {
  return kAvx512Tiles[qt][std::clamp<int>(mr, 1, kQuantMrAvx512) - 1];
}
#endif  // TS_X86

#ifdef TS_X86
// Rows [m0, m0 + rows) x weight-row groups [g0, g1) into y (+ bias) on AVX-512 VNNI: two
// groups per tile (an odd last group: the AVX2 tile, whose lanes give the same bits), rows
// in balanced blocks of at most kQuantMrAvx512.
void compute_block_avx512(int qt, const int16_t* xq, const float* xds, int64_t K, int64_t m0, int64_t rows,
                          const uint8_t* w, int64_t g0, int64_t g1, const float* bias, void* y, bool y_bf16,
                          int64_t N) {
  const int64_t nb = K / QK, gstride = nb * kGroupBytes[qt];
  qact::compute_group_pairs(
      m0, rows, w, gstride, g0, g1, bias, y, y_bf16, N,
      [&](int64_t m, int mr, const uint8_t* wg, float* out) {
        pick_tile2(qt, mr)(xq + m * K, xds + m * nb * 2, K, wg, gstride, out, 2 * RG);
      },
      [&](int64_t m, int mr, const uint8_t* wg, float* out) {
        for (int r0 = 0; r0 < mr; r0 += int(kQuantMrCap)) {  // AVX2 tiles of <= 6 rows
          const int r1 = std::min(mr, r0 + int(kQuantMrCap));
          pick_tile(qt, r1 - r0)(xq + (m + r0) * K, xds + (m + r0) * nb * 2, K, wg, out + r0 * 2 * RG, 2 * RG);
        }
      });
}
#endif  // TS_X86

// Rows [m0, m0 + rows) x weight-row groups [g0, g1) into y (+ bias).
void compute_block(int qt, bool avx2, const int16_t* xq, const float* xds, int64_t K, int64_t m0,
                   int64_t rows, const uint8_t* w, int64_t g0, int64_t g1, const float* bias, void* y,
                   bool y_bf16, int64_t N) {
  const int64_t nb = K / QK, gstride = nb * kGroupBytes[qt];
  qact::compute_groups(m0, rows, kQuantMr, w, gstride, g0, g1, bias, y, y_bf16, N,
                       [&](int64_t m, int mr, int64_t ncols, const uint8_t* wg, float* tile) {
#ifdef TS_X86
    if (avx2) {
      pick_tile(qt, mr)(xq + m * K, xds + m * nb * 2, K, wg, tile, RG);
      return;
    }
#endif
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < ncols; ++j)
        tile[r * RG + j] = dot_scalar(qt, xq + (m + r) * K, xds + (m + r) * nb * 2, K, wg, j);
  });
}

void check_packed(const char* fn, const torch::Tensor& w, int64_t qtype, int64_t N, int64_t K) {
  TORCH_CHECK(qtype >= 0 && qtype <= 2, fn, ": qtype must be 0 (Q4_0), 1 (Q4_1) or 2 (Q8_0)");
  TORCH_CHECK(K % QK == 0, fn, ": K=", K, " is not a multiple of 32");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 &&
                  w.size(0) == (N + RG - 1) / RG && w.size(1) == K / QK && w.size(2) == kGroupBytes[qtype],
              fn, ": w must be contiguous uint8 [", (N + RG - 1) / RG, ", ", K / QK, ", ", kGroupBytes[qtype],
              "] (tokenserve.ops.quant.repack_x8), got ", w.sizes());
}

}  // namespace

// y = x @ W^T (+ bias) on x8-packed GGUF blocks.
//   x:     [M, K] bf16 or fp32 (K a multiple of 32)
//   w:     uint8 [ceil(N / 8), K / 32, group_bytes] (repack_x8 of the GGUF rows)
//   qtype: 0 Q4_0, 1 Q4_1, 2 Q8_0
//   bias:  [N] or None (used as fp32);  out_dtype: bf16 | fp32 (None: x's dtype)
// Returns [M, N].
torch::Tensor quant_gemm(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                         const std::optional<torch::Tensor>& bias,
                         std::optional<at::ScalarType> out_dtype) {
  check_gemm_x("quant_gemm", x);
  const int64_t M = x.size(0), K = x.size(1);
  check_packed("quant_gemm", w, qtype, N, K);
  const GemmIo io = gemm_io("quant_gemm", x, N, bias, out_dtype);
  const at::ScalarType odt = io.dtype;
  const torch::Tensor& b = io.bias;
  auto y = torch::empty({M, N}, x.options().dtype(odt));
  if (M == 0 || N == 0) return y;
  const bool avx2 = avx2_enabled(g_force_portable);
  // AVX-512 VNNI tiles (the same bits as the AVX2 ones), except a one-row Q8_0 GEMM (the
  // lm_head at batch 1): it streams ~30 MB at DRAM speed either way, and the AVX2 tile's one
  // group stream measured 8 % faster than the two-group zmm tile's two (Zen 4, 2 threads).
  const bool avx512 = avx2 && cpu_features().avx512vnni && !g_no_avx512.load() &&
                      !(qtype == Q8_0 && M == 1);
  qact::ActBuffers& act = qact::act_buffers(M, K, false);
  qact::quantize_act(x.contiguous(), avx2, act, qact::kActQMax, [](int64_t) {});
  const int16_t* qp = act.q.data();
  const float* dp = act.ds.data();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  void* yp = y.data_ptr();
  const bool ybf = odt == at::kBFloat16;
  if (avx512 && M >= g_amx_min_rows.load() && quant_amx_int_available()) {
    quant_amx_int_gemm(int(qtype), qp, dp, M, K, wp, N, bp, yp, ybf);  // the same bits
    return y;
  }
  qact::run_units(M, N, K, avx512 ? kQuantMrAvx512 : kQuantMr,
                  [&](int64_t m_lo, int64_t m_hi, int64_t g0, int64_t g1) {
#ifdef TS_X86
    if (avx512) {
      compute_block_avx512(int(qtype), qp, dp, K, m_lo, m_hi - m_lo, wp, g0, g1, bp, yp, ybf, N);
      return;
    }
#endif
    compute_block(int(qtype), avx2, qp, dp, K, m_lo, m_hi - m_lo, wp, g0, g1, bp, yp, ybf, N);
  });
  return y;
}

// Embedding lookup on an x8-packed quantised table w (V rows): rows ids [T], dequantised as
// tokenserve.ops.quant.dequantize_ref does (fp32 d * (q - 8), d * q + m, d * q), [T, K].
torch::Tensor quant_dequant_rows(const torch::Tensor& ids, const torch::Tensor& w, int64_t qtype,
                                 int64_t V, int64_t K, at::ScalarType out_dtype) {
  check_packed("quant_dequant_rows", w, qtype, V, K);
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat, "quant_dequant_rows: bf16 or fp32 out");
  auto idx = ids.to(at::kLong).contiguous();
  const int64_t T = idx.numel(), nb = K / QK, GB = kGroupBytes[qtype];
  auto y = torch::empty({T, K}, w.options().dtype(out_dtype));
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < V, "quant_dequant_rows: id ", ip[t], " out of range [0, ", V, ")");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const bool bf = out_dtype == at::kBFloat16;
  void* yp = y.data_ptr();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    int32_t q[QK];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = ip[t] / RG, r = ip[t] % RG;
      for (int64_t b = 0; b < nb; ++b) {
        float d, m;
        unpack_row(int(qtype), wp + (g * nb + b) * GB, int(r), d, m, q);
        for (int i = 0; i < QK; ++i) {
          // Q4_0: (q - 8) * d; Q4_1: q * d + m (two roundings); Q8_0: q * d
          const float v = qtype == Q4_0 ? float(q[i] - 8) * d : qtype == Q4_1 ? float(q[i]) * d + m
                                                                                 : float(q[i]) * d;
          store1(yp, t * K + b * QK + i, v, bf);
        }
      }
    }
  });
  return y;
}

}  // namespace tokenserve

TOKENSERVE_REGISTER(quant) {
  m.def("quant_gemm", &tokenserve::quant_gemm, tokenserve::ReleaseGil(), pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("qtype"),
        pybind11::arg("N"), pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_dtype") = pybind11::none(),
        "quant_gemm(x: Tensor[M, K] bf16|fp32, w: uint8 [ceil(N/8), K/32, group_bytes] x8-packed GGUF blocks, "
        "qtype: 0 Q4_0 | 1 Q4_1 | 2 Q8_0, N, bias=None, out_dtype=None) -> Tensor[M, N]: x @ W^T (+ bias), "
        "int16 activations per 32-block, exact integer block dots, fp32 accumulation, row-invariant bits.");
  m.def("quant_dequant_rows", &tokenserve::quant_dequant_rows, pybind11::arg("ids"), pybind11::arg("w"),
        pybind11::arg("qtype"), pybind11::arg("V"), pybind11::arg("K"), pybind11::arg("out_dtype"),
        "quant_dequant_rows(ids: int [T], w: x8-packed table of V rows, qtype, V, K, out_dtype) -> "
        "Tensor[T, K]: an embedding lookup on a quantised table.");
  m.def("_quant_force_portable", [](bool on) { return tokenserve::g_force_portable.exchange(on); },
        "Test hook: True forces the portable (non-AVX2) path of quant_gemm; returns the old value.");
  m.def("_quant_amx_rows", [](int64_t rows) { return tokenserve::g_amx_min_rows.exchange(rows); },
        "Test hook: quant_gemm runs on the AMX-INT8 tiles (where available) from this many rows "
        "(default kAmxIntMinRows); returns the old value.");
  m.def("quant_amx_int_available", [] { return tokenserve::quant_amx_int_available(); },
        "True when this CPU has AMX-INT8 (with AVX-512 VBMI and VNNI) and the OS granted the tile state.");
  m.def("_quant_force_avx2", [](bool on) { return tokenserve::g_no_avx512.exchange(on); },
        "Test hook: True keeps quant_gemm on its AVX2 tiles on an AVX-512 VNNI CPU; returns the old value.");
}
