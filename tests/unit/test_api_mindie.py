"""POST /infer and /infer_token (spec/interfaces.md §2.1) over a real socket.

The server runs in the test's event loop on 127.0.0.1:0 with a fake engine that emits one
scripted RequestOutput per token after a small delay.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from tests.fakes import (
    MAX_MODEL_LEN,
    TIMEOUT_MSG,
    VOCAB,
    FakeEngine,
    serve_fake,
    token_text,
    wait_for,
)
from tests.sse import sse_events
from tokenserve.api.family_api import json_depth_exceeds, parse_json
from tokenserve.messages import FinishReason
from tokenserve.server.app import build_router
from tokenserve.transport.runtime import run
from tokenserve.transport.server import HttpServer


@pytest.fixture
async def env() -> AsyncIterator[tuple[FakeEngine, HttpServer, httpx.AsyncClient]]:
    engine = FakeEngine()
    async with serve_fake(engine) as (server, client):
        yield engine, server, client


def expected_text(prompt: list[int], n: int) -> str:
    return "".join(token_text(prompt[i % len(prompt)]) for i in range(n))


# --------------------------------------------------------------------------- non-stream


async def test_non_stream_input_id(env) -> None:
    engine, _, client = env
    r = await client.post(
        "/infer_token", json={"input_id": [1, 2, 3], "parameters": {"max_new_tokens": 5}}
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert "requestuuid" in r.headers
    assert r.json() == {"generated_text": expected_text([1, 2, 3], 5)}
    req = engine.requests[-1]
    assert req.prompt_token_ids == (1, 2, 3)
    assert req.params.max_new_tokens == 5
    assert req.priority == 5 and req.timeout_s is None
    assert req.params.do_sample is False  # nothing given: greedy


async def test_non_stream_text_inputs_and_defaults(env) -> None:
    engine, _, client = env
    r = await client.post("/infer", json={"inputs": "Hi!"})
    assert r.status_code == 200, r.text
    req = engine.requests[-1]
    assert req.prompt_token_ids == (ord("H"), ord("i"), ord("!"))
    assert req.params.max_new_tokens == 20  # default
    assert r.json()["generated_text"] == expected_text(list(req.prompt_token_ids), 20)
    # /infer_token accepts text too (same handler, spec §9.1)
    r = await client.post(
        "/infer_token", json={"inputs": "ok", "parameters": {"max_new_tokens": 2}}
    )
    assert r.status_code == 200 and r.json()["generated_text"] == expected_text([111, 107], 2)


async def test_details_and_parameter_mapping(env) -> None:
    engine, _, client = env
    body = {
        "input_id": [5, 6],
        "parameters": {
            "details": True,
            "max_new_tokens": 4,
            "seed": 123,
            "temperature": 0.7,
            "top_k": 10,
            "top_p": 0.9,
            "repetition_penalty": 1.1,
            "priority": 2,
            "timeout": 600,
            "typical_p": 0.5,
            "watermark": False,
        },
    }
    r = await client.post("/infer", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "generated_text": expected_text([5, 6], 4),
        "details": {
            "finish_reason": "length",
            "generated_tokens": 4,
            "generated_token_ids": [5, 6, 5, 6],
            "seed": 123,
        },
    }
    req = engine.requests[-1]
    p = req.params
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.seed) == (
        0.7,
        10,
        0.9,
        1.1,
        123,
    )
    assert p.do_sample is True  # TGI rule: sampling parameters given
    assert req.priority == 2 and req.timeout_s == 600.0


async def test_random_seed_echoed(env) -> None:
    engine, _, client = env
    r = await client.post(
        "/infer", json={"input_id": [1], "parameters": {"details": True, "seed": None}}
    )
    assert r.status_code == 200
    seed = r.json()["details"]["seed"]
    assert isinstance(seed, int) and seed == engine.requests[-1].params.seed


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, False),
        ({"temperature": 0.5}, True),
        ({"top_k": 3}, True),
        ({"top_p": 0.5}, True),
        ({"do_sample": True}, True),
        ({"do_sample": False, "temperature": 0.5}, False),
        ({"do_sample": None, "top_k": None}, False),
    ],
)
async def test_do_sample_rule(env, params: dict[str, Any], expected: bool) -> None:
    engine, _, client = env
    r = await client.post(
        "/infer", json={"input_id": [1], "parameters": {**params, "max_new_tokens": 1}}
    )
    assert r.status_code == 200, r.text
    assert engine.requests[-1].params.do_sample is expected


async def test_eos_finish_reason(env) -> None:
    engine, _, client = env
    engine.finish, engine.finish_after = FinishReason.EOS, 2
    r = await client.post("/infer", json={"input_id": [7], "parameters": {"details": True}})
    assert r.json()["details"]["finish_reason"] == "eos_token"
    assert r.json()["details"]["generated_tokens"] == 2


async def test_content_type_variants(env) -> None:
    _, _, client = env
    body = orjson.dumps({"input_id": [1], "parameters": {"max_new_tokens": 1}})
    r = await client.post("/infer", content=body)  # no Content-Type [I]
    assert r.status_code == 200, r.text
    r = await client.post(
        "/infer", content=body, headers={"content-type": "application/json; charset=utf-8"}
    )
    assert r.status_code == 200
    r = await client.post("/infer", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 422 and r.json()["error_type"] == "Input Validation Error"


async def test_depth_limit(env) -> None:
    _, _, client = env

    def nested(depth: int) -> dict[str, Any]:  # the object itself is level 1
        inner: Any = 1
        for _ in range(depth - 1):
            inner = [inner]
        return {"input_id": [1], "parameters": {"max_new_tokens": 1}, "x": inner}

    r = await client.post("/infer", json=nested(10))
    assert r.status_code == 200, r.text
    r = await client.post("/infer", json=nested(11))
    assert r.status_code == 422 and r.json()["error_type"] == "Input Validation Error"
    r = await client.post("/infer", content=b"[" * 60000)  # would crash a naive parser
    assert r.status_code == 422


BAD_BODIES: list[tuple[str, bytes, int]] = [
    ("both inputs", b'{"inputs": "a", "input_id": [1]}', 422),
    ("no inputs", b'{"parameters": {}}', 422),
    ("null inputs", b'{"inputs": null, "input_id": null}', 422),
    ("input_id not array", b'{"input_id": "1 2"}', 422),
    ("input_id empty", b'{"input_id": []}', 422),
    ("input_id float", b'{"input_id": [1.5]}', 422),
    ("input_id integral float", b'{"input_id": [1.0]}', 422),
    ("input_id bool", b'{"input_id": [true]}', 422),
    ("input_id string", b'{"input_id": ["1"]}', 422),
    ("input_id >= vocab", b'{"input_id": [1000]}', 422),
    ("input_id negative", b'{"input_id": [-1]}', 422),
    ("input_id huge", b'{"input_id": [18446744073709551616]}', 422),
    ("inputs empty", b'{"inputs": ""}', 422),
    ("inputs number", b'{"inputs": 5}', 422),
    ("inputs image", b'{"inputs": [{"type": "image_url", "image_url": "x"}]}', 422),
    ("inputs bad item", b'{"inputs": [1]}', 422),
    ("top_p 1.0", b'{"input_id": [1], "parameters": {"top_p": 1.0}}', 422),
    ("top_p 0", b'{"input_id": [1], "parameters": {"top_p": 0}}', 422),
    ("top_p string", b'{"input_id": [1], "parameters": {"top_p": "0.5"}}', 422),
    ("temperature 0", b'{"input_id": [1], "parameters": {"temperature": 0}}', 422),
    ("temperature negative", b'{"input_id": [1], "parameters": {"temperature": -1.0}}', 422),
    ("temperature > FLT_MAX", b'{"input_id": [1], "parameters": {"temperature": 1e39}}', 422),
    ("temperature bool", b'{"input_id": [1], "parameters": {"temperature": true}}', 422),
    ("top_k 0", b'{"input_id": [1], "parameters": {"top_k": 0}}', 422),
    ("top_k float", b'{"input_id": [1], "parameters": {"top_k": 2.0}}', 422),
    ("priority 0", b'{"input_id": [1], "parameters": {"priority": 0}}', 422),
    ("priority 6", b'{"input_id": [1], "parameters": {"priority": 6}}', 422),
    ("priority float", b'{"input_id": [1], "parameters": {"priority": 1.0}}', 422),
    ("timeout 0", b'{"input_id": [1], "parameters": {"timeout": 0}}', 422),
    ("timeout 65536", b'{"input_id": [1], "parameters": {"timeout": 65536}}', 422),
    ("timeout float", b'{"input_id": [1], "parameters": {"timeout": 10.5}}', 422),
    ("max_new_tokens 0", b'{"input_id": [1], "parameters": {"max_new_tokens": 0}}', 422),
    (
        "max_new_tokens 2^31",
        b'{"input_id": [1], "parameters": {"max_new_tokens": 2147483648}}',
        422,
    ),
    ("max_new_tokens float", b'{"input_id": [1], "parameters": {"max_new_tokens": 1.5}}', 422),
    ("seed negative", b'{"input_id": [1], "parameters": {"seed": -1}}', 422),
    ("seed 2^63", b'{"input_id": [1], "parameters": {"seed": 9223372036854775808}}', 422),
    ("seed float", b'{"input_id": [1], "parameters": {"seed": 1.0}}', 422),
    ("repetition_penalty 0", b'{"input_id": [1], "parameters": {"repetition_penalty": 0}}', 422),
    ("typical_p 0", b'{"input_id": [1], "parameters": {"typical_p": 0}}', 422),
    ("details string", b'{"input_id": [1], "parameters": {"details": "true"}}', 422),
    ("do_sample int", b'{"input_id": [1], "parameters": {"do_sample": 1}}', 422),
    ("watermark string", b'{"input_id": [1], "parameters": {"watermark": "no"}}', 422),
    ("stream string", b'{"input_id": [1], "stream": "yes"}', 422),
    ("parameters list", b'{"input_id": [1], "parameters": [1]}', 422),
    ("not json", b'{"input_id": [1]', 422),
    ("json array", b'[{"input_id": [1]}]', 422),
    ("json string", b'"hello"', 422),
    ("empty body", b"", 422),
    ("invalid utf-8", b'{"inputs": "\xff\xfe"}', 422),
    ("NaN", b'{"input_id": [1], "parameters": {"temperature": NaN}}', 422),
    ("prompt too long", orjson.dumps({"input_id": [1] * MAX_MODEL_LEN}), 424),
    ("text too long", orjson.dumps({"inputs": "x" * MAX_MODEL_LEN}), 424),
]


@pytest.mark.parametrize(("name", "body", "status"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
async def test_bad_input_then_server_still_serves(env, name: str, body: bytes, status: int) -> None:
    engine, _, client = env
    r = await client.post("/infer", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, (name, r.text)
    obj = r.json()
    assert set(obj) == {"error", "error_type"} and obj["error"]
    assert obj["error_type"] == {422: "Input Validation Error", 424: "Generation Error"}[status]
    if status == 424:
        assert obj["error"].startswith("Failed to enqueue inferRequest.")
    assert engine.requests == []  # rejected before reaching the engine
    ok = await client.post("/infer", json={"input_id": [1], "parameters": {"max_new_tokens": 2}})
    assert ok.status_code == 200


async def test_spec_messages(env) -> None:
    _, _, client = env

    async def err(body: dict[str, Any]) -> str:
        r = await client.post("/infer", json=body)
        assert r.status_code == 422
        return r.json()["error"]

    assert await err({"inputs": "a", "input_id": [1]}) == "Input conflict."
    assert await err({}) == "Not found inputs."
    assert await err({"input_id": 3}) == "Parameter input_id must be an array"
    assert (await err({"input_id": [VOCAB]})).startswith(
        "Data element in param input_id is invalid"
    )
    assert "top_p" in await err({"input_id": [1], "parameters": {"top_p": 1.0}})


async def test_longest_prompt_fits(env) -> None:
    _, _, client = env
    r = await client.post(
        "/infer", json={"input_id": [1] * (MAX_MODEL_LEN - 1), "parameters": {"max_new_tokens": 1}}
    )
    assert r.status_code == 200


async def test_404_405_health(env) -> None:
    engine, _, client = env
    r = await client.post("/nope", json={})
    assert r.status_code == 404 and r.json()["error_type"] == "NotFoundError"
    r = await client.get("/infer")
    assert r.status_code == 405 and set(r.json()) == {"error", "error_type"}
    r = await client.get("/health")
    assert r.status_code == 200 and r.content == b""
    engine.healthy = False
    r = await client.get("/health")
    assert r.status_code == 503 and r.content == b""


async def test_413_then_new_request_ok(env) -> None:
    _, _, client = env
    r = await client.post("/infer", content=b"x" * (64 * 1024 + 1))
    assert r.status_code == 413
    assert r.json() == {"message": "Request body too large. Maximum allowed size is 0.0625MB."}
    ok = await client.post("/infer", json={"input_id": [1], "parameters": {"max_new_tokens": 1}})
    assert ok.status_code == 200


async def test_keep_alive_one_connection(env) -> None:
    _, server, client = env
    for _ in range(3):
        r = await client.post("/infer", json={"input_id": [2], "parameters": {"max_new_tokens": 1}})
        assert r.status_code == 200
    assert server.num_connections == 1


# --------------------------------------------------------------------------- stream


async def test_stream_shape(env) -> None:
    _, _, client = env
    r = await client.post(
        "/infer", json={"input_id": [1, 2, 3], "stream": True, "parameters": {"max_new_tokens": 4}}
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream"
    assert r.headers["transfer-encoding"] == "chunked"
    events = sse_events(r.content)
    assert len(events) == 4
    first, *middle, last = events
    assert list(first) == ["prefill_time", "decode_time", "token"]
    assert isinstance(first["prefill_time"], (int, float)) and first["decode_time"] is None
    assert first["token"] == {"id": [1], "text": token_text(1)}
    for ev, tok in zip(middle, [2, 3], strict=True):
        assert ev["prefill_time"] is None and isinstance(ev["decode_time"], (int, float))
        assert ev["token"] == {"id": [tok], "text": token_text(tok)}
    assert list(last) == ["prefill_time", "decode_time", "generated_text", "details", "token"]
    assert last["prefill_time"] is None and isinstance(last["decode_time"], (int, float))
    assert last["generated_text"] == expected_text([1, 2, 3], 4)
    assert last["details"] is None
    assert last["token"] == {"id": [1], "text": None}


async def test_stream_details(env) -> None:
    engine, _, client = env
    r = await client.post(
        "/infer",
        json={
            "inputs": "ab",
            "stream": True,
            "parameters": {"max_new_tokens": 3, "details": True, "seed": 7},
        },
    )
    last = sse_events(r.content)[-1]
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 3, "seed": 7}
    assert last["generated_text"] == expected_text([97, 98], 3)


async def test_stream_single_token(env) -> None:
    _, _, client = env
    r = await client.post(
        "/infer", json={"input_id": [4], "stream": True, "parameters": {"max_new_tokens": 1}}
    )
    [only] = sse_events(r.content)
    assert isinstance(only["prefill_time"], (int, float)) and only["decode_time"] is None
    assert only["generated_text"] == token_text(4) and only["token"] == {"id": [4], "text": None}


async def test_stream_validation_error_is_json(env) -> None:
    _, _, client = env
    r = await client.post(
        "/infer", json={"input_id": [1], "stream": True, "parameters": {"top_p": 1.0}}
    )
    assert r.status_code == 422 and r.json()["error_type"] == "Input Validation Error"


# --------------------------------------------------------------------------- timeout / errors


async def test_timeout_non_stream_500(env) -> None:
    engine, _, client = env
    engine.finish, engine.finish_after = FinishReason.TIMEOUT, 3
    r = await client.post("/infer", json={"input_id": [1], "parameters": {"timeout": 1}})
    assert r.status_code == 500
    assert r.json() == {"error": TIMEOUT_MSG, "error_type": "Incomplete Generation"}


async def test_timeout_stream_ends_with_an_error_event(env) -> None:
    """[I] (api/errors.py): the family's error event ends a failed stream, then close."""
    engine, server, client = env
    engine.finish, engine.finish_after = FinishReason.TIMEOUT, 3
    r = await client.post("/infer", json={"input_id": [1, 2], "stream": True})
    assert r.status_code == 200
    events = sse_events(r.content)
    assert events[-1] == {"error": TIMEOUT_MSG, "error_type": "Incomplete Generation"}
    events = events[:-1]
    assert [e["token"]["id"] for e in events] == [[1], [2]]
    assert all("generated_text" not in e for e in events)
    await wait_for(lambda: server.num_connections == 0)  # closed after the last chunk
    ok = await client.post("/infer", json={"input_id": [1], "parameters": {"max_new_tokens": 1}})
    assert ok.status_code == 200


async def test_engine_error_non_stream_500(env) -> None:
    engine, _, client = env
    engine.finish, engine.finish_after = FinishReason.ERROR, 1
    r = await client.post("/infer", json={"input_id": [1]})
    assert r.status_code == 500 and r.json() == {
        "error": "boom",
        "error_type": "Incomplete Generation",
    }


async def test_engine_exception_500_and_server_survives(env) -> None:
    engine, _, client = env
    engine.raise_on_generate = True
    r = await client.post("/infer", json={"input_id": [1]})
    assert r.status_code == 500
    assert r.json() == {"error": "Server internal error", "error_type": "Incomplete Generation"}
    r = await client.post("/infer", json={"input_id": [1], "stream": True})
    assert r.status_code == 200 and b"Engine failure" in r.content
    engine.raise_on_generate = False
    ok = await client.post("/infer", json={"input_id": [1], "parameters": {"max_new_tokens": 1}})
    assert ok.status_code == 200


# --------------------------------------------------------------------------- disconnect


async def test_disconnect_mid_stream_aborts(env) -> None:
    engine, _, client = env
    engine.delay = 0.01
    body = {"input_id": [1, 2], "stream": True, "parameters": {"max_new_tokens": 1000}}
    async with client.stream("POST", "/infer", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break  # got one event; leave (closes the connection)
    await engine.wait_aborted_early()


async def test_disconnect_mid_non_stream_aborts(env) -> None:
    engine, server, _ = env
    engine.delay = 0.01
    reader, writer = await asyncio.open_connection("127.0.0.1", server.ports[0])
    body = orjson.dumps({"input_id": [1], "parameters": {"max_new_tokens": 1000}})
    writer.write(
        b"POST /infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    await wait_for(lambda: engine.requests)
    await asyncio.sleep(0.03)
    writer.close()
    await engine.wait_aborted_early()


async def test_generator_that_never_returns_does_not_hang(env) -> None:
    engine, _, client = env
    engine.hang_after_final = True
    r = await client.post("/infer", json={"input_id": [1], "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200
    body = {"input_id": [1], "stream": True, "parameters": {"max_new_tokens": 2}}
    r = await client.post("/infer", json=body)
    assert sse_events(r.content)[-1]["generated_text"] == expected_text([1], 2)
    assert engine.aborted == []  # finished requests are closed, not aborted


async def test_no_abort_after_normal_completion(env) -> None:
    engine, _, client = env
    await client.post("/infer", json={"input_id": [1], "parameters": {"max_new_tokens": 2}})
    await client.post(
        "/infer", json={"input_id": [1], "stream": True, "parameters": {"max_new_tokens": 2}}
    )
    assert engine.aborted == [] and engine.closed_early == []


# --------------------------------------------------------------------------- concurrency


async def test_twenty_parallel_requests(env) -> None:
    engine, _, client = env
    engine.delay = 0.005

    async def one(i: int) -> None:
        prompt = [i + 1, i + 2]
        stream = i % 2 == 0
        r = await client.post(
            "/infer",
            json={"input_id": prompt, "stream": stream, "parameters": {"max_new_tokens": 8}},
        )
        assert r.status_code == 200
        text = sse_events(r.content)[-1]["generated_text"] if stream else r.json()["generated_text"]
        assert text == expected_text(prompt, 8)

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(20))), 10)
    assert len(engine.completed) == 20 and engine.aborted == []


async def test_graceful_close_finishes_in_flight(env) -> None:
    engine, server, client = env
    engine.delay = 0.01
    task = asyncio.ensure_future(
        client.post("/infer", json={"input_id": [1], "parameters": {"max_new_tokens": 10}})
    )
    await wait_for(lambda: engine.requests)
    await server.close(timeout=2.0)
    r = await task
    assert r.status_code == 200 and r.json()["generated_text"] == expected_text([1], 10)
    with pytest.raises(httpx.ConnectError):
        await client.post("/infer", json={"input_id": [1]})


# --------------------------------------------------------------------------- uvloop


def test_uvloop_smoke() -> None:
    """The same server on uvloop (its transports are duck-typed, not asyncio classes)."""
    pytest.importorskip("uvloop")

    async def main() -> None:
        assert "uvloop" in type(asyncio.get_running_loop()).__module__
        engine = FakeEngine()
        server = HttpServer(build_router(engine), max_body_bytes=1024)
        await server.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.ports[0]}"
        try:
            async with httpx.AsyncClient(base_url=base, timeout=5.0) as client:
                body = {"input_id": [1, 2], "stream": True, "parameters": {"max_new_tokens": 3}}
                r = await client.post("/infer", json=body)
                assert sse_events(r.content)[-1]["generated_text"] == expected_text([1, 2], 3)
                r = await client.post("/infer", content=b"x" * 100_000)
                assert r.status_code == 413
                engine.delay = 0.01
                body["parameters"] = {"max_new_tokens": 1000}
                async with client.stream("POST", "/infer", json=body) as r:
                    async for _ in r.aiter_lines():
                        break
                await wait_for(lambda: len(engine.aborted) == 1)
        finally:
            await server.close(timeout=1.0)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(run, main()).result(timeout=15)


# --------------------------------------------------------------------------- common helpers


def _depth(obj: Any) -> int:
    if isinstance(obj, list):
        return 1 + max((_depth(x) for x in obj), default=0)
    if isinstance(obj, dict):
        return 1 + max((_depth(x) for x in obj.values()), default=0)
    return 0


def test_json_depth_matches_reference() -> None:
    rng = random.Random(1234)
    tricky = ["[[[[[[[[[[[[", "]]]}}}", 'q"]{', "\\", "x\\\\", "\\\\\\", '{\\"[', 1, None, 2.5]

    def make(d: int) -> Any:
        r = rng.random()
        if d > 8 or r < 0.3:
            return rng.choice(tricky)
        if r < 0.65:
            return [make(d + 1) for _ in range(rng.randint(0, 3))]
        keys = ["k", "[", '{"', "\\"]
        return {rng.choice(keys) + str(i): make(d + 1) for i in range(rng.randint(0, 3))}

    for _ in range(3000):
        obj = make(0)
        body = orjson.dumps(obj)
        for limit in (3, 7):
            assert json_depth_exceeds(body, limit) == (_depth(obj) > limit), body
    assert json_depth_exceeds(b"[" * 5_000_000, 10)  # unbalanced and deep
    assert json_depth_exceeds(b"[" * 20 + b"]" * 20, 10)
    assert not json_depth_exceeds(b'{"a": "' + b"[" * 100_000 + b'"}', 10)
    with pytest.raises(ValueError, match="Failed to parse request context to json"):
        parse_json(b"[" * 100_000 + b"]" * 100_000)
