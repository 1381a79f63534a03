"""An instance's PD identity over HTTP (spec/pd_disaggregation.md §4.2, §6.2, §9): status,
role assignment and its validation, the prefill gate before a role is known, /dresult and
the hand-off routes on the wrong role. A fake engine behind the real router and server."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.fakes import FakeEngine
from tokenserve.config.tree import PdConfig
from tokenserve.engine.info import EngineStats
from tokenserve.pd.node import PdNode
from tokenserve.server.app import build_router
from tokenserve.transport.server import HttpServer

ROLE_BODY = {"local": {"id": 0, "server_ip": "10.0.0.1", "host_ip": "10.0.0.1",
                       "device": [{"device_ip": "192.168.1.10", "device_id": "0",
                                   "device_logical_id": "0"}]},
             "peers": [{"id": 1, "server_ip": "10.0.0.2", "host_ip": "10.0.0.2",
                        "device": [{"device_ip": "192.168.1.20", "device_id": "0",
                                    "device_logical_id": "0"}]}]}


class StatsEngine(FakeEngine):
    """A fake engine with a KV cache of 100 blocks, 7 of them in use."""

    def stats(self) -> EngineStats:
        return EngineStats(num_running=2, num_waiting=1, num_blocks=100,
                           num_free_blocks=93, num_preemptions=0, finished_by_reason={})


@contextlib.asynccontextmanager
async def serve(cfg: PdConfig):
    engine = StatsEngine()
    node = PdNode(cfg, engine)
    server = HttpServer(build_router(engine, pd=node))
    await server.start("127.0.0.1", 0)
    node.inter_comm_port = server.ports[0]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.ports[0]}",
                                 timeout=5.0) as client:
        yield node, client
    await server.close(timeout=1.0)


async def test_status_of_a_mixed_instance():
    async with serve(PdConfig()) as (node, c):
        r = await c.get("/v1/status")
        assert r.status_code == 200
        body = r.json()
        assert body["service"]["roleStatus"] == "RoleReady"
        assert body["service"]["currentRole"] == "none"
        assert body["service"]["interCommPort"] == node.inter_comm_port
        res = body["resource"]
        assert res["availBlockNum"] == res["freeNpuBlockNums"] == 93
        assert res["totalNpuBlockNums"] == 100
        assert res["runningRequestNum"] == 2 and res["waitingRequestNum"] == 1
        assert res["worldSize"] == 1  # [I] the coordinator pairs equal world sizes
        assert body["linkStatus"] == {"peers": []}
        v2 = (await c.get("/v2/status")).json()["resource"]
        assert v2["totalAvailNpuBlockNum"] == res["availBlockNum"]
        assert v2["dpInstMap"] == {"0": res["availBlockNum"]}
        # PD is off: no role can be assigned, /dresult is refused
        r = await c.post("/v1/role/decode", json=ROLE_BODY)
        assert r.status_code == 503
        r = await c.get("/dresult")
        assert r.status_code == 400
        assert r.json()["error"] == "Non DMI does not support dresult request"


async def test_role_assignment_and_the_prefill_gate():
    async with serve(PdConfig(infer_mode="dmi")) as (_node, c):
        st = (await c.get("/v1/status")).json()["service"]
        assert st == {**st, "roleStatus": "RoleUnknown", "currentRole": "none"}
        # no role yet: inference is refused with the spec's 503 (§4.2 step 1)
        r = await c.post("/infer", json={"inputs": "hi"})
        assert r.status_code == 503
        assert r.json()["error"].startswith("The server cannot process the inference")
        r = await c.post("/v1/role/decode", json=ROLE_BODY)
        assert r.status_code == 200 and r.json() == {"result": "ok"}
        body = (await c.get("/v1/status")).json()
        assert body["service"]["currentRole"] == "decode"
        assert body["service"]["roleStatus"] == "RoleReady"
        assert body["linkStatus"]["peers"] == [{"target": "1", "link": "ok"}]
        # a decode instance takes no inference requests (§4.2 step 2)
        r = await c.post("/infer", json={"inputs": "hi"}, headers={
            "req-type": "prefill", "req-id": "1", "d-target": "127.0.0.1"})
        assert r.status_code == 400 and "only to the prefill node" in r.json()["error"]
        # switch to prefill: /dresult is then refused with the role named
        assert (await c.post("/v1/role/prefill", json=ROLE_BODY)).status_code == 200
        r = await c.get("/dresult")
        assert r.status_code == 400
        assert r.json()["error"] == ("Only the Decode node supports dresult but you send "
                                     "to prefill")
        r = await c.post("/v1/pd/decode", json={"reqId": "1"})
        assert r.status_code == 400  # only a decode instance accepts hand-offs
        # flex carries p_percentage
        flex = {**ROLE_BODY, "local": {**ROLE_BODY["local"], "p_percentage": 30}}
        assert (await c.post("/v1/role/flex", json=flex)).status_code == 200
        st = (await c.get("/v1/status")).json()["service"]
        assert st["currentRole"] == "flex" and st["p_percentage"] == 30


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/v1/role/decode", b"not json", 422),
    ("/v1/role/decode", {"local": {"device": []}}, 503),  # no server_ip
    ("/v1/role/decode", {"local": {**ROLE_BODY["local"], "server_ip": "nope"}}, 503),
    ("/v1/role/decode", {"local": {"server_ip": "10.0.0.1", "id": 1, "device": []}}, 503),
    ("/v1/role/decode", {"local": {"server_ip": "10.0.0.1", "device": [
        {"device_ip": "1.2.3.4", "device_id": "x", "device_logical_id": "0"}]}}, 503),
    ("/v1/role/flex", {"local": {**ROLE_BODY["local"], "p_percentage": 101}}, 503),
    ("/v1/role/mixed", ROLE_BODY, 404),
    ("/v2/role/flex", ROLE_BODY, 404),
])
async def test_bad_role_requests_keep_the_previous_role(path, body, status):
    async with serve(PdConfig(infer_mode="dmi", role="decode")) as (node, c):
        if isinstance(body, bytes):
            r = await c.post(path, content=body)
        else:
            r = await c.post(path, json=body)
        assert r.status_code == status
        if status == 422:
            assert r.json() == {"error": "Req body converts to json fail. Reset to previous "
                                "node status.", "error_type": "Input validation error"}
        if status == 503:
            assert r.json()["error"] == "Update pd info failed. Reset to previous node status."
        assert node.role == "decode"


async def test_v2_role_body():
    body = {"local": [{"server_ip": "10.0.0.1", "dp_inst_list": [
        {"dp_inst_id": 0, "device": [{"device_ip": "192.168.1.10", "device_id": "0",
                                      "device_logical_id": "0", "rank_id": "0"}]}]}],
            "peers": [[{"server_ip": "10.0.0.2", "dp_inst_list": []}]]}
    async with serve(PdConfig(infer_mode="dmi")) as (node, c):
        r = await c.post("/v2/role/prefill", json=body)
        assert r.status_code == 200, r.text
        assert node.role == "prefill"
        assert node.links == {"10.0.0.2": "ok"}


def test_decode_requests_outlive_a_gone_dresult_consumer_by_the_bound_only() -> None:
    """D ends its running requests (as a client disconnect would) once no /dresult
    consumer has been connected for ``dresult_orphan_timeout_s``, not before, and never
    while one is connected."""
    from tokenserve.aio import Signal
    from tokenserve.pd.decode import DecodeServer
    from tokenserve.transport.router import Router

    cfg = PdConfig(infer_mode="dmi", role="decode", dresult_orphan_timeout_s=2.0)
    server = DecodeServer(PdNode(cfg, StatsEngine()), Router())
    try:
        gone = Signal()
        server._live["7"] = gone
        server.hub.orphaned_since = None  # a consumer is connected
        assert server.abort_orphans(1e9) == 0 and not gone.is_set()
        server.hub.orphaned_since = 100.0  # it left at t = 100 s
        assert server.abort_orphans(101.9) == 0 and not gone.is_set()
        assert server.abort_orphans(102.0) == 1 and gone.is_set()
    finally:
        server.close()


def test_dresult_orphan_timeout_flag() -> None:
    from tokenserve.cli import build_parser
    from tokenserve.config.flags import serve_config

    args = build_parser().parse_args(["serve", "--role", "decode",
                                      "--dresult-orphan-timeout", "3.5"])
    assert serve_config(args).pd.dresult_orphan_timeout_s == 3.5
    with pytest.raises(ValueError, match="orphan"):
        PdConfig(dresult_orphan_timeout_s=0)
