"""``--quantization gguf`` and ``int8`` on the default model (SmolLM2-135M-Instruct).

gguf: Q4_1 layers and a tied Q8_0 embedding / lm_head, kept as the file's blocks
(csrc/quant.cpp). int8: every projection and the tied lm_head int8 per output channel
(csrc/int8_gemm.cpp), the embedding table as loaded. Either way the engine reports the
smaller weights, answers the chat prompt with "Paris", and a greedy request's tokens are the
same alone and in a batch of 16 (batch invariance).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from tokenserve.config import EngineConfig
from tokenserve.engine.engine import AsyncEngine
from tokenserve.messages import GenerateRequest
from tokenserve.models.llama import LlamaForCausalLM
from tokenserve.models.loader import ModelConfig, load_weights, resolve_model, resolve_quantization
from tokenserve.ops import load_kernels
from tokenserve.ops.quant import QuantWeight
from tokenserve.ops.quant_int8 import Int8Weight
from tokenserve.sampling_params import SamplingParams

C = load_kernels()
needs_c = pytest.mark.skipif(
    C is None or not hasattr(C, "quant_gemm") or not hasattr(C, "int8_gemm"),
    reason="tokenserve._C (quant_gemm, int8_gemm) not built")

_ids = itertools.count()


def test_auto_resolution():
    assert resolve_quantization("auto", None) == "gguf"
    assert resolve_quantization("auto", None, torch.bfloat16, 8) == "gguf"
    assert resolve_quantization("auto", None, torch.bfloat16, 200) == "none"  # bf16 wins at 16+
    assert resolve_quantization("gguf", None, torch.bfloat16, 200) == "gguf"
    assert resolve_quantization("auto", None, torch.float32) == "none"
    assert resolve_quantization("none", None) == "none"
    d = str(resolve_model(None))
    assert resolve_quantization("auto", d) == "none"  # a Hugging Face directory
    with pytest.raises(ValueError, match="needs a .gguf"):
        resolve_quantization("gguf", d)
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="int4")


@needs_c
def test_loader_keeps_blocks_and_model_is_smaller():
    d = resolve_model(None)
    cfg = ModelConfig.from_dir(d)
    sd = load_weights(d, torch.bfloat16, "gguf")
    embed = sd["model.embed_tokens.weight"]
    assert isinstance(embed, QuantWeight) and embed.qtype == "q8_0"
    assert embed.shape == (cfg.vocab_size, cfg.hidden_size)
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantWeight) and q.qtype == "q4_1"
    assert sd["model.norm.weight"].dtype == torch.bfloat16
    model = LlamaForCausalLM.from_state_dict(cfg, sd, torch.bfloat16, torch.device("cpu"))
    assert model.lm_head.backend == "tokenserve.quant_gemm"
    assert model.lm_head.qweight is model.w["embed"]  # tied: one copy of the table
    assert model.layers[0]["qkv"].qweight.shape == (
        (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)
    assert model.weight_bytes < 100 * 2**20  # ~92 MiB; bf16 is ~310 MiB
    assert model.dtype == torch.bfloat16


def test_int8_resolution_any_model():
    assert resolve_quantization("int8", None) == "int8"
    assert resolve_quantization("int8", str(resolve_model(None))) == "int8"  # HF directory
    assert EngineConfig(quantization="int8").quantization == "int8"


@needs_c
def test_loader_quantises_projections_and_keeps_the_table():
    d = resolve_model(None)
    cfg = ModelConfig.from_dir(d)
    sd = load_weights(d, torch.bfloat16, "int8")
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, Int8Weight) and q.table is None
    embed = sd["model.embed_tokens.weight"]
    assert isinstance(embed, Int8Weight) and embed.table.dtype == torch.bfloat16  # tied
    assert sd["model.norm.weight"].dtype == torch.bfloat16
    model = LlamaForCausalLM.from_state_dict(cfg, sd, torch.bfloat16, torch.device("cpu"))
    assert model.lm_head.backend == "tokenserve.int8_gemm"
    assert model.layers[0]["qkv"].backend == "tokenserve.int8_gemm"
    assert model.w["embed"] is model.lm_head.qweight  # one object: int8 head + table
    ids = torch.tensor([1, 2, 3, 49151])
    assert torch.equal(model.kernels.embedding(ids, model.w["embed"], torch.bfloat16),
                       embed.table[ids])
    assert model.weight_bytes < 200 * 2**20  # ~163 MiB; bf16 is ~310 MiB
    assert model.weight_formats == "int8 x 121"


async def _generate(engine: AsyncEngine, ids: list[int], **params) -> list[int]:
    g = GenerateRequest(f"q-{next(_ids)}", tuple(ids),
                        SamplingParams(**{"max_new_tokens": 24, **params}))
    out = []
    async for o in engine.generate(g):
        assert o.error is None, o.error
        out += o.new_token_ids
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=["gguf", "int8"])
async def engine(request):
    cfg = EngineConfig(dtype="bfloat16", device="cpu", block_size=16, kv_cache_bytes=128 << 20,
                       max_batch_size=32, quantization=request.param)
    e = await asyncio.to_thread(AsyncEngine.build, cfg)
    await e.start()
    yield e
    await e.stop()


@needs_c
@pytest.mark.asyncio(loop_scope="session")
async def test_chat_answer_is_sensible_english(engine):
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True)
    out = await _generate(engine, tok.encode(text, add_special_tokens=False), do_sample=False)
    answer = tok.decode(out)
    assert "Paris" in answer, answer
    assert 50 * 2**20 < engine.info.weights_bytes < 200 * 2**20  # bf16 is ~310 MiB


@needs_c
@pytest.mark.asyncio(loop_scope="session")
async def test_greedy_identical_alone_and_in_a_batch_of_16(engine):
    tok = engine.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
        add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    alone = await _generate(engine, prompt, do_sample=False, ignore_eos=True)
    rng = random.Random(5)
    others = [[rng.randrange(100, 40000) for _ in range(rng.randrange(1, 60))] for _ in range(15)]
    results = await asyncio.gather(
        _generate(engine, prompt, do_sample=False, ignore_eos=True),
        *(_generate(engine, o, do_sample=rng.random() < 0.5, seed=rng.randrange(1 << 30),
                    max_new_tokens=rng.randrange(1, 30)) for o in others))
    assert results[0] == alone, (tok.decode(alone), tok.decode(results[0]))
    await engine.wait_idle(timeout=30)
    st = engine.stats()
    assert st.num_free_blocks == st.num_blocks, "KV blocks leaked"


def test_cli_flag_and_config_key(tmp_path, monkeypatch):
    import json

    from tokenserve.cli import build_parser, serve_config
    from tokenserve.mindie_config import load_mindie_config

    monkeypatch.delenv("MIES_CONFIG_JSON_PATH", raising=False)
    args = build_parser().parse_args(["serve", "--quantization", "none"])
    assert serve_config(args).engine.quantization == "none"
    assert serve_config(build_parser().parse_args(["serve"])).engine.quantization == "auto"
    cfg = json.loads(Path("examples/config.json").read_text(encoding="utf-8"))
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["quantization"] = "gguf"
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0].pop("modelWeightPath", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    assert load_mindie_config(path).engine.quantization == "gguf"
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["quantization"] = "int3"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    with pytest.raises(ValueError, match="quantization"):
        load_mindie_config(path)


@needs_c
@pytest.mark.asyncio(loop_scope="session")
async def test_metrics_gauge_reports_the_weights(engine):
    from tokenserve.http.metrics import ServerMetrics

    text = ServerMetrics(engine).render().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("model_weights_bytes{"))
    assert float(line.rsplit(" ", 1)[1]) == engine.info.weights_bytes


def test_cli_flag(monkeypatch):
    from tokenserve.cli import build_parser, serve_config

    monkeypatch.delenv("MIES_CONFIG_JSON_PATH", raising=False)
    args = build_parser().parse_args(["serve", "--quantization", "int8"])
    assert serve_config(args).engine.quantization == "int8"
