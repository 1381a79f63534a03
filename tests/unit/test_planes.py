"""Listening planes (spec/interfaces.md §0.1): route classification, the listener layout
and ``serve()`` with separate business / management / metrics ports on real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.fakes import FakeEngine
from tokenserve.api.routes import plane_of
from tokenserve.cli import build_parser
from tokenserve.server.app import serve
from tokenserve.transport.planes import ALL_PLANES, Plane, plane_layout
from tokenserve.transport.server import HttpServer

B, MG, MT = Plane.BUSINESS, Plane.MANAGEMENT, Plane.METRICS
M = "fake-model"


@pytest.mark.parametrize(
    ("path", "plane"),
    [
        ("/infer", B), ("/generate", B), ("/v1/chat/completions", B), ("/v1/models", B),
        ("/v2", B), (f"/v2/models/{M}", B), (f"/v2/models/{M}/config", B),
        (f"/v2/models/{M}/infer", B), (f"/v2/models/{M}/generate_stream", B),
        (f"/v2/models/{M}/stopInfer", B), ("/v1/tokenizer", B), ("/dresult", B),
        ("/health", MG), ("/health/timed", MG), ("/health/timed-30", MG), ("/info", MG),
        ("/v2/health/live", MG), ("/v2/health/ready", MG), (f"/v2/models/{M}/ready", MG),
        (f"/v2/models/{M}/getSlotCount", MG), ("/metrics-json", MG), ("/stopService", MG),
        ("/v1/config", MG), ("/v1/status", MG), ("/v2/status", MG), ("/v1/role/decode", MG),
        ("/v1/load_lora_adapter", MG), ("/v1/engine-server/running-status", MG),
        ("/metrics", MT), ("/metricsx", B), ("/healthz", B),
    ],
)
def test_plane_of(path: str, plane: Plane) -> None:
    assert plane_of(path) is plane


def test_layouts() -> None:
    def summary(*args, **kw):
        return [(s.host, s.port, set(s.planes)) for s in plane_layout(*args, **kw)]

    # defaults: one port serves everything
    assert summary("h", 1025) == [("h", 1025, set(ALL_PLANES))]
    # all different (MindIE defaults)
    assert summary("127.0.0.1", 1025, "127.0.0.2", 1026, 1027) == [
        ("127.0.0.1", 1025, {B}), ("127.0.0.2", 1026, {MG}), ("127.0.0.2", 1027, {MT})]
    # management + metrics together
    assert summary("h", 1025, None, 1026) == [("h", 1025, {B}), ("h", 1026, {MG, MT})]
    # business + management together, metrics apart
    assert summary("h", 1025, None, 1025, 1027) == [("h", 1025, {B, MG}), ("h", 1027, {MT})]
    # metrics back on the business port
    assert summary("h", 1025, None, 1026, 1025) == [("h", 1025, {B, MT}), ("h", 1026, {MG})]
    # another address, same port number: a listener of its own
    assert summary("a", 1025, "b") == [("a", 1025, {B}), ("b", 1025, {MG, MT})]
    # explicit ephemeral ports never merge; inherited ones do
    assert summary("h", 0, None, 0, 0) == [("h", 0, {B}), ("h", 0, {MG}), ("h", 0, {MT})]
    assert summary("h", 0) == [("h", 0, set(ALL_PLANES))]


@pytest.fixture
async def planes() -> AsyncIterator[dict[Plane, httpx.AsyncClient]]:
    engine = FakeEngine()
    stop = asyncio.Event()
    fut: asyncio.Future[dict[Plane, HttpServer]] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(engine, "127.0.0.1", 0, management_port=0, metrics_port=0,
                                     stop=stop, listeners=fut))
    servers = await asyncio.wait_for(fut, 5)
    clients = {p: httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.ports[0]}", timeout=5)
               for p, s in servers.items()}
    yield clients
    for c in clients.values():
        await c.aclose()
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_separate_planes(planes) -> None:
    business, management, metrics = planes[B], planes[MG], planes[MT]
    assert len({str(c.base_url) for c in planes.values()}) == 3
    body = {"inputs": "ab", "parameters": {"max_new_tokens": 2}}
    assert (await business.post("/infer", json=body)).status_code == 200
    assert (await business.get("/v2")).status_code == 200
    for path in ("/health", "/v2/health/ready", f"/v2/models/{M}/ready", "/metrics-json",
                 f"/v2/models/{M}/getSlotCount"):
        assert (await management.get(path)).status_code == 200, path
        assert (await business.get(path)).status_code == 404, path
        assert (await metrics.get(path)).status_code == 404, path
    r = await metrics.get("/metrics")
    assert r.status_code == 200 and 'request_received_total{model_name="fake-model"} 1.0' in r.text
    assert (await business.get("/metrics")).status_code == 404
    assert (await management.get("/metrics")).status_code == 404
    assert (await management.post("/infer", json=body)).status_code == 404
    assert (await metrics.post("/infer", json=body)).status_code == 404
    r = (await management.get("/metrics-json")).json()
    assert r["result"][0]["metric"][0]["instance"] == str(management.base_url)[7:].rstrip("/")


async def test_single_port_serves_every_plane() -> None:
    stop = asyncio.Event()
    fut: asyncio.Future[HttpServer] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(FakeEngine(), "127.0.0.1", 0, stop=stop, started=fut))
    server = await asyncio.wait_for(fut, 5)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.ports[0]}") as c:
            for path in ("/health", "/v2/health/live", "/metrics", "/metrics-json", "/v2"):
                assert (await c.get(path)).status_code == 200, path
            r = await c.post("/infer", json={"inputs": "a", "parameters": {"max_new_tokens": 1}})
            assert r.status_code == 200
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


def test_cli_flags() -> None:
    args = build_parser().parse_args(["serve", "--port", "1025", "--management-host",
                                      "127.0.0.2", "--management-port", "1026",
                                      "--metrics-port", "1027"])
    assert (args.port, args.management_host, args.management_port, args.metrics_port) == (
        1025, "127.0.0.2", 1026, 1027)
    args = build_parser().parse_args(["serve"])
    assert args.management_host is None and args.management_port is None
    assert args.metrics_port is None
