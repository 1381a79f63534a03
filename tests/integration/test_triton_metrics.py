"""Triton family (spec/interfaces.md §6), stopInfer (§2.3) and /metrics (§7.7) with the
real default model over a real socket."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.sse import read_sse

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def client(server_client):
    """Every test here runs against a mixed server and against PD (conftest ``server``)."""
    return server_client


def addr(server) -> str:
    return server.url.removeprefix("http://")


def prompt_text(server, user: str) -> str:
    return server.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True)


async def stream_events(client, model: str, body: dict) -> list[dict]:
    # no space after "data:" on Triton streams (spec §9.4)
    return await read_sse(client, f"/v2/models/{model}/generate_stream", body, b"data:")


async def scrape(client) -> dict[str, float]:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return {s.name: s.value for fam in text_string_to_metric_families(r.text)
            for s in fam.samples if "le" not in s.labels}


async def test_tritonclient_ready_and_infer(server):
    import tritonclient.http as tc

    model = server.engine.model_name
    ids = server.chat_ids("What is the capital of France?")

    def call() -> tuple[bool, bool, list[int], list[int]]:
        c = tc.InferenceServerClient(url=addr(server), network_timeout=120)
        try:
            inp2 = tc.InferInput("input0", [len(ids)], "UINT32")
            inp2.set_data_from_numpy(np.array(ids, dtype=np.uint32), binary_data=False)
            res2 = c.infer(model, [inp2], outputs=[tc.InferRequestedOutput(
                "output0", binary_data=False)], parameters={"max_new_tokens": 12})
            out2 = res2.as_numpy("output0").ravel().tolist()
            # binary tensors (Triton's binary extension, the client's default) in and out;
            # PD: the body travels base64 to D, the answer's bytes back (pd/wire.py)
            inp = tc.InferInput("input0", [1, len(ids)], "UINT32")
            inp.set_data_from_numpy(np.array([ids], dtype=np.uint32))
            res = c.infer(model, [inp], request_id="tc1", parameters={"max_new_tokens": 12})
            assert res.get_response()["id"] == "tc1"
            out = res.as_numpy("output0").ravel().tolist()
            # one token: the answer is P's (it finishes before a hand-off)
            res1 = c.infer(model, [inp], parameters={"max_new_tokens": 1})
            assert res1.as_numpy("output0").ravel().tolist() == out[:1]
            return c.is_server_ready(), c.is_model_ready(model), out, out2
        finally:
            c.close()

    ready, model_ready, out, out2 = await asyncio.to_thread(call)
    assert ready and model_ready
    assert 0 < len(out) <= 12 and out == out2  # greedy: same ids either encoding
    assert "Paris" in server.engine.tokenizer.decode(out)
    await server.assert_idle_and_leak_free()


async def test_generate_stream_equals_non_stream(server, client):
    model = server.engine.model_name
    body = {"id": "eq-1", "text_input": prompt_text(server, "Explain what a cat is."),
            "parameters": {"max_new_tokens": 12, "details": True}}
    r = await client.post(f"/v2/models/{model}/generate", json=body)
    assert r.status_code == 200, r.text
    full = r.json()
    assert full["id"] == "eq-1" and full["model_name"] == model
    events = await stream_events(client, model, body)
    assert "".join(e["text_output"] for e in events) == full["text_output"]
    assert events[-1]["details"]["finish_reason"] == full["details"]["finish_reason"]
    assert events[-1]["details"]["generated_tokens"] == full["details"]["generated_tokens"]
    assert events[0]["prefill_time"] is not None and events[1]["decode_time"] is not None


async def test_generate_stream_chinese_emoji_utf8(server, client):
    model = server.engine.model_name
    body = {"text_input": "你好，世界！🌍🚀 我爱北京。😀\n" * 3, "max_tokens": 24}
    events = await stream_events(client, model, body)
    text = "".join(e["text_output"] for e in events)
    assert len({e["id"] for e in events}) == 1  # the server's id, one per response
    assert all("\ufffd" not in e["text_output"] for e in events)
    assert any(ord(c) > 0xFFFF for c in text), text
    assert any("\u4e00" <= c <= "\u9fff" for c in text), text


async def test_generate_stream_disconnect_frees_kv_blocks(server):
    model = server.engine.model_name
    body = {"text_input": prompt_text(server, "Write a very long essay about Rome."),
            "parameters": {"max_new_tokens": 400}}
    await server.disconnect_mid_stream(f"/v2/models/{model}/generate_stream", body)


async def test_stop_infer_stops_running_stream(server, client):
    model = server.engine.model_name
    body = {"id": "stop-me-1", "text_input": prompt_text(server, "Count from 1 to 1000."),
            "parameters": {"max_new_tokens": 400, "details": True}}
    aborted_before = await server.aborted()
    events: list[dict] = []
    first = asyncio.Event()

    async def run() -> None:
        async with (httpx.AsyncClient(base_url=server.url, timeout=60) as c,
                    c.stream("POST", f"/v2/models/{model}/generate_stream", json=body) as r):
            buf = b""
            async for chunk in r.aiter_bytes():
                buf += chunk
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    events.append(orjson.loads(ev[len(b"data:"):]))
                    first.set()

    task = asyncio.create_task(run())
    await asyncio.wait_for(first.wait(), 60)
    r = await client.post(f"/v2/models/{model}/stopInfer", json={"id": "stop-me-1"})
    assert r.status_code == 200 and r.json() == {"id": "stop-me-1"}
    await asyncio.wait_for(task, 30)
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert events[-1]["details"]["generated_tokens"] < 400
    await server.assert_idle_and_leak_free()
    assert await server.aborted_at_least(aborted_before + 1) == aborted_before + 1
    r = await client.post(f"/v2/models/{model}/stopInfer", json={"id": "stop-me-1"})
    assert r.status_code == 404


async def test_metrics_count_requests(server, client):
    model = server.engine.model_name
    if server.kind == "pd":  # the coordinator's cluster series and the instances' own
        await pd_metrics_count_requests(server, client, model)
        return
    before = await scrape(client)
    n = 3
    for i in range(n):
        r = await client.post(f"/v2/models/{model}/generate",
                              json={"text_input": f"Say {i}.", "parameters": {"max_new_tokens": 4}})
        assert r.status_code == 200
    await server.assert_idle_and_leak_free()
    after = await scrape(client)
    assert after["request_received_total"] - before["request_received_total"] == n
    assert after["request_success_total"] - before["request_success_total"] == n
    ttft = "time_to_first_token_seconds_count"
    assert after[ttft] - before[ttft] == n
    assert after["generation_tokens_total"] - before["generation_tokens_total"] >= n
    assert after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0
    assert after["cpu_cache_usage_perc"] == 0  # idle: every KV block free
    r = await client.get("/metrics-json")
    assert r.status_code == 200 and r.json()["resultType"] == "vector"


async def sums(client) -> dict[str, float]:
    """Every sample name of ``client``'s /metrics -> the sum over its series (what a
    dashboard's ``sum(request_received_total)`` gives)."""
    r = await client.get("/metrics")
    assert r.status_code == 200
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if "le" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def pd_metrics_count_requests(server, client, model: str) -> None:
    """PD's equivalent of the counts below (issue 40). On the coordinator, MindIE's names
    are the cluster's: each of the N requests received and succeeding once, one TTFT and
    one e2e observation each, so a sum over a name counts a request once (before, P's
    and D's series had those names too: 2N). The instances' own series are there as
    ``instance_*``; on P's and D's own /metrics each request is received and succeeds
    once (on P the hand-off counts as a success)."""
    insts = [httpx.AsyncClient(base_url=i.url, timeout=30)
             for i in (server.pair.p, server.pair.d)]
    try:
        before = [await scrape(c) for c in insts]
        coord_before = await sums(client)
        n = 3
        for i in range(n):
            r = await client.post(f"/v2/models/{model}/generate",
                                  json={"text_input": f"Say {i}.",
                                        "parameters": {"max_new_tokens": 4}})
            assert r.status_code == 200
        await server.assert_idle_and_leak_free()
        coord = await sums(client)
        for name in ("request_received_total", "request_success_total",
                     "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count"):
            assert coord[name] - coord_before.get(name, 0.0) == n, name
        assert coord["request_failed_total"] == coord_before.get("request_failed_total", 0)
        assert coord["request_received_total"] == \
            coord["request_success_total"] + coord["request_failed_total"]
        assert "instance_request_received_total" in coord  # P's and D's, by instance
        for c, b in zip(insts, before, strict=True):
            a = await scrape(c)
            assert a["request_received_total"] - b["request_received_total"] == n
            assert a["request_success_total"] - b["request_success_total"] == n
            assert a["num_requests_running"] == 0 and a["num_requests_waiting"] == 0
            assert a["cpu_cache_usage_perc"] == 0
    finally:
        for c in insts:
            await c.aclose()


async def test_triton_metadata_and_tokenizer(server, client):
    model = server.engine.model_name
    cfg = (await client.get(f"/v2/models/{model}/config")).json()
    assert cfg["max_seq_len"] == server.engine.max_model_len
    await server.assert_idle_and_leak_free()
    r = await client.get(f"/v2/models/{model}/getSlotCount")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    slots = r.json()
    assert set(slots) == {"total_slots", "free_slots", "available_tokens_length"}
    if server.kind == "mixed":
        assert slots["total_slots"] == slots["free_slots"] == server.engine.cfg.max_batch_size
        st = server.engine.stats()
        assert slots["available_tokens_length"] == st.num_free_blocks * server.engine.cfg.block_size
    else:  # [I] a cluster's slots are its decode instances' (coordinator/capacity.py)
        async with httpx.AsyncClient(base_url=server.pair.d.url, timeout=30) as c:
            d_slots = (await c.get(f"/v2/models/{model}/getSlotCount")).json()
        assert d_slots["total_slots"] == server.engine.cfg.max_batch_size
        assert slots == d_slots  # the pair's one D
        assert slots["free_slots"] == slots["total_slots"]  # idle
    r = await client.get("/v2/models/no-such-model/getSlotCount")
    assert r.status_code == 404 and "error" in r.json()
    r = await client.post("/v1/tokenizer", json={"inputs": "Hello world"})
    assert r.status_code == 200
    out = r.json()
    assert out["token_number"] == len(out["tokens"]) and "".join(out["tokens"]) == "Hello world"


async def test_health_timed_and_metrics_json(server, client):
    """``/health/timed``, ``/health/timed-{n}`` and ``/metrics-json`` (spec §3.6, §7.6)
    answer on PD's coordinator what a mixed server answers (PD: a P's, issue 22)."""
    for path in ("/health/timed", "/health/timed-1"):
        r = await client.get(path)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["content-type"].startswith("application/json")
        assert r.json() == {"status": "healthy"}
    r = await client.get("/health/timed-x")
    assert r.status_code == 404
    r = await client.get("/metrics-json")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["resultType"] == "vector" and body["result"]
    names = {m["metric"][0]["__name__"] for m in body["result"]}
    assert names == {"TTFT", "TBT", "waitingInferRequestNum", "processingInferRequestNum",
                     "remainBlocks"}
    await server.assert_idle_and_leak_free()
