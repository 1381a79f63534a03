"""Write a random-weight GGUF file of a real model's shape, for speed and memory runs.

    python -m bench.make_gguf --shape llama-3.2-1b --qtype q4_k_m --out bench/out/l1b.q4_k_m.gguf

No weights can be downloaded here, so real sizes are measured on random weights of the real
shapes (issues 39 and 42). The file is a llama.cpp GGUF v3 written with gguf-py's
``GGUFWriter``: the architecture's metadata as ``convert_hf_to_gguf.py`` writes it, the
default model's tokenizer (SmolLM2's byte-level BPE) padded with ``<|reserved_N|>`` control
tokens up to the shape's vocabulary, and every 2-D weight as random quantised blocks:

- ``q4_k_m``: llama.cpp's Q4_K_M mix (``llama-quant.cpp``): Q6_K for the output (the token
  table when tied) and for ``attn_v`` / ``ffn_down`` of the layers ``use_more_bits`` picks
  (the first and last eighth, and every third between), Q4_K elsewhere;
- ``q5_k_m``: the same with Q5_K; ``q6_k``: Q6_K everywhere; ``q4_0`` / ``q8_0``: one type
  (gguf-py quantises random normal weights);
- norms F32 (ones).

K-quant super-blocks are random bytes with their fp16 scales set to small values (``d``,
``dmin`` in [2^-13, 2^-12)), so weights stay within about +-0.25 and activations finite.
Random weights compute exactly as real ones of the same types: the kernels read the same
bytes per token, which is what a speed or memory run measures (not the text).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

from tokenserve.models.gguf_reader import open_gguf
from tokenserve.models.loader import default_gguf_path


@dataclass(frozen=True)
class Shape:
    """A decoder's shape (Hugging Face config names)."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0


SHAPES = {
    # meta-llama/Llama-3.2-1B / -3B (config.json); the llama3 RoPE factors are left out
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 128256, True, 500000.0),
    # Qwen/Qwen3-0.6B (q/k norms: the generic layer loop), and the same shape as Llama
    # layers (the fused C++ stack), to price the loop
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, 1e6),
    "llama-0.6b": Shape("llama", 1024, 28, 16, 8, 128, 3072, 151936, True, 1e6),
    # Qwen/Qwen3-30B-A3B's layer with 8 of its 48 layers (fits 24 GiB at Q4_K_M)
    "qwen3-moe-a3b-8l": Shape("qwen3moe", 2048, 8, 32, 4, 128, 6144, 151936, False, 1e6,
                              experts=128, experts_used=8, expert_ffn=768),
}


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _tensor_type(name: str, layer: int | None, n: int, mix: str) -> Q:
    if mix in ("q4_0", "q8_0", "q6_k"):
        return {"q4_0": Q.Q4_0, "q8_0": Q.Q8_0, "q6_k": Q.Q6_K}[mix]
    base = Q.Q4_K if mix == "q4_k_m" else Q.Q5_K
    if name in ("output", "token_embd_tied"):
        return Q.Q6_K
    if name in ("attn_v", "ffn_down", "ffn_down_exps") and _use_more_bits(layer, n):
        return Q.Q6_K
    return base


def _random_blocks(rng: np.random.Generator, shape: tuple[int, ...], qt: Q) -> np.ndarray:
    """Random quantised bytes for a tensor of ``shape`` (rows last-dim-major, as ggml)."""
    block, nbytes = GGML_QUANT_SIZES[qt]
    *outer, k = shape
    if qt in (Q.Q4_0, Q.Q8_0):
        w = (rng.standard_normal((int(np.prod(outer)), k), dtype=np.float32) * 0.05)
        return quantize(w, qt).reshape(*outer, k // block * nbytes)
    rows = int(np.prod(outer))
    data = rng.integers(0, 256, (rows, k // block, nbytes), dtype=np.uint8)
    scales = (rng.random((rows, k // block, 2), dtype=np.float32) * 2**-13 + 2**-13)
    f16 = scales.astype(np.float16).view(np.uint8)  # [rows, blocks, 4]
    if qt == Q.Q6_K:  # block_q6_K: d last
        data[..., nbytes - 2:] = f16[..., :2]
    else:  # block_q4_K / block_q5_K: d, dmin first
        data[..., :4] = f16
    return data.reshape(*outer, k // block * nbytes)


def add_default_tokenizer(w: GGUFWriter, vocab: int | None = None) -> None:
    """The default model's tokenizer (SmolLM2's byte-level BPE, its ids, merges and chat
    template) into ``w``, padded with ``<|reserved_N|>`` control tokens up to ``vocab``
    entries (None: as it is, 49152)."""
    src = open_gguf(default_gguf_path())
    f = src.fields
    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode("utf-8")
              for i in f["tokenizer.ggml.tokens"].data]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0])
             for i in f["tokenizer.ggml.token_type"].data]
    merges = [bytes(f["tokenizer.ggml.merges"].parts[i]).decode("utf-8")
              for i in f["tokenizer.ggml.merges"].data]
    pad = (vocab or len(tokens)) - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(pad)]
    types += [3] * pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(f["tokenizer.chat_template"].contents())


def write(shape: Shape, mix: str, out: Path, seed: int = 0) -> Path:
    """Write the file; returns ``out``."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(out), shape.arch)
    a = shape.arch
    w.add_name(f"random {a} {shape.layers}L h{shape.hidden}")
    w.add_block_count(shape.layers)
    w.add_context_length(8192)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_layer_norm_rms_eps(1e-5 if a == "llama" else 1e-6)
    w.add_vocab_size(shape.vocab)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_ffn)
    add_default_tokenizer(w, shape.vocab)

    n, h = shape.layers, shape.hidden
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def mat(name: str, layer: int | None, rows: int, cols: int, experts: int = 0,
            role: str | None = None) -> None:
        qt = _tensor_type(role or name, layer, n, mix)
        full = name if layer is None else f"blk.{layer}.{name}"
        dims = (experts, rows, cols) if experts else (rows, cols)
        data = _random_blocks(rng, dims, qt)
        w.add_tensor(f"{full}.weight", data, raw_dtype=qt)

    def norm(name: str, size: int) -> None:
        w.add_tensor(f"{name}.weight", np.ones(size, dtype=np.float32))

    # a tied table is the output too: llama.cpp quantises it as the output
    mat("token_embd", None, shape.vocab, h, role="token_embd_tied" if shape.tied else None)
    if not shape.tied:
        mat("output", None, shape.vocab, h)
    norm("output_norm", h)
    for i in range(n):
        norm(f"blk.{i}.attn_norm", h)
        norm(f"blk.{i}.ffn_norm", h)
        mat("attn_q", i, q_dim, h)
        mat("attn_k", i, kv_dim, h)
        mat("attn_v", i, kv_dim, h)
        mat("attn_output", i, h, q_dim)
        if a in ("qwen3", "qwen3moe"):
            norm(f"blk.{i}.attn_q_norm", shape.head_dim)
            norm(f"blk.{i}.attn_k_norm", shape.head_dim)
        if shape.experts:
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight",
                         (rng.standard_normal((shape.experts, h), dtype=np.float32) * 0.05))
            mat("ffn_gate_exps", i, shape.expert_ffn, h, shape.experts)
            mat("ffn_up_exps", i, shape.expert_ffn, h, shape.experts)
            mat("ffn_down_exps", i, h, shape.expert_ffn, shape.experts)
        else:
            mat("ffn_gate", i, shape.ffn, h)
            mat("ffn_up", i, shape.ffn, h)
            mat("ffn_down", i, h, shape.ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--qtype", choices=("q4_k_m", "q5_k_m", "q6_k", "q4_0", "q8_0"),
                    default="q4_k_m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(write(SHAPES[args.shape], args.qtype, args.out, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
