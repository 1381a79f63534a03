"""Our paged Llama against transformers' LlamaForCausalLM on a tiny random model (fp32).

Covers the paged-KV paths the engine uses: whole-prompt prefill, chunked prefill over a
cached prefix, batched decode with padded contexts, GQA, non-contiguous block tables.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.tiny_llama import tiny_llama_pair
from tokenserve.engine.model_runner import ModelRunner
from tokenserve.messages import ScheduledSeq, SeqStart, StepPlan
from tokenserve.sampling_params import SamplingParams

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_pair(tmp_path_factory.mktemp("tiny-llama"))


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


class Capture:
    """Records the logits the runner computes (the rows it samples from)."""

    def __init__(self, model):
        self.rows = []
        self._orig = model.compute_logits
        model.compute_logits = self

    def __call__(self, hidden):
        out = self._orig(hidden)
        self.rows.append(out)
        return out


def seq(rid, ids, start, n, table, sample=True):
    return ScheduledSeq(rid, tuple(ids[start:start + n]), start, tuple(table), sample,
                        SamplingParams(seed=0), SeqStart(tuple(ids), len(ids)))


def test_prefill_logits_match_transformers(tiny):
    hf, ours = tiny
    runner = ModelRunner(ours, num_blocks=16, block_size=BLOCK)
    cap = Capture(ours)
    ids = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    runner.step(StepPlan(0, [seq("a", ids, 0, 11, [3, 9, 5])]))  # scattered blocks
    torch.testing.assert_close(cap.rows[0][0], hf_logits(hf, ids)[-1], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_and_mixed_decode_match_transformers(tiny):
    hf, ours = tiny
    runner = ModelRunner(ours, num_blocks=16, block_size=BLOCK)
    cap = Capture(ours)
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 97, (14,), generator=g).tolist()
    b = torch.randint(0, 97, (3,), generator=g).tolist()
    ta, tb = [0, 7, 2, 12], [4]
    runner.step(StepPlan(0, [seq("a", a, 0, 6, ta, sample=False)]))
    runner.step(StepPlan(1, [seq("a", a, 6, 7, ta)]))  # chunk over a cached prefix
    # one step mixing a decode (a) with a fresh prefill (b)
    runner.step(StepPlan(2, [seq("b", b, 0, 3, tb), seq("a", a, 13, 1, ta)]))
    ref_a = hf_logits(hf, a)
    torch.testing.assert_close(cap.rows[0][0], ref_a[12], rtol=1e-4, atol=1e-4)
    # rows in plan order: row 0 is b's prefill, row 1 is a's decode
    torch.testing.assert_close(cap.rows[1][1], ref_a[13], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cap.rows[1][0], hf_logits(hf, b)[-1], rtol=1e-4, atol=1e-4)


def test_batched_decode_of_different_lengths(tiny):
    hf, ours = tiny
    runner = ModelRunner(ours, num_blocks=32, block_size=BLOCK)
    cap = Capture(ours)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 5, 9)]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    runner.step(StepPlan(0, [seq(f"r{i}", p, 0, len(p), t) for i, p, t in
                             zip(range(3), prompts, tables)]))
    nxt = [int(r.argmax()) for r in cap.rows[0]]
    full = [p + [t] for p, t in zip(prompts, nxt)]
    runner.step(StepPlan(1, [seq(f"r{i}", f, len(f) - 1, 1, t) for i, f, t in
                             zip(range(3), full, tables)]))
    for i, f in enumerate(full):
        torch.testing.assert_close(cap.rows[1][i], hf_logits(hf, f)[-1], rtol=1e-4, atol=1e-4)


def test_decodes_of_very_different_lengths_in_any_order(tiny):
    """Decodes of very different context lengths come in any order in one step; each
    request's greedy token equals transformers'."""
    hf, ours = tiny
    runner = ModelRunner(ours, num_blocks=64, block_size=BLOCK)
    g = torch.Generator().manual_seed(5)
    lens = (40, 3, 4, 18, 3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lens]
    tables, nxt = [], 0
    for n in lens:
        k = n // BLOCK + 1
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    runner.step(StepPlan(0, [seq(f"r{i}", p, 0, len(p) - 1, t, sample=False)
                             for i, (p, t) in enumerate(zip(prompts, tables)) if len(p) > 1]))
    greedy = SamplingParams(do_sample=False)
    res = runner.step(StepPlan(1, [
        ScheduledSeq(f"r{i}", tuple(p[-1:]), len(p) - 1, tuple(t), True, greedy,
                     SeqStart(tuple(p), len(p)))
        for i, (p, t) in enumerate(zip(prompts, tables))]))
    assert res.sampled == {f"r{i}": int(hf_logits(hf, p)[-1].argmax())
                           for i, p in enumerate(prompts)}
