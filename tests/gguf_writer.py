"""Write a transformers model to a GGUF file the way llama.cpp's ``convert_hf_to_gguf.py``
does, for the tests (the real converter needs transformers 4.x and the llama.cpp tree).

What it follows, per llama.cpp's ``conversion/`` modules: tensor names from gguf-py's own
HF -> GGUF table (``gguf.get_tensor_name_map``: llama.cpp's, not ours), Q/K rows permuted
for the archs llama.cpp runs with interleaved RoPE (llama, mixtral, granite:
``LlamaModel.permute``), experts stacked into 3-D ``ffn_*_exps`` tensors, Gemma's RMSNorm
weights stored as ``1 + w``, Llama 3's RoPE scaling as the ``rope_freqs`` factors, the
metadata keys each ``set_gguf_parameters`` writes, and the default model's tokenizer
(the tiny models use its vocabulary). Tensors are F32, or Q8_0 for 2-D weights whose input
width is a multiple of 32 (``qtype="Q8_0"``; gguf-py quantises them as llama.cpp does).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from bench.make_gguf import add_default_tokenizer
from tokenserve.models.gguf_arch import llama3_factors

#: HF model_type -> GGUF architecture
ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
        "qwen3": "qwen3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma": "gemma",
        "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "olmo2": "olmo2",
        "granite": "granite"}
_PERMUTED = ("llama", "granite")
_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp ``LlamaModel.permute``: HF rotate-half row order -> GGML's interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _rope(cfg) -> dict:
    p = getattr(cfg, "rope_parameters", None) or {}
    return p.get("full_attention", p)


def _metadata(w: gguf.GGUFWriter, cfg, arch: str) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = _rope(cfg)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    rot = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(rot)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    window = getattr(cfg, "sliding_window", None)
    if arch in ("gemma2", "gemma3", "phi3") and window:
        w.add_sliding_window(window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    n_exp = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if n_exp:
        w.add_expert_count(n_exp)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "granite":
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_logit_scale(cfg.logits_scaling)


def _checkpoint(model) -> dict[str, np.ndarray]:
    """The model's tensors as its saved checkpoint names them (transformers 5 keeps MoE
    experts fused in memory and writes the hub's per-expert names on save)."""
    import tempfile

    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        out: dict[str, np.ndarray] = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            out.update({k: v.astype(np.float32) for k, v in load_file(str(f)).items()})
    return out


def write_gguf(model, out: Path, qtype: str = "F32") -> Path:
    """Write ``model`` (a transformers causal LM, fp32) as a GGUF at ``out``."""
    cfg = model.config
    arch = ARCH[cfg.model_type]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny {cfg.model_type}")
    _metadata(w, cfg, arch)
    add_default_tokenizer(w)
    arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    sd = _checkpoint(model)
    if getattr(cfg, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def put(gname: str, arr: np.ndarray) -> None:
        if qtype == "Q8_0" and arr.ndim >= 2 and arr.shape[-1] % 32 == 0:
            w.add_tensor(gname, gguf.quants.quantize(arr, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))

    for name, arr in sd.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = arr
            continue
        if arch in _PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = _permute(arr, cfg.num_attention_heads)
        if arch in _PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = _permute(arr, cfg.num_key_value_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)
        put(names.get_name(name, try_suffixes=(".weight", ".bias")), arr)
    for (prefix, proj), by_e in sorted(experts.items()):
        stacked = np.stack([by_e[e] for e in sorted(by_e)])
        put(names.get_name(f"{prefix}.{proj}.weight", try_suffixes=(".weight",)), stacked)
    rope = _rope(cfg)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(
            rope["rope_theta"], head_dim, rope["factor"], rope["low_freq_factor"],
            rope["high_freq_factor"], rope["original_max_position_embeddings"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

