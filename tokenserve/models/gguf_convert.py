"""Convert a GGUF file of any served family into a Hugging Face-format model directory.

Output layout (what ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` and our own
loader read)::

    out_dir/
      config.json                 the family's hyper-parameters (tokenserve/models/gguf_arch.py)
      model.safetensors           float32 tensors, HF names, [out_features, in_features]
                                  (only with ``weights=True``, or later
                                  :func:`write_float_weights`)
      tokenizer.json              byte-level BPE built with the ``tokenizers`` library
      tokenizer_config.json       special tokens, add_bos_token, chat_template
      generation_config.json      bos/eos ids
      tokenserve-complete.json    marker, written last (see :func:`is_complete_conversion`)

Sources followed (read, not copied):

* llama.cpp ``convert_hf_to_gguf.py`` (``LlamaModel.permute``, tensor and metadata names) and
  ``src/llama-vocab.cpp`` (pre-tokenizer regexes per ``tokenizer.ggml.pre``);
* transformers ``modeling_gguf_pytorch_utils.py`` (``reverse_permute``) and the
  GGUF spec (``docs/gguf.md``: ``ne`` dimension order, token types).

Quantized tensors are dequantized with ``gguf.quants.dequantize`` (needs gguf >= 0.16 for
``ReaderField.contents``). The whole float32 model is held in memory while writing, so the
server's cache (``tokenserve.models.loader.resolve_model``) converts without it
(``weights=False``: config, tokenizer and a check of every tensor's name and the embedding's
shape) and writes the float32 copy only when a load needs dequantised weights: a 1B Q4_K_M
file served on its own blocks costs 0.8 GB, not 4.9 GB of disk and 6.3 GB of peak memory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

from tokenserve.models.gguf_arch import ARCHS, GgufArch, fit_llama3
from tokenserve.models.gguf_reader import open_gguf

logger = logging.getLogger("tokenserve.models")

#: Written last into a converted directory; its presence (with this format) means complete.
COMPLETE_MARKER = "tokenserve-complete.json"
#: Bump when the converter's output changes, so old cache entries are rebuilt.
FORMAT_VERSION = 2
#: The float32 weights of a converted directory.
WEIGHTS_FILE = "model.safetensors"

# GGUF token types (gguf.TokenType): 3 = CONTROL, 4 = USER_DEFINED.
_CONTROL = 3
_USER_DEFINED = 4


_GLOBAL_TENSORS = MappingProxyType(
    {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

# Pre-tokenizer split regexes, as llama.cpp's llama-vocab.cpp applies them per pre-type.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# pre-type -> (family, ignore_merges). Families: "gpt2" (GPT-2 regex), "digits" (each digit
# alone, then GPT-2 regex; SmolLM/StarCoder), or a custom split regex.
_PRE_TYPES = MappingProxyType(
    {
        "gpt2": ("gpt2", False),
        "smollm": ("digits", False),
        "starcoder": ("digits", False),
        "refact": ("digits", False),
        "codeshell": ("digits", False),
        "llama-bpe": (_LLAMA3_SPLIT, True),
        "llama3": (_LLAMA3_SPLIT, True),
        "llama-v3": (_LLAMA3_SPLIT, True),
        "smaug-bpe": (_LLAMA3_SPLIT, True),
        "qwen2": (_QWEN2_SPLIT, False),
        "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
    }
)


def is_complete_conversion(model_dir: str | Path) -> bool:
    """True when ``model_dir`` holds a finished conversion of the current :data:`FORMAT_VERSION`."""
    marker = Path(model_dir) / COMPLETE_MARKER
    try:
        return json.loads(marker.read_text()).get("format") == FORMAT_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp (``LlamaModel.permute``) reorders the rows of each head from HF's "halves" RoPE
    layout to GGML's interleaved one: ``w.reshape(n_head, 2, d, *rest).swapaxes(1, 2)`` with
    ``d = rows // n_head // 2``. This applies the inverse.

    Args:
        w: ``[n_head * head_dim, in_features]`` weight or ``[n_head * head_dim]`` bias.
        n_head: heads of this projection (attention heads for Q, KV heads for K).

    Returns:
        Array of the same shape and dtype, rows in HF order.

    Raises:
        ValueError: the row count is not a multiple of ``2 * n_head``.
    """
    rows = w.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"cannot unpermute {rows} rows into {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True,
                 weights: bool = True) -> Path:
    """Convert a GGUF into a Hugging Face-format directory at ``out_dir``.

    Everything is written into a temporary sibling directory that is renamed onto ``out_dir``
    at the end (atomic on one filesystem), so a reader never sees a half-written model and two
    processes may convert the same file at once: the second rename loses and its copy is
    discarded.

    Args:
        gguf_path: a GGUF v2/v3 file of an architecture in
            :data:`tokenserve.models.gguf_arch.ARCHS` with a byte-level BPE
            (``tokenizer.ggml.model == "gpt2"``) vocabulary.
        out_dir: the directory to create; must not exist yet.
        progress: show a tqdm bar over the tensors.
        weights: write ``model.safetensors`` (float32) now; False leaves it to
            :func:`write_float_weights` (the tensors' names and the embedding's shape are
            still checked).

    Returns:
        ``out_dir`` as a :class:`Path`.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        FileExistsError: ``out_dir`` already exists (or an incomplete one appeared meanwhile).
        ValueError: not a GGUF file, not a complete one (truncated or corrupt, as
            :func:`open_gguf` says; nothing is written), or one using an architecture,
            tokenizer, RoPE variant or tensor this converter does not handle.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    reader = open_gguf(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    config = _hf_config(meta, reader, name=gguf_path.stem)
    tokenizer = _build_tokenizer(meta)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        if weights:
            tensors = _convert_tensors(reader, config, gguf_arch(meta), progress)
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            del tensors
        else:
            _check_tensors(reader, config, gguf_arch(meta))
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(meta, config))
        _write_json(tmp / "generation_config.json", _generation_config(meta))
        _write_json(tmp / COMPLETE_MARKER,
                    {"format": FORMAT_VERSION, "source": str(gguf_path), "weights": weights})
        # mkdtemp makes it 0700; MindIE wants weight dirs <= 0750, group-readable is handy.
        for f in tmp.iterdir():
            f.chmod(0o640)
        tmp.chmod(0o750)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not is_complete_conversion(out_dir):
                raise FileExistsError(f"{out_dir} appeared during conversion, incomplete") from None
            logger.info("another process converted %s first; using its copy", gguf_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def write_float_weights(model_dir: str | Path, progress: bool = True) -> Path:
    """Write ``model_dir``'s ``model.safetensors`` (float32, HF names) from the GGUF its marker
    names, for a directory converted with ``weights=False``; atomic (a temporary file renamed),
    a no-op when the file is there. The caller serialises concurrent writers.

    Returns:
        The weights file's path.

    Raises:
        ValueError: ``model_dir`` is not a complete conversion, or its source GGUF is no longer
            a complete GGUF file (:func:`open_gguf`).
        FileNotFoundError: its source GGUF is gone.
    """
    model_dir = Path(model_dir)
    out = model_dir / WEIGHTS_FILE
    if out.is_file():
        return out
    if not is_complete_conversion(model_dir):
        raise ValueError(f"{model_dir} is not a complete GGUF conversion")
    source = Path(json.loads((model_dir / COMPLETE_MARKER).read_text())["source"])
    if not source.is_file():
        raise FileNotFoundError(f"{model_dir}'s source GGUF {source} is gone")
    logger.info("writing the float32 weights of %s into %s", source, out)
    reader = open_gguf(source)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    config = json.loads((model_dir / "config.json").read_text())
    tensors = _convert_tensors(reader, config, gguf_arch(meta), progress)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.chmod(0o640)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------- config


def _f32(x: float) -> float:
    """A float32 GGUF value as the shortest decimal that round-trips (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def gguf_arch(meta: dict[str, Any]) -> GgufArch:
    """The :class:`GgufArch` of a file's ``general.architecture``.

    Raises:
        ValueError: an architecture no family serves (named in the message).
    """
    arch_name = meta.get("general.architecture")
    arch = ARCHS.get(arch_name)
    if arch is None:
        raise ValueError(f"unsupported GGUF architecture {arch_name!r}; known: {sorted(ARCHS)}")
    return arch


#: GGML float types -> the dtype a file stored at that precision runs at (f16 runs at f32:
#: the CPU kernels have no f16 arithmetic, and f32 holds every f16 exactly).
_FLOAT_TYPES = {"F32": "float32", "F16": "float32", "BF16": "bfloat16"}


def _weights_dtype(reader: GGUFReader) -> str | None:
    """``float32`` / ``bfloat16`` when every 2-D weight of the file is stored at that float
    precision (an f32 / f16 / bf16 GGUF), None when any is quantised."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
    dtypes = {_FLOAT_TYPES.get(k) for k in kinds}
    return dtypes.pop() if len(dtypes) == 1 and None not in dtypes else None


def _hf_config(meta: dict[str, Any], reader: GGUFReader, name: str) -> dict[str, Any]:
    arch = gguf_arch(meta)
    arch_name = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch_name}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF lacks {arch_name}.{key}")
        if isinstance(value, list):
            raise ValueError(f"per-layer {arch_name}.{key} is not supported")
        return value

    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_head))
    if int(get("rope.dimension_count", head_dim)) != head_dim and arch_name != "phi3":
        raise ValueError("partial rotary embeddings (rope.dimension_count != head_dim) unsupported")
    tensors = {t.name: t for t in reader.tensors}
    theta = _f32(get("rope.freq_base", 10000.0))
    scaling_type = meta.get(f"{arch_name}.rope.scaling.type", "none")
    if scaling_type == "none":
        rope_scaling = None
    elif scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(get("rope.scaling.factor"))}
    else:
        raise ValueError(f"unsupported GGUF rope scaling type {scaling_type!r}")
    if "rope_freqs.weight" in tensors:  # Llama 3.1+: the llama3 factors, not the parameters
        freqs = np.asarray(dequantize(tensors["rope_freqs.weight"].data,
                                      tensors["rope_freqs.weight"].tensor_type))
        rope_scaling = fit_llama3(freqs, theta, head_dim) or rope_scaling
    if "rope_factors_short.weight" in tensors:  # Phi-3 longrope
        rot = int(get("rope.dimension_count", head_dim))

        def factors(n: str) -> list[float]:
            t = tensors[n]
            return [float(x) for x in np.asarray(dequantize(t.data, t.tensor_type)).reshape(-1)]
        rope_scaling = {"rope_type": "longrope", "short_factor": factors(
            "rope_factors_short.weight"), "long_factor": factors("rope_factors_long.weight"),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}
        if meta.get(f"{arch_name}.rope.scaling.attn_factor") is not None:
            rope_scaling["attention_factor"] = _f32(get("rope.scaling.attn_factor"))
        if len(rope_scaling["short_factor"]) != rot // 2:
            raise ValueError("rope_factors_short does not match the rotary dimensions")

    if not meta.get("tokenizer.ggml.tokens"):
        raise ValueError("GGUF has no embedded vocabulary (tokenizer.ggml.tokens)")
    names = set(tensors)
    ffn = meta.get(f"{arch_name}.feed_forward_length")
    config: dict[str, Any] = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": int(ffn) if isinstance(ffn, int) else int(
            get("expert_feed_forward_length", 0)),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(get("attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "tokenserve_name": name,
        "tokenserve_gguf_dtype": _weights_dtype(reader),
    }
    if arch.config is not None:
        config.update(arch.config(meta, arch_name, names, config))
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return config


def _generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    eos = [
        meta[key]
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                    "tokenizer.ggml.eom_token_id")
        if meta.get(key) is not None
    ]
    eos = list(dict.fromkeys(eos))
    gen: dict[str, Any] = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id")}
    gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        gen["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return gen


def _tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]
    cfg: dict[str, Any] = {
        # The generic fast tokenizer takes tokenizer.json as-is; transformers 5's GPT2Tokenizer
        # rebuilds its own pre-tokenizer and would drop SmolLM's digit split.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            cfg[name] = tokens[token_id]
    if meta.get("tokenizer.chat_template"):
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg


# --------------------------------------------------------------------------- tensors


def _hf_names(gguf_name: str, arch: GgufArch, n_experts: int = 0) -> list[str]:
    """The HF name(s) of a GGUF tensor: one, or one per expert for a stacked expert tensor.

    Raises:
        ValueError: a tensor the architecture does not name.
    """
    if gguf_name in _GLOBAL_TENSORS:
        return [_GLOBAL_TENSORS[gguf_name]]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in arch.tensors:
        hf = f"model.layers.{m.group(1)}.{arch.tensors[m.group(2)]}"
        return [hf.format(e=e) for e in range(n_experts)] if "{e}" in hf else [hf]
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for {arch.model_type}")


#: Tensors whose content lands in config.json (RoPE factors) rather than in the weights.
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _layer_arrays(t, arch: GgufArch, config: dict[str, Any], arr: np.ndarray
                  ) -> list[tuple[str, np.ndarray]]:
    """(HF name, array) pairs of one GGUF tensor's ``arr`` (dequantised ``[.., out, in]``
    floats, or raw block rows ``[.., out, row_bytes]``): Q/K rows un-permuted where llama.cpp
    permuted them, stacked experts split, Gemma's ``1 + w`` norms undone (floats only)."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
    if arch.unpermute_qk and kind in heads:
        arr = unpermute_qk(arr, heads[kind])
    if (arch.norm_plus_one and arr.dtype == np.float32 and t.name.endswith("norm.weight")):
        arr = arr - np.float32(1.0)
    names = _hf_names(t.name, arch, arr.shape[0] if arr.ndim == 3 else 0)
    if arr.ndim == 3:
        return [(n, arr[e]) for e, n in enumerate(names)]
    return [(names[0], arr)]


def _convert_tensors(
    reader: GGUFReader, config: dict[str, Any], arch: GgufArch, progress: bool
) -> dict[str, np.ndarray]:
    """Dequantize every tensor to float32 ``[out, in]`` (row-major) under its HF name
    (after :func:`_check_tensors`: names and the embedding's shape)."""
    _check_tensors(reader, config, arch)
    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="convert GGUF", unit="tensor", disable=not progress):
        if t.name in _CONFIG_TENSORS:
            continue
        # GGUF lists dims in ggml "ne" order (fastest first); numpy data is row-major, so the
        # dequantized array is [ne[n-1], ..., ne[0]] = [out_features, in_features].
        shape = tuple(int(d) for d in reversed(t.shape))
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        for name, a in _layer_arrays(t, arch, config, arr):
            out[name] = np.ascontiguousarray(a)
    return out


def _check_tensors(reader: GGUFReader, config: dict[str, Any], arch: GgufArch) -> None:
    """What a conversion refuses, without dequantising: a tensor the architecture does not
    name, an embedding of the wrong shape.

    Raises:
        ValueError: as :func:`convert_gguf`.
    """
    embed = None
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        _hf_names(t.name, arch, shape[0] if len(shape) == 3 else 0)
        if t.name == "token_embd.weight":
            embed = shape
    if embed != (config["vocab_size"], config["hidden_size"]):
        raise ValueError(f"token_embd shape {embed} does not match "
                         f"vocab {config['vocab_size']} x hidden {config['hidden_size']}")


def read_quantized_tensors(gguf_path: str | Path, formats: frozenset[str],
                           progress: bool = False,
                           offsets: dict[str, int] | None = None) -> dict[str, Any]:
    """Every tensor of a GGUF by its HF name, block-quantised ones kept as raw blocks (for
    ``--quantization gguf``).

    Tensors whose GGML type is in ``formats`` (e.g. ``{"Q4_0", "Q4_1", "Q8_0"}``) come back as
    ``(blocks, ggml_type_name, (rows, cols))`` with ``blocks`` a uint8 ``[rows, row_bytes]``
    array: each row is one output feature's blocks, so llama.cpp's Q/K row permutation is
    undone on whole rows (:func:`unpermute_qk` works on any trailing shape) and the bytes
    are otherwise the file's; a stacked expert tensor ``[E, rows, row_bytes]`` gives one such
    entry per expert. Blocks needing no reordering are views of the file's mapping (private,
    copy-on-write: nothing is written back), so their pages can leave the resident set once
    packed (``ops/host_memory.drop_file_pages``); un-permuted Q/K rows are copies. Every other
    tensor is dequantised to float32 as in :func:`convert_gguf`.

    Args:
        offsets: filled, when given, with each view's byte offset in the file (by HF name):
            what a later start needs to map the same bytes without parsing the file again.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: not a complete GGUF file (truncated or corrupt: the message names the file
            and, for a tensor cut short, the tensor, the bytes it needs and the file's size;
            :func:`open_gguf`), or an architecture or tensor :func:`convert_gguf` would refuse.
    """
    reader = open_gguf(gguf_path, mode="c")
    meta = {name: field.contents() for name, field in reader.fields.items()}
    config = _hf_config(meta, reader, name=Path(gguf_path).stem)
    arch = gguf_arch(meta)
    base, size = reader.data.ctypes.data, reader.data.nbytes
    out: dict[str, Any] = {}
    for t in tqdm(reader.tensors, desc="read GGUF", unit="tensor", disable=not progress):
        if t.name in _CONFIG_TENSORS:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type.name in formats and len(shape) in (2, 3):
            arr = np.asarray(t.data, dtype=np.uint8).reshape(*shape[:-1], -1)
            for name, a in _layer_arrays(t, arch, config, arr):
                blocks = np.ascontiguousarray(a)  # the file's bytes unless Q/K rows moved
                off = blocks.ctypes.data - base
                if offsets is not None and 0 <= off <= size - blocks.nbytes:
                    offsets[name] = off
                out[name] = (blocks, t.tensor_type.name, a.shape[:1] + shape[-1:])
            continue
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        for name, a in _layer_arrays(t, arch, config, arr):
            out[name] = np.array(a, order="C")  # owned, writable
    return out


# --------------------------------------------------------------------------- tokenizer


def _build_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` equivalent to llama.cpp's for this vocabulary.

    Control tokens (type 3) become special added tokens and user-defined ones (type 4) plain
    added tokens, both matched whole and unnormalized, at their GGUF ids. When
    ``add_bos_token``/``add_eos_token`` are set, a post-processor adds them.
    """
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF vocabularies supported, not {model!r}")
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in _PRE_TYPES:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}; supported: {sorted(_PRE_TYPES)}")
    family, ignore_merges = _PRE_TYPES[pre]

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    if len(vocab) != len(tokens):
        logger.warning("GGUF vocabulary has %d duplicate tokens; keeping the first id of each",
                       len(tokens) - len(vocab))
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise ValueError("malformed tokenizer.ggml.merges entry (expected 'left right')")
    tk = HFTokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))

    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    if family == "gpt2":
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)
    elif family == "digits":
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True),
        ])
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(family), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False),
        ])
    tk.decoder = decoders.ByteLevel()

    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, ty in enumerate(types) if ty == _CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, ty in enumerate(types) if ty == _USER_DEFINED]
    tk.add_special_tokens(special)
    tk.add_tokens(user)
    assert tk.get_vocab_size(with_added_tokens=True) == len(vocab), "added tokens changed ids"

    tk.post_processor = _post_processor(meta, tokens)
    return tk


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """ByteLevel offsets, plus BOS/EOS insertion when the GGUF asks for it (Llama 3 style)."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    specials: list[tuple[str, int] | None] = []
    for flag, key in (("add_bos_token", "bos_token_id"), ("add_eos_token", "eos_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        specials.append((tokens[token_id], token_id) if meta.get(f"tokenizer.ggml.{flag}")
                        and token_id is not None else None)
    bos, eos = specials
    if bos is None and eos is None:
        return byte_level

    def seq(piece: str, type_id: int) -> list[str]:
        return ([f"{bos[0]}:{type_id}"] if bos else []) + [f"{piece}:{type_id}"] + (
            [f"{eos[0]}:{type_id}"] if eos else [])

    template = processors.TemplateProcessing(
        single=seq("$A", 0),
        pair=seq("$A", 0) + seq("$B", 1),
        special_tokens=list(dict.fromkeys(s for s in (bos, eos) if s is not None)),
    )
    return processors.Sequence([byte_level, template])


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
