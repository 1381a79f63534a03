"""The OpenAI family (spec/interfaces.md §5) over a real socket with a scripted engine.

The fake engine echoes the prompt ids back (tests/fakes.py); here it also gets a chat
template, logprobs and stop reasons, so response shapes, SSE framing, the n-way fan-out,
validation and disconnect -> abort can be checked in milliseconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.fakes import (
    MAX_MODEL_LEN,
    TIMEOUT_MSG,
    FakeEngine,
    FakeTokenizer,
    serve_fake,
    token_text,
    wait_for,
)
from tokenserve.messages import FinishReason, GenerateRequest, RequestOutput, TokenLogprob

MODEL = "fake-model"


class ChatTokenizer(FakeTokenizer):
    """The fake tokenizer plus what the OpenAI family needs: a toy chat template,
    ``add_special_tokens`` / ``skip_special_tokens`` and token spellings."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(token_text(i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [token_text(i) for i in ids]

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs) -> str:
        if any(m["content"] == "RAISE" for m in messages):
            raise ValueError("chat template error: boom")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<a>" if add_generation_prompt else "")


@dataclass
class Cfg:
    max_iter_times: int = 7
    max_batch_size: int = 16
    model: str | None = None


@dataclass
class OpenAIFakeEngine(FakeEngine):
    """Adds logprobs (logprob -0.5 for the sampled token, -1-j for alternative j) and
    ``stop_reason`` "zz" on EOS."""

    tokenizer: ChatTokenizer = field(default_factory=ChatTokenizer)
    cfg: Cfg = field(default_factory=Cfg)

    async def outputs(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        inner = super().outputs(request)
        try:
            async for out in inner:
                k = request.params.logprobs
                if k is not None and out.new_token_ids:
                    lps = tuple(
                        TokenLogprob(t, -0.5, tuple((t + j + 1, -1.0 - j) for j in range(k)))
                        for t in out.new_token_ids
                    )
                    out = replace(out, logprobs=lps)
                if out.finished and out.finish_reason is FinishReason.EOS:
                    out = replace(out, stop_reason="zz")
                yield out
        finally:
            await inner.aclose()


@pytest.fixture
async def env() -> AsyncIterator[tuple[OpenAIFakeEngine, httpx.AsyncClient]]:
    engine = OpenAIFakeEngine()
    async with serve_fake(engine) as (_, client):
        yield engine, client


def chat_body(**kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(kw)
    return body


def cmpl_body(**kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4}
    body.update(kw)
    return body


def expected_text(prompt: str | list[int], n: int) -> str:
    ids = [ord(c) for c in prompt] if isinstance(prompt, str) else prompt
    return "".join(token_text(ids[i % len(ids)]) for i in range(n))


CHAT_PROMPT = "<user>hi<a>"


async def stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    """SSE events of a stream (``"[DONE]"`` kept as a string); checks the framing."""
    r = await client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    raw = r.content
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    parts = raw.split(b"\n\n")[:-1]
    assert all(p.startswith(b"data: ") for p in parts), raw
    events = [p[len(b"data: "):] for p in parts]
    assert events.count(b"[DONE]") == 1
    return [orjson.loads(e) for e in events[:-1]] + ["[DONE]"]


def assert_error(r: httpx.Response, status: int, error_type: str, text: str = "") -> str:
    """The OpenAI-family error body: OpenAI's shape plus MindIE's ``error_type``; returns
    the message."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error", "error_type"}, body
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, body
    assert (err["type"], err["param"], err["code"]) == (error_type, None, status)
    assert body["error_type"] == error_type
    assert isinstance(err["message"], str) and err["message"] and text in err["message"], body
    return err["message"]


def usage_chunks(events: list[Any]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and e.get("usage") is not None]


# --------------------------------------------------------------------------- models


async def test_models(env) -> None:
    _, client = env
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert r.text.startswith('{\n    "object"')  # 4-space indented (spec §5.3)
    card = r.json()["data"][0]
    assert r.json()["object"] == "list"
    assert {k: card[k] for k in ("id", "object", "owned_by", "parent")} == {
        "id": MODEL, "object": "model", "owned_by": "MindIE Server", "parent": "null"}
    assert isinstance(card["created"], int) and card["root"] == MODEL
    r = await client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200
    assert r.json() == {"id": MODEL, "object": "model", "created": card["created"],
                        "owned_by": "MindIE Server"}
    r = await client.get("/v1/models/nope")
    assert r.json() == {
        "error": {"message": "Model nope not found.", "type": "NotFoundError", "param": None,
                  "code": 404},
        "error_type": "NotFoundError"}
    assert_error(r, 404, "NotFoundError")


# --------------------------------------------------------------------------- non-stream


async def test_chat_non_stream_shape_and_mapping(env) -> None:
    engine, client = env
    r = await client.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    assert isinstance(out["created"], int) and out["model"] == MODEL
    assert out["choices"] == [{
        "index": 0,
        "message": {"role": "assistant", "content": expected_text(CHAT_PROMPT, 4),
                    "tool_calls": []},
        "logprobs": None, "finish_reason": "length"}]
    n_prompt = len(CHAT_PROMPT)
    assert out["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 4,
                            "total_tokens": n_prompt + 4, "prompt_tokens_details": {"cached_tokens": 0}}
    req = engine.requests[-1]
    assert req.prompt_token_ids == tuple(ord(c) for c in CHAT_PROMPT)
    assert req.request_id.startswith(out["id"])
    p = req.params
    assert p.max_new_tokens == 4 and p.do_sample and p.temperature == 1.0  # OpenAI default
    assert (p.top_k, p.top_p, p.stop, p.logprobs) == (0, 1.0, (), None)


async def test_content_parts_system_and_extras_accepted(env) -> None:
    engine, client = env
    body = chat_body(
        messages=[{"role": "system", "content": "S"},
                  {"role": "user", "content": [{"type": "text", "text": "h"},
                                               {"type": "text", "text": "i"}]}],
        temperature=0, top_p=1.0, top_k=-1, repetition_penalty=1.1, user="u1",
        logprobs=None, stream_options={}, tool_choice="auto", max_tokens=None, max_completion_tokens=3, seed=9,
        stop=["x", "yy"], stop_token_ids=[5, 3, 5, -1, 2**40], ignore_eos=True,
        presence_penalty=0.5, frequency_penalty=-0.5, include_stop_str_in_output=True,
        skip_special_tokens=False, chat_template_kwargs={"enable_thinking": False},
        some_future_field={"x": 1},
    )
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    p = engine.requests[-1].params
    assert engine.requests[-1].prompt_token_ids == tuple(ord(c) for c in "<system>S<user>hi<a>")
    assert p.max_new_tokens == 3 and not p.do_sample and p.seed == 9
    assert (p.top_k, p.top_p, p.repetition_penalty) == (0, 1.0, 1.1)
    assert p.stop == ("x", "yy") and p.stop_token_ids == (3, 5)
    assert p.ignore_eos and p.include_stop_str_in_output and not p.skip_special_tokens
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)


async def test_default_max_tokens_is_max_iter_times_capped_by_context(env) -> None:
    engine, client = env
    body = chat_body()
    del body["max_tokens"]
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    assert engine.requests[-1].params.max_new_tokens == engine.cfg.max_iter_times
    engine.cfg.max_iter_times = 10_000
    r = await client.post("/v1/completions", json=cmpl_body(max_tokens=10_000, prompt="a" * 60))
    assert r.status_code == 200
    assert engine.requests[-1].params.max_new_tokens == MAX_MODEL_LEN - 60


async def test_completions_prompt_forms_n_and_indices(env) -> None:
    engine, client = env
    r = await client.post("/v1/completions", json=cmpl_body(prompt=[[1, 2], [3]], n=2, seed=5))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [expected_text([1, 2], 4)] * 2 + [
        expected_text([3], 4)] * 2
    assert out["choices"][0]["stop_reason"] is None
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19, "prompt_tokens_details": {"cached_tokens": 0}}
    reqs = engine.requests[-4:]
    assert len({r.request_id for r in reqs}) == 4
    assert [r.params.seed for r in reqs] == [5, 6, 5, 6]  # seed + i within each prompt
    for prompt in ("xyz", ["ab", "c"], [7, 8, 9]):
        r = await client.post("/v1/completions", json=cmpl_body(prompt=prompt))
        assert r.status_code == 200, (prompt, r.text)
    assert [c["text"] for c in r.json()["choices"]] == [expected_text([7, 8, 9], 4)]


async def test_unseeded_choices_get_distinct_seeds(env) -> None:
    engine, client = env
    r = await client.post("/v1/completions", json=cmpl_body(n=3))
    assert r.status_code == 200
    assert len({r.params.seed for r in engine.requests[-3:]}) == 3


async def test_echo(env) -> None:
    _, client = env
    r = await client.post("/v1/completions", json=cmpl_body(echo=True))
    assert r.json()["choices"][0]["text"] == "abc" + expected_text("abc", 4)
    events = await stream(client, "/v1/completions", cmpl_body(echo=True))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "abc" + expected_text(
        "abc", 4)


async def test_eos_finish_is_stop_with_stop_reason(env) -> None:
    engine, client = env
    engine.finish, engine.finish_after = FinishReason.EOS, 2
    r = await client.post("/v1/completions", json=cmpl_body())
    c = r.json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", "zz")
    r = await client.post("/v1/chat/completions", json=chat_body())
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    events = await stream(client, "/v1/completions", cmpl_body())
    assert events[-2]["choices"][0]["stop_reason"] == "zz"


# --------------------------------------------------------------------------- stream


async def test_chat_stream_framing_usage_on_finishing_chunk(env) -> None:
    _, client = env
    events = await stream(client, "/v1/chat/completions", chat_body())
    first, *middle, last, done = events
    assert done == "[DONE]"
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]
    assert all(e["choices"][0]["finish_reason"] is None for e in middle)
    assert last["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["delta"]["content"] for e in events[:-1])
    assert text == expected_text(CHAT_PROMPT, 4)
    assert usage_chunks(events) == [last]
    assert len({e["id"] for e in events[:-1]}) == 1
    r = await client.post("/v1/chat/completions", json=chat_body())
    assert last["usage"] == r.json()["usage"]


async def test_stream_include_usage_both_ways(env) -> None:
    _, client = env
    for path, body in (("/v1/chat/completions", chat_body()), ("/v1/completions", cmpl_body())):
        plain = (await client.post(path, json=body)).json()["usage"]
        events = await stream(client, path, {**body, "stream_options": {"include_usage": True}})
        assert usage_chunks(events) == [events[-2]]
        assert events[-2]["choices"] == [] and events[-2]["usage"] == plain
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        for off in (False, None):
            events = await stream(client, path,
                                  {**body, "stream_options": {"include_usage": off}})
            assert usage_chunks(events) == [events[-2]]
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert events[-2]["usage"] == plain


async def test_completions_stream_has_no_role_chunk(env) -> None:
    _, client = env
    events = await stream(client, "/v1/completions", cmpl_body())
    assert len(events) == 5  # 4 tokens + [DONE]
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert [e["choices"][0]["text"] for e in events[:-1]] == list(expected_text("abc", 4))
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_n2(env) -> None:
    engine, client = env
    events = await stream(client, "/v1/chat/completions", chat_body(n=2, seed=1))
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]  # role chunks first
    assert all(e["choices"][0]["delta"]["content"] == "" for e in events[:2])
    for i in (0, 1):
        mine = [e for e in events[:-1] if e["choices"][0]["index"] == i]
        assert "".join(e["choices"][0]["delta"]["content"] for e in mine) == expected_text(
            CHAT_PROMPT, 4)
        assert [e["choices"][0]["finish_reason"] for e in mine].count("length") == 1
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
    assert len(usage_chunks(events)) == 1 and usage_chunks(events)[0]["usage"] == {
        "prompt_tokens": len(CHAT_PROMPT), "completion_tokens": 8,
        "total_tokens": len(CHAT_PROMPT) + 8, "prompt_tokens_details": {"cached_tokens": 0}}
    assert [r.params.seed for r in engine.requests[-2:]] == [1, 2]
    r = await client.post("/v1/chat/completions", json=chat_body(n=2))
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert r.json()["usage"]["completion_tokens"] == 8


# --------------------------------------------------------------------------- logprobs


async def test_chat_logprobs(env) -> None:
    engine, client = env
    r = await client.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=2))
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert engine.requests[-1].params.logprobs == 2
    assert len(content) == 4
    tok = ord("<")
    assert content[0] == {
        "token": token_text(tok), "logprob": -0.5, "bytes": list(token_text(tok).encode()),
        "top_logprobs": [{"token": token_text(tok + 1), "logprob": -1.0,
                          "bytes": list(token_text(tok + 1).encode())},
                         {"token": token_text(tok + 2), "logprob": -2.0,
                          "bytes": list(token_text(tok + 2).encode())}]}
    # top_logprobs alone turns logprobs on; logprobs alone gives no alternatives
    r = await client.post("/v1/chat/completions", json=chat_body(top_logprobs=1))
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 1
    r = await client.post("/v1/chat/completions", json=chat_body(logprobs=True))
    assert r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    events = await stream(client, "/v1/chat/completions", chat_body(logprobs=True))
    assert events[0]["choices"][0]["logprobs"] is None
    assert sum(len(e["choices"][0]["logprobs"]["content"]) for e in events[1:-1]) == 4


async def test_completion_logprobs(env) -> None:
    _, client = env
    r = await client.post("/v1/completions", json=cmpl_body(prompt=[1, 2], logprobs=1))
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == list(expected_text([1, 2], 4))
    assert lp["token_logprobs"] == [-0.5] * 4
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert lp["top_logprobs"][0] == {token_text(2): -1.0, token_text(1): -0.5}
    events = await stream(client, "/v1/completions", cmpl_body(prompt=[1, 2], logprobs=0))
    offsets = [o for e in events[:-1] for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2, 3]
    assert events[0]["choices"][0]["logprobs"]["top_logprobs"] == [{token_text(1): -0.5}]


# --------------------------------------------------------------------------- validation


BAD_CHAT = [
    {"temperature": -0.1}, {"temperature": "hot"}, {"top_p": 0}, {"top_p": 1.01},
    {"top_k": 0}, {"top_k": -2}, {"n": 0}, {"n": 2, "temperature": 0}, {"best_of": 1, "n": 2},
    {"logprobs": False, "top_logprobs": 2}, {"top_logprobs": 21}, {"logprobs": 1},
    {"max_tokens": 0}, {"max_tokens": 1.5}, {"max_tokens": 3, "max_completion_tokens": 4},
    {"messages": []}, {"messages": [{"content": "x"}]}, {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    {"messages": [{"role": "user", "content": "RAISE"}]},  # template error
    {"messages": [{"role": "tool", "content": "x"}]},  # no tool_call_id
    {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
    {"tools": [{"type": "function", "function": {"name": "f"}}],
     "messages": [{"role": "robot", "content": "x"}]},
    {"tool_choice": "sometimes"}, {"stop": ""}, {"stop": [1]}, {"stop": ["x" * 1025]},
    {"stop_token_ids": ["a"]}, {"seed": -1}, {"seed": 2**63}, {"presence_penalty": 2.5},
    {"frequency_penalty": -3}, {"repetition_penalty": 0}, {"repetition_penalty": 2.5},
    {"model": "other"}, {"model": ""}, {"model": None}, {"stream": "yes"},
    {"stream_options": {"include_usage": 1}}, {"response_format": {"type": "json_schema"}},
    {"response_format": {"type": "xml"}}, {"guided_choice": []}, {"guided_regex": 5},
    {"guided_json": {}, "guided_regex": "a"},
    {"response_format": {"type": "json_object"}, "guided_regex": "a"},
    {"use_beam_search": True}, {"chat_template": "{{ messages }}"},
    {"stream": True, "n": 2, "best_of": 3}, {"n": 17},  # more than maxBatchSize sequences
]
BAD_CMPL = [
    {"prompt": ""}, {"prompt": []}, {"prompt": [1, "a"]}, {"prompt": [[]]},
    {"prompt": [1000]}, {"prompt": None}, {"prompt": {"text": "x"}}, {"logprobs": 6},
    {"logprobs": True}, {"prompt_logprobs": 21}, {"max_tokens": -1}, {"model": "x"},
    {"stream": True, "best_of": 2},
]


@pytest.mark.parametrize("bad", BAD_CHAT, ids=lambda b: orjson.dumps(b).decode()[:40])
async def test_chat_validation_422_then_good_request(env, bad) -> None:
    engine, client = env
    r = await client.post("/v1/chat/completions", json=chat_body(**bad))
    assert_error(r, 422, "Input Validation Error")
    assert not engine.requests
    assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200


@pytest.mark.parametrize("bad", BAD_CMPL, ids=lambda b: orjson.dumps(b).decode()[:40])
async def test_completions_validation_422(env, bad) -> None:
    engine, client = env
    r = await client.post("/v1/completions", json=cmpl_body(**bad))
    assert_error(r, 422, "Input Validation Error")
    assert not engine.requests
    assert (await client.post("/v1/completions", json=cmpl_body())).status_code == 200


@pytest.mark.parametrize(("bad", "text"), [
    ({"top_p": 0}, "Parameter top_p must be in (0.0,1.0], got 0"),
    ({"temperature": -1}, "Parameter temperature must be in"),
    ({"model": "other"}, "Model not found"),
    ({"messages": [{"role": "user", "content": "RAISE"}]}, "Failed to apply the chat template"),
    ({"n": 17}, "maxBatchSize"),
])
async def test_validation_message_in_openai_error(env, bad, text) -> None:
    _, client = env
    r = await client.post("/v1/chat/completions", json=chat_body(**bad))
    assert_error(r, 422, "Input Validation Error", text)


@pytest.mark.parametrize("model", ["tgi", "dummy"])
async def test_client_placeholder_model_names_are_served(env, model) -> None:
    """TGI ignores ``model`` on its OpenAI routes; huggingface_hub's InferenceClient
    (base_url) without ``model=`` sends ``"tgi"`` or ``"dummy"``: both answer with the
    served model's name, on chat and completions."""
    engine, client = env
    for path, body in (("/v1/chat/completions", chat_body(model=model)),
                       ("/v1/completions", cmpl_body(model=model))):
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL
    assert len(engine.requests) == 2
    r = await client.post("/v1/chat/completions", json=chat_body(model="TGI"))
    assert_error(r, 422, "Input Validation Error", "Model not found")


async def test_body_errors_and_long_prompt(env) -> None:
    _, client = env
    r = await client.post("/v1/chat/completions", content=b"{not json")
    assert_error(r, 422, "Input Validation Error", "Failed to parse request context to json")
    r = await client.post("/v1/completions", content=b"[1]")
    assert_error(r, 422, "Input Validation Error", "parse")
    r = await client.post("/v1/completions", content=orjson.dumps(cmpl_body()),
                          headers={"content-type": "text/plain"})
    assert_error(r, 422, "Input Validation Error", "Content-Type must be application/json")
    deep = cmpl_body(prompt="abc")
    deep["x"] = [[[[[[[[[[[1]]]]]]]]]]]
    r = await client.post("/v1/chat/completions", json=deep)
    assert_error(r, 422, "Input Validation Error", "nesting depth exceeds")
    r = await client.post("/v1/completions", json=cmpl_body(prompt="a" * MAX_MODEL_LEN))
    msg = assert_error(r, 424, "Generation Error")
    assert msg.startswith("Failed to enqueue inferRequest.")


async def test_openai_sdk_against_fake(env) -> None:
    """The real SDK parses our shapes and raises the right class on a 422."""
    _, client = env
    sdk = openai.AsyncOpenAI(base_url=str(client.base_url) + "/v1", api_key="x", max_retries=0)
    out = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                    "content": "hi"}],
                                            max_tokens=3)
    assert out.choices[0].message.content == expected_text(CHAT_PROMPT, 3)
    chunks = [c async for c in await sdk.completions.create(
        model=MODEL, prompt="abc", max_tokens=3, stream=True,
        stream_options={"include_usage": True})]
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].choices == []
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        await sdk.chat.completions.create(model=MODEL, messages=[], max_tokens=3)
    assert exc.value.status_code == 422
    assert "Parameter messages must be a non-empty array." in exc.value.message
    assert "Parameter messages must be a non-empty array." in str(exc.value)
    assert exc.value.type == "Input Validation Error" and str(exc.value.code) == "422"
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        await sdk.completions.create(model=MODEL, prompt="abc", max_tokens=3, top_p=0)
    assert "Parameter top_p must be in (0.0,1.0], got 0" in str(exc.value)
    with pytest.raises(openai.NotFoundError) as nf:
        await sdk.models.retrieve("nope")
    assert "Model nope not found." in str(nf.value)
    assert [m.id async for m in sdk.models.list()] == [MODEL]
    await sdk.close()


# --------------------------------------------------------------------------- failures


async def test_disconnect_mid_stream_aborts_every_choice(env) -> None:
    engine, client = env
    engine.delay = 0.02
    body = {**cmpl_body(max_tokens=40, n=3), "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen = 0
        async for chunk in r.aiter_bytes():
            seen += chunk.count(b"data: ")
            if seen >= 4:
                break
    ids = [req.request_id for req in engine.requests]
    assert len(ids) == 3
    await wait_for(lambda: set(engine.aborted) == set(ids))
    assert not engine.completed


async def test_disconnect_non_stream_aborts(env) -> None:
    engine, client = env
    engine.delay = 0.05
    task = asyncio.create_task(client.post("/v1/chat/completions",
                                           json=chat_body(n=2, max_tokens=40)))
    await wait_for(lambda: len(engine.requests) == 2)
    task.cancel()
    await wait_for(lambda: len(engine.aborted) == 2)


async def test_timeout_mid_stream_and_non_stream(env) -> None:
    engine, client = env
    engine.finish, engine.finish_after = FinishReason.TIMEOUT, 2
    r = await client.post("/v1/chat/completions", json=chat_body())
    assert assert_error(r, 500, "Incomplete Generation") == TIMEOUT_MSG
    r = await client.post("/v1/completions", json={**cmpl_body(), "stream": True})
    assert r.status_code == 200
    last = r.content.rstrip(b"\n").rpartition(b"\n\n")[2]
    assert last.startswith(b"data: ")
    assert orjson.loads(last[6:]) == {
        "error": {"message": TIMEOUT_MSG, "type": "Incomplete Generation", "param": None,
                  "code": 500}, "error_type": "Incomplete Generation"}
    assert b"[DONE]" not in r.content


async def test_engine_exception_is_500(env) -> None:
    engine, client = env
    engine.raise_on_generate = True
    r = await client.post("/v1/completions", json=cmpl_body())
    assert assert_error(r, 500, "Incomplete Generation") == "Server internal error"
    r = await client.post("/v1/completions", json={**cmpl_body(), "stream": True})
    assert r.status_code == 200 and b"Engine failure" in r.content


STRUCTURED_CHAT = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("json_object", "")),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}, "strict": True}}},
     # strict: unspecified additionalProperties closed (OpenAI's strict mode, issue 40)
     ("json_schema", '{"type": "object", "additionalProperties": false}')),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}}}},
     ("json_schema", '{"type": "object"}')),
    ({"response_format": {"type": "json", "value": {"type": "integer"}}},  # TGI chat form
     ("json_schema", '{"type": "integer"}')),
    ({"guided_json": '{"type": "string"}'}, ("json_schema", '{"type": "string"}')),
    ({"guided_regex": "[a-z]+"}, ("regex", "[a-z]+")),
    ({"guided_choice": ["a", "b"]}, ("choice", '["a", "b"]')),
    ({"guided_grammar": 'start: "x"'}, ("grammar", 'start: "x"')),
]


@pytest.mark.parametrize(("extra", "want"), STRUCTURED_CHAT,
                         ids=lambda b: orjson.dumps(b).decode()[:40])
async def test_structured_fields_reach_the_engine(env, extra, want) -> None:
    """response_format and vLLM's guided_* become SamplingParams.structured, compiled
    before the request is submitted (the engine sees it with its grammar)."""
    engine, client = env
    for path, body in (("/v1/chat/completions", chat_body(**extra)),
                       ("/v1/completions", cmpl_body(**extra))):
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        s = engine.requests[-1].params.structured
        assert (None if s is None else (s.kind.value, s.value)) == want
        assert engine.requests[-1].grammar == (None if s is None else ("compiled", s))


async def test_invalid_constraint_is_400_before_any_compute(env) -> None:
    engine, client = env
    for path, body in (("/v1/chat/completions", chat_body(guided_regex="INVALID(")),
                       ("/v1/completions", cmpl_body(response_format={
                           "type": "json_schema", "json_schema": {"schema": {"INVALID": 1}}}))):
        r = await client.post(path, json=body)
        assert_error(r, 400, "Bad Request")
        assert not engine.requests
