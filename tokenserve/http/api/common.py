"""What every API family shares: JSON body parsing, typed field getters, tokenisation,
and consuming the engine with disconnect -> abort (spec/interfaces.md §0.4, §1, §2.1).

Field rules (spec §2.1 "Type rules (all interfaces)"): a JSON ``null`` means absent;
booleans must be JSON booleans; float fields accept any JSON number; integer fields reject
floats (``5.0`` included). Every getter raises ``ValueError`` with a MindIE-style message;
the family turns it into 422.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import numpy as np
import orjson

from tokenserve.http.context import ServeContext, context_of
from tokenserve.http.errors import HttpError
from tokenserve.http.server import ClientDisconnected
from tokenserve.messages import EngineOverloadedError, FinishReason, GenerateRequest, RequestOutput

logger = logging.getLogger(__name__)

#: spec §0.4 step 3: the message for a body that is not JSON.
PARSE_ERROR = "Failed to parse request context to json"
#: config.md ``maxJsonDepth`` default.
DEFAULT_MAX_JSON_DEPTH = 10
#: C ``FLT_MAX``: upper bound of MindIE's float parameters (spec §2.1).
FLT_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1
#: spec §1.5 ``MAX_TOKENS_NUM``: the most prompt tokens any request may carry.
MAX_TOKENS_NUM = 1_048_576
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
            f"{PARSE_ERROR}: Content-Type must be application/json, got {_show(ctype)}."
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
        raise ValueError(PARSE_ERROR)
    return obj


# --------------------------------------------------------------------------- typed getters


def _show(value: Any, limit: int = 64) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _interval(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    return f"{left}{'-inf' if lo is None else lo},{'inf' if hi is None else hi}{right}"


def _check_range(
    name: str, value: float, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool
) -> None:
    ok = True
    if lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        interval = _interval(lo, hi, lo_open, hi_open)
        raise ValueError(f"Parameter {name} must be in {interval}, got {_show(value)}.")


def get_float(
    obj: Mapping[str, Any],
    key: str,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    default: float | None = None,
    *,
    name: str | None = None,
) -> float | None:
    """A number field as float, checked against the interval given by ``lo``/``hi``
    (``*_open`` makes that end exclusive). Absent or ``null`` -> ``default``."""
    value = obj.get(key)
    if value is None:
        return default
    name = name or key
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"Parameter {name} must be a number, got {_show(orjson.dumps(value).decode())}."
        )
    try:
        f = float(value)
    except OverflowError:
        f = math.inf if value > 0 else -math.inf
    if math.isnan(f):
        raise ValueError(f"Parameter {name} must be a number, got {_show(value)}.")
    _check_range(name, f, lo, hi, lo_open, hi_open)
    return f


def get_int(
    obj: Mapping[str, Any],
    key: str,
    lo: int | None = None,
    hi: int | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    default: int | None = None,
    *,
    name: str | None = None,
) -> int | None:
    """An integer field (floats such as ``5.0`` are rejected), checked against the
    interval. Absent or ``null`` -> ``default``."""
    value = obj.get(key)
    if value is None:
        return default
    name = name or key
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"Parameter {name} must be integer, got {_show(orjson.dumps(value).decode())}."
        )
    _check_range(name, value, lo, hi, lo_open, hi_open)
    return value


def get_bool(
    obj: Mapping[str, Any], key: str, default: bool | None = None, *, name: str | None = None
) -> bool | None:
    """A JSON boolean field; absent or ``null`` -> ``default``."""
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(
            f"Parameter {name or key} must be a boolean, got {_show(orjson.dumps(value).decode())}."
        )
    return value


def get_str(
    obj: Mapping[str, Any], key: str, default: str | None = None, *, name: str | None = None
) -> str | None:
    """A JSON string field; absent or ``null`` -> ``default``."""
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ValueError(f"Parameter {name or key} must be a string.")
    return value


def get_object(obj: Mapping[str, Any], key: str, *, name: str | None = None) -> dict[str, Any]:
    """A JSON object field; absent or ``null`` -> ``{}``."""
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"Parameter {name or key} must be an object.")
    return value


def check_token_ids(ids: Any, vocab_size: int, name: str = "input_id") -> list[int]:
    """Validate a prompt given as token ids (spec §2.1): an array of 1..1048576 integers,
    each in [0, vocab_size).

    Raises:
        ValueError: ``Parameter <name> must be an array`` / ``must be integer`` /
            ``Data element in param <name> is invalid``.
    """
    if not isinstance(ids, list):
        raise ValueError(f"Parameter {name} must be an array")
    if not 0 < len(ids) <= MAX_TOKENS_NUM:
        raise ValueError(
            f"Parameter {name} must hold between 1 and {MAX_TOKENS_NUM} ids, got {len(ids)}."
        )
    if not all(type(i) is int for i in ids):
        raise ValueError(f"Parameter {name} must be integer")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(
            f"Data element in param {name} is invalid: ids must be in [0, {vocab_size})."
        )
    return ids


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
    except Exception as exc:  # a tokenizer failure is an input problem (422)
        raise ValueError(f"Failed to tokenize inputs: {_show(exc)}") from None
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


class EngineStream:
    """Consume ``engine.generate(request)`` for one HTTP request (spec §0.4 step 10).

    Use as ``async with EngineStream(engine, req, http_request.disconnected) as s:``
    then ``async for out in s:``; put the response writes inside the block too. When the
    client disconnects, the task running the block is cancelled at its current await
    (engine wait or write) and the block exits with :class:`ClientDisconnected`. On any
    exit before the final output (disconnect, error, ``break``), the engine generator is
    closed and ``engine.abort(request_id)`` is awaited, so KV blocks are freed at once.
    After the final output the generator is closed too (``aclose()`` at its last yield),
    without waiting for it to return by itself.

    Shared server state (``tokenserve.http.context``): ``context`` (default: the one
    ``build_router`` attaches to the engine it hands the families) gets the request
    registered for ``stopInfer`` (spec §2.3) under its ``request_id`` and ``aliases``
    (e.g. the client's Triton ``id``) while the block runs, and its metrics record the
    request (spec §7.7). :meth:`stop` (what ``stopInfer`` calls) aborts the request in
    the engine and ends the iteration with a synthesized final output whose
    ``finish_reason`` is ``ABORT`` (``stopped`` is then True), so the family can still
    answer normally.
    """

    def __init__(
        self,
        engine: EngineClient,
        request: GenerateRequest,
        disconnected: asyncio.Event,
        *,
        context: ServeContext | None = None,
        aliases: tuple[str, ...] = (),
    ) -> None:
        self._engine = engine
        self._request = request
        self._disconnected = disconnected
        self._context = context if context is not None else context_of(engine)
        self._ids = (request.request_id, *aliases)
        self._tracker: Any = None
        self._gen: AsyncIterator[RequestOutput] | None = None
        self._owner: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._active = False
        self._fired = False
        self._exhausted = False
        self._waiting = False  # the owner is awaiting the engine inside __anext__
        self._stop_requested = False
        self._stop_cancels = 0  # our stop() cancellations not yet consumed
        self._num_tokens = 0
        self.finished = False
        self.stopped = False
        self.last: RequestOutput | None = None

    @property
    def request_id(self) -> str:
        """The engine's id of this request."""
        return self._request.request_id

    async def __aenter__(self) -> EngineStream:
        if self._disconnected.is_set():
            raise ClientDisconnected()
        self._owner = asyncio.current_task()
        try:
            self._gen = self._engine.generate(self._request)
        except EngineOverloadedError as exc:  # bounded waiting queue full: refuse at once
            raise HttpError(503, str(exc)) from exc
        self._active = True
        ctx = self._context
        if ctx is not None:
            ctx.registry.add(self, self._ids)
            if ctx.metrics is not None:
                try:
                    self._tracker = ctx.metrics.request_started(self._request)
                except Exception:
                    logger.exception("metrics: request_started failed")
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def _watch(self) -> None:
        await self._disconnected.wait()
        # The owner is suspended inside the block whenever this runs with _active set, so
        # the CancelledError surfaces inside the block and __aexit__ sees it.
        if self._active and self._owner is not None:
            self._fired = True
            self._owner.cancel()

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._gen is None or self._exhausted:
            raise StopAsyncIteration
        if self.finished:
            # Never wait for more after the final output (an engine generator may not
            # return on its own); __aexit__ closes it.
            raise StopAsyncIteration
        if self._stop_requested:
            return self._stopped_output()
        self._waiting = True
        try:
            out = await self._gen.__anext__()
        except StopAsyncIteration:
            self._exhausted = True
            raise
        except asyncio.CancelledError:
            if self._stop_cancels and not self._fired and self._owner is not None:
                self._stop_cancels -= 1
                uncancel = getattr(self._owner, "uncancel", None)
                if uncancel is None or uncancel() == 0:
                    self._exhausted = True  # the generator ended with the cancellation
                    return self._stopped_output()
            raise
        finally:
            self._waiting = False
        self.last = out
        self._num_tokens += len(out.new_token_ids)
        if out.finished:
            self.finished = True
        if self._tracker is not None:
            try:
                self._tracker.output(out)
            except Exception:
                logger.exception("metrics: output failed")
        return out

    def _stopped_output(self) -> RequestOutput:
        """The final output of a request ended by :meth:`stop`."""
        req = self._request
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=(),
            new_text="",
            finished=True,
            finish_reason=FinishReason.ABORT,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_output_tokens=self._num_tokens,
            seed=req.params.seed,
        )
        self.last = out
        self.finished = True
        self.stopped = True
        return out

    async def stop(self) -> bool:
        """Stop the request (spec §2.3 stopInfer): abort it in the engine and end the
        iteration with a final ``ABORT`` output. False when it had already finished."""
        if self.finished or not self._active or self._stop_requested:
            return False
        self._stop_requested = True
        if self._waiting and self._owner is not None:
            self._stop_cancels += 1
            self._owner.cancel()
        try:
            await self._engine.abort(self._request.request_id)
        except Exception:
            logger.exception("aborting %s failed", self._request.request_id)
        return True

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self._active = False
        if self._watcher is not None:
            self._watcher.cancel()
        uncancel = getattr(self._owner, "uncancel", None)
        while self._stop_cancels and uncancel is not None:
            self._stop_cancels -= 1  # a stop() cancel that never surfaced as ours
            uncancel()
        disconnected = False
        if self._fired:
            assert self._owner is not None
            # our cancellation is consumed; any other pending cancel keeps propagating
            # (Python 3.10 has no cancel counting: treat it as ours)
            disconnected = uncancel is None or uncancel() == 0
        try:
            await self._stop_engine()
        finally:
            self._unregister()
        if disconnected:
            raise ClientDisconnected() from exc
        return False

    def _unregister(self) -> None:
        ctx = self._context
        if ctx is None:
            return
        ctx.registry.remove(self, self._ids)
        if self._tracker is not None:
            try:
                self._tracker.finished(self.last if self.finished else None)
            except Exception:
                logger.exception("metrics: finished failed")

    async def _stop_engine(self) -> None:
        """Close the engine generator (it is suspended at its last yield, or mid-way) and
        abort the request unless its final output arrived."""
        aclose = getattr(self._gen, "aclose", None)
        if aclose is not None and not self._exhausted:
            try:
                await aclose()
            except Exception:
                logger.exception("closing the engine stream of %s failed", self._request.request_id)
        if not self.finished:
            try:
                await self._engine.abort(self._request.request_id)
            except Exception:
                logger.exception("aborting %s failed", self._request.request_id)
