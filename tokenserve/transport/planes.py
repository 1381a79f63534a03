"""Listening planes (spec/interfaces.md §0.1): which routes each listener answers.

MindIE serves three planes, each on its own ``ip:port`` unless two coincide, in which case
one listener carries the union of their routes::

    business    ipAddress:port                        inference, /v1/models, /v2 metadata,
                                                      /v1/tokenizer, stopInfer, /dresult
    management  managementIpAddress:managementPort    /health*, /info, /v2/health/*,
                                                      /v2/models/{m}/ready|getSlotCount,
                                                      /metrics-json, /stopService, ...
    metrics     managementIpAddress:metricsPort       /metrics

The route table (:mod:`tokenserve.api.routes`) gives each route its plane, and
:func:`plane_handler` makes a listener answer 404 for the
paths of planes it does not carry. [I] Defaults: a plane whose port is not given shares
the listener of the plane it falls back to (management -> business, metrics ->
management), so with no options everything is served on the business port.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError
from tokenserve.transport.router import Handler


class Plane(str, enum.Enum):
    """spec §0.1 planes."""

    BUSINESS = "business"
    MANAGEMENT = "management"
    METRICS = "metrics"


ALL_PLANES = frozenset(Plane)

def plane_handler(handler: Handler, planes: frozenset[Plane],
                  plane_of: Callable[[str], Plane]) -> Handler:
    """``handler`` restricted to the routes of ``planes`` (others: 404, as unknown);
    ``plane_of`` classifies a path (the route table's
    :func:`tokenserve.api.routes.plane_of`)."""
    if planes >= ALL_PLANES:
        return handler

    async def restricted(request: HttpRequest, response: HttpResponse) -> None:
        if plane_of(request.path) not in planes:
            raise HttpError(404, f"Route {request.path} not found.")
        await handler(request, response)

    return restricted


@dataclass(frozen=True)
class ListenerSpec:
    """One listener to start: its address and the planes it carries."""

    host: str
    port: int
    planes: frozenset[Plane]


def plane_layout(
    host: str,
    port: int,
    management_host: str | None = None,
    management_port: int | None = None,
    metrics_port: int | None = None,
) -> list[ListenerSpec]:
    """The listeners for a plane configuration (spec §0.1 four layouts; config.md
    ``ServerConfig``): ``management_host`` defaults to ``host`` (and carries metrics
    too), ``management_port`` to ``port``, ``metrics_port`` to ``management_port``.
    Planes with the same (host, port) share a listener; an explicit port 0 (ephemeral)
    is always a listener of its own. Business comes first.
    """
    mhost = management_host or host
    business = (host, port, "business")
    management = business if management_port is None and mhost == host else (
        mhost, port if management_port is None else management_port, "management")
    metrics = management if metrics_port is None else (mhost, metrics_port, "metrics")

    def key(addr: tuple[str, int, str]) -> tuple[str, int, str]:
        h, p, origin = addr
        return (h, p, origin if p == 0 else "")

    groups: dict[tuple[str, int, str], set[Plane]] = {}
    for plane, addr in ((Plane.BUSINESS, business), (Plane.MANAGEMENT, management),
                        (Plane.METRICS, metrics)):
        groups.setdefault(key(addr), set()).add(plane)
    return [ListenerSpec(h, p, frozenset(planes)) for (h, p, _), planes in groups.items()]
