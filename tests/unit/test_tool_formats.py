"""Each family's tool-call format (issue 39): detection from the chat template's text,
the grammar of each format (accepts its own call text, rejects another family's), and the
reader (``split_tools`` on the final text and as stream deltas over every prefix)."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from tests.unit.test_api_openai_tools import TOOLS, accepts, byte_tokenizer, reassemble  # noqa: F401
from tokenserve.api.openai.tool_formats import (
    FORMATS,
    GRANITE,
    HERMES,
    LLAMA,
    MISTRAL,
    ToolFormat,
    detect_tool_format,
)
from tokenserve.api.openai.toolparse import ToolStream, split_tools
from tokenserve.api.openai.tools import parse_tool_choice, tool_constraint, tool_messages

ONE = [("add", '{"a": 1, "b": 2}')]
TWO = [("get_weather", '{"city": "Paris}", "days": 2}'), ("now", "{}")]

# Small templates in each family's style (the call-writing parts of the real ones).
TEMPLATES = {
    "mistral": "{%- for m in messages %}{%- if m.tool_calls %}[TOOL_CALLS] "
               "{{ m.tool_calls|tojson }}{%- endif %}{%- endfor %}"
               "{%- if tools %}[AVAILABLE_TOOLS] {{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}",
    "granite": "{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools|tojson }}"
               "{% endif %}{%- for m in messages %}{%- if m.tool_calls %}<|tool_call|>"
               "{{ m.tool_calls|tojson }}{% endif %}{%- endfor %}",
    "llama": "{%- if tools %}Respond in the format {\"name\": function name, \"parameters\": "
             "dictionary of argument name and its value}.{{ tools|tojson }}{% endif %}"
             "{%- for m in messages %}{%- if m.tool_calls %}<|python_tag|>{{ m.tool_calls[0]"
             ".function|tojson }}{% endif %}{{ m.content }}{%- endfor %}",
    "hermes": "{%- if tools %}<tools>{{ tools|tojson }}</tools>{% endif %}"
              "{%- for m in messages %}{%- if m.tool_calls %}<tool_call>\n{{ m.tool_calls|tojson }}"
              "\n</tool_call>{% endif %}{%- endfor %}",
}


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_detect_from_template(family: str) -> None:
    assert detect_tool_format(TEMPLATES[family]) is FORMATS[family]


def test_detect_falls_back_to_hermes() -> None:
    assert detect_tool_format(None) is HERMES
    assert detect_tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is HERMES


def grammar(fmt: ToolFormat, mode: str, parallel: bool = True) -> str:
    body = {"tools": TOOLS, "tool_choice": mode, "parallel_tool_calls": parallel}
    if mode == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": "add"}}
    choice = parse_tool_choice(body)
    assert choice is not None
    c = tool_constraint(choice, fmt)
    assert c is not None
    assert llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_lark(c.value)) == ""
    return c.value


@pytest.mark.parametrize("fmt", [HERMES, LLAMA, MISTRAL, GRANITE], ids=lambda f: f.name)
def test_grammar_accepts_own_format_only(fmt: ToolFormat, byte_tokenizer) -> None:  # noqa: F811
    req = grammar(fmt, "required")
    assert accepts(byte_tokenizer, req, fmt.render(ONE))
    assert accepts(byte_tokenizer, req, fmt.render(TWO)) == fmt.many
    assert not accepts(byte_tokenizer, req, "plain text")
    assert not accepts(byte_tokenizer, req, fmt.render([("add", '{"a": 1}')]))  # b missing
    assert not accepts(byte_tokenizer, req, fmt.render([("nope", "{}")]))
    for other in FORMATS.values():
        if other is not fmt:
            assert not accepts(byte_tokenizer, req, other.render(ONE)), other.name
    single = grammar(fmt, "required", parallel=False)
    assert accepts(byte_tokenizer, single, fmt.render(ONE))
    assert not accepts(byte_tokenizer, single, fmt.render(TWO))
    named = grammar(fmt, "named")
    assert accepts(byte_tokenizer, named, fmt.render(ONE))
    assert not accepts(byte_tokenizer, named, fmt.render([("now", "{}")]))
    auto = grammar(fmt, "auto")
    assert accepts(byte_tokenizer, auto, "Plain answer.")
    assert accepts(byte_tokenizer, auto, fmt.render(ONE))
    assert not accepts(byte_tokenizer, auto, fmt.render([("nope", "{}")]))


def texts(fmt: ToolFormat) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(text, content, calls) cases of ``fmt``."""
    calls = TWO if fmt.many else TWO[:1]
    out = [(fmt.render(ONE), "", ONE), (fmt.render(calls), "", calls),
           ("Plain answer, no tools.", "Plain answer, no tools.", [])]
    if fmt is not LLAMA:
        out.append(("Let me check.\n" + fmt.render(ONE), "Let me check.", ONE))
    else:
        out.append(("<|python_tag|>" + fmt.render(ONE), "", ONE))
        out.append(('{"not": "a call"}', '{"not": "a call"}', []))
    return out


@pytest.mark.parametrize("fmt", [HERMES, LLAMA, MISTRAL, GRANITE], ids=lambda f: f.name)
def test_split_final_and_every_prefix(fmt: ToolFormat) -> None:
    for text, content, calls in texts(fmt):
        final = split_tools(text, True, fmt)
        assert final.content == content, text
        assert [(c.name, c.arguments) for c in final.calls] == calls, text
        for c in final.calls:
            json.loads(c.arguments)
        # one character at a time: every prefix settles, the deltas reassemble exactly
        stream = ToolStream(fmt)
        pieces = [stream.feed(ch) for ch in text] + [stream.finish()]
        got_content, got_calls = reassemble(pieces)
        assert got_content == content and [tuple(c) for c in got_calls] == calls, text
        rng = random.Random(3)
        for _ in range(20):
            stream, pieces, i = ToolStream(fmt), [], 0
            while i < len(text):
                n = rng.randint(1, 7)
                pieces.append(stream.feed(text[i:i + n]))
                i += n
            pieces.append(stream.finish())
            assert reassemble(pieces) == (content, [list(c) for c in calls])


@pytest.mark.parametrize("fmt", [LLAMA, MISTRAL, GRANITE], ids=lambda f: f.name)
def test_cut_call_keeps_name_and_settled_arguments(fmt: ToolFormat) -> None:
    text = fmt.render(ONE)[:-4]  # cut by max_tokens inside the arguments
    got = split_tools(text, True, fmt)
    assert [c.name for c in got.calls] == ["add"]
    assert '{"a": 1, "b": 2}'.startswith(got.calls[0].arguments)


@pytest.mark.parametrize("fmt", [LLAMA, MISTRAL, GRANITE], ids=lambda f: f.name)
def test_default_prompt_writes_history_in_the_format(fmt: ToolFormat) -> None:
    choice = parse_tool_choice({"tools": TOOLS, "tool_choice": "required"})
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    out, extra = tool_messages(history, choice, False, fmt)
    assert extra == {}
    assert out[2]["content"] == fmt.render(ONE)
    assert fmt.render([("<function name>", "{<arguments as JSON>}")]) in out[0]["content"]
