"""Per-connection HTTP limits and the checks h11 does not make (spec/interfaces.md §0.2).

References: RFC 9112 (HTTP/1.1 message syntax), uvicorn's h11 protocol, nginx
(``client_header_timeout``, ``large_client_header_buffers``, ``limit_conn``) and Apache
``mod_reqtimeout`` (``header=20-40,MinRate=500 body=20,MinRate=500``).

Time limits on one connection, none of them re-armed by each byte (a client trickling one
byte a second cannot hold a connection open)::

    connection open / previous response done
        |-- idle: nothing of a next request yet ---------- keep_alive_s, then close
        |-- first byte of a head ------------------------- head_timeout_s for the WHOLE
        |                                                  head, then 408 and close
        |-- head done, body expected --------------------- body_timeout_s plus one second
        |                                                  per min_body_rate bytes
        |                                                  received, then 408 and close
        '-- handler running: no timer (the engine's tokenTimeout / e2eTimeout apply)

The first request's head deadline starts when the connection opens (nginx does the same),
so a connection that never sends anything is closed after ``head_timeout_s``.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from tokenserve.config.tree import ServerConfig
from tokenserve.transport.errors import error_body

#: spec §0.2 / config.md ``maxRequestLength`` default (40 MiB), bytes.
DEFAULT_MAX_BODY_BYTES = ServerConfig.max_body_bytes
#: [I] largest request line + header block, bytes (nginx 4 x 8 KiB ... we allow 64 KiB).
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
#: [I] idle keep-alive connections are closed after this many seconds (Motor's
#: ``keep_alive_seconds`` default, config.md §9).
DEFAULT_KEEP_ALIVE_S = 180.0
#: [I] the whole request head must arrive within this many seconds of its first byte
#: (nginx ``client_header_timeout`` 60 s; Apache ``header=20-40``).
DEFAULT_HEAD_TIMEOUT_S = 30.0
#: [I] the body gets this many seconds ... (Apache ``body=20``)
DEFAULT_BODY_TIMEOUT_S = 30.0
#: [I] ... plus one second per this many bytes received (Apache ``MinRate=500``), bytes/s.
DEFAULT_MIN_BODY_RATE = 1024.0

#: end of a request head: an empty line; h11 also accepts a bare LF (RFC 9112 §2.2).
_HEAD_END = re.compile(rb"\n\r?\n")


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection limits (spec §0.2, config.md ``maxRequestLength``, ``maxLinkNum``).

    Attributes:
        max_body_bytes: body limit, bytes (413 above it).
        max_header_bytes: request line + headers limit, bytes (431 above it).
        keep_alive_s: idle keep-alive connections close after this many seconds.
        head_timeout_s: the whole head must arrive within this many seconds (408).
        body_timeout_s: the body's base deadline, seconds after the head (408).
        min_body_rate: each ``min_body_rate`` bytes of body received add one second to
            the body deadline (bytes/s).
        max_connections: open connections per listener; one more is answered 503 and
            closed at once. None: no limit.
        close_whole_responses: every non-streamed response carries ``Connection: close``
            and the connection is closed after it (spec §0.2, as MindIE does); streamed
            responses keep the connection.
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    min_body_rate: float = DEFAULT_MIN_BODY_RATE
    max_connections: int | None = None
    close_whole_responses: bool = False

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0 or self.max_header_bytes <= 0:
            raise ValueError("max_body_bytes and max_header_bytes must be > 0")
        if min(self.head_timeout_s, self.body_timeout_s, self.min_body_rate) <= 0:
            raise ValueError("head_timeout_s, body_timeout_s and min_body_rate must be > 0")
        if self.max_connections is not None and self.max_connections <= 0:
            raise ValueError(f"max_connections must be > 0, got {self.max_connections}")

    def body_deadline(self, head_done: float, received: int) -> float:
        """When a body of which ``received`` bytes arrived must be complete
        (``time.monotonic()`` seconds; the head ended at ``head_done``)."""
        return head_done + self.body_timeout_s + received / self.min_body_rate


class HeadMeter:
    """Measures one request head as its bytes arrive, however they are split, so a head
    over the limit is refused the same way in one write or in many (h11 only checks the
    size of an *incomplete* head).

    ``feed`` returns the head's size in bytes once its end is seen, else None; after that
    it ignores input (body or pipelined bytes) until :meth:`reset`.
    """

    def __init__(self) -> None:
        self.seen = 0  # head bytes so far
        self._tail = b""  # last 2 bytes, for an end split across writes
        self.size: int | None = None

    def reset(self) -> None:
        """Start measuring the next head."""
        self.seen, self._tail, self.size = 0, b"", None

    def feed(self, data: bytes | bytearray) -> int | None:
        if self.size is not None:
            return self.size
        window = self._tail + bytes(data)
        m = _HEAD_END.search(window)
        if m is not None:
            self.size = self.seen - len(self._tail) + m.end()
            return self.size
        self.seen += len(data)
        self._tail = window[-2:]
        return None


def version_supported(http_version: bytes) -> bool:
    """HTTP/1.0 and HTTP/1.1 only; anything else (``HTTP/2.0`` on an HTTP/1 connection,
    RFC 9112 §2.3) is answered 505."""
    return http_version in (b"1.0", b"1.1")


def conflicting_framing(headers: dict[str, str]) -> bool:
    """RFC 9112 §6.1: a request with both ``Transfer-Encoding`` and ``Content-Length``
    may be a smuggling attempt; we answer 400 and close (the RFC requires the close)."""
    return "transfer-encoding" in headers and "content-length" in headers


def raw_error_response(status: int, reason: str, message: str) -> bytes:
    """A complete error response with ``Connection: close`` as bytes, for answering
    before any request has been parsed (h11 cannot frame a response then)."""
    body = error_body(status, message)
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"RequestUUID: {uuid.uuid4()}\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode("latin-1") + body

