"""D takes P's plan instead of redoing it (issue 40): for every family, a request through
the real prefill path (``serve_prefill``, the family handler, ``PrefillObserver``) and
the real decode route (``POST /v1/pd/decode``), over scripted engines whose tokenizers
count their calls. With P's plan (``DecodeParameters.plan``) D neither applies the chat
template nor tokenizes the prompt, and every ``/dresult`` message it sends is byte for
byte what D sends when it plans the request itself (the path of a P without a plan, and
D's only path before issue 40).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import pytest

from tests.fakes import FakeEngine, token_text, wait_for
from tokenserve.aio import Signal
from tokenserve.config.tree import PdConfig
from tokenserve.messages import GenerateRequest, KvHandoff, RequestOutput
from tokenserve.pd import decode as decode_mod
from tokenserve.pd import prefill as prefill_mod
from tokenserve.pd.messages import DecodeParameters
from tokenserve.pd.node import PdNode
from tokenserve.pd.sinks import CaptureResponse
from tokenserve.pd.wire import DresultParser
from tokenserve.server.app import build_router
from tokenserve.transport.cycle import HttpRequest

MODEL = "fake-model"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}


class CountingTokenizer:
    """One token per character (id = ord(c)), a toy chat template; counts what the
    prompt's planning calls: ``encode`` and ``apply_chat_template``."""

    chat_template = None

    def __init__(self) -> None:
        self.encodes = 0
        self.templates = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encodes += 1
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        self.templates += 1
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>"

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(token_text(i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [token_text(i) for i in ids]


@dataclass
class PdFakeEngine(FakeEngine):
    """The scripted engine (tests/fakes.py) on either side of PD: a prefill-only request
    parks after its first token (its output carries a ``KvHandoff``); an adopted one
    first replays the tokens generated elsewhere, then goes on as the script does."""

    tokenizer: CountingTokenizer = field(default_factory=CountingTokenizer)
    max_model_len: int = 1024  # room for the tool prompt

    async def outputs(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        done = len(request.adopt.output_token_ids) if request.adopt is not None else 0
        inner = super().outputs(request)
        try:
            i = 0
            async for out in inner:
                if request.prefill_only:
                    yield replace(out, handoff=KvHandoff((0,), len(request.prompt_token_ids)))
                    return  # parked: D goes on
                yield replace(out, replay=i < done)
                i += 1
        finally:
            await inner.aclose()


def _request(path: str, body: bytes, headers: dict[str, str]) -> HttpRequest:
    return HttpRequest(method="POST", path=path, query="", headers=headers, body=body,
                       disconnected=Signal(), arrival_time=time.monotonic())


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> list[DecodeParameters]:
    """What P hands D, kept instead of POSTed."""
    got: list[DecodeParameters] = []

    async def keep(self: prefill_mod.PrefillObserver) -> None:
        got.append(self.decode_parameters())

    monkeypatch.setattr(prefill_mod.PrefillObserver, "_send_decode", keep)
    return got


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every chunk D publishes on ``/dresult``."""
    got: list[bytes] = []
    original = decode_mod.DresultHub.publish

    def publish(self: decode_mod.DresultHub, msg: bytes) -> None:
        got.append(msg)
        original(self, msg)

    monkeypatch.setattr(decode_mod.DresultHub, "publish", publish)
    return got


async def _prefill(path: str, body: dict[str, Any], handed: list[DecodeParameters],
                   req_id: str) -> DecodeParameters:
    engine = PdFakeEngine()
    router = build_router(engine, pd=PdNode(PdConfig(infer_mode="dmi", role="prefill"), engine))
    answer = CaptureResponse()
    await router(_request(path, orjson.dumps(body), {
        "content-type": "application/json", "req-type": "prefill", "req-id": req_id,
        "d-target": "127.0.0.1;1"}), answer)
    assert answer.status == 200, answer.text
    assert not orjson.loads(answer.text).get("isLastResp"), "finished on P, no hand-off"
    return handed.pop()


async def _decode(params: DecodeParameters, published: list[bytes]
                  ) -> tuple[list[tuple[str, str]], CountingTokenizer]:
    """D's ``/dresult`` messages for ``params`` (kind, body), and its tokenizer."""
    engine = PdFakeEngine()
    router = build_router(engine, pd=PdNode(PdConfig(infer_mode="dmi", role="decode"), engine))
    published.clear()
    verdict = CaptureResponse()
    await router(_request("/v1/pd/decode", params.encode(), {}), verdict)
    assert b'"isValidDecodeParameters":true' in b"".join(verdict.chunks), verdict.text

    def messages() -> list[tuple[str, str]]:
        return [(m.kind, m.body) for m in DresultParser().feed(b"".join(published))]

    await wait_for(lambda: any(k in ("lastData", "lastBytes", "error", "retry")
                               for k, _ in messages()))
    await asyncio.sleep(0.01)  # D's handler leaves its blocks
    return messages(), engine.tokenizer


def _steady(messages: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The messages, OpenAI's ``created`` second masked (two runs may straddle one)."""
    return [(k, re.sub(r'"created":\d+', '"created":0', b)) for k, b in messages]


CASES = [  # (family, path, body, D tokenizes without a plan)
    ("mindie", "/infer", {"inputs": "abcdef", "stream": True,
                          "parameters": {"max_new_tokens": 5, "details": True}}, True),
    ("mindie", "/infer", {"inputs": "abcdef", "parameters": {"max_new_tokens": 5}}, True),
    ("mindie", "/infer_token", {"input_id": [97, 98, 99], "stream": True,
                                "parameters": {"max_new_tokens": 4}}, False),
    ("tgi", "/generate_stream", {"inputs": "abcdef", "parameters": {
        "max_new_tokens": 5, "details": True, "grammar": {"type": "regex", "value": "[a-z]+"},
        "stop": ["zz"]}}, True),
    ("tgi", "/generate", {"inputs": "abcdef", "parameters": {
        "max_new_tokens": 5, "decoder_input_details": True, "truncate": 4}}, True),
    ("vllm", "/generate", {"prompt": "abcdef", "max_tokens": 5, "stream": True,
                           "guided_choice": ["ab", "cd"]}, True),
    ("vllm", "/generate", {"prompt": "abcdef", "max_tokens": 5, "logprobs": 2}, True),
    ("openai", "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True}, "seed": 7, "temperature": 0.5,
        "response_format": {"type": "json_object"}, "stop": ["zz"]}, True),
    ("openai", "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 5, "logprobs": True,
        "top_logprobs": 2}, True),
    ("openai", "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True,
        "tools": [TOOL], "tool_choice": "required"}, True),
    ("openai", "/v1/completions", {"model": MODEL, "prompt": "abcdef", "max_tokens": 5,
                                   "stream": True, "echo": True}, True),
    ("openai", "/v1/completions", {"model": MODEL, "prompt": [97, 98, 99], "max_tokens": 5,
                                   "echo": True}, False),
    ("triton", f"/v2/models/{MODEL}/generate_stream", {
        "id": "t1", "text_input": "abcdef",
        "parameters": {"max_new_tokens": 5, "details": True}}, True),
    ("triton", f"/v2/models/{MODEL}/generate", {
        "text_input": "abcdef", "parameters": {"max_new_tokens": 5}}, True),
    ("triton", f"/v2/models/{MODEL}/infer", {
        "inputs": [{"name": "input0", "shape": [1, 3], "datatype": "UINT32",
                    "data": [97, 98, 99]}], "parameters": {"max_new_tokens": 5}}, False),
]


@pytest.mark.parametrize(("family", "path", "body", "tokenizes"), CASES,
                         ids=[f"{c[0]}-{c[1].split('/')[-1]}-{i}" for i, c in enumerate(CASES)])
async def test_d_runs_p_plan_without_templating_or_tokenizing(
        family, path, body, tokenizes, handed, published) -> None:
    params = await _prefill(path, body, handed, "ab12")
    assert params.plan is not None

    with_plan, tok = await _decode(params, published)
    assert (tok.encodes, tok.templates) == (0, 0), "D planned the prompt again"
    assert with_plan[-1][0] in ("lastData", "lastBytes"), with_plan[-1]

    # the same hand-off from a P that sends no plan: D plans the request itself, as it
    # did before issue 40, and sends the same bytes
    without_plan, tok = await _decode(replace(params, plan=None), published)
    assert (tok.encodes > 0) == tokenizes
    assert tok.templates == (1 if path == "/v1/chat/completions" else 0)
    assert _steady(with_plan) == _steady(without_plan)
    assert any(k == "data" for k, _ in with_plan) == ("stream" in path or body.get("stream",
                                                                                     False))


async def test_p_plan_carries_the_engine_request(handed) -> None:
    """What D submits is what P planned: the prompt's ids, the sampling and stopping
    parameters (the structured-output constraint and stop strings included), priority
    and timeout."""
    params = await _prefill("/infer", {"inputs": "abcdef", "parameters": {
        "max_new_tokens": 5, "seed": 9, "temperature": 0.5, "priority": 2,
        "timeout": 30}}, handed, "cd34")
    assert params.tokens == tuple(ord(c) for c in "abcdef")
    p = params.plan
    assert p is not None and (p.priority, p.timeout_s) == (2, 30.0)
    assert (p.params.seed, p.params.temperature, p.params.do_sample) == (9, 0.5, True)
    assert DecodeParameters.decode(params.encode()) == params
    params = await _prefill("/generate_stream", {"inputs": "abcdef", "parameters": {
        "max_new_tokens": 5, "stop": ["zz"], "grammar": {"type": "regex", "value": "[a-z]+"},
        "truncate": 4}}, handed, "cd35")
    assert params.tokens == tuple(ord(c) for c in "cdef")  # truncated on P
    p = params.plan
    assert p is not None and p.params.stop == ("zz",)
    assert p.params.structured is not None and p.params.structured.value == "[a-z]+"
