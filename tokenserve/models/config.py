"""A model's configuration: the hyper-parameters every family shares (:class:`ModelConfig`)
and the switches of the shared decoder blocks a family turns on (:class:`DecoderArch`).

:func:`tokenserve.models.loader.load_config` reads a model directory into a
:class:`ModelConfig`. ``config.json`` keys follow transformers' configuration classes (``LlamaConfig``,
``Qwen3Config``, ``Gemma3TextConfig``, ``MixtralConfig``...); each family file in
:mod:`tokenserve.models.families` reads its own keys into a :class:`DecoderArch`, so the
decoder (:mod:`tokenserve.models.decoder`) never branches on a family's name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    """One rotary-embedding table (Su et al., RoFormer; rotate-half pairing as transformers).

    Attributes:
        theta: the base.
        scaling: None, or ``rope_type`` ``linear`` / ``llama3`` / ``longrope`` with its
            parameters (transformers' ``rope_parameters``); see :func:`rope_inv_freq`.
        rotary_dim: dimensions of a head that rotate (the first ``rotary_dim``; the rest pass
            through): ``head_dim * partial_rotary_factor``.
    """

    theta: float
    scaling: dict[str, Any] | None
    rotary_dim: int


@dataclass(frozen=True)
class LayerArch:
    """One decoder layer's own settings.

    Attributes:
        window: sliding-window length in tokens (a query at position p sees keys
            ``p - window + 1 .. p``; transformers' ``sliding_window``), 0 = full attention.
        rope: index into :attr:`DecoderArch.ropes` (Gemma 3's local and global layers rotate
            with different bases).
        moe: the MLP is a mixture of experts (:class:`MoeArch`), else dense.
    """

    window: int = 0
    rope: int = 0
    moe: bool = False


@dataclass(frozen=True)
class MoeArch:
    """A sparse mixture-of-experts MLP (Shazeer et al. 2017; Mixtral, Qwen-MoE).

    Attributes:
        num_experts: experts per MoE layer.
        top_k: experts each token uses.
        norm_topk_prob: the top-k softmax probabilities are renormalised to sum to 1
            (Mixtral always; Qwen when ``norm_topk_prob``).
        weights_fp32: the routing weights multiply the expert output in fp32 (Mixtral);
            False: rounded to the model dtype first (Qwen2/3-MoE).
        intermediate_size: one expert's MLP width.
        shared_intermediate_size: Qwen2-MoE's always-on shared expert (its output scaled by
            ``sigmoid(shared_expert_gate(x))``), 0 = none.
    """

    num_experts: int
    top_k: int
    norm_topk_prob: bool
    weights_fp32: bool
    intermediate_size: int
    shared_intermediate_size: int = 0


@dataclass(frozen=True)
class DecoderArch:
    """Which shared blocks a decoder uses; the defaults are Llama's.

    A layer is::

        x = ln1(h)            if pre_attn_norm    (else x = h)
        a = o(attention(qkv(x)))                  q/k RMSNorm before RoPE if qk_norm
        a = attn_post(a)      if post_attn_norm
        h = h + residual_scale * a
        x = ln2(h)            if pre_mlp_norm
        m = mlp(x)            dense (act(gate) * up) @ down, or the MoE
        m = mlp_post(m)       if post_mlp_norm
        h = h + residual_scale * m

    Attributes:
        layers: one :class:`LayerArch` per decoder layer.
        ropes: the RoPE tables layers refer to.
        norm_offset: RMSNorm multiplies by ``1 + w`` (Gemma; folded into the weight at load).
        pre_attn_norm, post_attn_norm, pre_mlp_norm, post_mlp_norm: the norms around the two
            sublayers (Gemma 2/3 use all four, OLMo 2 only the post ones).
        qk_norm: ``"head"``: RMSNorm over each head's ``head_dim`` (Qwen3, Gemma 3);
            ``"full"``: over the whole q / k projection (OLMo 2); None.
        qkv_bias, o_bias: projection biases.
        act: ``"silu"``, ``"gelu_tanh"`` (Gemma's ``gelu_pytorch_tanh``) or ``"gelu"`` (exact).
        embed_scale: embeddings are multiplied by this (Gemma: sqrt(hidden); Granite's
            ``embedding_multiplier``).
        embed_scale_rounded: the scale is rounded to the model dtype first (Gemma's
            ``normalizer``).
        attn_scale: softmax scale; None = ``head_dim ** -0.5`` (Gemma: ``query_pre_attn_scalar
            ** -0.5``, Granite: ``attention_multiplier``).
        attn_softcap: attention logit soft-capping ``c * tanh(s / c)`` (Gemma 2), 0 = none.
        final_softcap: the same on the output logits (Gemma 2), 0 = none.
        residual_scale: Granite's ``residual_multiplier``.
        logits_divisor: logits are divided by this (Granite's ``logits_scaling``).
        moe: the experts of layers with ``LayerArch.moe``.
    """

    layers: tuple[LayerArch, ...]
    ropes: tuple[RopeSpec, ...]
    norm_offset: bool = False
    pre_attn_norm: bool = True
    post_attn_norm: bool = False
    pre_mlp_norm: bool = True
    post_mlp_norm: bool = False
    qk_norm: str | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    act: str = "silu"
    embed_scale: float = 1.0
    embed_scale_rounded: bool = False
    attn_scale: float | None = None
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    residual_scale: float = 1.0
    logits_divisor: float = 1.0
    moe: MoeArch | None = None

    def __post_init__(self) -> None:
        assert self.qk_norm in (None, "head", "full"), self.qk_norm
        assert self.act in ("silu", "gelu_tanh", "gelu"), self.act
        assert all(0 <= layer.rope < len(self.ropes) for layer in self.layers)
        assert self.moe is not None or not any(layer.moe for layer in self.layers)

    @property
    def llama_layers(self) -> bool:
        """Every layer is a plain pre-norm Llama layer (RMSNorm, SiLU MLP, optional q/k/v/o
        biases, optional per-head q/k RMSNorm (Qwen3), optional sliding window, one RoPE
        table): the Python loop's Llama path (``CausalLM.forward``); ``csrc/decoder.cpp``'s
        fused stack computes more (:attr:`fused_layers`)."""
        return (not self.norm_offset and self.pre_attn_norm and self.pre_mlp_norm
                and not self.post_attn_norm and not self.post_mlp_norm
                and self.qk_norm in (None, "head") and self.act == "silu"
                and self.attn_softcap == 0.0
                and self.residual_scale == 1.0 and self.moe is None
                and all(r.rotary_dim == self.ropes[0].rotary_dim for r in self.ropes)
                and all(layer.rope == 0 for layer in self.layers))

    @property
    def fused_layers(self) -> bool:
        """Every layer is one ``csrc/decoder.cpp``'s fused stack computes: a dense MLP with
        SiLU or tanh-GELU or a mixture-of-experts MLP with SiLU (``csrc/moe.h`` ``MoeMlp``),
        any of the four norms (Gemma 2/3's sandwich, OLMo 2's post norms alone), q/k RMSNorm
        per head or over the whole projection, biases, sliding windows, attention
        soft-capping, a RoPE table per layer, residual scaling (Granite). (The decoder also
        needs every table to rotate whole heads: ``CausalLM._build_decoder``.)"""
        return self.act == "silu" or (self.moe is None and self.act == "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters every served decoder has.

    Attributes:
        name: ``tokenserve_name`` from config.json (set by the GGUF converter to the file's
            stem, e.g. ``SmolLM2-135M-Instruct.Q4_1``), else the directory's basename.
        model_type: config.json's ``model_type`` (a key of the family registry).
        vocab_size: rows of the embedding / logits width.
        hidden_size, intermediate_size: model and (dense) MLP widths.
        num_layers, num_heads, num_kv_heads, head_dim: decoder depth and attention shape
            (``num_heads % num_kv_heads == 0``; GQA when unequal).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta, rope_scaling: the first RoPE table's base and scaling (``arch.ropes[0]``).
        max_position_embeddings: context length (tokens).
        tie_word_embeddings: the LM head reuses ``model.embed_tokens.weight``.
        attention_bias: q/k/v projections carry biases.
        sliding_window: the longest attention window of any layer, None when no layer has one.
        bos_token_id: BOS id or None.
        eos_token_ids: every id that ends generation: config.json's ``eos_token_id`` then
            generation_config.json's, de-duplicated.
        torch_dtype: dtype the checkpoint was saved in (``"float32"``, ``"bfloat16"``...).
        arch: the decoder's blocks (None: Llama's, :func:`llama_arch`).
    """

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    arch: DecoderArch | None = field(default=None, compare=False)

    @property
    def decoder_arch(self) -> DecoderArch:
        """:attr:`arch`, or Llama's blocks for a config built without one."""
        return self.arch if self.arch is not None else llama_arch(self)

    @classmethod
    def from_json(cls, name: str, cfg: dict[str, Any], gen: dict[str, Any],
                  arch_of: Callable[[dict[str, Any], int], DecoderArch]) -> ModelConfig:
        """Build from a parsed ``config.json`` and ``generation_config.json``; ``arch_of`` is
        the family's ``(config, head_dim) -> DecoderArch`` (``tokenserve.models.loader.
        load_config`` looks the family up).

        Raises:
            ValueError: inconsistent head counts, or what ``arch_of`` refuses.
        """
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        arch = arch_of(cfg, head_dim)
        eos: list[int] = []
        for source in (cfg, gen):
            value = source.get("eos_token_id")
            eos.extend([value] if isinstance(value, int) else (value or []))
        bos = cfg.get("bos_token_id", gen.get("bos_token_id"))
        windows = [layer.window for layer in arch.layers if layer.window]
        rope = arch.ropes[0]
        return cls(
            name=str(cfg.get("tokenserve_name") or name),
            model_type=str(cfg["model_type"]),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch.qkv_bias,
            sliding_window=max(windows) if windows else None,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            arch=arch,
        )


def llama_arch(cfg: ModelConfig) -> DecoderArch:
    """Llama's blocks for a :class:`ModelConfig` built by hand (tests, tools)."""
    rope = RopeSpec(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim)
    window = cfg.sliding_window or 0
    return DecoderArch(layers=tuple(LayerArch(window=window) for _ in range(cfg.num_layers)),
                       ropes=(rope,), qkv_bias=cfg.attention_bias)


def rope_params(params: dict[str, Any] | None, fallback_theta: float = 10000.0,
                ) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from one transformers ``rope_parameters`` / ``rope_scaling`` dict;
    ``type`` is normalised to ``rope_type``; ``default`` gives None.

    Raises:
        ValueError: a RoPE type outside :data:`SUPPORTED_ROPE_TYPES`.
    """
    scaling = dict(params or {})
    theta = float(scaling.pop("rope_theta", fallback_theta))
    rope_type = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    scaling.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling


def config_rope(cfg: dict[str, Any], head_dim: int) -> RopeSpec:
    """The one RoPE table of a config.json with the classic keys (``rope_theta``,
    ``rope_scaling``, ``partial_rotary_factor``) or transformers 5's ``rope_parameters``."""
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    theta, scaling = rope_params(params)
    return RopeSpec(theta, scaling, rotary_dim(head_dim, factor))


def rotary_dim(head_dim: int, factor: float) -> int:
    """Rotated dimensions of a head: ``int(head_dim * factor)``, even.

    Raises:
        ValueError: a factor that leaves an odd or empty rotated part.
    """
    dim = int(head_dim * factor)
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotated dims of {head_dim}")
    return dim


def rope_inv_freq(cfg: ModelConfig | RopeSpec) -> torch.Tensor:
    """RoPE inverse frequencies, one per rotated pair.

    ``default``: ``theta ** (-2i / rotary_dim)`` (Su et al., RoFormer). ``linear``: divided by
    ``factor`` (position interpolation). ``llama3``: Meta's Llama 3.1 rule, as in
    transformers' ``_compute_llama3_parameters``: wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those
    shorter than ``... / high_freq_factor`` are kept, and the band between is interpolated.
    ``longrope`` (Phi-3): divided by ``short_factor`` (the table for contexts up to
    ``original_max_position_embeddings``; the engine caps the context there, see
    :func:`max_exact_positions`), the cos/sin scaled by the attention factor
    (:func:`rope_attention_factor`).

    Args:
        cfg: a :class:`RopeSpec`, or a :class:`ModelConfig` (its first table, full head).

    Returns:
        float32 tensor ``[rotary_dim // 2]`` (radians per position).

    Raises:
        ValueError: an unsupported ``rope_type`` or missing scaling parameter.
    """
    if isinstance(cfg, ModelConfig):
        cfg = RopeSpec(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim)
    dim = cfg.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (cfg.theta**exponents)
    scaling = cfg.scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type")
    try:
        if rope_type == "linear":
            return inv_freq / float(scaling["factor"])
        if rope_type == "longrope":
            short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
            if short.numel() != dim // 2:
                raise ValueError(f"longrope short_factor has {short.numel()} values, "
                                 f"need {dim // 2}")
            return 1.0 / (short * cfg.theta**exponents)
        if rope_type == "llama3":
            factor = float(scaling["factor"])
            low = float(scaling["low_freq_factor"])
            high = float(scaling["high_freq_factor"])
            old_ctx = float(scaling["original_max_position_embeddings"])
        else:
            raise ValueError(f"unsupported RoPE type {rope_type!r}")
    except KeyError as e:
        raise ValueError(f"rope_scaling {rope_type!r} lacks {e.args[0]!r}") from None
    wavelen = 2 * math.pi / inv_freq
    # 0 for long wavelengths (fully scaled), 1 for short ones (kept), linear ramp between.
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_attention_factor(spec: RopeSpec, max_position_embeddings: int) -> float:
    """The factor transformers multiplies cos and sin by (``attention_scaling``): 1 except for
    ``longrope``, where it is ``attention_factor`` or ``sqrt(1 + ln(s) / ln(orig))`` with
    ``s = max_position_embeddings / original_max_position_embeddings``."""
    scaling = spec.scaling or {}
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    orig = float(scaling["original_max_position_embeddings"])
    s = max_position_embeddings / orig
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(orig))


def max_exact_positions(cfg: ModelConfig) -> int:
    """Positions this server computes exactly: ``max_position_embeddings``, or a longrope
    model's ``original_max_position_embeddings`` (past it transformers switches to the long
    factors, which would change every cached key's rotation)."""
    limits = [cfg.max_position_embeddings]
    arch = getattr(cfg, "arch", None)  # None: a hand-built config (Llama's single table)
    for spec in arch.ropes if arch is not None else ():
        scaling = spec.scaling or {}
        if scaling.get("rope_type") == "longrope":
            limits.append(int(scaling["original_max_position_embeddings"]))
    return min(limits)


def kv_window(cfg: ModelConfig) -> int:
    """Tokens of KV cache a running request needs: the largest sliding window when every
    layer has one (Mistral), else 0 (all of it: a full-attention layer, as Gemma 2/3's
    global ones, reads the whole context). A config without ``arch`` (a test's fake) has
    none."""
    arch = getattr(cfg, "arch", None)
    if arch is None or not arch.layers or any(layer.window == 0 for layer in arch.layers):
        return 0
    return max(layer.window for layer in arch.layers)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when the file does not exist."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
