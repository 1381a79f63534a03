"""Phi-3 and Phi-4-mini.

transformers ``modeling_phi3.py``: Llama's layer with fused ``qkv_proj`` (rows q | k | v)
and ``gate_up_proj`` (rows gate | up), partial rotary (``partial_rotary_factor``, Phi-4-mini
0.75), ``longrope`` scaling (served with its short factors up to
``original_max_position_embeddings``: see :func:`tokenserve.models.config.max_exact_positions`),
and a ``sliding_window`` on every layer when the config has one.
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
)


def arch(cfg: dict[str, Any], head_dim: int) -> DecoderArch:
    """Phi-3's blocks.

    Raises:
        ValueError: an activation other than SiLU, an unsupported RoPE type.
    """
    check_act(cfg, "hidden_act")
    orig = cfg.get("original_max_position_embeddings")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and orig is not None:
        cfg = {**cfg, "rope_parameters": {"original_max_position_embeddings": orig, **params}}
    elif isinstance(cfg.get("rope_scaling"), dict) and orig is not None:
        cfg = {**cfg, "rope_scaling": {"original_max_position_embeddings": orig,
                                       **cfg["rope_scaling"]}}
    return simple_arch(cfg, head_dim)


def layer(ck: Checkpoint, i: int, a: DecoderArch) -> LayerWeights:
    """Phi-3's layer: fused qkv and gate|up projections."""
    p = f"model.layers.{i}."
    return LayerWeights(qkv=[ck(p + "self_attn.qkv_proj.weight")],
                        o=ck(p + "self_attn.o_proj.weight"),
                        ln1=ck(p + "input_layernorm.weight"),
                        ln2=ck(p + "post_attention_layernorm.weight"),
                        gate_up=[ck(p + "mlp.gate_up_proj.weight")],
                        down=ck(p + "mlp.down_proj.weight"))


FAMILY = Family(arch=arch, layer=layer)
