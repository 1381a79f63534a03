"""One request/response cycle of the HTTP/1.1 server (spec/interfaces.md §0.2-§0.4).

:class:`HttpRequest` is a fully received request; :class:`HttpResponse` is the handler's
side of the answer, written as h11 events through the connection
(:class:`tokenserve.transport.server.HttpProtocol`, seen here only as :class:`Connection`);
:class:`ClientDisconnected` is what its writes raise once the client is gone (spec §0.4
step 10: the families turn it into an engine abort). Every response carries
``RequestUUID: <uuid4>`` (spec §0.2) and, while the server shuts down,
``Connection: close``; so does every whole (non-streamed) response when the connection's
``close_whole_responses`` is set (spec §0.2: MindIE closes after each one).

``tokenserve.transport.server`` re-exports the three names, the import path they had before.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

import h11
import orjson

from tokenserve.aio import Signal
from tokenserve.transport.errors import error_body


class Connection(Protocol):
    """What an :class:`HttpResponse` writes through: one client connection."""

    #: a graceful shutdown is in progress (responses then carry ``Connection: close``).
    shutting_down: bool
    #: spec §0.2: whole responses carry ``Connection: close`` and end the connection.
    close_whole_responses: bool

    async def drain(self) -> None:
        """Wait until the transport accepts writes; raise :class:`ClientDisconnected`
        if the client is gone."""

    def send_events(self, events: list[Any]) -> None:
        """Serialise h11 events and write them to the transport."""


class HandlerExit(Exception):
    """A handler stops without answering, and it is not an error: the subclass says why
    (:class:`ClientDisconnected`; PD prefill's ``RequestHandedOff``). Error handlers
    re-raise it untouched; whoever started the handler matches the subclass it expects."""


class ClientDisconnected(HandlerExit, ConnectionError):
    """The client went away; raised by :class:`HttpResponse` writes after disconnect."""


@dataclass(eq=False)
class HttpRequest:
    """One fully received request (body included).

    Attributes:
        method: upper-case method, e.g. ``"POST"``.
        path: percent-decoded path without the query, e.g. ``"/infer"``.
        query: raw query string (after ``?``), ``""`` when none.
        headers: header names lower-cased; repeated headers joined with ``", "``.
        body: the request body (at most ``max_body_bytes``).
        disconnected: set as soon as the connection is lost (a :class:`Signal`, so the
            engine handle can wait on it and on its next output at once).
        http_version: ``"1.1"`` or ``"1.0"``.
        client: peer (host, port) when known.
        arrival_time: ``time.monotonic()`` when the request head arrived (seconds).
        path_params: ``{param}`` values filled in by the router.
    """

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    disconnected: Signal
    http_version: str = "1.1"
    client: tuple[str, int] | None = None
    arrival_time: float = 0.0
    path_params: dict[str, str] = field(default_factory=dict)


class HttpResponse:
    """The handler's side of one request/response cycle.

    Either ``send``/``send_json``/``send_error`` once, or ``start_stream`` then any number
    of ``write`` and one ``end``. Every method raises :class:`ClientDisconnected` once the
    client is gone and ``RuntimeError`` when called out of order.
    """

    def __init__(self, protocol: Connection, head_only: bool = False) -> None:
        self._protocol = protocol
        self._head_only = head_only
        self.status: int | None = None
        self.started = False
        self.finished = False
        self.close_connection = False

    # ------------------------------------------------------------------ whole responses

    async def send(
        self,
        status: int,
        body: bytes = b"",
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Send a complete response with a Content-Length."""
        if self.started:
            raise RuntimeError("response already started")
        close = getattr(self._protocol, "close_whole_responses", False)
        hdrs = self._headers(content_type, headers, close)
        hdrs.append((b"content-length", str(len(body)).encode()))
        await self._protocol.drain()
        self.started = True
        self.status = status
        events: list[Any] = [response_head(status, hdrs)]
        if body and not self._head_only:
            events.append(h11.Data(data=body))
        events.append(h11.EndOfMessage())
        self._protocol.send_events(events)
        self.finished = True
        self.close_connection = self.close_connection or close

    async def send_json(
        self, status: int, obj: Any, headers: Mapping[str, str] | None = None
    ) -> None:
        """Send ``obj`` serialised with orjson as ``application/json``."""
        await self.send(status, orjson.dumps(obj), "application/json", headers)

    async def send_error(
        self,
        status: int,
        message: str,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Send the MindIE error wrapper (spec §0.3)."""
        await self.send(
            status, error_body(status, message, error_type), "application/json", headers
        )

    # ------------------------------------------------------------------ streaming

    async def start_stream(
        self,
        status: int = 200,
        content_type: str = "text/event-stream",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Send the head of a streamed response (chunked on HTTP/1.1; h11 picks the
        framing because no Content-Length is set)."""
        if self.started:
            raise RuntimeError("response already started")
        hdrs = self._headers(content_type, headers)
        await self._protocol.drain()
        self.started = True
        self.status = status
        self._protocol.send_events([response_head(status, hdrs)])

    async def write(self, chunk: bytes) -> None:
        """Write one piece of a streamed body (one SSE event = one h11.Data = one chunk),
        waiting for the transport to drain first if it is paused."""
        if not self.started or self.finished:
            raise RuntimeError("write() outside a started stream")
        await self._protocol.drain()
        if chunk and not self._head_only:
            self._protocol.send_events([h11.Data(data=chunk)])

    async def end(self, *, close_connection: bool = False) -> None:
        """Finish a streamed body; ``close_connection`` closes the connection afterwards
        (spec §0.4 step 9: the timeout text is the last chunk, then close)."""
        if not self.started:
            raise RuntimeError("end() before start_stream()")
        if self.finished:
            return
        if close_connection:
            self.close_connection = True
        self._protocol.send_events([h11.EndOfMessage()])
        self.finished = True

    # ------------------------------------------------------------------ helpers

    def _headers(
        self, content_type: str, extra: Mapping[str, str] | None, close: bool = False
    ) -> list[tuple[bytes, bytes]]:
        hdrs = [
            (b"content-type", content_type.encode("latin-1")),
            (b"RequestUUID", str(uuid.uuid4()).encode()),
        ]
        if extra:
            hdrs.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items())
        if close or self._protocol.shutting_down:
            hdrs.append((b"connection", b"close"))
        return hdrs


def response_head(status: int, headers: list[tuple[bytes, bytes]]) -> h11.Response:
    """The h11 response head for ``status`` with its standard reason phrase (none for a
    code :class:`http.HTTPStatus` does not know)."""
    try:
        reason = HTTPStatus(status).phrase.encode()
    except ValueError:
        reason = b""
    return h11.Response(status_code=status, headers=headers, reason=reason)
