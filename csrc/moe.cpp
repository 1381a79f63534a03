// The routed experts of a mixture-of-experts MLP (tokenserve.models.moe.MoE.__call__) in
// one call: the Python loop costs two GEMM calls, a gather, SiLU and an index_add_ per
// active expert (~4 x 128 interpreter round trips per layer for Qwen3-30B-A3B). MoeMlp
// (csrc/moe.h) adds the router, top-k and shared expert around it for the fused layer
// stack (csrc/decoder.cpp).
//
// MoeExperts holds every expert's (gate|up, down) projection specs once. forward():
//
//     for e in ascending expert id with tokens:         tok, slot = where(ids == e)
//         y = down_e(silu_and_mul(gate_up_e(x[tok])))   [n_e, hidden] model dtype
//         out.index_add_(0, tok, (y * w[tok, slot, None]).to(x.dtype))
//
// the same kernels and ATen ops in the same order as the Python loop, so the bits are
// the Python path's (tests/unit/test_moe.py). Batch invariance: the GEMMs are row-
// invariant and a token's experts are added in ascending id, one rounding each.
//
// Decode-sized calls (every active expert with at most parallel_rows tokens, and at least
// as many active experts as threads, so no core idles) run the experts side by side
// instead: one parallel region over the active experts (taken in turn from per-thread
// ranges, csrc/parallel.h), each expert's GEMMs serial on the thread that
// took it (a nested at::parallel_for runs inline), its weighted output kept, then the
// index_add_ in ascending id as above. The kernels' bits do not depend on the thread split,
// so the result is the same. Why: at one token a Qwen3-30B-A3B layer's 8 experts are 16
// small GEMVs, each its own parallel region with a barrier and ~7 ATen calls around it; the
// OpenMP worker spent ~0.4 as long spinning as in the tiles (perf, batch 1).
#include "moe.h"

#include <ATen/ThreadLocalState.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <vector>

#include "parallel.h"

namespace tokenserve {

MoeExperts::MoeExperts(pybind11::list gate_up, pybind11::list down, int64_t parallel_rows)
    : parallel_rows_(parallel_rows) {
  TORCH_CHECK(gate_up.size() == down.size() && gate_up.size() > 0, "MoeExperts: one gate_up and down per expert");
  TORCH_CHECK(parallel_rows >= 0, "MoeExperts: parallel_rows must be >= 0");
  for (size_t e = 0; e < gate_up.size(); ++e) {
    gate_up_.push_back(ProjSpec::parse(gate_up[e], "MoeExperts"));
    down_.push_back(ProjSpec::parse(down[e], "MoeExperts"));
  }
}

torch::Tensor MoeExperts::forward(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights) const {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && ids.size(0) == x.size(0) && weights.sizes() == ids.sizes(),
              "moe_experts: x [T, hidden], ids and weights [T, k]");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64, "moe_experts: ids must be int64");
  const int64_t T = ids.size(0), k = ids.size(1), E = num_experts();
  const torch::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  // Counting sort by expert id; within an expert, tokens ascending (torch.where's order).
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < E, "moe_experts: expert id ", id[i], " out of range");
    ++count[id[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  std::vector<int64_t> tok(T * k), flat(T * k), fill(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t p = fill[id[i]]++;
    tok[p] = i / k;
    flat[p] = i;
  }
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  const torch::Tensor tok_t = torch::from_blob(tok.data(), {T * k}, i64);
  const torch::Tensor flat_t = torch::from_blob(flat.data(), {T * k}, i64);
  const torch::Tensor wflat = weights.reshape({T * k});
  torch::Tensor out = torch::zeros_like(x);
  // expert e's tokens (ascending) and its weighted output [n_e, hidden] in x's dtype (the
  // Python loop's operand)
  auto tokens = [&](int64_t e) { return tok_t.narrow(0, count[e], count[e + 1] - count[e]); };
  // An expert every token chose (n == T: its tokens are 0..T-1; every expert at one token)
  // reads x itself and adds into out elementwise; the others' rows are gathered, added and
  // put back (an expert has each token at most once). The same values and roundings as the
  // Python loop's gather and index_add_, whose CPU kernel sorts the expanded index (a
  // Qwen3-30B-A3B-shaped Q4_K layer call 5-7 % faster at one row and at 16 rows that chose
  // the same experts, 1-3 % at 16-64 rows routed at random: bench/README.md "MoE layers in
  // the fused stack").
  auto everyone = [&](int64_t e) { return count[e + 1] - count[e] == T; };
  auto expert = [&](int64_t e) {
    const int64_t n = count[e + 1] - count[e];
    torch::Tensor y = gated_mlp(gate_up_[e], down_[e], everyone(e) ? x : x.index_select(0, tokens(e)));  // [n, hidden]
    // (y * w).to(x.dtype) in place: the product in the promoted dtype, then rounded to y's
    return y.mul_(wflat.index_select(0, flat_t.narrow(0, count[e], n)).unsqueeze(1));
  };
  auto add = [&](int64_t e, const torch::Tensor& yw) {
    if (everyone(e)) {
      out.add_(yw);
    } else {
      const torch::Tensor t = tokens(e);
      out.index_copy_(0, t, out.index_select(0, t).add_(yw));
    }
  };
  std::vector<int64_t> active;
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e)
    if (const int64_t n = count[e + 1] - count[e]; n > 0) active.push_back(e), most = std::max(most, n);
  const int64_t A = int64_t(active.size());
  const int64_t threads = at::get_num_threads();
  if (threads > 1 && A >= threads && most <= parallel_rows_) {
    std::vector<torch::Tensor> ys(static_cast<size_t>(A));
    const at::ThreadLocalState tls;  // the caller's inference / grad mode, for the workers' ATen ops
    parallel_units(A, threads, [&](int64_t i) {
      const at::ThreadLocalStateGuard guard(tls);
      ys[size_t(i)] = expert(active[size_t(i)]);
    });
    for (int64_t i = 0; i < A; ++i) add(active[size_t(i)], ys[size_t(i)]);
    return out;
  }
  for (const int64_t e : active) add(e, expert(e));
  return out;
}

MoeMlp MoeMlp::parse(const pybind11::handle& h, const char* who) {
  const auto t = pybind11::reinterpret_borrow<pybind11::tuple>(h);
  TORCH_CHECK(t.size() == 6, who, ": a MoE block is (router, experts, top_k, norm_topk_prob, weights_fp32, shared)");
  MoeMlp m;
  m.router = ProjSpec::parse(t[0], who);
  m.experts = t[1].cast<std::shared_ptr<MoeExperts>>();
  m.top_k = t[2].cast<int64_t>();
  m.norm_topk_prob = t[3].cast<bool>();
  m.weights_fp32 = t[4].cast<bool>();
  TORCH_CHECK(m.experts && m.top_k >= 1 && m.top_k <= m.experts->num_experts() && m.router.N == m.experts->num_experts(),
              who, ": top_k must be in [1, num_experts] and the router must have one output per expert");
  if (!t[5].is_none()) {
    const auto sh = t[5].cast<pybind11::tuple>();
    TORCH_CHECK(sh.size() == 3, who, ": the shared expert is (gate_up, down, gate)");
    m.shared_gate_up = ProjSpec::parse(sh[0], who);
    m.shared_down = ProjSpec::parse(sh[1], who);
    m.shared_gate = ProjSpec::parse(sh[2], who);
  }
  return m;
}

torch::Tensor MoeMlp::operator()(const torch::Tensor& x) const {
  const torch::Tensor probs = at::softmax(router(x).to(at::kFloat), -1);
  auto [w, ids] = at::topk(probs, top_k, -1);
  if (norm_topk_prob) w = w / w.sum(-1, true);
  if (!weights_fp32) w = w.to(x.scalar_type());
  torch::Tensor out = experts->forward(x, ids, w);
  if (shared_gate_up) out = out + at::sigmoid((*shared_gate)(x)) * gated_mlp(*shared_gate_up, *shared_down, x);
  return out;
}

}  // namespace tokenserve

TOKENSERVE_REGISTER(moe) {
  pybind11::class_<tokenserve::MoeExperts, std::shared_ptr<tokenserve::MoeExperts>>(m, "MoeExperts",
      "MoeExperts(gate_up_specs, down_specs, parallel_rows=32): one MoE layer's routed experts (csrc/moe.cpp), "
      "each a Linear.c_spec() tuple; bit-identical to tokenserve.models.moe.MoE's Python expert loop. The experts "
      "run side by side (one thread each) when none has more than parallel_rows tokens (0: never) and at least "
      "as many experts as threads are active.")
      .def(pybind11::init<pybind11::list, pybind11::list, int64_t>(), pybind11::arg("gate_up"), pybind11::arg("down"),
           pybind11::arg("parallel_rows") = 32)
      .def_property_readonly("num_experts", &tokenserve::MoeExperts::num_experts)
      .def("forward", &tokenserve::MoeExperts::forward, tokenserve::ReleaseGil(), pybind11::arg("x"),
           pybind11::arg("ids"), pybind11::arg("weights"),
           "forward(x[T,hidden], ids int64[T,k], weights[T,k] fp32 or model dtype) -> [T,hidden] model dtype.");
}
