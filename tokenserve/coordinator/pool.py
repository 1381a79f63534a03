"""The coordinator's view of its P and D instances: status polling, P/D selection and the
best-effort stop (spec/pd_disaggregation.md §3.4, §9.1, §10; plan "Wire decisions").

Each instance's ``GET /v1/status`` (management plane) is polled every
``status_interval_s``; an instance is *usable* while its last poll succeeded, its
``service.currentRole`` fits the list it was given in (P: prefill/flex, D: decode/flex)
and its ``roleStatus`` is ``RoleReady`` (or absent); a D also needs its ``/dresult``
stream open (:mod:`tokenserve.coordinator.dlink`), or its messages would be lost.

Selection: :mod:`tokenserve.coordinator.policy` (pure): MindIE-MS's DIGS load balance
(§3.4) by default, prefix-cache affinity for P with ``p_policy="affinity"``. A D is paired
only with a P of its own ``worldSize`` ([I] ``resource.worldSize`` of /v1/status, 1 when
absent; issue 41): the KV hand-off is rank to rank. A P and a D that cannot be linked are
logged once, one line, when a poll first shows the pair.

A P whose connection fails is unusable until its next successful poll (§10: repeated
failures take an instance out of scheduling); the poll is the health probe that brings a
restarted instance back. An instance taken offline (``POST /v1/instances/offline``, §9.4)
gets no new requests; the ones it has run to their end.

Each instance's state (:meth:`Instance.state`, pure) is logged once per change::

    joining --poll ok--> ready <--> unreachable        (any state --offline--> offline)
                         ready <--> not-ready (role, roleStatus) / unlinked (D)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from tokenserve.api.routes import path_of
from tokenserve.config.tree import CoordinatorConfig, InstanceAddr
from tokenserve.coordinator.policy import DView, PView, affinity_p, digs_d, digs_p, prefix_key

logger = logging.getLogger(__name__)

P_ROLES = frozenset({"prefill", "flex"})
D_ROLES = frozenset({"decode", "flex"})


@dataclass(eq=False)
class Instance:
    """One P or D instance and what the coordinator knows about it.

    Attributes:
        addr: where it is reached.
        roles: the ``currentRole`` values that let it serve in its list.
        status: its last ``GET /v1/status`` document; None while unreachable.
        link_up: (D) its ``/dresult`` stream is open.
        down: (D) re-links exhausted ``max_retry``; cleared by the next good link.
        prefill_load: (P) estimated prompt tokens in flight on it.
        assigned_blocks: (D) KV blocks assigned to it since its last status poll.
        polled: a poll has finished (ok or not).
        offline: taken out of scheduling by the management port (drain).
        logged: the state last logged (:meth:`InstancePool.note`).
        outstanding: requests sent to it (P: submitted, D: placed) and not finished.
        chosen: (P) submissions sent to it so far (the tie-break).
    """

    addr: InstanceAddr
    roles: frozenset[str]
    status: dict[str, Any] | None = None
    link_up: bool = False
    down: bool = False
    prefill_load: int = 0
    assigned_blocks: int = 0
    polled: bool = False
    offline: bool = False
    logged: str = "joining"
    outstanding: int = 0
    chosen: int = 0

    @property
    def name(self) -> str:
        return self.addr.name

    @property
    def is_decode(self) -> bool:
        return self.roles == D_ROLES

    @property
    def kind(self) -> str:
        """``prefill`` or ``decode``: the list it is in."""
        return "decode" if self.is_decode else "prefill"

    def state(self) -> str:
        """``joining`` (never answered), ``unreachable``, ``not-ready`` (wrong role or
        role status), ``unlinked`` (a D without its /dresult stream), ``offline`` or
        ``ready`` (the one state that takes new requests)."""
        if self.offline:
            return "offline"
        if self.status is None:
            return "unreachable" if self.polled else "joining"
        service = self.status.get("service") or {}
        if (service.get("currentRole") not in self.roles
                or service.get("roleStatus", "RoleReady") != "RoleReady"):
            return "not-ready"
        if self.is_decode and not self.link_up:
            return "unlinked"
        return "ready"

    def usable(self) -> bool:
        """Reachable, in a fitting role and ready (and, for a D, linked), not offline."""
        return self.state() == "ready"

    def describe(self) -> dict[str, Any]:
        """Its row of ``GET /v1/instances`` ([I] our shape)."""
        service = (self.status or {}).get("service") or {}
        resource = (self.status or {}).get("resource") or {}
        return {"name": self.name, "kind": self.kind, "address": self.addr.base_url,
                "management": self.addr.mgmt_url, "role": service.get("currentRole"),
                "state": self.state(), "outstanding": self.outstanding,
                "prefill_load": self.prefill_load,
                "free_blocks": resource.get("availBlockNum"),
                "total_blocks": resource.get("totalNpuBlockNums")}

    def world_size(self) -> int | None:
        """Its tensor-parallel ranks (``resource.worldSize`` of the last poll; 1 from an
        instance that does not say); None while it has not answered."""
        if self.status is None:
            return None
        world = (self.status.get("resource") or {}).get("worldSize", 1)
        return world if type(world) is int and world > 0 else 1

    def total_blocks(self) -> int:
        """(D) ``totalNpuBlockNums`` of the last poll (0 when unknown)."""
        total = ((self.status or {}).get("resource") or {}).get("totalNpuBlockNums")
        return total if isinstance(total, int) else 0

    def free_blocks(self) -> int:
        """(D) ``availBlockNum`` of the last poll minus the blocks assigned since."""
        resource = (self.status or {}).get("resource") or {}
        avail = resource.get("availBlockNum")
        return (avail if isinstance(avail, int) else 0) - self.assigned_blocks

    def d_target(self) -> str:
        """(D) the ``d-target`` header (§4.1, plan): ``<ipAddress or host>;<interCommPort>``,
        just the address when the status has no ``interCommPort``."""
        service = (self.status or {}).get("service") or {}
        ip = service.get("ipAddress") or self.addr.host
        port = service.get("interCommPort")
        return f"{ip};{port}" if port else str(ip)


class InstancePool:
    """Every configured instance, their status pollers and the selection policy (module
    docstring). ``client`` is the coordinator's upstream HTTP client."""

    def __init__(self, cfg: CoordinatorConfig, client: httpx.AsyncClient) -> None:
        self._cfg = cfg
        self._client = client
        self.prefill = [Instance(a, P_ROLES) for a in cfg.prefill]
        self.decode = [Instance(a, D_ROLES) for a in cfg.decode]
        self._model: str | None = None
        #: (P name, D name) pairs of different world sizes already logged
        self._unlinkable: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------ membership

    def find(self, name: str, kind: str | None = None) -> list[Instance]:
        """The instances called ``name`` (``host:port``), of ``kind`` when given."""
        return [i for i in self.prefill + self.decode
                if i.name == name and (kind is None or i.kind == kind)]

    def add(self, addr: InstanceAddr, kind: str) -> Instance | None:
        """Add an instance to the ``prefill`` or ``decode`` list; None when it is there.

        Raises:
            ValueError: an unknown kind.
        """
        if kind not in ("prefill", "decode"):
            raise ValueError(f"kind must be prefill or decode, got {kind!r}")
        if self.find(addr.name, kind):
            return None
        inst = Instance(addr, D_ROLES if kind == "decode" else P_ROLES)
        (self.decode if kind == "decode" else self.prefill).append(inst)
        logger.info("%s (%s): added", inst.name, kind)
        return inst

    def remove(self, inst: Instance) -> None:
        """Take ``inst`` out of its list (requests on it run to their end)."""
        lst = self.decode if inst.is_decode else self.prefill
        if inst in lst:
            lst.remove(inst)
            logger.info("%s (%s): removed", inst.name, inst.kind)

    def set_offline(self, inst: Instance, offline: bool) -> None:
        """Stop (``offline``) or resume scheduling new requests to ``inst``."""
        inst.offline = offline
        self.note(inst)

    def note(self, inst: Instance) -> None:
        """Log ``inst``'s state once each time it changes."""
        state = inst.state()
        if state != inst.logged:
            level = logging.INFO if state in ("ready", "offline") else logging.WARNING
            logger.log(level, "%s (%s): %s -> %s", inst.name, inst.kind, inst.logged, state)
            inst.logged = state

    # ------------------------------------------------------------------ status

    async def poll(self, inst: Instance) -> None:
        """One ``GET /v1/status`` of ``inst``; any failure makes it unusable."""
        try:
            resp = await self._client.get(inst.addr.mgmt_url + path_of("pd.status_v1"),
                                          timeout=self._cfg.status_timeout_s)
            doc = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            doc = None
        inst.polled = True
        if not isinstance(doc, dict):
            inst.status = None
        else:
            inst.status = doc
            inst.assigned_blocks = 0
            self.check_pairs(inst)
        self.note(inst)

    def check_pairs(self, inst: Instance) -> list[tuple[Instance, Instance]]:
        """Log, once per pair, every P / D pair with ``inst`` whose world sizes differ
        (they are never paired: :meth:`choose_d`); returns the pairs newly logged."""
        others = self.prefill if inst.is_decode else self.decode
        new = []
        for other in others:
            p, d = (other, inst) if inst.is_decode else (inst, other)
            pw, dw = p.world_size(), d.world_size()
            if pw is None or dw is None or p.name == d.name:
                continue
            key = (p.name, d.name)
            if pw == dw:
                self._unlinkable.discard(key)
            elif key not in self._unlinkable:
                self._unlinkable.add(key)
                logger.warning("P %s (worldSize %d) and D %s (worldSize %d) cannot be linked: "
                               "the KV hand-off is rank to rank", p.name, pw, d.name, dw)
                new.append((p, d))
        return new

    async def poll_forever(self, inst: Instance) -> None:
        """Poll ``inst`` every ``status_interval_s`` until cancelled."""
        while True:
            await self.poll(inst)
            await asyncio.sleep(self._cfg.status_interval_s)

    def ready(self) -> bool:
        """A P and a D of its world size can be chosen (§9.4 readiness)."""
        return any(self.choose_d(assign=0, world=p.world_size()) is not None
                   for p in self.prefill if p.usable())

    # ------------------------------------------------------------------ selection

    def choose_p(self, exclude: frozenset[str] = frozenset(), *, prompt: str = "",
                 cost: int = 0, linked: bool = False) -> Instance | None:
        """The usable P (not in ``exclude``, by name) the policy picks for a request
        whose prompt text is ``prompt`` and cost ``cost`` tokens
        (:mod:`tokenserve.coordinator.policy`); ``linked``: only among the Ps that have a
        usable D of their world size (a request's placement: a P whose every D has
        another size could never hand off; the forwarded routes take any P)."""
        cands = [p for p in self.prefill if p.usable() and p.name not in exclude
                 and (not linked or self._has_d_of_its_size(p))]
        views = [PView(p.name, p.prefill_load, p.chosen) for p in cands]
        if self._cfg.p_policy == "affinity" and prompt:
            i = affinity_p(views, prefix_key(prompt, self._cfg.affinity_prefix_chars),
                           self._cfg.affinity_load_bound, self._cfg.affinity_slack_tokens)
        else:
            i = digs_p(views)
        return None if i is None else cands[i]

    def _has_d_of_its_size(self, p: Instance) -> bool:
        return bool(self._usable_ds(world=p.world_size()))

    def _usable_ds(self, exclude: frozenset[str] = frozenset(), avoid: str | None = None,
                   world: int | None = None) -> list[Instance]:
        """The usable Ds not in ``exclude``, not named ``avoid``, of ``world`` ranks when
        given (the KV hand-off is rank to rank)."""
        return [d for d in self.decode
                if d.usable() and d.name not in exclude and d.name != avoid
                and (world is None or d.world_size() == world)]

    def choose_d(self, exclude: frozenset[str] = frozenset(), *, assign: int = 1,
                 avoid: str | None = None, world: int | None = None) -> Instance | None:
        """The usable D (not in ``exclude``; not the P named ``avoid``: [I] a flex
        instance is never paired with itself; of ``world`` ranks when given: the P's, the
        KV hand-off is rank to rank) of least DIGS load, charged ``assign`` blocks."""
        cands = self._usable_ds(exclude, avoid, world)
        i = digs_d([DView(d.outstanding, d.free_blocks() + d.assigned_blocks,
                          d.assigned_blocks, d.total_blocks()) for d in cands], assign)
        if i is None:
            return None
        cands[i].assigned_blocks += assign
        return cands[i]

    def blocks_for(self, tokens: int) -> int:
        """KV blocks a prompt of ``tokens`` tokens will hold on D (at least 1)."""
        return max(1, -(-tokens // self._cfg.block_size_hint))

    def mark_unreachable(self, inst: Instance) -> None:
        """A connection to ``inst`` failed: out of scheduling until its next good poll."""
        inst.status = None
        self.note(inst)

    # ------------------------------------------------------------------ stop

    async def model_name(self) -> str | None:
        """The served model's id from a P's ``GET /v1/models`` (cached once known)."""
        if self._model is not None:
            return self._model
        for p in sorted(self.prefill, key=lambda p: not p.usable()):
            with contextlib.suppress(httpx.HTTPError, ValueError, LookupError, TypeError):
                resp = await self._client.get(p.addr.base_url + path_of("openai.models"),
                                              timeout=self._cfg.status_timeout_s)
                self._model = str(resp.json()["data"][0]["id"])
                return self._model
        return None

    async def stop_infer(self, insts: list[Instance], req_id: str) -> None:
        """§10: ``POST /v2/models/{model}/stopInfer`` ``{"id": req_id}`` on each of
        ``insts`` (business plane), each tried up to ``1 + max_retry`` times while the
        connection fails. Best effort: never raises."""
        model = await self.model_name()
        if model is None:
            logger.warning("stopInfer %s: no model name known, not sent", req_id)
            return
        await asyncio.gather(*(self._stop_one(i, model, req_id) for i in insts))

    async def _stop_one(self, inst: Instance, model: str, req_id: str) -> None:
        url = inst.addr.base_url + path_of("mindie.stop_infer", model=model)
        for _ in range(1 + self._cfg.max_retry):
            try:
                await self._client.post(url, json={"id": req_id},
                                        timeout=self._cfg.status_timeout_s)
                return
            except httpx.HTTPError:
                await asyncio.sleep(0.1)
        logger.warning("stopInfer %s on %s failed", req_id, inst.name)
