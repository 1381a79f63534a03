"""What a family module provides, and the checkpoint layout most families share.

A family is two functions (:class:`Family`): ``config.json`` -> :class:`DecoderArch`, and
(checkpoint, layer index) -> :class:`LayerWeights`, the layer's tensors by role. Most
families name their tensors as Llama does (``model.layers.N.self_attn.q_proj.weight``...);
:func:`standard_layer` reads that layout and the family passes what differs (which norms a
layer has and what they are called).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tokenserve.models.config import DecoderArch, LayerArch, config_rope

Tensor = Any  # torch.Tensor or tokenserve.ops.quant_blocks.QuantWeight


class Checkpoint(Protocol):
    """The loaded tensors by Hugging Face name (on the model's device and dtype)."""

    def __call__(self, name: str) -> Tensor:
        """The tensor ``name``. Raises KeyError when absent."""

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds ``name``."""


@dataclass
class LayerWeights:
    """One decoder layer's tensors by role, as the checkpoint stores them (not yet fused).

    Projection weights are ``[out_features, in_features]``. ``qkv`` is ``[q, k, v]`` or one
    fused ``[qkv]`` tensor (rows q | k | v), ``gate_up`` ``[gate, up]`` or one fused tensor
    (rows gate | up); the decoder concatenates parts into one GEMM.
    """

    qkv: list[Tensor]
    o: Tensor
    qkv_bias: list[torch.Tensor] | None = None
    o_bias: torch.Tensor | None = None
    ln1: torch.Tensor | None = None       # before attention
    attn_post: torch.Tensor | None = None  # on the attention output (Gemma 2/3, OLMo 2)
    ln2: torch.Tensor | None = None       # before the MLP
    mlp_post: torch.Tensor | None = None   # on the MLP output (Gemma 2/3, OLMo 2)
    q_norm: torch.Tensor | None = None    # [head_dim] ("head") or [H * head_dim] ("full")
    k_norm: torch.Tensor | None = None
    gate_up: list[Tensor] | None = None   # dense MLP
    down: Tensor | None = None
    router: Tensor | None = None          # MoE: [num_experts, hidden]
    experts: list[tuple[list[Tensor], Tensor]] = field(default_factory=list)  # ([gate, up], down)
    shared: tuple[list[Tensor], Tensor] | None = None   # Qwen2-MoE's shared expert
    shared_gate: Tensor | None = None                   # its [1, hidden] gate


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        arch: ``(config.json dict, head_dim) -> DecoderArch``; raises ValueError for a
            feature we cannot compute exactly.
        layer: ``(checkpoint, layer index, arch) -> LayerWeights``; raises KeyError for a
            missing tensor.
    """

    arch: Callable[[dict[str, Any], int], DecoderArch]
    layer: Callable[[Checkpoint, int, DecoderArch], LayerWeights]


def refuse(cfg: dict[str, Any], **unsupported: Any) -> None:
    """Raise ValueError naming the first config key whose value is one we do not compute
    (``key=predicate`` pairs: the predicate of the value is True when unsupported)."""
    for key, bad in unsupported.items():
        if bad(cfg.get(key)):
            raise ValueError(f"{cfg.get('model_type')}: {key}={cfg.get(key)!r} is not supported")


def check_act(cfg: dict[str, Any], *keys: str, allowed: tuple[str, ...] = ("silu",)) -> str:
    """The MLP activation named by the first of ``keys`` present (default ``silu``), mapped to
    the decoder's names.

    Raises:
        ValueError: an activation outside ``allowed``.
    """
    act = next((cfg[k] for k in keys if cfg.get(k)), "silu")
    names = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if act not in allowed or act not in names:
        raise ValueError(f"{cfg.get('model_type')}: hidden activation {act!r} is not supported")
    return names[act]


def layer_windows(cfg: dict[str, Any]) -> list[int]:
    """Each layer's sliding window from ``layer_types`` (``sliding_attention`` /
    ``full_attention``, transformers 5) and ``sliding_window``; without ``layer_types``,
    ``sliding_window`` on every layer when ``use_sliding_window`` is not False.

    Raises:
        ValueError: a layer type we do not serve (e.g. ``chunked_attention``).
    """
    n = int(cfg["num_hidden_layers"])
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if types is None:
        on = window > 0 and cfg.get("use_sliding_window", True) is not False
        return [window if on else 0] * n
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    out = []
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise ValueError(f"{cfg.get('model_type')}: layer type {t!r} is not supported")
        out.append(window if t == "sliding_attention" and window > 0 else 0)
    return out


def simple_arch(cfg: dict[str, Any], head_dim: int, **kw: Any) -> DecoderArch:
    """A DecoderArch with one RoPE table (:func:`config_rope`), the config's per-layer windows
    (:func:`layer_windows`) and the given block switches."""
    layers = tuple(LayerArch(window=w) for w in layer_windows(cfg))
    return DecoderArch(layers=layers, ropes=(config_rope(cfg, head_dim),), **kw)


def standard_layer(ck: Checkpoint, i: int, arch: DecoderArch, *,
                   ln1: str | None = "input_layernorm",
                   attn_post: str | None = None,
                   ln2: str | None = "post_attention_layernorm",
                   mlp_post: str | None = None) -> LayerWeights:
    """Layer ``i`` in the Llama layout: ``self_attn.{q,k,v,o}_proj`` (biases when ``arch``
    says), ``self_attn.{q,k}_norm`` when ``arch.qk_norm``, ``mlp.{gate,up,down}_proj``, and
    the norms named by the keyword arguments (None: the layer has no such norm).

    Raises:
        KeyError: a tensor the layout needs is missing.
    """
    p = f"model.layers.{i}."
    attn = p + "self_attn."

    def norm(name: str | None) -> torch.Tensor | None:
        return ck(p + name + ".weight") if name is not None else None

    w = LayerWeights(qkv=[ck(f"{attn}{n}_proj.weight") for n in "qkv"],
                     o=ck(attn + "o_proj.weight"),
                     ln1=norm(ln1), attn_post=norm(attn_post), ln2=norm(ln2),
                     mlp_post=norm(mlp_post))
    if arch.qkv_bias:
        w.qkv_bias = [ck(f"{attn}{n}_proj.bias") for n in "qkv"]
    if arch.o_bias:
        w.o_bias = ck(attn + "o_proj.bias")
    if arch.qk_norm is not None:
        w.q_norm, w.k_norm = ck(attn + "q_norm.weight"), ck(attn + "k_norm.weight")
    if not arch.layers[i].moe:
        w.gate_up = [ck(p + "mlp.gate_proj.weight"), ck(p + "mlp.up_proj.weight")]
        w.down = ck(p + "mlp.down_proj.weight")
    return w
