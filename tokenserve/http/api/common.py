"""What every API family shares: the engine as it sees it, JSON body parsing, tokenisation,
the prompt-length check and the finish-reason mapping (spec/interfaces.md §0.4, §1, §2.1).

Two neighbours hold the rest: :mod:`tokenserve.http.api.fields`, the typed field getters
and the field parsers several families share (spec §2.1 type rules), and
:mod:`tokenserve.http.api.engine_stream`, :class:`EngineStream`, consuming the engine
with disconnect -> abort (spec §0.4 step 10; re-exported here, its former home).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import numpy as np
import orjson

from tokenserve.http.api.engine_stream import EngineStream
from tokenserve.http.api.fields import MAX_TOKENS_NUM, show
from tokenserve.messages import FinishReason, GenerateRequest, RequestOutput

__all__ = [  # EngineStream: re-exported, this was its home
    "DEFAULT_MAX_JSON_DEPTH", "MINDIE_FINISH_REASONS", "PARSE_ERROR", "TOKENIZE_OFFLOAD_CHARS",
    "EngineClient", "EngineStream", "check_json_content_type", "check_prompt_fits",
    "encode_text", "json_depth_exceeds", "mindie_finish_reason", "parse_json",
    "parse_json_object",
]

logger = logging.getLogger(__name__)

#: spec §0.4 step 3: the message for a body that is not JSON.
PARSE_ERROR = "Failed to parse request context to json"
#: config.md ``maxJsonDepth`` default.
DEFAULT_MAX_JSON_DEPTH = 10
#: texts longer than this (characters) are tokenised in a worker thread.
TOKENIZE_OFFLOAD_CHARS = 16_384

_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b'"[]{}')
_CURLY_TO_SQUARE = bytes.maketrans(b"{}", b"[]")


class EngineClient(Protocol):
    """The engine as the HTTP layer sees it (implemented by ``engine.AsyncEngine``)."""

    model_name: str
    vocab_size: int
    tokenizer: Any
    max_model_len: int

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...


# --------------------------------------------------------------------------- JSON bodies


def check_json_content_type(headers: Mapping[str, str]) -> None:
    """Accept ``application/json`` (any parameters) or [I] no Content-Type at all.

    Raises:
        ValueError: any other media type (422, like an unparseable body, spec §0.4).
    """
    ctype = headers.get("content-type", "").strip()
    if not ctype:
        return
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ValueError(
            f"{PARSE_ERROR}: Content-Type must be application/json, got {show(ctype)}."
        )


def json_depth_exceeds(body: bytes, max_depth: int) -> bool:
    """True when ``body`` nests arrays/objects deeper than ``max_depth``, or its brackets
    outside strings do not balance (the parser would reject it anyway).

    Runs before the parser because a deeply nested body can crash a C JSON parser. Every
    step is a C-level pass, so a hostile 40 MiB body costs well under a second::

        escapes removed (\\\\ then \\")  ->  keep only  " [ ] { }  ->  drop quoted parts
        ->  { } become [ ]  ->  balanced?  ->  innermost "[]" removed once per level
    """
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False
    s = body
    if b"\\" in s:
        s = s.replace(b"\\\\", b"").replace(b'\\"', b"")
    s = s.translate(None, _NOT_STRUCTURAL)
    if b'"' in s:
        chars = np.frombuffer(s, dtype=np.uint8)
        quote = chars == ord('"')
        inside = np.bitwise_xor.accumulate(quote)  # True from an opening quote on
        s = chars[~(inside | quote)].tobytes()
    s = s.translate(_CURLY_TO_SQUARE)
    if s.count(b"[") != s.count(b"]") or b"[" * (max_depth + 1) in s:
        return True
    for _ in range(max_depth):
        if not s:
            return False
        s = s.replace(b"[]", b"")  # one nesting level per pass
    return bool(s)


def parse_json(body: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> Any:
    """Parse a request body with orjson under a nesting-depth limit (spec §0.2, §0.4 step 3).

    Raises:
        ValueError: not valid UTF-8 JSON, or nested deeper than ``max_depth``.
    """
    if json_depth_exceeds(body, max_depth):
        raise ValueError(f"{PARSE_ERROR}: nesting depth exceeds {max_depth}.")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ValueError(PARSE_ERROR) from None


def parse_json_object(body: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> dict[str, Any]:
    """:func:`parse_json`, and the document must be an object."""
    obj = parse_json(body, max_depth)
    if not isinstance(obj, dict):
        raise ValueError(PARSE_ERROR)  # noqa: TRY004 - not an object: a parse error (422)
    return obj


# --------------------------------------------------------------------------- tokenisation


async def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Tokenise ``text`` (long texts in a worker thread so the event loop stays free).

    Raises:
        ValueError: the tokenizer failed or produced no tokens / too many (spec §1.5).
    """
    try:
        if len(text) > TOKENIZE_OFFLOAD_CHARS:
            ids = await asyncio.get_running_loop().run_in_executor(None, tokenizer.encode, text)
        else:
            ids = tokenizer.encode(text)
        ids = list(ids)
    except Exception as exc:  # noqa: BLE001 - a tokenizer failure is an input problem (422)
        raise ValueError(f"Failed to tokenize inputs: {show(exc)}") from None
    if not 0 < len(ids) <= MAX_TOKENS_NUM:
        raise ValueError(
            f"Tokenised inputs must have between 1 and {MAX_TOKENS_NUM} tokens, got {len(ids)}."
        )
    return ids


def check_prompt_fits(num_prompt_tokens: int, engine: EngineClient) -> None:
    """spec §1.5 / §0.4 step 8: the prompt must fit ``min(maxInputTokenLen, maxSeqLen - 1)``
    (``engine.max_input_len`` where the engine has it), leaving room for one token.

    Raises:
        ValueError: with the ``Failed to enqueue inferRequest.`` prefix (the family
            answers 424).
    """
    limit = getattr(engine, "max_input_len", engine.max_model_len - 1)
    if num_prompt_tokens > limit:
        raise ValueError(
            f"Failed to enqueue inferRequest. Input length {num_prompt_tokens} exceeds the "
            f"maximum allowed {limit} tokens."
        )


# --------------------------------------------------------------------------- outputs


#: spec §1.4: engine finish reason -> native/TGI/Triton ``finish_reason`` string.
MINDIE_FINISH_REASONS: dict[FinishReason, str] = {
    FinishReason.EOS: "eos_token",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "stop_sequence",
    FinishReason.TIMEOUT: "stop_sequence",
    FinishReason.ERROR: "stop_sequence",
}


def mindie_finish_reason(reason: FinishReason | None) -> str:
    """spec §1.4 mapping; anything unknown -> ``invalid finishReason``."""
    if reason is None:
        return "invalid finishReason"
    return MINDIE_FINISH_REASONS.get(reason, "invalid finishReason")
