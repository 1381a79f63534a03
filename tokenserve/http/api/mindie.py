"""MindIE native ``POST /infer`` and ``POST /infer_token`` (spec/interfaces.md §2.1).

Both paths share one handler (spec §9.1): the body carries ``inputs`` (text, tokenised
with the engine's tokenizer) or ``input_id`` (token ids), never both. The pipeline follows
spec §0.4: content type / JSON (422 ``Failed to parse request context to json``) ->
input and parameter validation (422) -> prompt length vs the context (424 ``Failed to
enqueue inferRequest. ...``) -> generation. Errors found before generation are JSON
errors; once a stream has started, a timeout or engine failure is written as a plain-text
last chunk and the connection is closed (§0.4 step 9).

Response shapes (spec §2.1)::

    non-stream  {"generated_text": "...", "details"?: {"finish_reason", "generated_tokens",
                 "generated_token_ids", "seed"}}
    stream      data: {"prefill_time": 45, "decode_time": null, "token": {"id": [..], "text": ".."}}
                data: {"prefill_time": null, "decode_time": 17, "token": {...}}
                data: {..., "generated_text": "<all>", "details": {..}|null,
                       "token": {"id": [last ids], "text": null}}
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from tokenserve.http.api.common import (
    DEFAULT_MAX_JSON_DEPTH,
    EngineClient,
    check_json_content_type,
    check_prompt_fits,
    encode_text,
    mindie_finish_reason,
    parse_json_object,
)
from tokenserve.http.api.engine_stream import EngineStream
from tokenserve.http.api.fields import (
    FLT_MAX,
    INT32_MAX,
    check_token_ids,
    get_bool,
    get_float,
    get_int,
    get_object,
    parse_text_input,
)
from tokenserve.http.cycle import ClientDisconnected, HttpRequest, HttpResponse
from tokenserve.http.errors import HttpError
from tokenserve.http.router import Router
from tokenserve.messages import FinishReason, GenerateRequest, RequestOutput
from tokenserve.sampling_params import MAX_SEED, SamplingParams

logger = logging.getLogger(__name__)

#: spec §2.1 ``timeout``: (0, 65535] seconds.
MAX_TIMEOUT_S = 65535
#: spec §1.5: at most this many media items in a multimodal ``inputs`` list; they are
#: counted and checked, then refused (the models we serve are text-only [I]).
MAX_MEDIA_ITEMS = 20
_MEDIA_TYPES = ("image_url", "video_url", "audio_url")
_FAILED_FINISH = (FinishReason.TIMEOUT, FinishReason.ERROR)


@dataclass(frozen=True)
class InferBody:
    """A validated ``/infer`` body (spec §2.1) before tokenisation.

    Exactly one of ``text`` and ``input_ids`` is set.
    """

    text: str | None
    input_ids: list[int] | None
    stream: bool
    details: bool
    params: SamplingParams
    priority: int
    timeout_s: float | None


def parse_infer_body(obj: dict[str, Any], vocab_size: int) -> InferBody:
    """Validate an ``/infer`` body (spec §2.1) and map it onto the internal model (§1).

    ``do_sample`` [I]: an explicit value wins; when absent, sample iff ``temperature``,
    ``top_k`` or ``top_p`` was given (the TGI rule). ``typical_p`` and ``watermark`` are
    validated and otherwise ignored.

    Raises:
        ValueError: any violation (the caller answers 422).
    """
    has_text = obj.get("inputs") is not None
    has_ids = obj.get("input_id") is not None
    if has_text and has_ids:
        raise ValueError("Input conflict.")
    if not has_text and not has_ids:
        raise ValueError("Not found inputs.")
    text: str | None = None
    if has_text:
        text = parse_text_input(obj["inputs"], "inputs", media_types=_MEDIA_TYPES,
                                max_media=MAX_MEDIA_ITEMS)
    ids = check_token_ids(obj["input_id"], vocab_size, "input_id") if has_ids else None

    stream = get_bool(obj, "stream", False)
    p = get_object(obj, "parameters")
    temperature = get_float(p, "temperature", 0.0, FLT_MAX, lo_open=True)
    top_k = get_int(p, "top_k", 0, INT32_MAX, lo_open=True)
    top_p = get_float(p, "top_p", 0.0, 1.0, lo_open=True, hi_open=True)
    get_float(p, "typical_p", 0.0, 1.0, lo_open=True)
    do_sample = get_bool(p, "do_sample")
    seed = get_int(p, "seed", 0, MAX_SEED)
    repetition_penalty = get_float(p, "repetition_penalty", 0.0, FLT_MAX, lo_open=True)
    get_bool(p, "watermark")
    priority = get_int(p, "priority", 1, 5, default=5)
    max_new_tokens = get_int(p, "max_new_tokens", 0, INT32_MAX, lo_open=True, default=20)
    timeout = get_int(p, "timeout", 0, MAX_TIMEOUT_S, lo_open=True)
    details = get_bool(p, "details", False)

    if do_sample is None:
        do_sample = temperature is not None or top_k is not None or top_p is not None
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": do_sample}
    if temperature is not None:
        kwargs["temperature"] = temperature
    if top_k is not None:
        kwargs["top_k"] = top_k
    if top_p is not None:
        kwargs["top_p"] = top_p
    if repetition_penalty is not None:
        kwargs["repetition_penalty"] = repetition_penalty
    if seed is not None:
        kwargs["seed"] = seed
    return InferBody(
        text=text,
        input_ids=ids,
        stream=bool(stream),
        details=bool(details),
        params=SamplingParams(**kwargs),
        priority=priority if priority is not None else 5,
        timeout_s=float(timeout) if timeout is not None else None,
    )


def _ms(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def _step_times(out: RequestOutput, first: bool, elapsed_ms: float) -> dict[str, Any]:
    """spec §2.1: ``prefill_time`` (ms) on the first event, ``decode_time`` (ms since the
    previous event) on later ones, the other ``null``; the engine's numbers win, the
    handler's clock is the fallback."""
    if first:
        ms = out.prefill_time_ms if out.prefill_time_ms is not None else elapsed_ms
        return {"prefill_time": _ms(ms), "decode_time": None}
    ms = out.decode_time_ms if out.decode_time_ms is not None else elapsed_ms
    return {"prefill_time": None, "decode_time": _ms(ms)}


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


class MindIEApi:
    """Handlers of the MindIE native family (spec §2.1)."""

    def __init__(
        self, engine: EngineClient, *, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    ) -> None:
        self._engine = engine
        self._max_json_depth = max_json_depth

    def register(self, router: Router) -> None:
        """Add ``POST /infer`` and ``POST /infer_token`` (one handler, spec §9.1)."""
        router.post("/infer", self.infer)
        router.post("/infer_token", self.infer)

    async def _build(self, request: HttpRequest) -> tuple[InferBody, GenerateRequest]:
        """Steps 3-8 of spec §0.4; raises HttpError 422/424."""
        try:
            check_json_content_type(request.headers)
            obj = parse_json_object(request.body, self._max_json_depth)
            body = parse_infer_body(obj, self._engine.vocab_size)
            if body.input_ids is not None:
                ids = body.input_ids
            else:
                assert body.text is not None
                ids = await encode_text(self._engine.tokenizer, body.text)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        try:
            check_prompt_fits(len(ids), self._engine)
        except ValueError as exc:
            raise HttpError(424, str(exc)) from None
        greq = GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=tuple(ids),
            params=body.params,
            priority=body.priority,
            timeout_s=body.timeout_s,
            arrival_time=request.arrival_time,
        )
        return body, greq

    async def infer(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /infer`` and ``POST /infer_token`` (spec §2.1)."""
        body, greq = await self._build(request)
        if body.stream:
            await self._stream(request, response, body, greq)
        else:
            await self._complete(request, response, body, greq)

    async def _complete(
        self, request: HttpRequest, response: HttpResponse, body: InferBody, greq: GenerateRequest
    ) -> None:
        texts: list[str] = []
        ids: list[int] = []
        async with EngineStream(self._engine, greq, request.disconnected) as stream:
            async for out in stream:
                texts.append(out.new_text)
                ids.extend(out.new_token_ids)
            last = stream.last
            if last is None or not last.finished:
                raise HttpError(500, "Engine stream ended without a final output.")
            if last.finish_reason in _FAILED_FINISH:
                raise HttpError(500, last.error or f"Engine request {last.finish_reason.value}.")
            result: dict[str, Any] = {"generated_text": "".join(texts)}
            if body.details:
                result["details"] = {
                    "finish_reason": mindie_finish_reason(last.finish_reason),
                    "generated_tokens": last.num_output_tokens,
                    "generated_token_ids": ids,
                    "seed": last.seed if last.seed is not None else greq.params.seed,
                }
            await response.send_json(200, result)

    async def _stream(
        self, request: HttpRequest, response: HttpResponse, body: InferBody, greq: GenerateRequest
    ) -> None:
        texts: list[str] = []
        first = True
        last_time = request.arrival_time or time.monotonic()
        # admission first (a full queue is a 503 answer), then the head
        async with EngineStream(self._engine, greq, request.disconnected) as stream:
            await response.start_stream(200, "text/event-stream")
            try:
                async for out in stream:
                    now = time.monotonic()
                    times = _step_times(out, first, (now - last_time) * 1000)
                    last_time = now
                    if out.finished and out.finish_reason in _FAILED_FINISH:
                        await self._fail_stream(response, out, times)
                        return
                    texts.append(out.new_text)
                    event: dict[str, Any] = dict(times)
                    if out.finished:
                        event["generated_text"] = "".join(texts)
                        event["details"] = self._stream_details(out, greq) if body.details else None
                        event["token"] = {"id": list(out.new_token_ids), "text": None}
                    elif not out.new_token_ids and not out.new_text:
                        continue
                    else:
                        event["token"] = {"id": list(out.new_token_ids), "text": out.new_text}
                    await response.write(_sse(event))
                    first = False
            except ClientDisconnected:
                raise
            except Exception as exc:
                # engine failure after the head was sent: plain-text last chunk (§0.4 step 9)
                logger.exception("engine failed while streaming %s", greq.request_id)
                await response.write(f"Engine failure: {exc}".encode())
                await response.end(close_connection=True)
                return
            if not stream.finished:
                await response.write(b"Engine stream ended without a final output.")
                await response.end(close_connection=True)
                return
        await response.end()

    @staticmethod
    def _stream_details(out: RequestOutput, greq: GenerateRequest) -> dict[str, Any]:
        return {
            "finish_reason": mindie_finish_reason(out.finish_reason),
            "generated_tokens": out.num_output_tokens,
            "seed": out.seed if out.seed is not None else greq.params.seed,
        }

    @staticmethod
    async def _fail_stream(
        response: HttpResponse, out: RequestOutput, times: dict[str, Any]
    ) -> None:
        """Timeout / engine error mid-stream (spec §0.4 step 9): tokens that came with the
        final output are sent as a normal event, then the error text as the last chunk,
        then the connection closes."""
        if out.new_token_ids:
            event = dict(times)
            event["token"] = {"id": list(out.new_token_ids), "text": out.new_text}
            await response.write(_sse(event))
        reason = out.finish_reason.value if out.finish_reason else "error"
        await response.write((out.error or f"Engine request {reason}.").encode())
        await response.end(close_connection=True)
