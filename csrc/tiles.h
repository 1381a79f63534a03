// Tile sizes and register-tile tables shared by the GEMM kernels, and the work scheduler of
// the panel GEMMs. Every size here is a speed choice only: each kernel's header explains why
// any tile shape and any thread partition gives the same bits.
//
//   panel GEMMs (fp32 FMA chain on 16-column panels): csrc/gemm.cpp, csrc/int8_gemm.cpp
//   block-quantised GEMMs (int16 activations, 8-row groups): csrc/quant.cpp,
//   csrc/quant_k.cpp, csrc/quant_act.h
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "simd.h"

namespace tokenserve {

// ---------------------------------------------------------------- panel GEMMs

// Columns per packed weight panel: one row of a panel is 2 ymm of fp32 (the AVX2 tiles'
// unit), one zmm (the AVX-512 pair-dot tile's), and, in bf16, one 32-byte load.
constexpr int64_t NR = 16;

// A register tile: mr rows of x by npb panels (npb * 16 columns).
struct Shape {
  int mr, npb;
};

// The AVX2 FMA tile from the batch size M: mr * 2 * npb ymm accumulators, 8 at M = 1 (1 x 4:
// the weights stream from DRAM; 8 independent FMA chains) and 12 otherwise (2 x 3, 3 x 2,
// 6 x 1), leaving 4 of the 16 ymm registers for the weight vectors (loaded once per k, used
// by every row) and the broadcast of x.
inline Shape fma_tile_shape(int64_t M) {
  if (M <= 1) return {1, 4};
  if (M == 2) return {2, 3};
  if (M == 3) return {3, 2};
  return {6, 1};
}

#ifdef TS_X86
// The AVX2 FMA micro-kernel of the panel GEMMs: MR rows x NPB panels (16 columns each), a
// register tile of MR * 2 * NPB accumulators. Per k: NPB weight loads (W::load widens one
// panel's 16 weights of that k to 2 ymm of fp32, exactly), MR broadcasts of x, MR * 2 * NPB
// FMAs. Each accumulator lane is one output element's chain acc = fma(x[m, k], w[n, k], acc),
// k ascending, whatever the tile shape.
template <int MR, int NPB, class W>
TS_TARGET_AVX2 void fma_tile(
    const float* __restrict x, int64_t ldx,     // [MR, K] rows, stride ldx
    const void* __restrict wp, int64_t pstride,  // first panel [K, 16]; panel stride (elements)
    int64_t K, float* __restrict out, int64_t ldo) {  // out: [MR, NPB*16] fp32, stride ldo
  const auto* w0 = static_cast<const typename W::T*>(wp);
  __m256 acc[MR][2 * NPB];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NPB; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[2 * NPB];
#pragma GCC unroll 8
    for (int p = 0; p < NPB; ++p) W::load(w0 + p * pstride + k * NR, w + 2 * p);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < 2 * NPB; ++j) acc[r][j] = _mm256_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NPB; ++j) _mm256_storeu_ps(out + r * ldo + 8 * j, acc[r][j]);
}

using FmaTileFn = void (*)(const float*, int64_t, const void*, int64_t, int64_t, float*, int64_t);

// The fma_tile of (mr rows, npb panels) on panels of W: every shape a fma_tile_shape tile and
// its row and panel tails can have; nullptr for another (run it one panel at a time).
template <class W>
FmaTileFn pick_fma_tile(int mr, int npb) {
#define TS_T(a, b) if (mr == a && npb == b) return &fma_tile<a, b, W>;
  TS_T(1, 1) TS_T(2, 1) TS_T(3, 1) TS_T(4, 1) TS_T(5, 1) TS_T(6, 1)
  TS_T(1, 2) TS_T(2, 2) TS_T(3, 2)
  TS_T(1, 3) TS_T(2, 3)
  TS_T(1, 4)
#undef TS_T
  return nullptr;
}
#endif  // TS_X86

// The largest tile of any panel GEMM (fma_tile_shape: 6 x 1 and 1 x 4; gemm.cpp's pair-dot
// tiles: up to 4 x 4): the per-thread accumulator scratch of for_each_tile holds
// kMaxTileRows * kMaxTilePanels * 16 fp32.
constexpr int64_t kMaxTileRows = 6, kMaxTilePanels = 4;

// Runs body(m, rows, p0, np, acc) over every output tile of an [M, NP*16] result: rows
// m..m+rows-1 (rows <= sh.mr) by panels p0..p0+np-1 (np <= sh.npb), acc a per-thread fp32
// scratch of [sh.mr, sh.npb * 16]. Which thread runs a tile never changes its arithmetic.
// x_row_bytes: the bytes of one row of x (what the row chunks keep in L2).
template <class Body>
void for_each_tile(int64_t M, int64_t NP, int64_t K, int64_t x_row_bytes, Shape sh,
                   const Body& body) {
  const int64_t npb = sh.npb, mr = sh.mr;
  const int64_t ngroups = (NP + npb - 1) / npb;
  // M chunks keep a chunk of x rows in L2 while every panel streams over it; chunks and the
  // MR-row blocks inside them are balanced (64 rows: 6,6,6,6,5,5,... not 6 x 10 + 4).
  const int64_t mc_max = std::max<int64_t>(mr, (196608 / std::max<int64_t>(x_row_bytes, 1)) / mr * mr);
  const int64_t nchunks = (M + mc_max - 1) / mc_max;
  const int64_t mc_rows = (M + nchunks - 1) / nchunks;
  const int64_t units = nchunks * ngroups;
  // Threads pull batches of units from a shared counter (dynamic scheduling): on a shared
  // or oversubscribed host a descheduled thread does not hold back the others' work.
  // Tasks get at least ~32K multiply-adds so that tiny GEMMs stay on one thread.
  const int64_t work_per_unit = std::max<int64_t>(1, std::min(M, mc_rows) * npb * NR * K);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / work_per_unit);
  const int64_t ntasks = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), (units + grain - 1) / grain));
  const int64_t batch = std::max<int64_t>(1, units / (ntasks * 8));  // ~8 batches per thread
  std::atomic<int64_t> next{0};
  at::parallel_for(0, ntasks, 1, [&](int64_t, int64_t) {
    alignas(64) float acc[kMaxTileRows * kMaxTilePanels * NR];
    for (int64_t u0 = next.fetch_add(batch); u0 < units; u0 = next.fetch_add(batch))
    for (int64_t u = u0, u1 = std::min(units, u0 + batch); u < u1; ++u) {
      const int64_t chunk = u / ngroups, g = u % ngroups;
      const int64_t m_lo = chunk * M / nchunks, m_hi = (chunk + 1) * M / nchunks;
      const int64_t p0 = g * npb, np = std::min(npb, NP - p0);
      const int64_t nblk = (m_hi - m_lo + mr - 1) / std::max<int64_t>(mr, 1);
      for (int64_t blk = 0, m = m_lo; blk < nblk; ++blk) {
        const int64_t rows = (m_hi - m_lo) / nblk + (blk < (m_hi - m_lo) % nblk ? 1 : 0);
        body(m, rows, p0, np, acc);
        m += rows;
      }
    }
  });
}

// ---------------------------------------------------------------- block-quantised GEMMs

// Activation block: x is quantised to int16 per row and 32 elements (one Q4_0 / Q4_1 /
// Q8_0 block, one Q4_K / Q5_K sub-block, two Q6_K sub-blocks).
constexpr int64_t QB = 32;

// Weight rows interleaved per group: a 16-byte chunk widened to int16 is 8 rows x 2
// elements, so one vpmaddwd against a broadcast activation pair gives 8 rows' dot products
// in one ymm; a tile's output is [rows, 8].
constexpr int64_t RG = 8;

// Activation rows per register tile. 4 beats 6 by 7-10 % at M = 16 and 64 (1 or 2 threads,
// Zen 3): a tile keeps 3 ymm per row (acc, summ, isum; Q6_K: acc and two isums), and at 6
// rows the 18 no longer fit in the 16 ymm registers.
constexpr int64_t kQuantMr = 4;

// The most rows compute_groups (csrc/quant_act.h) takes per tile (its scratch size).
constexpr int64_t kQuantMrCap = 6;

// Activation rows per AVX-512 VNNI tile of csrc/quant.cpp (two groups, 16 weight rows): a
// row keeps 3 zmm (acc, summ, isum) of the 32, so 8 rows leave room for the weight vectors.
constexpr int64_t kQuantMrAvx512 = 8;

// Groups of 8 weight rows per work unit of run_units (csrc/quant_act.h).
constexpr int64_t kQuantGroupsPerUnit = 2;

}  // namespace tokenserve
