"""A sliding-window model's requests hold window-sized KV (``SchedulerConfig.kv_window``):
blocks before every future query's window go back to the pool while the request runs, are
freed exactly once, and the accounting stays whole through chunked prefill, the prefix
cache, preemption by recompute and speculative drafts. No model: the scheduler and the
block pool only (as tests/unit/test_scheduler.py)."""

from __future__ import annotations

import math

import pytest

from tests.unit.test_scheduler import EOS, req, run_step
from tokenserve.engine.block_pool import BlockPool
from tokenserve.engine.scheduler import Scheduler, SchedulerConfig
from tokenserve.models.config import DecoderArch, LayerArch, ModelConfig, RopeSpec, kv_window

BS, W = 4, 8


def sched(window=W, caching=True, num_blocks=64, budget=64, **kw):
    pool = BlockPool(num_blocks, BS, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_batch_size=8, max_num_batched_tokens=budget,
                                     max_seq_len=512, long_prefill_token_threshold=budget,
                                     eos_token_ids=frozenset({EOS}), kv_window=window, **kw),
                     pool)


def held(s, r) -> int:
    return len(r.block_table) - r.num_released


def run_to_end(s, rs, steps=400, bound=None):
    for _ in range(steps):
        if not s.has_work():
            break
        run_step(s, token=7)
        s.pool.check()
        for r in rs:
            if bound is not None and r.block_table:
                assert held(s, r) <= bound, (r.request_id, held(s, r))
    assert not s.has_work()
    assert s.pool.all_free(), "KV blocks leaked"
    s.pool.check()


@pytest.mark.parametrize("caching", [True, False])
def test_long_generation_holds_window_sized_kv(caching):
    s = sched(caching=caching)
    r = req("a", n_prompt=5, max_new=120)
    s.add(r)
    released = 0
    for _ in range(200):
        if not s.has_work():
            break
        run_step(s)
        if r.block_table:
            released = max(released, r.num_released)
            assert held(s, r) <= math.ceil(W / BS) + 2
            assert s.pool.num_free >= s.pool.num_blocks - (math.ceil(W / BS) + 2)
    assert released > 20  # most of its 125 tokens' 32 blocks went back early
    assert s.pool.all_free()
    s.pool.check()


def test_negative_control_without_a_window_every_block_is_held():
    s = sched(window=0)
    r = req("a", n_prompt=5, max_new=60)
    s.add(r)
    for _ in range(30):
        run_step(s)
    assert r.num_released == 0 and held(s, r) == math.ceil(r.num_computed / BS)


def test_chunked_prefill_longer_than_the_window():
    s = sched(budget=6)  # a 40-token prompt in chunks of 6
    r = req("a", n_prompt=40, max_new=10)
    s.add(r)
    # the window's keys and a chunk's new tokens, each misaligned by up to a block
    run_to_end(s, [r], bound=math.ceil((W + 6) / BS) + 2)


def test_prefix_cache_hits_after_the_first_request_released_its_head():
    s = sched()
    prompt = list(range(300, 340))
    a = req("a", prompt=prompt, max_new=20)
    s.add(a)
    run_to_end(s, [a], bound=math.ceil(W / BS) + 3)
    b = req("b", prompt=prompt, max_new=3)
    s.add(b)
    run_step(s)
    assert b.num_cached_tokens > 0  # released blocks stayed cached (evictable)
    run_to_end(s, [b])


def test_preemption_by_recompute_reallocates_the_whole_context():
    s = sched(num_blocks=7)
    a, b = req("a", n_prompt=9, max_new=40), req("b", n_prompt=20, max_new=5, priority=1)
    s.add(a)
    for _ in range(12):
        run_step(s)
    assert a.num_released > 0
    s.add(b)  # higher priority: preempts a when blocks run short
    run_to_end(s, [a, b])
    assert a.num_preemptions > 0  # a was recomputed from scratch after releasing blocks


def test_prefill_only_requests_keep_their_blocks_for_the_decode_instance():
    s = sched()
    r = req("a", n_prompt=30, max_new=5, prefill_only=True)
    s.add(r)
    run_step(s)
    assert r.num_released == 0


def test_kv_window_of_a_model():
    def cfg(windows):
        arch = DecoderArch(layers=tuple(LayerArch(window=w) for w in windows),
                           ropes=(RopeSpec(1e4, None, 16),))
        return ModelConfig("m", "mistral", 10, 64, 96, len(windows), 4, 2, 16, 1e-5, 1e4,
                           None, 512, False, False, max(windows) or None, 1, (2,), None, arch)
    assert kv_window(cfg([8, 8])) == 8
    assert kv_window(cfg([8, 0])) == 0  # a global layer reads everything (Gemma 2/3)
    assert kv_window(cfg([0, 0])) == 0
