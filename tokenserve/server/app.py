"""Wire every API family onto one router and serve it on its planes
(spec/interfaces.md §0.1, §3.1, §3.6).

:func:`build_router` registers each family's routes on one :class:`Router`::

    MindIE native  POST /infer, /infer_token (§2.1); /v1/tokenizer, stopInfer (§2.2-2.3)
    TGI            POST /generate_stream, POST /, GET /info (§3)
    vLLM           POST /generate with a ``prompt`` (§4.1)
    OpenAI         /v1/chat/completions, /v1/completions, /v1/models[/{model}] (§5)
    Triton         /v2/models/{model}/infer|generate|generate_stream, /v2 health and
                   metadata (§6)
    shared         POST /generate dispatch (§3.1), GET /health (§3.6),
                   GET /metrics, /metrics-json (§7.6-7.7)
    management     GET /health/timed[-N], /v1/config (§7.1, §7.3)

``POST /generate`` belongs to two families: :func:`make_generate_dispatcher` parses the
body once and hands it to vLLM when ``prompt`` is non-null, else to TGI when ``inputs`` is,
else answers 422 with :data:`GENERATE_ROUTING_ERROR`. The families get the engine and
the server's :class:`ServeContext` (stopInfer registry, metrics).

:func:`serve` splits the routes over the listening planes (business, management, metrics;
spec §0.1, :mod:`tokenserve.transport.planes`), one :class:`HttpServer` per distinct address
(sockets bound by :mod:`tokenserve.transport.listeners`, with TLS where configured), until
cancelled or ``stop`` is set, then drains (:mod:`tokenserve.transport.drain`). :func:`run` runs
a coroutine on uvloop when it is installed (call it from the CLI: the engine's actors must
be created inside the loop that serves them); :func:`serve_engine` / :func:`run_server`
bind the listeners, then build the engine from a ``ServeConfig`` and serve it until
SIGTERM or SIGINT (``tokenserve serve``)::

    bind every listener (a port in use / bad TLS file: ValueError, nothing loaded yet)
    load the model, start the engine
    serve ... signal 1: drain (up to drain_timeout_s) ... signal 2: close now
    stop the engine; return (exit status 0)
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from tokenserve.api import management
from tokenserve.api.common import (
    DEFAULT_MAX_JSON_DEPTH,
    EngineClient,
    check_json_content_type,
    parse_json_object,
)
from tokenserve.api.mindie.handlers import MindIEApi
from tokenserve.api.mindie.extra import MindIEExtraApi
from tokenserve.api.openai.handlers import OpenAIApi
from tokenserve.api.tgi.handlers import TgiApi
from tokenserve.api.triton.handlers import TritonApi
from tokenserve.api.vllm.handlers import VllmApi
from tokenserve.api.context import ServeContext
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.drain import drain
from tokenserve.transport.errors import HttpError
from tokenserve.transport.limits import HttpLimits
from tokenserve.transport.listeners import BoundListener, bind_listeners, close_listeners
from tokenserve.api.management import ServedConfig
from tokenserve.server.metrics import ServerMetrics
from tokenserve.transport.planes import Plane, plane_handler, plane_layout
from tokenserve.transport.router import Handler, Router
from tokenserve.transport.server import DEFAULT_KEEP_ALIVE_S, DEFAULT_MAX_BODY_BYTES, HttpServer

if TYPE_CHECKING:
    from tokenserve.mindie_config import ServeConfig
    from tokenserve.pd.node import PdNode

logger = logging.getLogger(__name__)
T = TypeVar("T")


def make_health_handler(engine: EngineClient) -> Handler:
    """``GET /health`` (spec §3.6): 200 with an empty body when the engine is healthy,
    otherwise 503 with an empty body."""

    async def health(request: HttpRequest, response: HttpResponse) -> None:
        try:
            healthy = bool(engine.is_healthy())
        except Exception:
            logger.exception("engine health check failed")
            healthy = False
        await response.send(200 if healthy else 503, b"", "application/json")

    return health


#: spec §3.1: the ``error`` of a ``/generate`` body with neither ``prompt`` nor ``inputs``
#: is itself a JSON document.
GENERATE_ROUTING_ERROR = orjson.dumps(
    {
        "Error": "`inputs` or `prompt` must be necessary and data type must be string. "
        "Additionally, the request body must be valid json",
        "error_type": "validation",
    }
).decode()


def make_generate_dispatcher(
    vllm: VllmApi, tgi: TgiApi, *, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
) -> Handler:
    """``POST /generate`` (spec §3.1): the body is parsed once here; a non-null ``prompt``
    goes to the vLLM family (it wins over ``inputs``), else a non-null ``inputs`` to TGI,
    else 422 with the nested-JSON message. An unparseable body is 422 as everywhere
    (spec §0.4 step 3)."""

    async def generate(request: HttpRequest, response: HttpResponse) -> None:
        try:
            check_json_content_type(request.headers)
            obj = parse_json_object(request.body, max_json_depth)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        if obj.get("prompt") is not None:
            await vllm.generate(request, response, body=obj)
        elif obj.get("inputs") is not None:
            await tgi.generate(request, response, body=obj)
        else:
            raise HttpError(422, GENERATE_ROUTING_ERROR)

    return generate


def build_router(
    engine: EngineClient,
    *,
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
    context: ServeContext | None = None,
    served_config: ServedConfig | None = None,
    pd: PdNode | None = None,
) -> Handler:
    """A router with every family's routes, the shared ``POST /generate`` (spec §3.1),
    ``GET /health`` (spec §3.6; [I] also on the business port, spec §0.1), the native
    extras (``/v1/tokenizer``, ``stopInfer``, spec §2.2-2.3) and ``GET /metrics`` /
    ``/metrics-json`` (spec §7.6-7.7), ``/health/timed[-N]`` and ``/v1/config`` (spec §7.1,
    §7.3; ``served_config`` is what the latter reports) — every plane's routes; ``serve``
    splits them.

    ``context`` (default: a new one with fresh metrics) is the server's shared state; every
    family gets it, so every ``EngineStream`` registers its request for stopInfer and
    records metrics.

    ``pd`` (default: a mixed-mode node) is the instance's PD identity
    (spec/pd_disaggregation.md): ``/v1/status``, ``/v2/status``, ``/v1/role/*`` and
    ``/v2/role/*`` always; with ``inferMode: dmi``, inference requests go through the
    prefill side (:func:`tokenserve.pd.prefill.serve_prefill`) and ``/dresult`` /
    ``/v1/pd/decode`` / ``/v1/pd/release`` serve the hand-off. Returns the handler of
    every route (the router, wrapped for PD).
    """
    from tokenserve.pd.decode import DecodeServer
    from tokenserve.pd.node import PdConfig, PdNode
    from tokenserve.pd.prefill import is_inference, make_release_handler, serve_prefill

    if context is None:
        context = ServeContext(metrics=ServerMetrics(engine))
    router = Router()
    kw = {"max_json_depth": max_json_depth, "context": context}
    tgi = TgiApi(engine, **kw)
    vllm = VllmApi(engine, **kw)
    for api in (MindIEApi(engine, **kw), tgi, vllm, OpenAIApi(engine, **kw),
                TritonApi(engine, **kw)):
        api.register(router)
    router.post("/generate", make_generate_dispatcher(vllm, tgi, max_json_depth=max_json_depth))
    router.get("/health", make_health_handler(engine))
    management.register(router, engine, served_config)
    MindIEExtraApi(engine, **kw).register(router)
    if context.metrics is not None:
        context.metrics.register(router)
    node = pd if pd is not None else PdNode(PdConfig(), engine)
    node.register(router)
    decode = DecodeServer(node, router)
    decode.register(router)
    router.get("/dresult", decode.dresult)
    router.post("/v1/pd/release", make_release_handler(node))
    if node.cfg.pd:
        engine.set_kv_puller(decode.pull)
    if not node.cfg.pd:
        return router

    async def handle(request: HttpRequest, response: HttpResponse) -> None:
        if not is_inference(request):
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
            server = HttpServer(plane_handler(router, spec.planes),
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
        await asyncio.shield(drain(servers, context.registry, shutdown_timeout_s, now))


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a uvloop event loop when uvloop is installed,
    else on the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    loop = uvloop.new_event_loop()  # pragma: no cover - Python 3.10
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()


class _Signals:
    """SIGTERM and SIGINT on the running loop (systemd, Docker and Kubernetes send
    SIGTERM; a terminal SIGINT): the first sets ``stop`` (drain), the second ``now``
    (close at once). A second signal before the model has loaded exits at once."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.now = asyncio.Event()
        self.serving = False
        self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        name = signal.Signals(sig).name
        if not self.stop.is_set():
            logger.warning("%s received: stopping%s", name,
                           "" if self.serving else " once the model has loaded "
                           "(signal again to stop now)")
            self.stop.set()
        elif not self.serving:
            logger.warning("%s received again: stopping now", name)
            os._exit(0)  # the model load runs in a thread that cannot be interrupted
        else:
            logger.warning("%s received again: stopping now", name)
            self.now.set()

    def close(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.remove_signal_handler(sig)


async def serve_engine(cfg: ServeConfig, build: Callable[[], Any] | None = None) -> None:
    """Bind ``cfg.server``'s listeners (errors before anything loads), build the engine
    from ``cfg.engine`` (model load in a worker thread), start its actors and serve it
    until SIGTERM / SIGINT (see :class:`_Signals` and :func:`serve`); the engine is
    stopped on the way out. ``build`` (tests: a scripted engine with ``start`` and
    ``stop``) replaces ``AsyncEngine.build(cfg.engine)``.

    Raises:
        ValueError: a listener cannot be bound or its TLS material is bad (nothing has
            been loaded then), or the model cannot be loaded.
    """
    srv = cfg.server
    layout = plane_layout(srv.host, srv.port, srv.management_host, srv.management_port,
                          srv.metrics_port)
    tls = {Plane.BUSINESS: srv.business_tls, Plane.MANAGEMENT: srv.management_tls,
           Plane.METRICS: srv.metrics_tls}
    bound = bind_listeners(layout, tls, srv.max_connections)
    from tokenserve.config import select_device  # torch: after the cheap checks
    from tokenserve.engine.engine import AsyncEngine

    signals = _Signals()
    try:
        try:
            engine = await asyncio.to_thread(
                build or functools.partial(AsyncEngine.build, cfg.engine))
        except BaseException:
            close_listeners(bound)
            raise
        await engine.start()
        # The model load leaves ~170k long-lived objects (tensors, GGUF metadata): move
        # them out of the collector's reach, or a full collection walks them all (80 ms
        # on the default model: one step's ITL spike) and the young ones cost ~1-3 % of
        # a batch-1 decode step (perf: gc_collect_main).
        gc.freeze()
        e = cfg.engine
        served = ServedConfig.build(
            engine.info.model_name, engine.info.max_model_len, e.kv_cache_bytes,
            select_device(e.device).type != "cpu", e.max_iter_times, e.block_size)
        from tokenserve.pd.node import PdNode

        node = PdNode(cfg.pd, engine)
        if cfg.pd.pd:
            await asyncio.to_thread(node.start_kv)
            logger.info("PD: inferMode dmi, role %s, address %s, KV transfer %s",
                        node.role or "none (waiting for POST /v1/role)", cfg.pd.ip_address,
                        cfg.pd.kv_protocol)
        signals.serving = True
        try:
            await serve(
                engine,
                max_json_depth=srv.max_json_depth,
                limits=HttpLimits(max_body_bytes=srv.max_body_bytes),
                stop=signals.stop,
                now=signals.now,
                shutdown_timeout_s=srv.drain_timeout_s,
                bound=bound,
                served_config=served,
                pd=node,
            )
        finally:
            await node.aclose()
            await engine.stop()
    finally:
        signals.close()


def run_server(cfg: ServeConfig) -> None:
    """Blocking entry point for ``tokenserve serve`` (uvloop when installed); returns
    after a graceful stop."""
    run(serve_engine(cfg))
