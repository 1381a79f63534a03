"""vLLM family ``POST /generate`` with ``prompt`` (spec/interfaces.md §4.1) and the
``/generate`` dispatch rules (spec §3.1), over a real socket with the fake engine."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest

from tests.fakes import MAX_MODEL_LEN, TIMEOUT_MSG, FakeEngine, serve_fake, token_text, wait_for
from tokenserve.api.server_api import GENERATE_ROUTING_ERROR
from tokenserve.messages import FinishReason, GenerateRequest, RequestOutput, TokenLogprob
from tokenserve.transport.server import HttpServer


class LogprobEngine(FakeEngine):
    """The fake engine, reporting logprob ``-1 / (seed % 7 + 1)`` for every token and
    the text ``str(seed % 10)`` per token (so sequences can be told apart)."""

    async def outputs(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        seed = request.params.seed
        lp = -1.0 / (seed % 7 + 1)
        async for out in super().outputs(request):
            yield dataclasses.replace(
                out, new_text=str(seed % 10) * len(out.new_token_ids),
                logprobs=tuple(TokenLogprob(t, lp) for t in out.new_token_ids))


async def _env(engine: FakeEngine) -> AsyncIterator[tuple[FakeEngine, HttpServer, httpx.AsyncClient]]:
    async with serve_fake(engine) as (server, client):
        yield engine, server, client


@pytest.fixture
async def env() -> AsyncIterator[tuple[FakeEngine, HttpServer, httpx.AsyncClient]]:
    async for x in _env(FakeEngine()):
        yield x


def gen(text: str, n: int) -> str:
    ids = [ord(c) for c in text]
    return "".join(token_text(ids[i % len(ids)]) for i in range(n))


def nul_chunks(raw: bytes) -> list[dict[str, Any]]:
    assert raw.endswith(b"\0"), raw[-100:]
    return [orjson.loads(p) for p in raw.split(b"\0")[:-1]]


# --------------------------------------------------------------------------- dispatch (§3.1)


async def test_dispatch_rules(env) -> None:
    engine, _, client = env
    # prompt wins over inputs
    r = await client.post("/generate", json={"prompt": "ab", "inputs": "cd", "max_tokens": 2})
    assert r.json() == {"text": ["ab " + gen("ab", 2)]}
    # null prompt -> TGI
    r = await client.post("/generate", json={"prompt": None, "inputs": "cd",
                                             "parameters": {"max_new_tokens": 2}})
    assert r.json() == {"generated_text": gen("cd", 2)}
    # a non-string prompt is the vLLM family's 422
    r = await client.post("/generate", json={"prompt": 5, "inputs": "cd"})
    assert r.status_code == 422 and "prompt" in r.json()["error"]
    # neither -> the nested-JSON 422
    for body in ({}, {"prompt": None, "inputs": None}, {"parameters": {"max_new_tokens": 1}}):
        r = await client.post("/generate", json=body)
        assert r.status_code == 422
        obj = r.json()
        assert obj == {"error": GENERATE_ROUTING_ERROR, "error_type": "Input Validation Error"}
        assert orjson.loads(obj["error"]) == {
            "Error": "`inputs` or `prompt` must be necessary and data type must be string. "
            "Additionally, the request body must be valid json",
            "error_type": "validation",
        }
    for raw in (b'{"prompt": ', b"[1]", b""):
        r = await client.post("/generate", content=raw)
        assert r.status_code == 422 and r.json()["error"].startswith("Failed to parse")
    r = await client.post("/generate", content=b'{"prompt": "a"}', headers={"content-type": "text/plain"})
    assert r.status_code == 422
    assert len(engine.requests) == 2
    r = await client.get("/generate")
    assert r.status_code == 405


# --------------------------------------------------------------------------- shapes


async def test_non_stream_shape_and_defaults(env) -> None:
    engine, _, client = env
    r = await client.post("/generate", json={"prompt": "Hi"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    p = engine.requests[-1].params
    assert p.max_new_tokens == MAX_MODEL_LEN  # no engine cfg: the context length
    assert r.json() == {"text": ["Hi " + gen("Hi", MAX_MODEL_LEN)]}
    assert p.do_sample is False and p.top_k == 0 and p.skip_special_tokens is True
    assert p.ignore_eos is False and p.stop == () and p.stop_token_ids == ()
    assert p.presence_penalty == 0 and p.frequency_penalty == 0
    engine.cfg = SimpleNamespace(max_iter_times=7, max_batch_size=4)  # type: ignore[attr-defined]
    await client.post("/generate", json={"prompt": "Hi"})
    assert engine.requests[-1].params.max_new_tokens == 7  # maxIterTimes


async def test_stream_is_nul_delimited_json(env) -> None:
    _, _, client = env
    r = await client.post("/generate", json={"prompt": "abc", "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    assert not r.content.startswith(b"data:")
    chunks = nul_chunks(r.content)
    assert all(list(c) == ["text"] and len(c["text"]) == 1 for c in chunks)
    assert "".join(c["text"][0] for c in chunks) == gen("abc", 4)  # deltas, not cumulative
    assert len(chunks) == 4


async def test_multimodal_text_prompt(env) -> None:
    _, _, client = env
    prompt = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = await client.post("/generate", json={"prompt": prompt, "max_tokens": 2})
    assert r.json() == {"text": ["ab " + gen("ab", 2)]}


async def test_parameter_mapping(env) -> None:
    engine, _, client = env
    body = {
        "prompt": "a", "max_tokens": 3, "temperature": 0.5, "top_k": 5, "top_p": 1.0, "seed": 11,
        "repetition_penalty": 1.2, "frequency_penalty": -2, "presence_penalty": 2,
        "stop": ["x", "yz"], "stop_token_ids": [7, 3, 7, -1, 2**31, 5],
        "include_stop_str_in_output": True, "ignore_eos": True, "skip_special_tokens": False,
        "model": "fake-model", "use_beam_search": False, "logprobs": 3,
    }
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    p = engine.requests[-1].params
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (3, 0.5, 5, 1.0, 11)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.2, -2, 2)
    assert p.stop == ("x", "yz") and p.stop_token_ids == (3, 5, 7)
    assert p.include_stop_str_in_output and p.ignore_eos and not p.skip_special_tokens
    assert p.do_sample is True
    await client.post("/generate", json={"prompt": "a", "stop": "x" * 5000, "max_tokens": 1})
    assert engine.requests[-1].params.stop == ("x" * 5000,)


@pytest.mark.parametrize(
    ("fields", "do_sample", "top_k", "temperature"),
    [({}, False, 0, 1.0), ({"temperature": 0}, False, 0, 1.0), ({"temperature": 0.8}, True, 0, 0.8),
     ({"top_k": -1}, False, 0, 1.0), ({"top_k": 4}, True, 4, 1.0), ({"top_p": 0.5}, True, 0, 1.0),
     ({"temperature": 0, "top_k": 4}, False, 4, 1.0)],
)
async def test_sampling_rule(env, fields: dict[str, Any], do_sample: bool, top_k: int,
                             temperature: float) -> None:
    engine, _, client = env
    r = await client.post("/generate", json={"prompt": "a", "max_tokens": 1, **fields})
    assert r.status_code == 200, r.text
    p = engine.requests[-1].params
    assert (p.do_sample, p.top_k, p.temperature) == (do_sample, top_k, temperature)


async def test_include_stop_str_only_read_with_stop(env) -> None:
    engine, _, client = env
    r = await client.post("/generate", json={"prompt": "a", "max_tokens": 1,
                                             "include_stop_str_in_output": "junk"})
    assert r.status_code == 200 and not engine.requests[-1].params.include_stop_str_in_output
    r = await client.post("/generate", json={"prompt": "a", "stop_token_ids": [1],
                                             "include_stop_str_in_output": "junk"})
    assert r.status_code == 422


# --------------------------------------------------------------------------- n / best_of


async def test_n_sequences(env) -> None:
    engine, _, client = env
    r = await client.post("/generate", json={"prompt": "ab", "n": 3, "temperature": 0.7,
                                             "max_tokens": 2, "seed": 100})
    assert r.json() == {"text": ["ab " + gen("ab", 2)] * 3}
    reqs = engine.requests[-3:]
    assert sorted(q.params.seed for q in reqs) == [100, 101, 102]
    assert len({q.request_id for q in reqs}) == 3
    r = await client.post("/generate", json={"prompt": "ab", "n": 2, "best_of": 3,
                                             "temperature": 0.7, "max_tokens": 2})
    assert len(r.json()["text"]) == 3  # best_of wins (spec §4.1)


async def test_n_stream(env) -> None:
    _, _, client = env
    body = {"prompt": "ab", "n": 2, "temperature": 0.7, "max_tokens": 3, "stream": True}
    chunks = nul_chunks((await client.post("/generate", json=body)).content)
    assert all(len(c["text"]) == 2 for c in chunks)
    for i in range(2):
        assert "".join(c["text"][i] for c in chunks) == gen("ab", 3)


async def test_best_of_ranked_by_cumulative_logprob() -> None:
    async for engine, _, client in _env(LogprobEngine()):
        body = {"prompt": "ab", "best_of": 4, "temperature": 1.0, "max_tokens": 2, "seed": 0}
        r = await client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        assert all(q.params.logprobs == 0 for q in engine.requests)
        # seeds 0..3 -> logprob -1, -1/2, -1/3, -1/4 per token: best first
        assert sorted(q.params.seed for q in engine.requests) == [0, 1, 2, 3]
        assert r.json() == {"text": ["ab 33", "ab 22", "ab 11", "ab 00"]}
        # streaming keeps submission order (index i = sequence i)
        chunks = nul_chunks((await client.post("/generate", json={**body, "stream": True})).content)
        assert ["".join(c["text"][i] for c in chunks) for i in range(4)] == ["00", "11", "22", "33"]


@pytest.mark.parametrize(
    "body",
    [{"n": 2}, {"n": 2, "temperature": 0}, {"best_of": 2}, {"n": 3, "best_of": 2, "temperature": 1},
     {"n": 0}, {"n": 8193, "temperature": 1}, {"best_of": 129, "temperature": 1},
     {"best_of": 0}, {"n": 1.0}],
)
async def test_n_best_of_rules(env, body: dict[str, Any]) -> None:
    engine, _, client = env
    r = await client.post("/generate", json={"prompt": "a", **body})
    assert r.status_code == 422, r.text
    assert engine.requests == []


async def test_n_capped_by_max_batch_size(env) -> None:
    engine, _, client = env
    engine.cfg = SimpleNamespace(max_iter_times=2, max_batch_size=2)  # type: ignore[attr-defined]
    body = {"prompt": "a", "n": 3, "temperature": 1}
    assert (await client.post("/generate", json=body)).status_code == 422
    body["n"] = 2
    assert (await client.post("/generate", json=body)).status_code == 200


# --------------------------------------------------------------------------- validation

BAD: list[tuple[str, dict[str, Any]]] = [
    ("prompt empty", {"prompt": ""}),
    ("prompt number", {"prompt": 5}),
    ("prompt image", {"prompt": [{"type": "image_url", "image_url": "x"}]}),
    ("stream string", {"stream": "yes"}),
    ("max_tokens 0", {"max_tokens": 0}),
    ("max_tokens 2^31", {"max_tokens": 2**31}),
    ("max_tokens float", {"max_tokens": 2.0}),
    ("temperature negative", {"temperature": -0.1}),
    ("temperature > FLT_MAX", {"temperature": 1e39}),
    ("temperature string", {"temperature": "1"}),
    ("top_k 0", {"top_k": 0}),
    ("top_k -2", {"top_k": -2}),
    ("top_k 2^31", {"top_k": 2**31}),
    ("top_k float", {"top_k": 3.0}),
    ("top_p 0", {"top_p": 0}),
    ("top_p 1.01", {"top_p": 1.01}),
    ("seed negative", {"seed": -1}),
    ("seed 2^63", {"seed": 2**63}),
    ("repetition_penalty 0", {"repetition_penalty": 0}),
    ("frequency_penalty 2.1", {"frequency_penalty": 2.1}),
    ("presence_penalty -2.1", {"presence_penalty": -2.1}),
    ("stop empty", {"stop": ""}),
    ("stop too long", {"stop": "x" * 32769}),
    ("stop number", {"stop": 3}),
    ("stop list item too long", {"stop": ["x" * 1025]}),
    ("stop list item empty", {"stop": ["a", ""]}),
    ("stop list total", {"stop": ["x" * 1024] * 33}),
    ("stop list number", {"stop": ["a", 1]}),
    ("stop_token_ids not list", {"stop_token_ids": 5}),
    ("stop_token_ids float", {"stop_token_ids": [1.0]}),
    ("stop_token_ids bool", {"stop_token_ids": [True]}),
    ("include_stop_str_in_output int", {"stop": "x", "include_stop_str_in_output": 1}),
    ("ignore_eos string", {"ignore_eos": "true"}),
    ("skip_special_tokens int", {"skip_special_tokens": 0}),
    ("model empty", {"model": ""}),
    ("model unknown", {"model": "some-lora"}),
    ("model too long", {"model": "m" * 257}),
    ("model number", {"model": 3}),
]


@pytest.mark.parametrize(("name", "fields"), BAD, ids=[b[0] for b in BAD])
async def test_bad_body_422_then_ok(env, name: str, fields: dict[str, Any]) -> None:
    engine, _, client = env
    r = await client.post("/generate", json={"prompt": "a", **fields})
    assert r.status_code == 422, (name, r.text)
    obj = r.json()
    assert set(obj) == {"error", "error_type"} and obj["error_type"] == "Input Validation Error"
    assert engine.requests == []
    ok = await client.post("/generate", json={"prompt": "a", "max_tokens": 1})
    assert ok.status_code == 200


async def test_limits_accepted(env) -> None:
    _, _, client = env
    body = {"prompt": "a", "max_tokens": 1, "temperature": 0, "top_k": 2**31 - 1,
            "stop": ["x" * 1024] * 32, "seed": 2**63 - 1, "model": "None",
            "frequency_penalty": 2.0, "presence_penalty": -2.0, "best_of": 1, "n": 1}
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    r = await client.post("/generate", json={"prompt": "a", "max_tokens": 1, "stop": ["s"] * 5000})
    assert r.status_code == 200  # no count limit on this entrance


async def test_prompt_too_long_424(env) -> None:
    _, _, client = env
    r = await client.post("/generate", json={"prompt": "x" * MAX_MODEL_LEN})
    assert r.status_code == 424 and r.json()["error"].startswith("Failed to enqueue inferRequest.")


# --------------------------------------------------------------------------- failures


async def test_timeout_non_stream_and_stream(env) -> None:
    engine, server, client = env
    engine.finish, engine.finish_after = FinishReason.TIMEOUT, 3
    r = await client.post("/generate", json={"prompt": "ab"})
    assert r.status_code == 500
    assert r.json() == {"error": TIMEOUT_MSG, "error_type": "Incomplete Generation"}
    r = await client.post("/generate", json={"prompt": "ab", "stream": True})
    assert r.status_code == 200
    *chunks, last = nul_chunks(r.content)
    assert last == {"error": TIMEOUT_MSG, "error_type": "Incomplete Generation"}
    assert "".join(c["text"][0] for c in chunks) == gen("ab", 2)
    await wait_for(lambda: server.num_connections == 0)


async def test_engine_exception(env) -> None:
    engine, _, client = env
    engine.raise_on_generate = True
    r = await client.post("/generate", json={"prompt": "a"})
    assert r.status_code == 500 and r.json()["error_type"] == "Incomplete Generation"
    r = await client.post("/generate", json={"prompt": "a", "stream": True})
    assert r.status_code == 200 and b"Engine failure" in r.content
    engine.raise_on_generate = False
    assert (await client.post("/generate", json={"prompt": "a", "max_tokens": 1})).status_code == 200


async def test_no_abort_after_normal_completion(env) -> None:
    engine, _, client = env
    await client.post("/generate", json={"prompt": "a", "max_tokens": 2})
    await client.post("/generate", json={"prompt": "a", "max_tokens": 2, "stream": True})
    await client.post("/generate", json={"prompt": "a", "max_tokens": 2, "n": 2, "temperature": 1})
    assert engine.aborted == [] and engine.closed_early == []
    assert len(engine.completed) == 4


@pytest.mark.parametrize("n", [1, 3])
async def test_disconnect_mid_stream_aborts_every_sequence(env, n: int) -> None:
    engine, _, client = env
    engine.delay = 0.01
    body = {"prompt": "ab", "stream": True, "max_tokens": 1000, "n": n, "temperature": 1}
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        async for _ in r.aiter_bytes():
            break
    rids = [q.request_id for q in engine.requests]
    assert len(rids) == n
    await wait_for(lambda: all(r in engine.aborted and r in engine.closed_early for r in rids), 1.0)
    assert not set(rids) & set(engine.completed)


async def test_disconnect_mid_non_stream_aborts(env) -> None:
    engine, server, _ = env
    engine.delay = 0.01
    _, writer = await asyncio.open_connection("127.0.0.1", server.ports[0])
    body = orjson.dumps({"prompt": "a", "max_tokens": 1000})
    writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    await writer.drain()
    await wait_for(lambda: engine.requests)
    writer.close()
    await engine.wait_aborted_early()
