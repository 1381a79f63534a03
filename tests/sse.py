"""Server-sent-event helpers shared by the API tests."""

from __future__ import annotations

from typing import Any

import orjson


def sse_events(raw: bytes, prefix: bytes = b"data: ") -> list[dict[str, Any]]:
    """Parse a complete SSE body: every event is ``prefix + json + \\n\\n``."""
    assert raw.endswith(b"\n\n"), raw[-100:]
    parts = raw.split(b"\n\n")[:-1]
    assert all(p.startswith(prefix) for p in parts), raw
    return [orjson.loads(p[len(prefix):]) for p in parts]


async def read_sse(client, path: str, body: dict, prefix: bytes = b"data: ",
                   sep: bytes = b"\n\n") -> list[dict]:
    """POST ``body`` to a streaming route; every event, parsed, in order. Events are
    ``prefix + json`` ended by ``sep`` (vLLM: no prefix, NUL-ended, spec §4.1). Each event
    must be valid UTF-8 on its own and the stream must end on an event boundary."""
    events = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        buf = b""
        async for chunk in r.aiter_bytes():
            buf += chunk
            while sep in buf:
                ev, buf = buf.split(sep, 1)
                ev.decode("utf-8")
                # the JSON starts right after the prefix (Triton: "data:{", spec §9.4)
                assert ev.startswith(prefix) and ev[len(prefix):][:1] == b"{", ev
                events.append(orjson.loads(ev[len(prefix):]))
    assert buf == b""
    return events
