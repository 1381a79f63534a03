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

from tokenserve.api.common import (
    FamilyApi,
    collect,
    encode_text,
    mindie_finish_reason,
    run_stream,
)
from tokenserve.api.fields import (
    INT32_MAX,
    Bounds,
    check_token_ids,
    get_bool,
    get_int,
    get_object,
    parse_sampling,
    parse_text_input,
)
from tokenserve.api.framing import sse
from tokenserve.messages import GenerateRequest, RequestOutput
from tokenserve.sampling_params import SamplingParams
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError

logger = logging.getLogger(__name__)

#: spec §2.1 ``timeout``: (0, 65535] seconds.
MAX_TIMEOUT_S = 65535
#: spec §1.5: at most this many media items in a multimodal ``inputs`` list; they are
#: counted and checked, then refused (the models we serve are text-only [I]).
MAX_MEDIA_ITEMS = 20
_MEDIA_TYPES = ("image_url", "video_url", "audio_url")
#: spec §2.1: ``top_k`` (0, 2^31-1], ``top_p`` (0, 1).
TOP_K = Bounds(0, INT32_MAX, lo_open=True)
TOP_P = Bounds(0.0, 1.0, lo_open=True, hi_open=True)


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
    kwargs, priority = parse_sampling(p, top_k=TOP_K, top_p=TOP_P, priority=True)
    timeout = get_int(p, "timeout", 0, MAX_TIMEOUT_S, lo_open=True)
    details = get_bool(p, "details", False)
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


class MindIEApi(FamilyApi):
    """Handlers of the MindIE native family (spec §2.1)."""


    async def _build(self, request: HttpRequest) -> tuple[InferBody, GenerateRequest]:
        """Steps 3-8 of spec §0.4; raises HttpError 422/424."""
        try:
            body = parse_infer_body(self._json(request), self._info.vocab_size)
            if body.input_ids is not None:
                ids = body.input_ids
            else:
                assert body.text is not None
                ids = await encode_text(self._engine.tokenizer, body.text)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        self._check_fits(len(ids))
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
        async with collect(self._engine, greq, request, context=self._context) as got:
            last = got.last
            result: dict[str, Any] = {"generated_text": got.text}
            if body.details:
                result["details"] = {
                    "finish_reason": mindie_finish_reason(last.finish_reason),
                    "generated_tokens": last.num_output_tokens,
                    "generated_token_ids": got.ids,
                    "seed": last.seed if last.seed is not None else greq.params.seed,
                }
            await response.send_json(200, result)

    async def _stream(
        self, request: HttpRequest, response: HttpResponse, body: InferBody, greq: GenerateRequest
    ) -> None:
        texts: list[str] = []
        first = True
        last_time = request.arrival_time or time.monotonic()

        def step_times(out: RequestOutput) -> dict[str, Any]:
            nonlocal last_time
            now = time.monotonic()
            times = _step_times(out, first, (now - last_time) * 1000)
            last_time = now
            return times

        def on_output(out: RequestOutput) -> bytes | None:
            nonlocal first
            event: dict[str, Any] = step_times(out)
            texts.append(out.new_text)
            if out.finished:
                event["generated_text"] = "".join(texts)
                event["details"] = self._stream_details(out, greq) if body.details else None
                event["token"] = {"id": list(out.new_token_ids), "text": None}
            elif not out.new_token_ids and not out.new_text:
                return None
            else:
                event["token"] = {"id": list(out.new_token_ids), "text": out.new_text}
            first = False
            return sse(event)

        def on_failure(out: RequestOutput) -> bytes | None:
            """Timeout / engine error (spec §0.4 step 9): tokens that came with the final
            output go out as a normal event before the error text."""
            event = step_times(out)
            if not out.new_token_ids:
                return None
            event["token"] = {"id": list(out.new_token_ids), "text": out.new_text}
            return sse(event)

        await run_stream(self._engine, greq, request, response, on_output, on_failure,
                         context=self._context,
                         log=logger)

    @staticmethod
    def _stream_details(out: RequestOutput, greq: GenerateRequest) -> dict[str, Any]:
        return {
            "finish_reason": mindie_finish_reason(out.finish_reason),
            "generated_tokens": out.num_output_tokens,
            "seed": out.seed if out.seed is not None else greq.params.seed,
        }
