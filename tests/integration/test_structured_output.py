"""Structured output with the real model (issue 23): the engine's constraint enforcement
through the AsyncEngine API, then each API family's fields over real HTTP."""

from __future__ import annotations

import asyncio
import itertools
import json
import re

import jsonschema
import pytest

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
