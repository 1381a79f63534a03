// A mixture-of-experts MLP in C++ (tokenserve.models.moe.MoE): the routed experts
// (MoeExperts, csrc/moe.cpp's header comment) and the whole block around them (MoeMlp:
// router, top-k, the experts, Qwen2-MoE's gated shared expert), the latter for the fused
// layer stack (csrc/decoder.cpp).
#pragma once
#include <memory>
#include <optional>
#include <vector>

#include "proj_spec.h"

namespace tokenserve {

class MoeExperts {
 public:
  // gate_up, down: one c_spec tuple per expert (same length).
  // parallel_rows: the most tokens an expert may have for the experts to run side by side
  // (0: never; csrc/moe.cpp).
  MoeExperts(pybind11::list gate_up, pybind11::list down, int64_t parallel_rows);

  int64_t num_experts() const { return int64_t(down_.size()); }

  // x: [T, hidden] model dtype; ids: int64 [T, k]; weights: [T, k] fp32 or model dtype.
  // Returns [T, hidden] model dtype: sum over a token's experts (ascending id) of
  // weight * expert(x), each product rounded to the model dtype, then each addition.
  // Errors (RuntimeError): shapes, an id out of range.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights) const;

 private:
  std::vector<ProjSpec> gate_up_, down_;
  int64_t parallel_rows_;
};

// One layer's MoE MLP, as tokenserve.models.moe.MoE.__call__ computes it (the same ops in
// the same order, so the same bits):
//
//     probs = softmax(router(x).float())                     [T, E] fp32
//     w, ids = topk(probs, top_k)                            [T, k]
//     w = w / w.sum(-1) if norm_topk_prob;  w = w.to(dtype) unless weights_fp32
//     out = experts(x, ids, w)                               (MoeExperts.forward)
//     out = out + sigmoid(shared_gate(x)) * shared_down(silu_and_mul(shared_gate_up(x)))
//                                                            (Qwen2-MoE's shared expert)
struct MoeMlp {
  ProjSpec router;
  std::shared_ptr<const MoeExperts> experts;
  int64_t top_k = 0;
  bool norm_topk_prob = false, weights_fp32 = false;
  std::optional<ProjSpec> shared_gate_up, shared_down, shared_gate;  // all or none

  // Parses the Python tuple (router_spec, MoeExperts, top_k, norm_topk_prob, weights_fp32,
  // None | (shared_gate_up_spec, shared_down_spec, shared_gate_spec)). Needs the GIL.
  // Errors (RuntimeError): a malformed tuple, top_k outside [1, num_experts].
  static MoeMlp parse(const pybind11::handle& h, const char* who);

  // x: [T, hidden] model dtype -> [T, hidden] model dtype.
  torch::Tensor operator()(const torch::Tensor& x) const;
};

}  // namespace tokenserve
