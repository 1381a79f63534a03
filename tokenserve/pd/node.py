"""One server instance's PD identity (spec/pd_disaggregation.md §1, §9): its mode and role,
its links to peers, its KV transfer engine, and the management routes that expose them::

    GET  /v1/status, /v2/status        role, role status, KV and slot counters, links (§9.1)
    POST /v1/role/{prefill|decode|flex}, /v2/role/{prefill|decode}   role assignment (§9.2)

``inferMode`` ``standard`` (mixed, the default) serves every request locally; ``dmi``
turns PD on: the prefill side (:mod:`tokenserve.pd.prefill`) and the decode side
(:mod:`tokenserve.pd.decode`) both hang off a :class:`PdNode`.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenserve.api.engine_client import PdEngine
from tokenserve.api.family_api import parse_json_object
from tokenserve.config.tree import ROLES, PdConfig
from tokenserve.pd.messages import Release, WireError
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError

logger = logging.getLogger(__name__)

#: spec config.md ``interCommPort`` default, when a ``d-target`` carries no port.
DEFAULT_INTER_COMM_PORT = 1121
#: spec/interfaces.md §4.1, §5.1: PD mode refuses ``n`` != 1 and ``best_of`` != 1 with 422
#: (MindIE does too); raised in the family's error shape when a handler admits a second
#: sequence on P or D.
PD_ONE_SEQUENCE = "PD serves one sequence per request (n = 1, best_of = 1)."


def inter_comm_url(addr: str, path: str) -> str:
    """``http://ip:port<path>`` for a P/D address ``ip[;port]`` (spec §4.1 ``d-target``,
    §5.2 ``pNodeAddr``); IPv6 addresses get brackets."""
    ip, _, port = addr.partition(";")
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port or DEFAULT_INTER_COMM_PORT}{path}"


class RoleStatus(str, enum.Enum):
    """spec §9.1 ``roleStatus``."""

    READY = "RoleReady"
    SWITCHING = "RoleSwitching"
    UNKNOWN = "RoleUnknown"


@dataclass
class PdNode:
    """The live PD state of this instance (single event loop; no locks)."""

    cfg: PdConfig
    #: what P and D use of the engine: EngineClient plus the KV region, the puller,
    #: release and evict (api/engine_client.py)
    engine: PdEngine
    role: str | None = None
    role_status: RoleStatus = RoleStatus.UNKNOWN
    p_percentage: int = 50
    #: management (inter-comm) port, known once the listeners are bound
    inter_comm_port: int = 0
    #: peer address ("ip;port") -> "ok" | "failed : pull kv failed." (spec §9.1)
    links: dict[str, str] = field(default_factory=dict)
    kv: Any = None  # tokenserve.pd.rank_kv.RankedKv (one engine per rank), when PD is on
    client: httpx.AsyncClient | None = None

    def __post_init__(self) -> None:
        self.role = self.cfg.role
        self.p_percentage = self.cfg.p_percentage
        if not self.cfg.pd or self.role is not None:
            self.role_status = RoleStatus.READY

    # ------------------------------------------------------------------ lifecycle

    def start_kv(self) -> None:
        """Register the engine's KV cache with a Mooncake transfer engine (blocking,
        once; PD only); under tensor parallelism every rank registers its own shard with
        its own engine (:class:`~tokenserve.pd.rank_kv.RankedKv`). Raises whatever the
        transfer engine raises (``KvTransferError``)."""
        if not self.cfg.pd or self.kv is not None:
            return
        from tokenserve.pd.rank_kv import RankedKv

        self.kv = RankedKv.open(self.engine, self.cfg.ip_address,
                                protocol=self.cfg.kv_protocol, device_name=self.cfg.kv_device,
                                timeout_s=self.cfg.kv_trans_timeout_s,
                                port_range=self.cfg.kv_port_range)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.kv is not None:
            kv, self.kv = self.kv, None
            await asyncio.to_thread(kv.close)  # ~1 s; the engine (and its pulls) stopped

    def http(self) -> httpx.AsyncClient:
        """The shared client for P -> D calls."""
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.cfg.kv_trans_timeout_s))
        return self.client

    @property
    def address(self) -> str:
        """``ip;inter-comm port`` (spec §4.1 ``d-target`` / §5.2 ``pNodeAddr``)."""
        return f"{self.cfg.ip_address};{self.inter_comm_port}"

    @property
    def is_prefill(self) -> bool:
        return self.role == "prefill" or (self.role == "flex" and self.p_percentage != 0)

    @property
    def is_decode(self) -> bool:
        return self.role in ("decode", "flex")

    def is_self(self, target: str) -> bool:
        """Whether a ``d-target`` names this instance (spec §4.3 flex-local)."""
        ip, _, port = target.partition(";")
        return ip == self.cfg.ip_address and (not port or port == str(self.inter_comm_port))

    # ------------------------------------------------------------------ routes

    async def release(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v1/pd/release`` ``{"reqId": ...}`` (management plane): D has pulled the
        request's KV blocks (spec §8.1 ``ReleaseKVCacheChannel``); 200 ``{}`` either way."""
        try:
            rid = Release.decode(request.body).req_id
        except WireError as exc:
            raise HttpError(400, str(exc)) from None
        self.engine.release(rid)
        await response.send_json(200, {})

    def _status(self) -> dict[str, Any]:
        st = self.engine.stats()
        info = self.engine.info
        service: dict[str, Any] = {"roleStatus": self.role_status.value,
                                   "currentRole": self.role or "none"}
        if self.role == "flex":
            service["p_percentage"] = self.p_percentage
        service["ipAddress"] = self.cfg.ip_address  # [I] where d-target points
        service["interCommPort"] = self.inter_comm_port
        resource = {
            "availSlotsNum": max(0, info.max_batch_size - st.num_running),
            "availBlockNum": st.num_free_blocks,
            "waitingRequestNum": st.num_waiting,
            "runningRequestNum": st.num_running,
            "swappedRequestNum": st.num_swapped,
            "freeNpuBlockNums": st.num_free_blocks,
            "freeCpuBlockNums": 0,
            "totalNpuBlockNums": st.num_blocks,
            "totalCpuBlockNums": 0,
            # [I] tensor-parallel ranks: the coordinator pairs P and D of equal worldSize
            "worldSize": info.world_size,
        }
        peers = [{"target": t, "link": link} for t, link in sorted(self.links.items())]
        return {"service": service, "resource": resource, "linkStatus": {"peers": peers}}

    async def status_v1(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /v1/status`` (spec §9.1)."""
        if not self.engine.is_healthy():
            raise HttpError(503, "The server is not healthy.")
        await response.send_json(200, self._status())

    async def status_v2(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /v2/status`` (spec §9.1): v1 plus the DP-aware totals (one DP rank)."""
        if not self.engine.is_healthy():
            raise HttpError(503, "The server is not healthy.")
        body = self._status()
        res = body["resource"]
        res["totalAvailNpuSlotsNum"] = res["availSlotsNum"]
        res["totalAvailNpuBlockNum"] = res["availBlockNum"]
        res["dpInstMap"] = {"0": res["availBlockNum"]}
        res["maxAvailNpuBlockNum"] = res["availBlockNum"]
        await response.send_json(200, body)

    async def role_v1(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v1/role/{prefill|decode|flex}`` (spec §9.2)."""
        await self._set_role(request, response, ROLES, v2=False)

    async def role_v2(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v2/role/{prefill|decode}`` (spec §9.2)."""
        await self._set_role(request, response, ("prefill", "decode"), v2=True)

    async def _set_role(self, request: HttpRequest, response: HttpResponse,
                        allowed: tuple[str, ...], *, v2: bool) -> None:
        role = request.path_params.get("role", "")
        if role not in allowed:
            raise HttpError(404, f"Route {request.path} not found.")
        fail = ("Parse req json failed. Reset to previous node status." if v2
                else "Update pd info failed. Reset to previous node status.")
        try:
            body = parse_json_object(request.body)
        except ValueError:
            raise HttpError(422, "Req body converts to json fail. Reset to previous node "
                            "status.", error_type="Input validation error") from None
        try:
            p_pct, peers = _parse_role_body(body, role, v2=v2)
        except ValueError as exc:
            logger.warning("role %s refused: %s", role, exc)
            raise HttpError(503, fail) from None
        if not self.cfg.pd:
            raise HttpError(503, fail)
        self.role = role
        if p_pct is not None:
            self.p_percentage = p_pct
        # Mooncake with P2PHANDSHAKE links on demand: a peer is "ok" until a pull fails
        self.links = {peer: self.links.get(peer, "ok") for peer in peers}
        self.role_status = RoleStatus.READY
        logger.info("role set to %s (%d peers)", role, len(peers))
        await response.send_json(200, {"result": "ok"})


def _parse_role_body(body: dict[str, Any], role: str, *, v2: bool
                     ) -> tuple[int | None, list[str]]:
    """Validate a role body (spec §9.2); returns (p_percentage, peer ids).

    Raises:
        ValueError: what is wrong.
    """
    local = body.get("local")
    nodes = local if v2 else [local]
    if not isinstance(nodes, list) or not nodes:
        raise ValueError("local is required")
    for node in nodes:
        _check_node(node, v2=v2)
    p_pct = None
    if not v2 and role == "flex" and "p_percentage" in local:
        p_pct = local["p_percentage"]
        if type(p_pct) is not int or not 0 <= p_pct <= 100:
            raise ValueError("p_percentage must be an integer in [0, 100]")
    peers_raw = body.get("peers", [])
    if not isinstance(peers_raw, list):
        raise ValueError("peers must be a list")  # noqa: TRY004 - user input: 503
    peers = []
    for peer in peers_raw:
        for node in (peer if v2 and isinstance(peer, list) else [peer]):
            _check_node(node, v2=v2)
            peers.append(str(node.get("id", node["server_ip"])))
    return p_pct, peers


def _check_node(node: Any, *, v2: bool) -> None:
    if not isinstance(node, dict):
        raise ValueError("a node must be an object")  # noqa: TRY004 - user input: 503
    ip = node.get("server_ip")
    if not isinstance(ip, str):
        raise ValueError("server_ip is required")  # noqa: TRY004 - user input: 503
    ipaddress.ip_address(ip)
    if ("id" in node) != ("host_ip" in node) and not v2:
        raise ValueError("id and host_ip must be both present or both absent")
    if "id" in node and (type(node["id"]) is not int or node["id"] < 0):
        raise ValueError("id must be an unsigned integer")
    devices = ([d for dp in node.get("dp_inst_list", []) for d in dp.get("device", [])]
               if v2 else node.get("device"))
    if not isinstance(devices, list):
        raise ValueError("device must be a list")  # noqa: TRY004 - user input: 503
    for dev in devices:
        if not isinstance(dev, dict):
            raise ValueError("a device must be an object")  # noqa: TRY004 - user input: 503
        for key in ("device_id", "device_logical_id"):
            if not (isinstance(dev.get(key), str) and dev[key].isdigit()):
                raise ValueError(f"{key} must be a numeric string")
        ipaddress.ip_address(dev.get("device_ip", ""))
