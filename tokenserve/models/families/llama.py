"""Llama (1, 2, 3.x; SmolLM2) and Mistral.

transformers ``modeling_llama.py`` / ``modeling_mistral.py``: pre-norm RMSNorm layers,
rotate-half RoPE (``default``, ``linear`` or ``llama3`` scaling), SiLU-gated MLP, GQA.
``attention_bias`` puts biases on all four attention projections (q, k, v and o).
Mistral's ``sliding_window`` applies to every layer (Mistral-7B-v0.1: 4096 tokens).
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
    """Llama's blocks; Mistral's window on every layer.

    Raises:
        ValueError: ``mlp_bias``, an activation other than SiLU, a window on a Llama config.
    """
    refuse(cfg, mlp_bias=bool)
    check_act(cfg, "hidden_act")
    if cfg["model_type"] == "llama":
        cfg = {**cfg, "sliding_window": None}  # LlamaConfig has no window
    bias = bool(cfg.get("attention_bias", False))
    return simple_arch(cfg, head_dim, qkv_bias=bias, o_bias=bias)


FAMILY = Family(arch=arch, layer=standard_layer)
