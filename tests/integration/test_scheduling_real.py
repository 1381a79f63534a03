"""Scheduler behaviour with the real model (fp32, engine API, no HTTP).

- a KV pool too small for the load forces preemption by recompute, and the greedy
  outputs still equal those of the session's large-pool engine;
- a priority-1 request sent behind 30 priority-5 requests jumps the queue;
- a shared system prompt is served from the prefix cache;
- a short prompt sent while a long one is being prefilled in chunks finishes first, and
  the long one's greedy output equals that of a whole (unchunked) prefill.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import pytest_asyncio

from tokenserve.config.tree import EngineConfig
from tokenserve.engine.engine import AsyncEngine
from tokenserve.messages import GenerateRequest
from tokenserve.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")
_ids = itertools.count()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tiny_engine():
    # 10 blocks x 16 tokens: far less than 8 concurrent requests of ~60 tokens need
    per_block = 2 * 30 * 3 * 64 * 4 * 16  # K+V, layers, kv heads, head dim, fp32, block
    cfg = EngineConfig(dtype="float32", device="cpu", block_size=16,
                       kv_cache_bytes=10 * per_block, max_batch_size=4,
                       max_num_batched_tokens=256)
    engine = await asyncio.to_thread(AsyncEngine.build, cfg)
    await engine.start()
    yield engine
    await engine.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def small_budget_engine():
    # 128 tokens per step: a long prompt is prefilled in chunks; prompts with more than
    # 32 tokens left are long (a quarter of the budget)
    cfg = EngineConfig(dtype="float32", device="cpu", block_size=16,
                       kv_cache_bytes=64 << 20, max_num_batched_tokens=128)
    engine = await asyncio.to_thread(AsyncEngine.build, cfg)
    await engine.start()
    yield engine
    await engine.stop()


async def generate(engine, ids, priority=5, **params):
    g = GenerateRequest(f"sched-{next(_ids)}", tuple(ids),
                        SamplingParams(**{"max_new_tokens": 32, "seed": 0, **params}),
                        priority=priority)
    toks = []
    async for o in engine.generate(g):
        toks += o.new_token_ids
    return toks


async def test_tiny_pool_preempts_and_greedy_output_is_unchanged(live, tiny_engine):
    assert tiny_engine.stats().num_blocks == 10
    prompts = [live.chat_ids(f"Describe the colour number {i} in one sentence.") for i in range(8)]
    big = await asyncio.gather(*(generate(live.engine, p) for p in prompts))
    before = tiny_engine.stats().num_preemptions
    small = await asyncio.gather(*(generate(tiny_engine, p) for p in prompts))
    assert tiny_engine.stats().num_preemptions > before
    assert small == big
    await tiny_engine.wait_idle()
    assert tiny_engine.stats().num_free_blocks == tiny_engine.stats().num_blocks


async def test_priority_one_jumps_a_queue_of_thirty(tiny_engine):
    done: list[str] = []

    def send(name, priority, question):
        ids = tiny_engine.tokenizer.encode(question, add_special_tokens=False)
        g = GenerateRequest(f"sched-{next(_ids)}", tuple(ids),
                            SamplingParams(max_new_tokens=8, ignore_eos=True, seed=0),
                            priority=priority)
        outputs = tiny_engine.generate(g)  # queued now, synchronously

        async def drain():
            async for _ in outputs:
                pass
            done.append(name)
        return asyncio.create_task(drain())

    bulk = [send(f"bulk{i}", 5, f"Item {i}: say something.") for i in range(30)]
    await asyncio.sleep(0.3)  # the bulk requests are queued (4 run at a time)
    waiting = tiny_engine.stats().num_waiting
    assert waiting > 10
    urgent = send("urgent", 1, "Urgent: say hello.")  # no await since counting `waiting`
    await asyncio.gather(urgent, *bulk)
    # only the bulk requests already admitted may finish before it: it passed every one
    # that was still waiting
    assert done.index("urgent") <= 30 - waiting, (waiting, done)


async def test_shared_system_prompt_hits_prefix_cache(live):
    system = ("You are a meticulous assistant for a shipping company. Answer briefly, "
              "cite the relevant policy section, and never invent tracking numbers. ") * 4
    tok = live.engine.tokenizer

    def ids(q):
        text = tok.apply_chat_template([{"role": "system", "content": system},
                                        {"role": "user", "content": q}],
                                       add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    before = live.engine.stats()
    first = GenerateRequest(f"sched-{next(_ids)}", tuple(ids("Where is my parcel?")),
                            SamplingParams(max_new_tokens=4, seed=0))
    outs1 = [o async for o in live.engine.generate(first)]
    second = GenerateRequest(f"sched-{next(_ids)}", tuple(ids("Can I change my address?")),
                             SamplingParams(max_new_tokens=4, seed=0))
    outs2 = [o async for o in live.engine.generate(second)]
    block = live.engine.cfg.block_size
    shared = len(ids("Where is my parcel?")) // block * block
    assert outs1[-1].num_cached_tokens < shared  # nothing of it was cached before
    assert outs2[-1].num_cached_tokens >= shared - block  # the system prompt was
    after = live.engine.stats()
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= outs2[-1].num_cached_tokens
    assert 0 < after.prefix_cache_hit_rate <= 1


async def test_short_prompt_passes_a_long_prefill(live, small_budget_engine):
    eng = small_budget_engine
    text = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog." for i in range(90))
    long_ids = eng.tokenizer.encode(text, add_special_tokens=False)
    short_ids = eng.tokenizer.encode("Say hi.", add_special_tokens=False)
    assert len(long_ids) > 8 * 128 and len(short_ids) < 32
    done: list[str] = []

    async def run(name, ids):
        toks = await generate(eng, ids, max_new_tokens=4, ignore_eos=True)
        done.append(name)
        return toks

    long_task = asyncio.create_task(run("long", long_ids))
    while eng.stats().num_running == 0:  # the long prefill has started
        await asyncio.sleep(0.01)
    short_toks = await run("short", short_ids)
    long_toks = await long_task
    assert done == ["short", "long"]
    # chunked and interleaved with the short prompt, the long prompt's greedy output
    # equals the session engine's, which prefills it whole (budget 8192)
    assert long_toks == await generate(live.engine, long_ids, max_new_tokens=4, ignore_eos=True)
    assert short_toks == await generate(live.engine, short_ids, max_new_tokens=4, ignore_eos=True)
    await eng.wait_idle()
    assert eng.stats().num_free_blocks == eng.stats().num_blocks
