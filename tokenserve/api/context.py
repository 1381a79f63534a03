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

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenserve.server.metrics import ServerMetrics


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


@dataclass
class ServeContext:
    """One server's shared state (no globals: a process may run several servers).

    Attributes:
        registry: live requests, for ``stopInfer``.
        metrics: Prometheus metrics of this server, or None to record nothing.
    """

    registry: RequestRegistry = field(default_factory=RequestRegistry)
    metrics: ServerMetrics | None = None
