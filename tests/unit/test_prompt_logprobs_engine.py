"""Prompt log-probabilities, piece by piece: the model thread (tiny random model against
transformers), the scheduler (prefill-only requests, the prefix-cache skip), the actor's
gathering across chunks and recomputes, and the OpenAI / vLLM answer shapes."""

from __future__ import annotations

import orjson
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.tiny_llama import tiny_llama_pair
from tokenserve.api.openai.protocol import (
    LOGPROB_FLOOR,
    completion_prompt_logprobs,
    join_logprobs,
    parse_chat_body,
    parse_completion_body,
)
from tokenserve.api.vllm.protocol import vllm_prompt_logprobs
from tokenserve.engine import model_runner
from tokenserve.engine.block_pool import BlockPool
from tokenserve.engine.model_runner import ModelRunner
from tokenserve.engine.request import Request
from tokenserve.engine.scheduler import Scheduler, SchedulerConfig
from tokenserve.engine.scheduler_actor import _Tracked
from tokenserve.messages import FinishReason, PromptLogprobs, ScheduledSeq, SeqStart, StepPlan
from tokenserve.messages import TokenLogprob as TL
from tokenserve.sampling_params import SamplingParams

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_pair(tmp_path_factory.mktemp("tiny-llama-plp"))


@pytest.mark.parametrize("chunks", [[11], [4, 4, 3], [1, 7, 3]])
def test_runner_prompt_logprobs_equal_transformers(tiny, monkeypatch, chunks):
    """Every prompt position's fp32 log-softmax, carried across chunks, in lm_head slices
    of 2 rows; the sampled token's own logprob is not a prompt entry."""
    hf, ours = tiny
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 2)
    ids = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)[:-1]
    runner = ModelRunner(ours, num_blocks=16, block_size=BLOCK)
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=3, seed=0)
    table = (3, 9, 5)
    start, got = 0, []
    for step, n in enumerate(chunks):
        last = start + n == len(ids)
        seq = ScheduledSeq("a", tuple(ids[start:start + n]), start, table, last, params,
                           SeqStart(tuple(ids), len(ids)) if step == 0 else None,
                           prompt_logprobs=True)
        res = runner.step(StepPlan(step, (seq,)))
        plp = res.prompt_logprobs["a"]
        assert plp.start == start + 1 == len(got) + 1
        got.extend(plp.entries)
        start += n
    assert len(got) == len(ids) - 1
    assert [e.token_id for e in got] == ids[1:]
    want = ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor([e.logprob for e in got]), want, rtol=1e-4, atol=1e-4)
    top_i = ref.topk(3, dim=-1).indices
    for j, e in enumerate(got):
        assert [t for t, _ in e.top] == top_i[j].tolist()
        assert e.rank == int((ref[j] > ref[j, ids[j + 1]]).sum()) + 1


def test_runner_skips_rows_past_the_prompt(tiny):
    """A seq whose positions predict no prompt token (the last position, or a recompute
    over generated tokens) returns no entries."""
    _, ours = tiny
    runner = ModelRunner(ours, num_blocks=8, block_size=BLOCK)
    params = SamplingParams(max_new_tokens=2, prompt_logprobs=0, seed=0)
    ids = [5, 6, 7]
    res = runner.step(StepPlan(0, (ScheduledSeq("b", (5, 6), 0, (0,), False, params,
                                                SeqStart(tuple(ids), 3), prompt_logprobs=True),)))
    assert res.prompt_logprobs["b"].start == 1 and len(res.prompt_logprobs["b"].entries) == 2
    res = runner.step(StepPlan(1, (ScheduledSeq("b", (7,), 2, (0,), True, params,
                                                prompt_logprobs=True),)))
    assert "b" not in res.prompt_logprobs and "b" in res.sampled


# ----------------------------------------------------------------------------- scheduler


def sched(caching=True, budget=4):
    pool = BlockPool(32, BLOCK, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_seq_len=64,
                                     long_prefill_token_threshold=budget), pool)


def request(rid, tokens, max_new=0, plp=0):
    return Request(rid, list(tokens), len(tokens),
                   SamplingParams(max_new_tokens=max_new, prompt_logprobs=plp, seed=0),
                   priority=5, arrival_time=0.0, arrival_seq=0)


def test_prefill_only_request_ends_with_length_and_frees_its_blocks():
    s = sched()
    s.add(request("p", range(10, 20)))  # 10 tokens, 4 per step
    flags = []
    done = []
    while s.has_work():
        seqs = s.schedule()
        flags += [(q.num_computed, len(q.token_ids), q.sample, q.prompt_logprobs) for q in seqs]
        done += s.update(seqs, {}, 1.0)
    assert flags == [(0, 4, False, True), (4, 4, False, True), (8, 2, False, True)]
    (req, toks), = done
    assert toks == [] and req.finish_reason is FinishReason.LENGTH and req.num_output_tokens == 0
    assert s.pool.num_free == s.pool.num_blocks  # cached blocks are evictable, hence free
    assert s.take_dropped() == ("p",)


def test_prompt_logprobs_skip_the_prefix_cache_lookup():
    s = sched(budget=16)
    prompt = list(range(40, 52))  # 3 full blocks
    plain = request("plain", prompt, max_new=1, plp=None)
    s.add(plain)
    s.update(s.schedule(), {"plain": 7}, 1.0)
    assert plain.finished
    s.add(request("again", prompt, max_new=1, plp=None))
    seqs = s.schedule()
    assert seqs[0].num_computed == 8  # the cache serves it (last block recomputed)
    s.update(seqs, {"again": 7}, 1.0)
    asks = request("asks", prompt, max_new=1, plp=1)
    s.add(asks)
    (seq,) = s.schedule()
    assert seq.num_computed == 0 and len(seq.token_ids) == 12 and seq.prompt_logprobs
    s.update([seq], {"asks": 7}, 1.0)
    assert asks.num_cached_tokens == 0


def test_recompute_after_output_sends_no_prompt_logprobs():
    s = sched(budget=16)
    r = request("r", range(60, 66), max_new=5, plp=0)
    s.add(r)
    s.update(s.schedule(), {"r": 9}, 1.0)
    s._preempt(r)  # recompute: prompt + its output again
    (seq,) = s.schedule()
    # its prompt logprobs were sent: no more, and the prefix cache serves it again
    assert seq.num_computed == BLOCK and not seq.prompt_logprobs


def test_actor_gathers_chunks_and_skips_recomputed_positions():
    t = _Tracked(None, None, None, 0.0, 0)
    t.prompt_lps = [None]
    e = [TL(10 + i, -float(i)) for i in range(6)]
    t.add_prompt_logprobs(PromptLogprobs(1, tuple(e[1:3])))  # positions 1, 2
    assert t.take_prompt_logprobs(6) is None  # not complete yet
    t.add_prompt_logprobs(PromptLogprobs(1, tuple(e[1:4])))  # preempted: recomputed 1..3
    t.add_prompt_logprobs(PromptLogprobs(4, tuple(e[4:6])))
    assert t.take_prompt_logprobs(6) == (None, *e[1:6])
    assert t.take_prompt_logprobs(6) is None  # sent once


# ----------------------------------------------------------------------------- the answers


class Texts:
    def get(self, tid):
        text = {1: "A", 2: "bc", 3: "d", 4: "ee"}[tid]
        return text, list(text.encode())


def test_completion_prompt_logprobs_shape():
    entries = (None, TL(2, -1.5, ((3, -0.5), (2, -1.5))), TL(4, -float("inf"), ((3, -0.1),)))
    out = completion_prompt_logprobs((1, 2, 4), entries, Texts(), k=1)
    assert out == {"tokens": ["A", "bc", "ee"],
                   "token_logprobs": [None, -1.5, LOGPROB_FLOOR],
                   "top_logprobs": [None, {"d": -0.5, "bc": -1.5}, {"d": -0.1, "ee": LOGPROB_FLOOR}],
                   "text_offset": [0, 1, 3]}
    tail = {"tokens": ["d"], "token_logprobs": [-0.2], "top_logprobs": [{"d": -0.2}],
            "text_offset": [5]}
    joined = join_logprobs(out, tail)
    assert joined["tokens"] == ["A", "bc", "ee", "d"] and joined["text_offset"][-1] == 5
    assert join_logprobs(None, tail) is tail


def test_vllm_prompt_logprobs_shape():
    entries = (None, TL(2, -1.5, ((3, -0.5), (2, -1.5)), rank=2), TL(3, -0.1, ((3, -0.1),), 1))
    out = vllm_prompt_logprobs(entries, lambda t: Texts().get(t)[0], k=2)
    assert out[0] is None
    assert out[1] == {"2": {"logprob": -1.5, "rank": 2, "decoded_token": "bc"},
                      "3": {"logprob": -0.5, "rank": 1, "decoded_token": "d"}}
    assert list(out[2]) == ["3"]


def body(**kw):
    return {"model": "m", "prompt": "hi", **kw}


def test_parse_echo_logprobs_max_tokens_0_and_prompt_logprobs():
    b = parse_completion_body(body(echo=True, logprobs=1, max_tokens=0), 100)
    assert b.max_tokens == 0 and b.sampling["prompt_logprobs"] == 1 and b.echo
    assert "prompt_logprobs" not in parse_completion_body(body(logprobs=1), 100).sampling
    b = parse_completion_body(body(prompt_logprobs=4, echo=True, logprobs=1), 100)
    assert b.sampling["prompt_logprobs"] == 4 and b.prompt_logprobs == 4
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 1.5},
                {"max_tokens": -1}):
        with pytest.raises(ValueError, match="prompt_logprobs|max_tokens"):
            parse_completion_body(body(**bad), 100)
    with pytest.raises(ValueError, match="max_tokens"):  # chat still needs a token
        parse_chat_body({"model": "m", "messages": [{"role": "user", "content": "x"}],
                         "max_tokens": 0})


def test_sampling_params_prompt_only():
    assert SamplingParams(max_new_tokens=0).max_new_tokens == 0
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=-1)


# ----------------------------------------------------------------- the routes (fake engine)


@pytest.fixture
async def fake():
    from tests.fakes import FakeEngine, serve_fake

    engine = FakeEngine()
    async with serve_fake(engine) as (_, client):
        yield engine, client


async def test_vllm_generate_prompt_logprobs(fake):
    """vLLM ``/generate`` ``prompt_logprobs``: one list for the prompt (the fake engine's
    logprob of position i is -i), in the answer and in the stream's first chunk; only the
    first of ``n`` sequences computes it; out of range is a 422."""
    engine, client = fake
    body = {"prompt": "xyz", "max_tokens": 2, "prompt_logprobs": 0}
    out = (await client.post("/generate", json=body)).json()
    assert out["prompt_logprobs"] == [
        None, {"121": {"logprob": -1.0, "rank": 1, "decoded_token": "y"}},
        {"122": {"logprob": -2.0, "rank": 2, "decoded_token": "z"}}]
    r = await client.post("/generate", json={**body, "stream": True})
    chunks = [orjson.loads(c) for c in r.content.split(b"\0") if c]
    assert chunks[0]["prompt_logprobs"] == out["prompt_logprobs"]
    assert all("prompt_logprobs" not in c for c in chunks[1:])
    await client.post("/generate", json={**body, "n": 2, "temperature": 1})
    assert [r.params.prompt_logprobs for r in engine.requests[-2:]] == [0, None]
    r = await client.post("/generate", json={**body, "prompt_logprobs": 21})
    assert r.status_code == 422 and "prompt_logprobs" in r.text
    assert "prompt_logprobs" not in (await client.post(
        "/generate", json={"prompt": "xy", "max_tokens": 1})).json()


async def test_openai_echo_prompt_only_shape(fake):
    """``echo`` + ``logprobs`` + ``max_tokens: 0``: the prompt, its tokens and logprobs
    (first null), nothing generated; streamed as one chunk with the prompt then the end."""
    engine, client = fake
    body = {"model": engine.model_name, "prompt": "xyz", "echo": True, "logprobs": 0,
            "max_tokens": 0}
    out = (await client.post("/v1/completions", json=body)).json()
    (choice,) = out["choices"]
    assert choice["text"] == "xyz" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {"tokens": ["x", "y", "z"], "token_logprobs": [None, -1.0, -2.0],
                                  "top_logprobs": [None, {"y": -1.0}, {"z": -2.0}],
                                  "text_offset": [0, 1, 2]}
    assert out["usage"]["completion_tokens"] == 0
    assert engine.requests[-1].params.max_new_tokens == 0
    r = await client.post("/v1/completions", json={**body, "stream": True})
    events = [orjson.loads(line[6:]) for line in r.text.split("\n\n")
              if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == "xyz"
    assert events[0]["choices"][0]["logprobs"] == choice["logprobs"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_openai_chat_prompt_logprobs_top_level():
    """vLLM's chat ``prompt_logprobs``: one top-level list for the rendered prompt; with
    ``stream`` a 422, as vLLM answers."""
    from tests.fakes import serve_fake
    from tests.unit.test_api_openai import OpenAIFakeEngine  # the fake with a chat template

    engine = OpenAIFakeEngine()
    async with serve_fake(engine) as (_, client):
        await _chat_prompt_logprobs(engine, client)


async def _chat_prompt_logprobs(engine, client):
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1, "prompt_logprobs": 0}
    out = (await client.post("/v1/chat/completions", json=body)).json()
    ids = engine.requests[-1].prompt_token_ids
    plp = out["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    text = engine.tokenizer.decode([ids[1]], skip_special_tokens=False)
    assert plp[1] == {str(ids[1]): {"logprob": -1.0, "rank": 1, "decoded_token": text}}
    assert list(out)[-1] == "prompt_logprobs" and "prompt_logprobs" not in out["choices"][0]
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 422 and "prompt_logprobs" in r.text
