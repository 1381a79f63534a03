"""MindIE's request counters (spec/interfaces.md §7.7) add up on a mixed server and on
the PD coordinator after an abort storm (issue 40): every received request ends in
exactly one of success / failed, a disconnect being a failure (also counted in
``request_disconnected_total``), and a request that times out around the time its client
leaves is one failure, counted once. Real sockets, the real default model (the session's
``live`` server and ``pd_pair``, tests/integration/conftest.py).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import hang_up_mid_stream

pytestmark = pytest.mark.asyncio(loop_scope="session")

COUNTERS = ("request_received_total", "request_success_total", "request_failed_total",
            "request_disconnected_total")
#: streaming clients that hang up mid-stream
STORM = 10
#: the timed-out request's ``timeout`` (seconds, spec §2.1)
TIMEOUT_S = 1


async def counters(url: str) -> dict[str, float]:
    """The request counters of ``url``'s ``/metrics``."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.get("/metrics")
    assert r.status_code == 200
    return {s.name: s.value for fam in text_string_to_metric_families(r.text)
            for s in fam.samples if s.name in COUNTERS}


async def time_out_and_hang_up(url: str) -> None:
    """A MindIE-native stream that cannot end on its own within its ``timeout`` (sampled
    at a high temperature, 1000 tokens), whose client reads until about that timeout and
    then hangs up: the server's timeout and the client's disconnect land together, in
    either order."""
    body = {"inputs": "Tell me a very long story.", "stream": True,
            "parameters": {"max_new_tokens": 1000, "do_sample": True, "temperature": 5.0,
                           "seed": 7, "timeout": TIMEOUT_S}}
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=60) as c, \
            c.stream("POST", "/infer", json=body) as r:
        async for _ in r.aiter_bytes():
            if time.monotonic() - start >= TIMEOUT_S:
                break  # leaving the block closes the connection


async def storm_then_count(url: str, model: str, idle) -> None:
    """The abort storm and the timed-out request against ``url``; ``idle`` waits for
    the leak invariant; then the counters' sums."""
    before = await counters(url)
    chat = {"model": model, "stream": True, "max_tokens": 200, "ignore_eos": True}
    storm = [hang_up_mid_stream(url, "/v1/chat/completions",
                                {**chat, "messages": [{"role": "user",
                                                       "content": f"Count to {i + 50}."}]},
                                b"\n\n", after=3)
             for i in range(STORM)]
    await asyncio.gather(*storm, time_out_and_hang_up(url))
    await idle()  # the leak invariant: every KV block free

    n = STORM + 1
    # a handler records its end just after the engine ends the request: wait for them
    deadline = time.monotonic() + 30
    while True:
        after = await counters(url)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
        if delta["request_received_total"] == n and \
                delta["request_success_total"] + delta["request_failed_total"] == n:
            break
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert delta["request_received_total"] == n, delta
    # MindIE's identity, overall and for this storm: nothing in flight, nothing lost
    assert after["request_received_total"] == \
        after["request_success_total"] + after["request_failed_total"], after
    # every one of them failed, each once: 10 disconnects + 1 timeout
    assert (delta["request_success_total"], delta["request_failed_total"]) == (0, n), delta
    # the storm's disconnects are disconnects; the timed-out one may be either
    assert STORM <= delta["request_disconnected_total"] <= n, delta


async def test_abort_storm_keeps_received_equal_success_plus_failed(live):
    await storm_then_count(live.url, live.engine.model_name, live.assert_idle_and_leak_free)


async def test_the_same_sums_on_the_coordinator(live, pd_pair):
    """The coordinator's cluster series (its un-prefixed MindIE names) add up the same
    way after the same storm through P and D (issue 40: "on both")."""
    await storm_then_count(pd_pair.coord.url, live.engine.model_name,
                           lambda: asyncio.to_thread(pd_pair.assert_leak_free))
