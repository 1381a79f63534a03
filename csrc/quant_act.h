// Shared helpers of the block-quantised GEMMs: fp16 decoding and the activation quantisers
// (per row, stored as int16): int12 per 32-element block for csrc/quant.cpp (below), int8
// per 256-element super-block for csrc/quant_k.cpp (quantize_row_k_*, llama.cpp's Q8_K).
// Pure-torch oracles: tokenserve.ops.quant.quantize_act_ref, quantize_act_k_ref.
//
// Per 32-block of a row: d = amax / qmax (fp32; qmax 2047 or 127), q = round_half_even(x *
// (1 / d)) (0 where d = 0; |q| <= qmax), s = d * float(sum q). The scalar and AVX2 versions
// give the same bits.
// 12 bits, not 16: q = 16 h + l with h a signed byte and l = 0..15, so an AMX-INT8 tile
// product gives the exact block dot (csrc/quant_amx_int.cpp); mean KL against the fp32
// reference 0.00069 nats vs 0.00065 with int16 (bench/README.md, issue 24).
//
// Used by csrc/quant.cpp (Q4_0/Q4_1/Q8_0) and csrc/quant_k.cpp (k-quants), which also
// share run_units below: how a GEMM's output is cut into work units and handed to threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "tiles.h"

namespace tokenserve {
namespace qact {

constexpr int kActQMax = 2047;  // |q| of the int12 activations (Q4_0 / Q4_1 / Q8_0)
constexpr int kActQMax8 = 127;  // |q| of the int8 activations (the k-quants, csrc/quant_k.cpp)

// QB (the activation block), RG (weight rows per group) and the tile sizes: csrc/tiles.h

// IEEE half (little-endian bytes at p) -> float; normals, subnormals, inf/nan; no F16C.
inline float fp16_to_f32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One 32-block of a row: xb (32 values as fp32) -> q int16 [32], q = round_half_even(xb *
// inv); returns sum q (both quantisers below, per 32-block and per super-block).
inline int quantize32_scalar(const float* xb, float inv, int16_t* q) {
  int sum = 0;
  for (int i = 0; i < QB; ++i) {
    const int v = int(std::nearbyint(xb[i] * inv));  // round half to even (default mode)
    q[i] = int16_t(v);
    sum += v;
  }
  return sum;
}

// x [K] fp32 or bf16 (T = float | at::BFloat16) -> q int16 [K], ds fp32 [K / 32][2] =
// (d, s).  K a multiple of 32. A bf16 x is widened exactly, so both give the same bits.
// qmax: kActQMax (int12) or kActQMax8 (int8), d = amax / qmax.
template <class T>
inline void quantize_row_scalar(const T* x, int64_t K, int16_t* q, float* ds, int qmax) {
  for (int64_t b = 0; b < K / QB; ++b) {
    float xb[QB];
    for (int i = 0; i < QB; ++i) xb[i] = load1(x + b * QB + i);
    float amax = 0.f;
    for (int i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float db = amax / float(qmax), inv = db > 0.f ? 1.f / db : 0.f;
    const int sum = quantize32_scalar(xb, inv, q + b * QB);
    ds[2 * b] = db;
    ds[2 * b + 1] = db * float(sum);
  }
}

#ifdef TS_X86
// quantize32_scalar on AVX2: v the 32-block's 4 x 8 values, vinv the broadcast inverse scale.
TS_TARGET_AVX2 inline int32_t quantize32_avx2(const __m256 (&v)[4], __m256 vinv, int16_t* q) {
  __m256i iv[4];
  for (int i = 0; i < 4; ++i)
    iv[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], vinv),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
  // 32 x i32 -> 32 x i16 in element order (packs works per 128-bit lane: fix with a permute)
  const __m256i p01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[0], iv[1]), 0xd8);
  const __m256i p23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[2], iv[3]), 0xd8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p01);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), p23);
  return hsum8_epi32(sum4);
}

template <class T>
TS_TARGET_AVX2_F16C inline void quantize_row_avx2(const T* x, int64_t K, int16_t* q, float* ds, int qmax) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < K / QB; ++b) {
    const T* xb = x + b * QB;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load8(xb + 8 * i);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                              _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    const float amax = hmax8(mx);
    const float db = amax / float(qmax), inv = db > 0.f ? 1.f / db : 0.f;
    const int32_t sum = quantize32_avx2(v, _mm256_set1_ps(inv), q + b * QB);
    ds[2 * b] = db;
    ds[2 * b + 1] = db * float(sum);
  }
}
#endif

// Quantises the M rows of x [M, K] (fp32 or bf16, T = float | at::BFloat16) to q int16
// [M, K] and ds fp32 [M, K / 32, 2], then calls after_row(m) for each row (e.g. extra
// per-row sums). The rows shared over the threads from 16K elements (csrc/parallel.h: a
// range per thread, the idle one taking the other's rows), serial below (a batch-1 GEMV: a
// parallel region's barrier costs more than its ~1 us of quantising). Measured (Sapphire
// Rapids, 2 threads, a 64-row GEMM with N = 16, so mostly this): 22 -> 18.5 us at K = 576,
// 56 -> 44.5 us at K = 1536 against serial up to 4M elements; ~0.7 ms of a 64-row step.
// avx2: the caller checked the CPU. qmax: kActQMax or kActQMax8.
template <class T, class AfterRow>
void quantize_rows(const T* x, int64_t M, int64_t K, bool avx2, int16_t* q, float* ds, int qmax,
                   AfterRow&& after_row) {
  const int64_t nb = K / QB;
  parallel_units(M, M * K >= (int64_t{1} << 14) ? at::get_num_threads() : 1, [&](int64_t m) {
#ifdef TS_X86
    if (avx2) quantize_row_avx2(x + m * K, K, q + m * K, ds + m * nb * 2, qmax);
    else
#endif
      quantize_row_scalar(x + m * K, K, q + m * K, ds + m * nb * 2, qmax);
    after_row(m);
  });
}

// The k-quants' activations (csrc/quant_k.cpp; llama.cpp's Q8_K): x [K] (K a multiple of
// 256) -> q int16 [K] (values -127..127), d fp32 [K / 256] (amax / 127 per super-block) and
// bs int16 [K / 32] (exact sums of each 32 quants). q = round_half_even(x * (1 / d)), 0
// where d = 0. Pure-torch oracle: tokenserve.ops.quant.quantize_act_k_ref. The scalar and
// AVX2 versions give the same bits.
constexpr int64_t QKA = 256;  // activation elements per k-quant scale

template <class T>
inline void quantize_row_k_scalar(const T* x, int64_t K, int16_t* q, float* d, int16_t* bs) {
  for (int64_t B = 0; B < K / QKA; ++B) {
    const T* xb = x + B * QKA;
    float amax = 0.f;
    for (int i = 0; i < QKA; ++i) amax = std::max(amax, std::fabs(load1(xb + i)));
    const float db = amax / float(kActQMax8), inv = db > 0.f ? 1.f / db : 0.f;
    for (int b = 0; b < QKA / QB; ++b) {
      float xf[QB];
      for (int i = 0; i < QB; ++i) xf[i] = load1(xb + b * QB + i);
      bs[B * (QKA / QB) + b] = int16_t(quantize32_scalar(xf, inv, q + B * QKA + b * QB));
    }
    d[B] = db;
  }
}

#ifdef TS_X86
template <class T>
TS_TARGET_AVX2_F16C inline void quantize_row_k_avx2(const T* x, int64_t K, int16_t* q, float* d, int16_t* bs) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t B = 0; B < K / QKA; ++B) {
    const T* xb = x + B * QKA;
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < QKA; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(load8(xb + i), abs_mask));
    const float amax = hmax8(mx);
    const float db = amax / float(kActQMax8), inv = db > 0.f ? 1.f / db : 0.f;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int b = 0; b < QKA / QB; ++b) {
      const __m256 v[4] = {load8(xb + b * QB), load8(xb + b * QB + 8), load8(xb + b * QB + 16),
                           load8(xb + b * QB + 24)};
      bs[B * (QKA / QB) + b] = int16_t(quantize32_avx2(v, vinv, q + B * QKA + b * QB));
    }
    d[B] = db;
  }
}
#endif

// A GEMM's quantised activations, per calling thread, grown as needed and reused: a
// batch-1 step makes ~120 projections, and three tensor allocations (plus a bf16 -> fp32
// copy) each cost a few microseconds of a ~15 us GEMV.
struct ActBuffers {
  std::vector<int16_t> q;     // [M, K]
  std::vector<float> ds;      // [M, K / 32, 2]
  std::vector<int32_t> sums;  // [M, K / 16] (Q6_K)
  std::vector<int8_t> q8;     // [M, K]: q as int8 in the k-quant int8 tiles' lane order (csrc/quant_k.cpp)
  std::vector<int16_t> bs;    // [M, K / 32]: the k-quant activations' 32-element sums
};

inline ActBuffers& act_buffers(int64_t M, int64_t K, bool sums, bool q8 = false) {
  thread_local ActBuffers b;
  const size_t n = size_t(std::max<int64_t>(M * K, 1));
  if (b.q.size() < n) b.q.resize(n);
  if (b.ds.size() < n / QB * 2 + 2) b.ds.resize(n / QB * 2 + 2);
  if (sums && b.sums.size() < n / 16 + 1) b.sums.resize(n / 16 + 1);
  if (q8 && b.q8.size() < n) b.q8.resize(n);
  if (b.bs.size() < n / QB + 1) b.bs.resize(n / QB + 1);
  return b;
}

// Quantises x [M, K] (bf16 or fp32, contiguous) into b (act_buffers(M, K, ...) of the
// calling thread: after_row runs on worker threads, so it must use b, not act_buffers).
template <class AfterRow>
void quantize_act(const at::Tensor& x, bool avx2, ActBuffers& b, int qmax, AfterRow&& after_row) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kBFloat16)
    quantize_rows(x.data_ptr<at::BFloat16>(), M, K, avx2, b.q.data(), b.ds.data(), qmax, after_row);
  else
    quantize_rows(x.data_ptr<float>(), M, K, avx2, b.q.data(), b.ds.data(), qmax, after_row);
}

// quantize_act for the k-quants (quantize_row_k_*: b.q, d in b.ds [M, K / 256], b.bs).
template <class AfterRow>
void quantize_act_k(const at::Tensor& x, bool avx2, ActBuffers& b, AfterRow&& after_row) {
  const int64_t M = x.size(0), K = x.size(1);
  auto rows = [&](const auto* xp) {
    parallel_units(M, M * K >= (int64_t{1} << 14) ? at::get_num_threads() : 1, [&](int64_t m) {
#ifdef TS_X86
      if (avx2) quantize_row_k_avx2(xp + m * K, K, b.q.data() + m * K, b.ds.data() + m * (K / QKA),
                                    b.bs.data() + m * (K / QB));
      else
#endif
        quantize_row_k_scalar(xp + m * K, K, b.q.data() + m * K, b.ds.data() + m * (K / QKA),
                              b.bs.data() + m * (K / QB));
      after_row(m);
    });
  };
  if (x.scalar_type() == at::kBFloat16) rows(x.data_ptr<at::BFloat16>());
  else rows(x.data_ptr<float>());
}

// Runs fn(m_lo, m_hi, g0, g1) (activation rows [m_lo, m_hi), groups [g0, g1) of 8
// weight rows) over every work unit of an [M, N] output: row chunks sized so a chunk's
// activations stay in L2 (~128 KiB; a multiple of mr_max rows) x pairs of groups,
// unit u = (chunk u / groups, group pair u % groups). Each task owns a contiguous range of
// units and walks it in order, so at small M (where the GEMM streams its weights from
// memory) each thread reads one long sequential run of weight bytes that the prefetchers
// follow; a task that finishes its range takes units from the others' ranges
// (csrc/parallel.h), so a descheduled thread does not hold the others back. Small GEMMs
// stay on one thread (a unit of work below ~64K multiply-adds is not worth a barrier).
// Which thread computes a unit never changes its arithmetic, so the partition leaves
// results bit-identical.
//
// Measured (Zen 5, 2 threads, the 30 layers + lm_head of a batch-1 step on their own
// weights, bench/kernels_quant.py at M = 1, the two builds alternated four times):
// 3.27-3.76 ms with these ranges vs 3.78-4.64 ms with the previous interleaved batches of
// units / 16 (bench/README.md "One default weight path on AMD Zen 5").
// act_bytes: bytes per activation element the tiles read (2: int16, 1: int8; the k-quant
// GEMM's int8 tiles at 16 rows, Llama-3.2-1B's down [2048, 8192] in one row chunk instead
// of two: 1.35 -> 1.18 ms, bench/README.md "K-quants on int8 activations").
template <class Fn>
void run_units(int64_t M, int64_t N, int64_t K, int64_t mr_max, Fn&& fn, int64_t act_bytes = 2) {
  constexpr int64_t GPU = kQuantGroupsPerUnit;
  const int64_t mc = std::max<int64_t>(mr_max, (131072 / std::max<int64_t>(K * act_bytes, 1)) / mr_max * mr_max);
  const int64_t nchunks = (M + mc - 1) / mc;
  const int64_t NG = (N + RG - 1) / RG;
  const int64_t ngroups = (NG + GPU - 1) / GPU;
  const int64_t units = nchunks * ngroups;
  const int64_t work = std::max<int64_t>(1, std::min(M, mc) * GPU * RG * K);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / work);
  const int64_t ntasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (units + grain - 1) / grain));
  auto unit = [&](int64_t u) {
    const int64_t chunk = u / ngroups, gi = u % ngroups;
    fn(chunk * M / nchunks, (chunk + 1) * M / nchunks, gi * GPU, std::min(NG, (gi + 1) * GPU));
  };
  parallel_units(units, ntasks, unit);
}

// The body of a work unit, shared by csrc/quant.cpp and csrc/quant_k.cpp: activation rows
// [m0, m0 + rows) x weight-row groups [g0, g1) (8 rows each, gstride bytes apart). Rows are
// cut into balanced blocks of at most mr_max (7 rows: 4 + 3; any split gives the same bits);
// tile(m, mr, ncols, wg, out) writes out[r * 8 + j] for r < mr, j < ncols (fp32, no bias),
// which is then stored to y [M, N] (+ bias) in y's dtype.
template <class Tile>
void compute_groups(int64_t m0, int64_t rows, int64_t mr_max, const uint8_t* w, int64_t gstride,
                    int64_t g0, int64_t g1, const float* bias, void* y, bool y_bf16, int64_t N,
                    Tile&& tile) {
  assert(mr_max >= 1 && mr_max <= kQuantMrCap);
  float out[kQuantMrCap * RG];
  const int64_t nblk = (rows + mr_max - 1) / mr_max;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = w + g * gstride;
    const int64_t ncols = std::min<int64_t>(RG, N - g * RG);
    for (int64_t blk = 0, m = m0; blk < nblk; ++blk) {
      const int mr = int(rows / nblk + (blk < rows % nblk ? 1 : 0));
      tile(m, mr, ncols, wg, out);
      for (int r = 0; r < mr; ++r)
        for (int64_t j = 0; j < ncols; ++j) {
          const int64_t n = g * RG + j;
          float v = out[r * RG + j];
          if (bias) v += bias[n];
          store1(y, (m + r) * N + n, v, y_bf16);
        }
      m += mr;
    }
  }
}

#ifdef TS_X86
// The body of a work unit on the AVX-512 VNNI tiles (csrc/quant.cpp, csrc/quant_k.cpp):
// activation rows [m0, m0 + rows) x weight-row groups [g0, g1), two groups per tile, rows in
// balanced blocks of at most kQuantMrAvx512 (any split gives the same bits). pair(m, mr, wg,
// out) writes out[r * 16 + j] for the groups at wg and wg + gstride; a lone last group goes
// to one(m, mr, wg, out) (the AVX2 tiles, whose lanes give the same bits), same layout. Then
// stored to y [M, N] (+ bias) in y's dtype.
template <class Pair, class One>
void compute_group_pairs(int64_t m0, int64_t rows, const uint8_t* w, int64_t gstride, int64_t g0, int64_t g1,
                         const float* bias, void* y, bool y_bf16, int64_t N, Pair&& pair, One&& one);
#endif  // TS_X86

#ifdef TS_X86
// 16 bytes at a and 16 at b as one 32-byte vector (two weight-row groups' chunks side by
// side: the AVX-512 VNNI tiles of csrc/quant.cpp and csrc/quant_k.cpp).
TS_TARGET_AVX512VNNI inline __m256i pair16(const uint8_t* a, const uint8_t* b) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(load16(a)), load16(b), 1);
}

// An activation pair (x[e], x[e + 1]) in all 16 int32 lanes of a zmm.
TS_TARGET_AVX512VNNI inline __m512i xpair512(const int16_t* x, int e) {
  int32_t v;
  std::memcpy(&v, x + e, 4);
  return _mm512_set1_epi32(v);
}

// out [mr, 16] (+ bias) -> y rows m.., columns n0..n0+ncols-1, in y's dtype: a 16-column
// tile (two groups) in two 8-lane stores (the same bits as store1 per element), a tail
// element-wise.
TS_TARGET_AVX2 inline void store_tile16(const float* out, int mr, int64_t ncols, const float* bias, void* y,
                                        bool y_bf16, int64_t N, int64_t m, int64_t n0) {
  if (ncols < 16) {
    for (int r = 0; r < mr; ++r)
      for (int64_t j = 0; j < ncols; ++j)
        store1(y, (m + r) * N + n0 + j, bias ? out[r * 16 + j] + bias[n0 + j] : out[r * 16 + j], y_bf16);
    return;
  }
  for (int r = 0; r < mr; ++r)
    for (int h = 0; h < 2; ++h) {
      __m256 v = _mm256_loadu_ps(out + r * 16 + 8 * h);
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0 + 8 * h));
      const int64_t i = (m + r) * N + n0 + 8 * h;
      if (y_bf16) store8(static_cast<uint16_t*>(y) + i, v);
      else store8(static_cast<float*>(y) + i, v);
    }
}

template <class Pair, class One>
void compute_group_pairs(int64_t m0, int64_t rows, const uint8_t* w, int64_t gstride, int64_t g0, int64_t g1,
                         const float* bias, void* y, bool y_bf16, int64_t N, Pair&& pair, One&& one) {
  alignas(64) float out[kQuantMrAvx512 * 2 * RG];
  const int64_t nblk = (rows + kQuantMrAvx512 - 1) / kQuantMrAvx512;
  for (int64_t g = g0; g < g1;) {
    const int64_t ng = std::min<int64_t>(2, g1 - g);
    const int64_t ncols = std::min<int64_t>(ng * RG, N - g * RG);
    const uint8_t* wg = w + g * gstride;
    for (int64_t blk = 0, m = m0; blk < nblk; ++blk) {
      const int mr = int(rows / nblk + (blk < rows % nblk ? 1 : 0));
      if (ng == 2) pair(m, mr, wg, out);
      else one(m, mr, wg, out);
      store_tile16(out, mr, ncols, bias, y, y_bf16, N, m, g * RG);
      m += mr;
    }
    g += ng;
  }
}
#endif  // TS_X86

}  // namespace qact
}  // namespace tokenserve
