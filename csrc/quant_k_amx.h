// The k-quant GEMM of csrc/quant_k.cpp (Q4_K, Q5_K, Q6_K on k8-packed super-blocks) on Intel
// AMX-INT8 tiles (csrc/quant_k_amx.cpp), with its bits: quant_k_gemm hands a GEMM of at
// least kAmxKMinRows rows here where the CPU and OS allow.
#pragma once

#include <cstdint>

namespace tokenserve {

// Activation rows from which quant_k_gemm runs on the AMX-INT8 tiles (where the CPU and OS
// allow); below, the AVX-512 VNNI int8 tiles. The bits are the same either way.
constexpr int64_t kAmxKMinRows = 16;
// 16-row slices of activations from which Q4_K / Q5_K fold their scales into the B tiles
// (csrc/quant_k_amx.cpp); below, one product per sub-block. Q6_K folds on any number. The
// bits are the same either way.
constexpr int64_t kAmxKFoldSlices = 2;

// y [M, N] (+ bias) = quant_k_gemm's super-block formula on AMX-INT8 tiles, the same bits:
//   qt: kquant::Q4_K | Q5_K | Q6_K;  w: k8-packed [ceil(N / 8), K / 256, group bytes]
//   q8: int8 activations [ceil(M / 16) * 16, K] in the int8 tiles' lane order
//       (csrc/quant_k.cpp reorder_q8); xd: fp32 [ceil(M / 16) * 16, K / 256] (their scales);
//       xbs: int16 [ceil(M / 16) * 16, K / 32] (their 32-element sums). Rows past M may hold
//       anything: they are computed and never stored.
//   bias: [N] fp32 or null;  y: bf16 (y_bf16) or fp32 [M, N]
// Requires quant_amx_int_available() (csrc/quant_amx_int.h; asserted) and K % 256 == 0.
void quant_k_amx_gemm(int qt, const int8_t* q8, const float* xd, const int16_t* xbs, int64_t M, int64_t K,
                      const uint8_t* w, int64_t N, const float* bias, void* y, bool y_bf16);

}  // namespace tokenserve
