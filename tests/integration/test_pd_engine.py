"""The engine's PD primitives on the real model (spec/pd_disaggregation.md §5-§8), without
HTTP: a prefill-only request parks with its KV blocks and hands off; an adopted request
pulls those blocks and continues; the tokens equal a mixed run's, greedy and seeded
sampled. One engine plays both instances (its KV puller copies between its own blocks), so
the test loads the model once; the multi-process path is tested over HTTP elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import pytest_asyncio

from tokenserve.config.tree import EngineConfig
from tokenserve.engine.engine import AsyncEngine
from tokenserve.messages import FinishReason, GenerateRequest, KvAdoption
from tokenserve.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "Write a short poem about the sea and a lighthouse."
_ids = itertools.count()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    cfg = EngineConfig(dtype="float32", device="cpu", block_size=16, kv_cache_bytes=64 << 20,
                       max_batch_size=16, max_num_batched_tokens=512, kv_trans_timeout_s=5)
    eng = await asyncio.to_thread(AsyncEngine.build, cfg)
    region = eng.kv_region

    def puller(source, dst_blocks, num_tokens):
        src_blocks = source
        n = eng.pool.blocks_for(num_tokens)
        assert len(dst_blocks) == n and len(src_blocks) >= n
        region[:, :, dst_blocks] = region[:, :, list(src_blocks[:n])]

    eng.set_kv_puller(puller)
    await eng.start()
    yield eng
    await eng.stop()


def _prompt(engine) -> tuple[int, ...]:
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                   add_generation_prompt=True)
    return tuple(tok.encode(text, add_special_tokens=False))


async def _collect(handle) -> tuple[list[int], list, str]:
    ids, outs, text = [], [], ""
    async for out in handle:
        outs.append(out)
        if not out.replay:
            ids.extend(out.new_token_ids)
            text += out.new_text
    return ids, outs, text


async def _assert_idle(engine) -> None:
    await engine.wait_idle(timeout=30)
    st = engine.stats()
    assert st.num_free_blocks == st.num_blocks, "KV blocks leaked"


def _rid() -> str:
    return f"pd{next(_ids)}"


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=24, ignore_eos=True),
    SamplingParams(max_new_tokens=24, ignore_eos=True, do_sample=True, temperature=0.9,
                   top_p=0.95, seed=1234),
], ids=["greedy", "seeded"])
async def test_prefill_park_handoff_then_adopt_equals_mixed(engine, params):
    prompt = _prompt(engine)
    mixed_ids, _, mixed_text = await _collect(
        engine.generate(GenerateRequest(_rid(), prompt, params)))

    p_id = _rid()
    p_handle = engine.generate(GenerateRequest(p_id, prompt, params, prefill_only=True))
    first = await p_handle.get()
    assert not first.finished and first.handoff is not None and len(first.new_token_ids) == 1
    h = first.handoff
    assert h.num_computed == len(prompt)
    assert len(h.block_table) == engine.pool.blocks_for(len(prompt))
    assert (h.generator_state is not None) == params.do_sample
    # parked: the blocks stay held while the engine has nothing to compute
    await asyncio.sleep(0.05)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks - len(h.block_table)

    d_handle = engine.generate(GenerateRequest(
        _rid(), prompt, params,
        adopt=KvAdoption(first.new_token_ids, h.generator_state, h.num_computed,
                         source=h.block_table)))
    d_ids, d_outs, d_text = await _collect(d_handle)
    assert d_outs[0].replay and d_outs[0].new_token_ids == first.new_token_ids
    assert d_outs[0].new_text == first.new_text
    assert list(first.new_token_ids) + d_ids == mixed_ids
    assert first.new_text + d_text == mixed_text
    assert d_outs[-1].finish_reason is FinishReason.LENGTH
    assert d_outs[-1].num_output_tokens == params.max_new_tokens

    assert engine.release(p_id)
    final = await p_handle.get()
    assert final.finished and final.finish_reason is FinishReason.ABORT
    await _assert_idle(engine)


async def test_parked_request_times_out_and_frees_its_blocks(engine):
    engine.scheduler.parking.timeout_s = 0.2
    try:
        h = engine.generate(GenerateRequest(_rid(), _prompt(engine),
                                            SamplingParams(max_new_tokens=8, ignore_eos=True),
                                            prefill_only=True))
        first = await h.get()
        assert first.handoff is not None
        final = await asyncio.wait_for(h.get(), 10)
        assert final.finished and final.finish_reason is FinishReason.TIMEOUT
        assert "kv_trans_timeout" in final.error
    finally:
        engine.scheduler.parking.timeout_s = 5
    await _assert_idle(engine)


async def test_finished_on_the_first_token_is_not_parked(engine):
    h = engine.generate(GenerateRequest(_rid(), _prompt(engine),
                                        SamplingParams(max_new_tokens=1), prefill_only=True))
    out = await h.get()
    assert out.finished and out.handoff is None and out.finish_reason is FinishReason.LENGTH
    await _assert_idle(engine)


async def test_recompute_on_prefill_continues_without_repeating(engine):
    """spec §7.4: prompt + tokens already delivered, computed again, continue identically
    (greedy and seeded: the generator is advanced one draw per delivered token)."""
    prompt = _prompt(engine)
    for params in (SamplingParams(max_new_tokens=16, ignore_eos=True),
                   SamplingParams(max_new_tokens=16, ignore_eos=True, do_sample=True,
                                  temperature=0.8, seed=7)):
        mixed, _, _ = await _collect(engine.generate(GenerateRequest(_rid(), prompt, params)))
        got, outs, _ = await _collect(engine.generate(GenerateRequest(
            _rid(), prompt, params, adopt=KvAdoption(tuple(mixed[:5])))))
        assert outs[0].replay and list(outs[0].new_token_ids) == mixed[:5]
        assert mixed[:5] + got == mixed
    await _assert_idle(engine)


async def test_failed_pull_fails_that_request_alone(engine):
    prompt = _prompt(engine)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    good = engine.generate(GenerateRequest(_rid(), prompt, params))
    bad = engine.generate(GenerateRequest(_rid(), prompt, params, adopt=KvAdoption(
        (17,), None, len(prompt), source=[10**6] * 64)))  # the puller raises on these ids
    _, bad_outs, _ = await _collect(bad)
    assert bad_outs[-1].finish_reason is FinishReason.ERROR
    assert bad_outs[-1].error.startswith("Pull kv failed")
    good_ids, good_outs, _ = await _collect(good)
    assert len(good_ids) == 6 and good_outs[-1].finish_reason is FinishReason.LENGTH
    await _assert_idle(engine)


async def test_decode_eviction_ends_with_recompute(engine):
    """A decode instance cannot prefill: when its KV blocks run out, the evicted request
    ends with RECOMPUTE (spec §7.1) and frees its blocks."""
    prompt = _prompt(engine)
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    p_id = _rid()
    ph = engine.generate(GenerateRequest(p_id, prompt, params, prefill_only=True))
    first = await ph.get()
    h = first.handoff
    # fill the pool so the adopted request soon has no block to grow into
    free = engine.stats().num_free_blocks
    hog_len = (free - len(h.block_table) - 2) * 16
    hog = engine.generate(GenerateRequest(_rid(), tuple(prompt[:1]) * hog_len,
                                          SamplingParams(max_new_tokens=200, ignore_eos=True)))
    await hog.get()
    d = engine.generate(GenerateRequest(_rid(), prompt, params, adopt=KvAdoption(
        first.new_token_ids, None, h.num_computed, source=h.block_table)))
    engine.release(p_id)
    _, outs, _ = await _collect(d)
    assert outs[-1].finish_reason is FinishReason.RECOMPUTE
    await _collect(hog)
    await _assert_idle(engine)
