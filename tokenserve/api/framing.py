"""How the families frame a streamed answer on the wire (spec/interfaces.md §0.4 step 9,
§2.1, §3.2, §4.1, §5, §6.3): server-sent events and NUL-delimited JSON (a failed stream's
last event is :mod:`tokenserve.api.errors`'s). Imports nothing of the engine: the
coordinator frames with it too."""

from __future__ import annotations

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
