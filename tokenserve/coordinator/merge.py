"""The answers of one request's single-sequence parts merged into the answer a mixed
server gives the whole request (:mod:`tokenserve.coordinator.fanout`). Pure: bytes in,
bytes out, no I/O.

Part ``k`` answers as a one-choice request (its choice has index 0); in the merged answer
it is choice ``index_of[k]`` (``prompt_index * n + i``, as the mixed server numbers them).

=========  ===========================================  ====================================
family     whole answer                                 stream
=========  ===========================================  ====================================
openai     part 0's object; ``choices`` of every part   each part's chunks, its choices
           in index order; ``usage`` merged              re-indexed, with one ``id`` and
                                                        ``created``; ``usage`` on the last
                                                        finishing chunk only (or one
                                                        ``include_usage`` chunk), merged;
                                                        one ``data: [DONE]`` at the end
vllm       ``{"text": [every part's, in index order]}``  each part's ``{"text": [t]}`` as
           (``prompt_logprobs``: part 0's)               ``{"text": ["", .., t, .., ""]}``
=========  ===========================================  ====================================

Which of the two a family's answers take is its description's ``several``
(:class:`tokenserve.api.families.Several`), their event bytes its framing.

``usage`` (OpenAI): prompt tokens count once per prompt (its first part's, with its
``prompt_tokens_details``), completion tokens are summed over every part, total is their sum.
A part's in-stream error event ends the merged stream (:meth:`StreamMerge.feed` says so).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from tokenserve.api.families import FamilyDescription, Several, describe


def merged_usage(usages: Sequence[dict[str, Any] | None],
                 prompt_of: Sequence[int]) -> dict[str, Any] | None:
    """The ``usage`` of the whole request from its parts' (``prompt_of[k]``: part ``k``'s
    prompt index): prompt tokens (and ``prompt_tokens_details``) once per prompt, from
    its first part; completion tokens summed; None when no part reported usage."""
    first = next((u for u in usages if isinstance(u, dict)), None)
    if first is None:
        return None
    out = copy.deepcopy(first)
    prompt, cached, completion = 0, 0, 0
    seen: set[int] = set()
    has_cached = False
    for k, u in enumerate(usages):
        if not isinstance(u, dict):
            continue
        completion += _int(u.get("completion_tokens"))
        if prompt_of[k] in seen:
            continue
        seen.add(prompt_of[k])
        prompt += _int(u.get("prompt_tokens"))
        details = u.get("prompt_tokens_details")
        if isinstance(details, dict) and "cached_tokens" in details:
            has_cached = True
            cached += _int(details.get("cached_tokens"))
    out["prompt_tokens"] = prompt
    out["completion_tokens"] = completion
    out["total_tokens"] = prompt + completion
    if has_cached and isinstance(out.get("prompt_tokens_details"), dict):
        out["prompt_tokens_details"]["cached_tokens"] = cached
    return out


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def merge_whole(family: str, bodies: Sequence[bytes], index_of: Sequence[int],
                prompt_of: Sequence[int]) -> bytes:
    """The whole (non-stream) answer from every part's 200 answer, in part order.

    Raises:
        ValueError: a part's answer is not the family's JSON object.
    """
    objs = []
    for body in bodies:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise ValueError("a part's answer is not JSON") from None
        if not isinstance(obj, dict):
            raise ValueError("a part's answer is not a JSON object")  # noqa: TRY004 - a P_ERROR
        objs.append(obj)
    head = objs[0]
    if describe(family).several is Several.TEXTS:
        texts: list[Any] = []
        for obj in objs:
            if not isinstance(obj.get("text"), list):
                raise ValueError("a vLLM part's answer has no text list")  # noqa: TRY004 - a P_ERROR
            texts.extend(obj["text"])
        head["text"] = texts
        return orjson.dumps(head)
    choices: list[Any] = []
    for k, obj in enumerate(objs):
        part_choices = obj.get("choices")
        if not isinstance(part_choices, list):
            raise ValueError("an OpenAI part's answer has no choices")  # noqa: TRY004 - a P_ERROR
        for c in part_choices:
            if isinstance(c, dict):
                c["index"] = index_of[k]
            choices.append(c)
    head["choices"] = choices
    if "usage" in head:
        head["usage"] = merged_usage([o.get("usage") for o in objs], prompt_of)
    return orjson.dumps(head)


@dataclass
class StreamMerge:
    """The merged stream of ``len(index_of)`` parts: :meth:`feed` each part's bytes as
    they come (any split), :meth:`tail` once every part has ended.

    Attributes:
        family: ``openai`` or ``vllm``.
        index_of: part ``k``'s choice index in the merged answer.
        prompt_of: part ``k``'s prompt index (usage counts each prompt once).
        count: choices in the merged answer (vLLM: the length of each ``text`` list).
    """

    family: str
    index_of: Sequence[int]
    prompt_of: Sequence[int]
    count: int
    _buffers: list[bytes] = field(default_factory=list)
    _finished: list[bool] = field(default_factory=list)
    _usage: list[dict[str, Any] | None] = field(default_factory=list)
    _id: Any = None
    _created: Any = None
    _usage_head: dict[str, Any] | None = None  # the include_usage chunk, less its usage
    _desc: FamilyDescription = field(init=False)

    def __post_init__(self) -> None:
        self._desc = describe(self.family)
        n = len(self.index_of)
        self._buffers = [b""] * n
        self._finished = [False] * n
        self._usage = [None] * n

    def feed(self, k: int, data: bytes) -> tuple[bytes, bool]:
        """Part ``k``'s next bytes -> (the merged stream's bytes for them, whether a part
        failed: its error event is in those bytes, and the merged stream ends there)."""
        buf = self._buffers[k] + data
        *events, self._buffers[k] = buf.split(self._desc.framing.separator)
        out: list[bytes] = []
        for ev in events:
            if not ev.strip():
                continue
            piece, failed = self._event(k, ev)
            out.append(piece)
            if failed:
                return b"".join(out), True
        return b"".join(out), False

    def end(self, k: int) -> bytes:
        """Part ``k``'s stream ended: what is left of it (an unterminated event, as is)."""
        rest, self._buffers[k] = self._buffers[k], b""
        return rest

    def tail(self) -> bytes:
        """The end of the merged stream once every part has ended (OpenAI: the one
        ``include_usage`` chunk when asked, then ``data: [DONE]``)."""
        out = b""
        if self._usage_head is not None:
            chunk = dict(self._usage_head)
            chunk["usage"] = merged_usage(self._usage, self.prompt_of)
            out += self._desc.framing.event(chunk)
        return out + self._desc.stream_end

    # ------------------------------------------------------------------ one event

    def _event(self, k: int, ev: bytes) -> tuple[bytes, bool]:
        if self._desc.several is Several.TEXTS:
            return self._texts(k, ev)
        return self._choices(k, ev)

    def _texts(self, k: int, ev: bytes) -> tuple[bytes, bool]:
        sep = self._desc.framing.separator
        try:
            obj = orjson.loads(ev)
        except orjson.JSONDecodeError:
            return ev + sep, False
        if not isinstance(obj, dict) or "error" in obj:
            return ev + sep, True
        texts = obj.get("text")
        if isinstance(texts, list):
            merged = [""] * self.count
            merged[self.index_of[k]] = "".join(t for t in texts if isinstance(t, str))
            obj["text"] = merged
        return self._desc.framing.event(obj), False

    def _choices(self, k: int, ev: bytes) -> tuple[bytes, bool]:
        sep = self._desc.framing.separator
        if not ev.startswith(b"data:"):
            return ev + sep, False
        payload = ev[5:].lstrip(b" ")
        if payload.strip() == b"[DONE]":
            return b"", False  # one [DONE], at the end (tail)
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return ev + sep, False
        if not isinstance(obj, dict) or "error" in obj:
            return ev + sep, True
        if self._id is None:
            self._id, self._created = obj.get("id"), obj.get("created")
        if "id" in obj:
            obj["id"] = self._id
        if "created" in obj:
            obj["created"] = self._created
        choices = obj.get("choices")
        usage = obj.get("usage")
        if usage is not None:
            self._usage[k] = usage
        if choices == []:  # the include_usage chunk: one, merged, at the end
            head = {key: v for key, v in obj.items() if key != "usage"}
            self._usage_head = self._usage_head or head
            return b"", False
        if isinstance(choices, list):
            for c in choices:
                if isinstance(c, dict):
                    c["index"] = self.index_of[k]
                    if c.get("finish_reason") is not None:
                        self._finished[k] = True
        if "usage" in obj:  # rides on the last finishing chunk of the whole request
            if all(self._finished):
                obj["usage"] = merged_usage(self._usage, self.prompt_of)
            else:
                del obj["usage"]
        return self._desc.framing.event(obj), False
