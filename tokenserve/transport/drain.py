"""Graceful stop of every listener of one server ([I]; SIGTERM = SIGINT, as systemd,
Docker and Kubernetes expect; uvicorn's ``--timeout-graceful-shutdown``)::

    signal 1 --> stop accepting; idle connections close;
                 log "draining N requests (up to S s; signal again to stop now)"
        requests still running keep streaming, each connection closes after its response
    S seconds later, requests still running are ended with an error: each live engine
        request is stopped with DRAIN_EXPIRED_MESSAGE, which its family answers as an engine
        failure (spec §0.4 step 9: a stream gets the text as its last chunk and a proper
        end of the chunked body; a non-stream request a 500 error in its family's shape)
    signal 2 (any time) --> every connection is closed now

:func:`drain` returns when nothing is left; the caller then stops the engine and exits 0.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

from tokenserve.transport.server import HttpServer

logger = logging.getLogger(__name__)

#: seconds the families get to write their error answer once the drain time has ended.
EXPIRY_GRACE_S = 2.0
#: seconds handlers get to notice a forced close.
FORCED_GRACE_S = 1.0


class Stoppable(Protocol):
    """A live request as the registry sees it (``EngineStream`` implements it)."""

    @property
    def request_id(self) -> str: ...

    async def stop(self, error: str | None = None) -> bool: ...


class RequestRegistry:
    """Live requests by every id a client may use to stop them (spec §2.3): the
    server request id (the engine's ``request_id``) and any client-supplied id (the
    Triton ``id``). Several live requests may share a client id; ``find`` returns all.

    Synchronous and only touched from the event loop thread.
    """

    def __init__(self) -> None:
        self._by_id: dict[str, list[Stoppable]] = {}

    def add(self, stream: Stoppable, ids: Iterable[str]) -> None:
        """Register ``stream`` under each of ``ids`` (duplicates and empty ids skipped)."""
        for rid in dict.fromkeys(ids):
            if rid:
                self._by_id.setdefault(rid, []).append(stream)

    def remove(self, stream: Stoppable, ids: Iterable[str]) -> None:
        """Undo :meth:`add` for ``stream`` (ids it is not registered under are ignored)."""
        for rid in dict.fromkeys(ids):
            streams = self._by_id.get(rid)
            if not streams:
                continue
            try:
                streams.remove(stream)
            except ValueError:
                continue
            if not streams:
                del self._by_id[rid]

    def find(self, rid: str) -> list[Stoppable]:
        """The live requests registered under ``rid`` (empty when none)."""
        return list(self._by_id.get(rid, ()))

    def live(self) -> list[Stoppable]:
        """Every distinct live request (the server's drain ends them all)."""
        return list({id(s): s for streams in self._by_id.values() for s in streams}.values())

    def __contains__(self, rid: object) -> bool:
        return rid in self._by_id

    def __len__(self) -> int:
        """Number of distinct live requests."""
        return len({id(s) for streams in self._by_id.values() for s in streams})


def drain_expired_message(timeout_s: float) -> str:
    """The error a request still running at the end of the drain is ended with."""
    return f"The server is shutting down: the drain time of {timeout_s:g} s ended."


async def _wait(tasks: Iterable[asyncio.Task[None]], timeout_s: float,
                now: asyncio.Event | None) -> None:
    """Until every task is done, ``timeout_s`` seconds pass or ``now`` is set."""
    pending: set[asyncio.Future[object]] = set(tasks)
    if not pending or (now is not None and now.is_set()):
        return
    loop = asyncio.get_running_loop()
    waiter = loop.create_task(now.wait()) if now is not None else None
    deadline = loop.time() + timeout_s
    try:
        while pending and (waiter is None or not waiter.done()):
            left = deadline - loop.time()
            if left <= 0:
                return
            watch = pending | ({waiter} if waiter is not None else set())
            done, _ = await asyncio.wait(watch, timeout=left,
                                         return_when=asyncio.FIRST_COMPLETED)
            pending -= done
    finally:
        if waiter is not None:
            waiter.cancel()


def _running(servers: Sequence[HttpServer]) -> list[asyncio.Task[None]]:
    return [t for s in servers for t in s.active_tasks()]


async def drain(
    servers: Sequence[HttpServer],
    registry: RequestRegistry | None,
    timeout_s: float,
    now: asyncio.Event | None = None,
) -> None:
    """Stop ``servers`` gracefully (module docstring); ``now`` set (a second signal)
    closes every connection at once.

    Args:
        servers: the listeners of one server.
        registry: its live engine requests (ended with an error when time runs out).
        timeout_s: the drain time, seconds.
        now: set to stop at once.
    """
    for server in servers:
        server.stop_accepting()
    running = _running(servers)
    logger.warning("draining %d requests (up to %g s; signal again to stop now)",
                   len(running), timeout_s)
    await _wait(running, timeout_s, now)
    running = _running(servers)
    if running and not (now is not None and now.is_set()):
        message = drain_expired_message(timeout_s)
        live = registry.live() if registry is not None else []
        logger.warning("drain time ended: ending %d requests with an error", len(live))
        for stream in live:
            try:
                await stream.stop(error=message)
            except Exception:
                logger.exception("ending %s failed", stream.request_id)
        await _wait(running, EXPIRY_GRACE_S, now)
    if now is not None and now.is_set():
        logger.warning("stopping now: closing %d connections",
                       sum(s.num_connections for s in servers))
    for server in servers:
        server.force_close()
    running = _running(servers)
    if running:
        await asyncio.wait(running, timeout=FORCED_GRACE_S)
    for server in servers:
        await server.wait_closed()
