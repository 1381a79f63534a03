"""The server's application: every served row of the route table bound to its handler,
served on its planes (spec/interfaces.md §0.1).

:func:`build_router` binds each row of :data:`tokenserve.api.routes.SERVED` to the object
that owns its handler (the five families, :class:`~tokenserve.api.server_api.ServerApi` for
``/health`` and the shared ``/generate``, management, metrics, the PD node and decode
server); a PD prefill instance wraps the router so inference rows go through the prefill
gate. :func:`serve` splits the routes over the listening planes (business, management,
metrics; spec §0.1, :mod:`tokenserve.transport.planes`), one :class:`HttpServer` per
distinct address (sockets bound by :mod:`tokenserve.transport.listeners`, with TLS where
configured), until cancelled or ``stop`` is set, then drains
(:mod:`tokenserve.transport.drain`). ``tokenserve serve`` itself is
:mod:`tokenserve.server.main`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tokenserve.api import routes
from tokenserve.api.context import ServeContext
from tokenserve.api.family_api import DEFAULT_MAX_JSON_DEPTH, EngineClient
from tokenserve.api.management import ManagementApi, ServedConfig
from tokenserve.api.mindie.handlers import MindIEApi
from tokenserve.api.mindie.tokenizer_stop import MindIEExtraApi
from tokenserve.api.openai.handlers import OpenAIApi
from tokenserve.api.server_api import ServerApi
from tokenserve.api.tgi.handlers import TgiApi
from tokenserve.api.triton.handlers import TritonApi
from tokenserve.api.vllm.handlers import VllmApi
from tokenserve.server.metrics import ServerMetrics
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.drain import drain
from tokenserve.transport.limits import HttpLimits
from tokenserve.transport.listeners import BoundListener, bind_listeners, close_listeners
from tokenserve.transport.planes import Plane, plane_handler, plane_layout
from tokenserve.transport.router import Handler, Router
from tokenserve.transport.server import DEFAULT_KEEP_ALIVE_S, DEFAULT_MAX_BODY_BYTES, HttpServer

if TYPE_CHECKING:
    from tokenserve.pd.node import PdNode

logger = logging.getLogger(__name__)


def build_router(
    engine: EngineClient,
    *,
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
    context: ServeContext | None = None,
    served_config: ServedConfig | None = None,
    pd: PdNode | None = None,
) -> Handler:
    """A router serving every row of :data:`tokenserve.api.routes.SERVED` — every plane's
    routes; :func:`serve` splits them. Each row's ``handler`` (``owner.attribute``) is
    bound to one of the owners below; an owner with a ``wrap`` method (OpenAI: its error
    shape) wraps its handlers.

    ``context`` (default: a new one with fresh metrics) is the server's shared state; every
    family gets it, so every ``EngineStream`` registers its request for stopInfer and
    records metrics (without metrics, ``/metrics`` and ``/metrics-json`` are 404).
    ``served_config`` is what ``GET /v1/config`` reports.

    ``pd`` (default: a mixed-mode node) is the instance's PD identity
    (spec/pd_disaggregation.md): its status and role routes always; with ``inferMode:
    dmi``, inference requests go through the prefill side
    (:func:`tokenserve.pd.prefill.serve_prefill`) and ``/dresult`` / ``/v1/pd/decode`` /
    ``/v1/pd/release`` serve the hand-off. Returns the handler of every route (the
    router, wrapped for PD).
    """
    from tokenserve.pd.decode import DecodeServer
    from tokenserve.pd.node import PdConfig, PdNode
    from tokenserve.pd.prefill import serve_prefill

    if context is None:
        context = ServeContext(metrics=ServerMetrics(engine))
    router = Router()
    kw = {"max_json_depth": max_json_depth, "context": context}
    tgi = TgiApi(engine, **kw)
    vllm = VllmApi(engine, **kw)
    node = pd if pd is not None else PdNode(PdConfig(), engine)
    decode = DecodeServer(node, router)
    owners: dict[str, Any] = {
        "mindie": MindIEApi(engine, **kw), "mindie_extra": MindIEExtraApi(engine, **kw),
        "tgi": tgi, "vllm": vllm, "openai": OpenAIApi(engine, **kw),
        "triton": TritonApi(engine, **kw),
        "server": ServerApi(engine, vllm, tgi, max_json_depth=max_json_depth),
        "management": ManagementApi(engine, served_config), "metrics": context.metrics,
        "pd": node, "pd_decode": decode,
    }
    for route in routes.SERVED:
        assert route.handler is not None
        name, attr = route.handler.split(".")
        owner = owners[name]
        if owner is None:
            continue
        handler = getattr(owner, attr)
        wrap = getattr(owner, "wrap", None)
        router.add(route.method, route.path, wrap(handler) if wrap is not None else handler)
    if node.cfg.pd:
        engine.set_kv_puller(decode.pull)
        context.drain_hooks.append(decode.drain)
    if not node.cfg.pd:
        return router

    async def handle(request: HttpRequest, response: HttpResponse) -> None:
        if routes.inference_route(request.method, request.path) is None:
            await router(request, response)
            return
        handler, params = router.resolve(request.method, request.path)
        if params:
            request.path_params = params
        await serve_prefill(node, handler, request, response)

    return handle


async def serve(
    engine: EngineClient,
    host: str = "127.0.0.1",
    port: int = 1025,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    stop: asyncio.Event | None = None,
    now: asyncio.Event | None = None,
    started: asyncio.Future[HttpServer] | None = None,
    shutdown_timeout_s: float = 10.0,
    management_host: str | None = None,
    management_port: int | None = None,
    metrics_port: int | None = None,
    listeners: asyncio.Future[dict[Plane, HttpServer]] | None = None,
    bound: list[BoundListener] | None = None,
    limits: HttpLimits | None = None,
    served_config: ServedConfig | None = None,
    pd: PdNode | None = None,
) -> None:
    """Serve ``engine`` until cancelled or ``stop`` is set, then drain
    (:func:`tokenserve.transport.drain.drain`: in-flight requests get ``shutdown_timeout_s``
    seconds to finish, then end with an error; ``now`` set stops at once).

    Planes (spec §0.1): business on ``host:port``; management on
    ``management_host:management_port``; metrics (``/metrics``) on
    ``management_host:metrics_port``. Not given, a plane shares the listener of the one
    it falls back to (management -> business, metrics -> management), so by default one
    port serves every route; planes at the same address share one listener. ``bound``
    (from :func:`tokenserve.transport.listeners.bind_listeners`, TLS included) replaces the
    addresses. ``limits`` (default: ``max_body_bytes``, ``keep_alive_s``) applies to
    every listener, each with its own connection cap; whole responses carry
    ``Connection: close`` (spec §0.2).

    ``started`` (optional) receives the business plane's :class:`HttpServer` (with
    ``port=0``: read ``server.ports``); ``listeners`` receives every plane's server.
    """
    from tokenserve.pd.node import PdConfig, PdNode

    context = ServeContext(metrics=ServerMetrics(engine))
    pd = pd if pd is not None else PdNode(PdConfig(), engine)
    router = build_router(engine, max_json_depth=max_json_depth, context=context,
                          served_config=served_config, pd=pd)
    base = limits or HttpLimits(max_body_bytes=max_body_bytes, keep_alive_s=keep_alive_s)
    base = replace(base, close_whole_responses=True)
    if bound is None:
        bound = bind_listeners(plane_layout(host, port, management_host, management_port,
                                            metrics_port), max_connections=base.max_connections)
    by_plane: dict[Plane, HttpServer] = {}
    servers: list[HttpServer] = []
    try:
        for b in bound:
            spec = b.spec
            server = HttpServer(plane_handler(router, spec.planes, routes.plane_of),
                                limits=replace(base, max_connections=b.max_connections))
            await server.start(sock=b.sock, ssl=b.ssl)
            servers.append(server)
            by_plane.update(dict.fromkeys(spec.planes, server))
            mtls = " (mutual TLS)" if b.tls is not None and b.tls.mutual else ""
            logger.info(
                "serving %s (%s) on %s%s",
                engine.info.model_name,
                "+".join(sorted(p.value for p in spec.planes)),
                ", ".join(f"{b.scheme}://{spec.host}:{p}" for p in server.ports), mtls,
            )
            if Plane.MANAGEMENT in spec.planes and context.metrics is not None:
                context.metrics.instance = f"{spec.host}:{server.ports[0]}"
            if Plane.MANAGEMENT in spec.planes and pd is not None:
                pd.inter_comm_port = server.ports[0]  # P <-> D routes live there
        if started is not None and not started.done():
            started.set_result(by_plane[Plane.BUSINESS])
        if listeners is not None and not listeners.done():
            listeners.set_result(by_plane)
        if stop is None:
            await asyncio.Event().wait()  # until cancelled
        else:
            await stop.wait()
    finally:
        close_listeners(bound[len(servers):])  # bound but never served (a start failed)
        hooks = [asyncio.ensure_future(hook()) for hook in context.drain_hooks]
        try:
            await asyncio.shield(drain(servers, context.registry, shutdown_timeout_s, now))
        finally:
            for hook in hooks:
                hook.cancel()


