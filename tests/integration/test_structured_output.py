"""Structured output with the real model (issue 23): the engine's constraint enforcement
through the AsyncEngine API, then each API family's fields over real HTTP."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
from typing import Annotated

import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from pydantic import BaseModel, Field

from tokenserve.grammar.compiler import GrammarLimits
from tokenserve.messages import FinishReason, GenerateRequest
from tokenserve.sampling_params import ConstraintKind, SamplingParams, StructuredOutput

pytestmark = pytest.mark.asyncio(loop_scope="session")
_ids = itertools.count()

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                 "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


async def run(live, prompt_ids, structured=None, **params):
    """One engine request's outputs (compiled as the HTTP layer compiles it)."""
    grammar = (await live.engine.compile_grammar(structured)
               if structured is not None else None)
    p = SamplingParams(**{"max_new_tokens": 96, "seed": 0, "structured": structured, **params})
    g = GenerateRequest(f"so-{next(_ids)}", tuple(prompt_ids), p, grammar=grammar)
    return [o async for o in live.engine.generate(g)]


def text_of(outs):
    return "".join(o.new_text for o in outs)


def schema(s) -> StructuredOutput:
    return StructuredOutput(ConstraintKind.JSON_SCHEMA, json.dumps(s))


async def test_json_schema_greedy_and_sampled_validate(live):
    ids = live.chat_ids("Describe a user of a web shop as JSON.")
    for params in ({}, {"do_sample": True, "temperature": 1.0, "seed": 7}):
        outs = await run(live, ids, schema(PERSON), **params)
        assert outs[-1].finish_reason is FinishReason.EOS, text_of(outs)
        jsonschema.validate(json.loads(text_of(outs)), PERSON)
    await live.assert_idle_and_leak_free()


async def test_regex_choice_json_object_grammar(live):
    ids = live.chat_ids("Give me a phone number.")
    outs = await run(live, ids, StructuredOutput(ConstraintKind.REGEX, r"\+1-\d{3}-\d{4}"))
    assert re.fullmatch(r"\+1-\d{3}-\d{4}", text_of(outs))
    ids = live.chat_ids("Is the sky green? Answer yes or no.")
    outs = await run(live, ids, StructuredOutput(ConstraintKind.CHOICE, '["yes", "no"]'),
                     do_sample=True, seed=3)
    assert text_of(outs) in ("yes", "no")
    outs = await run(live, ids, StructuredOutput(ConstraintKind.JSON_OBJECT))
    assert isinstance(json.loads(text_of(outs)), dict)
    g = 'start: "answer: " num\nnum: /[0-9]{1,4}/'
    outs = await run(live, live.chat_ids("How many legs has a spider?"),
                     StructuredOutput(ConstraintKind.GRAMMAR, g))
    assert re.fullmatch(r"answer: [0-9]{1,4}", text_of(outs))
    await live.assert_idle_and_leak_free()


async def test_invalid_constraints_are_value_errors(live):
    for bad in (StructuredOutput(ConstraintKind.REGEX, "(("),
                StructuredOutput(ConstraintKind.JSON_SCHEMA, '{"type": "nope"}'),
                StructuredOutput(ConstraintKind.JSON_SCHEMA, "{not json"),
                StructuredOutput(ConstraintKind.CHOICE, "[]"),
                StructuredOutput(ConstraintKind.GRAMMAR, "start: undefined_rule")):
        with pytest.raises(ValueError):
            await live.engine.compile_grammar(bad)
    p = SamplingParams(structured=StructuredOutput(ConstraintKind.JSON_OBJECT))
    with pytest.raises(ValueError, match="compiled grammar"):  # never admitted uncompiled
        live.engine.generate(GenerateRequest("so-uncompiled", (1, 2), p))


async def test_constrained_greedy_is_batch_invariant(live):
    """A greedy constrained request gives the same tokens alone and among constrained
    and unconstrained neighbours (masks touch only their own rows)."""
    ids = live.chat_ids("Describe a user of a web shop as JSON.")
    alone = await run(live, ids, schema(PERSON), max_new_tokens=48)
    prompts = [live.chat_ids(f"Tell me about the number {i}.") for i in range(7)]
    plain_alone = await run(live, prompts[0], max_new_tokens=24)
    jobs = [run(live, ids, schema(PERSON), max_new_tokens=48)]
    for i, p in enumerate(prompts):
        if i % 2:
            jobs.append(run(live, p, StructuredOutput(ConstraintKind.JSON_OBJECT),
                            max_new_tokens=24, do_sample=True, seed=i))
        else:
            jobs.append(run(live, p, max_new_tokens=24))
    together = await asyncio.gather(*jobs)
    toks = [t for o in alone for t in o.new_token_ids]
    assert [t for o in together[0] for t in o.new_token_ids] == toks
    assert [t for o in together[1] for t in o.new_token_ids] == \
        [t for o in plain_alone for t in o.new_token_ids]
    assert live.engine.stats().mask_steps > 0
    await live.assert_idle_and_leak_free()


# --------------------------------------------------------------------------- over HTTP


class Shop(BaseModel):
    """What the openai SDK's ``parse`` turns into a strict json_schema response_format.
    Bounded fields (maxLength, maxItems, maximum), so the grammar itself ends the answer:
    the 135M default model, greedy, repeats array items until ``max_tokens`` otherwise."""

    name: str = Field(max_length=40)
    price: int = Field(ge=0, le=100_000)
    tags: list[Annotated[str, Field(max_length=20)]] = Field(max_length=3)
    in_stock: bool


async def test_openai_sdk_parse_pydantic(live):
    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0,
                                timeout=600)
    try:
        for item in ("a bicycle", "a teapot"):
            r = await client.beta.chat.completions.parse(
                model=live.engine.model_name, response_format=Shop, max_tokens=160, seed=1,
                messages=[{"role": "user",
                                          "content": f"Describe {item} for sale as JSON."}])
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "stop", msg.content
            assert isinstance(msg.parsed, Shop), msg.content
    finally:
        await client.close()
    await live.assert_idle_and_leak_free()


async def test_openai_strict_json_schema_stream_and_not_validate(live):
    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0,
                                timeout=600)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    msgs = [{"role": "user", "content": "Invent a user of a web shop; answer in JSON."}]

    async def one(seed: int, stream: bool) -> str:
        kw = {"model": live.engine.model_name, "messages": msgs, "response_format": fmt,
                  "temperature": 1.0, "seed": seed, "max_tokens": 120}
        if not stream:
            r = await client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "stop"
            return r.choices[0].message.content
        parts = []
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)

    try:
        texts = await asyncio.gather(*(one(s, s % 2 == 0) for s in range(6)))
    finally:
        await client.close()
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    await live.assert_idle_and_leak_free()


# plain pydantic models: their ``model_json_schema()`` has no additionalProperties (the
# openai SDK's ``parse`` adds them; a client sending the schema itself does not)
class Pet(BaseModel):
    name: str = Field(max_length=20)
    species: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)


class Owner(BaseModel):
    name: str = Field(max_length=20)
    pet: Pet


async def test_openai_strict_schema_without_additional_properties_adds_no_keys(live):
    """``strict: true`` reads an absent ``additionalProperties`` as false (OpenAI,
    xgrammar): sampled at temperature 1 (seeded), every answer's keys are declared ones,
    at the top and in the nested model, and the answer ends (the model, left free to add
    keys, invents them until ``max_tokens``)."""
    schema = Owner.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema)
    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0,
                                timeout=600)
    fmt = {"type": "json_schema", "json_schema": {"name": "owner", "schema": schema,
                                                  "strict": True}}
    msgs = [{"role": "user", "content": "Invent a pet owner and their pet; answer in JSON "
                                        "with any details you like."}]

    async def one(seed: int):
        return await client.chat.completions.create(
            model=live.engine.model_name, messages=msgs, response_format=fmt,
            temperature=1.0, seed=seed, max_tokens=120)

    try:
        answers = await asyncio.gather(*(one(s) for s in range(6)))
    finally:
        await client.close()
    for r in answers:
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        obj = json.loads(text)
        assert set(obj) <= set(Owner.model_fields), text
        assert set(obj.get("pet", {})) <= set(Pet.model_fields), text
        Owner.model_validate(obj)
    await live.assert_idle_and_leak_free()


async def test_tgi_client_grammar_json_and_regex(live):
    hf = InferenceClient(base_url=live.url)
    prompt = live.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Invent a user of a web shop."}], add_generation_prompt=True)
    out = await asyncio.to_thread(hf.text_generation, prompt, max_new_tokens=120,
                                  grammar={"type": "json", "value": PERSON})
    jsonschema.validate(json.loads(out), PERSON)
    out = await asyncio.to_thread(hf.text_generation, prompt, max_new_tokens=20,
                                  grammar={"type": "regex", "value": r"[A-Z][a-z]{2,8} [0-9]{2}"})
    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", out), out
    await live.assert_idle_and_leak_free()


async def test_tgi_client_chat_completion_json_schema_without_model(live):
    """``InferenceClient(base_url).chat_completion`` without ``model=`` sends a placeholder
    model name, and turns a ``json_schema`` into TGI's ``{"type": "json_object", "value":
    schema}``: both are served, and the schema holds (not just any JSON object)."""
    hf = InferenceClient(base_url=live.url)
    out = await asyncio.to_thread(
        hf.chat_completion, [{"role": "user", "content": "Invent a user of a web shop."}],
        max_tokens=120, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert out.model == live.engine.model_name
    assert out.choices[0].finish_reason == "stop", out
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    await live.assert_idle_and_leak_free()


async def test_vllm_guided_choice_and_regex(live, client):
    prompt = live.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which is a fruit: apple or car?"}],
        add_generation_prompt=True)
    r = await client.post("/generate", json={"prompt": prompt, "max_tokens": 10,
                                             "guided_choice": ["apple", "car"]})
    assert r.status_code == 200, r.text
    assert r.json()["text"][0] in (prompt + " apple", prompt + " car")  # "<prompt> <text>"
    r = await client.post("/v1/completions", json={
        "model": live.engine.model_name, "prompt": prompt, "max_tokens": 12,
        "guided_regex": "(yes|no), [a-z]+"})
    assert r.status_code == 200, r.text
    assert re.fullmatch("(yes|no), [a-z]+", r.json()["choices"][0]["text"])
    await live.assert_idle_and_leak_free()


BAD_REGEX = "([a-z"


async def test_invalid_constraint_400_in_each_family_shape(live, client):
    """A constraint that does not compile is a 400 before any compute, in the body shape
    the family gives its other errors (the 422 of a bad field, for comparison)."""
    m = live.engine.model_name
    cases = [  # (path, bad constraint body, bad field body)
        ("/v1/chat/completions",
         {"model": m, "messages": [{"role": "user", "content": "x"}], "guided_regex": BAD_REGEX},
         {"model": m, "messages": [{"role": "user", "content": "x"}], "seed": -1}),
        ("/generate", {"prompt": "x", "guided_regex": BAD_REGEX}, {"prompt": "x", "n": 0}),
        ("/generate", {"inputs": "x", "parameters": {"grammar": {
            "type": "json", "value": {"type": "nope"}}}},
         {"inputs": "x", "parameters": {"top_p": 5}}),
        ("/generate_stream", {"inputs": "x", "parameters": {"grammar": {
            "type": "regex", "value": BAD_REGEX}}}, {"inputs": "x", "parameters": {"top_p": 5}}),
        ("/infer", {"inputs": "x", "parameters": {"response_format": json.dumps(
            {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})}},
         {"inputs": "x", "parameters": {"top_p": 5}}),
        (f"/v2/models/{m}/generate", {"text_input": "x", "parameters": {"response_format": {
            "type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}},
         {"text_input": "x", "parameters": {"top_p": 5}}),
    ]
    before = live.engine.stats().finished_by_reason
    for path, bad, bad_field in cases:
        r = await client.post(path, json=bad)
        ref = await client.post(path, json=bad_field)
        assert r.status_code == 400, (path, r.text)
        assert 400 <= ref.status_code < 500, (path, ref.text)
        assert set(r.json()) == set(ref.json()), (path, r.json(), ref.json())
    assert live.engine.stats().finished_by_reason == before  # nothing reached the engine
    await live.assert_idle_and_leak_free()


async def test_stuck_compile_never_stalls_other_requests(live, client, monkeypatch):
    """A constraint whose compile does not end (held here on an event) leaves the event
    loop, the engine and other compiles free: unconstrained and constrained requests sent
    after it are answered while it is still compiling."""
    compiler = live.engine.grammars.compiler()
    release = threading.Event()
    real = compiler.compile

    def compile_(s):
        if s.value == "stuck[0-9]":
            release.wait(300)
        return real(s)

    monkeypatch.setattr(compiler, "compile", compile_)
    monkeypatch.setattr(compiler, "limits", GrammarLimits(compile_timeout_s=600))
    m = live.engine.model_name

    def body(**kw):
        return {"model": m, "messages": [{"role": "user", "content": "Count to five."}],
                "max_tokens": 8, **kw}

    stuck = asyncio.ensure_future(client.post("/v1/chat/completions",
                                              json=body(guided_regex="stuck[0-9]")))
    try:
        others = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=body(seed=i)) for i in range(4)),
            client.post("/v1/chat/completions", json=body(guided_regex="[0-9]{3}")))
        assert [r.status_code for r in others] == [200] * 5
        assert not stuck.done()
    finally:
        release.set()
    r = await stuck
    assert r.status_code == 200 and re.fullmatch(
        "stuck[0-9]", r.json()["choices"][0]["message"]["content"])
    await live.assert_idle_and_leak_free()


async def test_pathological_schemas_over_http(live, client):
    """Too deep a schema is refused (422 when the body nests too deep, 400 when the
    schema comes as JSON text); a long maxLength string and many maxItems generate
    with every step's mask inside llguidance's fuel (the request is cut by max_tokens,
    and its text is a valid prefix)."""
    deep = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    m = live.engine.model_name
    msgs = [{"role": "user", "content": "Write a long list of words as JSON."}]

    def body(schema):
        return {"model": m, "messages": msgs, "max_tokens": 24, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}

    r = await client.post("/v1/chat/completions", json=body(deep))
    assert r.status_code == 422  # the body itself is nested deeper than the server allows
    r = await client.post("/v1/chat/completions", json={  # as JSON text: the compiler's call
        "model": m, "messages": msgs, "max_tokens": 24, "guided_json": json.dumps(deep)})
    assert r.status_code == 400 and "recursion" in r.json()["error"]["message"]
    for schema in ({"type": "object", "required": ["s"], "properties": {
            "s": {"type": "string", "minLength": 2000, "maxLength": 100_000}}},
                   {"type": "array", "minItems": 500, "maxItems": 10_000,
                    "items": {"type": "string", "maxLength": 1000}}):
        r = await client.post("/v1/chat/completions", json=body(schema))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"].lstrip()[:1] in ("{", "[")
    await live.assert_idle_and_leak_free()
