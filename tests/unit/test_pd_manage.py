"""The coordinator's instance states and management routes (spec/pd_disaggregation.md
§9.4): the pure state function and body parsers without sockets, then the routes on the
management port in front of fake P and D servers (tests/unit/test_pd_coordinator.py)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest

from tests.unit.test_pd_coordinator import (
    D_LAST_JSON,
    MODEL,
    FakeD,
    bounded,
    cluster,
    free_port,
    p_answer,
    relay_script,
    until,
)
from tokenserve.config.tree import InstanceAddr
from tokenserve.coordinator.manage import parse_ids, parse_members, parse_refresh
from tokenserve.coordinator.pool import D_ROLES, P_ROLES, Instance

READY_P = {"service": {"currentRole": "prefill", "roleStatus": "RoleReady"}}
READY_D = {"service": {"currentRole": "decode"}}


def test_instance_states() -> None:
    p = Instance(InstanceAddr("h", 1), P_ROLES)
    assert p.state() == "joining" and not p.usable()
    p.polled = True
    assert p.state() == "unreachable"
    p.status = READY_P
    assert p.state() == "ready" and p.usable()
    p.status = {"service": {"currentRole": "decode"}}  # switched away by POST /v1/role
    assert p.state() == "not-ready"
    p.status = {"service": {"currentRole": "flex", "roleStatus": "RoleSwitching"}}
    assert p.state() == "not-ready"
    p.status, p.offline = READY_P, True
    assert p.state() == "offline" and not p.usable()
    d = Instance(InstanceAddr("h", 2), D_ROLES, status=READY_D, polled=True)
    assert d.state() == "unlinked"
    d.link_up = True
    assert d.state() == "ready"
    d.status = {"service": {"currentRole": "flex"}}  # a flex instance serves as D too
    assert d.state() == "ready"


def test_membership_bodies() -> None:
    ms = parse_members({"prefill": ["10.0.0.1:1025@1026"], "decode": ["[::1]:7"]})
    assert [(m.kind, m.addr) for m in ms] == [
        ("prefill", InstanceAddr("10.0.0.1", 1025, 1026)), ("decode", InstanceAddr("::1", 7))]
    for bad in ({}, {"prefill": "a:1"}, {"decode": [1]}, {"decode": ["nope"]}):
        with pytest.raises(ValueError):
            parse_members(bad)
    refresh = {"ids": [1, 2], "instances": [
        {"id": 1, "ip": "10.0.0.1", "port": 1025, "static_info": {"role": ord("P")}},
        {"id": 2, "ip": "10.0.0.2", "port": 1025, "management_port": 1026,
         "static_info": {"role": ord("F")}}]}
    got = [(m.kind, m.addr, m.ident) for m in parse_refresh(refresh)]
    assert got == [("prefill", InstanceAddr("10.0.0.1", 1025), "1"),
                   ("prefill", InstanceAddr("10.0.0.2", 1025, 1026), "2"),
                   ("decode", InstanceAddr("10.0.0.2", 1025, 1026), "2")]
    for bad in ({}, {"instances": [{"ip": "x", "port": 1}]},
                {"instances": [{"ip": "x", "port": "1", "static_info": {"role": 80}}]}):
        with pytest.raises(ValueError):
            parse_refresh(bad)
    assert parse_ids({"ids": ["a:1", 3]}) == ["a:1", "3"]
    with pytest.raises(ValueError):
        parse_ids({"ids": "a:1"})


@bounded
async def test_state_changes_are_logged_once_each(caplog) -> None:
    caplog.set_level(logging.INFO, "tokenserve.coordinator.pool")
    async with cluster() as cl:
        d = cl.ds[0]
        name = f"127.0.0.1:{d.port} (decode)"
        d.kill()
        await until(lambda: "ready -> unlinked" in caplog.text
                    or "ready -> unreachable" in caplog.text)
        await asyncio.sleep(0.3)  # several polls of a dead D
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(name)]
    assert lines[0] == f"{name}: joining -> unlinked" or lines[0].endswith("-> ready")
    assert len(lines) == len(set(lines)), lines  # no state logged twice in a row
    assert all("->" in line for line in lines)


def d_ports(cl) -> list[int]:
    """The D of each request the Ps have seen, in arrival order."""
    seen = sorted(((s.headers["req-id"], s) for s in cl.seen), key=lambda x: x[1].at)
    return [int(s.headers["d-port"]) for _, s in seen]


@bounded
async def test_management_port_lists_adds_drains_and_removes() -> None:
    mport = free_port()
    async with cluster(n_p=2, management_port=mport) as cl:
        cl.script(relay_script(cl, False))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{mport}",
                                     timeout=10.0) as m:
            rows = (await m.get("/v1/instances")).json()["instances"]
            assert [(r["kind"], r["state"]) for r in rows] == [
                ("prefill", "ready"), ("prefill", "ready"), ("decode", "ready")]
            assert rows[2]["free_blocks"] == 100
            # the management plane is not on the main port, and inference not here
            assert (await cl.client.get("/v1/instances")).status_code == 404
            assert (await m.post("/infer", json={"inputs": "hi"})).status_code == 404

            # offline the first P: new requests all go to the second
            p0 = f"127.0.0.1:{cl.ps[0].port}"
            assert (await m.post("/v1/instances/offline", json={"ids": [p0]})).json() \
                == {"result": "ok"}
            for _ in range(3):
                r = await cl.client.post("/infer", json={"inputs": "hi"})
                assert r.text == D_LAST_JSON
            assert (len(cl.ps[0].seen), len(cl.ps[1].seen)) == (0, 3)
            assert (await m.post("/v1/instances/online", json={"ids": [p0]})).status_code \
                == 200
            assert (await m.post("/v1/instances/offline", json={"ids": ["x:1"]})) \
                .status_code == 404

            # add a D at run time: it is linked and takes requests
            d2 = FakeD(1000)  # more free blocks: the D of choice
            await d2.start()
            try:
                cl.ds.append(d2)
                r = await m.post("/v1/instances/add",
                                 json={"decode": [f"127.0.0.1:{d2.port}"]})
                assert r.json()["added"] == [f"decode 127.0.0.1:{d2.port}"]
                await until(lambda: d2.linked)
                while not any(row["state"] == "ready" and row["name"].endswith(str(d2.port))
                              for row in (await m.get("/v1/instances")).json()["instances"]):
                    await asyncio.sleep(0.01)
                r = await cl.client.post("/infer", json={"inputs": "hi"})
                assert r.text == D_LAST_JSON
                assert d_ports(cl) == [cl.ds[0].port] * 3 + [d2.port]

                info = (await m.get("/v1/coordinator_info")).json()
                assert info["request_num"] == 0 and len(info["schedule_info"]) == 4
                assert all(row["allocated_slots"] == 0 for row in info["schedule_info"])

                r = await m.post("/v1/instances/remove",
                                 json={"decode": [f"127.0.0.1:{d2.port}"]})
                assert r.json()["removed"] == [f"decode 127.0.0.1:{d2.port}"]
                await until(lambda: not d2.linked)
                r = await cl.client.post("/infer", json={"inputs": "hi"})
                assert d_ports(cl) == [cl.ds[0].port] * 3 + [d2.port, cl.ds[0].port]
                assert (await m.post("/v1/instances/add", json={"decode": "x"})) \
                    .status_code == 400
            finally:
                await d2.close()


def test_coordinator_config_file(tmp_path) -> None:
    from tokenserve.cli import build_parser
    from tokenserve.config.flags import coordinator_config

    f = tmp_path / "coord.json"
    f.write_text('{"prefill": ["10.0.0.1:1025@1026", "10.0.0.2:1025"], '
                 '"decode": "10.0.0.3:1025", "management_port": 1027, "max_retry": 7, '
                 '"schedule_timeout_s": 30}')
    parse = build_parser().parse_args
    cfg = coordinator_config(parse(["coordinator", "--config", str(f), "--max-retry", "2"]))
    assert cfg.prefill == (InstanceAddr("10.0.0.1", 1025, 1026), InstanceAddr("10.0.0.2", 1025))
    assert cfg.decode == (InstanceAddr("10.0.0.3", 1025),)
    assert (cfg.management_port, cfg.max_retry, cfg.schedule_timeout_s) == (1027, 2, 30)
    f.write_text('{"prefill": ["10.0.0.1:1025"], "decode": ["x:1"], "bogus": 1}')
    with pytest.raises(ValueError, match="bogus"):
        coordinator_config(parse(["coordinator", "--config", str(f)]))
    with pytest.raises(ValueError, match="no decode"):
        coordinator_config(parse(["coordinator", "--prefill", "a:1"]))


@bounded
async def test_coordinator_metrics_count_requests_retries_and_failovers() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async def script(p, request):
        rid, d = request.headers["req-id"], cl.d_for(request)
        if len(cl.seen) == 1:  # the first P dies under the first request
            assert p.server is not None
            p.server.force_close()
            await asyncio.sleep(10)
        d.say(rid, ("ids", "1,5"), ("lastData", D_LAST_JSON))
        return 200, p_answer(rid, False)

    async with cluster(n_p=2) as cl:
        cl.script(script)
        assert (await cl.client.post("/infer", json={"inputs": "hi"})).status_code == 200
        assert (await cl.client.post("/infer", json={"inputs": "a"})).status_code == 200
        text = (await cl.client.get("/metrics")).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("coordinator_requests_total",
                    (("route", "mindie.infer"), ("status", "200")))] == 2
    assert samples[("coordinator_retries_total", ())] == 1
    assert samples[("coordinator_failovers_total", (("kind", "prefill"),))] == 1
    mindie = (("model_name", MODEL),)  # the cluster's series: each request once
    assert samples[("request_received_total", mindie)] == 2
    assert samples[("request_success_total", mindie)] == 2
    assert samples[("time_to_first_token_seconds_count", mindie)] == 2
    assert samples[("e2e_request_latency_seconds_count", mindie)] == 2
    assert samples[("coordinator_requests_in_flight", ())] == 0
    outstanding = [k for k in samples if k[0] == "coordinator_instance_outstanding"]
    assert len(outstanding) == 3 and all(samples[k] == 0 for k in outstanding)


async def _settled(cl) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The coordinator's /metrics samples once no request is in flight."""
    from prometheus_client.parser import text_string_to_metric_families

    while True:
        text = (await cl.client.get("/metrics")).text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        if samples[("coordinator_requests_in_flight", ())] == 0:
            return samples
        await asyncio.sleep(0.01)


@bounded
async def test_coordinator_counts_each_request_once_under_mindie_names() -> None:
    """issue 40: the MindIE names on the coordinator are the cluster's, each request
    counted once (P and D each also count it: their series are ``instance_*``, labelled
    by instance); success = the whole 200 answer; P's validation refusal is not counted
    (as on a mixed server); D's error and a client gone are failures, the latter also a
    disconnect; received == success + failed; TTFT per request P answered."""

    async def script(p, request):
        rid, d = request.headers["req-id"], cl.d_for(request)
        what = orjson.loads(request.body)["inputs"]
        if what == "bad":
            return 422, b'{"error":"bad","error_type":"Input Validation Error"}'
        if what == "err":
            d.say(rid, ("error", "boom"))
        elif what == "ok":
            d.say(rid, ("ids", "1,5"), ("lastData", D_LAST_JSON))
        stream = what in ("gone", "ok-stream")
        if what == "ok-stream":
            d.say(rid, ("ids", "1,5"), ("lastData", 'data: {"x":1}\n\n'))
        return 200, p_answer(rid, stream, output="data: {}\n\n" if stream else None)

    async with cluster(n_p=2) as cl:
        cl.script(script)
        for p in cl.ps:
            p.received = 5  # what the instances say about themselves
        cl.ds[0].received = 5
        assert (await cl.client.post("/infer", json={"inputs": "ok"})).status_code == 200
        r = await cl.client.post("/infer", json={"inputs": "ok-stream", "stream": True})
        assert r.status_code == 200
        assert (await cl.client.post("/infer", json={"inputs": "bad"})).status_code == 422
        assert (await cl.client.post("/infer", json={"inputs": "err"})).status_code == 500
        async with cl.client.stream("POST", "/infer",
                                    json={"inputs": "gone", "stream": True}) as s:
            async for _ in s.aiter_bytes():
                break  # hang up after P's first event: D never finishes it
        await until(lambda: any(d.stops for d in cl.ds))
        samples = await _settled(cl)
        names = {f"127.0.0.1:{f.port}": k for k, fs in (("prefill", cl.ps), ("decode", cl.ds))
                 for f in fs}
    cluster_lbl = (("model_name", MODEL),)

    def at(name: str) -> float:
        return samples[(name, cluster_lbl)]

    assert at("request_received_total") == 4  # the 422 never reached an engine
    assert at("request_success_total") == 2 and at("request_failed_total") == 2
    assert at("request_received_total") == \
        at("request_success_total") + at("request_failed_total")
    assert at("request_disconnected_total") == 1
    assert at("failed_request_perc") == 0.5
    assert at("time_to_first_token_seconds_count") == 4  # P answered each of the 4
    assert at("e2e_request_latency_seconds_count") == 4
    # a sum over a MindIE name is the cluster's: no instance series under it
    assert sum(v for (n, _), v in samples.items() if n == "request_received_total") == 4
    inst = {dict(lbl)["instance"]: (dict(lbl)["kind"], v) for (n, lbl), v in samples.items()
            if n == "instance_request_received_total"}
    assert inst == {name: (kind, 5.0) for name, kind in names.items()}


@bounded
async def test_starts_with_instances_down_and_is_ready_once_a_p_and_a_d_answer() -> None:
    async with cluster(ready=False, relink_backoff_max_s=0.05) as cl:
        d = cl.ds[0]
        d.alive = False
        await asyncio.sleep(0.2)
        assert (await cl.client.get("/v1/readiness")).status_code == 503
        r = await cl.client.post("/infer", json={"inputs": "hi"})
        assert r.status_code == 503
        # a request the coordinator refuses itself is counted by its route and status
        assert ('coordinator_requests_total{route="mindie.infer",status="503"} 1.0'
                in (await cl.client.get("/metrics")).text)
        d.alive = True  # D comes up: linked and polled, the coordinator is ready
        await until(lambda: d.linked)
        while (await cl.client.get("/v1/readiness")).status_code != 200:
            await asyncio.sleep(0.01)
        rows = (await cl.client.get("/v1/instances")).json()["instances"]
        assert [r["state"] for r in rows] == ["ready", "ready"]


class SwitchingD(FakeD):
    """An instance whose role a controller switches (POST /v1/role): its status says
    the role, and /dresult answers only while it decodes."""

    def __init__(self) -> None:
        super().__init__(100)
        self.role = "prefill"

    async def _status(self, request, response) -> None:
        await response.send_json(200, {
            "service": {"roleStatus": "RoleReady", "currentRole": self.role,
                        "ipAddress": "127.0.0.1", "interCommPort": self.port},
            "resource": {"availSlotsNum": 10, "availBlockNum": self.blocks}})

    async def _dresult(self, request, response) -> None:
        if self.role not in ("decode", "flex"):
            from tokenserve.transport.errors import HttpError

            raise HttpError(400, "Only the Decode node supports dresult")
        await super()._dresult(request, response)


@bounded
async def test_an_instance_switched_to_decode_is_picked_up() -> None:
    async with cluster(relink_backoff_max_s=0.05) as cl:
        x = SwitchingD()
        await x.start()
        try:
            name = f"127.0.0.1:{x.port}"
            r = await cl.client.post("/v1/instances/add",
                                     json={"prefill": [name], "decode": [name]})
            assert len(r.json()["added"]) == 2

            async def states() -> dict[str, str]:
                rows = (await cl.client.get("/v1/instances")).json()["instances"]
                return {r["kind"]: r["state"] for r in rows if r["name"] == name}

            while await states() != {"prefill": "ready", "decode": "not-ready"}:
                await asyncio.sleep(0.01)
            x.role = "decode"  # the controller switched it
            while await states() != {"prefill": "not-ready", "decode": "ready"}:
                await asyncio.sleep(0.01)
            assert x.linked
        finally:
            await x.close()
