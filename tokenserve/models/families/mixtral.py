"""Mixtral (sparse mixture of experts).

transformers ``modeling_mixtral.py``: Llama's attention (Mistral's window when set); the MLP
is ``block_sparse_moe``: a router ``gate`` ``[E, hidden]``, softmax over the experts in
fp32, the top ``num_experts_per_tok`` renormalised to sum to 1, and each chosen expert's
``w2(silu(w1 x) * w3 x)`` weighted in fp32 (Jiang et al. 2024, "Mixtral of Experts").
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


def arch(cfg: dict[str, Any], head_dim: int) -> DecoderArch:
    """Mixtral's blocks: every layer's MLP a MoE.

    Raises:
        ValueError: an activation other than SiLU.
    """
    check_act(cfg, "hidden_act")
    a = simple_arch(cfg, head_dim)
    moe = MoeArch(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                  norm_topk_prob=True, weights_fp32=True,
                  intermediate_size=int(cfg["intermediate_size"]))
    layers = tuple(LayerArch(window=la.window, moe=True) for la in a.layers)
    return DecoderArch(layers=layers, ropes=a.ropes, moe=moe)


def layer(ck: Checkpoint, i: int, a: DecoderArch) -> LayerWeights:
    """Mixtral's layer: Llama's attention, ``block_sparse_moe.experts.E.w1/w3/w2``."""
    w = standard_layer(ck, i, a)
    p = f"model.layers.{i}.block_sparse_moe."
    w.router = ck(p + "gate.weight")
    w.experts = [([ck(f"{p}experts.{e}.w1.weight"), ck(f"{p}experts.{e}.w3.weight")],
                  ck(f"{p}experts.{e}.w2.weight")) for e in range(a.moe.num_experts)]
    return w


FAMILY = Family(arch=arch, layer=layer)
