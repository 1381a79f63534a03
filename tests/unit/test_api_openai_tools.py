"""OpenAI tool calling (issue 23): validation, prompt, grammar, output parser, stream deltas.

The pure parts are checked directly (the grammar with llguidance over a byte-level
tokenizer built here); the HTTP shapes over a real socket with a scripted engine that
"generates" a given text, so the parser meets the text in engine-sized pieces.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import llguidance
import openai
import orjson
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from tests.fakes import FakeEngine, serve_fake
from tests.unit.test_api_openai import Cfg, ChatTokenizer, assert_error
from tokenserve.api.openai.protocol import parse_tools
from tokenserve.api.openai.toolparse import ToolStream, split_tools
from tokenserve.api.openai.tools import (
    MAX_TOOLS,
    closed_objects,
    parse_tool_choice,
    template_takes_tools,
    tool_constraint,
    tool_messages,
)
from tokenserve.messages import FinishReason, GenerateRequest, RequestOutput
from tokenserve.sampling_params import ConstraintKind, StructuredOutput

MODEL = "fake-model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
NOARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, ADD, NOARGS]


def block(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


TWO_CALLS = block("get_weather", '{"city": "Paris}", "days": 2}') + "\n" + block("now", "{}")


# --------------------------------------------------------------------------- validation


def test_tool_choice_defaults_and_forms() -> None:
    assert parse_tool_choice({}) is None
    assert parse_tool_choice({"tool_choice": "auto"}) is None
    c = parse_tool_choice({"tools": TOOLS})
    assert c is not None and c.mode == "auto" and c.parallel and c.active
    c = parse_tool_choice({"tools": TOOLS, "tool_choice": "none"})
    assert c is not None and not c.active and tool_constraint(c) is None
    c = parse_tool_choice({"tools": TOOLS, "parallel_tool_calls": False,
                           "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert c is not None and (c.mode, c.name, c.parallel) == ("named", "add", False)
    assert [t["function"]["name"] for t in c.offered()] == ["add"]


def test_named_tool_choice_without_type_as_tgi() -> None:
    """huggingface_hub's ChatCompletionInputToolChoiceClass sends ``{"function": {"name"}}``
    without ``"type"``; TGI takes it, so do we (parse_tools checks the shape)."""
    body = {"tools": TOOLS, "tool_choice": {"function": {"name": "get_weather"}}}
    assert parse_tools(body) == TOOLS
    c = parse_tool_choice(body)
    assert c is not None and (c.mode, c.name) == ("named", "get_weather")
    for bad in ({"type": "other", "function": {"name": "add"}}, {"function": "add"}, {}):
        with pytest.raises(ValueError, match="tool_choice must be"):
            parse_tools({"tools": TOOLS, "tool_choice": bad})


@pytest.mark.parametrize(("body", "text"), [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
    ({"tools": [WEATHER, WEATHER]}, "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}]},
     "not a valid JSON Schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "type: object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "JSON Schema object"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                for i in range(MAX_TOOLS + 1)]}, "at most"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "boolean"),
])
def test_tool_choice_rejects(body: dict[str, Any], text: str) -> None:
    with pytest.raises(ValueError, match=text):
        parse_tool_choice(body)


# --------------------------------------------------------------------------- grammar


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory) -> llguidance.LLTokenizer:
    """A byte-level tokenizer (one token per byte, plus EOS) for llguidance."""
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<eos>"])
    path = Path(tmp_path_factory.mktemp("tok")) / "tokenizer.json"
    path.write_text(tk.to_str())
    return llguidance.LLTokenizer(str(path), eos_token=vocab["<eos>"])


def accepts(tok: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()


def constraint_of(body: dict[str, Any]) -> str:
    choice = parse_tool_choice(body)
    assert choice is not None
    c = tool_constraint(choice)
    assert c is not None and c.kind is ConstraintKind.GRAMMAR
    assert llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_lark(c.value)) == ""
    return c.value


def test_required_grammar(byte_tokenizer) -> None:
    g = constraint_of({"tools": TOOLS, "tool_choice": "required"})
    one = block("add", '{"a": 1, "b": 2}')
    assert accepts(byte_tokenizer, g, one)
    assert accepts(byte_tokenizer, g, TWO_CALLS)  # parallel by default
    assert not accepts(byte_tokenizer, g, "plain text")
    assert not accepts(byte_tokenizer, g, block("add", '{"a": 1}'))  # b missing
    assert not accepts(byte_tokenizer, g, block("add", '{"a": "x", "b": 2}'))
    assert not accepts(byte_tokenizer, g, block("nope", "{}"))
    assert not accepts(byte_tokenizer, g, block("now", '{"x": 1}'))  # no parameters
    assert not accepts(byte_tokenizer, g, block("add", '{"a":1,"b":2}'))  # layout fixed
    single = constraint_of({"tools": TOOLS, "tool_choice": "required",
                            "parallel_tool_calls": False})
    assert accepts(byte_tokenizer, single, one)
    assert not accepts(byte_tokenizer, single, TWO_CALLS)


def test_objects_closed_unless_the_schema_opens_them(byte_tokenizer) -> None:
    open_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "object", "properties": {
            "y": {"type": "integer"}}}, "z": {"type": "array", "items": {
                "type": "object", "properties": {"k": {"type": "string"}}}}},
        "$defs": {"d": {"type": "object", "additionalProperties": True}}}}}
    g = constraint_of({"tools": [open_tool], "tool_choice": "required"})
    assert accepts(byte_tokenizer, g, block("f", '{"x": {"y": 1}, "z": [{"k": "v"}]}'))
    assert not accepts(byte_tokenizer, g, block("f", '{"extra": 1}'))
    assert not accepts(byte_tokenizer, g, block("f", '{"x": {"extra": 1}}'))
    assert not accepts(byte_tokenizer, g, block("f", '{"z": [{"extra": 1}]}'))
    params = open_tool["function"]["parameters"]
    assert closed_objects(params)["$defs"]["d"]["additionalProperties"] is True
    assert "additionalProperties" not in params  # the request is not changed


def test_named_grammar(byte_tokenizer) -> None:
    g = constraint_of({"tools": TOOLS,
                       "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    one = block("get_weather", '{"city": "Oslo"}')
    assert accepts(byte_tokenizer, g, one)
    assert not accepts(byte_tokenizer, g, block("add", '{"a": 1, "b": 2}'))
    assert not accepts(byte_tokenizer, g, one + "\n" + one)  # one call, as vLLM


def test_auto_grammar_text_or_calls(byte_tokenizer) -> None:
    g = constraint_of({"tools": TOOLS})
    assert accepts(byte_tokenizer, g, "It is sunny.\nNo tool needed.")
    assert accepts(byte_tokenizer, g, "")
    assert accepts(byte_tokenizer, g, TWO_CALLS)
    # once the answer starts a call, the call is held to the tools' schemas
    assert not accepts(byte_tokenizer, g, block("add", '{"a": "x"}'))
    assert not accepts(byte_tokenizer, g, '<tool_call>\n{"name": "other"')


def test_fifty_tools_grammar_compiles(byte_tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": f"fn_{i}", "parameters": {
        "type": "object", "required": ["p0"],
        "properties": {f"p{j}": {"type": ["string", "integer", "boolean"][j % 3]}
                       for j in range(10)}}}} for i in range(50)]
    g = constraint_of({"tools": tools, "tool_choice": "required"})
    assert accepts(byte_tokenizer, g, block("fn_49", '{"p0": "x", "p1": 3}'))


# --------------------------------------------------------------------------- parser


@pytest.mark.parametrize(("text", "content", "calls"), [
    (TWO_CALLS, "", [("get_weather", '{"city": "Paris}", "days": 2}'), ("now", "{}")]),
    ("Just text.\n", "Just text.\n", []),
    ("Let me look.\n" + block("add", '{"a": 1, "b": 2}') + "\nDone",
     "Let me look.\nDone", [("add", '{"a": 1, "b": 2}')]),
    ("<tool_call>\n{\"oops\": 1}\n</tool_call>", "<tool_call>\n{\"oops\": 1}\n</tool_call>", []),
    # cut by max_tokens inside the arguments: the call is reported as far as it got
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b', "", [("add", '{"a": 1, "b')]),
    ("a <tool", "a <tool", []),
])
def test_split_tools_final(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    got = split_tools(text, final=True)
    assert got.content == content
    assert [(c.name, c.arguments) for c in got.calls] == calls
    for c in got.calls:
        if text.endswith("</tool_call>") or "</tool_call>\n" in text:
            json.loads(c.arguments)


def reassemble(pieces: list[tuple[str, list[dict[str, Any]]]]) -> tuple[str, list[list[str]]]:
    content, calls = "", []
    for text, items in pieces:
        content += text
        for it in items:
            if it["index"] == len(calls):
                assert set(it) == {"index", "id", "type", "function"} and it["type"] == "function"
                assert it["id"].startswith("call_")
                calls.append([it["function"]["name"], it["function"]["arguments"]])
            else:
                assert set(it) == {"index", "function"} and set(it["function"]) == {"arguments"}
                calls[it["index"]][1] += it["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("text", [
    TWO_CALLS, "Plain answer, no tools.  ", "Intro\n" + TWO_CALLS + "\nOutro",
    '<tool_call>\n{"name": "add", "arguments": {"a": [1, {"b": "}}"}]',
    "<tool_call>\nnot json\n</tool_call> then text",
])
def test_stream_deltas_reassemble_to_final_whatever_the_chunking(text: str) -> None:
    final = split_tools(text, final=True)
    rng = random.Random(7)
    for _ in range(100):
        stream, pieces, i = ToolStream(), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            pieces.append(stream.feed(text[i:i + n]))
            i += n
        pieces.append(stream.finish())
        content, calls = reassemble(pieces)
        assert content == final.content
        assert calls == [[c.name, c.arguments] for c in final.calls]


def test_stream_sends_name_before_arguments_end() -> None:
    stream = ToolStream()
    _, items = stream.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert items[0]["function"] == {"name": "add", "arguments": '{"a": 1'}
    _, items = stream.feed(', "b": 2}}\n</tool_call>')
    assert items == [{"index": 0, "function": {"arguments": ', "b": 2}'}}]
    assert stream.called


# --------------------------------------------------------------------------- prompt

HERMES_LIKE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
               "{% endif %}{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}")
SMOLLM2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
           "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}")


def test_template_takes_tools() -> None:
    assert template_takes_tools(HERMES_LIKE)
    assert not template_takes_tools(SMOLLM2)
    assert not template_takes_tools(None)


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "9C"},
]


def test_default_tool_prompt_and_history() -> None:
    choice = parse_tool_choice({"tools": TOOLS, "tool_choice": "required"})
    msgs, extra = tool_messages(HISTORY, choice, takes_tools=False)
    assert extra == {}
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in msgs[0]["content"]
    assert "must call at least one function" in msgs[0]["content"]
    assert msgs[2]["content"] == (block("get_weather", '{"city": "Paris"}') + "\n"
                                  + block("get_weather", '{"city": "Oslo"}'))
    assert "tool_calls" not in msgs[2]
    assert msgs[3]["content"] == ("<tool_response>\n18C\n</tool_response>\n"
                                  "<tool_response>\n9C\n</tool_response>")
    assert HISTORY[2]["tool_calls"] and HISTORY[0]["content"] == "Be brief."  # not mutated
    # tool_choice none: the history still renders, no tools are offered
    msgs, _ = tool_messages(HISTORY, parse_tool_choice({"tools": TOOLS, "tool_choice": "none"}),
                            takes_tools=False)
    assert msgs[0]["content"] == "Be brief." and len(msgs) == 4


def test_template_with_tools_gets_them() -> None:
    choice = parse_tool_choice({"tools": TOOLS,
                                "tool_choice": {"type": "function", "function": {"name": "add"}}})
    msgs, extra = tool_messages(HISTORY, choice, takes_tools=True)
    assert extra == {"tools": [ADD]}
    assert [m["role"] for m in msgs] == [m["role"] for m in HISTORY]
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


# --------------------------------------------------------------------------- over HTTP


@dataclass
class ScriptEngine(FakeEngine):
    """'Generates' ``script`` three characters per token (EOS at the end, LENGTH when
    ``max_new_tokens`` runs out first)."""

    tokenizer: ChatTokenizer = None  # type: ignore[assignment]
    cfg: Cfg = None  # type: ignore[assignment]
    script: str = ""
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        self.tokenizer = ChatTokenizer()
        self.cfg = Cfg(max_iter_times=4000)

    async def compile_grammar(self, structured: StructuredOutput) -> str:
        """llguidance's own check of the constraint (the engine's compile needs a real
        tokenizer); ValueError as the engine raises it."""
        assert structured.kind is ConstraintKind.GRAMMAR
        grammar = llguidance.LLMatcher.grammar_from_lark(structured.value)
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(error)
        return grammar

    async def outputs(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        pieces = [self.script[i:i + 3] for i in range(0, len(self.script), 3)] or [""]
        pieces = pieces[:request.params.max_new_tokens]
        full = len(pieces) * 3 >= len(self.script)
        for i, piece in enumerate(pieces):
            await asyncio.sleep(0)
            last = i == len(pieces) - 1
            reason = (FinishReason.EOS if full else FinishReason.LENGTH) if last else None
            yield RequestOutput(request.request_id, (1,), piece, last, reason,
                                len(request.prompt_token_ids), i + 1, seed=request.params.seed)
        self.completed.append(request.request_id)


@pytest.fixture
async def script_env() -> AsyncIterator[tuple[ScriptEngine, httpx.AsyncClient]]:
    engine = ScriptEngine()
    async with serve_fake(engine, max_body_bytes=1 << 20) as (_, client):
        yield engine, client


def tool_body(**kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}],
            "tools": TOOLS, "tool_choice": "required", "max_tokens": 500}
    body.update(kw)
    return body


async def sse(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    events = [p[len(b"data: "):] for p in r.content.split(b"\n\n")[:-1]]
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


async def test_non_stream_tool_calls_and_constraint(script_env) -> None:
    engine, client = script_env
    engine.script = TWO_CALLS
    r = await client.post("/v1/chat/completions", json=tool_body())
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] is None
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("function", "get_weather",
                                             {"city": "Paris}", "days": 2}),
                                            ("function", "now", {})]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    params = engine.requests[-1].params
    assert params.structured is not None and params.structured.kind is ConstraintKind.GRAMMAR
    prompt = "".join(chr(i) for i in engine.requests[-1].prompt_token_ids)
    assert prompt.startswith("<system># Tools") and '"name": "add"' in prompt


async def test_stream_deltas_equal_non_stream(script_env) -> None:
    engine, client = script_env
    engine.script = "Checking.\n" + TWO_CALLS
    whole = (await client.post("/v1/chat/completions", json=tool_body(tool_choice="auto")))
    message = whole.json()["choices"][0]["message"]
    events = await sse(client, tool_body(tool_choice="auto"))
    first = [e["choices"][0]["delta"]["tool_calls"][0] for e in events
             if e["choices"] and "tool_calls" in e["choices"][0]["delta"]]
    heads = [it for it in first if "id" in it]
    assert [h["index"] for h in heads] == [0, 1] and all(h["type"] == "function" for h in heads)
    pieces = [(e["choices"][0]["delta"]["content"], e["choices"][0]["delta"].get("tool_calls", []))
              for e in events if e["choices"]]
    content, calls = reassemble(pieces)
    assert content == message["content"] == "Checking."
    assert calls == [[c["function"]["name"], c["function"]["arguments"]]
                     for c in message["tool_calls"]]
    assert sum(1 for h in pieces if len(h[1]) and "id" not in h[1][0]) >= 1  # fragments
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_auto_text_answer_has_no_calls(script_env) -> None:
    engine, client = script_env
    engine.script = "It is sunny in Paris."
    r = await client.post("/v1/chat/completions", json=tool_body(tool_choice="auto"))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "It is sunny in Paris.",
                                 "tool_calls": []}
    events = await sse(client, tool_body(tool_choice="auto"))
    assert "".join(e["choices"][0]["delta"]["content"] for e in events if e["choices"]) \
        == "It is sunny in Paris."
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_length_cut_call_says_length(script_env) -> None:
    engine, client = script_env
    engine.script = block("add", '{"a": 1, "b": 2}')
    r = await client.post("/v1/chat/completions", json=tool_body(max_tokens=16))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1'}


async def test_tool_choice_none_sends_no_tools_and_parses_nothing(script_env) -> None:
    engine, client = script_env
    engine.script = TWO_CALLS
    r = await client.post("/v1/chat/completions", json=tool_body(tool_choice="none"))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == TWO_CALLS and choice["message"]["tool_calls"] == []
    assert choice["finish_reason"] == "stop"
    assert engine.requests[-1].params.structured is None
    assert "# Tools" not in "".join(chr(i) for i in engine.requests[-1].prompt_token_ids)


async def test_tool_result_round_trip_prompt(script_env) -> None:
    engine, client = script_env
    engine.script = "Paris 18C, Oslo 9C."
    r = await client.post("/v1/chat/completions", json=tool_body(messages=HISTORY,
                                                                 tool_choice="auto"))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Paris 18C, Oslo 9C."
    prompt = "".join(chr(i) for i in engine.requests[-1].prompt_token_ids)
    assert "<tool_response>\n18C\n</tool_response>" in prompt and "<tool>" not in prompt


@pytest.mark.parametrize("bad", [
    {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": 5}}}}}]},
    {"tools": None},  # required without tools
    {"parallel_tool_calls": 1},
    {"response_format": {"type": "json_object"}},  # one constraint per answer
])
async def test_bad_tools_are_422_in_openai_shape(script_env, bad) -> None:
    engine, client = script_env
    r = await client.post("/v1/chat/completions", json=tool_body(**bad))
    assert_error(r, 422, "Input Validation Error")
    assert not engine.requests


async def test_openai_sdk_reads_tool_calls(script_env) -> None:
    engine, client = script_env
    engine.script = TWO_CALLS
    sdk = openai.AsyncOpenAI(base_url=str(client.base_url) + "/v1", api_key="x")
    out = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                    "content": "hi"}],
                                            tools=TOOLS, tool_choice="required")
    calls = out.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "now"]
    stream = await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                       "content": "hi"}],
                                               tools=TOOLS, tool_choice="required", stream=True)
    args: dict[int, str] = {}
    async for chunk in stream:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    assert [args[0], args[1]] == [c.function.arguments for c in calls]
    await sdk.close()


async def test_bench_tools_backend_reads_our_stream(script_env) -> None:
    """``tokenserve bench --backend openai-tools``: its body is accepted and its parser
    times the tool-call deltas and counts tokens from usage."""
    from tokenserve.loadgen.clients import StreamReader, get_backend
    from tokenserve.loadgen.workload import BenchRequest

    engine, client = script_env
    engine.script = TWO_CALLS
    backend = get_backend("openai-tools")
    req = BenchRequest(0, (1, 2, 3), "weather?", 80)
    path, body = backend.build(req, MODEL)
    assert body["tool_choice"] == "required" and "ignore_eos" not in body
    reader = StreamReader(backend, req)
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        t = 0.0
        async for chunk in r.aiter_bytes():
            t += 0.01
            reader.feed(t, chunk)
    rec = reader.finish(t + 0.01)
    assert rec.ok, rec.error
    assert rec.output_tokens == -(-len(TWO_CALLS) // 3) and rec.token_source == "usage"
    assert rec.ttft is not None
    assert "get_weather" in reader.text and '{"city": "Paris}", "days": 2}' in reader.text
    assert engine.requests[-1].params.structured is not None


def test_local_refs_resolve_under_the_wrapper(byte_tokenizer) -> None:
    """Pydantic-made parameters use ``$defs`` and ``$ref``; two tools may both name a
    definition ``Item``, and ``$ref: "#"`` is the tool's own schema."""
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"v": {"type": "integer"},
                                         "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v"]}}}
    cart = {"type": "function", "function": {"name": "cart", "parameters": {
        "type": "object", "$defs": {"Item": {"type": "object", "properties": {
            "sku": {"type": "string"}}, "required": ["sku"]}},
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
        "required": ["items"]}}}
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "definitions": {"Item": {"type": "integer"}},
        "properties": {"n": {"$ref": "#/definitions/Item"}}, "required": ["n"]}}}
    g = constraint_of({"tools": [tree, cart, other], "tool_choice": "required"})
    assert accepts(byte_tokenizer, g, block("cart", '{"items": [{"sku": "a1"}]}'))
    assert not accepts(byte_tokenizer, g, block("cart", '{"items": [{"sku": 1}]}'))
    assert accepts(byte_tokenizer, g, block("other", '{"n": 3}'))
    assert not accepts(byte_tokenizer, g, block("other", '{"n": "x"}'))
    assert accepts(byte_tokenizer, g, block("tree", '{"v": 1, "kids": [{"v": 2, "kids": []}]}'))
    assert not accepts(byte_tokenizer, g, block("tree", '{"v": 1, "kids": [{"x": 2}]}'))
