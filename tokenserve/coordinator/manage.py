"""The coordinator's management routes (spec/pd_disaggregation.md §9.4, the coordinator's
``manage_port``; served on ``--management-port`` when given, else on the main port)::

    GET  /v1/instances            every instance: kind, role, state, outstanding work,
                                  free KV blocks ([I] our shape)
    POST /v1/instances/refresh    §9.4 body: the whole membership (added, removed, kept)
    POST /v1/instances/add        [I] {"prefill": ["HOST:PORT[@MGMT]", ...], "decode": [...]}
    POST /v1/instances/remove     [I] same body; requests on a removed P run to their end,
                                  those on a removed D are recomputed on another D
    POST /v1/instances/offline    §9.4 {"ids": [...]}: no new requests (drain); in-flight
    POST /v1/instances/online          ones finish; ``online`` resumes
    GET  /v1/coordinator_info     §9.4 schedule info

An id is an instance's ``host:port`` or the ``id`` a refresh gave it. Bodies are parsed
by the pure functions below (ValueError: 400 ``{"error": ...}``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from tokenserve.config.tree import InstanceAddr
from tokenserve.coordinator.pool import Instance, InstancePool
from tokenserve.transport.cycle import HttpRequest, HttpResponse

T = TypeVar("T")

KINDS = ("prefill", "decode")
#: §9.4 ``static_info.role``: the character code of P, D or F (flex: both lists)
ROLE_CODES = {ord("P"): ("prefill",), ord("D"): ("decode",), ord("F"): KINDS}


@dataclass(frozen=True)
class Member:
    """One instance of a membership body: its address and list, and the controller's id
    when it gave one."""

    addr: InstanceAddr
    kind: str
    ident: str | None = None


def parse_members(body: dict[str, Any]) -> list[Member]:
    """An add/remove body: ``{"prefill": [...], "decode": [...]}`` of ``HOST:PORT[@MGMT]``.

    Raises:
        ValueError: neither list, a list that is not of strings, a bad address.
    """
    if not any(k in body for k in KINDS):
        raise ValueError("give a prefill and/or decode list of HOST:PORT[@MGMT]")
    out = []
    for kind in KINDS:
        items = body.get(kind, [])
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"{kind} must be a list of HOST:PORT[@MGMT] strings")
        out += [Member(InstanceAddr.parse(i), kind) for i in items]
    return out


def parse_refresh(body: dict[str, Any]) -> list[Member]:
    """A §9.4 refresh body: every instance the cluster has now (``ip``, ``port``,
    ``static_info.role`` as a character code; [I] ``management_port`` when the
    management plane has its own port).

    Raises:
        ValueError: no ``instances`` list, or an instance without ip, port or role.
    """
    insts = body.get("instances")
    if not isinstance(insts, list):
        raise ValueError("instances must be a list")  # noqa: TRY004 - 400
    out = []
    for item in insts:
        if not isinstance(item, dict):
            raise ValueError("an instance must be an object")  # noqa: TRY004 - 400
        ip, port = item.get("ip"), item.get("port")
        role = (item.get("static_info") or {}).get("role")
        if not isinstance(ip, str) or type(port) is not int or role not in ROLE_CODES:
            raise ValueError("an instance needs ip, port and static_info.role (the "
                             "character code of P, D or F)")
        mgmt = item.get("management_port")
        addr = InstanceAddr(ip.strip("[]"), port, mgmt if type(mgmt) is int else None)
        ident = str(item["id"]) if "id" in item else None
        out += [Member(addr, kind, ident) for kind in ROLE_CODES[role]]
    return out


def parse_ids(body: dict[str, Any]) -> list[str]:
    """An offline/online body: ``{"ids": [...]}`` (strings or integers).

    Raises:
        ValueError: no list of ids.
    """
    ids = body.get("ids")
    if not isinstance(ids, list) or not all(isinstance(i, str | int) for i in ids):
        raise ValueError("ids must be a list of instance ids (HOST:PORT or refresh ids)")
    return [str(i) for i in ids]


class Management:
    """The routes above over a pool. ``watch(inst)`` starts an added instance's poller
    (and /dresult link), ``unwatch(inst)`` stops them; ``requests()`` lists the in-flight
    requests' estimated prompt tokens."""

    def __init__(self, pool: InstancePool, watch: Callable[[Instance], None],
                 unwatch: Callable[[Instance], None],
                 requests: Callable[[], list[int]]) -> None:
        self._pool = pool
        self._watch, self._unwatch, self._requests = watch, unwatch, requests
        self._ids: dict[str, str] = {}  # refresh id -> host:port

    def _body(self, request: HttpRequest) -> dict[str, Any]:
        try:
            body = orjson.loads(request.body or b"{}")
        except orjson.JSONDecodeError:
            raise ValueError("the body is not JSON") from None
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")  # noqa: TRY004 - 400
        return body

    async def _parsed(self, request: HttpRequest, response: HttpResponse,
                      parse: Callable[[dict[str, Any]], T]) -> T | None:
        """``parse`` of the JSON body, or None once a 400 ``{"error"}`` is sent."""
        try:
            return parse(self._body(request))
        except ValueError as exc:
            await response.send_json(400, {"error": str(exc)})
            return None

    async def instances(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /v1/instances``."""
        insts = self._pool.prefill + self._pool.decode
        await response.send_json(200, {"instances": [i.describe() for i in insts]})

    def _add(self, members: list[Member]) -> list[str]:
        added = []
        for m in members:
            inst = self._pool.add(m.addr, m.kind)
            if inst is not None:
                self._watch(inst)
                added.append(f"{m.kind} {m.addr.name}")
            if m.ident is not None:
                self._ids[m.ident] = m.addr.name
        return added

    def _remove(self, insts: list[Instance]) -> list[str]:
        for inst in insts:
            self._unwatch(inst)
            self._pool.remove(inst)
        return [f"{i.kind} {i.name}" for i in insts]

    async def add(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v1/instances/add``."""
        members = await self._parsed(request, response, parse_members)
        if members is None:
            return
        await response.send_json(200, {"result": "ok", "added": self._add(members)})

    async def remove(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v1/instances/remove``."""
        members = await self._parsed(request, response, parse_members)
        if members is None:
            return
        insts = [i for m in members for i in self._pool.find(m.addr.name, m.kind)]
        await response.send_json(200, {"result": "ok", "removed": self._remove(insts)})

    async def refresh(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v1/instances/refresh`` (§9.4): the body is the whole membership."""
        members = await self._parsed(request, response, parse_refresh)
        if members is None:
            return
        keep = {(m.kind, m.addr.name) for m in members}
        gone = [i for i in self._pool.prefill + self._pool.decode
                if (i.kind, i.name) not in keep]
        removed = self._remove(gone)
        await response.send_json(200, {"result": "ok", "added": self._add(members),
                                       "removed": removed})

    async def offline(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v1/instances/offline`` (§9.4): drain."""
        await self._set_offline(request, response, True)

    async def online(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v1/instances/online`` (§9.4)."""
        await self._set_offline(request, response, False)

    async def _set_offline(self, request: HttpRequest, response: HttpResponse,
                           offline: bool) -> None:
        ids = await self._parsed(request, response, parse_ids)
        if ids is None:
            return
        insts = [i for ident in ids for i in self._pool.find(self._ids.get(ident, ident))]
        unknown = [ident for ident in ids if not self._pool.find(self._ids.get(ident, ident))]
        if unknown:
            await response.send_json(404, {"error": f"unknown instance ids: {unknown}"})
            return
        for inst in insts:
            self._pool.set_offline(inst, offline)
        await response.send_json(200, {"result": "ok"})

    async def info(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /v1/coordinator_info`` (§9.4): per instance the requests it holds
        (``allocated_slots``) and the KV blocks assigned since its last poll (D) or the
        prompt tokens in prefill (P) (``allocated_blocks``); in-flight requests and
        their estimated prompt tokens ([I] ``output_len`` is not estimated: 0)."""
        lengths = self._requests()
        rows = [{"id": i.name, "kind": i.kind, "allocated_slots": i.outstanding,
                 "allocated_blocks": i.assigned_blocks if i.is_decode else i.prefill_load}
                for i in self._pool.prefill + self._pool.decode]
        await response.send_json(200, {
            "schedule_info": rows, "request_num": len(lengths),
            "request_length_info": {"input_len": sum(lengths), "output_len": 0}})

    def handlers(self) -> dict[str, Callable[[HttpRequest, HttpResponse], Any]]:
        """Route name -> handler, for the rows the table marks ``Coord.MANAGE``."""
        return {"coordinator.instances": self.instances,
                "coordinator.instances_refresh": self.refresh,
                "coordinator.instances_add": self.add,
                "coordinator.instances_remove": self.remove,
                "coordinator.instances_offline": self.offline,
                "coordinator.instances_online": self.online,
                "coordinator.info": self.info}
