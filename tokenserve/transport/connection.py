"""HTTP/1.1 on h11: one :class:`asyncio.Protocol` per connection (spec/interfaces.md §0.2).

The request/response cycle itself (:class:`HttpRequest`, :class:`HttpResponse`,
:class:`ClientDisconnected`) lives in :mod:`tokenserve.transport.cycle`, the listening server
that makes one :class:`HttpProtocol` per accepted connection in
:mod:`tokenserve.transport.server`; this module owns the connection and its limits.

Shape (after uvicorn's h11 protocol, written for our needs)::

    socket bytes --data_received--> h11.Connection --events--> HttpProtocol
        Request + Data* + EndOfMessage  ->  HttpRequest (whole body, <= max_body_bytes)
        handler(request, response) runs as one task per request ("cycle")
    HttpResponse.send/start_stream/write/end --h11 events--> transport.write

- Keep-alive and pipelining: requests on one connection are handled strictly in order.
  While a handler runs we keep reading (so a client FIN is seen at once) until bytes of
  a *next* request arrive; then reading pauses until the response is complete and the
  buffered request is parsed. Reading also pauses while the transport is paused for
  writing (the client is not reading), and every write awaits ``drain()`` first.
- Disconnect: ``connection_lost`` sets ``request.disconnected`` immediately; later writes
  raise :class:`ClientDisconnected` (the server swallows it). Family handlers turn the
  event into an engine abort (spec §0.4 step 10).
- Limits (spec §0.2; :mod:`tokenserve.transport.limits` has the time limits drawn out):
  bodies over ``max_body_bytes`` get 413
  ``{"message":"Request body too large. Maximum allowed size is <N>MB."}`` — checked
  against Content-Length before any body byte is read, and counted for chunked bodies.
  A head over ``max_header_bytes`` gets 431 however its bytes arrive, a malformed
  request 400, ``Content-Length`` with ``Transfer-Encoding`` 400 (RFC 9112 §6.1), an
  HTTP version other than 1.0/1.1 505, a head or body that is too slow 408; all of them
  close the connection. Past ``max_connections`` open connections a new one is answered
  503 and closed at once. With ``close_whole_responses`` (spec §0.2) every non-streamed
  response carries ``Connection: close``.
- Graceful stop: ``HttpServer.stop_accepting``, then :meth:`HttpProtocol.shutdown`
  (idle connections close, busy ones after their response); what is still running when
  the drain time ends is ended by the caller (``tokenserve.transport.drain``).
- Every response carries ``RequestUUID: <uuid4>`` (spec §0.2). An uncaught handler
  exception answers 500 with the MindIE wrapper (``Server internal error``) and is logged;
  after a stream has started it closes the connection instead (the body is incomplete).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import h11
import orjson

from tokenserve.aio import Signal
from tokenserve.transport.cycle import (
    ClientDisconnected,
    HttpRequest,
    HttpResponse,
    response_head,
)
from tokenserve.transport.errors import (
    INTERNAL_ERROR_MESSAGE,
    HttpError,
    body_too_large_message,
    error_body,
)
from tokenserve.transport.limits import (
    HeadMeter,
    HttpLimits,
    conflicting_framing,
    raw_error_response,
    version_supported,
)

logger = logging.getLogger(__name__)
#: After an error response that leaves the request unread (413, 400) we half-close and
#: discard what the client still sends for this long, so it reads our answer instead of
#: a connection reset.
_LINGER_S = 2.0

Handler = Callable[["HttpRequest", "HttpResponse"], Awaitable[None]]


class HttpProtocol(asyncio.Protocol):
    """One client connection: bytes <-> h11 events, one handler task per request."""

    def __init__(
        self,
        handler: Handler,
        limits: HttpLimits | None = None,
        connections: set[HttpProtocol] | None = None,
    ) -> None:
        self._handler = handler
        self._limits = limits or HttpLimits()
        self._connections = connections
        self._loop = asyncio.get_running_loop()
        self._conn = h11.Connection(
            h11.SERVER, max_incomplete_event_size=self._limits.max_header_bytes
        )
        self._transport: asyncio.Transport | None = None
        self._client: tuple[str, int] | None = None
        self._closed = False
        self._discarding = False  # an error response was sent; drop further input
        self.shutting_down = False
        #: spec §0.2: whole (non-streamed) responses carry ``Connection: close``
        self.close_whole_responses = self._limits.close_whole_responses
        # flow control: reading is paused while any reason is present
        self._read_pause: set[str] = set()
        self._writable = asyncio.Event()
        self._writable.set()
        # the request being received
        self._head: h11.Request | None = None
        self._head_headers: dict[str, str] = {}
        self._arrival = 0.0
        self._body: list[bytes] = []
        self._body_len = 0
        self._meter = HeadMeter()
        # the request being handled
        self._request: HttpRequest | None = None
        self._response: HttpResponse | None = None
        self.task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = ""  # "idle" | "head" | "body" | "linger"

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only duck-typed ones
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self._client = (str(peer[0]), int(peer[1]))
        cap = self._limits.max_connections
        if self._connections is not None and cap is not None and len(self._connections) >= cap:
            # over maxLinkNum (spec §0.2 [I]): answer 503 and close at once, unread
            self._closed = True
            self._transport.write(raw_error_response(
                503, "Service Unavailable",
                f"Too many connections: the limit is {cap} (maxLinkNum)."))
            self._transport.close()
            return
        if self._connections is not None:
            self._connections.add(self)
        # the first request's head deadline runs from the connection's start
        self._arm_timer(self._limits.head_timeout_s, "head")

    def data_received(self, data: bytes) -> None:
        if self._discarding or self._closed:
            return
        self._conn.receive_data(data)
        if self._response is not None:
            # pipelined bytes while a request is handled: keep them in h11's buffer and
            # stop reading until the current response is done.
            self._pause_reading("pipeline")
            return
        if self._head is None:  # bytes of a head: its deadline runs from the first one
            if self._timer_kind != "head":
                self._arm_timer(self._limits.head_timeout_s, "head")
            if not self._check_head_size(data):
                return
        self._handle_events()
        self._arm_receive_timer()

    def _check_head_size(self, data: bytes | bytearray) -> bool:
        """431 for a head over ``max_header_bytes``, however its bytes are split."""
        size = self._meter.feed(data)
        limit = self._limits.max_header_bytes
        if (size if size is not None else self._meter.seen) > limit:
            self._reject(431, error_body(431, "Request header too large."))
            return False
        return True

    def _arm_receive_timer(self) -> None:
        """After input while no handler runs: a body gets its rate deadline; a head keeps
        the deadline set by its first byte."""
        if self._response is not None or self._discarding or self._closed:
            return
        if self._head is not None:
            deadline = self._limits.body_deadline(self._arrival, self._body_len)
            self._arm_timer(deadline - time.monotonic(), "body")

    def eof_received(self) -> bool | None:
        # The client will send nothing more: treat it as a disconnect (the transport
        # closes and connection_lost wakes any handler).
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._cancel_timer()
        self._writable.set()  # wake drain(), which then raises ClientDisconnected
        if self._request is not None:
            self._request.disconnected.set()
        if self._connections is not None:
            self._connections.discard(self)

    def pause_writing(self) -> None:
        self._writable.clear()
        self._pause_reading("write")

    def resume_writing(self) -> None:
        self._writable.set()
        self._resume_reading("write")

    # ------------------------------------------------------------------ flow control

    def _pause_reading(self, reason: str) -> None:
        if not self._read_pause and self._transport is not None and not self._closed:
            self._transport.pause_reading()
        self._read_pause.add(reason)

    def _resume_reading(self, reason: str) -> None:
        if reason not in self._read_pause:
            return
        self._read_pause.discard(reason)
        if not self._read_pause and self._transport is not None and not self._closed:
            self._transport.resume_reading()

    async def drain(self) -> None:
        """Wait until the transport accepts writes; raise if the client is gone."""
        if self._closed:
            raise ClientDisconnected()
        if not self._writable.is_set():
            await self._writable.wait()
            if self._closed:
                raise ClientDisconnected()

    def send_events(self, events: list[Any]) -> None:
        """Serialise h11 events and write them to the transport."""
        if self._closed or self._transport is None:
            raise ClientDisconnected()
        out: list[bytes] = []
        for event in events:
            chunks = self._conn.send_with_data_passthrough(event)
            if chunks:
                out.extend(chunks)
        if out:
            self._transport.write(b"".join(out) if len(out) > 1 else out[0])

    # ------------------------------------------------------------------ timers

    def _arm_timer(self, delay: float, kind: str) -> None:
        self._cancel_timer()
        if not self._closed:
            self._timer = self._loop.call_later(max(delay, 0.0), self._on_timeout)
            self._timer_kind = kind

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_kind = ""

    def _on_timeout(self) -> None:
        kind, self._timer, self._timer_kind = self._timer_kind, None, ""
        if self._response is not None or self._transport is None or self._closed:
            return
        if kind == "head" and self._meter.seen == 0 and self._meter.size is None:
            self._transport.close()  # not one byte of a request: nothing to answer
        elif kind in ("head", "body") and not self._discarding:
            what = "request head" if kind == "head" else "request body"
            self._reject(408, error_body(408, f"The {what} was not received in time."))
        else:  # idle keep-alive, or the linger after an error answer
            self._transport.close()

    # ------------------------------------------------------------------ request parsing

    def _handle_events(self) -> None:
        while not self._closed and not self._discarding and self._response is None:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                msg = (
                    "Request header too large." if status == 431 else f"Invalid HTTP request: {exc}"
                )
                self._reject(status, error_body(status, msg))
                return
            if event is h11.NEED_DATA:
                return
            if event is h11.PAUSED:
                self._pause_reading("pipeline")
                return
            if isinstance(event, h11.Request):
                self._on_request(event)
            elif isinstance(event, h11.Data):
                self._on_body(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._dispatch()
                if self._conn.trailing_data[0]:
                    self._pause_reading("pipeline")  # a next request is already buffered
            elif isinstance(event, h11.ConnectionClosed):
                if self._transport is not None:
                    self._transport.close()
                return

    def _on_request(self, event: h11.Request) -> None:
        self._arrival = time.monotonic()
        headers: dict[str, str] = {}
        for name, value in event.headers:
            key = name.decode("latin-1")
            val = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {val}" if key in headers else val
        self._head = event
        self._head_headers = headers
        self._body = []
        self._body_len = 0
        if not version_supported(event.http_version):
            self._reject(505, error_body(
                505, f"HTTP/{event.http_version.decode('latin-1')} is not supported; "
                "use HTTP/1.1."))
            return
        if conflicting_framing(headers):
            self._reject(400, error_body(
                400, "Content-Length and Transfer-Encoding must not both be sent."))
            return
        length = headers.get("content-length")
        if length is not None and int(length.split(",")[0]) > self._limits.max_body_bytes:
            self._reject_too_large()
            return
        self._arm_receive_timer()
        if self._conn.they_are_waiting_for_100_continue:
            self.send_events([h11.InformationalResponse(status_code=100, headers=[])])

    def _on_body(self, data: bytes | bytearray) -> None:
        self._body_len += len(data)
        if self._body_len > self._limits.max_body_bytes:
            self._reject_too_large()
            return
        self._body.append(bytes(data))

    def _dispatch(self) -> None:
        head = self._head
        assert head is not None
        self._head = None
        self._cancel_timer()  # no timer while the handler runs
        path, query = _split_target(head.target.decode("latin-1"))
        body = b"".join(self._body)
        self._body = []
        request = HttpRequest(
            method=head.method.decode("latin-1").upper(),
            path=path,
            query=query,
            headers=self._head_headers,
            body=body,
            disconnected=Signal(),
            http_version=head.http_version.decode("latin-1"),
            client=self._client,
            arrival_time=self._arrival,
        )
        response = HttpResponse(self, head_only=request.method == "HEAD")
        self._request = request
        self._response = response
        self.task = self._loop.create_task(self._run_cycle(request, response))

    # ------------------------------------------------------------------ cycle

    async def _run_cycle(self, request: HttpRequest, response: HttpResponse) -> None:
        try:
            await self._handler(request, response)
        except ClientDisconnected:
            pass
        except HttpError as exc:
            await self._fail(response, exc.status, exc.body(), exc.headers)
        except asyncio.CancelledError:
            self._abort_connection()
            raise
        except Exception:
            logger.exception("unhandled error in handler for %s %s", request.method, request.path)
            await self._fail(response, 500, error_body(500, INTERNAL_ERROR_MESSAGE))
        else:
            if not response.started:
                logger.error("handler for %s %s sent no response", request.method, request.path)
                await self._fail(response, 500, error_body(500, INTERNAL_ERROR_MESSAGE))
            elif not response.finished:
                try:
                    await response.end()
                except ClientDisconnected:
                    pass
        finally:
            self._cycle_done(response)

    async def _fail(
        self,
        response: HttpResponse,
        status: int,
        body: bytes,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if self._closed:
            return
        if response.started:
            # a partial body cannot be turned into an error: close so the client sees an
            # incomplete response rather than a well-formed truncated one
            self._abort_connection()
            return
        try:
            await response.send(status, body, "application/json", headers)
        except ClientDisconnected:
            pass

    def _cycle_done(self, response: HttpResponse) -> None:
        self._request = None
        self._response = None
        self.task = None
        if self._closed or self._transport is None:
            return
        conn = self._conn
        if (
            not response.finished
            or response.close_connection
            or self.shutting_down
            or conn.our_state is not h11.DONE
            or conn.their_state is not h11.DONE
        ):
            self._transport.close()
            return
        conn.start_next_cycle()
        self._meter.reset()
        self._resume_reading("pipeline")
        buffered = conn.trailing_data[0]
        if buffered:  # a pipelined request is already buffered (reading was paused)
            self._arm_timer(self._limits.head_timeout_s, "head")
            if not self._check_head_size(buffered):
                return
            self._handle_events()
            self._arm_receive_timer()
        else:
            self._arm_timer(self._limits.keep_alive_s, "idle")

    # ------------------------------------------------------------------ errors / closing

    def _reject_too_large(self) -> None:
        body = orjson.dumps({"message": body_too_large_message(self._limits.max_body_bytes)})
        self._reject(413, body)

    def _reject(self, status: int, body: bytes) -> None:
        """Answer an error for a request we will not read to the end, then close."""
        self._head = None
        self._body = []
        if self._transport is None or self._closed:
            return
        hdrs = [
            (b"content-type", b"application/json"),
            (b"RequestUUID", str(uuid.uuid4()).encode()),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            self.send_events([response_head(status, hdrs), h11.Data(data=body), h11.EndOfMessage()])
        except h11.LocalProtocolError:
            # no request parsed yet (a head refused before h11 saw its end): the bytes
            # are framed by hand, the same response h11 would have written
            head = response_head(status, hdrs)
            self._transport.write(
                b"HTTP/1.1 %d %s\r\n" % (status, head.reason)
                + b"".join(k + b": " + v + b"\r\n" for k, v in hdrs) + b"\r\n" + body)
        self._linger_close()

    def _linger_close(self) -> None:
        """Half-close after an error response and discard input for a moment, so a client
        still sending its body reads our response instead of a reset."""
        self._discarding = True
        self._cancel_timer()
        assert self._transport is not None
        for reason in list(self._read_pause):
            self._resume_reading(reason)
        if self._transport.can_write_eof():
            self._transport.write_eof()
            self._arm_timer(_LINGER_S, "linger")  # _on_timeout closes
        else:
            self._transport.close()

    def _abort_connection(self) -> None:
        if self._transport is not None and not self._closed:
            self._transport.close()

    def shutdown(self) -> None:
        """Graceful close: idle connections close now, busy ones after their response."""
        self.shutting_down = True
        if self._response is None:
            self._abort_connection()

    def force_close(self) -> None:
        """Close now; a running handler sees ``request.disconnected``."""
        self._abort_connection()


def _split_target(target: str) -> tuple[str, str]:
    """Split a request target into (percent-decoded path, raw query)."""
    if not target.startswith("/"):
        if target == "*":
            return "*", ""
        parts = urlsplit(target)  # absolute-form
        return unquote(parts.path or "/"), parts.query
    path, _, query = target.partition("?")
    return (unquote(path) if "%" in path else path), query
