// A projection as Python hands it to C++: the `(kind, weight, scale, qtype, N, bias)` tuple
// of tokenserve.ops.linear.Linear.c_spec() (or SplitLinear.c_spec()), parsed once and run on
// the kernel it names. Shared by the fused layer stack (csrc/decoder.cpp) and the MoE experts
// (csrc/moe.cpp).
//
// Kind 5 ("split") is a fused row-block weight whose parts are stored in different formats
// (a GGUF Q4_K_M layer's q|k in Q4_K and v in Q6_K): weight is a list of part specs, each
// run on its own kernel on the same x and the outputs concatenated along N, so no part is
// widened to bf16. Each part's GEMM is row-invariant, hence so is the whole.
#pragma once
#include <optional>
#include <vector>

#include "kernels.h"
#include "registry.h"

namespace tokenserve {

struct ProjSpec {
  enum Kind : int64_t { kGemm = 0, kQuantGemm = 1, kInt8Gemm = 2, kQuantKGemm = 3, kQuantAmxGemm = 4, kSplit = 5 };
  int64_t kind = kGemm;
  torch::Tensor w;                    // packed panels / x8 or t16 GGUF blocks / int8 panels / k8 blocks
  torch::Tensor scale;                // int8 only: fp32 per-row scales
  int64_t qtype = 0;                  // quant only
  int64_t N = 0;                      // out features
  std::optional<torch::Tensor> bias;  // fp32 [N] or none
  std::vector<ProjSpec> parts;        // split only: the row blocks in order

  // x: [M, K] model dtype -> [M, N] model dtype.
  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case kGemm: return gemm(x, w, N, bias, std::nullopt);
      case kQuantGemm: return quant_gemm(x, w, qtype, N, bias, std::nullopt);
      case kQuantKGemm: return quant_k_gemm(x, w, qtype, N, bias, std::nullopt);
      case kQuantAmxGemm: return quant_amx_gemm(x, w, qtype, N, bias, std::nullopt);
      case kSplit: {
        std::vector<torch::Tensor> ys;
        ys.reserve(parts.size());
        for (const ProjSpec& p : parts) ys.push_back(p(x));
        return torch::cat(ys, 1);
      }
      default: return int8_gemm(x, w, scale, N, bias, std::nullopt);
    }
  }

  // Needs the GIL (reads a Python tuple). Errors (RuntimeError, prefixed by who): a tuple of
  // the wrong length, an unknown kind, an int8 part without scales, a split whose parts'
  // N do not add up.
  static ProjSpec parse(const pybind11::handle& h, const char* who) {
    const auto spec = pybind11::reinterpret_borrow<pybind11::tuple>(h);
    TORCH_CHECK(spec.size() == 6, who, ": a projection spec is (kind, w, scale, qtype, N, bias)");
    ProjSpec p;
    p.kind = spec[0].cast<int64_t>();
    TORCH_CHECK(p.kind >= kGemm && p.kind <= kSplit, who, ": unknown projection kind ", p.kind);
    p.qtype = spec[3].cast<int64_t>();
    p.N = spec[4].cast<int64_t>();
    if (p.kind == kSplit) {
      int64_t n = 0;
      for (const auto& part : pybind11::reinterpret_borrow<pybind11::list>(spec[1])) {
        p.parts.push_back(parse(part, who));
        n += p.parts.back().N;
      }
      TORCH_CHECK(!p.parts.empty() && n == p.N, who, ": split parts give N=", n, ", expected ", p.N);
      return p;
    }
    p.w = spec[1].cast<torch::Tensor>();
    if (!spec[2].is_none()) p.scale = spec[2].cast<torch::Tensor>();
    if (!spec[5].is_none()) p.bias = spec[5].cast<torch::Tensor>();
    TORCH_CHECK(p.kind != kInt8Gemm || p.scale.defined(), who, ": an int8 projection needs its scales");
    return p;
  }
};

// A gated MLP on two projections: down(act(g[:, :I]) * g[:, I:]) with g = gate_up(x),
// act SiLU or tanh-GELU (csrc/layer_ops.cpp's kernels, one rounding each): [T, hidden] model
// dtype -> [T, hidden]. The dense layers of the fused stack, each MoE expert and Qwen2-MoE's
// shared expert.
inline torch::Tensor gated_mlp(const ProjSpec& gate_up, const ProjSpec& down, const torch::Tensor& x,
                               bool gelu_tanh = false) {
  const torch::Tensor g = gate_up(x);
  torch::Tensor act = torch::empty({g.size(0), g.size(1) / 2}, g.options());
  if (gelu_tanh)
    gelu_tanh_and_mul(act, g);
  else
    silu_and_mul(act, g);
  return down(act);
}

}  // namespace tokenserve
