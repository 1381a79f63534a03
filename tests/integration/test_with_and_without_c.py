"""Greedy output on the real model is the same with the C++ kernels and with the pure-torch
references (fp32), through the engine's own ModelRunner: a prefill in two chunks, then
decode steps over the paged cache."""

from __future__ import annotations

import pytest
import torch

from tokenserve.engine.model_runner import ModelRunner
from tokenserve.messages import ScheduledSeq, SeqStart, StepPlan
from tokenserve.models.decoder import CausalLM
from tokenserve.models.loader import load_config, load_weights, resolve_model
from tokenserve.models.tokenizer import Tokenizer
from tokenserve.ops.dispatch import Kernels, load_kernels
from tokenserve.sampling_params import SamplingParams

PROMPTS = [
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    ",
]
STEPS = 24


def _greedy(model: CausalLM, ids: list[int]) -> list[int]:
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    table = [6, 2, 7, 1, 5, 3]
    hist, out = list(ids), []
    greedy = SamplingParams(do_sample=False)
    half = len(ids) // 2
    runner.step(StepPlan(0, [ScheduledSeq("r", tuple(hist[:half]), 0, tuple(table), False,
                                          greedy, SeqStart(tuple(hist), len(hist)))]))
    start = half
    for step in range(STEPS):
        res = runner.step(StepPlan(step + 1, [ScheduledSeq("r", tuple(hist[start:]), start,
                                                           tuple(table), True, greedy)]))
        start = len(hist)
        hist.append(res.sampled["r"])
        out.append(res.sampled["r"])
    return out


def test_greedy_identical_with_and_without_c(monkeypatch):
    if load_kernels() is None:
        pytest.skip("tokenserve._C is not built (CI always builds it)")
    d = resolve_model(None)
    cfg = load_config(d)
    weights = load_weights(d, torch.float32)
    tok = Tokenizer(d)
    with_c = CausalLM.from_state_dict(cfg, weights, torch.float32, torch.device("cpu"))
    assert with_c.kernels.c is not None and with_c.lm_head.backend == "tokenserve.gemm"
    monkeypatch.setenv("TOKENSERVE_DISABLE_C", "1")
    without = CausalLM.from_state_dict(cfg, weights, torch.float32, torch.device("cpu"),
                                               Kernels(use_c=False))
    assert without.kernels.c is None and without.lm_head.backend == "torch"
    for prompt in PROMPTS:
        ids = tok.encode(prompt, add_special_tokens=False)
        a, b = _greedy(with_c, ids), _greedy(without, ids)
        assert a == b, (tok.decode(a), tok.decode(b))
