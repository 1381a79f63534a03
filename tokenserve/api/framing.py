"""How the families frame a streamed answer on the wire (spec/interfaces.md §0.4 step 9,
§2.1, §3.2, §4.1, §5, §6.3): server-sent events and NUL-delimited JSON (a failed stream's
last event is :mod:`tokenserve.api.errors`'s). Imports nothing of the engine: the
coordinator frames with it too. Which family frames how: :mod:`tokenserve.api.families`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

#: the content type of every family's stream (vLLM's NUL-delimited JSON too, spec §4.1).
EVENT_STREAM = "text/event-stream"
#: OpenAI's end of stream (spec §5).
SSE_DONE = b"data: [DONE]\n\n"


def sse(event: Any, *, space: bool = True) -> bytes:
    """One server-sent event ``data: <json>\\n\\n``; Triton writes ``data:<json>`` with no
    space (``space=False``, spec §6.3)."""
    return (b"data: " if space else b"data:") + orjson.dumps(event) + b"\n\n"


def nul_chunk(event: Any) -> bytes:
    """One vLLM stream chunk, ``<json>\\0`` (spec §4.1)."""
    return orjson.dumps(event) + b"\0"


@dataclass(frozen=True)
class Framing:
    """One way of putting a stream's JSON events on the wire.

    Attributes:
        name: for logs and tests.
        event: one JSON-able event -> its bytes.
        separator: the bytes that end every event (a reader splits the stream on them).
    """

    name: str
    event: Callable[[Any], bytes]
    separator: bytes

    @property
    def nul_delimited(self) -> bool:
        """Whether events end with NUL: such a stream crosses PD's ``/dresult`` (whose
        fields end with NUL) with each NUL as a newline and is swapped back for the client
        (:func:`tokenserve.pd.wire.dresult_body` / ``vllm_body``)."""
        return self.separator == b"\0"


#: ``data: <json>\n\n`` (MindIE, TGI, OpenAI)
SSE = Framing("sse", sse, b"\n\n")
#: ``data:<json>\n\n`` (Triton, spec §6.3)
SSE_NO_SPACE = Framing("sse-no-space", partial(sse, space=False), b"\n\n")
#: ``<json>\0`` (vLLM, spec §4.1)
NUL_JSON = Framing("nul-json", nul_chunk, b"\0")
