"""Gemma, Gemma 2 and Gemma 3 (text).

transformers ``modeling_gemma.py``, ``modeling_gemma2.py``, ``modeling_gemma3.py``:

- every RMSNorm multiplies by ``1 + w`` (folded into the weight at load);
- embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model dtype;
- the MLP is ``gelu_pytorch_tanh(gate) * up`` (Gemma 1 may name exact ``gelu``);
- Gemma 2 and 3: "sandwich" norms (``input_layernorm`` and ``post_attention_layernorm``
  around attention, ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` around
  the MLP), softmax scale ``query_pre_attn_scalar ** -0.5``, sliding windows on the layers
  ``layer_types`` marks (every other layer in Gemma 2, five of six in Gemma 3);
- Gemma 2: attention and final logit soft-capping;
- Gemma 3: per-head q/k RMSNorm, and the local (sliding) layers rotate with their own
  base (``rope_parameters["sliding_attention"]``; older configs ``rope_local_base_freq``).
"""

from __future__ import annotations

from typing import Any

from tokenserve.models.config import DecoderArch, LayerArch, RopeSpec, rope_params, rotary_dim
from tokenserve.models.families.base import (
    Checkpoint,
    Family,
    LayerWeights,
    check_act,
    layer_windows,
    refuse,
    standard_layer,
)

_ACTS = ("gelu_pytorch_tanh", "gelu")


def _ropes(cfg: dict[str, Any], head_dim: int) -> tuple[RopeSpec, RopeSpec]:
    """(global, local) RoPE tables of Gemma 3."""
    dim = rotary_dim(head_dim, float(cfg.get("partial_rotary_factor", 1.0)))
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = rope_params(params["full_attention"])
        local = rope_params(params.get("sliding_attention") or params["full_attention"])
    else:
        full_params = dict(cfg.get("rope_scaling") or {})
        full_params.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        full = rope_params(full_params)
        local = rope_params({"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)})
    return RopeSpec(*full, dim), RopeSpec(*local, dim)


def arch(cfg: dict[str, Any], head_dim: int) -> DecoderArch:
    """The blocks of Gemma (1), Gemma 2 or Gemma 3.

    Raises:
        ValueError: bidirectional attention (embedding models), an activation other than
            tanh-approximated or exact GELU.
    """
    refuse(cfg, use_bidirectional_attention=bool)
    model_type = cfg["model_type"]
    act = check_act(cfg, "hidden_activation", "hidden_act", allowed=_ACTS)
    common = dict(norm_offset=True, act=act, embed_scale=float(cfg["hidden_size"]) ** 0.5,
                  embed_scale_rounded=True, qkv_bias=bool(cfg.get("attention_bias", False)),
                  o_bias=bool(cfg.get("attention_bias", False)))
    if model_type == "gemma":
        from tokenserve.models.config import config_rope
        layers = tuple(LayerArch() for _ in range(int(cfg["num_hidden_layers"])))
        return DecoderArch(layers=layers, ropes=(config_rope(cfg, head_dim),), **common)
    windows = layer_windows(cfg)
    scale = float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5
    sandwich = dict(post_attn_norm=True, post_mlp_norm=True, attn_scale=scale)
    if model_type == "gemma2":
        from tokenserve.models.config import config_rope
        layers = tuple(LayerArch(window=w) for w in windows)
        return DecoderArch(layers=layers, ropes=(config_rope(cfg, head_dim),), **common,
                           **sandwich,
                           attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
                           final_softcap=float(cfg.get("final_logit_softcapping") or 0.0))
    layers = tuple(LayerArch(window=w, rope=1 if w else 0) for w in windows)
    return DecoderArch(layers=layers, ropes=_ropes(cfg, head_dim), **common, **sandwich,
                       qk_norm="head",
                       attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
                       final_softcap=float(cfg.get("final_logit_softcapping") or 0.0))


def layer(ck: Checkpoint, i: int, a: DecoderArch) -> LayerWeights:
    """Gemma's layer: the Llama layout (Gemma 1) or with the four sandwich norms."""
    if not a.post_attn_norm:
        return standard_layer(ck, i, a)
    return standard_layer(ck, i, a, attn_post="post_attention_layernorm",
                          ln2="pre_feedforward_layernorm", mlp_post="post_feedforward_layernorm")


FAMILY = Family(arch=arch, layer=layer)
