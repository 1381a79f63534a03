// The decoder layer stack of tokenserve.models.llama.LlamaForCausalLM.forward in one call.
//
// At batch 1 a decode step is ~300 small kernel calls (30 layers x 4 GEMMs, RoPE + KV
// write, attention, 2 norms, SiLU-and-mul). From Python each costs a few microseconds of
// interpreter, pybind11 argument conversion and output allocation on top of the kernel:
// about 1 ms of a ~9 ms step on the default model. Decoder holds the layers' prepared
// weights once and runs the loop here, calling the very same kernel functions
// (csrc/kernels.h) in the same order with the same arguments as the Python loop, so its
// results are bit-identical to it (tests/unit/test_decoder.py) and inherit the kernels'
// batch invariance.
//
// Per layer i (x: [T, hidden] normed input, residual: [T, hidden], both the model dtype):
//
//     qkv = proj(x, qkv_i)                                   [T, (H + 2 Hkv) D]
//     (Qwen3) q and k heads RMSNormed in place (q_norm_i, k_norm_i: [D])
//     rotary_embedding_write_kv(qkv, ..., k_cache_i, v_cache_i)
//     a = paged_attention(qkv[:, :H D] as [T, H, D])         [T, H, D]
//     x = proj(a, o_i);  residual += x;  x = rms_norm(residual) * ln2_i
//     x = proj(silu_and_mul(proj(x, gate_up_i)), down_i)
//     residual += x;  x = rms_norm(residual) * (ln1_{i+1} or the final norm)
#include <pybind11/stl.h>

#include <optional>
#include <vector>

#include "proj_spec.h"

namespace tokenserve {
namespace {

struct Layer {
  ProjSpec qkv, o, gate_up, down;
  torch::Tensor ln1, ln2;
  int64_t window;         // sliding window of the layer's attention (tokens), 0 = none
  torch::Tensor q_norm, k_norm;  // per-head RMSNorm weights [D] (Qwen3), or undefined
};

// In place: RMSNorm of each D-wide head of cols [lo, lo + n) of qkv [T, W], as the Python
// loop's CausalLM._qk_norm ("head"): the heads gathered contiguous, normed, copied back.
void head_rms_norm(torch::Tensor& qkv, int64_t lo, int64_t n, int64_t D, const torch::Tensor& w, double eps) {
  torch::Tensor part = qkv.narrow(1, lo, n);
  const torch::Tensor rows = part.reshape({-1, D}).contiguous();
  torch::Tensor out = torch::empty_like(rows);
  rms_norm(out, rows, w, eps);
  part.copy_(out.view({qkv.size(0), n}));
}

ProjSpec make_proj(const pybind11::tuple& spec) { return ProjSpec::parse(spec, "Decoder"); }

}  // namespace

class Decoder {
 public:
  Decoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : H_(num_heads), Hkv_(num_kv_heads), D_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(H_ > 0 && Hkv_ > 0 && H_ % Hkv_ == 0 && D_ > 0, "Decoder: bad head configuration");
  }

  void add_layer(pybind11::tuple qkv, pybind11::tuple o, pybind11::tuple gate_up, pybind11::tuple down,
                 torch::Tensor ln1, torch::Tensor ln2, int64_t window, std::optional<torch::Tensor> q_norm,
                 std::optional<torch::Tensor> k_norm) {
    TORCH_CHECK(window >= 0, "Decoder: window must be >= 0");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "Decoder: q_norm and k_norm go together");
    TORCH_CHECK(!q_norm || (q_norm->numel() == D_ && k_norm->numel() == D_),
                "Decoder: per-head q/k norm weights must be [head_dim]");
    layers_.push_back({make_proj(qkv), make_proj(o), make_proj(gate_up), make_proj(down), ln1, ln2, window,
                       q_norm.value_or(torch::Tensor()), k_norm.value_or(torch::Tensor())});
  }

  void set_final_norm(torch::Tensor norm) { final_norm_ = norm; }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // x: [T, hidden] the first layer's normed input; residual: [T, hidden] (updated in place);
  // kv_region: [layers, 2, num_blocks, Hkv, block_size, R] (LlamaForCausalLM.allocate_kv_cache;
  // R = D, or D + 4 for an int8 cache: the kernels read the layout from the tensor).
  // Returns [T, hidden]: the final normed hidden states.
  torch::Tensor forward(torch::Tensor x, torch::Tensor residual, torch::Tensor positions,
                        torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor query_start_loc,
                        torch::Tensor context_lens, torch::Tensor cos_sin, torch::Tensor kv_region) {
    const int64_t L = num_layers();
    TORCH_CHECK(L > 0 && final_norm_.defined(), "Decoder: no layers or no final norm");
    TORCH_CHECK(kv_region.dim() == 6 && kv_region.size(0) == L && kv_region.size(1) == 2,
                "Decoder: kv_region must be [", L, ", 2, num_blocks, Hkv, block_size, D], got ",
                kv_region.sizes());
    TORCH_CHECK(x.dim() == 2, "Decoder: x must be [T, hidden]");
    const int64_t T = x.size(0);
    for (int64_t i = 0; i < L; ++i) {
      const Layer& l = layers_[i];
      const torch::Tensor kv = kv_region.select(0, i);
      const torch::Tensor k_cache = kv.select(0, 0), v_cache = kv.select(0, 1);
      torch::Tensor qkv = l.qkv(x);
      if (l.q_norm.defined()) {
        head_rms_norm(qkv, 0, H_ * D_, D_, l.q_norm, eps_);
        head_rms_norm(qkv, H_ * D_, Hkv_ * D_, D_, l.k_norm, eps_);
      }
      rotary_embedding_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, H_, Hkv_);
      const torch::Tensor q = qkv.narrow(1, 0, H_ * D_).view({T, H_, D_});
      torch::Tensor a = torch::empty({T, H_, D_}, qkv.options());
      paged_attention_ex(a, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale_, l.window,
                         0.0);
      x = l.o(a.view({T, H_ * D_}));
      fused_add_rms_norm(x, residual, l.ln2, eps_);
      const torch::Tensor g = l.gate_up(x);
      torch::Tensor act = torch::empty({T, g.size(1) / 2}, g.options());
      silu_and_mul(act, g);
      x = l.down(act);
      fused_add_rms_norm(x, residual, i + 1 < L ? layers_[i + 1].ln1 : final_norm_, eps_);
    }
    return x;
  }

 private:
  int64_t H_, Hkv_, D_;
  double eps_, scale_;
  std::vector<Layer> layers_;
  torch::Tensor final_norm_;
};

}  // namespace tokenserve

TOKENSERVE_REGISTER(decoder) {
  pybind11::class_<tokenserve::Decoder>(m, "Decoder",
      "Decoder(num_heads, num_kv_heads, head_dim, rms_norm_eps, attn_scale): a Llama layer stack run "
      "in one call (csrc/decoder.cpp), bit-identical to LlamaForCausalLM's Python layer loop.")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double>(), pybind11::arg("num_heads"),
           pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"), pybind11::arg("scale"))
      .def("add_layer", &tokenserve::Decoder::add_layer,
           "add_layer(qkv, o, gate_up, down, ln1, ln2, window=0, q_norm=None, k_norm=None): projections as (kind 0 gemm | 1 quant_gemm | "
           "2 int8_gemm | 3 quant_k_gemm | 4 quant_amx_gemm | 5 split (w = list of part specs), weight, int8 scale "
           "or None, qtype, N, fp32 bias or None) (csrc/proj_spec.h); "
           "norms [hidden]; window: the layer's sliding window (tokens), 0 = none; q_norm, k_norm: per-head "
           "RMSNorm weights [head_dim] (Qwen3) or None.",
           pybind11::arg("qkv"), pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"),
           pybind11::arg("ln1"), pybind11::arg("ln2"), pybind11::arg("window") = 0,
           pybind11::arg("q_norm") = pybind11::none(), pybind11::arg("k_norm") = pybind11::none())
      .def("set_final_norm", &tokenserve::Decoder::set_final_norm)
      .def_property_readonly("num_layers", &tokenserve::Decoder::num_layers)
      .def("forward", &tokenserve::Decoder::forward, tokenserve::ReleaseGil(),
           pybind11::arg("x"), pybind11::arg("residual"),
           pybind11::arg("positions"), pybind11::arg("slot_mapping"), pybind11::arg("block_tables"),
           pybind11::arg("query_start_loc"), pybind11::arg("context_lens"), pybind11::arg("cos_sin"),
           pybind11::arg("kv_region"),
           "forward(x[T,hidden], residual[T,hidden] (in place), positions int64[T], slot_mapping int64[T], "
           "block_tables int32[S,maxb], query_start_loc int32[S+1], context_lens int32[S], cos_sin fp32, "
           "kv_region[L,2,nb,Hkv,bs,D]) -> [T, hidden] final normed hidden states.");
}
