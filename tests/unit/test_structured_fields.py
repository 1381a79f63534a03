"""Each family's structured-output fields -> SamplingParams.structured (pure parsing,
tokenserve/api/structured.py and the families' protocol modules), and the grammar
compiler's own bounds (tokenserve/grammar/compiler.py) on a tiny tokenizer."""

from __future__ import annotations

import json

import pytest

from tokenserve.api.mindie.protocol import parse_mindie_body
from tokenserve.api.structured import parse_guided, parse_response_format, parse_tgi_grammar
from tokenserve.api.tgi.protocol import parse_tgi_body
from tokenserve.api.triton.protocol import parse_parameters
from tokenserve.api.vllm.protocol import parse_vllm_body
from tokenserve.sampling_params import ConstraintKind as K
from tokenserve.sampling_params import StructuredOutput as S

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_tgi_grammar_on_generate_bodies() -> None:
    for value in (SCHEMA, json.dumps(SCHEMA)):
        body = parse_tgi_body({"inputs": "x", "parameters": {
            "grammar": {"type": "json", "value": value}}}, False, "m")
        assert body.params.structured == S(K.JSON_SCHEMA, json.dumps(SCHEMA))
    body = parse_tgi_body({"inputs": "x", "parameters": {
        "grammar": {"type": "regex", "value": "[0-9]+"}}}, True, "m")
    assert body.params.structured == S(K.REGEX, "[0-9]+")
    assert parse_tgi_body({"inputs": "x"}, False, "m").params.structured is None
    for bad in ({"type": "xml", "value": "a"}, {"type": "regex"}, {"type": "json", "value": 3},
                "json"):
        with pytest.raises(ValueError):
            parse_tgi_grammar(bad)


def test_vllm_generate_guided_fields() -> None:
    def body(**kw):
        return parse_vllm_body({"prompt": "x", **kw}, default_max_tokens=20,
                               model_name="m").params.structured

    assert body(guided_choice=["yes", "no"]) == S(K.CHOICE, '["yes", "no"]')
    assert body(guided_regex="a+") == S(K.REGEX, "a+")
    assert body(guided_json=SCHEMA) == S(K.JSON_SCHEMA, json.dumps(SCHEMA))
    assert body(guided_grammar='start: "a"') == S(K.GRAMMAR, 'start: "a"')
    assert body() is None
    for bad in ({"guided_choice": "yes"}, {"guided_choice": [1]}, {"guided_grammar": ""},
                {"guided_json": 5}, {"guided_regex": "a", "guided_choice": ["a"]}):
        with pytest.raises(ValueError):
            parse_guided(bad)


def test_mindie_and_triton_response_format() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    for value in (fmt, json.dumps(fmt)):  # spec §1.1: a JSON string; [I] or an object
        b = parse_mindie_body({"inputs": "x", "parameters": {"response_format": value}}, 100)
        assert b.params.structured == S(K.JSON_SCHEMA, json.dumps(SCHEMA))
    p = parse_parameters({"response_format": {"type": "json_object"}}, typical_p=True)
    assert p.sampling.structured == S(K.JSON_OBJECT)
    assert parse_response_format({"type": "text"}) is None
    for bad in ("{not json", {"type": "json_schema"}, {"type": "json_schema", "json_schema": {
            "name": "x" * 65, "schema": {}}}, {"type": "json_schema", "json_schema": {
            "schema": {}, "strict": "yes"}}, [1]):
        with pytest.raises(ValueError):
            parse_response_format(bad)


def test_response_format_tgi_forms_and_error_lists_every_type() -> None:
    """TGI's chat forms: ``json`` / ``regex`` with a value, and ``json_object`` with a
    ``value`` read as ``json`` (what huggingface_hub sends for a json_schema); an unknown
    type's error names all five accepted types."""
    assert parse_response_format({"type": "json", "value": SCHEMA}) == \
        S(K.JSON_SCHEMA, json.dumps(SCHEMA))
    assert parse_response_format({"type": "json_object", "value": SCHEMA}) == \
        S(K.JSON_SCHEMA, json.dumps(SCHEMA))
    assert parse_response_format({"type": "json_object"}) == S(K.JSON_OBJECT)
    assert parse_response_format({"type": "regex", "value": "a+"}) == S(K.REGEX, "a+")
    with pytest.raises(ValueError) as err:
        parse_response_format({"type": "xml"})
    for kind in ("text", "json_object", "json_schema", "json", "regex"):
        assert kind in str(err.value)


# --------------------------------------------------------------------------- strict


#: a pydantic v2 ``model_json_schema()`` of a model with a nested model, a list of models
#: and an optional model: no ``additionalProperties`` anywhere
PYDANTIC_LIKE = {
    "$defs": {
        "Item": {"properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                 "required": ["sku", "qty"], "title": "Item", "type": "object"},
        "Address": {"properties": {"city": {"type": "string"}}, "required": ["city"],
                    "title": "Address", "type": "object"},
    },
    "properties": {
        "name": {"type": "string"},
        "items": {"items": {"$ref": "#/$defs/Item"}, "type": "array"},
        "ship_to": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]},
        "meta": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "pairs": {"type": "array", "items": {"type": "object",
                                             "properties": {"k": {"type": "string"}}}},
        "free": {"type": "object", "additionalProperties": True},
        "counts": {"type": "object", "additionalProperties": {
            "type": "object", "properties": {"n": {"type": "integer"}}}},
        "either": {"oneOf": [{"type": "object", "properties": {"x": {"type": "integer"}}},
                             {"type": "string"}]},
    },
    "required": ["name", "items"],
    "title": "Order",
    "type": "object",
}


def _strict(schema, strict=True):
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
    if strict is not None:
        fmt["json_schema"]["strict"] = strict
    got = parse_response_format(fmt)
    assert got is not None and got.kind is K.JSON_SCHEMA
    return json.loads(got.value)


def test_strict_json_schema_closes_every_object_that_says_nothing() -> None:
    """OpenAI strict mode (and xgrammar's ``strict_mode``): an object schema without
    ``additionalProperties`` allows no other keys; an explicit value is kept."""
    before = json.dumps(PYDANTIC_LIKE)
    s = _strict(PYDANTIC_LIKE)
    assert json.dumps(PYDANTIC_LIKE) == before  # the request's schema is not changed
    props = s["properties"]
    assert s["additionalProperties"] is False
    assert s["$defs"]["Item"]["additionalProperties"] is False
    assert s["$defs"]["Address"]["additionalProperties"] is False
    assert props["meta"]["additionalProperties"] is False
    assert props["pairs"]["items"]["additionalProperties"] is False  # array of objects
    assert props["either"]["oneOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["either"]["oneOf"][1]  # a string
    assert props["free"]["additionalProperties"] is True  # explicit true kept
    assert props["counts"]["additionalProperties"]["additionalProperties"] is False
    assert props["counts"]["additionalProperties"]["properties"] == {"n": {"type": "integer"}}
    assert props["ship_to"] == PYDANTIC_LIKE["properties"]["ship_to"]  # refs, null: as is
    assert props["name"] == {"type": "string"}
    # the JSON text of a schema is read the same way
    fmt = {"type": "json_schema", "json_schema": {"schema": before, "strict": True}}
    assert json.loads(parse_response_format(fmt).value) == s


def test_strict_json_schema_keeps_explicit_values_and_open_intersections() -> None:
    explicit = {"type": "object", "properties": {"a": {"type": "integer"}},
                "additionalProperties": {"type": "string"}}
    assert _strict(explicit) == explicit
    pattern = {"type": "object", "patternProperties": {"^x": {
        "type": "object", "properties": {"y": {"type": "integer"}}}}}
    got = _strict(pattern)
    assert "additionalProperties" not in got  # patternProperties says what extra keys are
    assert got["patternProperties"]["^x"]["additionalProperties"] is False
    both = {"type": "object", "allOf": [
        {"type": "object", "properties": {"a": {"type": "object", "properties": {
            "b": {"type": "integer"}}}}},
        {"type": "object", "properties": {"c": {"type": "integer"}}}]}
    got = _strict(both)
    # closing an intersection's branches (or its holder) would reject the others' keys
    assert "additionalProperties" not in got
    assert all("additionalProperties" not in b for b in got["allOf"])
    assert got["allOf"][0]["properties"]["a"]["additionalProperties"] is False
    typed = _strict({"type": ["object", "null"], "properties": {"a": {"type": "integer"}}})
    assert typed["additionalProperties"] is False
    assert _strict(True) is True and _strict({}) == {}  # not object schemas


def test_non_strict_json_schema_is_unchanged() -> None:
    for strict in (None, False):
        assert _strict(PYDANTIC_LIKE, strict) == PYDANTIC_LIKE
    # not JSON text: left for the compiler's 400
    fmt = {"type": "json_schema", "json_schema": {"schema": "{nope", "strict": True}}
    assert parse_response_format(fmt) == S(K.JSON_SCHEMA, "{nope")
