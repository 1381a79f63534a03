"""The real default model (SmolLM2-135M-Instruct) against transformers, fp32.

Same converted weights in both; our paged-attention forward must give transformers'
logits on three prompts (tight tolerance) and the same 32-token greedy continuation
through the engine's own ModelRunner (prefill, then decode steps over the paged cache).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenserve.engine.model_runner import ModelRunner
from tokenserve.messages import ScheduledSeq, SeqStart, StepPlan
from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.decoder import CausalLM
from tokenserve.models.loader import ensure_float_weights, load_config, load_weights, resolve_model
from tokenserve.models.tokenizer import Tokenizer
from tokenserve.sampling_params import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def models():
    d = resolve_model(None)
    cfg = load_config(d)
    ours = CausalLM.from_state_dict(cfg, load_weights(d, torch.float32), torch.float32,
                                            torch.device("cpu"))
    hf = transformers.LlamaForCausalLM.from_pretrained(ensure_float_weights(d),
                                                    dtype=torch.float32).eval()
    return ours, hf, Tokenizer(d)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(models, prompt):
    ours, hf, tok = models
    ids = tok.encode(prompt, add_special_tokens=False)
    n = len(ids)
    nb = (n + 15) // 16
    kv = ours.allocate_kv_cache(num_blocks=nb, block_size=16)
    meta = AttentionMetadata.build(ours.kernels, [list(range(nb))], [n], [0], 16)
    hidden = ours.forward(torch.tensor(ids), kv, meta)
    got = ours.compute_logits(hidden)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-4)


def test_greedy_continuation_matches_transformers(models):
    ours, hf, tok = models
    ids = tok.encode(PROMPTS[2], add_special_tokens=False)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    runner = ModelRunner(ours, num_blocks=8, block_size=16)
    table = [5, 1, 6, 2, 7, 3]  # deliberately scattered blocks
    hist = list(ids)
    params = SamplingParams(max_new_tokens=32, seed=0)
    out = []
    for step in range(32):
        start = 0 if step == 0 else len(hist) - 1
        plan = StepPlan(step, [ScheduledSeq("r", tuple(hist[start:]), start, tuple(table),
                                            True, params, SeqStart(tuple(hist), len(ids)))])
        tok_id = runner.step(plan).sampled["r"]
        hist.append(tok_id)
        out.append(tok_id)
    assert out == ref, (tok.decode(out), tok.decode(ref))
