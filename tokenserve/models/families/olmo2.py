"""OLMo 2.

transformers ``modeling_olmo2.py``: no norm before the sublayers; RMSNorm on each
sublayer's output before it joins the residual (``post_attention_layernorm``,
``post_feedforward_layernorm``), and RMSNorm over the whole q and k projections
(``q_norm`` ``[H * head_dim]``, ``k_norm`` ``[Hkv * head_dim]``) before RoPE.
"""

from __future__ import annotations

from typing import Any

from tokenserve.models.config import DecoderArch
from tokenserve.models.families.base import (
    Checkpoint,
    Family,
    LayerWeights,
    check_act,
    simple_arch,
    standard_layer,
)


def arch(cfg: dict[str, Any], head_dim: int) -> DecoderArch:
    """OLMo 2's blocks.

    Raises:
        ValueError: an activation other than SiLU.
    """
    check_act(cfg, "hidden_act")
    bias = bool(cfg.get("attention_bias", False))
    return simple_arch({**cfg, "sliding_window": None}, head_dim, pre_attn_norm=False,
                       post_attn_norm=True, pre_mlp_norm=False, post_mlp_norm=True,
                       qk_norm="full", qkv_bias=bias, o_bias=bias)


def layer(ck: Checkpoint, i: int, a: DecoderArch) -> LayerWeights:
    """OLMo 2's layer: the Llama layout with post-sublayer norms only."""
    return standard_layer(ck, i, a, ln1=None, attn_post="post_attention_layernorm", ln2=None,
                          mlp_post="post_feedforward_layernorm")


FAMILY = Family(arch=arch, layer=layer)
