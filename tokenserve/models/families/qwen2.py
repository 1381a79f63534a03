"""Qwen2 and Qwen2.5.

transformers ``modeling_qwen2.py``: Llama's layer with biases on q, k and v (not o). With
``use_sliding_window`` the layers from ``max_window_layers`` on attend through a
``sliding_window`` (transformers 5 writes this as ``layer_types``).
"""

from __future__ import annotations

from typing import Any

from tokenserve.models.config import DecoderArch
from tokenserve.models.families.base import Family, check_act, simple_arch, standard_layer


def qwen_layer_types(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with ``layer_types`` filled in as transformers' Qwen2/Qwen3 configs derive it
    (``sliding_attention`` from ``max_window_layers`` on when ``use_sliding_window``)."""
    if cfg.get("layer_types") is not None:
        return cfg
    n = int(cfg["num_hidden_layers"])
    first = int(cfg.get("max_window_layers", n))
    on = bool(cfg.get("use_sliding_window")) and bool(cfg.get("sliding_window"))
    return {**cfg, "layer_types": ["sliding_attention" if on and i >= first else "full_attention"
                                   for i in range(n)]}


def arch(cfg: dict[str, Any], head_dim: int) -> DecoderArch:
    """Qwen2's blocks.

    Raises:
        ValueError: an activation other than SiLU.
    """
    check_act(cfg, "hidden_act")
    return simple_arch(qwen_layer_types(cfg), head_dim, qkv_bias=True)


FAMILY = Family(arch=arch, layer=standard_layer)
