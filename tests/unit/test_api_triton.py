"""Triton family (spec/interfaces.md §6), /v1/tokenizer (§2.2) and stopInfer (§2.3) over a
real socket with the scripted FakeEngine."""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from tests.fakes import TIMEOUT_MSG, VOCAB, FakeEngine, serve_fake, token_text, wait_for
from tokenserve.messages import FinishReason

M = "fake-model"


@pytest.fixture
async def env() -> AsyncIterator[tuple[FakeEngine, httpx.AsyncClient]]:
    engine = FakeEngine()
    async with serve_fake(engine) as (_, client):
        yield engine, client


def text_of(prompt: list[int], n: int) -> str:
    return "".join(token_text(prompt[i % len(prompt)]) for i in range(n))


def triton_events(raw: bytes) -> list[dict[str, Any]]:
    assert raw.endswith(b"\n\n"), raw[-80:]
    parts = raw.split(b"\n\n")[:-1]
    assert all(p.startswith(b"data:{") for p in parts), raw  # no space (spec §9.4)
    return [orjson.loads(p[len(b"data:"):]) for p in parts]


def infer_body(ids: list[int], **params: Any) -> dict[str, Any]:
    return {"id": "a1", "inputs": [{"name": "input0", "shape": [1, len(ids)],
                                    "datatype": "UINT32", "data": ids,
                                    "parameters": params}],
            "outputs": [{"name": "output0"}]}


# --------------------------------------------------------------------------- infer (§6.4)


async def test_infer_json(env) -> None:
    engine, client = env
    r = await client.post(f"/v2/models/{M}/infer",
                          json=infer_body([5, 6, 7], max_new_tokens=4, temperature=0.5,
                                          top_k=10, top_p=0.95, seed=1, priority=2,
                                          timeout=600, details=False, batch_size=1))
    assert r.status_code == 200, r.text
    assert r.json() == {"id": "a1", "outputs": [{"name": "output0", "shape": [1, 4],
                                                 "datatype": "UINT32", "data": [5, 6, 7, 5]}]}
    req = engine.requests[-1]
    assert req.prompt_token_ids == (5, 6, 7) and req.priority == 2 and req.timeout_s == 600
    p = req.params
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.do_sample) == (
        4, 0.5, 10, 0.95, 1, True)


async def test_infer_tritonclient_style_top_level_params_no_content_type(env) -> None:
    engine, client = env
    body = {"inputs": [{"name": "input0", "shape": [3], "datatype": "UINT32", "data": [1, 2, 3],
                        "parameters": {"max_new_tokens": 2}}],
            "parameters": {"max_new_tokens": 7, "top_k": 3, "binary_data_output": False}}
    r = await client.post(f"/v2/models/{M}/infer", content=orjson.dumps(body))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["outputs"][0]["data"] == [1, 2] and out["outputs"][0]["shape"] == [1, 2]
    assert out["id"] == engine.requests[-1].request_id  # no id: the server's
    assert engine.requests[-1].params.max_new_tokens == 2  # inside inputs[0] wins
    assert engine.requests[-1].params.top_k == 3  # top-level read too


async def test_infer_binary_tensors(env) -> None:
    """Triton's binary tensor extension, as tritonclient sends it by default."""
    _, client = env
    ids = np.array([9, 8, 7, 6], dtype=np.uint32)
    head = orjson.dumps({"inputs": [{"name": "input0", "shape": [1, 4], "datatype": "UINT32",
                                     "parameters": {"binary_data_size": 16}}],
                         "parameters": {"binary_data_output": True, "max_new_tokens": 3}})
    r = await client.post(f"/v2/models/{M}/infer", content=head + ids.tobytes(),
                          headers={"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    meta = orjson.loads(r.content[:n])
    out = meta["outputs"][0]
    assert out["parameters"] == {"binary_data_size": 12} and "data" not in out
    assert np.frombuffer(r.content[n:], dtype="<u4").tolist() == [9, 8, 7]


async def test_tritonclient_against_fake(env) -> None:
    tc = pytest.importorskip("tritonclient.http")
    _, client = env
    url = str(client.base_url).removeprefix("http://").rstrip("/")

    def call() -> tuple[bool, bool, list[int]]:
        c = tc.InferenceServerClient(url=url)
        try:
            inp = tc.InferInput("input0", [1, 3], "UINT32")
            inp.set_data_from_numpy(np.array([[3, 4, 5]], dtype=np.uint32))  # binary
            res = c.infer(M, [inp], request_id="r7", parameters={"max_new_tokens": 5})
            return c.is_server_ready(), c.is_model_ready(M), res.as_numpy("output0").tolist()
        finally:
            c.close()

    ready, model_ready, out = await asyncio.to_thread(call)
    assert ready and model_ready
    assert out == [[3, 4, 5, 3, 4]]


@pytest.mark.parametrize(
    ("mutate", "status"),
    [
        (lambda b: b["inputs"].append(dict(b["inputs"][0])), 422),  # two inputs
        (lambda b: b["inputs"][0].update(datatype="INT32"), 422),
        (lambda b: b["inputs"][0].update(shape=[2, 3]), 422),
        (lambda b: b["inputs"][0].update(shape=[1, 4]), 422),  # len(data) != n
        (lambda b: b["inputs"][0].update(data=[1, 2, VOCAB]), 422),
        (lambda b: b["inputs"][0].update(data=[1, 2.0, 3]), 422),
        (lambda b: b["inputs"][0].update(name="x" * 257), 422),
        (lambda b: b.update(outputs=[{"name": "a"}, {"name": "b"}]), 422),
        (lambda b: b.update(id="bad id!"), 422),
        (lambda b: b["inputs"][0]["parameters"].update(temperature=0), 422),
        (lambda b: b["inputs"][0]["parameters"].update(priority=6), 422),
        (lambda b: b["inputs"][0]["parameters"].update(max_new_tokens=0), 422),
        (lambda b: b["inputs"][0]["parameters"].update(top_p=1.0), 200),  # (0, 1] here
        (lambda b: b["inputs"][0]["parameters"].update(top_k=0), 200),  # [0, 2^31)
        (lambda b: b["inputs"][0]["parameters"].update(typical_p=7), 200),  # not read
        (lambda b: b.update(unknown_key=1), 200),
    ],
)
async def test_infer_validation(env, mutate, status: int) -> None:
    _, client = env
    body = infer_body([1, 2, 3], max_new_tokens=2)
    mutate(body)
    r = await client.post(f"/v2/models/{M}/infer", json=body)
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error_type"] == "Input Validation Error"


async def test_unknown_model_404_before_body(env) -> None:
    _, client = env
    for method, path in [("POST", "infer"), ("POST", "generate"), ("POST", "generate_stream"),
                         ("GET", "ready"), ("GET", "config"), ("POST", "stopInfer")]:
        r = await client.request(method, f"/v2/models/nope/{path}", content=b"not json")
        assert r.status_code == 404, (path, r.text)
        assert r.json() == {"error": "Model nope not found.", "error_type": "NotFoundError"}
    r = await client.post(f"/v2/models/{M}/infer", content=b"{not json")
    assert r.status_code == 422


# --------------------------------------------------------------------------- generate (§6.3)


async def test_generate_non_stream(env) -> None:
    engine, client = env
    r = await client.post(f"/v2/models/{M}/generate",
                          json={"id": "g-1", "text_input": "abc",
                                "parameters": {"max_new_tokens": 5, "details": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "g-1" and out["model_name"] == M and out["model_version"] is None
    assert out["text_output"] == text_of([97, 98, 99], 5)
    d = out["details"]
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 5
    assert d["first_token_cost"] is None and d["decode_cost"] is None
    assert len(d["queue_wait_time"]) == 5 and len(d["batch_size"]) == 5
    r = await client.post(f"/v2/models/{M}/generate", json={"text_input": "ab"})
    assert r.json()["id"] == engine.requests[-1].request_id and "details" not in r.json()
    assert engine.requests[-1].params.max_new_tokens == 20  # default


async def test_generate_max_tokens_alias_and_rules(env) -> None:
    engine, client = env
    url = f"/v2/models/{M}/generate"
    r = await client.post(url, json={"text_input": "ab", "max_tokens": 3})
    assert r.status_code == 200 and engine.requests[-1].params.max_new_tokens == 3
    r = await client.post(url, json={"text_input": "ab", "max_tokens": 3,
                                     "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200 and engine.requests[-1].params.max_new_tokens == 2
    for body in [{"text_input": "ab", "parameters": {"temperature": 0}},
                 {"text_input": "ab", "parameters": {"typical_p": 1.5}},
                 {"text_input": "ab", "max_tokens": 0},
                 {"text_input": ""}, {"parameters": {}}, {"text_input": 5}]:
        r = await client.post(url, json=body)
        assert r.status_code == 422, body
    r = await client.post(url, json={"text_input": "ab", "parameters": {"top_p": 1.0,
                                                                         "top_k": 0}})
    assert r.status_code == 200
    r = await client.post(url, json={"text_input": "x" * 100})  # > MAX_MODEL_LEN - 1
    assert r.status_code == 424


async def test_generate_stream(env) -> None:
    _, client = env
    r = await client.post(f"/v2/models/{M}/generate_stream",
                          json={"id": "s1", "text_input": "xyz",
                                "parameters": {"max_new_tokens": 4, "details": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = triton_events(r.content)
    assert "".join(e["text_output"] for e in events) == text_of([120, 121, 122], 4)
    assert all(e["id"] == "s1" and e["model_name"] == M for e in events)
    assert events[0]["prefill_time"] == 12 and events[0]["decode_time"] is None
    assert events[1]["prefill_time"] is None and events[1]["decode_time"] == 5
    assert [e["details"]["generated_tokens"] for e in events] == [1, 2, 3, 4]
    assert "finish_reason" not in events[0]["details"]
    assert events[-1]["details"]["finish_reason"] == "length"
    r = await client.post(f"/v2/models/{M}/generate_stream",
                          json={"text_input": "xyz", "parameters": {"max_new_tokens": 2}})
    events = triton_events(r.content)
    assert set(events[0]) == {"id", "model_name", "model_version", "text_output"}


async def test_generate_stream_timeout_ends_with_an_error_event(env) -> None:
    engine, client = env
    engine.finish, engine.finish_after = FinishReason.TIMEOUT, 2
    r = await client.post(f"/v2/models/{M}/generate_stream",
                          json={"text_input": "ab", "parameters": {"max_new_tokens": 9}})
    assert r.content.endswith(b'data:{"error":' + orjson.dumps(TIMEOUT_MSG)
                              + b',"error_type":"Incomplete Generation"}\n\n')
    r = await client.post(f"/v2/models/{M}/generate",
                          json={"text_input": "ab", "parameters": {"max_new_tokens": 9}})
    assert r.status_code == 500 and r.json()["error"] == TIMEOUT_MSG


async def test_generate_stream_disconnect_aborts(env) -> None:
    engine, client = env
    engine.delay = 0.05
    async with client.stream("POST", f"/v2/models/{M}/generate_stream",
                             json={"text_input": "ab",
                                   "parameters": {"max_new_tokens": 50}}) as r:
        async for _chunk in r.aiter_bytes():
            break
    rid = engine.requests[-1].request_id
    await wait_for(lambda: rid in engine.aborted)
    assert rid in engine.closed_early


# --------------------------------------------------------------------------- health, metadata


async def test_health_and_metadata(env) -> None:
    engine, client = env
    for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{M}/ready"):
        r = await client.get(path)
        assert r.status_code == 200 and r.content == b"", path
    engine.healthy = False
    assert (await client.get("/v2/health/live")).status_code == 500
    assert (await client.get("/v2/health/ready")).json() == {"message": "Engine is not running."}
    assert (await client.get(f"/v2/models/{M}/ready")).json()["error_type"] == (
        "Incomplete Generation")
    engine.healthy = True
    v2 = (await client.get("/v2")).json()
    assert v2["name"] == "MindIE Server" and set(v2["extensions"]) == {
        "max_iter_times", "prefill_policy_type", "decode_policy_type",
        "max_prefill_batch_size", "max_prefill_tokens"}
    assert (await client.get(f"/v2/models/{M}")).json() == {
        "name": M, "platform": "MindIE Server",
        "inputs": [{"name": "input0", "shape": [-1], "datatype": "UINT32"}],
        "outputs": [{"name": "output0", "shape": [-1], "datatype": "UINT32"}]}
    engine.cfg = types.SimpleNamespace(kv_cache_bytes=3 << 29, device="cpu")  # 1.5 GiB
    cfg = (await client.get(f"/v2/models/{M}/config")).json()
    assert cfg["model_name"] == M and cfg["max_seq_len"] == engine.max_model_len
    assert set(cfg) == {"model_name", "input_datatype", "output_datatype", "max_seq_len",
                        "npu_mem_size", "cpu_mem_size", "world_size", "model_weight_path",
                        "model_instance_type"}
    # a CPU engine: the KV cache is cpu_mem_size (GB), npu_mem_size keeps -1, as /v1/config
    assert engine.info.device == "cpu" and cfg["npu_mem_size"] == -1
    assert cfg["cpu_mem_size"] == 1.5
    slots = (await client.get(f"/v2/models/{M}/getSlotCount")).json()
    assert set(slots) == {"total_slots", "free_slots", "available_tokens_length"}
    assert (await client.get("/v2/models/nope")).status_code == 404


# --------------------------------------------------------------------------- stopInfer (§2.3)


async def test_stop_infer_by_triton_id_stream(env) -> None:
    engine, client = env
    engine.delay = 0.02

    async def run_stream() -> list[dict[str, Any]]:
        r = await client.post(f"/v2/models/{M}/generate_stream",
                              json={"id": "job-7", "text_input": "ab",
                                    "parameters": {"max_new_tokens": 500, "details": True}})
        return triton_events(r.content)

    task = asyncio.create_task(run_stream())
    await wait_for(lambda: len(engine.requests) == 1)
    await asyncio.sleep(0.1)
    body = b'{"id": "job-7"}'
    r = await client.post(f"/v2/models/{M}/stopInfer", content=body)
    assert r.status_code == 200 and r.content == body
    events = await asyncio.wait_for(task, 3)
    assert 1 < len(events) < 100
    assert events[-1]["details"]["finish_reason"] == "stop_sequence"
    rid = engine.requests[-1].request_id
    assert rid in engine.aborted
    r = await client.post(f"/v2/models/{M}/stopInfer", json={"id": "job-7"})
    assert r.status_code == 404 and r.json()["error"] == "RequestId is job-7 not found."


async def test_stop_infer_by_server_id_non_stream_native(env) -> None:
    engine, client = env
    engine.delay = 0.02
    task = asyncio.create_task(client.post(
        "/infer", json={"inputs": "ab", "parameters": {"max_new_tokens": 500,
                                                      "details": True}}))
    await wait_for(lambda: len(engine.requests) == 1)
    await asyncio.sleep(0.05)
    rid = engine.requests[0].request_id
    r = await client.post(f"/v2/models/{M}/stopInfer", json={"id": rid})
    assert r.status_code == 200
    out = (await asyncio.wait_for(task, 3)).json()
    assert out["details"]["finish_reason"] == "stop_sequence"
    assert 0 < out["details"]["generated_tokens"] < 500


async def test_stop_infer_errors(env) -> None:
    _, client = env
    url = f"/v2/models/{M}/stopInfer"
    assert (await client.post(url, json={"id": "nobody"})).status_code == 404
    for body in (b"{", b'{"id": "bad id"}', b'{"id": 5}', b"{}", b"[]"):
        assert (await client.post(url, content=body)).status_code == 422, body


# --------------------------------------------------------------------------- /v1/tokenizer (§2.2)


async def test_tokenizer(env) -> None:
    _, client = env
    r = await client.post("/v1/tokenizer", json={"inputs": "hey"})
    assert r.status_code == 200 and r.json() == {"token_number": 3, "tokens": ["h", "e", "y"]}
    r = await client.post("/v1/tokenizer", json={"inputs": "hey", "do_decode": False})
    assert r.json() == {"token_number": 3, "tokens": [104, 101, 121]}
    for body in (b"nope", b'{"inputs": 5}', b'{"inputs": ""}', b"{}",
                 b'{"inputs": "a", "do_decode": 1}'):
        r = await client.post("/v1/tokenizer", content=body)
        assert r.status_code == 422 and r.json()["error_type"] == "Input Validation Error"
    r = await client.post("/v1/tokenizer", content=b"nope")
    assert r.json()["error"] == "Req body converts to json fail."
