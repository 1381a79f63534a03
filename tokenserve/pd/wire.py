"""The NUL-framed ``/dresult`` message codec (spec/pd_disaggregation.md §6.3, plan
"/dresult codec").

D writes, on its one long-lived ``GET /dresult`` response towards the coordinator, a
sequence of NUL-terminated text fields; a request message is two fields, a heartbeat one::

    reqId:<id> NUL <kind>:<body> NUL        kind: data, lastData, lastBytes, error, retry,
                                                  close, ids
    ka:heartbeat NUL

The coordinator parses it with :class:`DresultParser`, which is more tolerant than
MindIE's (§6.3 asks only "at least as tolerant"): a field split across HTTP chunks is
reassembled, runs of NUL are skipped, the keyword is the text before the first ``:``
(the body may hold more), a field with an empty body or without ``:`` is ignored, and
``reqId:`` sets the id of the *following* kind field only. Unknown kinds are dropped
(they still consume the pending id). Bytes are decoded as UTF-8 per field, after
reassembly, so a multi-byte character split across chunks survives.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

#: §6.3: the request id of a ``close`` message.
CLOSE_ID = "0xffffffffffffffff"
#: §6.3: the body of a ``close`` message.
CLOSE_TEXT = "new connection is to established, close the old one."
#: §6.3: the keep-alive field D writes after 5 s without output.
HEARTBEAT: bytes = b"ka:heartbeat\0"
#: every kind the codec knows (§6.3 plus the plan's ``ids``).
KINDS = frozenset({"data", "lastData", "lastBytes", "error", "retry", "close", "ka", "ids"})
#: a field longer than this (bytes, no NUL seen) is a broken stream, not a message.
DEFAULT_MAX_FIELD_BYTES = 64 * 2**20


def encode(req_id: str, kind: str, body: str) -> bytes:
    """One request message, ``reqId:<req_id>\\0<kind>:<body>\\0``, UTF-8 (§6.3). D must
    write it in one chunk.

    Raises:
        ValueError: an unknown ``kind``, an empty ``req_id`` or ``body`` (the parser would
            drop the field), or a NUL inside either.
    """
    if kind not in KINDS or kind == "ka":
        raise ValueError(f"unknown /dresult message kind {kind!r}")
    if not req_id or not body:
        raise ValueError("a /dresult message needs a non-empty request id and body")
    if "\0" in req_id or "\0" in body:
        raise ValueError("a /dresult field must not contain NUL")
    return f"reqId:{req_id}\0{kind}:{body}\0".encode()


def dresult_body(chunk: bytes) -> str:
    """A rendered chunk as a /dresult body (D's side). [I] A body never holds NUL, so
    the NUL that ends each vLLM stream chunk (``{json}\\0``, spec/interfaces.md §4.1)
    travels as a newline (JSON text never holds a raw one); :func:`vllm_body` turns it
    back.

    Raises:
        UnicodeDecodeError: ``chunk`` is not UTF-8 (a family renders text).
    """
    return chunk.decode("utf-8").replace("\0", "\n")


def vllm_body(body: str) -> str:
    """The inverse of :func:`dresult_body` for a vLLM stream body (the coordinator's
    side): the bytes the client expects, as text."""
    return body.replace("\n", "\0")


@dataclass(frozen=True)
class WholeAnswer:
    """A whole (non-stream) answer that is not a plain JSON text: its bytes, content type
    and extra headers (Triton's binary tensor extension: ``application/octet-stream``
    with ``Inference-Header-Content-Length``, spec/interfaces.md §6.4)."""

    content_type: str
    headers: dict[str, str]
    body: bytes

    @staticmethod
    def needed(content_type: str, headers: Mapping[str, str] | None) -> bool:
        """Whether an answer with this content type and headers must travel as a
        :class:`WholeAnswer` (a ``lastData`` body is text, sent as ``application/json``)."""
        return bool(headers) or content_type != "application/json"

    def encode(self) -> str:
        """[I] The ``lastBytes`` body and P's ``outputBytes``: JSON
        ``{"contentType", "headers", "body": base64}`` (never holds NUL)."""
        return orjson.dumps({"contentType": self.content_type, "headers": self.headers,
                             "body": base64.b64encode(self.body).decode()}).decode()

    @staticmethod
    def decode(text: str) -> WholeAnswer:
        """The inverse of :meth:`encode`.

        Raises:
            ValueError: a malformed text."""
        try:
            obj = orjson.loads(text)
            headers = {str(k): str(v) for k, v in obj["headers"].items()}
            return WholeAnswer(str(obj["contentType"]), headers,
                               base64.b64decode(obj["body"], validate=True))
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError,
                binascii.Error) as exc:
            raise ValueError(f"bad whole answer: {exc}") from None


def close_message() -> bytes:
    """The message D writes on the old stream when a new ``/dresult`` consumer connects
    (§6.2): ``reqId:0xffffffffffffffff\\0close:new connection ...\\0``."""
    return encode(CLOSE_ID, "close", CLOSE_TEXT)


@dataclass(frozen=True)
class DMessage:
    """One parsed message.

    Attributes:
        req_id: the id of the ``reqId:`` field just before it; None when there was none
            (a heartbeat).
        kind: one of :data:`KINDS`.
        body: the text after the first ``:`` of the kind field (never empty).
    """

    req_id: str | None
    kind: str
    body: str


class DresultParser:
    """Incremental parser of one ``/dresult`` stream (module docstring for the rules).

    Args:
        max_field_bytes: the most bytes a field may hold before its NUL.
    """

    def __init__(self, max_field_bytes: int = DEFAULT_MAX_FIELD_BYTES) -> None:
        self._buf = bytearray()
        self._req_id: str | None = None
        self._max = max_field_bytes

    def feed(self, chunk: bytes) -> list[DMessage]:
        """Parse ``chunk`` (any split of the stream's bytes) and return the messages it
        completes, in stream order.

        Raises:
            ValueError: more than ``max_field_bytes`` bytes without a NUL.
        """
        buf = self._buf
        buf += chunk
        out: list[DMessage] = []
        start = 0
        while (end := buf.find(b"\0", start)) >= 0:
            if end > start:  # an empty field is a run of NUL: skipped
                msg = self._field(bytes(buf[start:end]))
                if msg is not None:
                    out.append(msg)
            start = end + 1
        del buf[:start]
        if len(buf) > self._max:
            raise ValueError(f"/dresult field over {self._max} bytes without a NUL")
        return out

    def _field(self, raw: bytes) -> DMessage | None:
        key, sep, body = raw.decode("utf-8", errors="replace").partition(":")
        if not sep or not body:
            return None
        if key == "reqId":
            self._req_id = body
            return None
        req_id, self._req_id = self._req_id, None
        if key not in KINDS:
            return None
        return DMessage(req_id, key, body)
