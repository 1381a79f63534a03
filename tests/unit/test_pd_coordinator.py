"""The PD coordinator in-process against fake P and D servers (spec/pd_disaggregation.md
§3, §4.1, §5.3, §6, §7.3, §10, §11).

A fake P records each request and answers what the test scripts (a §5.3 document); the
script "sends" the request to the fake D named by ``d-target`` by making that D write
/dresult messages. A fake D serves ``/v1/status`` and one scripted ``/dresult`` stream.
Everything runs on 127.0.0.1 with ephemeral ports; every test is bounded in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import sys
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import orjson
import pytest

from tokenserve.api.ids import derived_id
from tokenserve.api.routes import INFERENCE
from tokenserve.cli import build_parser
from tokenserve.config.flags import coordinator_config as config_from_args
from tokenserve.config.flags import parse_instances
from tokenserve.config.tree import CoordinatorConfig, InstanceAddr
from tokenserve.coordinator.app import serve_coordinator
from tokenserve.coordinator.reqids import ReqIdGenerator
from tokenserve.pd.wire import WholeAnswer, close_message, encode, vllm_body
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError
from tokenserve.transport.router import Router
from tokenserve.transport.server import HttpServer

TEST_TIMEOUT_S = 15.0
MODEL = "m1"
Script = Callable[["FakeP", HttpRequest], Awaitable[tuple[int, bytes]]]


def bounded(fn: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Fail a test that runs longer than TEST_TIMEOUT_S instead of hanging the suite."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> None:
        await asyncio.wait_for(fn(*args, **kwargs), TEST_TIMEOUT_S)

    return wrapper


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    async def loop() -> None:
        while not cond():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(loop(), timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def p_answer(req_id: str, stream: bool, *, last: bool = False, output: str | None = None
             ) -> bytes:
    """A §5.3 P answer, keys in the spec's order."""
    obj: dict[str, Any] = {"reqId": req_id, "isStream": stream}
    if stream or last:
        obj["isLastResp"] = last
        obj["output"] = output or ""
    return orjson.dumps(obj)


def mindie_error(status: int, text: str) -> dict[str, str]:
    """What a mixed server answers for ``status`` on a non-OpenAI route (spec/interfaces.md
    §0.3): the coordinator's own errors look the same (PD spec §3.2 rule [I])."""
    kinds = {400: "Bad Request", 408: "Request Timeout", 422: "Input Validation Error",
             429: "Too Many Requests", 500: "Incomplete Generation",
             503: "Service Unavailable"}
    return {"error": text, "error_type": kinds[status]}


def assert_error(r: httpx.Response, status: int, text: str) -> None:
    """``r`` is the coordinator's own error ``status``/``text`` in MindIE's JSON shape."""
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    assert r.json() == mindie_error(status, text)


def mindie_stream_error(text: str) -> str:
    """The event that ends a failed MindIE-native stream (api/errors.py's table)."""
    return "data: " + orjson.dumps(mindie_error(500, text)).decode() + "\n\n"


async def race_disconnect(request: HttpRequest, work: Awaitable[Any]) -> Any:
    """``work``, or None as soon as the client (the coordinator) goes away."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(request.disconnected.wait())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        for t in (task, gone):
            t.cancel()


# ---------------------------------------------------------------------- fakes

class FakeServer:
    def __init__(self) -> None:
        self.server: HttpServer | None = None
        self.stops: list[tuple[str, dict[str, Any]]] = []

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.ports[0]

    async def start(self) -> None:
        router = self.router()
        router.post("/v2/models/{model}/stopInfer", self._stop)
        router.get("/v2/models/{model}/getSlotCount", self._slots)
        router.get("/info", self._info)
        router.get("/metrics", self._metrics)
        self.server = HttpServer(router)
        await self.server.start("127.0.0.1", 0)

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close(timeout=0.5)

    def router(self) -> Router:
        raise NotImplementedError

    #: this fake's getSlotCount answer (total, free, tokens)
    slots = (10, 7, 1600)

    async def _slots(self, request: HttpRequest, response: HttpResponse) -> None:
        if request.path_params["model"] != MODEL:
            await response.send(404, b'{"error":"no such model"}')
            return
        total, free, tokens = self.slots
        await response.send_json(200, {"total_slots": total, "free_slots": free,
                                       "available_tokens_length": tokens})

    async def _info(self, request: HttpRequest, response: HttpResponse) -> None:
        """TGI ``/info`` (spec/interfaces.md §3.5), its slots this fake's ``total_slots``."""
        await response.send_json(200, {"max_concurrent_requests": self.slots[0],
                                       "max_batch_total_tokens": 2048,
                                       "models": [{"model_id": MODEL}]})

    #: this fake's request_received_total (its own /metrics, as an instance's)
    received = 1

    async def _metrics(self, request: HttpRequest, response: HttpResponse) -> None:
        text = ("# HELP request_received_total Requests received\n"
                "# TYPE request_received_total counter\n"
                f'request_received_total{{model_name="{MODEL}"}} {float(self.received)}\n')
        await response.send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    async def _stop(self, request: HttpRequest, response: HttpResponse) -> None:
        self.stops.append((request.path, orjson.loads(request.body)))
        await response.send(200, b'{"result":"ok"}')


class FakeD(FakeServer):
    """/v1/status, one /dresult stream fed by :meth:`emit`, stopInfer."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = blocks
        self.alive = True
        self.links = 0
        self._queue: asyncio.Queue[bytes | None] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1;{self.port}"

    def router(self) -> Router:
        r = Router()
        r.get("/v1/status", self._status)
        r.get("/dresult", self._dresult)
        return r

    async def _status(self, request: HttpRequest, response: HttpResponse) -> None:
        if not self.alive:
            raise HttpError(503, "down")
        await response.send_json(200, {
            "service": {"roleStatus": "RoleReady", "currentRole": "decode",
                        "ipAddress": "127.0.0.1", "interCommPort": self.port},
            "resource": {"availSlotsNum": 10, "availBlockNum": self.blocks}})

    async def _dresult(self, request: HttpRequest, response: HttpResponse) -> None:
        if not self.alive:
            raise HttpError(503, "down")
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        if self._queue is not None:
            self._queue.put_nowait(close_message())
        self._queue = queue
        self.links += 1
        await response.start_stream(200, "text/event-stream")
        try:
            while (item := await race_disconnect(request, queue.get())) is not None:
                await response.write(item)
        finally:
            if self._queue is queue:
                self._queue = None

    @property
    def linked(self) -> bool:
        return self._queue is not None

    def emit(self, *chunks: bytes) -> None:
        """One /dresult chunk made of ``chunks``."""
        assert self._queue is not None, "no /dresult consumer"
        self._queue.put_nowait(b"".join(chunks))

    def say(self, req_id: str, *messages: tuple[str, str]) -> None:
        """Messages (kind, body) for ``req_id`` in one chunk."""
        self.emit(*(encode(req_id, k, b) for k, b in messages))

    def kill(self) -> None:
        """The D dies: its /dresult stream ends and nothing answers any more."""
        self.alive = False
        if self._queue is not None:
            self._queue.put_nowait(None)


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float = field(default_factory=time.monotonic)

    @property
    def req_id(self) -> str:
        return self.headers["req-id"]


class FakeP(FakeServer):
    """/v1/status, /v1/models, /health, /v1/tokenizer and every inference route, answered
    by ``script``."""

    def __init__(self, script: Script | None = None) -> None:
        super().__init__()
        self.script = script
        self.seen: list[Seen] = []

    def router(self) -> Router:
        r = Router()
        r.get("/v1/status", self._status)
        r.get("/v1/models", self._models)
        r.get("/health", self._health)
        r.post("/v1/tokenizer", self._tokenizer)
        for route in INFERENCE:
            r.post(route.path, self._infer)
        return r

    async def _status(self, request: HttpRequest, response: HttpResponse) -> None:
        await response.send_json(200, {
            "service": {"roleStatus": "RoleReady", "currentRole": "prefill",
                        "ipAddress": "127.0.0.1", "interCommPort": self.port},
            "resource": {"availSlotsNum": 10, "availBlockNum": 100}})

    async def _models(self, request: HttpRequest, response: HttpResponse) -> None:
        await response.send_json(200, {"object": "list", "data": [{"id": MODEL}]})

    async def _health(self, request: HttpRequest, response: HttpResponse) -> None:
        await response.send(200, b"")

    async def _tokenizer(self, request: HttpRequest, response: HttpResponse) -> None:
        await response.send(200, b'{"token_number":3}')

    async def _infer(self, request: HttpRequest, response: HttpResponse) -> None:
        self.seen.append(Seen(request.path, dict(request.headers), request.body))
        assert self.script is not None, "no script"
        answer = await race_disconnect(request, self.script(self, request))
        if answer is not None:
            status, body = answer
            await response.send(status, body, "application/json")


@dataclass
class Cluster:
    client: httpx.AsyncClient
    ps: list[FakeP]
    ds: list[FakeD]
    cfg: CoordinatorConfig
    extra: list[FakeServer] = field(default_factory=list)

    def d_for(self, request: HttpRequest) -> FakeD:
        target = request.headers["d-target"]
        return next(d for d in self.ds if d.target == target)

    def script(self, fn: Script) -> None:
        for p in self.ps:
            p.script = fn

    @property
    def seen(self) -> list[Seen]:
        return [s for p in self.ps for s in p.seen]


BASE_CFG: dict[str, Any] = {
    "status_interval_s": 0.05, "status_timeout_s": 1.0, "relink_backoff_s": 0.02,
    "relink_backoff_max_s": 0.1, "retry_delay_s": 0.01, "drain_timeout_s": 1.0,
    "connect_timeout_s": 1.0}


@contextlib.asynccontextmanager
async def cluster(d_blocks: tuple[int, ...] = (100,), n_p: int = 1, *,
                  ghost_p: bool = False, ready: bool = True, **cfg: Any
                  ) -> AsyncIterator[Cluster]:
    """Fake Ps and Ds and a coordinator in front of them. ``ghost_p``: a first P whose
    status answers but whose business port refuses connections."""
    ps = [FakeP() for _ in range(n_p)]
    ds = [FakeD(b) for b in d_blocks]
    extra: list[FakeServer] = [FakeP()] if ghost_p else []
    for f in [*ps, *ds, *extra]:
        await f.start()
    prefill = [InstanceAddr("127.0.0.1", p.port) for p in ps]
    if ghost_p:
        prefill.insert(0, InstanceAddr("127.0.0.1", free_port(), extra[0].port))
    conf = CoordinatorConfig(prefill=tuple(prefill),
                             decode=tuple(InstanceAddr("127.0.0.1", d.port) for d in ds),
                             host="127.0.0.1", port=0, **{**BASE_CFG, **cfg})
    stop = asyncio.Event()
    started: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve_coordinator(conf, started=started, stop=stop))
    try:
        server = await asyncio.wait_for(asyncio.shield(started), 5.0)
        url = f"http://127.0.0.1:{server.ports[0]}"
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            cl = Cluster(client, ps, ds, conf, extra)
            if ready:
                await until(lambda: all(d.linked for d in ds))
                mport = conf.management_port
                async with httpx.AsyncClient(
                        base_url=url if mport is None else f"http://127.0.0.1:{mport}",
                        timeout=10.0) as probe:
                    await wait_ready(probe)
            yield cl
    finally:
        stop.set()
        await asyncio.wait_for(task, 5.0)
        for f in [*ps, *ds, *extra]:
            await f.close()


async def wait_ready(client: httpx.AsyncClient) -> None:
    async def loop() -> None:
        while (await client.get("/v1/readiness")).status_code != 200:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(loop(), 5.0)


# ---------------------------------------------------------------------- relay

P_OUT = 'data: {"token":{"id":[5],"text":"é"}}\n\n'
D_DATA = 'data: {"token":{"id":[6],"text":":中"}}\n\n'
D_LAST_STREAM = 'data: {"generated_text":"é:中🙂","token":{"id":[7]}}\n\n'
D_LAST_JSON = '{"generated_text":"é:中🙂"}'
CHAT = [{"role": "user", "content": "hi"}]
TRITON_IDS = {"name": "input0", "datatype": "UINT32", "shape": [1, 3], "data": [1, 2, 3]}

#: (path, body, the coordinator must stream it)
FAMILY_CASES = [
    ("/infer", {"inputs": "hi", "stream": True}, True),
    ("/infer", {"inputs": "hi"}, False),
    ("/infer_token", {"input_id": [1, 2, 3], "stream": True}, True),
    ("/infer_token", {"input_id": [1, 2, 3], "stream": False}, False),
    ("/generate", {"inputs": "hi"}, False),
    ("/generate", {"inputs": "hi", "stream": True}, False),  # TGI /generate never streams
    ("/generate_stream", {"inputs": "hi"}, True),
    ("/", {"inputs": "hi", "stream": True}, True),
    ("/", {"inputs": "hi"}, False),
    ("/generate", {"prompt": "hi", "stream": True}, True),  # vLLM
    ("/generate", {"prompt": "hi"}, False),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "stream": True}, True),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT}, False),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True}, True),
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}, False),
    ("/v2/models/m1/infer", {"inputs": [TRITON_IDS]}, False),
    ("/v2/models/m1/generate", {"text_input": "hi", "stream": True}, False),
    ("/v2/models/m1/generate_stream", {"text_input": "hi"}, True),
]


def relay_script(cl: Cluster, stream: bool) -> Script:
    """P answers after D has already written its first messages (§11: they wait for
    P's output); D's last message comes after P's answer."""

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid, d = request.headers["req-id"], cl.d_for(request)
        d.say(rid, ("ids", "2,5,6,5"), ("ids", "6"), ("data", D_DATA))
        last = D_LAST_STREAM if stream else D_LAST_JSON
        asyncio.get_running_loop().call_later(
            0.02, d.say, rid, ("ids", "7"), ("lastData", last))
        return 200, p_answer(rid, stream, output=P_OUT if stream else None)

    return script


@pytest.mark.parametrize(("path", "body", "stream"), FAMILY_CASES)
@bounded
async def test_each_family_is_relayed_byte_exact(path: str, body: dict[str, Any],
                                                 stream: bool) -> None:
    async with cluster() as cl:
        cl.script(relay_script(cl, stream))
        raw = orjson.dumps(body)
        r = await cl.client.post(path, content=raw, headers={
            "content-type": "application/json", "x-trace": "t1", "req-id": "999",
            "is-recompute": "true"})
        assert r.status_code == 200
        if stream:
            assert r.headers["content-type"] == "text/event-stream"
            d_part = D_DATA + D_LAST_STREAM
            if path == "/generate" and "prompt" in body:  # vLLM: D's newlines are its NULs
                d_part = vllm_body(d_part)
            assert r.content == (P_OUT + d_part).encode()
        else:
            assert r.headers["content-type"] == "application/json"
            assert r.content == D_LAST_JSON.encode()
        [seen] = cl.seen
        d = cl.ds[0]
        assert seen.path == path and seen.body == raw
        assert seen.headers["req-type"] == "prefill"
        assert seen.req_id.isdigit() and int(seen.req_id) < 2**64 and seen.req_id != "999"
        assert seen.headers["d-target"] == d.target
        assert seen.headers["d-port"] == str(d.port)
        assert "is-recompute" not in seen.headers
        assert seen.headers["x-trace"] == "t1"
        assert seen.headers["content-type"] == "application/json"


@pytest.mark.parametrize("stream", [True, False])
@bounded
async def test_request_finished_on_p_is_answered_from_p(stream: bool) -> None:
    out = P_OUT + D_LAST_STREAM if stream else D_LAST_JSON

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        return 200, p_answer(request.headers["req-id"], stream, last=True, output=out)

    async with cluster() as cl:
        cl.script(script)
        r = await cl.client.post("/infer", json={"inputs": "hi", "stream": stream})
        assert r.status_code == 200 and r.content == out.encode()
        assert r.headers["content-type"] == ("text/event-stream" if stream
                                             else "application/json")


@bounded
async def test_p_error_is_forwarded_unchanged() -> None:
    body = b'{"error":"max_new_tokens must be > 0","error_type":"Input Validation Error"}'

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        return 422, body

    async with cluster() as cl:
        cl.script(script)
        r = await cl.client.post("/generate_stream", json={"inputs": "hi"})
        assert (r.status_code, r.content) == (422, body)
        assert r.headers["content-type"] == "application/json"


@bounded
async def test_p_answer_with_wrong_req_id_is_a_p_error() -> None:
    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        return 200, p_answer("123", True, output=P_OUT)

    async with cluster() as cl:
        cl.script(script)
        r = await cl.client.post("/infer", json={"inputs": "hi", "stream": True})
        assert_error(r, 500, "P instance error")


@bounded
async def test_p_lost_before_answering_is_retried_on_another_p_under_a_new_id() -> None:
    """A P that drops the connection before answering (killed): the same body goes to
    the other P under a fresh req-id; what the lost P may have handed to its D is
    stopped under the old id, and a late D message for the old id reaches nobody."""
    ps_seen: list[tuple[int, str]] = []

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid, d = request.headers["req-id"], cl.d_for(request)
        ps_seen.append((cl.ps.index(p), rid))
        if len(ps_seen) == 1:
            d.say(rid, ("ids", "1,5"), ("data", D_DATA))  # handed off, then P dies
            assert p.server is not None
            p.server.force_close()
            await asyncio.sleep(TEST_TIMEOUT_S)
        d.say(ps_seen[0][1], ("ids", "1,5"), ("lastData", "stale"))
        d.say(rid, ("ids", "1,5"), ("lastData", D_LAST_JSON))
        return 200, p_answer(rid, False)

    async with cluster(n_p=2) as cl:
        cl.script(script)
        r = await cl.client.post("/infer", json={"inputs": "hi"})
        assert r.status_code == 200 and r.text == D_LAST_JSON
        (first, old), (second, new) = ps_seen
        assert first != second and old != new
        await until(lambda: any(b == {"id": old} for _, b in cl.ds[0].stops))
        assert [s.body for s in cl.seen] == [b'{"inputs":"hi"}'] * 2


@bounded
async def test_a_connection_that_breaks_while_set_up_goes_to_another_p(monkeypatch) -> None:
    """httpcore on anyio can fail with AttributeError (the peer name of a socket the P
    closed, read while connecting to a P killed at that moment; seen in the PD fault test):
    the coordinator's transport (coordinator/upstream.py) makes it a failed connect, so the
    request goes to the other P instead of ending in a 500."""
    broken: list[str] = []
    p_ports: set[int] = set()  # filled once the cluster is up
    real = httpx.AsyncHTTPTransport.handle_async_request

    async def handle(self: httpx.AsyncHTTPTransport, request: httpx.Request) -> httpx.Response:
        if not broken and request.method == "POST" and request.url.port in p_ports:
            broken.append(str(request.url))
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        return await real(self, request)

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid = request.headers["req-id"]
        cl.d_for(request).say(rid, ("ids", "1,5"), ("lastData", D_LAST_JSON))
        return 200, p_answer(rid, False)

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", handle)
    async with cluster(n_p=2) as cl:
        cl.script(script)
        p_ports.update(p.port for p in cl.ps)
        r = await cl.client.post("/infer", json={"inputs": "hi"})
        assert r.status_code == 200 and r.text == D_LAST_JSON
        served = [p for p in cl.ps if p.seen]
        assert len(broken) == 1 and len(served) == 1 and len(served[0].seen) == 1
        assert f":{served[0].port}/" not in broken[0]


@bounded
async def test_p_lost_every_time_ends_with_503_after_max_retry() -> None:
    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        assert p.server is not None
        p.server.force_close()
        await asyncio.sleep(TEST_TIMEOUT_S)
        raise AssertionError("not reached")

    async with cluster(max_retry=2) as cl:
        cl.script(script)
        r = await cl.client.post("/infer", json={"inputs": "hi"})
        assert_error(r, 503, "MindIE-MS Coordinator is not ready")
        assert len(cl.seen) == 3
        assert len({s.req_id for s in cl.seen}) == 3


@bounded
async def test_p_lost_and_no_other_p_is_503_within_the_schedule_timeout() -> None:
    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        assert p.server is not None
        await p.close()  # P dies with the request: no P is left to take it
        await asyncio.sleep(TEST_TIMEOUT_S)
        raise AssertionError("not reached")

    async with cluster(schedule_timeout_s=0.5) as cl:
        cl.script(script)
        r = await cl.client.post("/infer", json={"inputs": "hi"})
        assert_error(r, 503, "MindIE-MS Coordinator is not ready")


@bounded
async def test_interleaved_messages_reach_their_own_requests() -> None:
    arrived: list[HttpRequest] = []
    both = asyncio.Event()

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        arrived.append(request)
        if len(arrived) == 2:
            both.set()
        await both.wait()
        rid, d = request.headers["req-id"], cl.d_for(request)
        if request is arrived[1]:  # one chunk, both requests' messages interleaved
            by_prompt = {orjson.loads(r.body)["inputs"]: r.headers["req-id"] for r in arrived}
            a, b = by_prompt["a"], by_prompt["b"]
            d.emit(encode(a, "ids", "1,5"), encode(b, "ids", "1,6"),
                   encode(b, "data", "data: b1\n\n"), encode(a, "data", "data: a1\n\n"),
                   encode(a, "lastData", "data: a2\n\n"), encode(b, "lastData", "data: b2\n\n"))
        prompt = orjson.loads(request.body)["inputs"]
        return 200, p_answer(rid, True, output=f"data: {prompt}0\n\n")

    async with cluster() as cl:
        cl.script(script)
        ra, rb = await asyncio.gather(
            cl.client.post("/infer", content=b'{"inputs":"a","stream":true}'),
            cl.client.post("/infer", content=b'{"inputs":"b","stream":true}'))
        assert ra.text == "data: a0\n\ndata: a1\n\ndata: a2\n\n"
        assert rb.text == "data: b0\n\ndata: b1\n\ndata: b2\n\n"


# ---------------------------------------------------------------------- D errors

@pytest.mark.parametrize("stream", [True, False])
@bounded
async def test_d_error(stream: bool) -> None:
    text = "Pull kv failed irreversibly."

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid, d = request.headers["req-id"], cl.d_for(request)
        d.say(rid, ("ids", "1,5,6"), ("error", text))
        return 200, p_answer(rid, stream, output=P_OUT if stream else None)

    async with cluster() as cl:
        cl.script(script)
        r = await cl.client.post("/infer", json={"inputs": "hi", "stream": stream})
        if stream:
            assert r.status_code == 200 and r.text == P_OUT + mindie_stream_error(text)
        else:
            assert r.status_code == 500
            assert r.json() == {"error": text, "error_type": "Incomplete Generation"}


# ---------------------------------------------------------------------- recompute

@bounded
async def test_retry_resubmits_the_body_with_is_recompute() -> None:
    retry_body = orjson.dumps({"inputs": "3,1,2,3,10,11", "stream": True}).decode()
    chunks = ['data: {"t":"A"}\n\n', 'data: {"t":"B"}\n\n', 'data: {"t":"C"}\n\n',
              'data: {"t":"D"}\n\n', 'data: {"t":"E"}\n\n']

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid, d = request.headers["req-id"], cl.d_for(request)
        if "is-recompute" not in request.headers:
            d.say(rid, ("ids", "3,1,2,3,10"))
            d.say(rid, ("ids", "11"), ("data", chunks[1]))
            d.say(rid, ("retry", retry_body))
            return 200, p_answer(rid, True, output=chunks[0])
        d.say(rid, ("ids", "3,1,2,3,10,11,12"))
        d.say(rid, ("ids", "13"), ("data", chunks[3]))
        d.say(rid, ("ids", "14"), ("lastData", chunks[4]))
        return 200, p_answer(rid, True, output=chunks[2])

    async with cluster() as cl:
        cl.script(script)
        r = await cl.client.post("/infer_token", json={"input_id": [1, 2, 3], "stream": True})
        assert r.status_code == 200 and r.text == "".join(chunks)
        first, again = cl.seen
        assert again.headers["is-recompute"] == "true"
        assert again.req_id == first.req_id
        assert again.body == retry_body.encode()


@bounded
async def test_retry_limit_ends_the_stream_with_retry_failed() -> None:
    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid, d = request.headers["req-id"], cl.d_for(request)
        d.say(rid, ("ids", "1,5"), ("retry", '{"inputs":"1,5","stream":true}'))
        return 200, p_answer(rid, True, output=P_OUT)

    async with cluster(max_retry=2) as cl:
        cl.script(script)
        r = await cl.client.post("/infer", json={"inputs": "hi", "stream": True})
        assert r.text == P_OUT * 3 + mindie_stream_error("Request retry failed")
        assert len(cl.seen) == 3


@bounded
async def test_p_error_while_retrying_is_sent_again_to_the_same_p() -> None:
    calls: list[str] = []

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid, d = request.headers["req-id"], cl.d_for(request)
        calls.append(request.headers.get("is-recompute", "-"))
        if len(calls) == 1:
            d.say(rid, ("ids", "1,5"), ("retry", '{"inputs":"1,5"}'))
            return 200, p_answer(rid, False)
        if len(calls) == 2:  # the old request is still known to P
            return 500, b'{"error":"busy","error_type":"Incomplete Generation"}'
        d.say(rid, ("ids", "1,5"), ("lastData", D_LAST_JSON))
        return 200, p_answer(rid, False)

    async with cluster() as cl:
        cl.script(script)
        r = await cl.client.post("/infer", json={"inputs": "hi"})
        assert r.status_code == 200 and r.text == D_LAST_JSON
        assert calls == ["-", "true", "true"]
        assert len({s.req_id for s in cl.seen}) == 1
        assert cl.seen[2].body == b'{"inputs":"1,5"}'


@bounded
async def test_p_refusing_the_recompute_body_ends_the_request_at_once() -> None:
    calls: list[str] = []

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid, d = request.headers["req-id"], cl.d_for(request)
        calls.append(request.headers.get("is-recompute", "-"))
        if len(calls) == 1:
            d.say(rid, ("ids", "1,5"), ("retry", '{"inputs":"1,5","stream":true}'))
            return 200, p_answer(rid, True, output=P_OUT)
        return 422, b'{"error":"bad recompute body","error_type":"validation"}'

    async with cluster() as cl:
        cl.script(script)
        r = await cl.client.post("/infer", json={"inputs": "hi", "stream": True})
        # a 4xx P gives the resubmitted body is final: no retry with back-off
        assert calls == ["-", "true"]
        assert r.text == P_OUT + mindie_stream_error("bad recompute body")


@bounded
async def test_lost_d_is_recomputed_on_the_other_d_from_the_ids_history() -> None:
    recompute = recompute_module()
    body = {"inputs": "abc", "stream": True, "parameters": {"max_new_tokens": 8}}
    a, b, c, d_ = ('data: {"t":"A"}\n\n', 'data: {"t":"B"}\n\n', 'data: {"t":"C"}\n\n',
                   'data: {"t":"D"}\n\n')

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid, d = request.headers["req-id"], cl.d_for(request)
        if d is cl.ds[0]:
            d.say(rid, ("ids", "3,1,2,3,10"))
            d.say(rid, ("ids", "11"), ("data", b))
            d.kill()
            return 200, p_answer(rid, True, output=a)
        d.say(rid, ("ids", "3,1,2,3,10,11,12"))
        d.say(rid, ("ids", "13"), ("lastData", d_))
        return 200, p_answer(rid, True, output=c)

    async with cluster(d_blocks=(100, 50)) as cl:
        cl.script(script)
        r = await cl.client.post("/infer", json=body)
        assert r.status_code == 200 and r.text == a + b + c + d_  # nothing lost or repeated
        first, again = cl.seen
        assert first.headers["d-target"] == cl.ds[0].target
        assert again.headers["d-target"] == cl.ds[1].target
        assert again.headers["is-recompute"] == "true" and again.req_id == first.req_id
        assert orjson.loads(again.body) == recompute.build_recompute_body(
            "/infer", body, [1, 2, 3, 10, 11], 3)
        await until(lambda: cl.ds[0].stops)  # best effort: the old D may still run it
        assert cl.ds[0].stops == [(f"/v2/models/{MODEL}/stopInfer", {"id": first.req_id})]


@bounded
async def test_lost_d_before_any_output_resubmits_the_original_body() -> None:
    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid, d = request.headers["req-id"], cl.d_for(request)
        if d is cl.ds[0]:
            d.kill()  # D died before it took the request: no ids
            return 200, p_answer(rid, False)
        d.say(rid, ("ids", "1,5"), ("lastData", D_LAST_JSON))
        return 200, p_answer(rid, False)

    async with cluster(d_blocks=(100, 50)) as cl:
        cl.script(script)
        raw = b'{"inputs":"hi"}'
        r = await cl.client.post("/infer", content=raw)
        assert r.status_code == 200 and r.text == D_LAST_JSON
        first, again = cl.seen
        assert first.headers["d-target"] == cl.ds[0].target
        assert again.headers["d-target"] == cl.ds[1].target
        assert again.body == raw and "is-recompute" not in again.headers


def recompute_module() -> types.ModuleType:
    """The lead's ``tokenserve.pd.recompute``, or a stand-in with the plan's signature
    while it does not exist yet."""
    try:
        import tokenserve.pd.recompute as mod
    except ImportError:
        mod = types.ModuleType("tokenserve.pd.recompute")

        def build_recompute_body(path: str, body: dict[str, Any], history: list[int],
                                 num_prompt: int) -> dict[str, Any]:
            csv = ",".join(map(str, [num_prompt, *history]))
            return {**body, "inputs": csv, "origin_inputs": body.get("inputs")}

        mod.build_recompute_body = build_recompute_body  # type: ignore[attr-defined]
        sys.modules[mod.__name__] = mod
    return mod


# ---------------------------------------------------------------------- client side

@bounded
async def test_client_disconnect_stops_the_request_on_p_and_d() -> None:
    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid, d = request.headers["req-id"], cl.d_for(request)
        d.say(rid, ("ids", "1,5"))
        return 200, p_answer(rid, True, output=P_OUT)

    async with cluster() as cl:
        cl.script(script)
        async with cl.client.stream("POST", "/infer",
                                    json={"inputs": "hi", "stream": True}) as r:
            async for chunk in r.aiter_raw():
                assert chunk == P_OUT.encode()
                break
        [seen] = cl.seen
        stop = (f"/v2/models/{MODEL}/stopInfer", {"id": seen.req_id})
        await until(lambda: cl.ps[0].stops and cl.ds[0].stops)
        assert cl.ps[0].stops == [stop] and cl.ds[0].stops == [stop]


@pytest.mark.parametrize("by", ["client id", "req-id", "answer id"])
@bounded
async def test_stop_infer_reaches_the_instances_that_hold_the_request(by: str) -> None:
    """interfaces §2.3 on the coordinator: the client's stopInfer goes to the request's P
    and D (by the client's Triton ``id``, the coordinator's req-id or the id the answer
    carries); 200 when one of them answers 200."""
    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid, d = request.headers["req-id"], cl.d_for(request)
        d.say(rid, ("ids", "1,5"))
        return 200, p_answer(rid, True, output=P_OUT)

    async with cluster() as cl:
        cl.script(script)
        path = f"/v2/models/{MODEL}/generate_stream"
        async with cl.client.stream("POST", path, json={"id": "c-1", "text_input": "hi"}) as r:
            async for chunk in r.aiter_raw():
                assert chunk == P_OUT.encode()
                break
            [seen] = cl.seen
            body = {"id": {"client id": "c-1", "req-id": seen.req_id,
                           "answer id": derived_id(seen.req_id, 1)}[by]}
            stop = await cl.client.post(f"/v2/models/{MODEL}/stopInfer", json=body)
            assert stop.status_code == 200
            want = (f"/v2/models/{MODEL}/stopInfer", body)
            assert cl.ps[0].stops == [want] and cl.ds[0].stops == [want]


@bounded
async def test_stop_infer_of_an_unknown_id_is_a_p_answer() -> None:
    async with cluster() as cl:
        r = await cl.client.post(f"/v2/models/{MODEL}/stopInfer", json={"id": "nope"})
        assert r.status_code == 200  # the fake P echoes; a real one says 404
        assert cl.ps[0].stops == [(f"/v2/models/{MODEL}/stopInfer", {"id": "nope"})]
        assert cl.ds[0].stops == []


@pytest.mark.parametrize(("path", "raw"), [
    ("/infer", b"{not json"),
    ("/infer", b"[1, 2]"),
    ("/infer", b'{"inputs": "a", "input_id": [1]}'),
    ("/infer", b'{"stream": true}'),
    ("/generate", b'{"parameters": {}}'),
    ("/generate_stream", b'{"inputs": [{"type": "image_url"}]}'),
    ("/v1/chat/completions", b'{"model": "m1"}'),
    ("/v2/models/m1/generate", b'{"text_input": 5}'),
    ("/v2/models/m1/infer", b'{"inputs": [{"datatype": "FP32", "data": [1]}]}'),
])
@bounded
async def test_malformed_requests_are_forwarded_to_p_and_its_answer_relayed(
        path: str, raw: bytes) -> None:
    """PD spec §3.2 rule [I] (b): the coordinator does not validate; P's error (here a
    scripted 422 in a made-up shape, so nothing of the coordinator's can match it)
    reaches the client byte for byte, status and content type included."""
    answer = b'{"detail":"p says no"}'

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        return 422, answer

    async with cluster() as cl:
        cl.script(script)
        r = await cl.client.post(path, content=raw)
        assert (r.status_code, r.content) == (422, answer)
        assert r.headers["content-type"] == "application/json"
        [seen] = cl.seen
        assert seen.body == raw and seen.path == path


@bounded
async def test_too_many_requests() -> None:
    release = asyncio.Event()

    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        await release.wait()
        return 200, p_answer(request.headers["req-id"], False, last=True, output="{}")

    async with cluster(max_requests=1) as cl:
        cl.script(script)
        first = asyncio.ensure_future(cl.client.post("/infer", json={"inputs": "a"}))
        await until(lambda: cl.seen)
        r = await cl.client.post("/infer", json={"inputs": "b"})
        assert_error(r, 429, "Too many requests")
        release.set()
        assert (await first).status_code == 200


@bounded
async def test_not_ready_without_a_usable_d() -> None:
    async with cluster(ready=False) as cl:
        cl.ds[0].kill()
        await until(lambda: not cl.ds[0].linked)
        await asyncio.sleep(0.1)  # a status poll sees the D down
        r = await cl.client.post("/infer", json={"inputs": "a"})
        assert_error(r, 503, "MindIE-MS Coordinator is not ready")
        assert (await cl.client.get("/v2/health/ready")).status_code == 503
        assert (await cl.client.get("/health")).status_code == 503


@bounded
async def test_a_blank_last_message_ends_the_stream_with_nothing_more() -> None:
    """D's lastData " " (nothing left to send: an empty field would be ignored, §6.3)
    must not reach the client (it broke vLLM's NUL framing after a stop string)."""
    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        rid, d = request.headers["req-id"], cl.d_for(request)
        d.say(rid, ("ids", "1,5"), ("ids", "6"), ("data", '{"text":["b"]}\n'),
              ("lastData", " "))
        return 200, p_answer(rid, True, output='{"text":["a"]}\0')

    async with cluster() as cl:
        cl.script(script)
        r = await cl.client.post("/generate", json={"prompt": "hi", "stream": True})
        assert r.status_code == 200
        assert r.content == b'{"text":["a"]}\0{"text":["b"]}\0'


@bounded
async def test_coordinator_errors_take_the_family_shape() -> None:
    """PD spec §3.2 rule [I] (a): OpenAI routes get the OpenAI error object, the other
    families MindIE's wrapper, each with MindIE-MS's message."""
    async with cluster(ready=False) as cl:
        cl.ds[0].kill()
        await until(lambda: not cl.ds[0].linked)
        await asyncio.sleep(0.1)
        r = await cl.client.post("/v1/chat/completions",
                                 json={"model": MODEL, "messages": [{"role": "user",
                                                                     "content": "a"}]})
        assert r.status_code == 503 and r.headers["content-type"] == "application/json"
        assert r.json() == {"error": {"message": "MindIE-MS Coordinator is not ready",
                                      "type": "Service Unavailable", "param": None,
                                      "code": 503},
                            "error_type": "Service Unavailable"}
        for path, body in (("/generate", {"inputs": "a"}), ("/generate", {"prompt": "a"}),
                           ("/v2/models/m1/generate", {"text_input": "a"})):
            assert_error(await cl.client.post(path, json=body), 503,
                         "MindIE-MS Coordinator is not ready")


@pytest.mark.parametrize(("path", "body", "event"), [
    ("/v1/chat/completions",
     {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "a"}]},
     'data: {"error":{"message":"Request inference timeout","type":"Incomplete Generation",'
     '"param":null,"code":500},"error_type":"Incomplete Generation"}\n\n'),
    ("/generate", {"prompt": "a", "stream": True},
     '{"error":"Request inference timeout","error_type":"Incomplete Generation"}\0'),
    ("/generate_stream", {"inputs": "a"},
     'data: {"error":"Request inference timeout","error_type":"Incomplete Generation"}\n\n'),
    ("/v2/models/m1/generate_stream", {"text_input": "a"},
     'data:{"error":"Request inference timeout","error_type":"Incomplete Generation"}\n\n'),
])
@bounded
async def test_a_started_stream_fails_with_the_family_error_event(
        path: str, body: dict[str, Any], event: str) -> None:
    """An error after the head is the family's own last event, never bare text."""
    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        return 200, p_answer(request.headers["req-id"], True, output=P_OUT)

    async with cluster(infer_timeout_s=0.3) as cl:
        cl.script(script)
        r = await cl.client.post(path, json=body)
        assert r.status_code == 200 and r.text == P_OUT + event


@bounded
async def test_unreachable_p_is_skipped_for_another() -> None:
    async with cluster(ghost_p=True) as cl:
        cl.script(relay_script(cl, False))
        r = await cl.client.post("/infer", json={"inputs": "hi"})
        assert r.status_code == 200 and r.text == D_LAST_JSON
        assert len(cl.ps[0].seen) == 1


@bounded
async def test_no_reachable_p_is_connect_failed() -> None:
    async with cluster(ghost_p=True) as cl:
        await cl.ps[0].close()  # the only real P goes away too
        r = await cl.client.post("/infer", json={"inputs": "hi"})
        assert_error(r, 500, "Connect to p instance failed")


@bounded
async def test_first_token_timeout() -> None:
    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        await asyncio.sleep(TEST_TIMEOUT_S)
        raise AssertionError("not reached")

    async with cluster(first_token_timeout_s=0.2) as cl:
        cl.script(script)
        r = await cl.client.post("/infer", json={"inputs": "hi"})
        assert_error(r, 408, "Request first token timeout")
        await until(lambda: cl.ps[0].stops)


@bounded
async def test_inference_timeout_ends_a_started_stream() -> None:
    async def script(p: FakeP, request: HttpRequest) -> tuple[int, bytes]:
        return 200, p_answer(request.headers["req-id"], True, output=P_OUT)

    async with cluster(infer_timeout_s=0.3) as cl:
        cl.script(script)
        r = await cl.client.post("/infer", json={"inputs": "hi", "stream": True})
        assert r.status_code == 200
        assert r.text == P_OUT + mindie_stream_error("Request inference timeout")


# ---------------------------------------------------------------------- other routes

@bounded
async def test_forwarded_routes_and_probes() -> None:
    async with cluster() as cl:
        r = await cl.client.get("/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
        assert (await cl.client.get("/health")).status_code == 200
        r = await cl.client.post("/v1/tokenizer", json={"inputs": "abc"})
        assert r.json() == {"token_number": 3}
        for path in ("/v1/startup", "/v1/health", "/v1/readiness", "/v2/health/live",
                     "/v2/health/ready"):
            r = await cl.client.get(path)
            assert r.status_code == 200 and r.content == b"", path
            assert r.headers["content-type"] == "application/json"  # as a mixed server


@bounded
async def test_close_message_relinks_the_d() -> None:
    async with cluster() as cl:
        d = cl.ds[0]
        d.emit(close_message())
        await until(lambda: d.links == 2 and d.linked)
        cl.script(relay_script(cl, True))
        r = await cl.client.post("/infer", json={"inputs": "hi", "stream": True})
        assert r.text == P_OUT + D_DATA + D_LAST_STREAM


# ---------------------------------------------------------------------- config

def test_instance_addresses() -> None:
    assert InstanceAddr.parse("10.0.0.1:1025") == InstanceAddr("10.0.0.1", 1025)
    a = InstanceAddr.parse("10.0.0.1:1025@1026")
    assert a.base_url == "http://10.0.0.1:1025" and a.mgmt_url == "http://10.0.0.1:1026"
    v6 = InstanceAddr.parse("[::1]:5@6")
    assert v6.host == "::1" and v6.base_url == "http://[::1]:5"
    assert len(parse_instances("a:1,b:2@3,")) == 2
    for bad in ("host", ":1", "h:0", "h:x", "h:1@70000", ""):
        with pytest.raises(ValueError):
            parse_instances(bad)


def test_req_ids_are_unique_u64_decimals() -> None:
    gen = ReqIdGenerator()
    ids = [gen.next() for _ in range(10000)]
    assert len(set(ids)) == len(ids)
    assert all(i.isdigit() and int(i) < 2**64 for i in ids)


def test_cli_flags() -> None:
    args = build_parser().parse_args([
        "coordinator", "--prefill", "127.0.0.1:1025@1026,127.0.0.1:2025",
        "--decode", "127.0.0.1:3025", "--port", "0", "--infer-timeout", "30",
        "--max-requests", "7"])
    cfg = config_from_args(args)
    assert [a.name for a in cfg.prefill] == ["127.0.0.1:1025", "127.0.0.1:2025"]
    assert cfg.prefill[0].mgmt_port == 1026 and cfg.decode[0].port == 3025
    assert (cfg.port, cfg.infer_timeout_s, cfg.max_requests) == (0, 30.0, 7)
    assert replace(cfg, port=1).port == 1
    with pytest.raises(ValueError):
        CoordinatorConfig(prefill=cfg.prefill, decode=())


@bounded
async def test_port_in_use_is_a_value_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        cfg = CoordinatorConfig(prefill=parse_instances("127.0.0.1:1"),
                                decode=parse_instances("127.0.0.1:2"),
                                port=s.getsockname()[1])
        with pytest.raises(ValueError, match="cannot listen"):
            await serve_coordinator(cfg)


@bounded
async def test_d_request_no_flow_waits_for_is_stopped_once() -> None:
    """Messages for a req-id this coordinator does not know (an earlier coordinator's
    request still running on D): stopInfer on that D, once."""
    async with cluster() as cl:
        d = cl.ds[0]
        d.say("1234", ("ids", "1,5"), ("data", D_DATA))
        d.say("1234", ("ids", "6"), ("data", D_DATA))
        await until(lambda: d.stops)
        await asyncio.sleep(0.1)
        assert [b for _, b in d.stops] == [{"id": "1234"}]


@bounded
async def test_slots_are_the_decode_instances_sum_in_get_slot_count_and_info() -> None:
    """issue 40: ``getSlotCount`` ``total_slots`` and ``/info`` ``max_concurrent_requests``
    are one number on the coordinator, the cluster's slots: every usable D asked, fields
    summed (coordinator/capacity.py: a request holds a D slot for its whole decode, a P
    slot only until its hand-off); the Ps' slots are not in it. A D's 404 for an unknown
    model is relayed."""
    async with cluster((100, 100), n_p=2) as cl:
        for p in cl.ps:
            p.slots = (64, 60, 9600)  # P's own: in neither answer
        cl.ds[0].slots = (20, 15, 3200)
        r = await cl.client.get(f"/v2/models/{MODEL}/getSlotCount")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json() == {"total_slots": 20 + 10, "free_slots": 15 + 7,
                            "available_tokens_length": 3200 + 1600}
        info = await cl.client.get("/info")
        assert info.status_code == 200 and info.headers["content-type"] == "application/json"
        assert info.json() == {"max_concurrent_requests": 20 + 10,
                               "max_batch_total_tokens": 2048,
                               "models": [{"model_id": MODEL}]}  # the rest: P's answer
        assert info.json()["max_concurrent_requests"] == r.json()["total_slots"]
        cl.ds[1].kill()  # unusable once noticed: out of both numbers alike
        while (await cl.client.get(f"/v2/models/{MODEL}/getSlotCount")).json()[
                "total_slots"] != 20:
            await asyncio.sleep(0.01)
        assert (await cl.client.get("/info")).json()["max_concurrent_requests"] == 20
        r = await cl.client.get("/v2/models/other/getSlotCount")
        assert r.status_code == 404 and r.json() == {"error": "no such model"}


@bounded
async def test_a_binary_whole_answer_from_d_or_p_keeps_its_bytes_and_headers() -> None:
    """D's ``lastBytes`` / P's ``outputBytes`` (Triton's binary tensors): the client gets
    the bytes, content type and headers the instance's handler sent."""
    raw = b'{"id":"x"}' + bytes(range(256))
    whole = WholeAnswer("application/octet-stream",
                        {"Inference-Header-Content-Length": "10"}, raw).encode()
    body = {"inputs": [TRITON_IDS]}
    for on_p in (False, True):
        async def script(p: FakeP, request: HttpRequest, on_p: bool = on_p
                         ) -> tuple[int, bytes]:
            rid = request.headers["req-id"]
            if on_p:
                obj = orjson.loads(p_answer(rid, False, last=True, output=""))
                return 200, orjson.dumps({**obj, "outputBytes": whole})
            cl.d_for(request).say(rid, ("ids", "3,1,2,3,9"), ("lastBytes", whole))
            return 200, p_answer(rid, False)

        async with cluster() as cl:
            cl.script(script)
            r = await cl.client.post(f"/v2/models/{MODEL}/infer", json=body)
            assert r.status_code == 200 and r.content == raw, on_p
            assert r.headers["content-type"] == "application/octet-stream"
            assert r.headers["inference-header-content-length"] == "10"
