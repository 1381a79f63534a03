"""OpenAI tool calling, the answer side: the model's text -> ``content`` and
``tool_calls``, whole or as stream deltas (OpenAI API reference, Chat Completions object
and chunk object: ``message.tool_calls``, ``delta.tool_calls``; spec/interfaces.md §5.1).

The text holds ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks
(format: :mod:`tokenserve.api.openai.tools`). One pure function, :func:`split_tools`,
reads a text that may still grow and says what is settled: the content outside the blocks
and, per call, its name and the settled prefix of its ``arguments``. Streaming sends the
growth of that answer (:class:`ToolStream`); the non-stream answer is the same function on
the final text, so the streamed deltas reassemble exactly to the non-stream ``tool_calls``.

Rules (the same whether the text is final or not):

- a block is a call once its text starts ``{"name": "<name>", "arguments": `` (whitespace
  free); its ``arguments`` is then the JSON value's own text as generated when the block
  is one valid JSON object, else the block's text after that prefix less a trailing
  ``}`` (a call cut by ``max_tokens``, or a model writing outside the grammar);
- a block that never starts so stays content, as text, once closed; unclosed at the end
  (a cut by ``max_tokens`` before the name) it is dropped: content never ends in a
  half-written call;
- whitespace between content and a block is neither (no stray ``"\\n"`` content); text
  on both sides of a block is joined by one newline;
- while the text may grow, a tail that could begin ``<tool_call>`` / ``</tool_call>``, or
  that could be the end of the arguments (``}`` and whitespace), is held back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenserve.api.openai.tool_formats import CALL_CLOSE, CALL_OPEN, HERMES, ToolFormat

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    """One call: its name and (the settled prefix of) its ``arguments`` text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Split:
    """What a text says: ``content`` outside the calls, and the calls in order."""

    content: str
    calls: tuple[ParsedCall, ...]


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _name(head: re.Match[str]) -> str | None:
    try:
        return json.loads(f'"{head.group(1)}"')
    except ValueError:
        return None


def _final_call(body: str) -> ParsedCall | None:
    """A whole block's body (between the tags) -> a call, or None when it does not start
    as one."""
    head = _HEAD.match(body)
    name = _name(head) if head is not None else None
    if head is None or name is None:
        return None
    rest = body[head.end():]
    try:
        _, end = _DECODER.raw_decode(rest)
    except ValueError:
        end = -1
    if end >= 0 and re.fullmatch(r"\s*\}\s*", rest[end:]):
        return ParsedCall(name, rest[:end])
    return ParsedCall(name, re.sub(r"\s*\}?\s*$", "", rest))


def _settled_args(rest: str) -> str:
    """While a block may grow: its arguments text less a tail that may close the value
    or the object (``}`` and whitespace)."""
    return re.sub(r"[\s}]*$", "", rest)


def _joined(content: list[str], segment: str, after_block: bool) -> str:
    """Text after a block joins earlier content with one newline (both non-empty)."""
    return "\n" + segment if after_block and segment and any(content) else segment


def split_marked(text: str, final: bool, fmt: ToolFormat) -> Split:
    """Settle ``text`` in a marker format (Llama, Mistral, Granite:
    :mod:`tool_formats`): content is the text before the first marker (less trailing
    whitespace); after it, call objects ``{"name": ..., "<args_key>": ...}``, bare or in a
    list, separated by ``,`` (or Llama's ``;``). A call's arguments are the value's text
    once the object is whole, else its settled prefix (as Hermes' blocks). When final
    and nothing after the marker starts a call, the whole text is content.
    """
    starts = [(i, m) for m in fmt.markers if (i := text.find(m)) >= 0
              and (m != "{" or not text[:i].strip())]
    if not starts:
        if final:
            return Split(text, ())
        held = max((_held_prefix(text.lstrip(), m) if m == "{" else _held_prefix(text, m))
                   for m in fmt.markers)
        if "{" in fmt.markers and not text.strip():
            return Split("", ())
        return Split(text[:len(text) - held].rstrip(), ())
    at, marker = min(starts)
    content = text[:at].rstrip()
    pos = at + (0 if marker == "{" else len(marker))
    head_re = re.compile(_HEAD.pattern.replace("arguments", fmt.args_key))
    rest = text[pos:].lstrip()
    rest = rest.removeprefix("[")
    calls: list[ParsedCall] = []
    while True:
        head = head_re.match(rest)
        name = _name(head) if head is not None else None
        if head is None or name is None:
            break
        args = rest[head.end():]
        try:
            _, end = _DECODER.raw_decode(args)
        except ValueError:
            end = -1
        close = re.match(r"\s*\}", args[end:]) if end >= 0 else None
        if close is None:  # the object is not whole
            if not final:
                calls.append(ParsedCall(name, _settled_args(args)))
            else:
                calls.append(ParsedCall(name, re.sub(r"[\s}\]]*$", "", args)))
            return Split(content, tuple(calls))
        calls.append(ParsedCall(name, args[:end]))
        rest = args[end + close.end():]
        sep = re.match(r"\s*[,;]\s*", rest)
        if sep is None:
            break
        rest = rest[sep.end():]
    if not calls and final:
        return Split(text, ())
    return Split(content, tuple(calls))


def split_tools(text: str, final: bool, fmt: ToolFormat = HERMES) -> Split:
    """Settle ``text`` (module docstring) in the format ``fmt``. ``final``: the text will
    not grow."""
    if fmt is not HERMES:
        return split_marked(text, final, fmt)
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    after_block = False
    while True:
        start = text.find(CALL_OPEN, pos)
        if start < 0:
            tail = text[pos:]
            if after_block:
                tail = tail.lstrip()
            if not final:
                tail = tail[:len(tail) - _held_prefix(tail, CALL_OPEN)]
                tail = tail.rstrip()  # may be the space before a block
            content.append(_joined(content, tail, after_block))
            break
        segment = text[pos:start]
        content.append(_joined(content, segment.strip() if after_block else segment.rstrip(),
                               after_block))
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        closed = end >= 0
        body = text[body_start:end] if closed else text[body_start:]
        if not closed and not final:
            body = body[:len(body) - _held_prefix(body, CALL_CLOSE)]
            head = _HEAD.match(body)
            name = _name(head) if head is not None else None
            if head is not None and name is not None:
                calls.append(ParsedCall(name, _settled_args(body[head.end():])))
            return Split("".join(content), tuple(calls))
        call = _final_call(body)
        if call is not None:
            calls.append(call)
        elif closed:
            content.append(text[start:end + len(CALL_CLOSE)])
        if not closed:
            break
        pos = end + len(CALL_CLOSE)
        after_block = True
    return Split("".join(content), tuple(calls))


def new_call_id() -> str:
    """A tool call id, OpenAI's ``call_`` prefix and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def message_tool_calls(split: Split) -> list[dict[str, Any]]:
    """``message.tool_calls``: ``[{id, type: function, function: {name, arguments}}]``."""
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in split.calls]


@dataclass
class ToolStream:
    """One choice's stream: text in, the deltas of :func:`split_tools` out.

    ``feed`` takes each step's new text; ``finish`` the end. Each returns ``(content,
    tool_calls)``: the new content text and the ``delta.tool_calls`` items (a call's first
    item carries ``index``, ``id``, ``type``, ``function.name`` and its arguments so far;
    later items ``index`` and an ``arguments`` fragment), as OpenAI streams them.
    """

    fmt: ToolFormat = HERMES
    text: str = ""
    sent_content: str = ""
    sent_args: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    @property
    def called(self) -> bool:
        """True once a call has been sent (the finish reason is then ``tool_calls``)."""
        return bool(self.ids)

    def feed(self, new_text: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += new_text
        return self._delta(split_tools(self.text, False, self.fmt))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._delta(split_tools(self.text, True, self.fmt))

    def _delta(self, split: Split) -> tuple[str, list[dict[str, Any]]]:
        # split_tools only ever settles more of a growing text (module docstring)
        assert split.content.startswith(self.sent_content), (split, self.sent_content)
        content = split.content[len(self.sent_content):]
        self.sent_content = split.content
        items: list[dict[str, Any]] = []
        for i, call in enumerate(split.calls):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(call.arguments)
                items.append({"index": i, "id": self.ids[i], "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
                continue
            sent = self.sent_args[i]
            assert call.arguments.startswith(sent), (call, sent)
            if len(call.arguments) > len(sent):
                items.append({"index": i, "function": {"arguments": call.arguments[len(sent):]}})
                self.sent_args[i] = call.arguments
        return content, items
