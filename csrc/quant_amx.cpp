// GEMM on GGUF block-quantised weights (Q4_0, Q4_1, Q8_0) on Intel AMX: y = x @ W^T (+ b).
// Pure-torch oracle: tokenserve.ops.quant (quant_amx_linear_ref, repack_t16).
//
// The weights stay in their GGUF blocks in memory (0.625 bytes per Q4_1 weight) and are
// dequantised to bf16 one tile at a time, in registers and L1, right before the tile
// product; the activations are bf16 (an fp32 x is rounded to bf16 first), never
// quantised. Per output element y[m, n]:
//
//     w[n, k] = bf16(fl(fma(q, d, m)))   (Q4_0: m = -8 d; Q8_0: fl(q * d))   d, m: fp16
//     acc = 0; for b in 0..nb-1: acc = tdpbf16ps(acc, x[m, 32b : 32b + 32], w[n, 32b : ...])
//     y = round(acc (+ bias[n]))
//
// one tdpbf16ps per 32-block, in block order, for every row: a row's bits depend on its
// own x row and the weight only, never on M, on the row's place in a tile, on the tile
// shape or on the thread partition (batch invariance; tests/unit/test_kernel_quant_amx.py).
// The bits differ from csrc/quant.cpp's (int16 activations, exact integer block dots), so
// a CPU runs one of the two for every step (tokenserve.ops.linear picks it at load).
//
// Layout "t16" (tokenserve.ops.quant_blocks.repack_t16), per (16-row tile t, block b):
//
//     | d[16] fp16 | (Q4_1) m[16] fp16 | qs: 16 rows x the GGUF block's quants |
//       Q4_0 288 bytes, Q4_1 320, Q8_0 544: the file's bytes, regrouped (no more memory)
//
// (a tile's d and m are widened to fp32 once, into a 128-byte scratch the rows broadcast from).
// Tiles: the weights are the A operand (16 weight rows x 32 k, one block: a row is one GGUF
// block, so one 16-entry bf16 table per row maps its nibbles, vpermw), the activations the
// B operand, packed per call in k pairs ([16 k-pairs][16 rows][2]); C = [16 n][16 m] fp32.
// Where the time goes (Sapphire Rapids, 2 threads): a Q4 tile's dequantisation ~20 ns
// (~3 cycles per row, ports 0 and 5), the tile product ~4 ns. At M <= 32 each tile is
// dequantised right before its products; above, a pair of 16-row weight panels is
// dequantised once into L1/L2 and reused by every 32-row slice of x.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"
#include "kernels.h"
#include "quant_act.h"
#include "registry.h"
#include "simd.h"

#if defined(TS_X86) && defined(__linux__) && defined(__GNUC__) && __GNUC__ >= 12
#define TS_HAVE_AMX 1
#define TS_TARGET_AMX                                                                      \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi," \
                        "amx-tile,amx-bf16")))
#endif

namespace tokenserve {
namespace {

constexpr int64_t QK = 32;   // weights per GGUF block = k per tile product
constexpr int64_t NT = 16;   // weight rows per tile
enum QType : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
constexpr int64_t kTileBytes[3] = {288, 320, 544};
constexpr int64_t kQuantOffset[3] = {32, 64, 32};
// Blocks ahead of the one being dequantised whose bytes the fused loop prefetches.
constexpr int64_t kPrefetchBlocks = 2;

// AMX-BF16 on the CPU (with AVX-512 VBMI, for the nibble permutes) and granted by the OS.
bool amx_permitted() {
#ifdef TS_HAVE_AMX
  return cpu_features().amx_bf16 && __builtin_cpu_supports("avx512vbmi") && amx_tiles_permitted();
#else
  return false;
#endif
}

#ifdef TS_HAVE_AMX
// Tiles 0-3: C (16 x 16 fp32); 4, 5: A (two 16-row weight tiles); 6, 7: B (two 16-row
// activation tiles). All 16 rows x 64 bytes.
TS_TARGET_AMX void tiles_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  asm volatile("" ::"r"(&c) : "memory");  // GCC may drop stores to a struct only ldtilecfg reads
  _tile_loadconfig(&c);
}
TS_TARGET_AMX void tiles_release() { _tile_release(); }

// One (tile, block) of t16 weights -> the A tile, bf16 [16 rows][32 k] (1 KB at dst).
template <int QT>
TS_TARGET_AMX inline void dequant_tile(const uint8_t* tb, uint16_t* dst) {
  alignas(64) float d[32];  // d[16], then m[16] (Q4_1)
  _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb))));
  if constexpr (QT == Q4_1)
    _mm512_store_ps(d + 16, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 32))));
  asm volatile("" ::"r"(d) : "memory");  // the rows broadcast from memory (a load), not by permutes
  const uint8_t* qs = tb + kQuantOffset[QT];
  if constexpr (QT == Q8_0) {
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const __m512 dv = _mm512_set1_ps(d[r]);
      const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(qs + 32 * r))), dv);
      const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(qs + 32 * r + 16))), dv);
      _mm512_store_si512(reinterpret_cast<__m512i*>(dst + 32 * r), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  } else {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    // word i (0..31) <- qs byte i % 16 (in both bytes), then >> 4 for i >= 16: bits 0-3 are
    // element i's quant (GGUF: byte i holds element i low, element i + 16 high)
    const __m512i perm = _mm512_set_epi8(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8,
                                         7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0,
                                         15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8,
                                         7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i shift = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
                                           0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const __m512 mv = QT == Q4_1 ? _mm512_set1_ps(d[16 + r]) : _mm512_set1_ps(-8.f * d[r]);
      const __m512 v = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[r]), mv);  // the row's 16 values
      // the table twice (vpermw reads index bit 4 too, which holds another nibble's bit)
      const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v, v);
      const __m512i raw = _mm512_permutexvar_epi8(perm, _mm512_castsi128_si512(load16(qs + 16 * r)));
      const __m512i w = _mm512_permutexvar_epi16(_mm512_srlv_epi16(raw, shift), table);
      _mm512_store_si512(reinterpret_cast<__m512i*>(dst + 32 * r), w);
    }
  }
}

using DequantFn = void (*)(const uint8_t*, uint16_t*);
constexpr DequantFn kDequant[3] = {&dequant_tile<Q4_0>, &dequant_tile<Q4_1>, &dequant_tile<Q8_0>};

// C tile [16 n][16 m] fp32 (cbuf) (+ bias) -> y rows m0 .. m0 + rows - 1, columns n0 ..
// n0 + cols - 1, in y's dtype (bf16: round to nearest even).
TS_TARGET_AMX inline void store_c(const float* c, int rows, int64_t cols, const float* bias, void* y,
                                  bool y_bf16, int64_t N, int64_t m0, int64_t n0) {
  const __m512i col = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
  const __mmask16 k = cols >= 16 ? __mmask16(0xffff) : __mmask16((1u << cols) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    __m512 v = _mm512_i32gather_ps(col, c + r, 4);
    if (bias) v = _mm512_add_ps(v, bv);
    if (y_bf16) {
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + (m0 + r) * N + n0, k,
                               (__m256i)_mm512_cvtneps_pbh(v));
    } else {
      _mm512_mask_storeu_ps(static_cast<float*>(y) + (m0 + r) * N + n0, k, v);
    }
  }
}

struct Problem {
  int qt;
  const uint8_t* w;   // t16 tiles [ntiles][nb][kTileBytes]
  int64_t nb, ntiles, M, N;
  const uint16_t* xb;  // activations [nmt][nb][16 k-pairs][16 rows][2] bf16
  int64_t nmt;
  const float* bias;
  void* y;
  bool y_bf16;
};

// Weight tiles t0, t0 + 1 (ntl of them) x every 16-row slice of x. abuf: 64-byte aligned,
// nb * 2 KB (or 4 KB at M <= 32: two blocks); cbuf: 2 x 256 fp32.
TS_TARGET_AMX void run_tiles(const Problem& p, int64_t t0, int64_t ntl, uint16_t* abuf, float* cbuf) {
  const int64_t TB = kTileBytes[p.qt], nb = p.nb;
  const DequantFn dq = kDequant[p.qt];
  const uint8_t* w0 = p.w + t0 * nb * TB;
  const uint8_t* w1 = w0 + nb * TB;
  const bool fused = p.nmt <= 2;
  if (!fused) {
    for (int64_t b = 0; b < nb; ++b) {
      dq(w0 + b * TB, abuf + b * 1024);
      if (ntl == 2) dq(w1 + b * TB, abuf + b * 1024 + 512);
    }
  }
  for (int64_t mt = 0; mt < p.nmt; mt += 2) {
    const bool two = mt + 1 < p.nmt;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (fused) {  // block 0 now; block b + 1 below, before block b's tile products
      dq(w0, abuf);
      if (ntl == 2) dq(w1, abuf + 512);
    }
    for (int64_t b = 0; b < nb; ++b) {
      uint16_t* a = fused ? abuf + (b & 1) * 1024 : abuf + b * 1024;
      if (fused) {
        // the next block's tiles, into the other half of abuf: the vector units dequantise
        // while the tile unit multiplies, and the tile loads below read stores that are
        // one block old (a tile load right behind its vector stores waits for them)
        for (int64_t o = 0; o < TB; o += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(w0 + (b + kPrefetchBlocks) * TB + o), _MM_HINT_T0);
          if (ntl == 2) _mm_prefetch(reinterpret_cast<const char*>(w1 + (b + kPrefetchBlocks) * TB + o), _MM_HINT_T0);
        }
        if (b + 1 < nb) {
          uint16_t* nxt = abuf + ((b + 1) & 1) * 1024;
          dq(w0 + (b + 1) * TB, nxt);
          if (ntl == 2) dq(w1 + (b + 1) * TB, nxt + 512);
        }
      }
      _tile_loadd(4, a, 64);
      _tile_loadd(6, p.xb + (mt * nb + b) * 512, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (ntl == 2) {
        _tile_loadd(5, a + 512, 64);
        _tile_dpbf16ps(1, 5, 6);
      }
      if (two) {
        _tile_loadd(7, p.xb + ((mt + 1) * nb + b) * 512, 64);
        _tile_dpbf16ps(2, 4, 7);
        if (ntl == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
    for (int64_t i = 0; i < (two ? 2 : 1); ++i) {
      if (i == 0) {
        _tile_stored(0, cbuf, 64);
        if (ntl == 2) _tile_stored(1, cbuf + 256, 64);
      } else {
        _tile_stored(2, cbuf, 64);
        if (ntl == 2) _tile_stored(3, cbuf + 256, 64);
      }
      const int rows = int(std::min<int64_t>(16, p.M - 16 * (mt + i)));
      for (int64_t j = 0; j < ntl; ++j) {
        const int64_t n0 = (t0 + j) * NT;
        store_c(cbuf + 256 * j, rows, std::min<int64_t>(16, p.N - n0), p.bias, p.y, p.y_bf16, p.N,
                16 * (mt + i), n0);
      }
    }
  }
}

// x [M, K] bf16 -> xb [nmt][nb][16 k-pairs][16 rows] of bf16 pairs (uint32); xb's rows past
// M are left as they are (the caller zeroes them).
void pack_x(const uint32_t* x, int64_t M, int64_t K, uint32_t* xb) {
  const int64_t nb = K / QK, nmt = (M + 15) / 16, kp_row = K / 2;
  at::parallel_for(0, nmt * nb, 256, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t mt = u / nb, b = u % nb;
      uint32_t* o = xb + u * 256;
      const int64_t rows = std::min<int64_t>(16, M - 16 * mt);
      for (int64_t mm = 0; mm < rows; ++mm) {
        const uint32_t* src = x + (16 * mt + mm) * kp_row + b * 16;
        for (int kp = 0; kp < 16; ++kp) o[kp * 16 + mm] = src[kp];
      }
    }
  });
}
#endif  // TS_HAVE_AMX

void check_t16(const torch::Tensor& w, int64_t qtype, int64_t N, int64_t K) {
  TORCH_CHECK(qtype >= 0 && qtype <= 2, "quant_amx_gemm: qtype must be 0 (Q4_0), 1 (Q4_1) or 2 (Q8_0)");
  TORCH_CHECK(K % QK == 0, "quant_amx_gemm: K=", K, " is not a multiple of 32");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 &&
                  w.size(0) == (N + NT - 1) / NT && w.size(1) == K / QK && w.size(2) == kTileBytes[qtype],
              "quant_amx_gemm: w must be contiguous uint8 [", (N + NT - 1) / NT, ", ", K / QK, ", ",
              kTileBytes[qtype], "] (tokenserve.ops.quant_blocks.repack_t16), got ", w.sizes());
}

}  // namespace

// y = x @ W^T (+ bias) on t16-packed GGUF blocks, on AMX (see the header).
//   x:     [M, K] bf16 or fp32 (fp32 is rounded to bf16 first); K a multiple of 32
//   w:     uint8 [ceil(N / 16), K / 32, 288 | 320 | 544] (repack_t16)
//   qtype: 0 Q4_0, 1 Q4_1, 2 Q8_0;  bias: [N] or None;  out_dtype: bf16 | fp32 (None: x's)
// Returns [M, N]. Raises (RuntimeError) when this CPU or OS cannot run AMX tiles.
torch::Tensor quant_amx_gemm(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                             const std::optional<torch::Tensor>& bias,
                             std::optional<at::ScalarType> out_dtype) {
  check_gemm_x("quant_amx_gemm", x);
  const int64_t M = x.size(0), K = x.size(1);
  check_t16(w, qtype, N, K);
  TORCH_CHECK(amx_permitted(), "quant_amx_gemm: this CPU or OS cannot run AMX-BF16 tiles");
  const GemmIo io = gemm_io("quant_amx_gemm", x, N, bias, out_dtype);
  auto y = torch::empty({M, N}, x.options().dtype(io.dtype));
  if (M == 0 || N == 0) return y;
#ifdef TS_HAVE_AMX
  const auto xbf = x.to(at::kBFloat16).contiguous();
  const int64_t nb = K / QK, nmt = (M + 15) / 16, ntiles = (N + NT - 1) / NT;
  // 64-byte aligned scratch: the packed activations (zeroed: the rows past M)
  std::vector<uint32_t> xbuf(nmt * nb * 256 + 16);
  uint32_t* xb = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(xbuf.data()) + 63) & ~uintptr_t(63));
  pack_x(reinterpret_cast<const uint32_t*>(xbf.data_ptr()), M, K, xb);
  const Problem p{int(qtype), w.data_ptr<uint8_t>(), nb, ntiles, M, N, reinterpret_cast<const uint16_t*>(xb),
                  nmt, io.bias.defined() ? io.bias.data_ptr<float>() : nullptr, y.data_ptr(),
                  io.dtype == at::kBFloat16};
  const int64_t npairs = (ntiles + 1) / 2;
  const int64_t abuf_elems = (nmt <= 2 ? 2 : nb) * 1024;
  // at least ~256 weight-tile pairs of blocks per thread (~10 us at M = 1): a parallel
  // region costs a few microseconds, and a small GEMM ran slower on 2 threads than on 1
  const int64_t grain = std::max<int64_t>(1, 256 / (nb * std::min<int64_t>(nmt, 4)));
  at::parallel_for(0, npairs, grain, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<uint16_t> abv;  // the dequantised weight tiles
    if (abv.size() < size_t(abuf_elems + 32)) abv.resize(abuf_elems + 32);
    uint16_t* abuf = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(abv.data()) + 63) & ~uintptr_t(63));
    alignas(64) float cbuf[2 * 256];
    tiles_configure();
    for (int64_t q = p0; q < p1; ++q) run_tiles(p, 2 * q, std::min<int64_t>(2, ntiles - 2 * q), abuf, cbuf);
    tiles_release();  // back to the init state: a context switch saves no tile data
  });
#endif
  return y;
}

// Embedding lookup on a t16-packed table w (V rows): rows ids [T] -> [T, K] in out_dtype,
// dequantised as quant_dequant_rows does on x8 (fp32 float(q) * d + m, two roundings), so a
// tied table gives the same embeddings whichever GEMM holds it.
torch::Tensor quant_t16_dequant_rows(const torch::Tensor& ids, const torch::Tensor& w, int64_t qtype,
                                     int64_t V, int64_t K, at::ScalarType out_dtype) {
  check_t16(w, qtype, V, K);
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat, "quant_t16_dequant_rows: bf16 or fp32 out");
  auto idx = ids.to(at::kLong).contiguous();
  const int64_t T = idx.numel(), nb = K / QK, TB = kTileBytes[qtype];
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < V, "quant_t16_dequant_rows: id ", ip[t], " out of range [0, ", V, ")");
  auto y = torch::empty({T, K}, w.options().dtype(out_dtype));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const bool bf = out_dtype == at::kBFloat16;
  void* yp = y.data_ptr();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t tile = ip[t] / NT, r = ip[t] % NT;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* tb = wp + (tile * nb + b) * TB;
        const float d = qact::fp16_to_f32(tb + 2 * r);
        const uint8_t* qs = tb + kQuantOffset[qtype];
        for (int i = 0; i < QK; ++i) {
          float v;
          if (qtype == Q8_0) {
            v = float(int8_t(qs[32 * r + i])) * d;
          } else {
            const uint8_t byte = qs[16 * r + (i % 16)];
            const int q = i < 16 ? (byte & 0x0f) : (byte >> 4);
            v = qtype == Q4_0 ? float(q - 8) * d : float(q) * d + qact::fp16_to_f32(tb + 32 + 2 * r);
          }
          store1(yp, t * K + b * QK + i, v, bf);
        }
      }
    }
  });
  return y;
}

}  // namespace tokenserve

TOKENSERVE_REGISTER(quant_amx) {
  m.def("quant_t16_dequant_rows", &tokenserve::quant_t16_dequant_rows, pybind11::arg("ids"), pybind11::arg("w"),
        pybind11::arg("qtype"), pybind11::arg("V"), pybind11::arg("K"), pybind11::arg("out_dtype"),
        "quant_t16_dequant_rows(ids: int [T], w: t16-packed table of V rows, qtype, V, K, out_dtype) -> "
        "Tensor[T, K]: an embedding lookup on a quantised table (the same values as quant_dequant_rows).");
  m.def("quant_amx_gemm", &tokenserve::quant_amx_gemm, tokenserve::ReleaseGil(), pybind11::arg("x"),
        pybind11::arg("w"), pybind11::arg("qtype"), pybind11::arg("N"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("out_dtype") = pybind11::none(),
        "quant_amx_gemm(x: Tensor[M, K] bf16|fp32, w: uint8 [ceil(N/16), K/32, 288|320|544] t16-packed GGUF "
        "blocks, qtype: 0 Q4_0 | 1 Q4_1 | 2 Q8_0, N, bias=None, out_dtype=None) -> Tensor[M, N]: x @ W^T "
        "(+ bias) on AMX tiles, weights dequantised to bf16 per tile, bf16 activations, fp32 accumulation, "
        "row-invariant bits.");
  m.def("quant_amx_available", [] { return tokenserve::amx_permitted(); },
        "True when this CPU has AMX-BF16 (and AVX512-VBMI) and the OS granted the tile state.");
}
