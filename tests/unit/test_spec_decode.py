"""Speculative decoding by prompt lookup: the drafter (``engine/ngram.py``), its config,
and the scheduler with drafts on random workloads (hypothesis; a fake greedy model).

The fake model's next token is a deterministic function of the whole history over a small
vocabulary, so histories repeat and drafts are often (not always) right. With drafts on,
every request must produce exactly the tokens it produces with them off, the step budget
and block coverage must hold every step, and every block is free at the end, through
preemptions (a small KV pool), aborts between a step's plan and its result (mid
verification) and requests finishing inside an accepted draft (EOS, length).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenserve.engine.block_pool import BlockPool
from tokenserve.config.tree import SpecConfig
from tokenserve.engine.ngram import propose
from tokenserve.engine.request import Request
from tokenserve.engine.scheduler import Scheduler, SchedulerConfig
from tokenserve.messages import FinishReason
from tokenserve.sampling_params import SamplingParams

EOS = 3


def test_propose_takes_the_latest_longest_match():
    ids = [1, 2, 3, 9, 1, 2, 3, 8, 7, 5, 1, 2, 3]
    # the suffix (1, 2, 3) last occurred at 4..6, followed by 8, 7, 5, 1
    assert propose(ids, 4, 2, 3) == (8, 7, 5, 1)
    assert propose(ids, 2, 2, 3) == (8, 7)
    assert propose([5, 6, 5, 6], 3, 1, 2) == (5, 6)  # stops where the sequence ends
    assert propose([1, 2, 3, 4], 3, 1, 3) == ()  # the suffix never occurred before
    assert propose([4, 4], 3, 1, 1) == (4,)
    assert propose(ids, 0, 1, 3) == ()
    assert propose([7], 3, 1, 3) == ()
    # n_min bounds the match: a 1-token match is not enough with n_min = 2
    assert propose([9, 5, 1, 6, 5], 2, 2, 3) == ()
    assert propose([9, 5, 1, 6, 5], 2, 1, 3) == (1, 6)


def test_spec_config_from_vllm_object():
    c = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5,
                              "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (5, 4, 2)
    for bad, msg in (({"method": "eagle"}, "not supported"),
                     ({"num_speculative_tokens": 0}, ">= 1"),
                     ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                     ({"draft_model": "x"}, "unknown key"),
                     ({"num_speculative_tokens": "4"}, "must be a number"),
                     ({"num_speculative_tokens": 2.5}, "must be a number")):
        with pytest.raises(ValueError, match=msg):
            SpecConfig.from_dict(bad)


def model(history: list[int]) -> int:
    """The fake greedy model: the next token from the last two (vocab 10..15, EOS 3): its
    outputs soon cycle, so prompt lookup finds them."""
    v = (history[-1] * 5 + (history[-2] if len(history) > 1 else 0) * 3) % 37
    return EOS if v == 0 else 10 + v % 6


def verify(history: list[int], draft: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """What the model thread returns for a seq: the first token and the accepted rest."""
    toks = [model(history + list(draft[:j])) for j in range(len(draft) + 1)]
    a = 0
    while a < len(draft) and draft[a] == toks[a]:
        a += 1
    return toks[0], tuple(toks[1:a + 1])


REQUEST = st.tuples(
    st.integers(1, 30),  # prompt tokens
    st.integers(1, 20),  # max_new_tokens
    st.integers(1, 5),  # priority
    st.integers(0, 8),  # arrival step
    st.booleans(),  # ignore_eos
    st.one_of(st.none(), st.integers(0, 30)),  # step at which the client aborts, if any
)


def run(specs, spec: SpecConfig | None, block_size: int, num_blocks: int, budget: int,
        max_batch: int, caching: bool) -> tuple[dict[str, list[int]], Scheduler]:
    """Drive a scheduler over ``specs``; returns each finished request's output ids."""
    cfg = SchedulerConfig(max_batch_size=max_batch, max_num_batched_tokens=budget,
                          max_seq_len=num_blocks * block_size, eos_token_ids=frozenset({EOS}),
                          spec=spec)
    pool = BlockPool(num_blocks, block_size, enable_caching=caching)
    s = Scheduler(cfg, pool)
    seq = itertools.count()
    pending = sorted(enumerate(specs), key=lambda e: e[1][3])
    done: dict[str, list[int]] = {}
    aborts: dict[int, list[str]] = {}
    for step in range(3000):
        while pending and pending[0][1][3] <= step:
            i, (n_prompt, max_new, priority, _, ignore_eos, abort_at) = pending.pop(0)
            # the request must fit an otherwise empty KV cache
            max_new = min(max_new, num_blocks * block_size // 2)
            n_prompt = min(n_prompt, num_blocks * block_size - max_new - 1)
            prompt = [10 + (i * 7 + k * k) % 6 for k in range(n_prompt)]
            rid = f"r{i}"
            s.add(Request(request_id=rid, token_ids=prompt, num_prompt_tokens=len(prompt),
                          params=SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos),
                          priority=priority, arrival_time=0.0, arrival_seq=next(seq)))
            if abort_at is not None:
                aborts.setdefault(abort_at, []).append(rid)
        if not pending and not s.has_work():
            break
        seqs = s.schedule()
        assert sum(len(q.token_ids) for q in seqs) <= budget
        results = {}
        for q in seqs:
            req = s.requests[q.request_id]
            assert len(req.block_table) * block_size >= q.num_computed + len(q.token_ids)
            assert list(q.token_ids[:len(q.token_ids) - len(q.draft)]) == \
                req.token_ids[q.num_computed:q.num_computed + len(q.token_ids) - len(q.draft)]
            if q.draft:
                assert spec is not None and q.sample and len(q.draft) <= spec.num_speculative_tokens
                assert len(q.token_ids) == 1 + len(q.draft)
            if q.sample:
                results[q.request_id] = verify(req.token_ids, q.draft)
        pool.check()
        # clients that leave while the step (and its verification) runs
        for rid in aborts.pop(step, []):
            s.finish(rid, FinishReason.ABORT)
        sampled = {rid: r[0] for rid, r in results.items()}
        accepted = {rid: r[1] for rid, r in results.items() if r[1]}
        for req, _ in s.update(seqs, sampled, float(step), accepted):
            if req.finished:
                done[req.request_id] = req.output_token_ids
        pool.check()
    else:
        raise AssertionError("not done after 3000 steps")
    assert pool.all_free()
    return done, s


@settings(max_examples=120, deadline=None)
@given(
    block_size=st.integers(1, 6),
    num_blocks=st.integers(14, 40),
    budget=st.integers(8, 40),
    max_batch=st.integers(1, 8),
    caching=st.booleans(),
    k=st.integers(1, 6),
    rows=st.integers(1, 8),
    specs=st.lists(REQUEST, min_size=1, max_size=10),
)
def test_drafts_change_no_output_and_leak_no_block(block_size, num_blocks, budget, max_batch,
                                                   caching, k, rows, specs):
    plain, _ = run(specs, None, block_size, num_blocks, budget, max_batch, caching)
    spec = SpecConfig(num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1,
                      max_draft_rows=rows, min_acceptance=0.3, backoff_steps=2)
    drafted, s = run(specs, spec, block_size, num_blocks, budget, max_batch, caching)
    # every request that was not aborted gives the same tokens, drafts or not
    for i, sp in enumerate(specs):
        if sp[5] is None:
            assert drafted[f"r{i}"] == plain[f"r{i}"], f"r{i}"
    assert s.num_accepted_tokens <= s.num_draft_tokens


def test_a_repetitive_request_drafts_and_accepts():
    """A request whose history repeats gets drafts and accepts some (the property test
    could pass with drafting broken)."""
    specs = [(24, 40, 5, 0, True, None)]
    spec = SpecConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    plain, _ = run(specs, None, 4, 40, 32, 4, True)
    drafted, s = run(specs, spec, 4, 40, 32, 4, True)
    assert drafted == plain
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens > 0


def test_opted_out_and_sampled_requests_get_no_draft():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_seq_len=256,
                          spec=SpecConfig(prompt_lookup_min=1, max_draft_rows=8))
    s = Scheduler(cfg, BlockPool(64, 4))
    prompt = [10, 11, 12, 10, 11, 12, 10, 11]
    for rid, params in (("greedy", SamplingParams(max_new_tokens=8)),
                        ("opted-out", SamplingParams(max_new_tokens=8, speculative=False)),
                        ("sampled", SamplingParams(max_new_tokens=8, do_sample=True)),
                        ("stop", SamplingParams(max_new_tokens=8, stop=("x",))),
                        ("logprobs", SamplingParams(max_new_tokens=8, logprobs=1))):
        s.add(Request(request_id=rid, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                      params=params, priority=5, arrival_time=0.0, arrival_seq=len(s.requests)))
    seqs = s.schedule()  # the prefills
    s.update(seqs, {q.request_id: 12 for q in seqs}, 0.0)
    drafted = {q.request_id: q.draft for q in s.schedule()}
    assert drafted.pop("greedy") == (10, 11, 12)  # after the last earlier 12, 10, 11, 12
    assert all(d == () for d in drafted.values()), drafted


def test_cli_flag_and_config_key(tmp_path, monkeypatch):
    import json
    from pathlib import Path

    from tokenserve.cli import build_parser, serve_config
    from tokenserve.config.mindie_json import load_mindie_config

    monkeypatch.delenv("MIES_CONFIG_JSON_PATH", raising=False)
    assert serve_config(build_parser().parse_args(["serve"])).engine.speculative_config is None
    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 6}'])
    assert serve_config(args).engine.speculative_config.num_speculative_tokens == 6
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "{bad"])
    cfg = json.loads(Path("examples/config.json").read_text(encoding="utf-8"))
    mc = cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    mc["speculative_config"] = {"method": "ngram", "prompt_lookup_max": 3}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    assert load_mindie_config(path).engine.speculative_config.prompt_lookup_max == 3
    mc["speculative_config"] = {"method": "medusa"}
    path.write_text(json.dumps(cfg), encoding="utf-8")
    with pytest.raises(ValueError, match="speculative_config.*not supported"):
        load_mindie_config(path)


def test_bench_reads_the_counters_from_metrics():
    from tokenserve.loadgen.serving import spec_counters_from_metrics

    page = ('# TYPE spec_decode_num_draft_tokens counter\n'
            'spec_decode_num_draft_tokens_total{model_name="m"} 120.0\n'
            'spec_decode_num_accepted_tokens_total{model_name="m"} 75.0\n')
    assert spec_counters_from_metrics(page) == (120, 75)
    assert spec_counters_from_metrics("num_preemptions_total 3\n") is None
