"""AsyncEngine with a fake model runner: the real scheduler actor, block pool, output
streams and detokenizer, with a deterministic "model" so every test runs in
milliseconds. Covers the engine's edges: abort everywhere, the leak invariant,
timeouts, a full queue, closing before reading, executor failure."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from tokenserve.config.tree import EngineConfig
from tokenserve.engine.engine import AsyncEngine
from tokenserve.messages import (
    EngineOverloadedError,
    FinishReason,
    GenerateRequest,
    StepPlan,
    StepResult,
)
from tokenserve.sampling_params import SamplingParams

VOCAB = 50
EOS = 2


class FakeRunner:
    """Next token = (last token + 1) % VOCAB, skipping EOS unless the prompt asks for it."""

    def __init__(self, num_blocks: int, delay: float = 0.002) -> None:
        self.num_blocks = num_blocks
        self.delay = delay
        self.fail_next = False
        self.steps = 0
        #: request_id -> token history, owned here as the real model thread owns it
        self.states: dict[str, list[int]] = {}

    def close(self) -> None:
        pass

    def step(self, plan: StepPlan) -> StepResult:
        for rid in plan.drop:
            self.states.pop(rid, None)
        for s in plan.seqs:
            if s.request_id not in self.states:
                assert s.start is not None
                self.states[s.request_id] = list(s.start.token_ids)
        if not plan.seqs:
            return StepResult(plan.step_id, {}, 0.0)
        time.sleep(self.delay)
        self.steps += 1
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device lost")
        out = {}
        for s in plan.seqs:
            if s.sample:
                hist = self.states[s.request_id]
                nxt = (hist[-1] + 1) % VOCAB
                out[s.request_id] = nxt if nxt != EOS or hist[0] == 0 else nxt + 1
                hist.append(out[s.request_id])
        return StepResult(plan.step_id, out, 0.0)


class FakeTokenizer:
    eos_token_ids = (EOS,)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids if not (skip_special_tokens and i == EOS))


class FakeModelConfig:
    vocab_size = VOCAB
    max_position_embeddings = 256
    eos_token_ids = (EOS,)
    name = "fake"


_ids = itertools.count()


def make_engine(num_blocks: int = 32, **kw) -> tuple[AsyncEngine, FakeRunner]:
    cfg = EngineConfig(block_size=4, **{"max_batch_size": 4, "max_queue_size": 4, **kw})
    runner = FakeRunner(num_blocks)
    return AsyncEngine(cfg, FakeModelConfig(), FakeTokenizer(), runner, "fake"), runner


def greq(prompt=(5, 6, 7), timeout_s=None, **params):
    return GenerateRequest(f"r{next(_ids)}", tuple(prompt),
                           SamplingParams(**{"max_new_tokens": 8, "seed": 0, **params}),
                           timeout_s=timeout_s)


async def collect(engine, g):
    return [o async for o in engine.generate(g)]


@pytest.fixture
async def engine():
    e, _ = make_engine()
    await e.start()
    yield e
    await e.stop()


async def assert_leak_free(engine):
    await engine.wait_idle(timeout=5)
    st = engine.stats()
    assert st.num_free_blocks == st.num_blocks and st.num_running == st.num_waiting == 0
    # idle: the model thread holds no request's sampling state either
    assert engine.executor.runner.states == {}


async def test_generates_and_finishes(engine):
    outs = await collect(engine, greq(max_new_tokens=5))
    assert [t for o in outs for t in o.new_token_ids] == [8, 9, 10, 11, 12]
    assert "".join(o.new_text for o in outs) == "ijklm"
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[0].prefill_time_ms is not None and outs[0].queue_time_ms is not None
    await assert_leak_free(engine)


async def test_eos_ends_request(engine):
    outs = await collect(engine, greq(prompt=(0, 1), max_new_tokens=5))
    assert outs[-1].finish_reason is FinishReason.EOS and outs[-1].num_output_tokens == 1


async def test_close_before_reading_aborts_and_frees(engine):
    it = engine.generate(greq(max_new_tokens=100))
    await asyncio.sleep(0.02)  # the request is running
    await it.aclose()
    await assert_leak_free(engine)
    assert engine.stats().finished_by_reason.get("abort") == 1


async def test_consumer_cancelled_mid_stream_aborts(engine):
    async def consume():
        async for _ in engine.generate(greq(max_new_tokens=1000)):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.03)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_leak_free(engine)


async def test_abort_of_waiting_request(engine):
    long = [asyncio.create_task(collect(engine, greq(max_new_tokens=50))) for _ in range(4)]
    await asyncio.sleep(0.01)
    queued = engine.generate(greq(max_new_tokens=50))
    await asyncio.sleep(0.01)
    assert engine.stats().num_waiting == 1
    await queued.aclose()
    await asyncio.gather(*long)
    await assert_leak_free(engine)


async def test_client_timeout_fires_with_mindie_message(engine):
    outs = await collect(engine, greq(max_new_tokens=10_000, timeout_s=0.05, ignore_eos=True))
    assert outs[-1].finish_reason is FinishReason.TIMEOUT
    assert outs[-1].error == "Engine callback timeout: client timeout"
    await assert_leak_free(engine)


async def test_full_queue_is_refused_at_once(engine):
    running = [engine.generate(greq(max_new_tokens=200)) for _ in range(8)]  # 4 run + 4 wait
    with pytest.raises(EngineOverloadedError):
        engine.generate(greq())
    for it in running:
        await it.aclose()
    await assert_leak_free(engine)
    assert (await collect(engine, greq(max_new_tokens=2)))[-1].finished


async def test_executor_failure_fails_the_step_and_engine_keeps_serving():
    e, runner = make_engine()
    await e.start()
    try:
        runner.fail_next = True
        outs = await collect(e, greq())
        assert outs[-1].finish_reason is FinishReason.ERROR and "device lost" in outs[-1].error
        assert e.is_healthy()
        assert (await collect(e, greq(max_new_tokens=3)))[-1].finish_reason is FinishReason.LENGTH
        await assert_leak_free(e)
    finally:
        await e.stop()


async def test_many_concurrent_requests_tiny_pool_all_complete():
    e, _ = make_engine(num_blocks=6, max_batch_size=8, max_queue_size=64)
    await e.start()
    try:
        results = await asyncio.gather(*(collect(e, greq(prompt=(10 + i, 11, 12), max_new_tokens=10))
                                         for i in range(20)))
        for i, outs in enumerate(results):
            toks = [t for o in outs for t in o.new_token_ids]
            assert toks == [(13 + k) % VOCAB for k in range(10)], i
        assert e.stats().num_preemptions > 0
        await assert_leak_free(e)
    finally:
        await e.stop()


async def test_abort_ends_with_one_final_output(engine):
    handle = engine.generate(greq(max_new_tokens=1000))
    first = await handle.get()
    assert first is not None and not first.finished
    assert handle.abort() and not handle.abort()  # idempotent
    outs = [o async for o in handle]
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.ABORT
    assert sum(o.finished for o in outs) == 1
    await assert_leak_free(engine)


async def test_abort_with_error_ends_as_error(engine):
    handle = engine.generate(greq(max_new_tokens=1000))
    handle.abort(error="drain time over")
    outs = [o async for o in handle]
    assert outs[-1].finish_reason is FinishReason.ERROR and outs[-1].error == "drain time over"
    await assert_leak_free(engine)


async def test_get_returns_none_on_disconnect_without_cancelling(engine):
    from tokenserve.aio import Signal

    gone = Signal()
    handle = engine.generate(greq(max_new_tokens=1000))
    assert await handle.get(gone) is not None
    asyncio.get_running_loop().call_later(0.01, gone.set)
    while (out := await handle.get(gone)) is not None:
        assert not out.finished
    handle.abort()
    await assert_leak_free(engine)


async def test_stop_engine_ends_open_requests():
    e, _ = make_engine()
    await e.start()
    handle = e.generate(greq(max_new_tokens=1000))
    await e.stop()
    outs = [o async for o in handle]
    assert outs[-1].finish_reason is FinishReason.ERROR


async def test_event_loop_held_until_the_model_thread_takes_the_step(monkeypatch):
    """ExecutorActor.run holds the loop until the worker thread has started the step, so
    the tasks that run next (a step's stream writes) do not take the core it needs: the
    step starts before a callback already queued on the loop runs."""
    from tokenserve.engine import model_runner

    monkeypatch.setattr(model_runner, "START_WAIT_S", 30.0)  # no timeout on a loaded host
    order: list[str] = []

    class Runner:
        def step(self, plan: StepPlan) -> StepResult:
            order.append("step")
            return StepResult(plan.step_id, {}, 0.0)

        def close(self) -> None:
            pass

    ex = model_runner.ExecutorActor(Runner())
    try:
        for i in range(5):
            order.clear()
            asyncio.get_running_loop().call_soon(order.append, "loop")
            assert (await ex.run(StepPlan(i, ()))).step_id == i
            await asyncio.sleep(0)
            assert order == ["step", "loop"], i
    finally:
        ex.close()
