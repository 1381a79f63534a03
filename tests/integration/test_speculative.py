"""Speculative decoding by prompt lookup on the real model: greedy outputs are the same
tokens with drafts on and off, alone and 16 at a time, on input-grounded prompts (repeat
or edit a given passage: drafts mostly accepted) and open chat prompts (drafts mostly
rejected); drafts are really made and accepted; every KV block is free afterwards. A
decode instance (PD) drafts too: a request handed off by a prefill-only step and adopted
continues with drafts and gives the mixed run's tokens (one engine plays P and D, as in
``test_pd_engine.py``).
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import pytest_asyncio

from tokenserve.config.tree import EngineConfig
from tokenserve.engine.engine import AsyncEngine
from tokenserve.config.tree import SpecConfig
from tokenserve.messages import GenerateRequest, KvAdoption
from tokenserve.sampling_params import SamplingParams

PASSAGES = [
    "The lighthouse stood on the northern cliff for two hundred years. Every night its "
    "keeper climbed the ninety steps, trimmed the wick and watched the ships pass safely "
    "between the rocks.",
    "To install the package, create a virtual environment, activate it, and run pip "
    "install with the name of the package. Then start the server and open the address "
    "it prints in your browser.",
    "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
    "def sub(a, b):\n    return a - b\n",
    "Paris is the capital of France. It lies on the Seine river, and its museums, cafes "
    "and bridges draw millions of visitors every year.",
]
REPEAT = ["Repeat the following text exactly, word for word:\n\n{}",
          "Rewrite this text with every sentence on its own line:\n\n{}",
          "Fix any mistakes in this text and return it:\n\n{}"]
CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "Give three tips for learning to cook.", "Explain what a CPU does.",
        "Name four animals that live in the ocean.", "How do plants make food?"]

_ids = itertools.count()


def _prompts(tok) -> list[list[int]]:
    texts = [r.format(p) for r in REPEAT for p in PASSAGES] + CHAT
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}],
                                               add_generation_prompt=True),
                       add_special_tokens=False) for t in texts]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engines():
    made = []
    for spec in (None, SpecConfig(num_speculative_tokens=4, prompt_lookup_max=4,
                                  prompt_lookup_min=2, max_draft_rows=64)):
        cfg = EngineConfig(dtype="bfloat16", device="cpu", block_size=16,
                           kv_cache_bytes=64 << 20, max_batch_size=32,
                           max_num_batched_tokens=512, speculative_config=spec)
        e = await asyncio.to_thread(AsyncEngine.build, cfg)
        e.set_kv_puller(_local_puller(e))
        await e.start()
        made.append(e)
    yield made
    for e in made:
        await e.stop()


def _local_puller(engine: AsyncEngine):
    """A KV puller that copies between the engine's own blocks (it plays P and D)."""
    region = engine.kv_region

    def pull(source, dst_blocks, num_tokens):
        n = engine.pool.blocks_for(num_tokens)
        region[:, :, dst_blocks] = region[:, :, list(source[:n])]
    return pull


async def _generate(engine: AsyncEngine, ids: list[int], max_new: int) -> list[int]:
    g = GenerateRequest(f"spec-{next(_ids)}", tuple(ids),
                        SamplingParams(max_new_tokens=max_new, do_sample=False))
    out = []
    async for o in engine.generate(g):
        assert o.error is None, o.error
        out += o.new_token_ids
    return out


async def _all(engine: AsyncEngine, prompts, max_new: int, concurrency: int) -> list[list[int]]:
    sem = asyncio.Semaphore(concurrency)

    async def one(p):
        async with sem:
            return await _generate(engine, p, max_new)
    return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("concurrency", [1, 16])
async def test_greedy_tokens_identical_with_and_without_drafts(engines, concurrency):
    plain, spec = engines
    prompts = _prompts(plain.tokenizer)
    if concurrency == 1:
        prompts = prompts[::4]  # every fourth: both kinds, fewer tokens at batch 1
    before = spec.stats()
    want = await _all(plain, prompts, 40, concurrency)
    got = await _all(spec, prompts, 40, concurrency)
    for i, (a, b) in enumerate(zip(want, got)):
        assert a == b, f"prompt {i}: drafts changed the output"
    st = spec.stats()
    drafted = st.num_draft_tokens - before.num_draft_tokens
    accepted = st.num_accepted_tokens - before.num_accepted_tokens
    assert drafted > 0 and 0 < accepted <= drafted
    for e in engines:
        await e.wait_idle(timeout=30)
        s = e.stats()
        assert s.num_free_blocks == s.num_blocks, "KV blocks leaked"
        assert e.executor.runner.states == {}, "sampling state leaked"


@pytest.mark.asyncio(loop_scope="session")
async def test_decode_instance_drafts_after_a_handoff(engines):
    plain, spec = engines
    prompt = tuple(_prompts(spec.tokenizer)[0])  # repeat a passage: drafts pay
    params = SamplingParams(max_new_tokens=40, do_sample=False)
    want = await _generate(plain, list(prompt), 40)
    p_id = f"spec-{next(_ids)}"
    p_handle = spec.generate(GenerateRequest(p_id, prompt, params, prefill_only=True))
    first = await p_handle.get()
    h = first.handoff
    assert h is not None and len(first.new_token_ids) == 1
    before = spec.stats()
    d_ids = []
    async for o in spec.generate(GenerateRequest(
            f"spec-{next(_ids)}", prompt, params,
            adopt=KvAdoption(first.new_token_ids, h.generator_state, h.num_computed,
                             source=h.block_table))):
        assert o.error is None, o.error
        if not o.replay:
            d_ids += o.new_token_ids
    assert list(first.new_token_ids) + d_ids == want
    after = spec.stats()
    assert after.num_accepted_tokens > before.num_accepted_tokens, "D made no accepted draft"
    assert spec.release(p_id)
    assert (await p_handle.get()).finished
    await spec.wait_idle(timeout=30)
    st = spec.stats()
    assert st.num_free_blocks == st.num_blocks, "KV blocks leaked"
