"""The sparse mixture-of-experts MLP (Shazeer et al. 2017; Mixtral, Qwen2/3-MoE).

For each token: router logits ``x @ Wr^T`` in the model dtype, softmax over the experts in
fp32, the ``top_k`` experts (ties: torch.topk's order), optionally renormalised, and the sum
of the chosen experts' SwiGLU MLPs weighted by them (transformers' ``MixtralExperts`` /
``Qwen2MoeExperts``); Qwen2-MoE adds a shared expert gated by ``sigmoid(x @ Wg^T)``.

The step's tokens are grouped by expert and each active expert runs one GEMM pair over its
tokens (no expert runs for tokens that did not choose it). Batch invariance: the GEMMs are
row-invariant (``tokenserve/ops/linear.py``), and a token's output is accumulated over its
experts in ascending expert id, each addition rounded to the model dtype, whatever other
tokens chose the same experts: its bits depend on its own row alone.

When every expert projection runs on a C++ kernel (``Linear.c_spec``), the expert loop
runs in C++ (``csrc/moe.cpp`` ``MoeExperts``: the same kernels and ops in the same order,
the same bits, the GIL released); ``MoE(..., use_c=False)`` keeps the Python loop (A/B).
"""

from __future__ import annotations

import torch

from tokenserve.models.config import MoeArch
from tokenserve.models.families.base import LayerWeights
from tokenserve.ops.dispatch import Kernels
from tokenserve.ops.linear import Linear, fused_linear, leaf_linears


class MoE:
    """One layer's experts, router and (Qwen2-MoE) shared expert.

    Args:
        arch: the model's :class:`MoeArch`.
        lw: the layer's weights (``router`` [E, hidden], ``experts`` E x ([gate, up], down),
            ``shared`` / ``shared_gate`` when the arch has a shared expert).
        dtype: the model dtype.
        use_c: run the expert loop in C++ where every expert has a c_spec (False: always
            the Python loop, for A/B tests).
    """

    def __init__(self, arch: MoeArch, lw: LayerWeights, dtype: torch.dtype, use_c: bool = True) -> None:
        assert lw.router is not None and len(lw.experts) == arch.num_experts
        self.arch = arch
        self.router = Linear(lw.router, fallback_dtype=dtype)
        self.experts = [(fused_linear(gu, None, dtype),
                         Linear(down, fallback_dtype=dtype)) for gu, down in lw.experts]
        self.shared = None
        if arch.shared_intermediate_size:
            gu, down = lw.shared
            self.shared = (fused_linear(gu, None, dtype),
                           Linear(down, fallback_dtype=dtype),
                           Linear(lw.shared_gate, fallback_dtype=dtype))
        self.use_c = use_c
        self._c_experts: object | None = None  # built at the first call with C kernels

    def linears(self) -> list[Linear]:
        """The router, every expert's gate|up and down, then the shared expert's."""
        out = [self.router] + [lin for pair in self.experts for lin in pair]
        return leaf_linears(out + list(self.shared or ()))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts each token uses and their weights.

        Args:
            x: [T, hidden] model dtype.

        Returns:
            (weights [T, top_k] fp32 or the model dtype (:attr:`MoeArch.weights_fp32`),
            expert ids [T, top_k] int64).
        """
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [T, E]
        top_w, top_i = torch.topk(probs, self.arch.top_k, dim=-1)
        if self.arch.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if not self.arch.weights_fp32:
            top_w = top_w.to(x.dtype)
        return top_w, top_i

    def __call__(self, x: torch.Tensor, ops: Kernels) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] model dtype: the weighted experts' sum (+ the shared
        expert)."""
        top_w, top_i = self.route(x)
        c_experts = self._c_moe(ops) if self.use_c else None
        if c_experts is not None:
            out = c_experts.forward(x, top_i, top_w)
        else:
            out = self._experts_py(x, top_w, top_i, ops)
        if self.shared is not None:
            gate_up, down, gate = self.shared
            s = down(ops.silu_and_mul(gate_up(x)))
            out = out + torch.sigmoid(gate(x)) * s
        return out

    def _c_moe(self, ops: Kernels) -> object | None:
        """The C++ ``MoeExperts`` over this layer's experts, or None when the kernels are off
        or an expert projection has no c_spec."""
        if ops.c is None or not hasattr(ops.c, "MoeExperts"):
            return None
        if self._c_experts is None:
            specs = [(gu.c_spec(), d.c_spec()) for gu, d in self.experts]
            if any(a is None or b is None for a, b in specs):
                self._c_experts = False
            else:
                self._c_experts = ops.c.MoeExperts([a for a, _ in specs], [b for _, b in specs])
        return self._c_experts or None

    def c_block(self, ops: Kernels) -> tuple | None:
        """This MoE MLP for ``csrc/decoder.cpp``'s fused stack (``csrc/moe.h`` ``MoeMlp``,
        the bits of :meth:`__call__`): ``(router spec, MoeExperts, top_k, norm_topk_prob,
        weights_fp32, None | (shared gate_up, down, gate specs))``, or None when the router,
        an expert or the shared expert has no C++ spec, or the kernels are off."""
        experts = self._c_moe(ops) if self.use_c else None
        router = self.router.c_spec()
        if experts is None or router is None:
            return None
        shared = None
        if self.shared is not None:
            shared = tuple(lin.c_spec() for lin in self.shared)
            if None in shared:
                return None
        return (router, experts, self.arch.top_k, self.arch.norm_topk_prob,
                self.arch.weights_fp32, shared)

    def _experts_py(self, x: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor,
                    ops: Kernels) -> torch.Tensor:
        """The routed experts' weighted sum in Python: [T, hidden] model dtype."""
        out = torch.zeros_like(x)
        for e in torch.unique(top_i).tolist():  # ascending expert id
            tok, slot = torch.where(top_i == e)  # each token at most once per expert
            gate_up, down = self.experts[e]
            y = down(ops.silu_and_mul(gate_up(x[tok])))
            out.index_add_(0, tok, (y * top_w[tok, slot, None]).to(x.dtype))
        return out
