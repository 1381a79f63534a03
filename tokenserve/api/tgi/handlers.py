"""TGI-compatible family: ``POST /generate_stream``, ``POST /``, the TGI side of
``POST /generate`` and ``GET /info`` (spec/interfaces.md §3).

``POST /generate`` is shared with the vLLM family; ``tokenserve.server.app`` parses the body
once, routes it (spec §3.1) and calls :meth:`TgiApi.generate` with the parsed object.
Stream-ness (spec §3.2): ``/generate`` never streams, ``/generate_stream`` always does,
``POST /`` reads ``stream`` from the body. The pipeline is spec §0.4: JSON (422) ->
validation (422, MindIE's ``{"error", "error_type"}`` wrapper) -> prompt length (424) ->
generation; a timeout or engine failure after a stream started is written as a plain-text
last chunk and the connection is closed (§0.4 step 9). The body and the answer's shapes
are in :mod:`tokenserve.api.tgi.protocol`.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from tokenserve.api.engine_client import engine_healthy
from tokenserve.api.engine_stream import handed_plan
from tokenserve.api.family_api import FamilyApi, collect, encode_text, run_stream
from tokenserve.api.fields import get_bool
from tokenserve.api.framing import sse
from tokenserve.api.tgi.protocol import (
    TgiBody,
    parse_tgi_body,
    tgi_answer,
    tgi_info,
    tgi_prefill,
    tgi_stream_details,
    tgi_token_event,
)
from tokenserve.messages import GenerateRequest, RequestOutput
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError

logger = logging.getLogger(__name__)


class TgiApi(FamilyApi):
    """Handlers of the TGI family (spec §3)."""


    # ------------------------------------------------------------------ routes

    async def generate(
        self, request: HttpRequest, response: HttpResponse, *, body: dict[str, Any] | None = None
    ) -> None:
        """TGI ``POST /generate`` (never streams, spec §3.2); ``body`` is the parsed JSON
        when the dispatcher already has it."""
        obj = body if body is not None else self._body(request)
        await self._run(request, response, obj, stream=False, wrap=False)

    async def generate_stream(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /generate_stream`` (always streams, spec §3.4)."""
        await self._run(request, response, self._body(request), stream=True, wrap=False)

    async def root(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /``: ``stream`` from the body; non-stream answers a one-element array."""
        obj = self._body(request)
        try:
            stream = bool(get_bool(obj, "stream", False))
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        await self._run(request, response, obj, stream=stream, wrap=not stream)

    async def info(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /info`` (spec §3.5, :func:`tgi_info`); 503 with an empty body when the
        engine is unhealthy."""
        if not engine_healthy(self._engine):
            await response.send(503, b"", "application/json")
            return
        await response.send_json(200, tgi_info(self._info))

    # ------------------------------------------------------------------ pipeline

    async def _plan(self, request: HttpRequest, body: TgiBody) -> GenerateRequest:
        """Step 8 of spec §0.4: the prompt's ids and the engine request; raises
        HttpError 422/424."""
        try:
            ids = await encode_text(self._engine.tokenizer, body.text)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        if body.truncate is not None and len(ids) > body.truncate:
            ids = ids[-body.truncate:]  # spec §1.2: keep the last N prompt tokens
        self._check_fits(len(ids))
        return GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=tuple(ids),
            params=body.params,
            arrival_time=request.arrival_time,
        )

    async def _run(
        self, request: HttpRequest, response: HttpResponse, obj: dict[str, Any], *,
        stream: bool, wrap: bool,
    ) -> None:
        """Parse (steps 5-7 of spec §0.4, 422) -> plan (or the plan handed over, PD
        decode) -> run and render."""
        try:
            body = parse_tgi_body(obj, stream, self._info.model_name)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        greq = handed_plan() or await self._plan(request, body)
        if stream:
            await self._stream(request, response, body, greq)
        else:
            await self._complete(request, response, body, greq, wrap)

    async def _complete(
        self, request: HttpRequest, response: HttpResponse, body: TgiBody,
        greq: GenerateRequest, wrap: bool,
    ) -> None:
        entries: list[Any] = []  # the prompt's logprobs, when they come

        def keep(out: RequestOutput) -> None:
            if out.prompt_logprobs is not None:
                entries.append(out.prompt_logprobs)

        async with collect(self._engine, greq, request, context=self._context,
                           on_output=keep) as got:
            prefill = None
            if body.decoder_input_details:
                try:
                    prefill = tgi_prefill(greq.prompt_token_ids, entries[0] if entries else None,
                                          self._token_text)
                except ValueError as exc:
                    raise HttpError(500, str(exc)) from None
            result = tgi_answer(got, greq, body, prefill)
            await response.send_json(200, [result] if wrap else result)

    def _token_text(self, token_id: int) -> str:
        """One token's text, special tokens kept (``details.prefill``)."""
        return self._engine.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _stream(
        self, request: HttpRequest, response: HttpResponse, body: TgiBody, greq: GenerateRequest
    ) -> None:
        texts: list[str] = []

        def on_output(out: RequestOutput) -> bytes | None:
            if not out.finished and not out.new_token_ids and not out.new_text:
                return None
            texts.append(out.new_text)
            event = tgi_token_event(out)
            if out.finished:
                event["generated_text"] = body.prefix + "".join(texts)
                if body.details:
                    event["details"] = tgi_stream_details(out, greq)
            return sse(event)

        def on_failure(out: RequestOutput) -> bytes | None:
            """Timeout / engine error (spec §0.4 step 9): tokens that came with the final
            output go out as a normal event before the error text."""
            return sse(tgi_token_event(out)) if out.new_token_ids else None

        await run_stream(self._engine, greq, request, response, on_output, on_failure,
                         family="tgi",
                         context=self._context,
                         log=logger)
