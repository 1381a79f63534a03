// The k-quant type ids and sizes shared by csrc/quant_k.cpp (the GEMM and the row lookup,
// whose header draws the "k8" layout) and csrc/quant_k_pack.cpp (the load-time regrouping
// into it).
#pragma once

#include <cstdint>

namespace tokenserve::kquant {

constexpr int64_t QKK = 256;                           // weights per super-block
enum KType : int { Q4_K = 12, Q5_K = 13, Q6_K = 14 };  // ggml's type ids

constexpr bool is_k_type(int64_t qt) { return qt == Q4_K || qt == Q5_K || qt == Q6_K; }
// One GGUF super-block (ggml-common.h block_q4_K / block_q5_K / block_q6_K).
constexpr int64_t block_bytes(int qt) { return qt == Q4_K ? 144 : qt == Q5_K ? 176 : 210; }
// One k8 group's super-block: 8 rows' blocks regrouped (the same bytes as 8 blocks).
constexpr int64_t group_bytes(int qt) { return qt == Q4_K ? 1152 : qt == Q5_K ? 1408 : 1680; }
// A Q4_K / Q5_K sub-block of a k8 group super-block.
constexpr int64_t sub_bytes(int qt) { return qt == Q4_K ? 128 : 160; }

}  // namespace tokenserve::kquant
