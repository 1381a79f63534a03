"""Every served family against transformers on a tiny random model (fp32): logits of a
prefill, and a greedy continuation through the engine's ModelRunner (prefill, then decode
steps over scattered KV blocks) equal to transformers' ``generate``.

Each family's distinguishing features get a negative control: the same weights with the
feature switched off in our :class:`DecoderArch` give other logits, so the comparison can
fail when the feature is missing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.families import FAMILIES, build, hf_greedy
from tokenserve.engine.model_runner import ModelRunner
from tokenserve.messages import ScheduledSeq, SeqStart, StepPlan
from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.config import ModelConfig, RopeSpec
from tokenserve.models.decoder import CausalLM
from tokenserve.models.loader import load_config, load_weights
from tokenserve.sampling_params import SamplingParams

BLOCK = 4
PROMPT_LEN, NEW = 14, 12


def _prompt(seed: int = 1) -> list[int]:
    return torch.randint(3, 40000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)
                         ).tolist()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, d)
    cfg = load_config(d)
    return request.param, hf, cfg, load_weights(d, torch.float32)


def _ours(cfg: ModelConfig, sd: dict) -> CausalLM:
    return CausalLM.from_state_dict(cfg, dict(sd), torch.float32, torch.device("cpu"))


def _prefill_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    nb = -(-len(ids) // BLOCK)
    kv = model.allocate_kv_cache(num_blocks=nb + 2, block_size=BLOCK)
    table = list(range(nb + 1, 0, -1))[:nb]  # reversed: blocks out of order
    meta = AttentionMetadata.build(model.kernels, [table], [len(ids)], [0], BLOCK)
    return model.compute_logits(model.forward(torch.tensor(ids), kv, meta))


def _greedy(model: CausalLM, ids: list[int], n: int, chunk: int = 5) -> list[int]:
    """Greedy tokens through ModelRunner: the prompt in chunks of ``chunk`` tokens, then
    one decode step per token, over a scattered block table."""
    total = len(ids) + n
    nb = -(-total // BLOCK)
    runner = ModelRunner(model, num_blocks=2 * nb + 1, block_size=BLOCK)
    table = tuple(range(2 * nb, 0, -2))[:nb]
    hist, out = list(ids), []
    params = SamplingParams(max_new_tokens=n, seed=0)
    done, step = 0, 0
    while len(out) < n:
        end = min(done + chunk, len(hist)) if done < len(ids) else len(hist)
        last = end == len(hist)
        plan = StepPlan(step, [ScheduledSeq("r", tuple(hist[done:end]), done, table, last,
                                            params, SeqStart(tuple(ids), len(ids)))])
        res = runner.step(plan)
        done, step = end, step + 1
        if last:
            tok = res.sampled["r"]
            hist.append(tok)
            out.append(tok)
    return out


def test_logits_match_transformers(pair):
    _, hf, cfg, sd = pair
    ids = _prompt()
    got = _prefill_logits(_ours(cfg, sd), ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)


def test_greedy_matches_transformers(pair):
    name, hf, cfg, sd = pair
    ids = _prompt(2)
    assert _greedy(_ours(cfg, sd), ids, NEW) == hf_greedy(hf, ids, NEW), name


def _off(arch, **changes):
    return dataclasses.replace(arch, **changes)


def _no_window(a):
    return _off(a, layers=tuple(dataclasses.replace(la, window=0) for la in a.layers))


def _no_scaling(a):
    return _off(a, ropes=tuple(RopeSpec(r.theta, None, r.rotary_dim) for r in a.ropes))


#: family -> feature switched off (a DecoderArch -> DecoderArch edit) for the negative control
CONTROLS = {
    "llama": {"llama3 rope": _no_scaling},
    "llama_bias": {"o_proj bias": lambda a: _off(a, o_bias=False)},
    "mistral": {"sliding window": _no_window},
    "qwen2": {"sliding window": _no_window},
    "qwen3": {"q/k norm": lambda a: _off(a, qk_norm=None)},
    "gemma": {"1 + w norm": lambda a: _off(a, norm_offset=False),
              "embedding scale": lambda a: _off(a, embed_scale=1.0)},
    "gemma2": {"sliding window": _no_window,
               "attention soft-cap": lambda a: _off(a, attn_softcap=0.0),
               "final soft-cap": lambda a: _off(a, final_softcap=0.0),
               "sandwich norms": lambda a: _off(a, post_attn_norm=False, post_mlp_norm=False)},
    "gemma3_text": {"sliding window": _no_window, "q/k norm": lambda a: _off(a, qk_norm=None),
                    "local rope base": lambda a: _off(a, layers=tuple(
                        dataclasses.replace(la, rope=0) for la in a.layers))},
    "phi3": {"partial rotary": lambda a: _off(a, ropes=tuple(
        RopeSpec(r.theta, r.scaling, 16) for r in a.ropes)), "sliding window": _no_window},
    "olmo2": {"q/k norm": lambda a: _off(a, qk_norm=None)},
    "granite": {"residual multiplier": lambda a: _off(a, residual_scale=1.0),
                "embedding multiplier": lambda a: _off(a, embed_scale=1.0),
                "logits scaling": lambda a: _off(a, logits_divisor=1.0)},
    "mixtral": {"top-k renormalisation": lambda a: _off(
        a, moe=dataclasses.replace(a.moe, norm_topk_prob=False))},
    "qwen2_moe": {"shared expert": lambda a: _off(
        a, moe=dataclasses.replace(a.moe, shared_intermediate_size=0))},
    "qwen3_moe": {"top-k renormalisation": lambda a: _off(
        a, moe=dataclasses.replace(a.moe, norm_topk_prob=False))},
}


def test_every_family_has_a_control():
    assert set(CONTROLS) == set(FAMILIES)


def test_negative_controls(pair):
    """Each feature matters on this model: switched off, the logits move well past the
    tolerance of :func:`test_logits_match_transformers`."""
    name, hf, cfg, sd = pair
    ids = _prompt()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    for feature, edit in CONTROLS[name].items():
        off = dataclasses.replace(cfg, arch=edit(cfg.arch))
        got = _prefill_logits(_ours(off, sd), ids)
        assert (got - ref).abs().max() > 0.05, f"{name}: {feature} made no difference"


def test_readme_table_lists_every_served_model_type_and_each_is_tested():
    """Each row of the README's "Models" table is a served model type, every served type
    has a row, and each has a tiny model in tests/families.py (so a row is backed by the
    tests above)."""
    from pathlib import Path

    from tests.families import hf_config
    from tokenserve.models.families import SUPPORTED_MODEL_TYPES

    text = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    section = text.split("## Models\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2].strip().strip("`") for line in section.splitlines()
            if line.startswith("| ") and "`" in line.split("|")[2]][1:]  # after the header
    assert sorted(rows) == sorted(SUPPORTED_MODEL_TYPES)
    from tokenserve.models.gguf_arch import ARCHS
    gguf = {line.split("|")[3].strip().split("`")[1] for line in section.splitlines()
            if line.startswith("| ") and "`" in line.split("|")[2]}
    assert gguf - {"general.architecture"} <= set(ARCHS)
    assert {hf_config(f).model_type for f in FAMILIES} == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gpt_oss", None])
def test_unsupported_architecture_is_refused_in_one_line(tmp_path, model_type):
    import json

    from tokenserve.models.loader import load_config

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": model_type, "architectures": ["SomethingForCausalLM"], "hidden_size": 64,
        "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100}))
    with pytest.raises(ValueError, match="unsupported model_type") as e:
        load_config(tmp_path)
    assert "\n" not in str(e.value) and repr(model_type) in str(e.value)


def test_bidirectional_gemma_is_refused(tmp_path):
    from tests.families import hf_config
    from tokenserve.models.loader import load_config

    cfg = hf_config("gemma3_text")
    cfg.use_bidirectional_attention = True
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        load_config(tmp_path)


@pytest.mark.parametrize("family", ["mistral", "qwen3", "llama_bias"])
def test_fused_layer_stack_runs_windowed_llama_layers_bit_for_bit(tmp_path, family):
    """Mistral's windowed layers, Qwen3's per-head q/k norms and Llama's o bias run in
    csrc/decoder.cpp's fused stack, with the same bits as the Python layer loop over the
    same kernels (the logits tests above hold that loop to transformers)."""
    build(family, tmp_path)
    cfg = load_config(tmp_path)
    model = _ours(cfg, load_weights(tmp_path, torch.float32))
    if model.kernels.c is None:
        pytest.skip("tokenserve._C not built")
    assert model.decoder is not None
    assert {"mistral": cfg.sliding_window, "qwen3": model.arch.qk_norm == "head",
            "llama_bias": model.layers[0]["o"].bias is not None}[family]
    ids = _prompt(5) + _prompt(6)  # 28 tokens, past the window
    fused = _prefill_logits(model, ids)
    model.decoder = None
    assert torch.equal(_prefill_logits(model, ids), fused)
