"""What PD needs of the engine (issue 40): the ``PdEngine`` protocol, its implementations
(the real ``AsyncEngine`` and the tests' ``FakeEngine``), and ``evict`` / ``wait_idle``
answered by the scheduler actor's reply instead of a polling loop."""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from typing import Any

import pytest

from tests.fakes import FakeEngine
from tests.unit.test_engine_fake_runner import collect, greq, make_engine
from tokenserve.api.engine_client import EngineClient, PdEngine
from tokenserve.engine.engine import AsyncEngine
from tokenserve.messages import FinishReason, GenerateRequest
from tokenserve.sampling_params import SamplingParams


def _members(proto: type) -> list[str]:
    """The protocol's members, its bases' included (what ``isinstance`` checks)."""
    return sorted({name for cls in proto.__mro__ if cls.__dict__.get("_is_protocol")
                   for name in cls.__dict__
                   if not name.startswith("_") and name not in ("copy_with",)})


def _shape(obj: Any) -> tuple[str, tuple[str, ...]] | str:
    """A member's shape: ``property``/``attribute``, or (sync|async, parameter names)."""
    if isinstance(obj, property):
        return "property"
    if not callable(obj):
        return "attribute"
    kind = "async" if inspect.iscoroutinefunction(obj) else "sync"
    return kind, tuple(inspect.signature(obj).parameters)


def _mismatches(impl: Any, proto: type) -> list[str]:
    """Members of ``proto`` that the instance ``impl`` lacks or defines with another
    shape (a property may be a plain attribute: the protocol only reads it)."""
    cls, out = type(impl), []
    for name in _members(proto):
        want = _shape(next(c.__dict__[name] for c in proto.__mro__ if name in c.__dict__))
        if name not in dir(impl):  # not hasattr: that would run a property
            out.append(f"{cls.__name__}.{name} missing")
            continue
        got = _shape(inspect.getattr_static(cls, name, None)
                     if name in dir(cls) else inspect.getattr_static(impl, name))
        if want == "property" and got in ("property", "attribute"):
            continue
        if got != want:
            out.append(f"{cls.__name__}.{name}: {got} != {want}")
    return out


def test_pd_engine_extends_the_engine_client() -> None:
    members = _members(PdEngine)
    assert set(_members(EngineClient)) < set(members)
    assert {"kv_region", "set_kv_puller", "release", "evict"} <= set(members)


@pytest.mark.parametrize("make", [lambda: make_engine()[0], FakeEngine],
                         ids=["AsyncEngine", "FakeEngine"])
def test_implementations_match_the_protocol(make: Any) -> None:
    """Every member, with the protocol's parameters and sync/async kind: the static
    check (``isinstance`` on a runtime-checkable protocol only sees names)."""
    impl = make()
    assert _mismatches(impl, PdEngine) == []
    if isinstance(impl, AsyncEngine):  # its property reads the runner: the class's
        assert isinstance(inspect.getattr_static(AsyncEngine, "kv_region"), property)


def test_a_typed_fake_engine_is_a_pd_engine() -> None:
    fake = FakeEngine()
    assert isinstance(fake, EngineClient) and isinstance(fake, PdEngine)


def test_the_checks_catch_a_missing_or_reshaped_member() -> None:
    """The negative control: an engine without ``evict``, or with a sync one."""

    class NoEvict(FakeEngine):
        evict = None  # type: ignore[assignment]

    class SyncEvict(FakeEngine):
        def evict(self, request_id: str, timeout_s: float = 10.0) -> bool:  # type: ignore[override]
            return False

    assert not isinstance(NoEvict(), PdEngine)
    want = "('async', ('self', 'request_id', 'timeout_s'))"
    assert _mismatches(NoEvict(), PdEngine) == [f"NoEvict.evict: attribute != {want}"]
    assert _mismatches(SyncEvict(), PdEngine) == [
        f"SyncEvict.evict: ('sync', ('self', 'request_id', 'timeout_s')) != {want}"]


# ------------------------------------------------------------------ replies, not polling


@pytest.fixture
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record every ``asyncio.sleep`` the engine calls (a polling loop would); the delays.
    Other tasks of the test session's loop (a watchdog left by another test) may sleep."""
    calls: list[float] = []
    real = asyncio.sleep

    async def sleep(delay: float, result: Any = None) -> Any:
        if sys._getframe(1).f_globals.get("__name__", "").startswith("tokenserve.engine"):
            calls.append(delay)
        return await real(delay, result)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    return calls


@pytest.fixture
async def engine() -> Any:
    """A started engine over the fake runner (tests/unit/test_engine_fake_runner.py)."""
    e, _ = make_engine()
    await e.start()
    yield e
    await e.stop()


async def _parked(engine: AsyncEngine) -> tuple[str, Any]:
    """A prefill-only request, parked after its first token (its blocks held)."""
    rid = "parked-1"
    handle = engine.generate(GenerateRequest(rid, (5, 6, 7, 8, 9),
                                             SamplingParams(max_new_tokens=8, seed=0),
                                             prefill_only=True))
    out = await handle.get()
    assert out is not None and out.handoff is not None and not out.finished
    assert engine.stats().num_free_blocks < engine.stats().num_blocks
    return rid, handle


async def test_evict_returns_on_the_actors_reply(engine: AsyncEngine,
                                                 no_sleep: list[float]) -> None:
    rid, handle = await _parked(engine)
    t0 = time.perf_counter()
    assert await engine.evict(rid, timeout_s=5)
    took = time.perf_counter() - t0
    # left the engine by the time evict returns: blocks freed, final output put
    st = engine.stats()
    assert st.num_free_blocks == st.num_blocks
    assert rid not in engine._streams
    final = handle.poll()
    assert final is not None and final.finished and final.finish_reason is FinishReason.ABORT
    assert no_sleep == [], "evict polled"
    assert took < 0.5  # one actor turn; generous for a loaded machine
    assert not await engine.evict(rid)  # gone: False at once
    await engine.wait_idle(timeout=5)
    assert no_sleep == [], "wait_idle polled"


async def test_evict_times_out_when_the_actor_does_not_answer(engine: AsyncEngine) -> None:
    rid, _handle = await _parked(engine)
    seen: list[Any] = []
    engine.actor.inbox.put_nowait = seen.append  # type: ignore[method-assign]
    try:
        with pytest.raises(TimeoutError):
            await engine.evict(rid, timeout_s=0.05)
    finally:
        del engine.actor.inbox.put_nowait
    assert seen and seen[0].done.cancelled()  # the reply was given up
    engine.release(rid)
    await engine.wait_idle(timeout=5)


async def test_wait_idle_answers_when_the_last_request_ends(engine: AsyncEngine,
                                                            no_sleep: list[float]) -> None:
    engine.executor.runner.delay = 0.01
    outs: list[Any] = []
    ended_at: list[float] = []

    async def consume() -> None:
        outs.extend(await collect(engine, greq(max_new_tokens=6)))
        ended_at.append(time.perf_counter())

    idle = asyncio.create_task(engine.wait_idle(timeout=5))
    await asyncio.gather(consume(), idle)
    idle_at = time.perf_counter()
    assert outs[-1].finished and idle.done()
    # it returned once the request had ended, with nothing left in the engine
    assert not engine.scheduler.has_work() and engine.actor.inbox.empty()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    assert idle_at - ended_at[0] < 0.5
    assert no_sleep == [], "wait_idle polled"


async def test_wait_idle_keeps_its_timeout_while_a_request_is_parked(
        engine: AsyncEngine) -> None:
    rid, _handle = await _parked(engine)
    with pytest.raises(TimeoutError):
        await engine.wait_idle(timeout=0.05)
    assert engine.release(rid)
    await engine.wait_idle(timeout=5)


async def test_wait_idle_on_a_stopped_engine() -> None:
    engine, _ = make_engine()
    await engine.wait_idle(timeout=0.01)  # never started: nothing to wait for
    await engine.start()
    await engine.stop()
    await engine.wait_idle(timeout=0.01)


async def test_stop_right_after_a_release_does_not_hang() -> None:
    """A cancel landing as the actor's timed inbox wait completes (the release's message)
    must stop the actor: asyncio.wait_for on Python 3.11 swallowed it and stop() hung."""
    for _ in range(20):
        engine, _ = make_engine()
        await engine.start()
        rid, _handle = await _parked(engine)
        assert engine.release(rid)
        t0 = time.perf_counter()
        # (stop() itself swallows a cancel of its wait, so the hang shows as time)
        await asyncio.wait_for(engine.stop(), timeout=5)
        assert time.perf_counter() - t0 < 2.0
