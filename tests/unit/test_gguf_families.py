"""Every family from GGUF: a tiny random transformers model written as llama.cpp's converter
writes it (tests/gguf_writer.py: gguf-py's name table, Q/K permutation, stacked experts,
Gemma's ``1 + w`` norms, Llama 3's ``rope_freqs``), converted back by ours, served by our
decoder: an F32 file gives transformers' logits; a Q8_0 file run on its own blocks stays
within the quantisation's error of the file's dequantised weights.

GGUF stores less than config.json: llama.cpp derives Gemma's attention scale from the head
size, Gemma 3's window pattern (every 6th layer global) and Gemma 2's (alternate), and keeps
no Qwen2 / Mistral window; the tiny models here use those derived values, as a real file's
model does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.families import FAMILIES, hf_config, randomize
from tests.gguf_writer import write_gguf
from tokenserve.models.decoder import CausalLM
from tokenserve.models.gguf_convert import convert_gguf
from tokenserve.models.loader import load_config, load_weights

#: family -> config changes so that the GGUF can say everything the model does
GGUF_VARIANTS = {
    "mistral": dict(sliding_window=None),
    "qwen2": dict(use_sliding_window=False, sliding_window=None),
    "gemma2": dict(query_pre_attn_scalar=16, layer_types=None),
    "gemma3_text": dict(query_pre_attn_scalar=16, num_hidden_layers=2, layer_types=None,
                        sliding_window_pattern=6),
    "qwen2_moe": dict(mlp_only_layers=[]),
}
#: families whose GGUF tiny model is the unit test's one
FAMILIES_GGUF = sorted(set(FAMILIES) - {"llama_bias"}) + ["llama_bias"]


def _hf_model(family: str, seed: int = 0):
    import transformers as T

    cfg = hf_config(family)
    for k, v in GGUF_VARIANTS.get(family, {}).items():
        setattr(cfg, k, v)
    if family == "qwen2":
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    if family == "gemma2":
        cfg.layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                           for i in range(cfg.num_hidden_layers)]
    if family == "gemma3_text":
        cfg.layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention"
                           for i in range(cfg.num_hidden_layers)]
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg).eval().float()
    randomize(model, seed)
    return model


def _prompt() -> list[int]:
    return torch.randint(3, 40000, (14,), generator=torch.Generator().manual_seed(3)).tolist()


def _logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    from tests.unit.test_families import _prefill_logits
    return _prefill_logits(model, ids)


@pytest.fixture(scope="module", params=FAMILIES_GGUF)
def converted(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"gguf_{request.param}")
    hf = _hf_model(request.param)
    path = write_gguf(hf, d / "m.gguf")
    out = convert_gguf(path, d / "hf", progress=False)
    return request.param, hf, path, out


def test_f32_gguf_gives_transformers_logits(converted):
    family, hf, _, out = converted
    cfg = load_config(out)
    # Mistral files say "llama" (llama.cpp keeps no window for them): a llama without one
    assert cfg.model_type == {"mistral": "llama"}.get(family, hf.config.model_type)
    model = CausalLM.from_state_dict(cfg, load_weights(out, torch.float32), torch.float32,
                                     torch.device("cpu"))
    ids = _prompt()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-4, atol=1e-3)


def test_converted_directory_loads_in_transformers(converted):
    """The converted directory is a Hugging Face model transformers itself loads into the
    same logits (the contract between the converter and the decoder)."""
    import transformers as T

    _, hf, _, out = converted
    again = T.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([_prompt()])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-3)


def test_gguf_f32_file_records_its_precision(converted):
    import json
    out = converted[3]
    assert json.loads((out / "config.json").read_text())["tokenserve_gguf_dtype"] == "float32"


@pytest.mark.parametrize("family,trap", [("llama", "unpermute_qk"), ("granite", "unpermute_qk"),
                                         ("gemma3_text", "norm_plus_one")])
def test_negative_controls_of_the_conversion(tmp_path, monkeypatch, family, trap):
    """Each llama.cpp convention the converter undoes matters: skipping it (the Q/K row
    un-permutation, Gemma's ``1 + w``) gives other logits."""
    from tokenserve.models import gguf_arch

    hf = _hf_model(family)
    path = write_gguf(hf, tmp_path / "m.gguf")
    arch = {"llama": "llama", "granite": "granite", "gemma3_text": "gemma3"}[family]
    monkeypatch.setitem(gguf_arch.ARCHS, arch,
                        dataclasses.replace(gguf_arch.ARCHS[arch], **{trap: False}))
    out = convert_gguf(path, tmp_path / "hf", progress=False)
    model = CausalLM.from_state_dict(load_config(out), load_weights(out, torch.float32),
                                     torch.float32, torch.device("cpu"))
    ids = _prompt()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (_logits(model, ids) - ref).abs().max() > 0.05


def test_q8_0_file_runs_on_its_blocks_close_to_its_dequantised_weights(tmp_path):
    """A Q8_0 file served on its own blocks (``--quantization gguf``) against the same file's
    dequantised weights at fp32: the same greedy top-1 on most positions and small logit
    differences (Q8_0 weights, int12 activations per 32-block: bench/README.md)."""
    hf = _hf_model("qwen3")
    path = write_gguf(hf, tmp_path / "m.gguf", qtype="Q8_0")
    out = convert_gguf(path, tmp_path / "hf", progress=False)
    cfg = load_config(out)
    ref = CausalLM.from_state_dict(cfg, load_weights(out, torch.float32), torch.float32,
                                   torch.device("cpu"))
    blocks = load_weights(out, torch.float32, "gguf", str(path))
    assert any(getattr(v, "qtype", None) == "q8_0" for v in blocks.values())
    ours = CausalLM.from_state_dict(cfg, blocks, torch.float32, torch.device("cpu"))
    ids = _prompt()
    a, b = _logits(ours, ids), _logits(ref, ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_dtype_auto_runs_an_f32_file_at_f32_unless_told(tmp_path, monkeypatch):
    """``--dtype auto`` (the default) serves an F32 GGUF at float32 and a quantised one at
    bfloat16; an explicit ``--dtype`` wins."""
    from tokenserve.config.tree import EngineConfig
    from tokenserve.engine.engine import AsyncEngine

    monkeypatch.setenv("TOKENSERVE_CACHE", str(tmp_path / "cache"))
    hf = _hf_model("llama")
    f32 = write_gguf(hf, tmp_path / "f32.gguf")
    q8 = write_gguf(hf, tmp_path / "q8.gguf", qtype="Q8_0")
    for path, asked, expected in ((f32, "auto", "float32"), (q8, "auto", "bfloat16"),
                                  (f32, "bfloat16", "bfloat16")):
        engine = AsyncEngine.build(EngineConfig(model=str(path), dtype=asked, device="cpu",
                                                kv_cache_bytes=4 << 20, block_size=16))
        try:
            assert engine.executor.runner.model.dtype == getattr(torch, expected), (path, asked)
        finally:
            engine.executor.close()
            engine.grammars.close()
