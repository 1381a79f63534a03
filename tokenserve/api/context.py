"""What one server's API families share: the registry of live requests (for
``stopInfer``, spec/interfaces.md §2.3) and the metrics (spec §7.6, §7.7).

``build_router`` makes one :class:`ServeContext` per server and hands it to every family
next to the engine; each :class:`~tokenserve.api.engine_stream.EngineStream` takes it,
so every family registers its requests and records metrics in one place without any
module-global state::

    build_router(engine) -> ServeContext(registry, metrics)
        families get (engine, context=ctx)
            EngineStream(engine, ..., context=ctx)  ->  registry.add / metrics.request_started
                                      ...  registry.remove / tracker.finished
    POST /v2/models/{m}/stopInfer {"id": ...}  ->  registry.find(id) -> stream.stop()
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from tokenserve.messages import GenerateRequest, RequestOutput
from tokenserve.transport.drain import RequestRegistry


class RequestMetrics(Protocol):
    """What one engine request reports to the server's metrics
    (``tokenserve.server.metrics.SequenceTracker``)."""

    def sibling(self, request: GenerateRequest) -> RequestMetrics:
        """Another engine request of the same client request (counted with it, once)."""
        ...

    def output(self, out: RequestOutput) -> None: ...

    def finished(self, last: RequestOutput | None, handed_off: bool = False,
                 disconnected: bool = False) -> None: ...


class Metrics(Protocol):
    """The server's metrics as the families see them
    (``tokenserve.server.metrics.ServerMetrics``, spec §7.6-§7.7)."""

    def request_started(self, request: GenerateRequest) -> RequestMetrics: ...


@dataclass
class ServeContext:
    """One server's shared state (no globals: a process may run several servers).

    Attributes:
        registry: live requests, for ``stopInfer``.
        metrics: Prometheus metrics of this server, or None to record nothing.
        drain_hooks: coroutines run beside the server's drain (a PD decode instance ends
            its ``/dresult`` stream once its requests are done).
    """

    registry: RequestRegistry = field(default_factory=RequestRegistry)
    metrics: Metrics | None = None
    drain_hooks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
