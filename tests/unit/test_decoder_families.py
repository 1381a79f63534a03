"""csrc/decoder.cpp's fused layer stack runs Gemma 1/2/3, OLMo 2, Granite, Phi-3 and the
mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE) with the same bits as CausalLM's
Python layer loop (``_layer``) over the same kernels: sandwich and post-only norms,
tanh-GELU, attention soft-capping, per-layer sliding windows and RoPE tables, query scale,
q/k norms per head and over the whole projection, residual scaling, partial rotary (Phi-3's
tiny model: 12 of 16 dims), the MoE block (router, top-k and its renormalisation, routing
weights in fp32 or the model dtype, Qwen2-MoE's gated shared expert, MoE and dense layers
in one stack).

On tiny random models (tests/families.py; the logits and greedy tests of test_families.py
hold the Python loop to transformers): a prefill past the sliding window for one sequence
and a shorter one beside it, then decode steps, in fp32 and bf16 (and over an int8 KV
cache): every step's hidden states, logits and the KV cache bit-equal. Each feature has a
negative control: the stack built with it switched off gives other logits than the loop
with it on, so the equality would notice a stack that ignored it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.families import WINDOW, build
from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.config import ModelConfig
from tokenserve.models.decoder import CausalLM
from tokenserve.models.loader import load_config, load_weights
from tokenserve.ops.dispatch import load_kernels

C = load_kernels()
pytestmark = pytest.mark.skipif(C is None or not hasattr(C, "gelu_tanh_and_mul"),
                                reason="tokenserve._C (Decoder, gelu_tanh_and_mul) not built")

BLOCK = 4
PREFILL = (WINDOW + 9, 6)  # seq 0 past the window, seq 1 inside it
DECODES = 4


@pytest.fixture(scope="module",
                params=["gemma", "gemma2", "gemma3_text", "olmo2", "granite", "phi3", "mixtral",
                        "qwen2_moe", "qwen3_moe"])
def family(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    build(request.param, d)
    return request.param, load_config(d), load_weights(d, torch.float32)


def _model(cfg: ModelConfig, sd: dict, dtype: torch.dtype) -> CausalLM:
    return CausalLM.from_state_dict(cfg, dict(sd), dtype, torch.device("cpu"))


def _run(model: CausalLM, fused: bool, kv_dtype: torch.dtype | None = None,
         ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Prefill both sequences (over out-of-order blocks), then DECODES steps of both: each
    step's hidden states and logits, and the KV region at the end."""
    saved, model.decoder = model.decoder, (model.decoder if fused else None)
    try:
        total = max(PREFILL) + DECODES
        per = -(-total // BLOCK)
        kv = model.allocate_kv_cache(num_blocks=2 * per + 1, block_size=BLOCK,
                                     kv_dtype=kv_dtype)
        tables = [list(range(2 * per, per, -1)), list(range(per))]
        g = torch.Generator().manual_seed(7)
        hiddens, logits = [], []
        done = [0, 0]
        q_lens = list(PREFILL)
        for _ in range(1 + DECODES):
            meta = AttentionMetadata.build(model.kernels, tables, q_lens, list(done), BLOCK)
            ids = torch.randint(3, model.cfg.vocab_size, (sum(q_lens),), generator=g)
            h = model.forward(ids, kv, meta)
            hiddens.append(h.clone())
            logits.append(model.compute_logits(h))
            done = [d + q for d, q in zip(done, q_lens)]
            q_lens = [1, 1]
        return hiddens, logits, kv[0][0]._base.clone()
    finally:
        model.decoder = saved


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                            (torch.bfloat16, torch.int8)])
def test_fused_stack_equals_python_loop(family, dtype, kv_dtype):
    name, cfg, sd = family
    model = _model(cfg, sd, dtype)
    assert model.decoder is not None and model.decoder.num_layers == cfg.num_layers
    arch = model.arch
    assert {"gemma": arch.act == "gelu_tanh" and arch.embed_scale != 1.0,
            "gemma2": arch.post_mlp_norm and arch.attn_softcap > 0 and arch.attn_scale,
            "gemma3_text": arch.qk_norm == "head" and len({la.rope for la in arch.layers}) == 2,
            "olmo2": arch.qk_norm == "full" and not arch.pre_attn_norm,
            "granite": arch.residual_scale != 1.0 and arch.embed_scale != 1.0,
            "phi3": 0 < arch.ropes[0].rotary_dim < cfg.head_dim,
            "mixtral": arch.moe is not None and arch.moe.weights_fp32 and arch.moe.norm_topk_prob,
            "qwen2_moe": (arch.moe is not None and arch.moe.shared_intermediate_size > 0
                          and [la.moe for la in arch.layers] == [True, False]),
            "qwen3_moe": (arch.moe is not None and arch.moe.norm_topk_prob
                          and not arch.moe.weights_fp32 and arch.qk_norm == "head")}[name]
    if name.startswith("gemma") and name != "gemma":
        assert {la.window for la in arch.layers} == {0, WINDOW} and PREFILL[0] > WINDOW
    h_c, l_c, kv_c = _run(model, True, kv_dtype)
    h_py, l_py, kv_py = _run(model, False, kv_dtype)
    for step, (a, b, la, lb) in enumerate(zip(h_c, h_py, l_c, l_py)):
        assert a.dtype == dtype and torch.isfinite(la).all()
        assert torch.equal(a, b), f"{name} {dtype}: hidden states differ at step {step}"
        assert torch.equal(la, lb), f"{name} {dtype}: logits differ at step {step}"
    assert torch.equal(kv_c, kv_py)


def _off(arch, **changes):
    return dataclasses.replace(arch, **changes)


def _layers(**changes):
    return lambda a: _off(a, layers=tuple(dataclasses.replace(la, **changes) for la in a.layers))


#: family -> feature of the fused stack -> the arch with it switched off
CONTROLS = {
    "gemma": {"tanh-GELU": lambda a: _off(a, act="silu")},
    "gemma2": {"attention soft-cap": lambda a: _off(a, attn_softcap=0.0),
               "query scale": lambda a: _off(a, attn_scale=None),
               "sliding window": _layers(window=0),
               "post-attention norm": lambda a: _off(a, post_attn_norm=False),
               "post-MLP norm": lambda a: _off(a, post_mlp_norm=False),
               "pre-MLP norm": lambda a: _off(a, pre_mlp_norm=False)},
    "gemma3_text": {"per-layer rope": _layers(rope=0),
                    "per-head q/k norm": lambda a: _off(a, qk_norm=None)},
    "olmo2": {"whole-projection q/k norm": lambda a: _off(a, qk_norm=None),
              "post-attention norm": lambda a: _off(a, post_attn_norm=False),
              "post-MLP norm": lambda a: _off(a, post_mlp_norm=False)},
    "granite": {"residual scale": lambda a: _off(a, residual_scale=1.0)},
    "phi3": {"partial rotary width": lambda a: _off(a, ropes=tuple(
        dataclasses.replace(r, rotary_dim=r.rotary_dim // 2) for r in a.ropes))},
    "mixtral": {"top-k experts": lambda a: _off(a, moe=dataclasses.replace(a.moe, top_k=1))},
    "qwen2_moe": {"shared expert": lambda a: _off(a, moe=dataclasses.replace(
        a.moe, shared_intermediate_size=0))},
    "qwen3_moe": {"top-k renormalisation": lambda a: _off(a, moe=dataclasses.replace(
        a.moe, norm_topk_prob=False))},
}


def test_negative_controls(family):
    """The stack without one feature (but the same weights) gives other logits than the loop
    with it: the bit-equality above would fail if the stack dropped that feature."""
    name, cfg, sd = family
    model = _model(cfg, sd, torch.float32)
    _, loop, _ = _run(model, False)
    for feature, edit in CONTROLS[name].items():
        off = _model(dataclasses.replace(cfg, arch=edit(cfg.arch)), sd, torch.float32)
        for role in ("attn_post", "ln2", "mlp_post"):  # the same norm weights, only unused
            for a, b in zip(off.layers, model.layers):
                a[role] = b[role]
        off.decoder = off._build_decoder()
        assert off.decoder is not None, feature
        _, fused, _ = _run(off, True)
        diff = max((a - b).abs().max().item() for a, b in zip(fused, loop))
        assert diff > 1e-3, f"{name}: the stack without {feature} gives the same logits"


def test_stack_refuses_what_it_does_not_compute(family):
    """Exact GELU: the Python loop (``decoder`` None)."""
    _, cfg, sd = family
    for edit in (lambda a: _off(a, act="gelu"),):
        arch = edit(cfg.arch)
        assert not arch.fused_layers
        assert _model(dataclasses.replace(cfg, arch=arch), sd, torch.float32).decoder is None


def test_fused_decoder_off_by_env(family, monkeypatch):
    _, cfg, sd = family
    monkeypatch.setenv("TOKENSERVE_FUSED_DECODER", "0")
    model = _model(cfg, sd, torch.float32)
    assert model.decoder is None
    monkeypatch.delenv("TOKENSERVE_FUSED_DECODER")
    h, _, _ = _run(model, False)  # the loop runs it
    assert torch.isfinite(h[-1]).all()


def test_add_layer_checks_its_blocks():
    dec = C.Decoder(4, 2, 16, 1e-5, 0.25)
    spec = (0, torch.zeros(1), None, 0, 1, None)
    with pytest.raises(RuntimeError, match="act"):
        dec.add_layer(spec, spec, spec, spec, None, None, act="relu")
    with pytest.raises(RuntimeError, match="qk_norm"):
        dec.add_layer(spec, spec, spec, spec, None, None, qk_norm="half")
    with pytest.raises(RuntimeError, match="q/k norm weights"):
        dec.add_layer(spec, spec, spec, spec, None, None, q_norm=torch.ones(16),
                      k_norm=torch.ones(16), qk_norm="full")
    with pytest.raises(RuntimeError, match="softcap"):
        dec.add_layer(spec, spec, spec, spec, None, None, softcap=-1.0)
