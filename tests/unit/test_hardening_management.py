"""``GET /health/timed[-N]`` (spec §7.1), ``GET /v1/config`` (spec §7.3) and the OpenAI
unknown-model error that names the served ids (issue 11 item 6)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.fakes import FakeEngine
from tokenserve.api.management import INVALID_WAIT, ServedConfig, parse_wait
from tokenserve.server.app import build_router
from tokenserve.transport.server import HttpServer

SERVED = ServedConfig.build("fake-model", 64, 1 << 30, False, 512, 128)


async def client_for(engine: FakeEngine) -> tuple[HttpServer, httpx.AsyncClient]:
    server = HttpServer(build_router(engine, served_config=SERVED))
    await server.start("127.0.0.1", 0)
    return server, httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.ports[0]}",
                                     timeout=5)


@pytest.mark.parametrize("path", ["/health/timed", "/health/timed-1", "/health/timed-600"])
async def test_timed_health_runs_one_token(path: str) -> None:
    engine = FakeEngine()
    server, client = await client_for(engine)
    async with client:
        r = await client.get(path)
    await server.close(0.5)
    assert r.status_code == 200 and r.json() == {"status": "healthy"}
    assert engine.requests[-1].params.max_new_tokens == 1


@pytest.mark.parametrize("suffix", ["0", "601", "abc", "0010"])
async def test_timed_health_bad_wait_is_404(suffix: str) -> None:
    server, client = await client_for(FakeEngine())
    async with client:
        r = await client.get(f"/health/timed-{suffix}")
    await server.close(0.5)
    assert r.status_code == 404 and r.json() == {"error": INVALID_WAIT,
                                                 "error_type": "NotFoundError"}


async def test_timed_health_unhealthy_503_and_slow_engine_500() -> None:
    server, client = await client_for(FakeEngine(healthy=False))
    async with client:
        r = await client.get("/health/timed-1")
    await server.close(0.5)
    assert r.status_code == 503 and r.content == b""

    slow = FakeEngine(delay=3.0)
    server, client = await client_for(slow)
    async with client:
        r = await client.get("/health/timed-1")
    await server.close(0.5)
    assert r.status_code == 500 and "within 1 s" in r.json()["error"]
    await asyncio.sleep(0)
    assert slow.requests[-1].request_id in slow.closed_early  # the probe was ended


def test_parse_wait_default_and_range() -> None:
    assert parse_wait(None) == 10 and parse_wait("600") == 600
    with pytest.raises(ValueError):
        parse_wait("1000")


async def test_v1_config_reports_the_served_model() -> None:
    server, client = await client_for(FakeEngine())
    async with client:
        r = await client.get("/v1/config")
    await server.close(0.5)
    assert r.status_code == 200
    assert r.json() == {"modelName": "fake-model", "maxSeqLen": 64, "npuMemSize": -1,
                        "cpuMemSize": 1, "worldSize": 1, "maxOutputLen": 512,
                        "cacheBlockSize": 128}


async def test_openai_unknown_model_names_the_served_ids() -> None:
    server, client = await client_for(FakeEngine())
    async with client:
        r = await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "ab"})
    await server.close(0.5)
    assert r.status_code == 422
    message = r.json()["error"]["message"]
    assert "Not found given model" in message and "Available models: fake-model." in message
