"""TGI family (spec/interfaces.md §3) over a real socket with the fake engine:
``POST /generate`` (TGI side), ``POST /generate_stream``, ``POST /``, ``GET /info``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest

from tests.fakes import MAX_MODEL_LEN, TIMEOUT_MSG, FakeEngine, serve_fake, token_text, wait_for
from tests.sse import sse_events
from tokenserve.messages import FinishReason
from tokenserve.transport.server import HttpServer


@pytest.fixture
async def env() -> AsyncIterator[tuple[FakeEngine, HttpServer, httpx.AsyncClient]]:
    engine = FakeEngine()
    async with serve_fake(engine) as (server, client):
        yield engine, server, client


def gen(text: str, n: int) -> str:
    """What the fake engine answers to ``text`` (ids = ord(c), cycled)."""
    ids = [ord(c) for c in text]
    return "".join(token_text(ids[i % len(ids)]) for i in range(n))


def null_tokens(ids: list[int]) -> list[dict[str, Any]]:
    return [{"id": i, "logprob": None, "special": None, "text": None} for i in ids]


# --------------------------------------------------------------------------- non-stream


async def test_generate_plain(env) -> None:
    engine, _, client = env
    r = await client.post("/generate", json={"inputs": "Hi!"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"generated_text": gen("Hi!", 20)}  # max_new_tokens default 20
    p = engine.requests[-1].params
    assert p.max_new_tokens == 20 and p.do_sample is False and p.stop == ()


async def test_generate_details_shape(env) -> None:
    _, _, client = env
    body = {"inputs": "abc", "parameters": {"details": True, "max_new_tokens": 4, "seed": 42}}
    r = await client.post("/generate", json=body)
    obj = r.json()
    assert list(obj) == ["details", "generated_text"]  # details first (spec §3.3)
    d = obj["details"]
    assert list(d) == [
        "prompt_tokens", "finish_reason", "generated_tokens", "prefill", "seed", "tokens",
    ]
    assert d == {
        "prompt_tokens": 3,
        "finish_reason": "length",
        "generated_tokens": 4,
        "prefill": [],
        "seed": 42,
        "tokens": null_tokens([97, 98, 99, 97]),
    }
    assert list(d["tokens"][0]) == ["id", "logprob", "special", "text"]
    assert obj["generated_text"] == gen("abc", 4)


async def test_decoder_input_details_alone_gives_details(env) -> None:
    _, _, client = env
    body = {"inputs": "xy", "parameters": {"decoder_input_details": True, "max_new_tokens": 1}}
    d = (await client.post("/generate", json=body)).json()["details"]
    # the fake engine's prompt logprobs: position i -> -i; text: the token's own
    assert d["prefill"] == [{"id": 120, "logprob": None, "special": None, "text": "x"},
                            {"id": 121, "logprob": -1.0, "special": None, "text": "y"}]
    assert d["tokens"] == null_tokens([120])


async def test_random_seed_echoed_and_eos(env) -> None:
    engine, _, client = env
    engine.finish, engine.finish_after = FinishReason.EOS, 2
    r = await client.post("/generate", json={"inputs": "a", "parameters": {"details": True}})
    d = r.json()["details"]
    assert d["finish_reason"] == "eos_token" and d["generated_tokens"] == 2
    assert isinstance(d["seed"], int) and d["seed"] == engine.requests[-1].params.seed


async def test_return_full_text(env) -> None:
    _, _, client = env
    params = {"return_full_text": True, "max_new_tokens": 3}
    r = await client.post("/generate", json={"inputs": "ab", "parameters": params})
    assert r.json() == {"generated_text": "ab " + gen("ab", 3)}
    r = await client.post("/generate_stream", json={"inputs": "ab", "parameters": params})
    events = sse_events(r.content)
    assert events[-1]["generated_text"] == "ab " + gen("ab", 3)
    assert [e["token"]["text"] for e in events] == list(gen("ab", 3))  # deltas unprefixed


async def test_truncate_keeps_last_tokens(env) -> None:
    engine, _, client = env
    body = {"inputs": "abcdef", "parameters": {"truncate": 2, "max_new_tokens": 1, "details": True}}
    r = await client.post("/generate", json=body)
    assert engine.requests[-1].prompt_token_ids == (ord("e"), ord("f"))
    assert r.json()["details"]["prompt_tokens"] == 2
    body["parameters"]["truncate"] = 100  # longer than the prompt: no-op
    await client.post("/generate", json=body)
    assert len(engine.requests[-1].prompt_token_ids) == 6
    # a prompt too long for the context fits once truncated
    long = {"inputs": "x" * MAX_MODEL_LEN, "parameters": {"max_new_tokens": 1}}
    assert (await client.post("/generate", json=long)).status_code == 424
    long["parameters"]["truncate"] = 10
    assert (await client.post("/generate", json=long)).status_code == 200


async def test_parameter_mapping(env) -> None:
    engine, _, client = env
    params = {
        "temperature": 0.7, "top_k": 10, "top_p": 0.9, "repetition_penalty": 1.1, "seed": 5,
        "typical_p": 0.5, "watermark": False, "max_new_tokens": 2, "stop": ["\n", "END"],
    }
    r = await client.post("/generate", json={"inputs": "a", "parameters": params})
    assert r.status_code == 200, r.text
    p = engine.requests[-1].params
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.seed) == (0.7, 10, 0.9, 1.1, 5)
    assert p.do_sample is True and p.stop == ("\n", "END") and p.max_new_tokens == 2
    r = await client.post("/generate", json={"inputs": "a", "parameters": {"stop": "x"}})
    assert engine.requests[-1].params.stop == ("x",)
    for stop in (None, []):
        r = await client.post("/generate", json={"inputs": "a", "parameters": {"stop": stop}})
        assert r.status_code == 200 and engine.requests[-1].params.stop == ()


@pytest.mark.parametrize(
    ("params", "expected"),
    [({}, False), ({"temperature": 0.5}, True), ({"top_k": 3}, True), ({"top_p": 0.5}, True),
     ({"do_sample": True}, True), ({"do_sample": False, "temperature": 0.5}, False)],
)
async def test_do_sample_rule(env, params: dict[str, Any], expected: bool) -> None:
    engine, _, client = env
    body = {"inputs": "a", "parameters": {**params, "max_new_tokens": 1}}
    assert (await client.post("/generate", json=body)).status_code == 200
    assert engine.requests[-1].params.do_sample is expected


async def test_unsupported_fields_ignored(env) -> None:
    engine, _, client = env
    params = {
        "best_of": 3, "n": 2, "top_n_tokens": 5, "ignore_eos_token": True,
        "grammar": {"type": "json", "value": {"type": "object"}}, "frequency_penalty": 1.5,
        "something_new": [1, 2], "max_new_tokens": 2,
    }
    r = await client.post("/generate", json={"inputs": "a", "parameters": params, "extra": 1})
    assert r.status_code == 200 and len(engine.requests) == 1


async def test_adapter_id(env) -> None:
    _, _, client = env
    ok = {"inputs": "a", "parameters": {"adapter_id": "fake-model", "max_new_tokens": 1}}
    assert (await client.post("/generate", json=ok)).status_code == 200
    for bad in ("other-lora", "bad id!"):
        body = {"inputs": "a", "parameters": {"adapter_id": bad}}
        assert (await client.post("/generate", json=body)).status_code == 422


async def test_generate_ignores_stream_flag(env) -> None:
    _, _, client = env
    body = {"inputs": "a", "stream": True, "parameters": {"max_new_tokens": 2}}
    r = await client.post("/generate", json=body)
    assert r.headers["content-type"] == "application/json" and r.json() == {"generated_text": gen("a", 2)}


async def test_root_non_stream_is_array_and_stream_is_sse(env) -> None:
    _, _, client = env
    body: dict[str, Any] = {"inputs": "ab", "parameters": {"max_new_tokens": 3, "details": True}}
    r = await client.post("/", json=body)
    obj = r.json()
    assert isinstance(obj, list) and len(obj) == 1
    assert obj[0]["generated_text"] == gen("ab", 3) and obj[0]["details"]["generated_tokens"] == 3
    body["stream"] = True
    r = await client.post("/", json=body)
    assert r.headers["content-type"] == "text/event-stream"
    assert sse_events(r.content)[-1]["generated_text"] == gen("ab", 3)
    body["stream"] = "yes"
    assert (await client.post("/", json=body)).status_code == 422


# --------------------------------------------------------------------------- stream


async def test_stream_shape(env) -> None:
    _, _, client = env
    r = await client.post("/generate_stream", json={"inputs": "abc", "parameters": {"max_new_tokens": 4}})
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    assert r.headers["transfer-encoding"] == "chunked"
    assert b"[DONE]" not in r.content
    events = sse_events(r.content)
    assert len(events) == 4
    for ev, tok in zip(events[:-1], [97, 98, 99], strict=True):
        assert list(ev) == ["token", "generated_text", "details"]
        assert list(ev["token"]) == ["id", "text", "logprob", "special"]
        assert ev == {
            "token": {"id": [tok], "text": token_text(tok), "logprob": None, "special": None},
            "generated_text": None,
            "details": None,
        }
    last = events[-1]
    assert last["token"] == {"id": [97], "text": token_text(97), "logprob": None, "special": None}
    assert last["generated_text"] == gen("abc", 4) and last["details"] is None


async def test_stream_details(env) -> None:
    _, _, client = env
    body = {"inputs": "ab", "parameters": {"max_new_tokens": 3, "details": True, "seed": 9}}
    last = sse_events((await client.post("/generate_stream", json=body)).content)[-1]
    assert list(last["details"]) == ["prompt_tokens", "finish_reason", "generated_tokens", "seed"]
    assert last["details"] == {
        "prompt_tokens": 2, "finish_reason": "length", "generated_tokens": 3, "seed": 9,
    }


async def test_stream_rejects_decoder_input_details(env) -> None:
    engine, _, client = env
    params = {"decoder_input_details": True}
    r = await client.post("/generate_stream", json={"inputs": "a", "parameters": params})
    assert r.status_code == 422 and r.json()["error_type"] == "Input Validation Error"
    r = await client.post("/", json={"inputs": "a", "stream": True, "parameters": params})
    assert r.status_code == 422
    assert engine.requests == []
    r = await client.post("/", json={"inputs": "a", "parameters": {**params, "max_new_tokens": 1}})
    assert r.status_code == 200


# --------------------------------------------------------------------------- validation

BAD: list[tuple[str, Any]] = [
    ("no inputs", {"parameters": {}}),
    ("null inputs", {"inputs": None}),
    ("inputs empty", {"inputs": ""}),
    ("inputs number", {"inputs": 5}),
    ("inputs image", {"inputs": [{"type": "image_url", "image_url": "x"}]}),
    ("parameters list", {"inputs": "a", "parameters": [1]}),
    ("temperature 0", {"inputs": "a", "parameters": {"temperature": 0}}),
    ("temperature > FLT_MAX", {"inputs": "a", "parameters": {"temperature": 1e39}}),
    ("temperature string", {"inputs": "a", "parameters": {"temperature": "1"}}),
    ("top_k 0", {"inputs": "a", "parameters": {"top_k": 0}}),
    ("top_k float", {"inputs": "a", "parameters": {"top_k": 2.0}}),
    ("top_k 2^31", {"inputs": "a", "parameters": {"top_k": 2**31}}),
    ("top_p 1.0", {"inputs": "a", "parameters": {"top_p": 1.0}}),
    ("top_p 0", {"inputs": "a", "parameters": {"top_p": 0}}),
    ("typical_p 0", {"inputs": "a", "parameters": {"typical_p": 0}}),
    ("typical_p 1.5", {"inputs": "a", "parameters": {"typical_p": 1.5}}),
    ("do_sample int", {"inputs": "a", "parameters": {"do_sample": 1}}),
    ("seed negative", {"inputs": "a", "parameters": {"seed": -1}}),
    ("seed 2^63", {"inputs": "a", "parameters": {"seed": 2**63}}),
    ("seed float", {"inputs": "a", "parameters": {"seed": 1.0}}),
    ("repetition_penalty 0", {"inputs": "a", "parameters": {"repetition_penalty": 0}}),
    ("watermark string", {"inputs": "a", "parameters": {"watermark": "no"}}),
    ("max_new_tokens 0", {"inputs": "a", "parameters": {"max_new_tokens": 0}}),
    ("max_new_tokens 2^31", {"inputs": "a", "parameters": {"max_new_tokens": 2**31}}),
    ("max_new_tokens float", {"inputs": "a", "parameters": {"max_new_tokens": 1.5}}),
    ("stop empty string", {"inputs": "a", "parameters": {"stop": ""}}),
    ("stop number", {"inputs": "a", "parameters": {"stop": 5}}),
    ("stop list with number", {"inputs": "a", "parameters": {"stop": ["a", 1]}}),
    ("stop list with empty", {"inputs": "a", "parameters": {"stop": ["a", ""]}}),
    ("stop too long", {"inputs": "a", "parameters": {"stop": "x" * 1025}}),
    ("stop emoji too long", {"inputs": "a", "parameters": {"stop": "😀" * 513}}),  # UTF-16
    ("stop too many", {"inputs": "a", "parameters": {"stop": ["x"] * 1025}}),
    ("stop total too long", {"inputs": "a", "parameters": {"stop": ["x" * 1000] * 33}}),
    ("details string", {"inputs": "a", "parameters": {"details": "true"}}),
    ("decoder_input_details int", {"inputs": "a", "parameters": {"decoder_input_details": 1}}),
    ("return_full_text string", {"inputs": "a", "parameters": {"return_full_text": "y"}}),
    ("truncate 0", {"inputs": "a", "parameters": {"truncate": 0}}),
    ("truncate float", {"inputs": "a", "parameters": {"truncate": 1.5}}),
    ("adapter_id number", {"inputs": "a", "parameters": {"adapter_id": 5}}),
]


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
@pytest.mark.parametrize(("name", "body"), BAD, ids=[b[0] for b in BAD])
async def test_bad_body_422_then_ok(env, path: str, name: str, body: Any) -> None:
    engine, _, client = env
    if path == "/generate" and body.get("inputs") is None:
        pytest.skip("routed by the /generate dispatcher (test_api_vllm)")
    r = await client.post(path, json=body)
    assert r.status_code == 422, (name, r.text)
    obj = r.json()
    assert set(obj) == {"error", "error_type"} and obj["error"]
    assert obj["error_type"] == "Input Validation Error"
    assert engine.requests == []
    ok = await client.post(path, json={"inputs": "a", "parameters": {"max_new_tokens": 1}})
    assert ok.status_code == 200


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
async def test_limits_accepted(env, path: str) -> None:
    _, _, client = env
    params = {
        "stop": ["x" * 1024] * 32, "top_p": 0.999, "typical_p": 1.0, "seed": 2**63 - 1,
        "max_new_tokens": 1, "temperature": 3.4e38,
    }
    r = await client.post(path, json={"inputs": "a", "parameters": params})
    assert r.status_code == 200, r.text
    r = await client.post(path, json={"inputs": "a", "parameters": {"stop": ["x"] * 1024}})
    assert r.status_code == 200


@pytest.mark.parametrize("path", ["/generate_stream", "/"])
async def test_not_json_and_prompt_too_long(env, path: str) -> None:
    _, _, client = env
    r = await client.post(path, content=b'{"inputs": ')
    assert r.status_code == 422 and r.json()["error"].startswith("Failed to parse")
    r = await client.post(path, json={"inputs": "x" * MAX_MODEL_LEN})
    assert r.status_code == 424 and r.json()["error_type"] == "Generation Error"


# --------------------------------------------------------------------------- failures


async def test_timeout_non_stream_and_stream(env) -> None:
    engine, server, client = env
    engine.finish, engine.finish_after = FinishReason.TIMEOUT, 2
    r = await client.post("/generate", json={"inputs": "ab"})
    assert r.status_code == 500
    assert r.json() == {"error": TIMEOUT_MSG, "error_type": "Incomplete Generation"}
    r = await client.post("/generate_stream", json={"inputs": "ab"})
    *events, last = sse_events(r.content)
    assert last == {"error": TIMEOUT_MSG, "error_type": "Incomplete Generation"}
    assert [e["token"]["id"] for e in events] == [[97]]
    await wait_for(lambda: server.num_connections == 0)


async def test_engine_exception(env) -> None:
    engine, _, client = env
    engine.raise_on_generate = True
    r = await client.post("/generate", json={"inputs": "a"})
    assert r.status_code == 500
    r = await client.post("/generate_stream", json={"inputs": "a"})
    assert r.status_code == 200 and b"Engine failure" in r.content


@pytest.mark.parametrize(("path", "extra"), [("/generate_stream", {}), ("/", {"stream": True})])
async def test_disconnect_mid_stream_aborts(env, path: str, extra: dict[str, Any]) -> None:
    engine, _, client = env
    engine.delay = 0.01
    body = {"inputs": "ab", "parameters": {"max_new_tokens": 1000}, **extra}
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
    await engine.wait_aborted_early()


async def test_disconnect_mid_non_stream_aborts(env) -> None:
    engine, server, _ = env
    engine.delay = 0.01
    _, writer = await asyncio.open_connection("127.0.0.1", server.ports[0])
    body = orjson.dumps({"inputs": "a", "parameters": {"max_new_tokens": 1000}})
    writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    await writer.drain()
    await wait_for(lambda: engine.requests)
    writer.close()
    rid = engine.requests[-1].request_id
    await wait_for(lambda: rid in engine.aborted, 1.0)


# --------------------------------------------------------------------------- /info


async def test_info(env) -> None:
    engine, _, client = env
    r = await client.get("/info")
    assert r.status_code == 200
    obj = r.json()
    assert list(obj) == [
        "docker_label", "max_batch_total_tokens", "max_best_of", "max_concurrent_requests",
        "max_stop_sequences", "max_waiting_tokens", "sha", "validation_workers", "version",
        "waiting_served_ratio", "models", "max_input_length",
    ]
    [model] = obj["models"]
    assert list(model) == [
        "model_device_type", "model_dtype", "model_id", "model_pipeline_tag", "model_sha",
        "max_total_tokens",
    ]
    assert model["model_id"] == "fake-model" and model["max_total_tokens"] == MAX_MODEL_LEN
    assert model["model_pipeline_tag"] == "text-generation" and obj["max_best_of"] == 1
    assert obj["max_input_length"] == MAX_MODEL_LEN - 1
    engine.cfg = SimpleNamespace(max_num_batched_tokens=2048, max_batch_size=32, dtype="float32",
                                 device="cpu")  # type: ignore[attr-defined]
    obj = (await client.get("/info")).json()
    assert obj["max_batch_total_tokens"] == 2048 and obj["max_concurrent_requests"] == 32
    assert obj["models"][0]["model_dtype"] == "float32"
    engine.healthy = False
    r = await client.get("/info")
    assert r.status_code == 503 and r.content == b""


# --------------------------------------------------------------------------- real client


async def test_huggingface_hub_client(env) -> None:
    from huggingface_hub import InferenceClient

    _, _, client = env
    hf = InferenceClient(base_url=str(client.base_url).rstrip("/"))
    out = await asyncio.to_thread(hf.text_generation, "abc", details=True, max_new_tokens=4,
                                  seed=3, top_n_tokens=2)
    assert out.generated_text == gen("abc", 4)
    assert out.details.finish_reason == "length" and out.details.seed == 3
    assert [t.id for t in out.details.tokens] == [97, 98, 99, 97]
    toks = await asyncio.to_thread(lambda: list(hf.text_generation("ab", stream=True,
                                                                    max_new_tokens=3)))
    assert "".join(toks) == gen("ab", 3)
    evs = await asyncio.to_thread(lambda: list(hf.text_generation(
        "ab", stream=True, details=True, max_new_tokens=3, stop=["zz"])))
    assert evs[-1].generated_text == gen("ab", 3) and evs[-1].details.generated_tokens == 3
    assert await asyncio.to_thread(hf.text_generation, "ab", max_new_tokens=2) == gen("ab", 2)
