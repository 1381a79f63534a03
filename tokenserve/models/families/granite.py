"""IBM Granite 3.x (dense).

transformers ``modeling_granite.py``: Llama's layer with four scalars: embeddings times
``embedding_multiplier``, softmax scale ``attention_multiplier`` (instead of
``head_dim ** -0.5``), each sublayer's output times ``residual_multiplier`` before the
residual add, logits divided by ``logits_scaling``.
"""

from __future__ import annotations

from typing import Any

from tokenserve.models.config import DecoderArch
from tokenserve.models.families.base import (
    Family,
    check_act,
    refuse,
    simple_arch,
    standard_layer,
)


def arch(cfg: dict[str, Any], head_dim: int) -> DecoderArch:
    """Granite's blocks.

    Raises:
        ValueError: ``mlp_bias`` or an activation other than SiLU.
    """
    refuse(cfg, mlp_bias=bool)
    check_act(cfg, "hidden_act")
    bias = bool(cfg.get("attention_bias", False))
    return simple_arch({**cfg, "sliding_window": None}, head_dim, qkv_bias=bias, o_bias=bias,
                       embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
                       attn_scale=float(cfg.get("attention_multiplier", head_dim ** -0.5)),
                       residual_scale=float(cfg.get("residual_multiplier", 1.0)),
                       logits_divisor=float(cfg.get("logits_scaling", 1.0)))


FAMILY = Family(arch=arch, layer=standard_layer)
