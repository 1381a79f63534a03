"""Metrics (spec/interfaces.md §7.6, §7.7) recorded by EngineStream for every family, and
the live-request registry, over a real socket with the scripted FakeEngine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes import FakeEngine, serve_fake, wait_for
from tokenserve.api.context import ServeContext
from tokenserve.engine.engine import EngineStats
from tokenserve.messages import FinishReason
from tokenserve.server.app import build_router
from tokenserve.server.metrics import (
    E2E_BUCKETS,
    TOKEN_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    ServerMetrics,
)
from tokenserve.transport.drain import RequestRegistry
from tokenserve.transport.server import HttpServer

M = "fake-model"


@dataclass
class Cfg:
    device: str = "cpu"


@dataclass
class StatsEngine(FakeEngine):
    """FakeEngine with ``stats()`` and ``cfg`` like AsyncEngine."""

    cfg: Cfg = field(default_factory=Cfg)
    running: int = 3
    preemptions: int = 2

    def stats(self) -> EngineStats:
        return EngineStats(self.running, 1, 100, 75, self.preemptions, {"abort": 1},
                           prefix_query_tokens=40, prefix_hit_tokens=10)


@pytest.fixture
async def env() -> AsyncIterator[tuple[StatsEngine, httpx.AsyncClient]]:
    engine = StatsEngine()
    async with serve_fake(engine, max_body_bytes=40 << 20) as (_, client):
        yield engine, client


async def scrape(client: httpx.AsyncClient) -> dict[str, Any]:
    """sample name (+ le for buckets) -> value, checking every series' model_name."""
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            assert s.labels["model_name"] == M, s
            key = s.name + (f"@{s.labels['le']}" if "le" in s.labels else "")
            out[key] = s.value
    return out


async def test_counts_across_families(env) -> None:
    _, client = env
    before = await scrape(client)
    assert before["request_received_total"] == 0
    p = {"max_new_tokens": 3}
    for r in await asyncio.gather(
        client.post("/infer", json={"inputs": "abc", "parameters": p}),
        client.post(f"/v2/models/{M}/generate", json={"text_input": "abcd", "parameters": p}),
        client.post(f"/v2/models/{M}/generate_stream", json={"text_input": "ab",
                                                              "parameters": p}),
        client.post(f"/v2/models/{M}/infer", json={"inputs": [
            {"name": "i", "shape": [2], "datatype": "UINT32", "data": [1, 2],
             "parameters": p}]}),
    ):
        assert r.status_code == 200
    bad = await client.post("/infer", json={"inputs": "abc", "parameters": {"top_p": 1.0}})
    assert bad.status_code == 422  # never reaches the engine: not counted
    m = await scrape(client)
    assert m["request_received_total"] == 4
    assert m["request_success_total"] == 4 and m["request_failed_total"] == 0
    assert m["failed_request_perc"] == 0
    assert m["time_to_first_token_seconds_count"] == 4
    assert m["time_to_first_token_seconds_sum"] == pytest.approx(4 * 0.0123)
    assert m["time_per_output_token_seconds_count"] == 4
    assert m["time_per_output_token_seconds_sum"] == pytest.approx(4 * 0.0046)
    assert m["e2e_request_latency_seconds_count"] == 4
    assert m["request_prompt_tokens_sum"] == 3 + 4 + 2 + 2
    assert m["request_generation_tokens_sum"] == 12
    assert m["request_generation_tokens_bucket@10.0"] == 4
    assert m["prompt_tokens_total"] == 11 and m["generation_tokens_total"] == 12
    # engine state, read at scrape time
    assert m["num_requests_running"] == 3 and m["num_requests_waiting"] == 1
    assert m["num_requests_swapped"] == 0
    assert m["cpu_cache_usage_perc"] == 0.25 and m["npu_cache_usage_perc"] == 0
    assert m["num_preemptions_total"] == 2
    assert m["npu_prefix_cache_hit_rate"] == 0.25
    assert m["all_radix_match_num"] == 40 and m["npu_radix_match_hit_num"] == 10
    assert "avg_prompt_throughput_toks_per_s" in m
    assert "avg_generation_throughput_toks_per_s" in m


async def test_buckets_follow_spec(env) -> None:
    _, client = env
    m = await scrape(client)
    for name, bounds in (("time_to_first_token_seconds", TTFT_BUCKETS),
                         ("time_per_output_token_seconds", TPOT_BUCKETS),
                         ("e2e_request_latency_seconds", E2E_BUCKETS),
                         ("request_prompt_tokens", TOKEN_BUCKETS),
                         ("request_generation_tokens", TOKEN_BUCKETS)):
        les = [k.split("@")[1] for k in m if k.startswith(f"{name}_bucket@")]
        assert les == [repr(float(b)) for b in bounds] + ["+Inf"], name
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and TOKEN_BUCKETS[-1] == 128000


async def test_failures_timeout_disconnect_stop(env) -> None:
    engine, client = env
    engine.finish, engine.finish_after = FinishReason.TIMEOUT, 1
    r = await client.post("/infer", json={"inputs": "ab", "parameters": {"max_new_tokens": 5}})
    assert r.status_code == 500
    engine.finish_after = None
    engine.delay = 0.05
    async with client.stream("POST", "/infer", json={"inputs": "ab", "stream": True,
                                                     "parameters": {"max_new_tokens": 50}}) as s:
        async for _ in s.aiter_bytes():
            break
    await wait_for(lambda: len(engine.aborted) == 1)
    task = asyncio.create_task(client.post(f"/v2/models/{M}/generate", json={
        "id": "x", "text_input": "ab", "parameters": {"max_new_tokens": 50}}))
    await wait_for(lambda: len(engine.requests) == 3)
    await asyncio.sleep(0.08)
    assert (await client.post(f"/v2/models/{M}/stopInfer", json={"id": "x"})).status_code == 200
    assert (await task).status_code == 200
    m = await scrape(client)
    assert m["request_received_total"] == 3
    # every request is a success or a failure (MindIE's sums, issue 40); a disconnect and
    # a stopInfer are failures that are also the client going away (issue 22 c)
    assert m["request_failed_total"] == 3 and m["request_success_total"] == 0
    assert m["request_disconnected_total"] == 2
    assert m["failed_request_perc"] == 1.0


async def test_metrics_json(env) -> None:
    _, client = env
    await client.post("/infer", json={"inputs": "ab", "parameters": {"max_new_tokens": 3}})
    r = await client.get("/metrics-json")
    assert r.status_code == 200
    body = r.json()
    assert body["resultType"] == "vector"
    by_name = {e["metric"][0]["__name__"]: e for e in body["result"]}
    assert list(by_name) == ["TTFT", "TBT", "waitingInferRequestNum",
                             "processingInferRequestNum", "remainBlocks"]
    assert all(isinstance(e["value"], str) for e in body["result"])
    assert all(e["metric"][0]["job"] == "node" for e in body["result"])
    assert float(by_name["TTFT"]["value"]) == pytest.approx(12.3, abs=0.01)
    assert float(by_name["TBT"]["value"]) == pytest.approx(4.6, abs=0.01)
    assert by_name["remainBlocks"]["value"] == "75"
    assert by_name["processingInferRequestNum"]["value"] == "3"


def test_registry_per_server_and_npu_device() -> None:
    a, b = ServerMetrics(StatsEngine()), ServerMetrics(StatsEngine(cfg=Cfg("npu")))
    assert a.registry is not b.registry
    a.outcomes.received += 1
    ra, rb = a.render().decode(), b.render().decode()
    assert 'request_received_total{model_name="fake-model"} 1.0' in ra
    assert 'request_received_total{model_name="fake-model"} 0.0' in rb
    assert 'npu_cache_usage_perc{model_name="fake-model"} 0.25' in rb
    assert "_created" not in ra
    # an engine without stats(): the engine-state series are left out, nothing fails
    plain = ServerMetrics(FakeEngine()).render().decode()
    assert "request_received_total" in plain and "num_requests_running" not in plain


class _S:
    def __init__(self, rid: str) -> None:
        self.request_id = rid

    async def stop(self) -> bool:
        return True


def test_request_registry() -> None:
    reg = RequestRegistry()
    s1, s2 = _S("r1"), _S("r2")
    reg.add(s1, ("r1", "client"))
    reg.add(s2, ("r2", "client", "r2"))
    assert reg.find("client") == [s1, s2] and reg.find("r2") == [s2] and len(reg) == 2
    reg.remove(s1, ("r1", "client"))
    assert reg.find("client") == [s2] and "r1" not in reg
    reg.remove(s2, ("r2", "client"))
    reg.remove(s2, ("r2",))  # twice: no error
    assert len(reg) == 0 and reg.find("client") == []
    assert ServeContext().metrics is None


async def test_registry_tracks_live_requests() -> None:
    engine = StatsEngine(delay=0.02)
    ctx = ServeContext(metrics=ServerMetrics(engine))
    server = HttpServer(build_router(engine, context=ctx))
    await server.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.ports[0]}") as c:
            task = asyncio.create_task(c.post(f"/v2/models/{M}/generate", json={
                "id": "q", "text_input": "a", "parameters": {"max_new_tokens": 10}}))
            await wait_for(lambda: "q" in ctx.registry)
            rid = engine.requests[-1].request_id
            assert [s.request_id for s in ctx.registry.find("q")] == [rid]
            assert rid in ctx.registry and len(ctx.registry) == 1
            assert (await task).status_code == 200
            assert len(ctx.registry) == 0
            assert ctx.metrics is not None and ctx.metrics.success == 1
    finally:
        await server.close(timeout=1.0)


def test_tpot_counts_only_timed_tokens() -> None:
    """A slow consumer gets outputs merged; tokens merged into the first output have no
    decode time, so TPOT divides the decode time by the tokens it covers."""
    from tokenserve.messages import GenerateRequest, RequestOutput
    from tokenserve.sampling_params import SamplingParams

    m = ServerMetrics(FakeEngine())
    t = m.request_started(GenerateRequest("r", (1, 2), SamplingParams(), arrival_time=1.0))

    def out(ids, fin=False, **kw):
        return RequestOutput("r", ids, "x", fin, FinishReason.LENGTH if fin else None, 2,
                             0, **kw)

    t.output(out((5, 6, 7), prefill_time_ms=40.0))  # three tokens merged into the first
    t.output(out((8, 9), decode_time_ms=30.0))  # two merged: 15 ms each
    t.output(out((4,), fin=True, decode_time_ms=15.0))
    t.finished(out((), fin=True))
    assert m.success == 1 and m.ttft.count == 1 and m.ttft.sum == pytest.approx(0.04)
    assert m.tpot.count == 1 and m.tpot.sum == pytest.approx(0.015)
    assert m.generation_tokens.sum == 6 and m.live_prompt_tokens == 2
    t.finished(None)  # idempotent
    assert m.success + m.failed == 1


def test_a_client_that_went_away_is_a_failure_counted_once() -> None:
    """A disconnect (or stopInfer) is a failure, also counted in
    request_disconnected_total (issue 22 c); received == success + failed (issue 40). A
    request that timed out and whose client then left is one failure, not a disconnect;
    a second ``finished`` counts nothing."""
    from tokenserve.messages import GenerateRequest, RequestOutput
    from tokenserve.sampling_params import SamplingParams

    m = ServerMetrics(FakeEngine())

    def run(reason, **kw):
        t = m.request_started(GenerateRequest("r", (1,), SamplingParams(), arrival_time=1.0))
        t.finished(RequestOutput("r", (), "", True, reason, 1, 0), **kw)

    run(FinishReason.ABORT, disconnected=True)
    run(FinishReason.ERROR)
    run(FinishReason.LENGTH, disconnected=True)  # it had finished: a success
    run(FinishReason.TIMEOUT, disconnected=True)  # timed out, then the client left
    t = m.request_started(GenerateRequest("r", (1,), SamplingParams(), arrival_time=1.0))
    t.finished(None, disconnected=True)  # gone before any final output
    t.finished(RequestOutput("r", (), "", True, FinishReason.TIMEOUT, 1, 0))  # no-op
    assert (m.success, m.failed, m.disconnected) == (1, 4, 2)
    assert m.received == m.success + m.failed
    from prometheus_client import generate_latest

    text = generate_latest(m.registry).decode()
    assert "request_disconnected_total" in text


def test_a_request_of_several_sequences_is_counted_once() -> None:
    """OpenAI n = 2 (or a list of prompts) is one request on a mixed server, as the PD
    coordinator counts it (issue 40): received once, one outcome after the last
    sequence ends, TTFT of the first token, tokens of every sequence, each distinct
    prompt once."""
    from tokenserve.messages import GenerateRequest, RequestOutput
    from tokenserve.sampling_params import SamplingParams

    m = ServerMetrics(FakeEngine())

    def req(prompt):
        return GenerateRequest("r", prompt, SamplingParams(), arrival_time=1.0)

    def out(ids, fin=False, reason=FinishReason.LENGTH, **kw):
        return RequestOutput("r", ids, "x", fin, reason if fin else None, 2, 0, **kw)

    a = m.request_started(req((1, 2)))
    b = a.sibling(req((1, 2)))  # n = 2: the same prompt
    c = a.sibling(req((3, 4, 5)))  # a second prompt
    assert m.received == 1
    b.output(out((7,), prefill_time_ms=20.0))
    a.output(out((6,), prefill_time_ms=30.0))
    a.output(out((8, 9), decode_time_ms=20.0))
    c.output(out((1,), prefill_time_ms=40.0))
    for t in (a, b):
        t.finished(out((), fin=True))
        assert m.success + m.failed == 0  # c still running
    c.finished(out((), fin=True))
    assert (m.received, m.success, m.failed) == (1, 1, 0)
    assert m.ttft.count == 1 and m.ttft.sum == pytest.approx(0.02)
    assert m.tpot.count == 1 and m.tpot.sum == pytest.approx(0.01)
    assert m.generation_tokens.sum == 5 and m.prompt_tokens.sum == 5
    assert m.live_prompt_tokens == 5

    # one sequence failed: the request is one failure; a disconnect only when every
    # failed sequence ended by its client going away
    for reasons, disc, want in (((FinishReason.LENGTH, FinishReason.ERROR), False, (1, 0)),
                                ((FinishReason.ABORT, FinishReason.ABORT), True, (1, 1)),
                                ((FinishReason.TIMEOUT, FinishReason.ABORT), True, (1, 0))):
        before = (m.failed, m.disconnected)
        first = m.request_started(req((1,)))
        second = first.sibling(req((1,)))
        for t, reason in zip((first, second), reasons):
            t.finished(out((), fin=True, reason=reason), disconnected=disc)
        assert (m.failed - before[0], m.disconnected - before[1]) == want, reasons
    assert m.received == m.success + m.failed
