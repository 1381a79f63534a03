"""``tokenserve serve``: bind the listeners, load the model, serve until a signal, drain.

:func:`serve_engine` / :func:`run_server` bind the listeners, then build the engine from a
``ServeConfig`` and serve it until SIGTERM or SIGINT::

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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenserve.api.management import ServedConfig
from tokenserve.server.app import serve
from tokenserve.transport.limits import HttpLimits
from tokenserve.transport.listeners import bind_listeners, close_listeners
from tokenserve.transport.planes import Plane, plane_layout
from tokenserve.transport.runtime import Signals, run

if TYPE_CHECKING:
    from tokenserve.config.tree import ServeConfig

logger = logging.getLogger(__name__)


async def serve_engine(cfg: ServeConfig, build: Callable[[], Any] | None = None) -> None:
    """Bind ``cfg.server``'s listeners (errors before anything loads), build the engine
    from ``cfg.engine`` (model load in a worker thread), start its actors and serve it
    until SIGTERM / SIGINT (see :class:`Signals` and :func:`serve`); the engine is
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
    from tokenserve.config.resolve import select_device  # torch: after the cheap checks
    from tokenserve.engine.engine import AsyncEngine

    signals = Signals()
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
            select_device(e.device).type != "cpu", e.max_iter_times, e.block_size,
            e.parallel.tensor_parallel_size)
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


def run_server(cfg: ServeConfig) -> int:
    """Blocking entry point for ``tokenserve serve`` (uvloop when installed); returns
    the exit status after a graceful stop (0). A tensor-parallel node other than 0
    (``--node-rank R > 0``) serves no HTTP: it runs its ranks until rank 0 stops them
    (:func:`tokenserve.engine.tensor_parallel.run_node`, whose status it returns)."""
    if cfg.engine.parallel.node_rank > 0:
        from tokenserve.engine.tensor_parallel import run_node

        return run_node(cfg.engine)
    run(serve_engine(cfg))
    return 0
