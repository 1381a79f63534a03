"""Each family's structured-output fields -> one :class:`StructuredOutput` (issue 23,
spec interfaces.md §5.5).

Only the shape of the fields is checked here (``ValueError``: the family's usual 4xx for a
bad field); whether a schema, regex or grammar is valid is the compiler's call
(``AsyncEngine.compile_grammar``: 400 in the family's shape, before any compute).

Sources:
    OpenAI  ``response_format``: ``{"type": "text"}`` | ``{"type": "json_object"}`` |
            ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
            (platform.openai.com/docs/api-reference/chat/create#chat-create-response_format);
            [I] also TGI's chat form ``{"type": "json"|"regex", "value"}`` (TGI serves
            ``/v1/chat/completions`` with it; TGI reads ``json_object`` with a ``value`` as
            ``json``, which ``huggingface_hub``'s ``chat_completion`` sends for a
            ``json_schema``), and ``strict: false`` is enforced too (as vLLM).
            ``strict: true`` closes the schema's objects first (:func:`closed_objects`:
            OpenAI's strict mode and xgrammar's ``strict_mode`` read an absent
            ``additionalProperties`` as false; JSON Schema itself reads it as true).
    vLLM    ``guided_json`` (object or JSON text), ``guided_regex``, ``guided_choice``
            (list of strings), ``guided_grammar`` (docs.vllm.ai "Structured Outputs"); at
            most one of them, and not with a non-text ``response_format``.
            [I] ``guided_grammar`` is llguidance's Lark dialect (GBNF is not converted).
    TGI     ``parameters.grammar``: ``{"type": "json"|"regex", "value"}``
            (huggingface.co/docs/text-generation-inference "Guidance"); ``value`` of
            ``json`` is a schema object or its JSON text.
    MindIE  ``response_format`` (spec §1.1: a JSON string) on the native and Triton
            bodies [I]: the OpenAI shape, as an object or its JSON text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tokenserve.sampling_params import ConstraintKind, StructuredOutput

#: OpenAI: ``json_schema.name`` is 1..64 of a-z, A-Z, 0-9, underscore and dash.
_NAME_MAX = 64
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
#: where a schema holds subschemas :func:`closed_objects` closes: lists of them, maps of
#: them, and single ones (``items`` may be a list too: the draft-4 tuple form).
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_ONE = ("items", "additionalItems", "additionalProperties")
#: an object schema with one of these says what extra keys may be: left as it is.
_EXTRA_KEYS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema (``type``
    ``object``, or one listing ``properties``) that says nothing about extra keys [I]:
    what OpenAI's strict mode and xgrammar's ``strict_mode`` do; an explicit value
    (``true`` or a schema) is kept. A copy: ``schema`` is not changed.

    Reached: ``properties``, ``patternProperties``, ``$defs`` / ``definitions``,
    ``items`` (one or a list), ``prefixItems``, ``additionalItems``, a schema-valued
    ``additionalProperties``, ``anyOf`` and ``oneOf`` branches. ``allOf`` is read as an
    intersection (llguidance, as JSON Schema): closing its branches, or the object that
    holds it, would reject the other branches' keys, so those stay open (the schemas
    nested in them are closed). ``not`` and ``if``/``then``/``else`` are left as they are
    (closing a negated or conditional schema would widen what it allows).

    The grammar then generates only the declared properties: a 135M model left free to
    add keys writes made-up ones until ``max_tokens``. Every such answer still validates
    against the original schema (it allows a superset).
    """
    return _close(schema, close_self=True)


def _close(schema: Any, *, close_self: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _close(v, close_self=True) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(v, close_self=True) for v in out[key]]
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], close_self=True)
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(v, close_self=False) for v in out["allOf"]]
        close_self = False
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) \
        or (kind is None and "properties" in out)
    if close_self and is_object and not _EXTRA_KEYS & out.keys():
        out["additionalProperties"] = False
    return out


def _json_text(value: Any, where: str) -> str:
    """A schema given as an object (or boolean), or as its JSON text, as JSON text."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    raise ValueError(f"Parameter {where} must be a JSON schema object.")


def _schema_value(value: Any, where: str, *, strict: bool = False) -> StructuredOutput:
    """A JSON_SCHEMA constraint; ``strict``: its objects closed (:func:`closed_objects`).
    A schema text that is not JSON is kept as it is (the compiler's 400 names it)."""
    if strict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return StructuredOutput(ConstraintKind.JSON_SCHEMA, value)
        value = closed_objects(value)
    return StructuredOutput(ConstraintKind.JSON_SCHEMA, _json_text(value, where))


def _regex_value(value: Any, where: str) -> StructuredOutput:
    if not isinstance(value, str) or not value:
        raise ValueError(f"Parameter {where} must be a non-empty string.")
    return StructuredOutput(ConstraintKind.REGEX, value)


def parse_response_format(value: Any, *, name: str = "response_format") -> StructuredOutput | None:
    """OpenAI ``response_format`` (also TGI's chat form); None for absent or ``text``.

    Raises:
        ValueError: not one of the shapes above.
    """
    if value is None:
        return None
    if isinstance(value, str):  # MindIE: a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"Parameter {name} must be a JSON object.") from None
    if not isinstance(value, dict):
        raise ValueError(f"Parameter {name} must be an object.")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        if value.get("value") is not None:  # TGI: json_object is an alias of json
            return _schema_value(value["value"], f"{name}.value")
        return StructuredOutput(ConstraintKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError(f"Parameter {name}.json_schema must be an object.")
        label = spec.get("name")
        if label is not None and (not isinstance(label, str)
                                  or not 0 < len(label) <= _NAME_MAX):
            raise ValueError(f"Parameter {name}.json_schema.name must have 1 to "
                             f"{_NAME_MAX} characters.")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"Parameter {name}.json_schema.strict must be a boolean.")
        schema = spec.get("schema")
        if schema is None:  # OpenAI: schema is optional; then any JSON value
            schema = {}
        return _schema_value(schema, f"{name}.json_schema.schema", strict=strict is True)
    if kind == "json":  # TGI chat
        return _schema_value(value.get("value"), f"{name}.value")
    if kind == "regex":  # TGI chat
        return _regex_value(value.get("value"), f"{name}.value")
    raise ValueError(f"Parameter {name}.type must be text, json_object, json_schema, json "
                     "or regex.")


def parse_guided(obj: Mapping[str, Any]) -> StructuredOutput | None:
    """vLLM's ``guided_*`` fields of a body; None when none is given.

    Raises:
        ValueError: more than one given, or a field of the wrong type.
    """
    given = [k for k in _GUIDED if obj.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"Only one kind of guided decoding may be given, got {', '.join(given)}.")
    key = given[0]
    value = obj[key]
    if key == "guided_json":
        return _schema_value(value, key)
    if key == "guided_regex":
        return _regex_value(value, key)
    if key == "guided_choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) for c in value)):
            raise ValueError("Parameter guided_choice must be a non-empty list of strings.")
        return StructuredOutput(ConstraintKind.CHOICE, json.dumps(value))
    if not isinstance(value, str) or not value:
        raise ValueError("Parameter guided_grammar must be a non-empty string.")
    return StructuredOutput(ConstraintKind.GRAMMAR, value)


def parse_openai_structured(obj: Mapping[str, Any]) -> StructuredOutput | None:
    """The constraint of an OpenAI chat/completions body: ``response_format`` or vLLM's
    ``guided_*`` (the same routes accept both).

    Raises:
        ValueError: a bad field, or both a non-text ``response_format`` and ``guided_*``.
    """
    fmt = parse_response_format(obj.get("response_format"))
    guided = parse_guided(obj)
    if fmt is not None and guided is not None:
        raise ValueError("Parameters response_format and guided_* cannot be given together.")
    return fmt or guided


def parse_tgi_grammar(value: Any) -> StructuredOutput | None:
    """TGI ``parameters.grammar``; None for absent.

    Raises:
        ValueError: not ``{"type": "json"|"regex", "value": ...}``.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("Parameter grammar must be an object.")
    kind = value.get("type")
    if kind == "json":
        return _schema_value(value.get("value"), "grammar.value")
    if kind == "regex":
        return _regex_value(value.get("value"), "grammar.value")
    raise ValueError("Parameter grammar.type must be json or regex.")
