"""The one ``GET /dresult`` stream of a decode instance (spec/pd_disaggregation.md §6.2).

Every D message of every request (``pd/decode.py``'s observers publish them, whole
messages per chunk) goes to the one connected consumer, the coordinator: a new consumer
closes the old one (``close_message``); ``ka:heartbeat`` after ``HEARTBEAT_S`` idle;
messages published while no consumer is connected are kept (at most ``BACKLOG``) instead
of dropped [I], and so is what a consumer that left did not get, so the next one reads
them first. ``orphaned_since`` says since when nobody reads (``DecodeServer`` ends the
running requests after ``dresult_orphan_timeout_s``).
"""

from __future__ import annotations

import asyncio
import collections
import time

from tokenserve.pd.wire import HEARTBEAT, close_message
from tokenserve.transport.cycle import ClientDisconnected, HttpRequest, HttpResponse

#: §6.2: heartbeat after this many idle seconds.
HEARTBEAT_S = 5.0
#: [I] messages kept while no /dresult consumer is connected.
BACKLOG = 100_000
_CLOSE = object()


class DresultHub:
    """The one ``GET /dresult`` stream of a decode instance (§6.2)."""

    def __init__(self, heartbeat_s: float = HEARTBEAT_S, backlog: int = BACKLOG) -> None:
        self.heartbeat_s = heartbeat_s
        self._queue: asyncio.Queue | None = None  # the connected consumer's
        self._backlog: collections.deque[bytes] = collections.deque(maxlen=backlog)
        #: time.monotonic() when the last consumer left; None while one is connected
        self.orphaned_since: float | None = time.monotonic()
        self._closed = False

    def publish(self, msg: bytes) -> None:
        """Queue one chunk (whole messages) for the consumer; never blocks."""
        if self._queue is not None:
            self._queue.put_nowait(msg)
        else:
            self._backlog.append(msg)

    @property
    def connected(self) -> bool:
        return self._queue is not None

    def close(self) -> None:
        """The server is stopping and nothing is left to send: the consumer's stream ends
        (after what is queued, with the close message), and so does any later one's."""
        self._closed = True
        if self._queue is not None:
            self._queue.put_nowait(_CLOSE)

    async def serve(self, request: HttpRequest, response: HttpResponse) -> None:
        """Stream messages to this consumer until it leaves or a newer one replaces it."""
        if self._queue is not None:
            self._queue.put_nowait(_CLOSE)
        queue: asyncio.Queue = asyncio.Queue()
        while self._backlog:
            queue.put_nowait(self._backlog.popleft())
        self._queue = queue
        self.orphaned_since = None
        if self._closed:
            queue.put_nowait(_CLOSE)
        gone = asyncio.Event()
        request.disconnected.subscribe(gone.set)
        request.disconnected.subscribe(lambda: queue.put_nowait(_CLOSE))
        try:
            await response.start_stream(200, "text/event-stream")
            while not gone.is_set():
                try:
                    msg = await asyncio.wait_for(queue.get(), self.heartbeat_s)
                except TimeoutError:
                    msg = HEARTBEAT
                if msg is _CLOSE:
                    if not gone.is_set():
                        await response.write(close_message())
                        await response.end()
                    return
                try:
                    await response.write(msg)
                except ClientDisconnected:
                    self._backlog.appendleft(msg)
                    return
        finally:
            if self._queue is queue:
                self._queue = None
                self.orphaned_since = time.monotonic()
                while not queue.empty():  # keep what this consumer did not get
                    m = queue.get_nowait()
                    if m is not _CLOSE:
                        self._backlog.append(m)
