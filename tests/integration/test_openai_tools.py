"""OpenAI tool calling (issue 23) with the real model, through the real ``openai`` SDK.

SmolLM2-135M's template has no ``tools`` variable, so these run the default tool prompt;
``required`` and named calls are generated under the tools' grammar (the engine enforces
``SamplingParams.structured``), so every call parses and validates whatever the model's
judgement. ``auto`` is checked as a mechanism (the constraint is there, a text answer
stays text), not as the 135M model's choice to call.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="session")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = ["What is the weather in Paris?", "Add 2 and 40.", "Is it raining in Oslo?",
             "What is 7 plus 8?"]


@pytest_asyncio.fixture(loop_scope="session")
async def sdk(live):
    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0,
                                timeout=600)
    yield client
    await client.close()


async def ask(sdk, live, messages, **kw):
    kw.setdefault("max_tokens", 80)
    return await sdk.chat.completions.create(model=live.engine.model_name, messages=messages,
                                             **kw)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def check_calls(message, allowed: set[str]) -> list[tuple[str, dict]]:
    """Every call names an offered tool and its arguments parse and validate."""
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed, call
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("named", [None, "add", "get_weather"])
async def test_required_and_named_calls_always_parse_and_validate(sdk, live, named):
    """One call (named: always; required: parallel_tool_calls false), sampled at
    temperature 0.8 over 4 questions x 2 seeds: 100% parse and validate."""
    choice = "required" if named is None else {"type": "function", "function": {"name": named}}
    runs = [ask(sdk, live, user(q), tools=TOOLS, tool_choice=choice, temperature=0.8, seed=s,
                parallel_tool_calls=named is not None)
            for q in QUESTIONS for s in (1, 2)]
    answers = await asyncio.gather(*runs)
    for out in answers:
        c = out.choices[0]
        assert c.finish_reason == "tool_calls", c
        calls = check_calls(c.message, set(SCHEMAS) if named is None else {named})
        assert c.message.content is None and len(calls) == 1
    await live.assert_idle_and_leak_free()


async def test_parallel_calls_valid_up_to_a_cut(sdk, live):
    """required with parallel_tool_calls (the default): one or more calls; every call
    the answer finished validates; a 135M model tends to repeat calls until max_tokens,
    and then the answer says length (spec §5.5)."""
    out = (await ask(sdk, live, user("Weather in Paris, then in Rome?"), tools=TOOLS,
                     tool_choice="required", temperature=0, max_tokens=100)).choices[0]
    calls = out.message.tool_calls
    assert calls and out.finish_reason in ("tool_calls", "length")
    done = calls if out.finish_reason == "tool_calls" else calls[:-1]
    for call in done:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    await live.assert_idle_and_leak_free()


async def test_stream_deltas_reassemble_to_non_stream(sdk, live):
    kw = {"tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 100}
    msgs = user("What is the weather in Paris and in Rome?")
    full = (await ask(sdk, live, msgs, **kw)).choices[0]
    chunks = [c async for c in await ask(sdk, live, msgs, stream=True, **kw)]
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            if d.index not in calls:  # OpenAI: the first delta has id, type and name
                assert d.id and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert list(calls) == list(range(len(calls)))
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in full.message.tool_calls]
    assert len(calls) >= 1
    assert chunks[-1].choices[0].finish_reason == full.finish_reason
    assert full.finish_reason in ("tool_calls", "length")
    await live.assert_idle_and_leak_free()


async def test_tool_result_round_trip_gets_an_answer(sdk, live):
    first = (await ask(sdk, live, user("What is the weather in Paris?"), tools=TOOLS,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                       temperature=0)).choices[0].message
    [(name, args)] = check_calls(first, {"get_weather"})[:1]
    call = first.tool_calls[0]
    history = [*user("What is the weather in Paris?"),
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function",
                    "function": {"name": name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id,
                "content": json.dumps({"city": args["city"], "temperature_c": 18,
                                       "sky": "sunny"})}]
    out = (await ask(sdk, live, history, tools=TOOLS, tool_choice="none",
                     temperature=0)).choices[0]
    assert out.finish_reason in ("stop", "length")
    assert out.message.content and not out.message.tool_calls
    # the same turn with tool_choice auto: an answer either way, never a 4xx
    auto = (await ask(sdk, live, history, tools=TOOLS, temperature=0)).choices[0]
    assert auto.message.content or auto.message.tool_calls
    await live.assert_idle_and_leak_free()


async def test_auto_is_text_or_calls(sdk, live):
    """auto: the answer is constrained (text, or calls that validate); a text answer is
    returned as content with no calls."""
    outs = await asyncio.gather(*[ask(sdk, live, user(q), tools=TOOLS, temperature=0)
                                  for q in QUESTIONS])
    for out in outs:
        c = out.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            check_calls(c.message, set(SCHEMAS))
        else:
            assert c.finish_reason in ("stop", "length") and c.message.content
            assert "<tool_call>" not in c.message.content[:11]
    await live.assert_idle_and_leak_free()


async def test_fifty_tools(sdk, live):
    """50 tools of 4 parameters (~3k prompt tokens): the call validates, and a plain
    request sent alongside gets exactly the tokens it gets alone."""
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}",
        "parameters": {"type": "object", "required": ["p0"], "properties": {
            f"p{j}": {"type": ["string", "integer", "boolean"][j % 3]} for j in range(4)}}}}
        for i in range(50)]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    plain = user("Name a colour.")
    alone = (await ask(sdk, live, plain, max_tokens=12, temperature=0)).choices[0].message
    big, beside = await asyncio.gather(
        ask(sdk, live, user("Use tool 7 with p0 = hello."), tools=tools,
            tool_choice="required", temperature=0, max_tokens=120),
        ask(sdk, live, plain, max_tokens=12, temperature=0))
    assert beside.choices[0].message.content == alone.content
    c = big.choices[0]
    assert c.finish_reason == "tool_calls"
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    await live.assert_idle_and_leak_free()


async def test_bad_tools_are_422(sdk, live):
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        await ask(sdk, live, user("hi"), tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "missing"}})
    assert "not in tools" in exc.value.message
    await live.assert_idle_and_leak_free()


async def test_bench_tool_workload(tmp_path):
    """``tokenserve bench --backend openai-tools`` against a server it starts: the same
    summary as any backend, tokens counted from usage."""
    import subprocess
    import sys

    from tests.integration.test_bench_smoke import TINY, check_records, check_summary

    out = tmp_path / "tools.json"
    cmd = [sys.executable, "-m", "tokenserve.cli", "bench", "--backend", "openai-tools",
           "--num-prompts", "2", "--concurrency", "2", "--out", str(out), *TINY]
    proc = await asyncio.to_thread(subprocess.run, cmd, cwd=tmp_path, capture_output=True,
                                   text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (lv,) = json.loads(out.read_text())["levels"]
    check_summary(lv["ours"], 2, "usage", 4)
    check_records(lv["records"]["ours"], "usage", 4)


async def test_tgi_client_chat_completion_with_tools(live):
    """TGI's chat is this same route: ``huggingface_hub.InferenceClient.chat_completion``
    with ``tools`` reads the call (it also sends TGI's ``tool_prompt``, ignored)."""
    from huggingface_hub import InferenceClient

    hf = InferenceClient(base_url=live.url)
    out = await asyncio.to_thread(
        hf.chat_completion, user("What is the weather in Paris?"), model=live.engine.model_name,
        tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0,
        extra_body={"parallel_tool_calls": False})
    [call] = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    await live.assert_idle_and_leak_free()


async def test_tgi_client_named_tool_choice_without_type_or_model(live):
    """huggingface_hub's ``ChatCompletionInputToolChoiceClass`` sends a named choice
    without ``"type"``, and no ``model=`` sends a placeholder name: both as TGI takes them."""
    from huggingface_hub import (
        ChatCompletionInputFunctionName,
        ChatCompletionInputToolChoiceClass,
        InferenceClient,
    )

    hf = InferenceClient(base_url=live.url)
    choice = ChatCompletionInputToolChoiceClass(
        function=ChatCompletionInputFunctionName(name="add"))
    out = await asyncio.to_thread(
        hf.chat_completion, user("What is the weather in Paris?"), tools=TOOLS,
        tool_choice=choice, max_tokens=80, temperature=0)
    [call] = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["add"])
    await live.assert_idle_and_leak_free()
