"""POST /infer_token over a real socket with the real default model (spec §2.1)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.sse import read_sse

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def client(server_client):
    """Every test here runs against a mixed server and against PD (conftest ``server``)."""
    return server_client


async def infer(client, ids, **params):
    r = await client.post("/infer_token", json={"input_id": ids, "parameters": params})
    assert r.status_code == 200, r.text
    return r.json()


async def stream_events(client, ids, **params):
    """All SSE events of a streamed /infer_token, parsed, in order."""
    return await read_sse(client, "/infer_token",
                          {"input_id": ids, "stream": True, "parameters": params})


async def test_chat_prompt_gives_sensible_english(server, client):
    out = await infer(client, server.chat_ids("What is the capital of France?"),
                      max_new_tokens=24, details=True)
    assert "Paris" in out["generated_text"], out
    assert out["details"]["finish_reason"] in ("eos_token", "length")
    await server.assert_idle_and_leak_free()


async def test_max_new_tokens_five_gives_exactly_five(server, client):
    ids = server.chat_ids("Tell me a long story about a dragon.")
    out = await infer(client, ids, max_new_tokens=5, details=True)
    d = out["details"]
    assert d["generated_tokens"] == 5 and len(d["generated_token_ids"]) == 5
    assert d["finish_reason"] == "length"
    assert isinstance(d["seed"], int)


async def test_concurrent_greedy_equals_sequential(server, client):
    questions = [f"Give me one fact about the number {i}." for i in range(16)]
    prompts = [server.chat_ids(q) for q in questions]
    seq = [(await infer(client, p, max_new_tokens=24, details=True))["details"]
           ["generated_token_ids"] for p in prompts]
    conc = await asyncio.gather(*(infer(client, p, max_new_tokens=24, details=True)
                                  for p in prompts))
    assert [c["details"]["generated_token_ids"] for c in conc] == seq
    await server.assert_idle_and_leak_free()


async def test_seeded_sampling_is_batch_independent(server, client):
    ids = server.chat_ids("Write a short poem about rain.")
    params = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_p=0.95, seed=1234,
                  details=True)
    alone = await infer(client, ids, **params)
    others = [infer(client, server.chat_ids(f"Count to {i}."), max_new_tokens=16, do_sample=True,
                    seed=i) for i in range(6)]
    together, *_ = await asyncio.gather(infer(client, ids, **params), *others)
    assert together["details"]["generated_token_ids"] == alone["details"]["generated_token_ids"]
    assert together["details"]["seed"] == 1234


async def test_stream_matches_non_stream(server, client):
    ids = server.chat_ids("Explain what a cat is in two sentences.")
    events = await stream_events(client, ids, max_new_tokens=20, details=True)
    full = await infer(client, ids, max_new_tokens=20)
    first, last = events[0], events[-1]
    assert first["prefill_time"] is not None and first["decode_time"] is None
    assert all(e["prefill_time"] is None and e["decode_time"] is not None for e in events[1:])
    assert last["token"]["text"] is None  # spec §2.1: last text only in generated_text
    assert all(isinstance(e["token"]["id"], list) for e in events)
    streamed = "".join(e["token"]["text"] for e in events[:-1])
    assert last["generated_text"].startswith(streamed)
    assert last["generated_text"] == full["generated_text"]
    assert last["details"]["generated_tokens"] == 20 or last["details"]["finish_reason"] == "eos_token"
    assert sum(len(e["token"]["id"]) for e in events) == last["details"]["generated_tokens"]


async def test_chinese_and_emoji_stream_valid_utf8(server, client):
    text = "你好，世界！🌍🚀 我爱北京。😀\n" * 3
    ids = server.engine.tokenizer.encode(text, add_special_tokens=False)
    events = await stream_events(client, ids, max_new_tokens=40)
    pieces = [e["token"]["text"] for e in events[:-1]]
    final = events[-1]["generated_text"]
    assert all("\ufffd" not in p for p in pieces) and "\ufffd" not in final
    assert any(ord(c) > 0xFFFF for c in final), final  # an emoji (4-byte UTF-8)
    assert any("\u4e00" <= c <= "\u9fff" for c in final), final  # a CJK ideograph (3 bytes)
    assert final.startswith("".join(pieces))
    full = await infer(client, ids, max_new_tokens=40)
    assert final == full["generated_text"]


async def test_client_disconnect_mid_stream_frees_kv_blocks(server):
    ids = server.chat_ids("Write a very long essay about the history of Rome.")
    body = {"input_id": ids, "stream": True,
            "parameters": {"max_new_tokens": 400, "details": False}}
    await server.disconnect_mid_stream("/infer_token", body)


async def test_engine_timeout_stops_request_and_frees_blocks(live):
    """A client `timeout` that fires: the request ends with the spec's error (§0.4).
    Mixed only: it drives the in-process engine directly (no HTTP, nothing PD could
    change)."""
    from tokenserve.messages import FinishReason, GenerateRequest
    from tokenserve.sampling_params import SamplingParams

    g = GenerateRequest("timeout-1", tuple(live.chat_ids("Hello")),
                        SamplingParams(max_new_tokens=400, ignore_eos=True), timeout_s=0.3)
    outs = [o async for o in live.engine.generate(g)]
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.TIMEOUT
    assert outs[-1].error == "Engine callback timeout: client timeout"
    assert outs[-1].num_output_tokens < 400
    await live.assert_idle_and_leak_free()


BAD = [
    ("malformed json", b'{"input_id": [1, 2', "application/json", 422),
    ("wrong content type", b'{"input_id": [1, 2]}', "text/plain", 422),
    ("empty input_id", b'{"input_id": []}', "application/json", 422),
    ("id beyond vocab", b'{"input_id": [1, 49152]}', "application/json", 422),
    ("negative id", b'{"input_id": [1, -3]}', "application/json", 422),
    ("top_p 1.0", b'{"input_id": [1], "parameters": {"top_p": 1.0}}', "application/json", 422),
    ("temperature 0", b'{"input_id": [1], "parameters": {"temperature": 0}}', "application/json", 422),
    ("temperature < 0", b'{"input_id": [1], "parameters": {"temperature": -1}}', "application/json", 422),
    ("priority 0", b'{"input_id": [1], "parameters": {"priority": 0}}', "application/json", 422),
    ("priority 6", b'{"input_id": [1], "parameters": {"priority": 6}}', "application/json", 422),
    ("timeout 0", b'{"input_id": [1], "parameters": {"timeout": 0}}', "application/json", 422),
    ("max_new_tokens 0", b'{"input_id": [1], "parameters": {"max_new_tokens": 0}}', "application/json", 422),
    ("not an object", b'[1, 2, 3]', "application/json", 422),
]


@pytest.mark.parametrize("name,body,ctype,status", BAD, ids=[b[0] for b in BAD])
async def test_bad_input_gets_4xx_then_server_still_serves(server, client, name, body, ctype,
                                                           status):
    r = await client.post("/infer_token", content=body, headers={"content-type": ctype})
    assert r.status_code == status, (name, r.text)
    err = r.json()
    assert set(err) >= {"error", "error_type"} and err["error_type"] == "Input Validation Error"
    out = await infer(client, [1, 9690, 314], max_new_tokens=2)
    assert isinstance(out["generated_text"], str)


async def test_huge_body_is_413_and_server_keeps_serving(server, client):
    body = b'{"input_id": [' + b"1," * (21 << 20) + b"1]}"  # ~42 MiB > 40 MiB limit
    try:
        r = await client.post("/infer_token", content=body,
                              headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert "message" in r.json()
    except httpx.WriteError:
        pass  # the server may answer and close before the client finished sending
    out = await infer(client, [1, 9690, 314], max_new_tokens=2)
    assert isinstance(out["generated_text"], str)


async def test_prompt_longer_than_context_is_4xx(server, client):
    n = server.engine.max_model_len + 5
    r = await client.post("/infer_token", json={"input_id": [28] * n})
    assert 400 <= r.status_code < 500
    assert "error" in r.json()


async def test_health(client):
    r = await client.get("/health")
    assert r.status_code == 200


async def test_stop_mid_character_drops_the_broken_tail(server, client):
    """Issue 11 §6: a greedy Chinese answer cut by max_new_tokens mid-way through a
    multi-byte character ends without U+FFFD, in the stream and the final text alike;
    the token ids still report every token."""
    ids = server.chat_ids("请用中文介绍一下长城的历史。")
    full = (await infer(client, ids, max_new_tokens=48, details=True))["details"]
    decode = server.engine.tokenizer.decode
    # greedy: a shorter max_new_tokens gives a prefix of these ids; cut inside a character
    n = max(k for k in range(2, 49) if decode(full["generated_token_ids"][:k]).endswith("\ufffd"))
    out = await infer(client, ids, max_new_tokens=n, details=True)
    text, got = out["generated_text"], out["details"]["generated_token_ids"]
    assert got == full["generated_token_ids"][:n] and out["details"]["generated_tokens"] == n
    assert text and not text.endswith("\ufffd"), text
    assert decode(got).startswith(text)
    events = await stream_events(client, ids, max_new_tokens=n)
    assert events[-1]["generated_text"] == text
    assert "".join(e["token"]["text"] or "" for e in events) == text
    assert [t for e in events for t in e["token"]["id"]] == got
    await server.assert_idle_and_leak_free()
