"""Each model family's own tool-call text: how calls are written, how the grammar
constrains them, and how a (growing) text is read back.

Formats (sources: each family's chat template in its tokenizer_config.json; vLLM's
``hermes_tool_parser``, ``llama_tool_parser``, ``mistral_tool_parser``,
``granite_tool_parser`` were read as a reference):

- ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3; our default, SmolLM2 uses it):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call;
  read by :mod:`tokenserve.api.openai.toolparse`.
- ``llama`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): one bare object
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``; the
  template allows one call per turn, so the grammar writes exactly one.
- ``mistral`` (Mistral v0.3+, Mixtral 8x22B): ``[TOOL_CALLS] [{"name": ..., "arguments":
  {...}}, ...]``.
- ``granite`` (Granite 3.x): ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``.

The three "marker" formats share one reader (:func:`split_marked`): content before the
marker, then a JSON object or list of call objects. Each call's ``arguments`` is the JSON
value's own text as generated, so streamed deltas reassemble to the final answer.

Special tokens: real tokenizers hold the markers (:attr:`ToolFormat.tokens`) as added
tokens with ``special: true`` (Qwen2.5's ``<tool_call>`` 151657 / ``</tool_call>``
151658, Mistral's ``[TOOL_CALLS]``, Granite's ``<|tool_call|>``, Llama 3.1's
``<|python_tag|>``). :func:`special_marker_ids` finds them once per tokenizer; the grammar
then writes each such marker as its token (``<[id]>`` in llguidance's Lark: a string
literal never matches a special token; worse, llguidance 1.9 masks a literal spelling a
special token's text down to that token, which the literal then rejects: a 500), and
the OpenAI handler asks
the detokeniser to keep exactly those tokens' text
(``SamplingParams.keep_special_token_ids``), so the reader sees the markers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Hermes' tags around one call.
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolFormat:
    """One family's call text.

    Attributes:
        name: ``hermes`` | ``llama`` | ``mistral`` | ``granite``.
        marker: what the model writes before its calls (Hermes: before each call).
        args_key: the key of a call's arguments (``arguments``; Llama ``parameters``).
        listed: the calls are one JSON list after the marker.
        many: more than one call per turn is possible.
        markers: every prefix that starts the calls when reading (Llama: ``<|python_tag|>``
            or a bare ``{``).
        tokens: the marker strings a tokenizer may hold as one special token (Hermes'
            open and close tags; Llama's ``<|python_tag|>``, optional before its call).
    """

    name: str
    marker: str
    args_key: str = "arguments"
    listed: bool = False
    many: bool = True
    markers: tuple[str, ...] = ()
    tokens: tuple[str, ...] = ()

    def render(self, calls: list[tuple[str, str]]) -> str:
        """Calls ``(name, arguments JSON text)`` as this format writes them (the grammar
        generates exactly this layout)."""
        objs = [f'{{"name": {_json_str(n)}, "{self.args_key}": {a}}}' for n, a in calls]
        if self.name == "hermes":
            return "\n".join(f"{CALL_OPEN}\n{o}\n{CALL_CLOSE}" for o in objs)
        if self.listed:
            return f"{self.marker}[{', '.join(objs)}]"
        return self.marker + "; ".join(objs)

    def grammar(self, body_schema: str, parallel: bool, auto: bool,
                special: Mapping[str, int] | None = None) -> str:
        """The llguidance Lark grammar: ``body_schema`` is one call object's JSON Schema
        text; ``parallel`` allows more than one call; ``auto`` adds free text that does
        not start the calls. ``special``: markers the tokenizer holds as one special
        token -> its id (:func:`special_marker_ids`); those are written as the token
        (``<[id]>``), the way the model emits them (module docstring)."""
        sp = {t: special[t] for t in self.tokens if special and t in special}
        many = parallel and self.many
        if self.name == "hermes":
            head = _lark_seq([sp.get(CALL_OPEN, CALL_OPEN), "\n"])
            tail = _lark_seq(["\n", sp.get(CALL_CLOSE, CALL_CLOSE)])
            call = f"call: {head} body {tail}\n"
            calls = 'call ("\\n" call)*' if many else "call"
        elif self.listed:
            more = '(", " body)* ' if many else ""
            call = f'call: {_lark_seq([*self._marker_parts(sp), "["])} body {more}"]"\n'
            calls = "call"
        else:
            tag = [f"<[{i}]>? " for i in sp.values()]  # Llama: <|python_tag|> may lead
            call = f"call: {''.join(tag)}body\n"
            calls = "call"
        start = f"start: {calls}\n"
        if auto:
            avoid = "|".join(re.escape(m) for m in (self.markers or (self.marker,)))
            start = f"start: TEXT | {calls}\nTEXT: /(?s:.*)/ & ~/({avoid})(?s:.*)/\n"
        return start + call + f"body: %json {body_schema}\n"

    def _marker_parts(self, special: Mapping[str, int]) -> list[str | int]:
        """:attr:`marker` as text, its leading special token (if any) as the id."""
        for t, i in special.items():
            if self.marker.startswith(t):
                return [i, self.marker[len(t):]]
        return [self.marker]


def special_marker_ids(fmt: ToolFormat, tokenizer: Any) -> dict[str, int]:
    """The markers of ``fmt`` (:attr:`ToolFormat.tokens`) that ``tokenizer`` holds as one
    special token (an added token with ``special: true``): marker -> id. Empty when it
    has none of them, or does not list its special tokens (``all_special_ids``,
    ``convert_ids_to_tokens``: :class:`tokenserve.models.tokenizer.Tokenizer`)."""
    ids = list(getattr(tokenizer, "all_special_ids", None) or ())
    if not ids or not hasattr(tokenizer, "convert_ids_to_tokens"):
        return {}
    held = {t: i for t, i in zip(tokenizer.convert_ids_to_tokens(ids), ids, strict=True)
            if t is not None}
    return {t: held[t] for t in fmt.tokens if t in held}


def _lark_seq(parts: list[str | int]) -> str:
    """A Lark sequence of text (adjacent pieces joined into one literal) and special
    token ids (``<[id]>``)."""
    out: list[str] = []
    text = ""
    for p in parts:
        if isinstance(p, int):
            if text:
                out.append(f'"{_lark_str(text)}"')
                text = ""
            out.append(f"<[{p}]>")
        else:
            text += p
    if text:
        out.append(f'"{_lark_str(text)}"')
    return " ".join(out)


def _json_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _lark_str(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


HERMES = ToolFormat("hermes", CALL_OPEN, markers=(CALL_OPEN,), tokens=(CALL_OPEN, CALL_CLOSE))
LLAMA = ToolFormat("llama", "", args_key="parameters", many=False,
                   markers=("<|python_tag|>", "{"), tokens=("<|python_tag|>",))
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS] ", listed=True, markers=("[TOOL_CALLS]",),
                     tokens=("[TOOL_CALLS]",))
GRANITE = ToolFormat("granite", "<|tool_call|>", listed=True, markers=("<|tool_call|>",),
                     tokens=("<|tool_call|>",))
FORMATS = {f.name: f for f in (HERMES, LLAMA, MISTRAL, GRANITE)}


def detect_tool_format(template: str | None) -> ToolFormat:
    """The format a chat template writes calls in, from its text: ``[TOOL_CALLS]`` ->
    Mistral, ``<|tool_call|>`` -> Granite, ``<tool_call>`` -> Hermes, ``<|python_tag|>``
    or a ``"parameters"`` call object -> Llama; anything else -> Hermes (our default tool
    prompt's)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MISTRAL
    if "<|tool_call|>" in t:
        return GRANITE
    if CALL_OPEN in t:
        return HERMES
    if "<|python_tag|>" in t or re.search(r'"parameters"\s*:', t):
        return LLAMA
    return HERMES
