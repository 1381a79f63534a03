"""Scheduler + block pool with no model: hand-made requests and step results."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tokenserve.engine.block_pool import BlockPool, NoFreeBlocksError
from tokenserve.engine.finish import Finish
from tokenserve.engine.request import Request, RequestStatus
from tokenserve.engine.scheduler import Scheduler, SchedulerConfig
from tokenserve.messages import FinishReason
from tokenserve.sampling_params import SamplingParams

EOS = 2


def make_sched(num_blocks=64, block_size=4, budget=64, max_batch=8, max_seq_len=256,
               caching=True, max_prefill_batch=50, chunked=True, long_threshold=None):
    pool = BlockPool(num_blocks, block_size, enable_caching=caching)
    cfg = SchedulerConfig(max_batch_size=max_batch, max_num_batched_tokens=budget,
                          max_seq_len=max_seq_len, max_prefill_batch_size=max_prefill_batch,
                          enable_chunked_prefill=chunked,
                          long_prefill_token_threshold=long_threshold or budget,
                          eos_token_ids=frozenset({EOS}))
    return Scheduler(cfg, pool)


_seq = iter(range(10**9))


def req(rid, n_prompt=5, max_new=4, priority=5, prompt=None, **kw):
    """A request; its prompt is unique to ``rid`` unless ``prompt`` is given."""
    base = 100 + 1000 * (sum(map(ord, rid)) % 97)
    tokens = list(prompt) if prompt is not None else list(range(base, base + n_prompt))
    return Request(request_id=rid, token_ids=tokens, num_prompt_tokens=len(tokens),
                   params=SamplingParams(max_new_tokens=max_new, seed=0),
                   priority=priority, arrival_time=0.0, arrival_seq=next(_seq), **kw)


def run_step(s, token=7, now=1.0):
    seqs = s.schedule()
    sampled = {q.request_id: token for q in seqs if q.sample}
    return seqs, s.update(seqs, sampled, now)


def test_block_pool_allocate_free_and_errors():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert pool.num_free == 1 and sorted(a) == [0, 1, 2]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1  # nothing taken on failure
    pool.free(a)
    assert pool.all_free()
    pool.check()
    with pytest.raises(AssertionError):
        pool.free([a[0]])
    assert pool.blocks_for(0) == 0 and pool.blocks_for(16) == 1 and pool.blocks_for(17) == 2


def test_prefill_then_decode_until_length():
    s = make_sched()
    s.add(req("a", n_prompt=5, max_new=3))
    seqs, out = run_step(s)
    assert [(q.request_id, len(q.token_ids), q.sample) for q in seqs] == [("a", 5, True)]
    assert len(seqs[0].block_table) == 2  # 5 tokens / block 4
    for _ in range(2):
        seqs, out = run_step(s)
        assert len(seqs[0].token_ids) == 1 and seqs[0].num_computed >= 5
    r = out[0][0]
    assert r.finished and r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 3
    assert s.pool.all_free() and not s.has_work()


def test_eos_and_ignore_eos():
    s = make_sched()
    s.add(req("a"))
    _, out = run_step(s, token=EOS)
    assert out[0][0].finish_reason is FinishReason.EOS
    r = req("b", max_new=2)
    r.params = SamplingParams(max_new_tokens=2, ignore_eos=True, seed=0)
    s.add(r)
    run_step(s, token=EOS)
    _, out = run_step(s, token=EOS)
    assert out[0][0].finish_reason is FinishReason.LENGTH
    assert s.pool.all_free()


def test_continuous_batching_join_and_leave():
    s = make_sched()
    s.add(req("a", max_new=2))
    run_step(s)
    s.add(req("b", max_new=3))
    seqs, _ = run_step(s)  # a decodes while b prefills in the same step
    assert {q.request_id: len(q.token_ids) for q in seqs} == {"a": 1, "b": 5}
    seqs, out = run_step(s)
    assert [q.request_id for q in seqs] == ["b"]  # a left after its 2nd token
    run_step(s)
    assert s.pool.all_free() and not s.has_work()


def test_chunked_prefill_splits_long_prompt_over_budget():
    s = make_sched(budget=8)
    s.add(req("short", n_prompt=3, max_new=10))
    run_step(s)
    s.add(req("long", n_prompt=20))
    seqs, _ = run_step(s)
    d = {q.request_id: (len(q.token_ids), q.num_computed, q.sample) for q in seqs}
    assert d == {"short": (1, 3, True), "long": (7, 0, False)}
    seqs, _ = run_step(s)
    d = {q.request_id: (len(q.token_ids), q.num_computed, q.sample) for q in seqs}
    assert d["long"] == (7, 7, False) and d["short"][0] == 1
    seqs, _ = run_step(s)
    d = {q.request_id: (len(q.token_ids), q.num_computed, q.sample) for q in seqs}
    assert d["long"] == (6, 14, True)


def test_max_batch_size_caps_running():
    s = make_sched(max_batch=2)
    for i in range(3):
        s.add(req(f"r{i}"))
    seqs, _ = run_step(s)
    assert [q.request_id for q in seqs] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_priority_orders_waiting_queue():
    s = make_sched(max_batch=1)
    s.add(req("low", priority=5))
    s.add(req("high", priority=1))
    s.add(req("mid", priority=3))
    assert [r.request_id for r in s.waiting] == ["high", "mid", "low"]


def test_preempt_lowest_priority_latest_and_resume():
    s = make_sched(num_blocks=4, block_size=4, caching=False)
    s.add(req("a", n_prompt=4, max_new=8, priority=1))
    s.add(req("b", n_prompt=4, max_new=8, priority=5))
    run_step(s)  # each prefills into 1 block
    run_step(s)  # each takes a 2nd block: pool exhausted
    assert s.pool.num_free == 0
    b = s.requests["b"]
    steps = 0
    while b.status is RequestStatus.RUNNING:
        run_step(s)
        steps += 1
    # a (priority 1) needed a 3rd block at position 8: b (priority 5) lost its blocks
    assert steps == 4
    assert b.status is RequestStatus.PREEMPTED and b.block_table == [] and b.num_computed == 0
    assert s.requests["a"].status is RequestStatus.RUNNING and s.num_preemptions == 1
    tokens_before = list(b.token_ids)
    while "a" in s.requests:
        run_step(s)
    # b resumes: prompt + generated tokens recomputed in one prefill, then it samples
    seqs, _ = run_step(s)
    assert seqs[0].request_id == "b" and seqs[0].num_computed == 0
    assert list(seqs[0].token_ids) == tokens_before and seqs[0].sample
    while s.has_work():
        run_step(s)
    assert b.num_output_tokens == 8 and s.pool.all_free()


@pytest.mark.parametrize("where", ["waiting", "running", "preempted"])
def test_abort_frees_blocks_everywhere(where):
    s = make_sched(num_blocks=4, block_size=4, max_batch=1 if where == "waiting" else 8)
    s.add(req("x", n_prompt=4, max_new=8, priority=1))
    s.add(req("y", n_prompt=4, max_new=8))
    run_step(s)
    if where == "preempted":
        while s.requests["y"].status is not RequestStatus.PREEMPTED:
            run_step(s)
    target = "y"
    assert s.finish(target, FinishReason.ABORT) is not None
    assert s.finish(target, FinishReason.ABORT) is None  # idempotent
    s.finish("x", FinishReason.ABORT)
    assert s.pool.all_free() and not s.has_work()
    s.pool.check()


def test_deadlines_expire():
    s = make_sched()
    s.add(req("client", deadline=5.0, deadline_reason="client timeout"))
    s.add(req("tok", token_timeout_s=2.0))
    assert s.expired(1.0) == []
    assert s.next_deadline() == 2.0
    assert s.expired(2.5) == [
        ("tok", Finish(FinishReason.TIMEOUT, error="Engine callback timeout: server tokenTimeout"))]
    assert ("client", Finish(FinishReason.TIMEOUT, error="Engine callback timeout: client timeout")
            ) in s.expired(5.0)


def test_add_asserts_what_the_engine_checked():
    """AsyncEngine.generate is the one admission check; add() only asserts it held."""
    s = make_sched(max_seq_len=8)
    with pytest.raises(AssertionError):
        s.add(req("long", n_prompt=8))
    s.add(req("ok", n_prompt=3))
    with pytest.raises(AssertionError):
        s.add(req("ok", n_prompt=3))


def test_prefix_hit_shares_blocks_and_keeps_one_token_to_compute():
    s = make_sched(block_size=4)
    prompt = list(range(500, 508))  # exactly 2 full blocks
    s.add(req("a", prompt=prompt, max_new=3))
    run_step(s)
    a_blocks = list(s.requests["a"].block_table)
    s.add(req("b", prompt=prompt + [9, 9], max_new=3))
    s.add(req("c", prompt=prompt, max_new=3))
    seqs, _ = run_step(s)
    d = {q.request_id: q for q in seqs}
    # b: both full blocks are cached; it computes only its 2 extra tokens
    assert d["b"].num_computed == 8 and d["b"].token_ids == (9, 9)
    assert list(d["b"].block_table[:2]) == a_blocks[:2]
    # c: same 8 tokens; the hit is capped at 1 block so the last token is computed
    assert d["c"].num_computed == 4 and len(d["c"].token_ids) == 4
    assert s.pool.ref_count(a_blocks[0]) == 3 and s.pool.ref_count(a_blocks[1]) == 2
    assert s.requests["b"].num_cached_tokens == 8 and s.requests["c"].num_cached_tokens == 4
    assert s.prefix_query_tokens == 8 + 10 + 8 and s.prefix_hit_tokens == 12
    while s.has_work():
        run_step(s)
    assert s.pool.all_free() and s.pool.num_cached > 0  # freed blocks stay cached
    s.pool.check()


def test_cached_blocks_survive_until_evicted_lru():
    s = make_sched(num_blocks=6, block_size=4)
    s.add(req("a", prompt=list(range(200, 209)), max_new=1))  # 2 full blocks + 1
    run_step(s)
    assert not s.has_work() and s.pool.num_cached == 2
    # a new request that needs every block evicts the cached ones
    s.add(req("big", n_prompt=23, max_new=1))
    run_step(s)
    assert s.pool.num_cached == 5 and s.pool.all_free()
    s.add(req("again", prompt=list(range(200, 209)), max_new=1))
    seqs, _ = run_step(s)
    assert seqs[0].num_computed == 0  # a's blocks were evicted and reused


def test_preempted_request_resumes_from_prefix_cache():
    s = make_sched(num_blocks=4, block_size=4)
    s.add(req("a", n_prompt=4, max_new=8, priority=1))
    s.add(req("b", n_prompt=4, max_new=8, priority=5))
    b = s.requests["b"]
    while b.status is not RequestStatus.PREEMPTED:
        run_step(s)
    while "a" in s.requests:
        run_step(s)
    seqs, _ = run_step(s)
    # b's first block was registered when full, survived in the cache, and is reused
    assert seqs[0].request_id == "b" and seqs[0].num_computed >= 4
    while s.has_work():
        run_step(s)
    assert b.num_output_tokens == 8 and s.pool.all_free()


def test_caching_off_never_hits():
    s = make_sched(caching=False)
    p = list(range(300, 312))
    s.add(req("a", prompt=p, max_new=1))
    run_step(s)
    s.add(req("b", prompt=p, max_new=1))
    seqs, _ = run_step(s)
    assert seqs[0].num_computed == 0 and s.pool.num_cached == 0


def test_max_prefill_batch_size_limits_admissions_per_step():
    s = make_sched(max_prefill_batch=2)
    for i in range(5):
        s.add(req(f"p{i}"))
    seqs, _ = run_step(s)
    assert len(seqs) == 2
    seqs, _ = run_step(s)
    assert sorted(len(q.token_ids) for q in seqs) == [1, 1, 5, 5]


def test_higher_priority_waiting_request_preempts_when_batch_full():
    s = make_sched(max_batch=2, caching=False)
    s.add(req("bulk1", max_new=20))
    s.add(req("bulk2", max_new=20))
    s.add(req("bulk3", max_new=20))
    run_step(s)
    run_step(s)
    s.add(req("urgent", priority=1, max_new=2))
    seqs, _ = run_step(s)
    ids = [q.request_id for q in seqs]
    assert "urgent" in ids and "bulk2" not in ids  # latest-arrived bulk request preempted
    assert s.requests["bulk2"].status is RequestStatus.PREEMPTED
    assert [r.request_id for r in s.waiting] == ["bulk2", "bulk3"]
    # equal priority never preempts
    s.add(req("bulk4", max_new=2))
    seqs, _ = run_step(s)
    assert "bulk4" not in [q.request_id for q in seqs]


def test_without_chunked_prefill_long_prompt_runs_whole():
    s = make_sched(budget=8, chunked=False)
    s.add(req("short", n_prompt=3, max_new=10))
    run_step(s)
    s.add(req("long", n_prompt=20))
    s.add(req("next", n_prompt=3))
    seqs, _ = run_step(s)  # the whole prompt in one step; the budget is then spent
    d = {q.request_id: (len(q.token_ids), q.sample) for q in seqs}
    assert d == {"short": (1, True), "long": (20, True)}


def plan(seqs):
    return {q.request_id: (len(q.token_ids), q.sample) for q in seqs}


def test_long_prefill_takes_the_whole_budget_when_alone():
    s = make_sched(budget=16, long_threshold=6)
    s.add(req("long", n_prompt=30))
    assert plan(run_step(s)[0]) == {"long": (16, False)}


def test_short_prompt_runs_beside_a_long_prefill():
    s = make_sched(budget=16, long_threshold=6)
    s.add(req("long", n_prompt=40))
    run_step(s)
    s.add(req("short", n_prompt=5))
    # the long prefill keeps its guaranteed 6 and the short one runs whole; the long one
    # gets no more while a short prefill is in the step, so that step stays short
    assert plan(run_step(s)[0]) == {"long": (6, False), "short": (5, True)}
    # the short one now decodes: the long one takes the rest of the budget again
    assert plan(run_step(s)[0]) == {"long": (15, False), "short": (1, True)}


def test_long_prefill_progresses_at_least_the_threshold_under_a_flood_of_short_ones():
    s = make_sched(num_blocks=256, budget=16, long_threshold=6, max_batch=64)
    s.add(req("long", n_prompt=60))
    run_step(s)
    done = 16
    for k in range(3):
        for m in range(4):
            s.add(req(f"s{k}{m}", n_prompt=6, max_new=1))
        p = plan(run_step(s)[0])
        assert p["long"][0] >= 6 and sum(n for n, _ in p.values()) == 16
        done += p["long"][0]
    assert s.requests["long"].num_computed == done


def test_long_prompt_waits_for_a_long_slot_and_shorter_ones_pass_it():
    s = make_sched(budget=16, long_threshold=6)
    for r in (req("a", n_prompt=40), req("b", n_prompt=40), req("c", n_prompt=5)):
        s.add(r)
    # a starts (one long slot), b waits for the slot, c passes b
    assert plan(run_step(s)[0]) == {"a": (6, False), "c": (5, True)}
    assert [r.request_id for r in s.waiting] == ["b"]
    while "b" not in (p := plan(run_step(s)[0])):
        assert p["a"][1] is False  # a is still prefilling
    # b starts in the step in which a's prefill completes (a's slot is free again)
    assert p["a"][1] is True and p["b"] == (6, False)


def test_more_long_slots_admit_both_long_prompts():
    s = make_sched(budget=16, long_threshold=6)
    s.cfg = replace(s.cfg, max_long_partial_prefills=2)
    s.add(req("a", n_prompt=40))
    s.add(req("b", n_prompt=40))
    assert plan(run_step(s)[0]) == {"a": (10, False), "b": (6, False)}


def test_lower_priority_long_prefill_does_not_hold_the_slot_from_a_higher_one():
    s = make_sched(budget=16, long_threshold=6)
    s.add(req("bulk", n_prompt=40, priority=5))
    run_step(s)
    s.add(req("urgent", n_prompt=40, priority=1))
    s.add(req("bulk2", n_prompt=40, priority=5))
    # urgent starts beside bulk (bulk2 waits for a slot); leftovers go to urgent first
    assert plan(run_step(s)[0]) == {"bulk": (6, False), "urgent": (10, False)}


def test_default_long_threshold_is_a_quarter_of_the_budget():
    pool = BlockPool(64, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=40, max_seq_len=256), pool)
    s.add(req("long", n_prompt=100))
    run_step(s)
    s.add(req("long2", n_prompt=11))  # 11 > 40 / 4: long, waits for the slot
    s.add(req("short", n_prompt=10))
    assert plan(s.schedule()) == {"long": (10, False), "short": (10, True)}


def test_no_priority_preemption_for_a_request_the_long_slot_holds_back():
    s = make_sched(num_blocks=256, budget=16, long_threshold=6, max_batch=2, caching=False)
    s.add(req("bulk", n_prompt=100, priority=5))
    for _ in range(4):
        run_step(s)
    s.add(req("h1", n_prompt=100, priority=1))
    run_step(s)  # h1 starts beside bulk (two seats)
    s.add(req("h2", n_prompt=100, priority=1))  # long, and h1 holds the long slot
    seqs, _ = run_step(s)
    # h2 could not start anyway, so bulk keeps its seat and its 64 computed tokens
    assert "h2" not in plan(seqs) and s.requests["bulk"].num_preemptions == 0
    assert s.num_preemptions == 0


def test_no_preempt_and_readmit_cycle_while_a_long_request_waits_for_its_slot():
    s = make_sched(num_blocks=256, budget=32, long_threshold=10, max_batch=2, caching=False)
    s.add(req("low", n_prompt=2, max_new=6, priority=5))
    run_step(s)
    s.add(req("h1", n_prompt=200, priority=1))
    s.add(req("h2", n_prompt=200, priority=1))
    while s.requests["h1"].first_token_time is None:
        run_step(s)
    assert s.num_preemptions <= 1  # low yields its seat at most once (to h1)


def test_prompt_mostly_in_the_prefix_cache_counts_as_short():
    s = make_sched(num_blocks=256, budget=16, long_threshold=6)
    p = list(range(5000, 5040))
    s.add(req("warm", prompt=p, max_new=1))
    while s.has_work():
        run_step(s)
    s.add(req("long", n_prompt=200))
    run_step(s)
    s.add(req("cached", prompt=p[:36] + [1, 2, 3, 4], max_new=1))  # 4 left to compute
    got = plan(run_step(s)[0])
    assert got["cached"] == (4, True) and got["long"] == (6, False)


def test_lower_priority_short_prompts_do_not_throttle_a_higher_priority_long_prefill():
    s = make_sched(num_blocks=512, budget=16, long_threshold=6, max_batch=64)
    s.add(req("urgent", n_prompt=120, priority=1))
    run_step(s)
    for k in range(4):
        s.add(req(f"bulk{k}", n_prompt=3, max_new=1, priority=5))
        assert plan(run_step(s)[0])["urgent"] == (16 - 3, False)
