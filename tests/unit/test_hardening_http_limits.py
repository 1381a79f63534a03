"""HTTP limits over real sockets (issue 11 item 4; RFC 9112, uvicorn and nginx as the
references): head deadline and minimum body rate (408), the connection cap (503), a head
over 64 KiB (431 however it arrives), Content-Length with Transfer-Encoding (400 and
close), ``HTTP/2.0`` (505) and spec §0.2's ``Connection: close``. Every socket read has a
timeout; each test takes well under two seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import orjson
import pytest

from tests.fakes import FakeEngine
from tokenserve.server.app import build_router, serve
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.limits import HeadMeter, HttpLimits
from tokenserve.transport.server import HttpServer

IO_TIMEOUT = 3.0


async def ok(request: HttpRequest, response: HttpResponse) -> None:
    await response.send(200, b'{"ok":true}')


@contextlib.asynccontextmanager
async def server(**limits: float | None) -> AsyncIterator[int]:
    srv = HttpServer(ok, limits=HttpLimits(**limits))  # type: ignore[arg-type]
    await srv.start("127.0.0.1", 0)
    try:
        yield srv.ports[0]
    finally:
        await srv.close(timeout=0.5)


async def read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything until the server closes (bounded by IO_TIMEOUT)."""
    return await asyncio.wait_for(reader.read(), IO_TIMEOUT)


def status_of(raw: bytes) -> int:
    assert raw.startswith(b"HTTP/1.1 "), raw[:80]
    return int(raw[9:12])


async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  data: bytes, every_s: float) -> tuple[bytes, float]:
    """Write ``data`` one byte every ``every_s`` seconds until the server answers and
    closes; returns (what it sent back, seconds from the first byte to its close)."""
    t0 = time.monotonic()
    answer = asyncio.ensure_future(read_all(reader))
    for byte in data:
        if answer.done():
            break
        writer.write(bytes([byte]))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        await asyncio.sleep(every_s)
    raw = await answer
    elapsed = time.monotonic() - t0
    writer.close()
    return raw, elapsed


async def test_trickled_head_gets_408_at_the_head_deadline() -> None:
    async with server(head_timeout_s=0.4) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # one byte every 20 ms: each would re-arm an idle timer; 5 s of head in all
        head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 250
        raw, elapsed = await trickle(reader, writer, head, 0.02)
    assert status_of(raw) == 408 and b"connection: close" in raw.lower()
    assert elapsed < 1.5  # the deadline is for the whole head, not per byte


async def test_silent_connection_is_closed_at_the_head_deadline() -> None:
    async with server(head_timeout_s=0.3) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        assert await read_all(reader) == b""  # nothing to answer: just closed
        assert time.monotonic() - t0 < 1.5
        writer.close()


async def test_trickled_body_gets_408_under_the_minimum_rate() -> None:
    async with server(body_timeout_s=0.3, min_body_rate=1000) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        raw, elapsed = await trickle(reader, writer, b"a" * 100, 0.05)  # 20 bytes/s
    assert status_of(raw) == 408
    assert elapsed < 1.5


async def test_connections_past_the_cap_get_503_at_once() -> None:
    async with server(max_connections=2) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        raw = await read_all(reader)
        assert status_of(raw) == 503
        assert orjson.loads(raw.split(b"\r\n\r\n", 1)[1])["error_type"] == "Service Unavailable"
        writer.close()
        held[0][1].close()  # one slot frees: a new connection is served again
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status_of(await read_all(reader)) == 200
        writer.close()
        for _, w in held[1:]:
            w.close()


@pytest.mark.parametrize("piece", [None, 1024])
async def test_head_over_64_kib_is_431_however_it_arrives(piece: int | None) -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (100 * 1024) + b"\r\n\r\n"
    async with server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        chunks = [head] if piece is None else [head[i:i + piece]
                                               for i in range(0, len(head), piece)]
        with contextlib.suppress(ConnectionError):
            for c in chunks:
                writer.write(c)
                await writer.drain()
        raw = await read_all(reader)
        writer.close()
    assert status_of(raw) == 431


def test_head_meter_counts_the_head_only() -> None:
    m = HeadMeter()
    assert m.feed(b"GET / HTTP/1.1\r\nHost: x\r") is None
    assert m.feed(b"\n\r\nbody bytes") == len(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    m.reset()
    assert m.feed(b"x" * 10) is None and m.seen == 10


async def test_content_length_with_transfer_encoding_is_400_and_close() -> None:
    async with server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        smuggled = b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n"
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled)
        raw = await read_all(reader)  # ends: the connection is closed
        writer.close()
    assert status_of(raw) == 400 and raw.count(b"HTTP/1.1 ") == 1  # /next never served


async def test_http2_request_line_is_505() -> None:
    async with server() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/2.0\r\nHost: x\r\n\r\n")
        raw = await read_all(reader)
        writer.close()
    assert status_of(raw) == 505


async def test_whole_responses_close_streams_keep_alive() -> None:
    """spec §0.2: every non-streamed response carries ``Connection: close``."""
    loop = asyncio.get_running_loop()
    started: asyncio.Future[HttpServer] = loop.create_future()
    stop = asyncio.Event()
    task = loop.create_task(serve(FakeEngine(), "127.0.0.1", 0, stop=stop, started=started,
                                  shutdown_timeout_s=0.5))
    port = (await asyncio.wait_for(started, IO_TIMEOUT)).ports[0]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = await read_all(reader)  # read() returns: the server closed
        writer.close()
        assert status_of(raw) == 200 and b"connection: close" in raw.lower()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = orjson.dumps({"inputs": "ab", "parameters": {"max_new_tokens": 2}})
        req = (b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
               b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        writer.write(req)
        first = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), IO_TIMEOUT)
        assert b"connection: close" not in first.lower()
        writer.write(req)  # the same connection serves a second stream
        second = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), IO_TIMEOUT)
        assert status_of(second) == 200
        writer.close()
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


def test_limits_reject_bad_values() -> None:
    with pytest.raises(ValueError):
        HttpLimits(max_connections=0)
    with pytest.raises(ValueError):
        HttpLimits(head_timeout_s=0)


async def test_build_router_without_config_answers_v1_config_500() -> None:
    from tests.fakes import serve_fake

    async with serve_fake(FakeEngine()) as (_, client):
        r = await client.get("/v1/config")
    assert r.status_code == 500 and r.json()["error"] == "No model is configured."
    assert build_router(FakeEngine()) is not None
