"""How each GGUF ``general.architecture`` maps back to a Hugging Face model: its
``config.json`` keys, its tensor names, and what llama.cpp's converter did to the tensors.

Sources followed (read, not copied): llama.cpp ``convert_hf_to_gguf.py`` and its
``conversion/`` modules (``llama.py``: Q/K row permutation, Mixtral's stacked experts,
Llama 3's ``rope_freqs``; ``gemma.py``: RMSNorm weights stored as ``1 + w``; ``qwen.py``,
``phi.py``, ``olmo.py``, ``granite.py``), gguf-py ``constants.py`` (tensor and metadata
names), llama.cpp ``src/llama-model.cpp`` (what the runtime derives rather than stores:
Gemma's attention scale, Gemma 3's window pattern, Qwen-MoE's top-k normalisation).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Meta = dict[str, Any]


@dataclass(frozen=True)
class GgufArch:
    """One GGUF architecture.

    Attributes:
        model_type, architecture: config.json's ``model_type`` and ``architectures[0]``.
        unpermute_qk: llama.cpp permuted Q/K rows (archs it runs with interleaved RoPE).
        norm_plus_one: norm weights are stored as ``1 + w`` (Gemma); undone at conversion.
        tensors: GGUF block tensor suffix -> HF name under ``model.layers.N.`` (``{e}``: the
            expert index of a 3-D expert tensor, split into one HF tensor per expert).
        config: extra config.json keys from the metadata and the tensor names.
    """

    model_type: str
    architecture: str
    unpermute_qk: bool = False
    norm_plus_one: bool = False
    tensors: dict[str, str] = field(default_factory=dict)
    config: Callable[[Meta, str, set[str], dict[str, Any]], dict[str, Any]] | None = None


#: The Llama layout's block tensors (GGUF suffix -> HF name under ``model.layers.N.``).
LLAMA_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight",
            "attn_k_norm.weight": "self_attn.k_norm.weight"}
_SANDWICH = {"attn_norm.weight": "input_layernorm.weight",
             "post_attention_norm.weight": "post_attention_layernorm.weight",
             "ffn_norm.weight": "pre_feedforward_layernorm.weight",
             "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_QWEN_EXPERTS = {"ffn_gate_inp.weight": "mlp.gate.weight",
                 "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
                 "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
                 "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight"}
_MIXTRAL_EXPERTS = {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
                    "ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight",
                    "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight",
                    "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight"}


def _get(meta: Meta, arch: str, key: str, default: Any = None) -> Any:
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
        raise ValueError(f"GGUF lacks {arch}.{key}")
    return value


def _experts(meta: Meta, arch: str) -> dict[str, Any]:
    return {"num_experts_per_tok": int(_get(meta, arch, "expert_used_count"))}


def _qwen2moe(meta: Meta, arch: str, names: set[str], base: dict[str, Any]) -> dict[str, Any]:
    return {**_experts(meta, arch), "num_experts": int(_get(meta, arch, "expert_count")),
            "moe_intermediate_size": int(_get(meta, arch, "expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(
                _get(meta, arch, "expert_shared_feed_forward_length")),
            # llama.cpp runs Qwen2-MoE without renormalising the top-k weights
            "norm_topk_prob": False, "qkv_bias": "blk.0.attn_q.bias" in names,
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def _qwen3(meta: Meta, arch: str, names: set[str], base: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": "blk.0.attn_q.bias" in names}


def _qwen3moe(meta: Meta, arch: str, names: set[str], base: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp renormalises Qwen3-MoE's top-k weights (the released configs say so too)
    return {**_qwen3(meta, arch, names, base), **_experts(meta, arch),
            "num_experts": int(_get(meta, arch, "expert_count")),
            "moe_intermediate_size": int(_get(meta, arch, "expert_feed_forward_length")),
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _llama(meta: Meta, arch: str, names: set[str], base: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": False}
    if "blk.0.ffn_gate_exps.weight" in names:  # Mixtral: llama with stacked experts
        out = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
               "num_local_experts": int(_get(meta, arch, "expert_count")),
               **_experts(meta, arch)}
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)
    return out


def _attn_scalar(meta: Meta, arch: str, base: dict[str, Any], big_layers: int) -> int:
    """Gemma 2/3's ``query_pre_attn_scalar``, which GGUF does not store: llama.cpp uses
    ``hidden / heads`` for the 27B models (identified by their layer count) and the head
    dim otherwise (``llama-model.cpp``, ``f_attention_scale``)."""
    if base["num_hidden_layers"] == big_layers:
        return base["hidden_size"] // base["num_attention_heads"]
    return int(base["head_dim"])


def _gemma(meta: Meta, arch: str, names: set[str], base: dict[str, Any]) -> dict[str, Any]:
    return {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": "output.weight" not in names}


def _gemma2(meta: Meta, arch: str, names: set[str], base: dict[str, Any]) -> dict[str, Any]:
    n = base["num_hidden_layers"]
    return {**_gemma(meta, arch, names, base),
            "sliding_window": int(_get(meta, arch, "attention.sliding_window")),
            "attn_logit_softcapping": float(meta.get(f"{arch}.attn_logit_softcapping") or 0)
            or None,
            "final_logit_softcapping": float(meta.get(f"{arch}.final_logit_softcapping") or 0)
            or None,
            "query_pre_attn_scalar": _attn_scalar(meta, arch, base, 46),
            "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention"
                            for i in range(n)]}


def _gemma3(meta: Meta, arch: str, names: set[str], base: dict[str, Any]) -> dict[str, Any]:
    n = base["num_hidden_layers"]
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": base.pop("rope_theta")}
    scaling = base.pop("rope_scaling", None)
    if scaling:
        full.update(scaling)
    base.pop("rope_parameters", None)
    return {**_gemma(meta, arch, names, base), "architectures": ["Gemma3ForCausalLM"],
            "sliding_window": int(_get(meta, arch, "attention.sliding_window")),
            "query_pre_attn_scalar": _attn_scalar(meta, arch, base, 62),
            # llama.cpp: every 6th layer global (set_swa_pattern(6)), local base 10000
            "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention"
                            for i in range(n)],
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": 10000.0}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None}


def _phi3(meta: Meta, arch: str, names: set[str], base: dict[str, Any]) -> dict[str, Any]:
    rot = int(meta.get(f"{arch}.rope.dimension_count", base["head_dim"]))
    out: dict[str, Any] = {"partial_rotary_factor": rot / base["head_dim"]}
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)
    return out


def _granite(meta: Meta, arch: str, names: set[str], base: dict[str, Any]) -> dict[str, Any]:
    return {**_llama(meta, arch, names, base),
            "embedding_multiplier": float(meta.get(f"{arch}.embedding_scale", 1.0)),
            "residual_multiplier": float(meta.get(f"{arch}.residual_scale", 1.0)),
            "attention_multiplier": float(meta.get(f"{arch}.attention.scale",
                                                   base["head_dim"] ** -0.5)),
            "logits_scaling": float(meta.get(f"{arch}.logit_scale", 1.0))}


ARCHS: dict[str, GgufArch] = {
    # Mistral and Mixtral files say "llama" too (Mixtral: stacked experts, see _llama)
    "llama": GgufArch("llama", "LlamaForCausalLM", unpermute_qk=True,
                      tensors={**LLAMA_TENSORS, **_MIXTRAL_EXPERTS}, config=_llama),
    "qwen2": GgufArch("qwen2", "Qwen2ForCausalLM", tensors=LLAMA_TENSORS),
    "qwen3": GgufArch("qwen3", "Qwen3ForCausalLM", tensors={**LLAMA_TENSORS, **_QK_NORM},
                      config=_qwen3),
    "qwen2moe": GgufArch("qwen2_moe", "Qwen2MoeForCausalLM", tensors={
        **LLAMA_TENSORS, **_QWEN_EXPERTS,
        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
        "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}, config=_qwen2moe),
    "qwen3moe": GgufArch("qwen3_moe", "Qwen3MoeForCausalLM",
                         tensors={**LLAMA_TENSORS, **_QK_NORM, **_QWEN_EXPERTS}, config=_qwen3moe),
    "gemma": GgufArch("gemma", "GemmaForCausalLM", norm_plus_one=True, tensors=LLAMA_TENSORS,
                      config=_gemma),
    "gemma2": GgufArch("gemma2", "Gemma2ForCausalLM", norm_plus_one=True,
                       tensors={**LLAMA_TENSORS, **_SANDWICH}, config=_gemma2),
    "gemma3": GgufArch("gemma3_text", "Gemma3ForCausalLM", norm_plus_one=True,
                       tensors={**LLAMA_TENSORS, **_SANDWICH, **_QK_NORM}, config=_gemma3),
    "phi3": GgufArch("phi3", "Phi3ForCausalLM", tensors={
        **LLAMA_TENSORS, "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight"}, config=_phi3),
    "olmo2": GgufArch("olmo2", "Olmo2ForCausalLM", tensors={
        **LLAMA_TENSORS, **_QK_NORM,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}),
    "granite": GgufArch("granite", "GraniteForCausalLM", unpermute_qk=True,
                        tensors=LLAMA_TENSORS, config=_granite),
}

#: llama3 RoPE parameters tried when a file carries ``rope_freqs`` (Meta's released values
#: for Llama 3.1 / 3.2 / 3.3 first: factor 8 or 32, low 1, high 4, original context 8192).
#: Any candidate that reproduces every factor gives the same frequencies, so the first
#: match is as good as the file's own parameters.
_LLAMA3_CANDIDATES = [(f, lo, hi, 2**c) for f in (8.0, 32.0, 16.0, 4.0, 2.0, 64.0)
                      for lo in (1.0, 2.0) for hi in (4.0, 2.0, 8.0)
                      for c in (13, 12, 11, 14, 15, 16, 17, 10, 9, 8, 7, 6, 5, 4)]


def llama3_factors(theta: float, dim: int, factor: float, low: float, high: float,
                   ctx: int) -> np.ndarray:
    """The ``rope_freqs`` llama.cpp writes for these parameters (``LlamaModel.
    generate_extra_tensors``): per frequency, 1 / the multiplier of its wavelength."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / float(f)
        if wavelen < ctx / high:
            out.append(1.0)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def fit_llama3(rope_freqs: np.ndarray, theta: float, dim: int) -> dict[str, Any]:
    """Recover transformers' ``rope_scaling`` (``llama3``) from a file's ``rope_freqs``.

    Raises:
        ValueError: no standard parameter set reproduces the factors (within fp32 rounding):
            the file is refused rather than served with other frequencies.
    """
    got = np.asarray(rope_freqs, dtype=np.float32).reshape(-1)
    if got.size != dim // 2:
        raise ValueError(f"rope_freqs has {got.size} values, need {dim // 2}")
    if np.all(got == 1.0):
        return {}
    for factor, low, high, ctx in _LLAMA3_CANDIDATES:
        if np.allclose(llama3_factors(theta, dim, factor, low, high, ctx), got,
                       rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": ctx}
    raise ValueError("GGUF rope_freqs match no llama3 RoPE parameters we know; refused")
