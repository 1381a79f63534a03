"""Qwen2-MoE and Qwen3-MoE.

transformers ``modeling_qwen2_moe.py`` / ``modeling_qwen3_moe.py``: the layers named by
``decoder_sparse_step`` and not in ``mlp_only_layers`` have a MoE MLP: router ``mlp.gate``
``[E, hidden]``, softmax in fp32, top ``num_experts_per_tok`` (renormalised when
``norm_topk_prob``), weights rounded to the model dtype, experts
``mlp.experts.E.{gate,up,down}_proj``. Qwen2-MoE adds an always-on shared expert
(``mlp.shared_expert``) scaled by ``sigmoid(mlp.shared_expert_gate(x))``; Qwen2-MoE has
q/k/v biases, Qwen3-MoE per-head q/k RMSNorm instead.
"""

from __future__ import annotations

from typing import Any

from tokenserve.models.config import DecoderArch, LayerArch, MoeArch
from tokenserve.models.families.base import (
    Checkpoint,
    Family,
    LayerWeights,
    check_act,
    simple_arch,
    standard_layer,
)
from tokenserve.models.families.qwen2 import qwen_layer_types


def arch(cfg: dict[str, Any], head_dim: int) -> DecoderArch:
    """Qwen-MoE's blocks.

    Raises:
        ValueError: an activation other than SiLU.
    """
    check_act(cfg, "hidden_act")
    qwen3 = cfg["model_type"] == "qwen3_moe"
    bias = bool(cfg.get("attention_bias", False)) if qwen3 else bool(cfg.get("qkv_bias", True))
    a = simple_arch(qwen_layer_types(cfg), head_dim, qk_norm="head" if qwen3 else None,
                    qkv_bias=bias, o_bias=bias and qwen3)
    n_exp = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    moe = MoeArch(num_experts=n_exp, top_k=int(cfg["num_experts_per_tok"]),
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), weights_fp32=False,
                  intermediate_size=int(cfg["moe_intermediate_size"]),
                  shared_intermediate_size=0 if qwen3 else int(
                      cfg.get("shared_expert_intermediate_size") or 0))
    layers = tuple(LayerArch(window=la.window,
                             moe=n_exp > 0 and i not in dense_only and (i + 1) % step == 0)
                   for i, la in enumerate(a.layers))
    return DecoderArch(layers=layers, ropes=a.ropes, qk_norm=a.qk_norm, qkv_bias=a.qkv_bias,
                       o_bias=a.o_bias, moe=moe)


def layer(ck: Checkpoint, i: int, a: DecoderArch) -> LayerWeights:
    """Qwen-MoE's layer: Llama's layout, ``mlp.gate`` / ``mlp.experts.E`` on MoE layers."""
    w = standard_layer(ck, i, a)
    if not a.layers[i].moe:
        return w
    p = f"model.layers.{i}.mlp."
    w.router = ck(p + "gate.weight")
    w.experts = [([ck(f"{p}experts.{e}.gate_proj.weight"), ck(f"{p}experts.{e}.up_proj.weight")],
                  ck(f"{p}experts.{e}.down_proj.weight")) for e in range(a.moe.num_experts)]
    if a.moe.shared_intermediate_size:
        s = p + "shared_expert."
        w.shared = ([ck(s + "gate_proj.weight"), ck(s + "up_proj.weight")],
                    ck(s + "down_proj.weight"))
        w.shared_gate = ck(p + "shared_expert_gate.weight")
    return w


FAMILY = Family(arch=arch, layer=layer)
