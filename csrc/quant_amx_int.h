// The x8 layout of the GGUF block GEMM (csrc/quant.cpp) and its AMX-INT8 path
// (csrc/quant_amx_int.cpp), which gives csrc/quant.cpp's bits on Intel AMX tiles.
#pragma once

#include <cstdint>

namespace tokenserve {
namespace x8 {

// Per group of 8 weight rows and 32-block: | d[8] fp16 | (Q4_1) m[8] fp16 | quants |
// (tokenserve.ops.quant.repack_x8; the layout is drawn in csrc/quant.cpp's header).
enum QType : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
constexpr int64_t kGroupBytes[3] = {144, 160, 272};
constexpr int64_t kQuantOffset[3] = {16, 32, 16};  // where the quants start in a group-block

}  // namespace x8

// Activation rows from which quant_gemm runs on the AMX-INT8 tiles (where the CPU and OS
// allow): below, the AVX-512 VNNI tiles are faster (each weight block is used by few rows,
// and the tile path pays per block for its scales); the bits are the same either way.
constexpr int64_t kAmxIntMinRows = 16;

// True where this CPU has AMX-INT8 (with AVX-512 VBMI and VNNI) and the OS granted the tiles.
bool quant_amx_int_available();

// y [M, N] (+ bias) = the block GEMM of csrc/quant.cpp on AMX-INT8 tiles, the same bits:
//   qt: x8::Q4_0 | Q4_1 | Q8_0;  w: x8-packed weights [ceil(N / 8), K / 32, group bytes]
//   xq: int16 activations [M, K], |q| <= 2047 (csrc/quant_act.h); xds: fp32 [M, K / 32, 2]
//   bias: [N] fp32 or null;  y: bf16 (y_bf16) or fp32 [M, N]
// Requires quant_amx_int_available() (asserted).
void quant_amx_int_gemm(int qt, const int16_t* xq, const float* xds, int64_t M, int64_t K,
                        const uint8_t* w, int64_t N, const float* bias, void* y, bool y_bf16);

}  // namespace tokenserve
