"""Tool-call markers that are special tokens (issue 39), through the server's own parts.

Real tokenizers hold the markers as added tokens with ``special: true`` (Qwen2.5
``<tool_call>`` / ``</tool_call>``, Mistral ``[TOOL_CALLS]``, Granite ``<|tool_call|>``,
Llama 3.1 ``<|python_tag|>``). Here SmolLM2's tokenizer gets those five as special added
tokens (one id each) and is loaded by the server's ``Tokenizer``; the generated ids run
through the engine's ``IncrementalDetokenizer`` (one id per step, as the engine feeds it)
into ``split_tools`` / ``ToolStream``. With ``skip_special_tokens`` alone (tools absent,
and the behaviour before the fix) the marker is gone and no call is found; with the
format's marker ids kept, the call is parsed and no marker is left in ``content``, while
EOS and the chat markers stay skipped. The grammar writes a special marker as its token
(a string literal cannot match it: llguidance masks it down to that token, then rejects
it).

The HTTP path (grammar-forced answers of a tiny random model): tests/integration/
test_tool_special_tokens_http.py.
"""

from __future__ import annotations

import shutil

import llguidance
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from tests.unit.test_api_openai_tools import TOOLS, reassemble
from tokenserve.api.openai.tool_formats import (
    FORMATS,
    GRANITE,
    HERMES,
    LLAMA,
    MISTRAL,
    ToolFormat,
    special_marker_ids,
)
from tokenserve.api.openai.toolparse import ToolStream, split_tools
from tokenserve.api.openai.tools import parse_tool_choice, tool_constraint
from tokenserve.engine.detokenizer import IncrementalDetokenizer
from tokenserve.grammar.compiler import make_tokenizer
from tokenserve.models.loader import resolve_model
from tokenserve.models.tokenizer import Tokenizer

MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|tool_call|>", "<|python_tag|>"]
ONE = [("add", '{"a": 1, "b": 2}')]
IM_END, IM_START = 2, 1  # SmolLM2's <|im_end|> (EOS) and <|im_start|>: special, skipped


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """SmolLM2's tokenizer with :data:`MARKERS` as special added tokens."""
    src = resolve_model(None)
    d = tmp_path_factory.mktemp("special_markers")
    tk = HFTokenizer.from_file(str(src / "tokenizer.json"))
    tk.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    (d / "tokenizer.json").write_text(tk.to_str())
    shutil.copy(src / "tokenizer_config.json", d / "tokenizer_config.json")
    return Tokenizer(d)


@pytest.fixture(scope="module")
def prompt(tok: Tokenizer) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": "Add 1 and 2."}])
    return tok.encode(text, add_special_tokens=False)


def answer_ids(tok: Tokenizer, fmt: ToolFormat) -> list[int]:
    """The ids a model writes for one call in ``fmt`` (markers as their special ids),
    then EOS."""
    text = fmt.render(ONE)
    if fmt is LLAMA:
        text = "<|python_tag|>" + text
    return [*tok.encode(text, add_special_tokens=False), IM_END]


def detokenize(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True,
               keep: tuple[int, ...] = ()) -> list[str]:
    """The engine's deltas: one ``add`` per generated id, then the final flush."""
    detok = IncrementalDetokenizer(tok, prompt, skip, keep)
    return [*(detok.add([i]) for i in ids), detok.flush(drop_incomplete=True)]


def stream(fmt: ToolFormat, deltas: list[str]) -> tuple[str, list[list[str]]]:
    ts = ToolStream(fmt)
    return reassemble([*(ts.feed(d) for d in deltas), ts.finish()])


def test_markers_are_one_special_token_each(tok: Tokenizer) -> None:
    for m in MARKERS:
        ids = tok.encode(m, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] in tok.all_special_ids, m
    assert special_marker_ids(HERMES, tok) == {"<tool_call>": 49152, "</tool_call>": 49153}
    assert special_marker_ids(MISTRAL, tok) == {"[TOOL_CALLS]": 49154}
    assert special_marker_ids(GRANITE, tok) == {"<|tool_call|>": 49155}
    assert special_marker_ids(LLAMA, tok) == {"<|python_tag|>": 49156}
    # SmolLM2 itself holds none of them; a tokenizer that lists no special tokens neither
    plain = Tokenizer(resolve_model(None))
    assert all(special_marker_ids(f, plain) == {} for f in FORMATS.values())
    assert special_marker_ids(HERMES, object()) == {}


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, GRANITE, LLAMA], ids=lambda f: f.name)
def test_skipped_marker_loses_the_call(fmt: ToolFormat, tok: Tokenizer, prompt) -> None:
    """The default (tools absent; every request before the fix): special tokens are
    skipped, so the marker never reaches the reader and the call is lost or left as
    content."""
    deltas = detokenize(tok, prompt, answer_ids(tok, fmt))
    text = "".join(deltas)
    assert text == tok.decode(answer_ids(tok, fmt))  # the engine's text is decode(skip)
    assert not any(m in text for m in MARKERS)
    assert fmt is LLAMA or not split_tools(text, True, fmt).calls  # Llama: bare JSON is a call


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, GRANITE, LLAMA], ids=lambda f: f.name)
def test_kept_markers_give_the_call(fmt: ToolFormat, tok: Tokenizer, prompt) -> None:
    keep = tuple(special_marker_ids(fmt, tok).values())
    ids = answer_ids(tok, fmt)
    deltas = detokenize(tok, prompt, [IM_START, *ids], keep=keep)  # a stray special too
    text = "".join(deltas)
    want = ("<|python_tag|>" if fmt is LLAMA else "") + fmt.render(ONE)
    assert text == want  # markers kept; <|im_start|> and EOS still skipped
    split = split_tools(text, True, fmt)
    assert split.content == ""  # the marker does not leak into content
    assert [(c.name, c.arguments) for c in split.calls] == ONE
    assert stream(fmt, deltas) == ("", [list(c) for c in ONE])


def test_keep_is_exactly_the_listed_ids(tok: Tokenizer, prompt) -> None:
    ids = [IM_START, 49152, *tok.encode("hi", add_special_tokens=False), 49154, IM_END]
    assert "".join(detokenize(tok, prompt, ids)) == "hi"
    assert "".join(detokenize(tok, prompt, ids, keep=(49152,))) == "<tool_call>hi"
    everything = tok.decode(ids, skip_special_tokens=False)
    assert "".join(detokenize(tok, prompt, ids, skip=False, keep=(49152,))) == everything


def _grammar(fmt: ToolFormat, mode: str, special: dict[str, int] | None) -> str:
    choice = parse_tool_choice({"tools": TOOLS, "tool_choice": mode,
                                "parallel_tool_calls": False})
    assert choice is not None
    c = tool_constraint(choice, fmt, special)
    assert c is not None
    return c.value


def _accepts(lt: llguidance.LLTokenizer, grammar: str, ids: list[int]) -> bool:
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(ids) and m.is_accepting()


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, GRANITE, LLAMA], ids=lambda f: f.name)
def test_grammar_writes_the_special_token(fmt: ToolFormat, tok: Tokenizer) -> None:
    """The engine's llguidance tokenizer (``make_tokenizer``) on the tokenizer with
    special markers: the grammar built with them accepts the call as the model writes it
    (marker = one special id), in ``required`` and ``auto`` mode; the text-only grammar
    (what was built before) does not."""
    lt = make_tokenizer(tok.to_json_str(), tok.vocab_size, (IM_END,))
    special = special_marker_ids(fmt, tok)
    ids = answer_ids(tok, fmt)[:-1]
    for mode in ("required", "auto"):
        g = _grammar(fmt, mode, special)
        assert all(f"<[{i}]>" in g for i in special.values())
        assert _accepts(lt, g, ids), (mode, g)
        assert not _accepts(lt, _grammar(fmt, mode, None), ids)
    auto = _grammar(fmt, "auto", special)
    assert _accepts(lt, auto, tok.encode("Plain text.", add_special_tokens=False))
    if fmt is LLAMA:  # <|python_tag|> may lead; the bare object is still a call
        bare = tok.encode(fmt.render(ONE), add_special_tokens=False)
        assert _accepts(lt, _grammar(fmt, "required", special), bare)


def test_grammar_text_unchanged_without_special_markers() -> None:
    """No special markers: the grammar is the text-literal one, as before."""
    for fmt in FORMATS.values():
        for mode in ("required", "auto"):
            assert _grammar(fmt, mode, {}) == _grammar(fmt, mode, None)
    g = _grammar(HERMES, "required", None)
    assert 'call: "<tool_call>\\n" body "\\n</tool_call>"' in g
