"""Wire the API families onto a router and serve it (spec/interfaces.md §0.1, §2.1, §3.6).

``build_router(engine)`` registers the MindIE native routes and ``GET /health``;
``serve(engine, host, port)`` runs an :class:`HttpServer` until cancelled or ``stop`` is
set; ``run(coro)`` runs a coroutine on uvloop when it is installed (call it from the CLI:
the engine's actors must be created inside the loop that serves them).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from tokenserve.http.api.common import DEFAULT_MAX_JSON_DEPTH, EngineClient
from tokenserve.http.api.mindie import MindIEApi
from tokenserve.http.router import Handler, Router
from tokenserve.http.server import (
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_BODY_BYTES,
    HttpRequest,
    HttpResponse,
    HttpServer,
)

if TYPE_CHECKING:
    from tokenserve.config import EngineConfig

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


def build_router(engine: EngineClient, *, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH) -> Router:
    """A router with ``POST /infer``, ``POST /infer_token`` (spec §2.1) and
    ``GET /health`` (spec §3.6; [I] also on the business port, spec §0.1)."""
    router = Router()
    MindIEApi(engine, max_json_depth=max_json_depth).register(router)
    router.get("/health", make_health_handler(engine))
    return router


async def serve(
    engine: EngineClient,
    host: str = "127.0.0.1",
    port: int = 1025,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    stop: asyncio.Event | None = None,
    started: asyncio.Future[HttpServer] | None = None,
    shutdown_timeout_s: float = 10.0,
) -> None:
    """Serve ``engine`` on ``host:port`` until cancelled or ``stop`` is set, then close
    gracefully (in-flight requests get ``shutdown_timeout_s`` to finish).

    ``started`` (optional) receives the running :class:`HttpServer` (useful with
    ``port=0``: read ``server.ports``).
    """
    server = HttpServer(
        build_router(engine, max_json_depth=max_json_depth),
        max_body_bytes=max_body_bytes,
        keep_alive_s=keep_alive_s,
    )
    await server.start(host, port)
    logger.info(
        "serving %s on %s", engine.model_name, ", ".join(f"{host}:{p}" for p in server.ports)
    )
    if started is not None and not started.done():
        started.set_result(server)
    try:
        if stop is None:
            await asyncio.Event().wait()  # until cancelled
        else:
            await stop.wait()
    finally:
        await asyncio.shield(server.close(shutdown_timeout_s))


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


async def serve_engine(cfg: "EngineConfig", host: str, port: int) -> None:
    """Build the engine from ``cfg`` (model load in a worker thread), start its actors
    and serve it until cancelled; the engine is stopped on the way out."""
    from tokenserve.engine.engine import AsyncEngine

    engine = await asyncio.to_thread(AsyncEngine.build, cfg)
    await engine.start()
    try:
        await serve(engine, host, port)
    finally:
        await engine.stop()


def run_server(cfg: "EngineConfig", host: str = "127.0.0.1", port: int = 1025) -> None:
    """Blocking entry point for ``tokenserve serve`` (uvloop when installed)."""
    run(serve_engine(cfg, host, port))
