// The decoder layer stack of tokenserve.models.decoder.CausalLM.forward in one call.
//
// At batch 1 a decode step is ~300 small kernel calls (30 layers x 4 GEMMs, RoPE + KV
// write, attention, 2 norms, SiLU-and-mul). From Python each costs a few microseconds of
// interpreter, pybind11 argument conversion and output allocation on top of the kernel:
// about 1 ms of a ~9 ms step on the default model. Decoder holds the layers' prepared
// weights once and runs the loop here, calling the very same kernel functions
// (csrc/kernels.h) in the same order with the same arguments as the Python loop, so its
// results are bit-identical to it (tests/unit/test_decoder.py, test_decoder_families.py)
// and inherit the kernels' batch invariance.
//
// A layer is data, not a family: its optional blocks are the tensors and flags add_layer
// was given (DecoderArch in tokenserve/models/config.py draws the same layer). Per layer i
// (x: [T, hidden] the sublayer input, residual: [T, hidden] the residual stream h, both the
// model dtype):
//
//     in  = x (normed by ln1_i)  or  residual (no ln1: OLMo 2)
//     qkv = proj(in, qkv_i)                                  [T, (H + 2 Hkv) D]
//     q, k RMSNormed in place: per head (q_norm_i [D]: Qwen3, Gemma 3) or over the whole
//         projection (q_norm_i [H D], k_norm_i [Hkv D]: OLMo 2)
//     rotary_embedding_write_kv(qkv, ..., cos_sin[rope_i], k_cache_i, v_cache_i)
//     a = paged_attention(qkv[:, :H D] as [T, H, D], scale, window_i, softcap_i)
//     x = proj(a, o_i);  x = rms_norm(x) * attn_post_i     (sandwich / post norm)
//     x *= residual_scale_i                                 (Granite; 1 = skipped)
//     residual += x;  x = rms_norm(residual) * ln2_i        (no ln2: x = residual)
//     x = proj(act_and_mul(proj(x, gate_up_i)), down_i)     act: SiLU, or GELU-tanh (Gemma)
//         or, in a mixture-of-experts layer, x = moe_i(x)    (csrc/moe.h MoeMlp: router,
//         top-k, the experts, the shared expert: tokenserve.models.moe.MoE's bits)
//     x = rms_norm(x) * mlp_post_i;  x *= residual_scale_i
//     residual += x;  x = rms_norm(residual) * (ln1_{i+1} or the final norm)
//                                                          (no ln1_{i+1}: x = residual)
//
// "residual += x; x = rms_norm(residual)" is fused_add_rms_norm: the add rounds once to the
// dtype as torch's `h + a`, then the norm reads the stored sum: the bits of the Python
// loop's separate add and rms_norm (CausalLM._layer). With ln1 and ln2, no post norms and
// SiLU it is Llama's layer (the Python loop of CausalLM.forward for DecoderArch.llama_layers).
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "moe.h"
#include "proj_spec.h"

namespace tokenserve {
namespace {

enum class Act { kSilu, kGeluTanh };
enum class QkNorm { kNone, kHead, kFull };

// One layer's weights and blocks (undefined tensors: the block is absent).
struct Layer {
  ProjSpec qkv, o, gate_up, down;    // gate_up, down: the dense MLP (unset with moe)
  std::optional<MoeMlp> moe;          // a mixture-of-experts MLP instead of the dense one
  torch::Tensor ln1, ln2;             // pre-attention / pre-MLP RMSNorm weights [hidden]
  torch::Tensor attn_post, mlp_post;  // post-attention / post-MLP RMSNorm weights [hidden]
  int64_t window;                     // sliding window of the layer's attention (tokens), 0 = none
  QkNorm qk_norm;
  torch::Tensor q_norm, k_norm;  // q/k RMSNorm weights: [D] per head, or [H D] / [Hkv D] whole
  Act act;
  double softcap;  // attention logit soft-capping c * tanh(s / c), 0 = none
  int64_t rope;    // index of the layer's RoPE table in forward's cos_sin
  double residual_scale;  // each sublayer's output times this before the residual add (Granite), 1 = none
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

// In place: RMSNorm of cols [lo, lo + n) of qkv [T, W] as one row per token (CausalLM._qk_norm
// "full"; the kernel reads strided rows and may write over its input: the same bits).
void full_rms_norm(torch::Tensor& qkv, int64_t lo, int64_t n, const torch::Tensor& w, double eps) {
  torch::Tensor part = qkv.narrow(1, lo, n);
  rms_norm(part, part, w, eps);
}

torch::Tensor opt(const std::optional<torch::Tensor>& t) { return t.value_or(torch::Tensor()); }

ProjSpec make_proj(const pybind11::tuple& spec) { return ProjSpec::parse(spec, "Decoder"); }

}  // namespace

class Decoder {
 public:
  Decoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : H_(num_heads), Hkv_(num_kv_heads), D_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(H_ > 0 && Hkv_ > 0 && H_ % Hkv_ == 0 && D_ > 0, "Decoder: bad head configuration");
  }

  void add_layer(pybind11::tuple qkv, pybind11::tuple o, pybind11::object gate_up, pybind11::object down,
                 std::optional<torch::Tensor> ln1, std::optional<torch::Tensor> ln2, int64_t window,
                 std::optional<torch::Tensor> q_norm, std::optional<torch::Tensor> k_norm,
                 std::optional<torch::Tensor> attn_post, std::optional<torch::Tensor> mlp_post,
                 const std::string& qk_norm, const std::string& act, double softcap, int64_t rope,
                 double residual_scale, pybind11::object moe) {
    TORCH_CHECK(moe.is_none() ? !gate_up.is_none() && !down.is_none() : gate_up.is_none() && down.is_none(),
                "Decoder: a layer has either a dense MLP (gate_up, down) or a MoE block");
    TORCH_CHECK(moe.is_none() || act == "silu", "Decoder: a MoE block's experts use SiLU");
    TORCH_CHECK(window >= 0, "Decoder: window must be >= 0");
    TORCH_CHECK(softcap >= 0.0, "Decoder: softcap must be >= 0");
    TORCH_CHECK(rope >= 0, "Decoder: rope must be >= 0");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "Decoder: q_norm and k_norm go together");
    TORCH_CHECK(qk_norm == "head" || qk_norm == "full", "Decoder: qk_norm must be 'head' or 'full', got ", qk_norm);
    const bool full = qk_norm == "full";
    TORCH_CHECK(!q_norm || (full ? q_norm->numel() == H_ * D_ && k_norm->numel() == Hkv_ * D_
                                 : q_norm->numel() == D_ && k_norm->numel() == D_),
                "Decoder: q/k norm weights must be [head_dim] (qk_norm 'head') or [H * head_dim] / "
                "[Hkv * head_dim] ('full')");
    TORCH_CHECK(act == "silu" || act == "gelu_tanh", "Decoder: act must be 'silu' or 'gelu_tanh', got ", act);
    std::optional<MoeMlp> block;
    if (!moe.is_none()) block = MoeMlp::parse(moe, "Decoder");
    layers_.push_back({make_proj(qkv), make_proj(o), block ? ProjSpec() : make_proj(gate_up),
                       block ? ProjSpec() : make_proj(down), std::move(block), opt(ln1), opt(ln2),
                       opt(attn_post), opt(mlp_post), window,
                       !q_norm ? QkNorm::kNone : full ? QkNorm::kFull : QkNorm::kHead, opt(q_norm), opt(k_norm),
                       act == "silu" ? Act::kSilu : Act::kGeluTanh, softcap, rope, residual_scale});
  }

  void set_final_norm(torch::Tensor norm) { final_norm_ = norm; }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // x: [T, hidden] the first layer's input normed by its ln1 (ignored when it has none: the
  // layer reads residual; x may then be residual itself); residual: [T, hidden] (updated in
  // place); cos_sin: the RoPE tables (fp32 [max_pos, D] each), layer i rotates with
  // cos_sin[rope_i]; kv_region: [layers, 2, num_blocks, Hkv, block_size, R]
  // (CausalLM.allocate_kv_cache; R = D, or D + 4 for an int8 cache: the kernels read the
  // layout from the tensor). Returns [T, hidden]: the final normed hidden states.
  torch::Tensor forward(torch::Tensor x, torch::Tensor residual, torch::Tensor positions,
                        torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor query_start_loc,
                        torch::Tensor context_lens, const std::vector<torch::Tensor>& cos_sin,
                        torch::Tensor kv_region) {
    const int64_t L = num_layers();
    TORCH_CHECK(L > 0 && final_norm_.defined(), "Decoder: no layers or no final norm");
    TORCH_CHECK(kv_region.dim() == 6 && kv_region.size(0) == L && kv_region.size(1) == 2,
                "Decoder: kv_region must be [", L, ", 2, num_blocks, Hkv, block_size, D], got ",
                kv_region.sizes());
    TORCH_CHECK(residual.dim() == 2, "Decoder: residual must be [T, hidden]");
    for (const Layer& l : layers_)
      TORCH_CHECK(l.rope < int64_t(cos_sin.size()), "Decoder: a layer rotates with RoPE table ", l.rope,
                  " of ", cos_sin.size());
    const int64_t T = residual.size(0);
    for (int64_t i = 0; i < L; ++i) {
      const Layer& l = layers_[i];
      const torch::Tensor kv = kv_region.select(0, i);
      const torch::Tensor k_cache = kv.select(0, 0), v_cache = kv.select(0, 1);
      torch::Tensor qkv = l.qkv(l.ln1.defined() ? x : residual);
      if (l.qk_norm == QkNorm::kHead) {
        head_rms_norm(qkv, 0, H_ * D_, D_, l.q_norm, eps_);
        head_rms_norm(qkv, H_ * D_, Hkv_ * D_, D_, l.k_norm, eps_);
      } else if (l.qk_norm == QkNorm::kFull) {
        full_rms_norm(qkv, 0, H_ * D_, l.q_norm, eps_);
        full_rms_norm(qkv, H_ * D_, Hkv_ * D_, l.k_norm, eps_);
      }
      rotary_embedding_write_kv(qkv, positions, cos_sin[l.rope], k_cache, v_cache, slot_mapping, H_, Hkv_);
      const torch::Tensor q = qkv.narrow(1, 0, H_ * D_).view({T, H_, D_});
      torch::Tensor a = torch::empty({T, H_, D_}, qkv.options());
      paged_attention_ex(a, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale_, l.window,
                         l.softcap);
      x = l.o(a.view({T, H_ * D_}));
      if (l.attn_post.defined()) rms_norm(x, x, l.attn_post, eps_);
      if (l.residual_scale != 1.0) x.mul_(l.residual_scale);  // as the loop's h + a * s
      add_then_norm(x, residual, l.ln2);
      const torch::Tensor& in = l.ln2.defined() ? x : residual;
      x = l.moe ? (*l.moe)(in) : gated_mlp(l.gate_up, l.down, in, l.act == Act::kGeluTanh);
      if (l.mlp_post.defined()) rms_norm(x, x, l.mlp_post, eps_);
      if (l.residual_scale != 1.0) x.mul_(l.residual_scale);
      add_then_norm(x, residual, i + 1 < L ? layers_[i + 1].ln1 : final_norm_);
    }
    return x;
  }

 private:
  // residual += x, then x = rms_norm(residual) * norm (one fused kernel), or with no norm
  // the add alone (x is then unused: the next block reads residual).
  void add_then_norm(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& norm) const {
    if (norm.defined())
      fused_add_rms_norm(x, residual, norm, eps_);
    else
      residual.add_(x);
  }

  int64_t H_, Hkv_, D_;
  double eps_, scale_;
  std::vector<Layer> layers_;
  torch::Tensor final_norm_;
};

}  // namespace tokenserve

TOKENSERVE_REGISTER(decoder) {
  namespace py = pybind11;
  using tokenserve::Decoder;
  py::class_<Decoder>(m, "Decoder",
      "Decoder(num_heads, num_kv_heads, head_dim, rms_norm_eps, attn_scale): a decoder layer stack run in "
      "one call (csrc/decoder.cpp), bit-identical to CausalLM's Python layer loop over the same kernels.")
      .def(py::init<int64_t, int64_t, int64_t, double, double>(), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("scale"))
      .def("add_layer", &Decoder::add_layer,
           "add_layer(qkv, o, gate_up, down, ln1, ln2, window=0, q_norm=None, k_norm=None, attn_post=None, "
           "mlp_post=None, qk_norm='head', act='silu', softcap=0.0, rope=0, residual_scale=1.0): projections as (kind 0 gemm | "
           "1 quant_gemm | 2 int8_gemm | 3 quant_k_gemm | 4 quant_amx_gemm | 5 split (w = list of part specs), "
           "weight, int8 scale or None, qtype, N, fp32 bias or None) (csrc/proj_spec.h); "
           "ln1, ln2 (pre-attention / pre-MLP), attn_post, mlp_post (on the sublayer output before the "
           "residual add): RMSNorm weights [hidden] or None (no such norm); window: the layer's sliding "
           "window (tokens), 0 = none; q_norm, k_norm: q/k RMSNorm weights or None, per head ([head_dim], "
           "qk_norm='head') or over the whole projection ([H * head_dim] / [Hkv * head_dim], 'full'); "
           "act: the gated MLP's 'silu' or 'gelu_tanh'; softcap: attention logit soft-capping, 0 = none; "
           "rope: index of the layer's table in forward's cos_sin; residual_scale: each sublayer's output "
           "times this before its residual add (Granite's residual_multiplier), 1 = none; moe: a "
           "mixture-of-experts MLP instead of gate_up / down (both None): (router spec, MoeExperts, top_k, "
           "norm_topk_prob, weights_fp32, None or the shared expert's (gate_up, down, gate) specs) "
           "(csrc/moe.h MoeMlp: tokenserve.models.moe.MoE's bits).",
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("ln1"), py::arg("ln2"),
           py::arg("window") = 0, py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("attn_post") = py::none(), py::arg("mlp_post") = py::none(), py::arg("qk_norm") = "head",
           py::arg("act") = "silu", py::arg("softcap") = 0.0, py::arg("rope") = 0,
           py::arg("residual_scale") = 1.0, py::arg("moe") = py::none())
      .def("set_final_norm", &Decoder::set_final_norm)
      .def_property_readonly("num_layers", &Decoder::num_layers)
      // one table (every layer's) or a list of them (layer i's: cos_sin[rope_i])
      .def("forward",
           [](Decoder& d, torch::Tensor x, torch::Tensor residual, torch::Tensor positions,
              torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor query_start_loc,
              torch::Tensor context_lens, torch::Tensor cos_sin, torch::Tensor kv_region) {
             return d.forward(x, residual, positions, slot_mapping, block_tables, query_start_loc, context_lens,
                              {cos_sin}, kv_region);
           },
           tokenserve::ReleaseGil(), py::arg("x"), py::arg("residual"), py::arg("positions"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("query_start_loc"), py::arg("context_lens"),
           py::arg("cos_sin"), py::arg("kv_region"))
      .def("forward", &Decoder::forward, tokenserve::ReleaseGil(), py::arg("x"), py::arg("residual"),
           py::arg("positions"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("query_start_loc"),
           py::arg("context_lens"), py::arg("cos_sin"), py::arg("kv_region"),
           "forward(x[T,hidden], residual[T,hidden] (in place), positions int64[T], slot_mapping int64[T], "
           "block_tables int32[S,maxb], query_start_loc int32[S+1], context_lens int32[S], cos_sin: fp32 "
           "[max_pos, D] or a list of them (layer i rotates with cos_sin[rope_i]), kv_region[L,2,nb,Hkv,bs,D]) "
           "-> [T, hidden] final normed hidden states. x: the first layer's input normed by its ln1 (unused "
           "when it has none; may be residual).");
}
