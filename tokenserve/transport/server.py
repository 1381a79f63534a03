"""The listening server: binds (or adopts) listening sockets and makes one
:class:`~tokenserve.transport.connection.HttpProtocol` per accepted connection; tracks the
open connections for the connection cap, the graceful stop and the drain.

The connection itself (h11, keep-alive, pipelining, limits) is
:mod:`tokenserve.transport.connection`; the request/response cycle :mod:`tokenserve.transport.cycle`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tokenserve.transport.connection import Handler, HttpProtocol
from tokenserve.transport.cycle import (  # re-exported: their import path before cycle.py
    ClientDisconnected,
    HttpRequest,
    HttpResponse,
)
from tokenserve.transport.limits import (  # re-exported: their import path before limits.py
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    HttpLimits,
)

__all__ = [
    "DEFAULT_KEEP_ALIVE_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_HEADER_BYTES",
    "ClientDisconnected",
    "HttpLimits",
    "HttpProtocol",
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
]


class HttpServer:
    """Listens on one or more (host, port) pairs and serves ``handler`` on each.

    Args:
        handler: ``async def handler(request, response)``, usually a
            :class:`tokenserve.transport.router.Router`.
        max_body_bytes: body limit (spec §0.2; default 40 MiB).
        max_header_bytes: request line + headers limit (431 above it).
        keep_alive_s: idle keep-alive connections close after this many seconds.
        limits: every limit at once (:class:`HttpLimits`); overrides the three above.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        limits: HttpLimits | None = None,
    ) -> None:
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be > 0, got {max_body_bytes}")
        self._handler = handler
        self.limits = limits or HttpLimits(max_body_bytes, max_header_bytes, keep_alive_s)
        self._servers: list[asyncio.base_events.Server] = []
        self._connections: set[HttpProtocol] = set()

    def _make_protocol(self) -> HttpProtocol:
        return HttpProtocol(self._handler, self.limits, self._connections)

    async def start(
        self, host: str | None = None, port: int | None = None, **kwargs: Any
    ) -> asyncio.base_events.Server:
        """Start listening (``port=0`` picks a free port; see ``server.sockets``).
        Extra keyword arguments go to ``loop.create_server``: ``sock=`` (a socket bound
        beforehand, instead of host and port), ``ssl=`` (an ``ssl.SSLContext``), ..."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(self._make_protocol, host, port, **kwargs)
        self._servers.append(server)
        return server

    @property
    def ports(self) -> list[int]:
        """The bound ports of every listener (for ``port=0``)."""
        return [s.getsockname()[1] for srv in self._servers for s in (srv.sockets or ())]

    @property
    def num_connections(self) -> int:
        """Open client connections."""
        return len(self._connections)

    def active_tasks(self) -> list[asyncio.Task[None]]:
        """The request handlers running now (one per busy connection)."""
        return [p.task for p in self._connections if p.task is not None]

    def stop_accepting(self) -> None:
        """Close the listening sockets; idle connections close now, busy ones after
        their response (which then carries ``Connection: close``)."""
        for server in self._servers:
            server.close()
        for proto in list(self._connections):
            proto.shutdown()

    def force_close(self) -> None:
        """Close every connection now; running handlers see a disconnect."""
        for proto in list(self._connections):
            proto.force_close()

    async def wait_closed(self) -> None:
        """Wait for the listening sockets to close (after :meth:`stop_accepting`)."""
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()

    async def close(self, timeout: float = 10.0) -> None:
        """Graceful shutdown: stop accepting, let in-flight requests finish for up to
        ``timeout`` seconds, then close what is left (handlers see a disconnect)."""
        self.stop_accepting()
        tasks = self.active_tasks()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        self.force_close()
        tasks = self.active_tasks()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        await self.wait_closed()
