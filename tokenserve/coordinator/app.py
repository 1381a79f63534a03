"""The PD coordinator: the client-facing entry point of a prefill/decode cluster (MindIE
Motor's ``ms_coordinator``, spec/pd_disaggregation.md §2-§4, §6, §7.3, §9.4, §10, §11).

``tokenserve coordinator --prefill HOST:PORT[@MGMT][,...] --decode HOST:PORT[@MGMT][,...]``
serves, on one port, every family's inference routes (§3.1) and relays each request
through a P and a D::

    client --POST /infer ...--> Coordinator ---POST + req-type/req-id/d-target--> P
                                    ^  <------ {"reqId","isStream","isLastResp","output"}
                                    |                                       | hand-off
                                    +--- GET /dresult (one per D) <-------- D

One module per job: :mod:`~tokenserve.coordinator.reqids` (request ids),
:mod:`~tokenserve.coordinator.ingress` (routes, stream detection, §3.2 errors),
:mod:`~tokenserve.coordinator.pool` (status polling, P/D choice, stopInfer),
:mod:`~tokenserve.coordinator.dlink` (the /dresult streams),
:mod:`~tokenserve.coordinator.relay` (one request: submit, relay, resubmit),
:mod:`~tokenserve.coordinator.fanout` (a request for several sequences: one relay per
sequence, answers merged by :mod:`~tokenserve.coordinator.merge`),
:mod:`~tokenserve.coordinator.forward` (the routes answered by asking the instances:
forward, probes, sums, stopInfer), :mod:`~tokenserve.coordinator.manage` (membership).

Other routes on the same port (the route table's coordinator column): ``GET /health``,
``/v1/models[/{m}]``, ``/v1/config``, ``/v2``, ``/v2/models/{m}[/config]`` and
``POST /v1/tokenizer``, ``/health/timed[-{n}]`` (a virtual inference on that P) and
``/metrics-json`` (that P's metrics, [I]) are forwarded to a P; Triton's
``getSlotCount`` is the sum over the usable decode instances, and ``/info`` a P's answer
whose ``max_concurrent_requests`` is that sum's ``total_slots`` ([I] one number, the
cluster's slots: :mod:`~tokenserve.coordinator.capacity`); the §9.4 status probes (``/v1/startup``,
``/v1/health``, ``/v1/readiness``, ``/v2/health/live``, ``/v2/health/ready``,
``/v2/models/{m}/ready``) answer 200 while a P and a D are usable, else 503.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable
from typing import Any

import httpx

from tokenserve.api.errors import ERROR_CONTENT_TYPE, error_json
from tokenserve.api.routes import ROUTES, Coord, match, plane_of
from tokenserve.config.flags import coordinator_config
from tokenserve.config.tree import CoordinatorConfig
from tokenserve.coordinator import ingress as msg
from tokenserve.coordinator.dlink import DLink
from tokenserve.coordinator.fanout import FanOut, max_sequences, plan_fan_out
from tokenserve.coordinator.forward import Forwarder
from tokenserve.coordinator.ingress import AdmissionError, Ingress, classify
from tokenserve.coordinator.manage import Management
from tokenserve.coordinator.metrics import CoordinatorMetrics
from tokenserve.coordinator.pool import Instance, InstancePool
from tokenserve.coordinator.relay import Flow, FlowContext
from tokenserve.coordinator.reqids import ReqIdGenerator
from tokenserve.coordinator.upstream import upstream_client
from tokenserve.pd.wire import DMessage
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.drain import drain
from tokenserve.transport.limits import HttpLimits
from tokenserve.transport.planes import ALL_PLANES, Plane, plane_handler
from tokenserve.transport.router import Router
from tokenserve.transport.runtime import Signals, run
from tokenserve.transport.server import HttpServer

logger = logging.getLogger(__name__)

#: seconds best-effort stops get to finish when the coordinator closes.
STOP_GRACE_S = 2.0
#: orphan req-ids remembered as stopped, so each is stopped once.
STOPPED_MEMORY = 4096


class Coordinator:
    """The coordinator's state: upstream client, instances, /dresult links and the
    requests in flight (by req-id). :meth:`start` before serving :meth:`router`,
    :meth:`close` after."""

    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self._client: httpx.AsyncClient | None = None
        self._pool: InstancePool | None = None
        self._forwarder: Forwarder | None = None
        self._flows: dict[str, Flow] = {}
        self._ids = ReqIdGenerator()
        self.metrics = CoordinatorMetrics(lambda: self.pool, lambda: self.in_flight)
        self._tasks: dict[int, list[asyncio.Task[None]]] = {}  # id(instance) -> its tasks
        self._background: set[asyncio.Task[None]] = set()
        #: req-ids of orphan D requests already stopped (insertion order, bounded)
        self._stopped: dict[str, None] = {}

    @property
    def pool(self) -> InstancePool:
        assert self._pool is not None, "Coordinator.start() first"
        return self._pool

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished."""
        return len(self._flows)

    async def start(self) -> None:
        """Open the upstream client, start polling every instance and link every D."""
        self._client = upstream_client()
        self._pool = InstancePool(self.cfg, self._client)
        self._forwarder = Forwarder(self.cfg, self._pool, self._client, self._holders)
        for inst in self._pool.prefill + self._pool.decode:
            self.watch(inst)

    def watch(self, inst: Instance) -> None:
        """Start polling ``inst`` (and, for a D, its /dresult link)."""
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self.pool.poll_forever(inst))]
        if inst.is_decode:
            link = DLink(inst, self._client_or_fail(), self.cfg, self._on_message,
                         self._on_drop)
            tasks.append(loop.create_task(link.run()))
        self._tasks[id(inst)] = tasks

    def unwatch(self, inst: Instance) -> None:
        """Stop polling and linking ``inst`` (a D's requests are recomputed elsewhere)."""
        for task in self._tasks.pop(id(inst), []):
            task.cancel()

    async def close(self) -> None:
        """Stop polling and linking, give pending stops ``STOP_GRACE_S``, close the
        client."""
        tasks = [t for ts in self._tasks.values() for t in ts]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._background:
            await asyncio.wait(self._background, timeout=STOP_GRACE_S)
        for task in self._background:
            task.cancel()
        if self._client is not None:
            await self._client.aclose()

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run a best-effort coroutine (a stop) in the background, tracked for close."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ /dresult

    def _on_message(self, d: Instance, message: DMessage) -> None:
        rid = message.req_id or ""
        flow = self._flows.get(rid)
        if flow is not None:
            flow.on_d_message(d.name, message)
        elif message.kind in ("ids", "data") and rid not in self._stopped:
            # [I] a request no flow waits for (an earlier coordinator's, or a lost P's
            # copy) still runs on D: stop it so its blocks are freed now
            self._stopped[rid] = None
            while len(self._stopped) > STOPPED_MEMORY:
                self._stopped.pop(next(iter(self._stopped)))
            logger.info("%s: request %s has no client here, stopping it", d.name, rid)
            self.spawn(self.pool.stop_infer([d], rid))

    def _on_drop(self, d: Instance) -> None:
        self.pool.note(d)
        for flow in list(self._flows.values()):
            flow.on_d_dropped(d.name)

    # ------------------------------------------------------------------ routes

    def router(self) -> Router:
        """Every route of the coordinator (module docstring)."""
        assert self._forwarder is not None, "Coordinator.start() first"
        fwd = self._forwarder
        router = Router()
        handlers = {Coord.RELAY: self.infer, Coord.PROBE: fwd.probe,
                    Coord.FORWARD: fwd.forward, Coord.STOP: fwd.stop_infer,
                    Coord.SUM: fwd.sum_over_instances, Coord.INFO: fwd.cluster_info}
        manage = Management(self.pool, self.watch, self.unwatch,
                            lambda: [f.cost for f in self._flows.values()])
        own = {**manage.handlers(), "server.metrics": self.serve_metrics}
        for route in ROUTES:
            if route.coordinator is Coord.MANAGE:
                router.add(route.method, route.path, own[route.name])
            elif route.coordinator is not Coord.NONE:
                router.add(route.method, route.path, handlers[route.coordinator])
        return router

    async def infer(self, request: HttpRequest, response: HttpResponse) -> None:
        """An inference request (§3.1-§3.3): admitted (429 / 503 in the family's error
        shape, §3.2 rule [I]), given a fresh req-id, then relayed through a P and a D
        (:class:`Flow`). The body is not validated: P does (§3.2 rule [I] (b)). A
        request for several sequences (OpenAI ``n``, vLLM ``n``) is split into
        single-sequence ones whose answers are merged
        (:mod:`tokenserve.coordinator.fanout`)."""
        ingress = classify(request.path, request.body, self.cfg.chars_per_token)
        try:
            if self.in_flight >= self.cfg.max_requests:
                raise AdmissionError(429, msg.TOO_MANY)
            if not self.pool.ready():
                raise AdmissionError(503, msg.NOT_READY)
        except AdmissionError as exc:
            await response.send(exc.status, error_json(ingress.family, exc.status, exc.message),
                                ERROR_CONTENT_TYPE)
            route = match(request.method, request.path)  # refused ones count too
            self.metrics.requests.labels(route.name if route else "other",
                                         str(exc.status)).inc()
            return
        plan = plan_fan_out(request.path, ingress, max_sequences(self.pool.prefill))
        if plan is not None:  # n > 1: one single-sequence request per choice, merged
            await FanOut(plan, request, response, self._relay,
                         self.cfg.chars_per_token).run()
            return
        await self._relay(request, response, ingress)

    async def _relay(self, request: HttpRequest, response: HttpResponse,
                     ingress: Ingress, counted: bool = True) -> None:
        """Relay one admitted single-sequence request through a P and a D
        (:class:`Flow`, registered under a fresh req-id while it runs); ``counted``:
        it is recorded in the metrics (a split request's first part only: the client's
        request is counted once)."""
        req_id = self._ids.next()
        while req_id in self._flows:  # pragma: no cover - 2**64 ids
            req_id = self._ids.next()
        ctx = FlowContext(self.cfg, self.pool, self._client_or_fail(), self.spawn,
                          self._rekey, self.metrics if counted else None)
        flow = Flow(ctx, req_id, request, response, ingress)
        self._flows[req_id] = flow  # before P sees it: D may answer first (§11)
        try:
            await flow.run()
        finally:
            del self._flows[flow.req_id]

    def _rekey(self, old: str) -> str:
        """A fresh req-id for the flow registered under ``old`` (its P was lost: what
        that P handed to a D keeps the old id, whose messages then match nothing)."""
        flow = self._flows.pop(old)
        new = self._ids.next()
        while new in self._flows:  # pragma: no cover - 2**64 ids
            new = self._ids.next()
        self._flows[new] = flow
        return new

    async def serve_metrics(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /metrics``: the coordinator's own series and its instances'
        (:mod:`tokenserve.coordinator.metrics`)."""
        body = await self.metrics.render(self._client_or_fail(), self.cfg.status_timeout_s)
        await response.send(200, body, "text/plain; version=0.0.4; charset=utf-8")

    def _holders(self, rid: str) -> list[Instance]:
        """The P and D holding the request in flight that ``rid`` names: its req-id, the
        client's own ``id`` (Triton) or the id its answer carries (:meth:`Flow.known_as`);
        empty when none has that id (stopInfer, :meth:`Forwarder.stop_infer`)."""
        flow = self._flows.get(rid)
        if flow is None:
            flow = next((f for f in self._flows.values() if f.known_as(rid)), None)
        return [i for i in (flow.p, flow.d) if i is not None] if flow is not None else []

    def _client_or_fail(self) -> httpx.AsyncClient:
        assert self._client is not None, "Coordinator.start() first"
        return self._client


# ---------------------------------------------------------------------- serving

async def serve_coordinator(
    cfg: CoordinatorConfig,
    *,
    started: asyncio.Future[Any] | None = None,
    stop: asyncio.Event | None = None,
    now: asyncio.Event | None = None,
) -> None:
    """Serve ``cfg`` until cancelled or ``stop`` is set, then drain: running requests
    get ``cfg.drain_timeout_s`` seconds (``now`` set: none), then their connections
    close and what still runs on P/D is stopped.

    ``started`` receives the :class:`HttpServer` once it listens (``cfg.port == 0``:
    read ``server.ports``).

    Raises:
        ValueError: the listener cannot be bound (a port in use, a bad address).
    """
    coord = Coordinator(cfg)
    await coord.start()
    router = coord.router()
    limits = HttpLimits(max_body_bytes=cfg.max_body_bytes)
    # [I] with --management-port, the management plane (§9.4 manage and status routes,
    # /health, /info, /v1/config) has its own listener; else one port serves everything
    main_planes = (ALL_PLANES if cfg.management_port is None
                   else ALL_PLANES - {Plane.MANAGEMENT})
    server = HttpServer(plane_handler(router, main_planes, plane_of), limits=limits)
    servers = [server]
    try:
        try:
            await server.start(cfg.host, cfg.port)
            if cfg.management_port is not None:
                mgmt = HttpServer(plane_handler(router, frozenset({Plane.MANAGEMENT}),
                                                plane_of), limits=limits)
                await mgmt.start(cfg.host, cfg.management_port)
                servers.append(mgmt)
        except OSError as exc:
            raise ValueError(f"cannot listen on {cfg.host}:{cfg.port}"
                             f"{'' if cfg.management_port is None else '/'}"
                             f"{cfg.management_port or ''}: {exc.strerror or exc}") from None
        logger.info("coordinator on http://%s:%s%s: prefill %s, decode %s", cfg.host,
                    server.ports[0],
                    f" (management :{servers[1].ports[0]})" if len(servers) > 1 else "",
                    ",".join(a.name for a in cfg.prefill),
                    ",".join(a.name for a in cfg.decode))
        if started is not None and not started.done():
            started.set_result(server)
        await (stop or asyncio.Event()).wait()
    finally:
        listening = [s for s in servers if s.ports]
        if listening:
            await drain(listening, None, cfg.drain_timeout_s, now)
        await coord.close()


async def _serve_with_signals(cfg: CoordinatorConfig) -> None:
    signals = Signals()
    signals.serving = True
    try:
        await serve_coordinator(cfg, stop=signals.stop, now=signals.now)
    finally:
        signals.close()


def run_coordinator(cfg: CoordinatorConfig) -> None:
    """Blocking entry point (uvloop when installed): serve until SIGTERM/SIGINT (the
    first drains, a second closes at once).

    Raises:
        ValueError: the listener cannot be bound.
    """
    run(_serve_with_signals(cfg))


# ---------------------------------------------------------------------- command line

def main(args: argparse.Namespace) -> int:
    """``tokenserve coordinator``: 0 after a signal, 2 (one line on stderr) on a bad
    flag or a port that cannot be bound."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per status poll
    try:
        run_coordinator(coordinator_config(args))
    except ValueError as exc:
        print(f"tokenserve coordinator: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a signal before the handlers were installed
        pass
    return 0
