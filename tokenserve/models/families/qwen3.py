"""Qwen3 (dense).

transformers ``modeling_qwen3.py``: Llama's layer plus a per-head RMSNorm on q and k
(``q_norm`` / ``k_norm``, weight ``[head_dim]``) before RoPE; ``attention_bias`` (q, k, v and
o) off in released models; sliding windows as Qwen2.
"""

from __future__ import annotations

from typing import Any

from tokenserve.models.config import DecoderArch
from tokenserve.models.families.base import Family, check_act, simple_arch, standard_layer
from tokenserve.models.families.qwen2 import qwen_layer_types


def arch(cfg: dict[str, Any], head_dim: int) -> DecoderArch:
    """Qwen3's blocks.

    Raises:
        ValueError: an activation other than SiLU.
    """
    check_act(cfg, "hidden_act")
    bias = bool(cfg.get("attention_bias", False))
    return simple_arch(qwen_layer_types(cfg), head_dim, qk_norm="head", qkv_bias=bias,
                       o_bias=bias)


FAMILY = Family(arch=arch, layer=standard_layer)
