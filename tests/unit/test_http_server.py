"""HttpProtocol fed with raw bytes through a fake transport (no sockets).

Covers keep-alive reuse, pipelining, flow control, disconnect, limits (413/431), bad
request lines (400), handler errors (500 wrapper) and the router's 404/405.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import h11
import orjson
import pytest

from tokenserve.transport.errors import HttpError, body_too_large_message
from tokenserve.transport.router import Router, compile_pattern
from tokenserve.transport.server import (
    ClientDisconnected,
    HttpLimits,
    HttpProtocol,
    HttpRequest,
    HttpResponse,
)


class FakeTransport(asyncio.Transport):
    """Collects writes; records pause/resume/close like a socket transport would."""

    def __init__(self) -> None:
        super().__init__()
        self.protocol: HttpProtocol | None = None
        self.buffer = bytearray()
        self.closed = False
        self.read_paused = False
        self.eof_written = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        assert not self.eof_written, "write after write_eof"
        self.buffer += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            assert self.protocol is not None
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def pause_reading(self) -> None:
        self.read_paused = True

    def resume_reading(self) -> None:
        self.read_paused = False

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True


def connect(handler: Any, **limits: Any) -> tuple[HttpProtocol, FakeTransport]:
    proto = HttpProtocol(handler, HttpLimits(**limits))
    transport = FakeTransport()
    transport.protocol = proto
    proto.connection_made(transport)
    return proto, transport


async def wait_for(cond: Any, timeout: float = 2.0) -> None:
    async def loop() -> None:
        while not cond():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(loop(), timeout)


def parse_responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Parse every complete response in ``data`` with an h11 client."""
    client = h11.Connection(h11.CLIENT)
    out: list[tuple[int, dict[str, str], bytes]] = []
    client.receive_data(bytes(data))
    while True:
        if client.our_state is h11.IDLE:
            client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
            client.send(h11.EndOfMessage())
        status, headers, body = 0, {}, b""
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return out
            if isinstance(event, h11.InformationalResponse):
                out.append((event.status_code, {}, b""))
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                out.append((status, headers, body))
                break
        if client.our_state is not h11.DONE or client.their_state is not h11.DONE:
            return out
        client.start_next_cycle()


def get(path: str = "/", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


def post(path: str, body: bytes, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


async def echo(request: HttpRequest, response: HttpResponse) -> None:
    await response.send_json(
        200,
        {
            "method": request.method,
            "path": request.path,
            "query": request.query,
            "body": request.body.decode(),
            "ua": request.headers.get("user-agent"),
        },
    )


async def test_simple_request_and_request_uuid() -> None:
    proto, tr = connect(echo)
    proto.data_received(get("/a%20b?x=1", "User-Agent: t\r\n"))
    await wait_for(lambda: parse_responses(tr.buffer))
    [(status, headers, body)] = parse_responses(tr.buffer)
    assert status == 200
    assert orjson.loads(body) == {
        "method": "GET",
        "path": "/a b",
        "query": "x=1",
        "body": "",
        "ua": "t",
    }
    assert headers["content-type"] == "application/json"
    uuid.UUID(headers["requestuuid"])  # every response carries RequestUUID (spec §0.2)
    assert b"RequestUUID:" in tr.buffer  # original casing on the wire
    assert not tr.closed


async def test_keep_alive_reuse() -> None:
    proto, tr = connect(echo)
    proto.data_received(post("/one", b"1"))
    await wait_for(lambda: len(parse_responses(tr.buffer)) == 1)
    assert not tr.closed and not tr.read_paused
    proto.data_received(post("/two", b"22"))
    await wait_for(lambda: len(parse_responses(tr.buffer)) == 2)
    bodies = [orjson.loads(b) for _, _, b in parse_responses(tr.buffer)]
    assert [(b["path"], b["body"]) for b in bodies] == [("/one", "1"), ("/two", "22")]
    ids = {h["requestuuid"] for _, h, _ in parse_responses(tr.buffer)}
    assert len(ids) == 2
    assert not tr.closed


async def test_pipelining_in_order_and_reading_paused() -> None:
    gate = asyncio.Event()
    seen: list[str] = []

    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        seen.append(request.path)
        if request.path == "/slow":
            await gate.wait()
        await response.send(200, request.path.encode(), "text/plain")

    proto, tr = connect(handler)
    proto.data_received(get("/slow") + get("/fast"))
    await wait_for(lambda: seen == ["/slow"])
    await asyncio.sleep(0.01)
    assert seen == ["/slow"]  # the second request waits for the first response
    assert tr.read_paused  # pipelined bytes are buffered: stop reading more
    gate.set()
    await wait_for(lambda: len(parse_responses(tr.buffer)) == 2)
    assert [b for _, _, b in parse_responses(tr.buffer)] == [b"/slow", b"/fast"]
    assert seen == ["/slow", "/fast"]
    assert not tr.read_paused and not tr.closed


async def test_pipelined_bytes_arriving_during_handler() -> None:
    gate = asyncio.Event()

    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        if request.path == "/slow":
            await gate.wait()
        await response.send(200, request.path.encode(), "text/plain")

    proto, tr = connect(handler)
    proto.data_received(get("/slow"))
    await asyncio.sleep(0.005)
    assert not tr.read_paused  # still reading: a FIN would be seen at once
    proto.data_received(get("/next"))
    assert tr.read_paused
    gate.set()
    await wait_for(lambda: len(parse_responses(tr.buffer)) == 2)
    assert [b for _, _, b in parse_responses(tr.buffer)] == [b"/slow", b"/next"]


async def test_early_disconnect_sets_event_and_write_raises() -> None:
    started = asyncio.Event()
    result: dict[str, Any] = {}

    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        await response.start_stream()
        await response.write(b"data: 1\n\n")
        started.set()
        await asyncio.wait_for(request.disconnected.wait(), 2)
        result["saw_disconnect"] = True
        try:
            await response.write(b"data: 2\n\n")
        except ClientDisconnected:
            result["raised"] = True
            raise

    proto, tr = connect(handler)
    proto.data_received(get("/stream"))
    await started.wait()
    task = proto.task
    assert task is not None
    proto.connection_lost(None)
    await asyncio.wait_for(task, 2)
    assert result == {"saw_disconnect": True, "raised": True}
    assert task.exception() is None  # swallowed by the server


async def test_disconnect_wakes_a_writer_blocked_on_drain() -> None:
    step = asyncio.Event()
    wrote = asyncio.Event()

    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        await response.start_stream()
        await step.wait()
        await response.write(b"x")  # transport paused: waits in drain()
        wrote.set()

    proto, tr = connect(handler)
    proto.pause_writing()
    assert tr.read_paused  # client not reading: stop reading from it too
    proto.data_received(get("/"))
    await asyncio.sleep(0.01)
    assert tr.buffer == b""  # start_stream itself waits for drain
    proto.resume_writing()
    await wait_for(lambda: b"200 OK" in tr.buffer)
    proto.pause_writing()
    step.set()
    await asyncio.sleep(0.01)
    assert not wrote.is_set() and b"\r\nx\r\n" not in tr.buffer
    task = proto.task
    assert task is not None and not task.done()
    proto.connection_lost(None)
    await asyncio.wait_for(task, 2)
    assert not wrote.is_set()


async def test_write_resumes_after_drain() -> None:
    step = asyncio.Event()

    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        await response.start_stream(200, "text/event-stream")
        await response.write(b"data: 0\n\n")
        await step.wait()
        for i in (1, 2):
            await response.write(f"data: {i}\n\n".encode())
        await response.end()

    proto, tr = connect(handler)
    proto.data_received(get("/"))
    await wait_for(lambda: b"data: 0" in tr.buffer)
    proto.pause_writing()
    step.set()
    await asyncio.sleep(0.01)
    assert b"data: 1" not in tr.buffer
    proto.resume_writing()
    await wait_for(lambda: len(parse_responses(tr.buffer)) == 1)
    [(status, headers, body)] = parse_responses(tr.buffer)
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    assert headers["content-type"] == "text/event-stream"
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    # one write -> one chunk
    assert b"9\r\ndata: 1\n\n\r\n" in tr.buffer
    assert not tr.read_paused


async def test_bad_request_line_400_and_close() -> None:
    called = []

    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        called.append(1)

    proto, tr = connect(handler)
    proto.data_received(b"THIS IS NOT HTTP\r\n\r\n")
    [(status, headers, body)] = parse_responses(tr.buffer)
    assert status == 400
    obj = orjson.loads(body)
    assert obj["error_type"] == "Bad Request" and obj["error"]
    assert headers["connection"] == "close"
    assert tr.eof_written or tr.closed
    proto.data_received(get("/"))  # discarded
    await asyncio.sleep(0.01)
    assert called == []


async def test_413_from_content_length_without_reading_body() -> None:
    called = []

    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        called.append(1)

    proto, tr = connect(handler, max_body_bytes=2 * 2**20)
    head = f"POST /infer HTTP/1.1\r\nHost: x\r\nContent-Length: {2 * 2**20 + 1}\r\n\r\n"
    proto.data_received(head.encode())  # no body byte sent yet
    [(status, headers, body)] = parse_responses(tr.buffer)
    assert status == 413
    assert orjson.loads(body) == {"message": "Request body too large. Maximum allowed size is 2MB."}
    assert "requestuuid" in headers
    proto.data_received(b"x" * 1000)  # the rest is discarded
    await asyncio.sleep(0.01)
    assert called == []


async def test_413_chunked_body_counted() -> None:
    called = []

    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        called.append(1)

    proto, tr = connect(handler, max_body_bytes=100)
    proto.data_received(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    proto.data_received(b"40\r\n" + b"a" * 64 + b"\r\n")
    assert tr.buffer == b""
    proto.data_received(b"40\r\n" + b"b" * 64 + b"\r\n0\r\n\r\n")
    [(status, _, body)] = parse_responses(tr.buffer)
    assert status == 413 and b"Request body too large" in body
    await asyncio.sleep(0.01)
    assert called == []


async def test_chunked_body_within_limit() -> None:
    proto, tr = connect(echo, max_body_bytes=100)
    proto.data_received(
        b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    await wait_for(lambda: parse_responses(tr.buffer))
    [(status, _, body)] = parse_responses(tr.buffer)
    assert status == 200 and orjson.loads(body)["body"] == "abcde"


async def test_header_too_large_431() -> None:
    proto, tr = connect(echo, max_header_bytes=1024)
    proto.data_received(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4000)
    [(status, _, body)] = parse_responses(tr.buffer)
    assert status == 431
    assert set(orjson.loads(body)) == {"error", "error_type"}


async def test_expect_100_continue() -> None:
    proto, tr = connect(echo)
    proto.data_received(
        b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
    )
    assert tr.buffer.startswith(b"HTTP/1.1 100 ")
    proto.data_received(b"ok")
    await wait_for(lambda: b"200 OK" in tr.buffer)
    assert orjson.loads(parse_responses(tr.buffer)[-1][2])["body"] == "ok"


async def test_handler_exception_500_and_connection_survives() -> None:
    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        if request.path == "/boom":
            raise RuntimeError("bug")
        await response.send(200, b"fine", "text/plain")

    proto, tr = connect(handler)
    proto.data_received(get("/boom"))
    await wait_for(lambda: parse_responses(tr.buffer))
    [(status, _, body)] = parse_responses(tr.buffer)
    assert status == 500
    assert orjson.loads(body) == {
        "error": "Server internal error",
        "error_type": "Incomplete Generation",
    }
    proto.data_received(get("/ok"))
    await wait_for(lambda: len(parse_responses(tr.buffer)) == 2)
    assert parse_responses(tr.buffer)[1][:1] == (200,)


async def test_handler_without_response_gets_500() -> None:
    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        return None

    proto, tr = connect(handler)
    proto.data_received(get("/"))
    await wait_for(lambda: parse_responses(tr.buffer))
    assert parse_responses(tr.buffer)[0][0] == 500


async def test_exception_after_stream_started_closes() -> None:
    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        await response.start_stream()
        await response.write(b"data: 1\n\n")
        raise RuntimeError("mid-stream bug")

    proto, tr = connect(handler)
    proto.data_received(get("/"))
    await wait_for(lambda: tr.closed)
    assert b"0\r\n\r\n" not in tr.buffer  # the body is visibly incomplete


async def test_stream_end_close_connection() -> None:
    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        await response.start_stream()
        await response.write(b"Engine callback timeout: client timeout")
        await response.end(close_connection=True)

    proto, tr = connect(handler)
    proto.data_received(get("/"))
    await wait_for(lambda: tr.closed)
    [(status, _, body)] = parse_responses(tr.buffer)
    assert status == 200 and body == b"Engine callback timeout: client timeout"


async def test_http_error_becomes_wrapper() -> None:
    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        raise HttpError(422, "Input conflict.")

    proto, tr = connect(handler)
    proto.data_received(get("/"))
    await wait_for(lambda: parse_responses(tr.buffer))
    [(status, _, body)] = parse_responses(tr.buffer)
    assert status == 422
    assert orjson.loads(body) == {
        "error": "Input conflict.",
        "error_type": "Input Validation Error",
    }


async def test_http10_closes_after_response() -> None:
    proto, tr = connect(echo)
    proto.data_received(b"GET /old HTTP/1.0\r\n\r\n")
    await wait_for(lambda: tr.closed)
    assert parse_responses(tr.buffer)[0][0] == 200


async def test_head_request_has_no_body() -> None:
    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        await response.send(200, b"hello", "text/plain")

    proto, tr = connect(handler)
    proto.data_received(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
    await wait_for(lambda: b"\r\n\r\n" in tr.buffer)
    await asyncio.sleep(0.01)
    assert tr.buffer.endswith(b"\r\n\r\n") and b"hello" not in tr.buffer
    assert not tr.closed


async def test_idle_keep_alive_timeout_closes() -> None:
    proto, tr = connect(echo, keep_alive_s=0.02)
    proto.data_received(get("/"))
    await wait_for(lambda: parse_responses(tr.buffer))
    await wait_for(lambda: tr.closed, 1.0)


async def test_shutdown_waits_for_busy_connection() -> None:
    gate = asyncio.Event()

    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        await gate.wait()
        await response.send(200, b"done", "text/plain")

    proto, tr = connect(handler)
    proto.data_received(get("/"))
    await asyncio.sleep(0.005)
    proto.shutdown()
    assert not tr.closed
    gate.set()
    await wait_for(lambda: tr.closed)
    [(status, headers, body)] = parse_responses(tr.buffer)
    assert status == 200 and body == b"done" and headers["connection"] == "close"


# --------------------------------------------------------------------------- router


async def test_router_404_405_and_params() -> None:
    router = Router()

    async def model(request: HttpRequest, response: HttpResponse) -> None:
        await response.send_json(200, request.path_params)

    router.get("/v2/models/{model}", model)
    router.post("/infer", echo)
    proto, tr = connect(router)
    proto.data_received(
        get("/v2/models/Smol-LM2.135M")
        + get("/nope")
        + get("/infer")
        + get("/v2/models/bad%20name")
    )
    await wait_for(lambda: len(parse_responses(tr.buffer)) == 4)
    (s1, _, b1), (s2, _, b2), (s3, h3, b3), (s4, _, _) = parse_responses(tr.buffer)
    assert (s1, orjson.loads(b1)) == (200, {"model": "Smol-LM2.135M"})
    assert s2 == 404 and orjson.loads(b2)["error_type"] == "NotFoundError"
    assert s3 == 405 and set(orjson.loads(b3)) == {"error", "error_type"}
    assert h3["allow"] == "POST"
    assert s4 == 404  # space is outside [\w\-.]


def test_route_pattern_and_duplicates() -> None:
    rx = compile_pattern("/health/timed-{n}")
    assert rx.fullmatch("/health/timed-10").groupdict() == {"n": "10"}
    assert rx.fullmatch("/health/timed-1/x") is None
    router = Router()
    router.get("/a", echo)
    with pytest.raises(ValueError):
        router.get("/a", echo)
    router.post("/a", echo)
    assert sorted(router.routes()) == [("GET", "/a"), ("POST", "/a")]


def test_body_too_large_message() -> None:
    assert (
        body_too_large_message(40 * 2**20)
        == "Request body too large. Maximum allowed size is 40MB."
    )
