"""What every API family shares: the engine as it sees it, :class:`FamilyApi` (the base of
the handler classes), JSON body parsing, tokenisation, the prompt-length check, the
finish-reason mapping and how a request's end is answered: :func:`collect` /
:func:`check_final` for a non-stream answer, :func:`run_stream` / :func:`guard_stream` for a
stream (spec/interfaces.md §0.4, §1, §2.1).

Neighbours hold the rest: :mod:`tokenserve.api.fields`, the typed field getters
and the field parsers several families share (spec §2.1 type rules);
:mod:`tokenserve.api.engine_client`, the engine as the HTTP side sees it; and
:mod:`tokenserve.api.engine_stream`, :class:`EngineStream`, consuming the engine
with disconnect -> abort (spec §0.4 step 10). Neither imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import orjson

from tokenserve.api.context import ServeContext
from tokenserve.api.engine_client import EngineClient, EngineInfo
from tokenserve.api.engine_stream import NO_FINAL_OUTPUT, EngineStream
from tokenserve.api.errors import fail_stream
from tokenserve.api.fields import MAX_TOKENS_NUM, show
from tokenserve.api.framing import EVENT_STREAM
from tokenserve.config.tree import ServerConfig
from tokenserve.messages import FinishReason, GenerateRequest, RequestOutput
from tokenserve.transport.cycle import HandlerExit, HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError

__all__ = [
    "DEFAULT_MAX_JSON_DEPTH", "FAILED_FINISH", "MINDIE_FINISH_REASONS", "PARSE_ERROR",
    "SERVER_NAME", "TOKENIZE_OFFLOAD_CHARS", "Collected", "EngineClient", "EngineStream",
    "FamilyApi", "check_final", "check_json_content_type", "check_prompt_fits", "collect",
    "encode_text", "failure_text", "guard_stream", "json_depth_exceeds",
    "mindie_finish_reason", "parse_json", "parse_json_object", "reported_seed",
    "run_stream", "step_times", "tokenizer_call",
]

logger = logging.getLogger(__name__)

#: spec §0.4 step 3: the message for a body that is not JSON.
PARSE_ERROR = "Failed to parse request context to json"
#: config.md ``maxJsonDepth`` default.
DEFAULT_MAX_JSON_DEPTH = ServerConfig.max_json_depth
#: texts longer than this (characters) are tokenised in a worker thread.
TOKENIZE_OFFLOAD_CHARS = 16_384
#: the server's name where a family reports one (Triton ``name``/``platform`` §6.2,
#: OpenAI ``owned_by`` §5.3/§5.4).
SERVER_NAME = "MindIE Server"

_T = TypeVar("_T")

_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b'"[]{}')
_CURLY_TO_SQUARE = bytes.maketrans(b"{}", b"[]")


class FamilyApi:
    """Base of the families' handler classes: the engine they serve, the server's shared
    state (``context``: stopInfer registry, metrics; None records nothing) and the nesting
    limit their JSON bodies are parsed under (config.md ``maxJsonDepth``)."""

    def __init__(
        self,
        engine: EngineClient,
        *,
        max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
        context: ServeContext | None = None,
    ) -> None:
        self._engine = engine
        self._context = context
        self._max_json_depth = max_json_depth

    @property
    def _info(self) -> EngineInfo:
        """The engine's model facts and limits."""
        return self._engine.info

    def _json(self, request: HttpRequest) -> dict[str, Any]:
        """The body as a JSON object (spec §0.4 step 3); raises ``ValueError``."""
        check_json_content_type(request.headers)
        return parse_json_object(request.body, self._max_json_depth)

    def _body(self, request: HttpRequest, message: str | None = None) -> dict[str, Any]:
        """:meth:`_json`, a failure answered 422 (with ``message`` when given)."""
        try:
            return self._json(request)
        except ValueError as exc:
            raise HttpError(422, message or str(exc)) from None

    def _served_model(self, request: HttpRequest) -> str:
        """The path's ``{model}``; anything but the served model is 404 ``Model <m> not
        found.`` (spec §0.4 step 2)."""
        name = request.path_params.get("model", "")
        if name != self._info.model_name:
            raise HttpError(404, f"Model {name} not found.")
        return name

    def _check_fits(self, num_prompt_tokens: int) -> None:
        """:func:`check_prompt_fits`, a prompt too long answered 424 (spec §0.4 step 8)."""
        try:
            check_prompt_fits(num_prompt_tokens, self._engine)
        except ValueError as exc:
            raise HttpError(424, str(exc)) from None


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


async def tokenizer_call(text: str, work: Callable[[], _T]) -> _T:
    """``work()``, tokenizer work on ``text``: in a worker thread when ``text`` is longer
    than ``TOKENIZE_OFFLOAD_CHARS``, so the event loop stays free."""
    if len(text) > TOKENIZE_OFFLOAD_CHARS:
        return await asyncio.get_running_loop().run_in_executor(None, work)
    return work()


async def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Tokenise ``text`` (long texts in a worker thread so the event loop stays free).

    Raises:
        ValueError: the tokenizer failed or produced no tokens / too many (spec §1.5).
    """
    try:
        ids = list(await tokenizer_call(text, functools.partial(tokenizer.encode, text)))
    except Exception as exc:  # noqa: BLE001 - a tokenizer failure is an input problem (422)
        raise ValueError(f"Failed to tokenize inputs: {show(exc)}") from None
    if not 0 < len(ids) <= MAX_TOKENS_NUM:
        raise ValueError(
            f"Tokenised inputs must have between 1 and {MAX_TOKENS_NUM} tokens, got {len(ids)}."
        )
    return ids


def check_prompt_fits(num_prompt_tokens: int, engine: EngineClient) -> None:
    """spec §1.5 / §0.4 step 8: the prompt must fit ``engine.info.max_input_len``
    (``min(maxInputTokenLen, maxSeqLen - 1)``, leaving room for one token).

    Raises:
        ValueError: with the ``Failed to enqueue inferRequest.`` prefix (the family
            answers 424).
    """
    limit = engine.info.max_input_len
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


def reported_seed(out: RequestOutput, request: GenerateRequest) -> int:
    """The ``seed`` a family reports: the engine's, else the one the request asked for."""
    return out.seed if out.seed is not None else request.params.seed


def step_times(out: RequestOutput, first: bool, elapsed_ms: float) -> dict[str, Any]:
    """spec §2.1, §6.3: ``prefill_time`` (ms) on a stream's first event, ``decode_time``
    (ms since the previous event) on later ones, the other ``null``; the engine's numbers
    win, the handler's clock (``elapsed_ms``) is the fallback."""
    if first:
        ms = out.prefill_time_ms if out.prefill_time_ms is not None else elapsed_ms
        return {"prefill_time": round(ms), "decode_time": None}
    ms = out.decode_time_ms if out.decode_time_ms is not None else elapsed_ms
    return {"prefill_time": None, "decode_time": round(ms)}


# --------------------------------------------------------------------------- request ends


#: spec §0.4 step 9: final outputs that end a request in failure (timeout, engine error).
FAILED_FINISH = (FinishReason.TIMEOUT, FinishReason.ERROR)


def failure_text(out: RequestOutput) -> str:
    """What a failed final output is answered with: its error, else ``Engine request <reason>.``"""
    reason = out.finish_reason.value if out.finish_reason else "error"
    return out.error or f"Engine request {reason}."


def check_final(last: RequestOutput | None) -> RequestOutput:
    """A non-stream answer's final output: 500 when the engine stream ended without one or
    the request failed (timeout, engine error).

    Raises:
        HttpError: 500 ``Engine stream ended without a final output.`` or :func:`failure_text`.
    """
    if last is None or not last.finished:
        raise HttpError(500, NO_FINAL_OUTPUT)
    if last.finish_reason in FAILED_FINISH:
        raise HttpError(500, failure_text(last))
    return last


@dataclass(frozen=True)
class Collected:
    """One engine request run to its end by :func:`collect`."""

    texts: list[str]
    ids: list[int]
    last: RequestOutput  # the final output, not a failed one

    @property
    def text(self) -> str:
        """All the generated text."""
        return "".join(self.texts)


@contextlib.asynccontextmanager
async def collect(
    engine: EngineClient,
    request: GenerateRequest,
    http_request: HttpRequest,
    *,
    context: ServeContext | None = None,
    aliases: tuple[str, ...] = (),
    on_output: Callable[[RequestOutput], None] | None = None,
) -> AsyncIterator[Collected]:
    """For a non-stream answer: run one engine request to its end (an :class:`EngineStream`,
    ``on_output`` seeing each output), gathering its texts and token ids, its final output
    checked by :func:`check_final`. Send the answer inside the block, while the request is
    still registered (``stopInfer``, metrics)."""
    texts: list[str] = []
    ids: list[int] = []
    async with EngineStream(engine, request, http_request.disconnected,
                            context=context, aliases=aliases) as stream:
        async for out in stream:
            texts.append(out.new_text)
            ids.extend(out.new_token_ids)
            if on_output is not None:
                on_output(out)
        yield Collected(texts, ids, check_final(stream.last))


async def guard_stream(
    response: HttpResponse, body: Awaitable[bool], log: logging.Logger, what: str,
    family: str,
) -> bool:
    """Await ``body`` (a stream's writes) and return what it returns (False: it closed the
    stream itself). Any failure but a disconnect once the head is out is answered as
    spec §0.4 step 9 asks: logged on ``log`` (naming ``what``), ``Engine failure: <exc>``
    as ``family``'s error event (:func:`tokenserve.api.errors.fail_stream`), then close
    (False). Before the head, the failure is raised."""
    try:
        return await body
    except HandlerExit:
        raise
    except Exception as exc:
        if not response.started:  # refused at admission: an ordinary error answer
            raise
        log.exception("engine failed while streaming %s", what)
        await fail_stream(response, family, f"Engine failure: {exc}")
        return False


#: Renders one engine output as the bytes to write (None: nothing to write).
Render = Callable[[RequestOutput], bytes | None]


async def run_stream(
    engine: EngineClient,
    request: GenerateRequest,
    http_request: HttpRequest,
    response: HttpResponse,
    on_output: Render,
    on_failure: Render,
    *,
    family: str,
    context: ServeContext | None = None,
    aliases: tuple[str, ...] = (),
    log: logging.Logger = logger,
) -> None:
    """Stream one engine request as ``text/event-stream`` (spec §0.4 steps 9-10).

    Admission first (a full queue is a 503 answer), then the head. Each output is
    written as ``on_output`` renders it; a failed final output (timeout, engine error) as
    ``on_failure`` renders it (the tokens that came with it), then :func:`failure_text`
    as ``family``'s error event (:func:`tokenserve.api.errors.fail_stream`) ends it.
    An engine failure is answered by :func:`guard_stream`; a stream that ends without a
    final output ends with the error ``Engine stream ended without a final output.``
    """

    async def pump(stream: EngineStream) -> bool:
        async for out in stream:
            failed = out.finished and out.finish_reason in FAILED_FINISH
            chunk = on_failure(out) if failed else on_output(out)
            if chunk is not None:
                await response.write(chunk)
            if failed:
                await fail_stream(response, family, failure_text(out))
                return False
        return True

    async with EngineStream(engine, request, http_request.disconnected,
                            context=context, aliases=aliases) as stream:
        await response.start_stream(200, EVENT_STREAM)
        if not await guard_stream(response, pump(stream), log, request.request_id, family):
            return
        if not stream.finished:
            await fail_stream(response, family, NO_FINAL_OUTPUT)
            return
    await response.end()
