"""Responses that are not written to a socket (PD): the family handlers run unchanged on a
prefill or decode instance and write into one of these instead of the client's connection.

:class:`CaptureResponse` has the :class:`tokenserve.transport.cycle.HttpResponse` interface
(``send`` / ``send_json`` / ``send_error`` once, or ``start_stream``, ``write``..., ``end``)
and records what was written. Subclasses decide where the bytes go.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from tokenserve.transport.errors import error_body


class CaptureResponse:
    """Records a handler's answer (no socket). Attributes after the handler:
    ``status``, ``is_stream``, ``chunks`` (stream bytes or the whole body),
    ``content_type``, ``headers`` (a whole answer's), ``finished``."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.started = False
        self.finished = False
        self.close_connection = False
        self.is_stream = False
        self.content_type = "application/json"
        #: the extra headers of a whole answer (Triton's binary extension)
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        #: set while the handler renders a replay output (tokens the client already has):
        #: stream writes are then dropped
        self.muted = False

    # whole responses
    async def send(self, status: int, body: bytes = b"", content_type: str = "application/json",
                   headers: Mapping[str, str] | None = None) -> None:
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        self.status, self.content_type = status, content_type
        self.headers = dict(headers or {})
        self.chunks.append(body)
        self.on_whole(status, body)

    async def send_json(self, status: int, obj: Any,
                        headers: Mapping[str, str] | None = None) -> None:
        await self.send(status, orjson.dumps(obj), "application/json", headers)

    async def send_error(self, status: int, message: str, error_type: str | None = None,
                         headers: Mapping[str, str] | None = None) -> None:
        await self.send(status, error_body(status, message, error_type), "application/json",
                        headers)

    # streams
    async def start_stream(self, status: int = 200, content_type: str = "text/event-stream",
                           headers: Mapping[str, str] | None = None) -> None:
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.is_stream = True
        self.status, self.content_type = status, content_type

    async def write(self, chunk: bytes) -> None:
        if not self.started or self.finished:
            raise RuntimeError("write() outside a started stream")
        if chunk and not self.muted:
            self.chunks.append(chunk)
            self.on_chunk(chunk)

    async def end(self, *, close_connection: bool = False) -> None:
        if not self.started:
            raise RuntimeError("end() before start_stream()")
        if self.finished:
            return
        self.finished = True
        self.on_end()

    # hooks
    def on_whole(self, status: int, body: bytes) -> None:
        """A whole (non-stream) answer was sent."""

    def on_chunk(self, chunk: bytes) -> None:
        """A stream chunk was written."""

    def on_end(self) -> None:
        """The stream ended."""

    @property
    def text(self) -> str:
        """Everything recorded, as text."""
        return b"".join(self.chunks).decode("utf-8", errors="replace")
