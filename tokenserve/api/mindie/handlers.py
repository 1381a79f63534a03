"""MindIE native ``POST /infer`` and ``POST /infer_token`` (spec/interfaces.md §2.1).

Both paths share one handler (spec §9.1): the body carries ``inputs`` (text, tokenised
with the engine's tokenizer) or ``input_id`` (token ids), never both. The pipeline follows
spec §0.4: content type / JSON (422 ``Failed to parse request context to json``) ->
input and parameter validation (422) -> prompt length vs the context (424 ``Failed to
enqueue inferRequest. ...``) -> generation. Errors found before generation are JSON
errors; once a stream has started, a timeout or engine failure is written as a plain-text
last chunk and the connection is closed (§0.4 step 9). The body and the answer's shapes
are in :mod:`tokenserve.api.mindie.protocol`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from tokenserve.api.engine_stream import handed_plan
from tokenserve.api.family_api import FamilyApi, collect, encode_text, run_stream, step_times
from tokenserve.api.framing import sse
from tokenserve.api.mindie.protocol import (
    MindieBody,
    mindie_answer,
    mindie_stream_details,
    mindie_token,
    parse_mindie_body,
)
from tokenserve.messages import GenerateRequest, RequestOutput
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError

logger = logging.getLogger(__name__)


class MindIEApi(FamilyApi):
    """Handlers of the MindIE native family (spec §2.1)."""


    def _parse(self, request: HttpRequest) -> MindieBody:
        """Steps 3-7 of spec §0.4; raises HttpError 422."""
        try:
            return parse_mindie_body(self._json(request), self._info.vocab_size)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None

    async def _plan(self, request: HttpRequest, body: MindieBody) -> GenerateRequest:
        """Step 8 of spec §0.4: the prompt's ids (tokenised ``inputs``) and the engine
        request; raises HttpError 422/424."""
        if body.input_ids is not None:
            ids = body.input_ids
        else:
            assert body.text is not None
            try:
                ids = await encode_text(self._engine.tokenizer, body.text)
            except ValueError as exc:
                raise HttpError(422, str(exc)) from None
        self._check_fits(len(ids))
        return GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=tuple(ids),
            params=body.params,
            priority=body.priority,
            timeout_s=body.timeout_s,
            arrival_time=request.arrival_time,
        )

    async def infer(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /infer`` and ``POST /infer_token`` (spec §2.1): parse -> plan (or the
        plan handed over, PD decode) -> run and render."""
        body = self._parse(request)
        greq = handed_plan() or await self._plan(request, body)
        if body.stream:
            await self._stream(request, response, body, greq)
        else:
            await self._complete(request, response, body, greq)

    async def _complete(
        self, request: HttpRequest, response: HttpResponse, body: MindieBody, greq: GenerateRequest
    ) -> None:
        async with collect(self._engine, greq, request, context=self._context) as got:
            await response.send_json(200, mindie_answer(got, greq, body.details))

    async def _stream(
        self, request: HttpRequest, response: HttpResponse, body: MindieBody, greq: GenerateRequest
    ) -> None:
        texts: list[str] = []
        first = True
        last_time = request.arrival_time or time.monotonic()

        def times_now(out: RequestOutput) -> dict[str, Any]:
            nonlocal last_time
            now = time.monotonic()
            times = step_times(out, first, (now - last_time) * 1000)
            last_time = now
            return times

        def on_output(out: RequestOutput) -> bytes | None:
            nonlocal first
            event: dict[str, Any] = times_now(out)
            texts.append(out.new_text)
            if out.finished:
                event["generated_text"] = "".join(texts)
                event["details"] = mindie_stream_details(out, greq) if body.details else None
                event["token"] = {"id": list(out.new_token_ids), "text": None}
            elif not out.new_token_ids and not out.new_text:
                return None
            else:
                event["token"] = mindie_token(out)
            first = False
            return sse(event)

        def on_failure(out: RequestOutput) -> bytes | None:
            """Timeout / engine error (spec §0.4 step 9): tokens that came with the final
            output go out as a normal event before the error text."""
            event = times_now(out)
            if not out.new_token_ids:
                return None
            event["token"] = mindie_token(out)
            return sse(event)

        await run_stream(self._engine, greq, request, response, on_output, on_failure,
                         family="mindie",
                         context=self._context,
                         log=logger)
