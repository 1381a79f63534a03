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
