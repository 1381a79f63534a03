// Load-time repack of GGUF k-quant rows (Q4_K, Q5_K, Q6_K) into csrc/quant_k.cpp's "k8"
// layout (drawn in that file's header; the pure-torch oracle is
// tokenserve.ops.quant_blocks.repack_k8, which this equals byte for byte).
//
// A byte shuffle, one pass over the weights: per group of 8 rows and super-block, the 8
// rows' blocks are read and the group's bytes written, groups in parallel. The torch
// version decodes every quant to int32 fields first (~30 bytes of transient memory a
// weight and ~0.2 s per 1B-model tensor); this one holds nothing beyond the output.
//
// GGUF super-block fields (ggml-common.h block_q4_K / block_q5_K / block_q6_K), as read here:
//   Q4_K 144 B | d fp16 | dmin fp16 | scales 12 | qs 128 |: sub-block j = 2c + h, element l:
//        (qs[32c + l] >> 4h) & 15
//   Q5_K 176 B | d | dmin | scales 12 | qh 32 | qs 128 |: Q4_K's nibble | ((qh[l] >> j) & 1) << 4
//   Q6_K 210 B | ql 128 | qh 64 | scales 16 int8 | d fp16 |: element 128h + 32c + l:
//        ((ql[64h + 32(c % 2) + l] >> 4(c / 2)) & 15) | ((qh[32h + l] >> 2c) & 3) << 4

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#include <ATen/Parallel.h>
#include "quant_k_layout.h"
#include "registry.h"
#include "tiles.h"

namespace tokenserve {
namespace {

using namespace kquant;  // QKK, KType, block_bytes, group_bytes, sub_bytes (RG: csrc/tiles.h)

// One super-block's 256 quants (unsigned, element order) of a GGUF block.
void decode_q(int qtype, const uint8_t* b, uint8_t* q) {
  if (qtype == Q6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          const int lo = (ql[64 * h + 32 * (c % 2) + l] >> (4 * (c / 2))) & 15;
          const int hi = (qh[32 * h + l] >> (2 * c)) & 3;
          q[128 * h + 32 * c + l] = uint8_t(lo | (hi << 4));
        }
    return;
  }
  const bool q5 = qtype == Q5_K;
  const uint8_t* qs = b + (q5 ? 48 : 16);
  for (int j = 0; j < 8; ++j)
    for (int l = 0; l < 32; ++l) {
      int v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
      if (q5) v |= ((b[16 + l] >> j) & 1) << 4;
      q[32 * j + l] = uint8_t(v);
    }
}

// The k8 bytes of one (group, super-block): rows[r] is row r's GGUF block (nullptr past N:
// left zero), out the group's GB bytes (zeroed by the caller).
void pack_group(int qtype, const uint8_t* const* rows, uint8_t* out) {
  uint8_t q[RG][QKK];
  for (int r = 0; r < RG; ++r) {
    if (rows[r]) decode_q(qtype, rows[r], q[r]);
    else std::memset(q[r], 0, QKK);
  }
  if (qtype == Q6_K) {  // | d[8] | scales[16][8] | 8 blocks x (8 low chunks, 4 high chunks) |
    for (int r = 0; r < RG; ++r) {
      if (!rows[r]) continue;
      std::memcpy(out + 2 * r, rows[r] + 208, 2);
      for (int s = 0; s < 16; ++s) out[16 + 8 * s + r] = rows[r][192 + s];
    }
    uint8_t* body = out + 144;
    for (int blk = 0; blk < 8; ++blk, body += 192)
      for (int r = 0; r < RG; ++r) {
        const uint8_t* e = q[r] + 32 * blk;
        for (int p = 0; p < 8; ++p)
          for (int j = 0; j < 2; ++j)
            body[16 * p + 2 * r + j] = uint8_t((e[2 * p + j] & 15) | ((e[16 + 2 * p + j] & 15) << 4));
        for (int c = 0; c < 4; ++c)
          for (int j = 0; j < 2; ++j) {
            int v = 0;
            for (int t = 0; t < 4; ++t) v |= (e[2 * c + j + 8 * t] >> 4) << (2 * t);
            body[128 + 16 * c + 2 * r + j] = uint8_t(v);
          }
      }
    return;
  }
  // Q4_K / Q5_K: | d[8] | dmin[8] | 3 scale words x 8 rows | 8 sub-blocks |
  const bool q5 = qtype == Q5_K;
  for (int r = 0; r < RG; ++r) {
    if (!rows[r]) continue;
    std::memcpy(out + 2 * r, rows[r], 2);
    std::memcpy(out + 16 + 2 * r, rows[r] + 2, 2);
    for (int w = 0; w < 3; ++w) std::memcpy(out + 32 + 32 * w + 4 * r, rows[r] + 4 + 4 * w, 4);
  }
  const int64_t sb = sub_bytes(qtype);
  uint8_t* body = out + 128;
  for (int sub = 0; sub < 8; ++sub, body += sb)
    for (int r = 0; r < RG; ++r) {
      const uint8_t* e = q[r] + 32 * sub;
      for (int p = 0; p < 8; ++p)
        for (int j = 0; j < 2; ++j)
          body[16 * p + 2 * r + j] = uint8_t((e[2 * p + j] & 15) | ((e[16 + 2 * p + j] & 15) << 4));
      if (!q5) continue;
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 2; ++j) {
          int v = 0;
          for (int i = 0; i < 8; ++i) v |= (e[16 * h + 2 * i + j] >> 4) << i;
          body[128 + 16 * h + 2 * r + j] = uint8_t(v);
        }
    }
}

// rows: uint8 [N, K / 256 * block_bytes] (GGUF row order, contiguous) -> uint8
// [ceil(N / 8), K / 256, group_bytes].
torch::Tensor repack_k8(const torch::Tensor& rows, int64_t qtype, int64_t K) {
  TORCH_CHECK(is_k_type(qtype), "repack_k8: qtype must be 12 Q4_K | 13 Q5_K | 14 Q6_K");
  TORCH_CHECK(K > 0 && K % QKK == 0, "repack_k8: K must be a positive multiple of 256");
  TORCH_CHECK(rows.dtype() == torch::kUInt8 && rows.dim() == 2 && rows.is_contiguous() && rows.device().is_cpu(),
              "repack_k8: rows must be a contiguous CPU uint8 [N, row_bytes] tensor");
  const int64_t nsb = K / QKK, bb = block_bytes(int(qtype)), gb = group_bytes(int(qtype));
  TORCH_CHECK(rows.size(1) == nsb * bb, "repack_k8: rows hold ", rows.size(1), " bytes, K needs ", nsb * bb);
  const int64_t N = rows.size(0), G = (N + RG - 1) / RG;
  auto out = torch::zeros({G, nsb, gb}, torch::kUInt8);
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, 16, [&](int64_t g0, int64_t g1) {
    const uint8_t* blocks[RG];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t B = 0; B < nsb; ++B) {
        for (int r = 0; r < RG; ++r) {
          const int64_t n = g * RG + r;
          blocks[r] = n < N ? src + (n * nsb + B) * bb : nullptr;
        }
        pack_group(int(qtype), blocks, dst + (g * nsb + B) * gb);
      }
  });
  return out;
}

}  // namespace
}  // namespace tokenserve

TOKENSERVE_REGISTER(quant_k_pack) {
  m.def("repack_k8", &tokenserve::repack_k8, tokenserve::ReleaseGil(), pybind11::arg("rows"), pybind11::arg("qtype"),
        pybind11::arg("K"),
        "repack_k8(rows: uint8 [N, K/256 * block_bytes] GGUF k-quant rows (contiguous), qtype: 12 Q4_K | 13 Q5_K | "
        "14 Q6_K, K) -> uint8 [ceil(N/8), K/256, group_bytes]: csrc/quant_k.cpp's k8 layout, rows past N zero; "
        "equals tokenserve.ops.quant_blocks.repack_k8 byte for byte.");
}
