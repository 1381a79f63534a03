"""Bind every plane's listening socket before the model loads (spec/interfaces.md §0.1).

``tokenserve serve`` binds first, so a port already in use (or a bad TLS file) is a
one-line start-up error in a second, not a traceback after a minute of loading weights
and a gigabyte of KV cache. The sockets are handed to ``loop.create_server(sock=...)``.

Per listener: its planes (:func:`tokenserve.transport.planes.plane_layout`), its TLS context
(:class:`tokenserve.config.tree.TlsSettings`; a shared listener uses the material of its first plane in
business, management, metrics order, as MindIE uses the management and metrics keys only
for separate listeners), and its connection cap (spec §0.2: ``maxLinkNum`` on the business
listener, ``max(maxLinkNum / 10, 100)`` on management and metrics listeners).
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

from tokenserve.config.tree import ALL_INTERFACES, TlsSettings
from tokenserve.transport.planes import ListenerSpec, Plane

logger = logging.getLogger(__name__)

_ORDER = (Plane.BUSINESS, Plane.MANAGEMENT, Plane.METRICS)


@dataclass(frozen=True)
class BoundListener:
    """A bound, listening socket and how to serve it."""

    spec: ListenerSpec
    sock: socket.socket
    ssl: ssl.SSLContext | None
    tls: TlsSettings | None
    max_connections: int | None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl is not None else "http"


def connection_cap(planes: frozenset[Plane], max_connections: int | None) -> int | None:
    """spec §0.2: the business listener takes ``maxLinkNum`` connections, a management
    or metrics listener ``max(maxLinkNum // 10, 100)``."""
    if max_connections is None or Plane.BUSINESS in planes:
        return max_connections
    return max(max_connections // 10, 100)


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) (SO_REUSEADDR, as asyncio sets it).

    Raises:
        ValueError: the address is in use, not local, or not an address.
    """
    try:
        info = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                  flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, addr = info[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        why = "the port is already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise ValueError(f"cannot listen on {host}:{port}: {why}") from None
    sock.setblocking(False)
    return sock


def bind_listeners(
    layout: list[ListenerSpec],
    tls: Mapping[Plane, TlsSettings | None] | None = None,
    max_connections: int | None = None,
) -> list[BoundListener]:
    """Build each listener's TLS context, then bind every socket (all or none).

    Raises:
        ValueError: a TLS file is missing or bad, or an address cannot be bound (the
            message names it).
    """
    tls = tls or {}
    chosen: list[TlsSettings | None] = []
    contexts: list[ssl.SSLContext | None] = []
    for spec in layout:
        plane = next(p for p in _ORDER if p in spec.planes)
        settings = tls.get(plane)
        chosen.append(settings)
        contexts.append(settings.context() if settings is not None else None)
    out: list[BoundListener] = []
    try:
        for spec, settings, ctx in zip(layout, chosen, contexts):
            out.append(BoundListener(spec, _bind(spec.host, spec.port), ctx, settings,
                                     connection_cap(spec.planes, max_connections)))
    except BaseException:
        for b in out:
            b.sock.close()
        raise
    for b in out:
        if b.spec.host in ALL_INTERFACES:
            logger.warning("listening on every interface (%s:%d, %s): the %s plane(s) are "
                           "exposed to the network", b.spec.host, b.sock.getsockname()[1],
                           b.scheme, "+".join(p.value for p in _ORDER if p in b.spec.planes))
    return out


def close_listeners(bound: list[BoundListener]) -> None:
    """Close sockets that were bound but never served."""
    for b in bound:
        b.sock.close()
