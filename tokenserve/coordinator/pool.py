"""The coordinator's view of its P and D instances: status polling, P/D selection and the
best-effort stop (spec/pd_disaggregation.md §3.4, §9.1, §10; plan "Wire decisions").

Each instance's ``GET /v1/status`` (management plane) is polled every
``status_interval_s``; an instance is *usable* while its last poll succeeded, its
``service.currentRole`` fits the list it was given in (P: prefill/flex, D: decode/flex)
and its ``roleStatus`` is ``RoleReady`` (or absent); a D also needs its ``/dresult``
stream open (:mod:`tokenserve.coordinator.dlink`), or its messages would be lost.

Selection ([I] a simplification of MindIE's DIGS scheduler, §3.4)::

    P: least outstanding prefill work = estimated prompt tokens of the requests sent to
       it and not yet answered (ties: the order given on the command line)
    D: most free KV blocks = resource.availBlockNum of the last poll minus the blocks the
       coordinator assigned to it since that poll (ties: command-line order)

A P whose connection fails is unusable until its next successful poll (§10: repeated
failures take an instance out of scheduling).
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
    """

    addr: InstanceAddr
    roles: frozenset[str]
    status: dict[str, Any] | None = None
    link_up: bool = False
    down: bool = False
    prefill_load: int = 0
    assigned_blocks: int = 0
    polled: bool = False

    @property
    def name(self) -> str:
        return self.addr.name

    @property
    def is_decode(self) -> bool:
        return self.roles == D_ROLES

    def usable(self) -> bool:
        """Reachable, in a fitting role and ready (and, for a D, linked)."""
        if self.status is None or (self.is_decode and not self.link_up):
            return False
        service = self.status.get("service") or {}
        return (service.get("currentRole") in self.roles
                and service.get("roleStatus", "RoleReady") == "RoleReady")

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

    # ------------------------------------------------------------------ status

    async def poll(self, inst: Instance) -> None:
        """One ``GET /v1/status`` of ``inst``; any failure makes it unusable."""
        try:
            resp = await self._client.get(inst.addr.mgmt_url + path_of("pd.status_v1"),
                                          timeout=self._cfg.status_timeout_s)
            doc = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            doc = None
        first, inst.polled = not inst.polled, True
        if not isinstance(doc, dict):
            if inst.status is not None or first:
                logger.warning("%s: status unreachable, out of scheduling", inst.name)
            inst.status = None
            return
        if inst.status is None:
            logger.info("%s: status ok (%s)", inst.name,
                        (doc.get("service") or {}).get("currentRole"))
        inst.status = doc
        inst.assigned_blocks = 0

    async def poll_forever(self, inst: Instance) -> None:
        """Poll ``inst`` every ``status_interval_s`` until cancelled."""
        while True:
            await self.poll(inst)
            await asyncio.sleep(self._cfg.status_interval_s)

    def ready(self) -> bool:
        """A P and a D can be chosen (§9.4 readiness)."""
        return self.choose_p() is not None and self.choose_d(assign=0) is not None

    # ------------------------------------------------------------------ selection

    def choose_p(self, exclude: frozenset[str] = frozenset()) -> Instance | None:
        """The usable P (not in ``exclude``, by name) with the least prefill load."""
        cands = [p for p in self.prefill if p.usable() and p.name not in exclude]
        return min(cands, key=lambda p: p.prefill_load, default=None)

    def choose_d(self, exclude: frozenset[str] = frozenset(), *, assign: int = 1,
                 avoid: str | None = None) -> Instance | None:
        """The usable D (not in ``exclude``; not the P named ``avoid``: [I] a flex
        instance is never paired with itself) with the most free blocks, charged
        ``assign`` blocks."""
        cands = [d for d in self.decode
                 if d.usable() and d.name not in exclude and d.name != avoid]
        best = max(cands, key=lambda d: d.free_blocks(), default=None)
        if best is not None:
            best.assigned_blocks += assign
        return best

    def blocks_for(self, tokens: int) -> int:
        """KV blocks a prompt of ``tokens`` tokens will hold on D (at least 1)."""
        return max(1, -(-tokens // self._cfg.block_size_hint))

    def mark_unreachable(self, inst: Instance) -> None:
        """A connection to ``inst`` failed: out of scheduling until its next good poll."""
        if inst.status is not None:
            logger.warning("%s: connection failed, out of scheduling", inst.name)
        inst.status = None

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
