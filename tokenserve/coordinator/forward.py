"""The coordinator's routes answered by asking its instances rather than relaying a
request through a P and a D (the route table's coordinator column, spec
pd_disaggregation.md §3.5, §6.2, §9.4; interfaces.md §2.3):

- ``Coord.PROBE``: the §9.4 status probes, 200 while a P and a D are usable (Triton's
  model probe: a P's answer);
- ``Coord.FORWARD``: ``/health``, ``/v1/models[/{m}]``, ``/v1/tokenizer``, ``/v1/config``,
  Triton's ``/v2`` metadata, ``/health/timed[-N]``, ``/metrics-json``: the least loaded
  P's answer, unchanged, on the plane that serves the route;
- ``Coord.SUM``: Triton's ``getSlotCount``, summed over the usable decode instances;
- ``Coord.INFO``: TGI's ``/info``, a P's answer with the cluster's slots
  (:mod:`~tokenserve.coordinator.capacity`);
- ``Coord.STOP``: ``stopInfer``, sent to the P and D holding the request, else a P's
  answer.

Errors the coordinator makes on these routes take the route family's shape
(:func:`send_error`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from tokenserve.api.errors import ERROR_CONTENT_TYPE, error_json
from tokenserve.api.families import answering
from tokenserve.api.routes import Family, Route, match, path_of
from tokenserve.config.tree import CoordinatorConfig
from tokenserve.coordinator import capacity
from tokenserve.coordinator import ingress as msg
from tokenserve.coordinator.pool import Instance, InstancePool
from tokenserve.pd.messages import forward_headers
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.planes import Plane


class Forwarder:
    """The forwarding routes' handlers over the coordinator's pool and upstream client.

    Args:
        cfg: the coordinator's configuration (its timeouts).
        pool: the instances.
        client: the upstream HTTP client (the coordinator's, open).
        holders: the P and D that hold the request a stopInfer ``id`` names (the
            coordinator's req-id, the client's id or the answer's); empty when no
            request in flight has that id.
    """

    def __init__(self, cfg: CoordinatorConfig, pool: InstancePool, client: httpx.AsyncClient,
                 holders: Callable[[str], list[Instance]]) -> None:
        self.cfg = cfg
        self.pool = pool
        self._client = client
        self._holders = holders

    async def probe(self, request: HttpRequest, response: HttpResponse) -> None:
        """§9.4 status probes: 200 (empty, ``application/json`` as a mixed server's Triton
        probes) while a P and a D are usable, else 503. Triton's model probe, when
        ready, is a P's answer (404 for a model it does not serve, as a mixed server)."""
        if self.pool.ready():
            route = match(request.method, request.path)
            if route is None or route.name != "triton.model_ready":
                await response.send(200, b"", "application/json")
            else:
                await self.forward(request, response)
        else:
            await response.send(503, error_json(Family.MINDIE, 503, msg.NOT_READY),
                                ERROR_CONTENT_TYPE)

    async def forward(self, request: HttpRequest, response: HttpResponse) -> None:
        """The routes the table marks ``Coord.FORWARD`` (``/health``, ``/v1/models[/{m}]``,
        ``/v1/tokenizer``, ``/info``, ``/v1/config``, Triton's ``/v2`` metadata and model
        config): the least loaded P's answer, status and body unchanged, asked on the P's
        plane that serves the route (``@MGMT`` for the management plane). 503 when not
        ready; 408 ``Request tokenizer timeout`` (tokenizer) or 500 ``Connect to p
        instance failed`` when P fails, in the route family's error shape."""
        p = self.pool.choose_p()
        route = match(request.method, request.path)
        if request.path == path_of("server.health") and (p is None or not self.pool.ready()):
            await response.send(503, b"", "application/json")  # a mixed server's unhealthy
            return
        if p is None:
            await send_error(response, route, 503, msg.NOT_READY)
            return
        plane = route.plane if route is not None else Plane.BUSINESS
        base = p.addr.base_url if plane is Plane.BUSINESS else p.addr.mgmt_url
        url = base + request.path + (f"?{request.query}" if request.query else "")
        tokenizer = request.path == path_of("mindie.tokenizer")
        timeout = self.cfg.tokenizer_timeout_s if tokenizer else self.cfg.status_timeout_s
        try:
            resp = await self._client.request(
                request.method, url, headers=forward_headers(request.headers),
                content=request.body or None, timeout=timeout)
        except httpx.TimeoutException:
            status, text = (408, msg.TOKENIZER_TIMEOUT) if tokenizer else (503, msg.NOT_READY)
            await send_error(response, route, status, text)
            return
        except httpx.HTTPError:
            await send_error(response, route, 500, msg.CONNECT_P_FAILED)
            return
        await response.send(resp.status_code, resp.content,
                            resp.headers.get("content-type", "application/json"))

    async def sum_over_instances(self, request: HttpRequest, response: HttpResponse) -> None:
        """The routes the table marks ``Coord.SUM`` (Triton's ``getSlotCount``, spec §6.2):
        [I] every usable decode instance is asked on the plane that serves the route
        (:mod:`~tokenserve.coordinator.capacity`: a cluster's slots are its decode
        instances'); the answer is their 200 answers with every numeric field summed
        (``total_slots``, ``free_slots``, ``available_tokens_length``), so its shape and
        content type are a mixed server's. The first non-200 answer (404 for a model the
        instances do not serve) is relayed unchanged; 503 when no P or D is usable; 500
        ``Connect to p instance failed`` when none answers."""
        route = match(request.method, request.path)
        if not self.pool.ready():
            await send_error(response, route, 503, msg.NOT_READY)
            return
        total, first = await self._cluster_slots(request, request.path)
        if total is None:
            if first is None:
                await send_error(response, route, 500, msg.CONNECT_P_FAILED)
            else:
                await response.send(first.status_code, first.content,
                                    first.headers.get("content-type", "application/json"))
            return
        assert first is not None
        await response.send(200, orjson.dumps(total),
                            first.headers.get("content-type", "application/json"))

    async def cluster_info(self, request: HttpRequest, response: HttpResponse) -> None:
        """TGI ``GET /info`` (the table's ``Coord.INFO``, spec §3.5): a P's answer, as
        :meth:`forward` relays it, with ``max_concurrent_requests`` = the cluster's
        ``total_slots``, the number ``getSlotCount`` answers (both are MindIE's
        ``maxBatchSize``; a cluster's is its decode instances' sum, the reasoning in
        :mod:`~tokenserve.coordinator.capacity`). A P answer that is not a 200 ``/info``
        document is relayed unchanged; 503 when no P or D is usable; 500 ``Connect to p
        instance failed`` when no P, or no D, answers."""
        route = match(request.method, request.path)
        p = self.pool.choose_p()
        if p is None or not self.pool.ready():
            await send_error(response, route, 503, msg.NOT_READY)
            return
        answer = await self._ask(p, route, request)
        if answer is None:
            await send_error(response, route, 500, msg.CONNECT_P_FAILED)
            return
        content_type = answer.headers.get("content-type", "application/json")
        info: Any = None
        if answer.status_code == 200:
            try:
                info = orjson.loads(answer.content)
            except orjson.JSONDecodeError:
                info = None
        model = capacity.served_model(info) if isinstance(info, dict) else None
        if model is None:
            await response.send(answer.status_code, answer.content, content_type)
            return
        slots, _ = await self._cluster_slots(request, path_of("triton.slot_count",
                                                                model=model))
        if slots is None or not isinstance(slots.get(capacity.TOTAL_SLOTS), int):
            await send_error(response, route, 500, msg.CONNECT_P_FAILED)
            return
        assert isinstance(info, dict)
        await response.send(200, orjson.dumps(capacity.with_cluster_slots(info, slots)),
                            content_type)

    async def _cluster_slots(self, request: HttpRequest, path: str
                             ) -> tuple[dict[str, Any] | None, httpx.Response | None]:
        """``GET path`` (a getSlotCount path) on every usable decode instance
        (:func:`capacity.slot_instances`), their answers summed
        (:func:`capacity.sum_fields`), with the first answer (its content type). (None,
        the first non-200 answer) when one refused; (None, None) when none answered or
        an answer is not a JSON object."""
        route = match("GET", path)
        insts = capacity.slot_instances(self.pool)
        answers = await asyncio.gather(*(self._ask(i, route, request, path)
                                         for i in insts))
        got = [a for a in answers if a is not None]
        bad = next((a for a in got if a.status_code != 200), None)
        if bad is not None:
            return None, bad
        parts = []
        for a in got:
            try:
                part = orjson.loads(a.content)
            except orjson.JSONDecodeError:
                part = None
            if not isinstance(part, dict):
                return None, None
            parts.append(part)
        if not parts:
            return None, None
        return capacity.sum_fields(parts), got[0]

    async def _ask(self, inst: Instance, route: Route | None, request: HttpRequest,
                   path: str | None = None) -> httpx.Response | None:
        """The client's request sent to ``inst`` on the plane serving ``route`` (to
        ``path`` instead of the client's when given, without the query); None when it
        fails."""
        plane = route.plane if route is not None else Plane.BUSINESS
        base = inst.addr.base_url if plane is Plane.BUSINESS else inst.addr.mgmt_url
        if path is None:
            path = request.path + (f"?{request.query}" if request.query else "")
        try:
            return await self._client.request(
                request.method, base + path, headers=forward_headers(request.headers),
                content=request.body or None, timeout=self.cfg.status_timeout_s)
        except httpx.HTTPError:
            return None

    async def stop_infer(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v2/models/{m}/stopInfer`` (interfaces §2.3): ``{"id"}`` names a request
        by the coordinator's req-id, the client's own ``id`` (Triton) or the id the
        answer carries (:meth:`~tokenserve.coordinator.relay.Flow.known_as`). The client's
        request goes, unchanged, to the P and D that hold that request (each registers
        it under both ids), and the first 200 is the answer (the request's own stream
        then ends as stopped); when no request here has that id, or none answers 200,
        a P's answer is (404 ``RequestId is <id> not found.``, 422 for a bad body, 404
        for an unknown model: what a mixed server answers)."""
        try:
            body: Any = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            body = None
        rid = body.get("id") if isinstance(body, dict) else None
        holders = self._holders(rid) if isinstance(rid, str) else []
        if holders:
            answers = await asyncio.gather(*(self._stop_on(i, request) for i in holders))
            ok = next((a for a in answers if a is not None and a.status_code == 200), None)
            if ok is not None:
                await response.send(200, ok.content,
                                    ok.headers.get("content-type", "application/json"))
                return
        await self.forward(request, response)

    async def _stop_on(self, inst: Instance, request: HttpRequest) -> httpx.Response | None:
        """The client's stopInfer sent to ``inst`` (business plane); None when it fails."""
        url = inst.addr.base_url + request.path
        try:
            return await self._client.post(
                url, content=request.body, headers=forward_headers(request.headers),
                timeout=self.cfg.status_timeout_s)
        except httpx.HTTPError:
            return None


async def send_error(response: HttpResponse, route: Route | None, status: int,
                     message: str) -> None:
    """A coordinator-made error on a non-inference route, in the shape a mixed server
    answers that route's errors (its family's shape: OpenAI's object on OpenAI's routes,
    MindIE's on the rest)."""
    family = answering(route.family if route is not None else Family.SERVER)
    await response.send(status, family.error_body(status, message), ERROR_CONTENT_TYPE)
