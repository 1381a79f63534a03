// C++ entry points of the kernels that other kernels call directly (csrc/decoder.cpp runs
// a whole decoder layer stack without returning to Python). Each is defined, documented and
// bound to Python in the file named beside it; the Python bindings call the same functions.
#pragma once
#include <torch/extension.h>

#include <optional>

namespace tokenserve {

// gemm.cpp: y = x @ W^T (+ bias) on gemm_prepack panels; a new [M, N] of out_dtype.
torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                   const std::optional<torch::Tensor>& bias, std::optional<at::ScalarType> out_dtype);
// quant.cpp: y = x @ W^T (+ bias) on x8-packed GGUF blocks (qtype 0 Q4_0, 1 Q4_1, 2 Q8_0).
torch::Tensor quant_gemm(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                         const std::optional<torch::Tensor>& bias, std::optional<at::ScalarType> out_dtype);
// quant_amx.cpp: the same on t16-packed GGUF blocks (qtype 0..2) on AMX tiles (bf16 dequantised
// weights and activations: other bits than quant_gemm's).
torch::Tensor quant_amx_gemm(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                             const std::optional<torch::Tensor>& bias, std::optional<at::ScalarType> out_dtype);
// quant_k.cpp: the same on k8-packed k-quant super-blocks (qtype 12 Q4_K, 13 Q5_K, 14 Q6_K).
torch::Tensor quant_k_gemm(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t N,
                           const std::optional<torch::Tensor>& bias, std::optional<at::ScalarType> out_dtype);
// int8_gemm.cpp: y = (x @ Q^T) * scale (+ bias) on pack_int8 panels.
torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale, int64_t N,
                        const std::optional<torch::Tensor>& bias, std::optional<at::ScalarType> out_dtype);

// The argument checks the three quantised GEMMs (quant_gemm, quant_k_gemm, int8_gemm) share;
// every message names the kernel (`name`).
// x: a 2-D CPU tensor [M, K], bf16 or fp32.
inline void check_gemm_x(const char* name, const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), name, ": x must be a 2-D CPU tensor [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              name, ": x must be bfloat16 or float32, got ", x.scalar_type());
}
// The output dtype (None: x's; bf16 or fp32) and the bias ([N] or None, as contiguous fp32;
// undefined when None).
struct GemmIo {
  at::ScalarType dtype;
  torch::Tensor bias;
};
inline GemmIo gemm_io(const char* name, const torch::Tensor& x, int64_t N,
                        const std::optional<torch::Tensor>& bias, std::optional<at::ScalarType> out_dtype) {
  const auto odt = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(odt == at::kBFloat16 || odt == at::kFloat, name, ": out dtype must be bf16 or fp32");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, name, ": bias must be [N=", N, "]");
    b = bias->to(at::kFloat).contiguous();
  }
  return {odt, b};
}

// layer_ops.cpp
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void silu_and_mul(torch::Tensor out, torch::Tensor x);
void gelu_tanh_and_mul(torch::Tensor out, torch::Tensor x);
// An int8 KV cache row: head_dim int8 values, then their fp32 scale in this many bytes
// (cache_ops.cpp writes it, attention.cpp reads it; tokenserve.ops.layer_ref.KV_SCALE_BYTES).
constexpr int kKvScaleBytes = 4;
// cache_ops.cpp
void rotary_embedding_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_sin,
                               torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
                               int64_t num_heads, int64_t num_kv_heads);
// attention.cpp
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor context_lens,
                     double scale);
// the same with a sliding window (0 = none) and logit soft-capping (0 = none)
void paged_attention_ex(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor block_tables, torch::Tensor query_start_loc,
                        torch::Tensor context_lens, double scale, int64_t window, double softcap);

}  // namespace tokenserve
