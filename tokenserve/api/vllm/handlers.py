"""vLLM-compatible family: ``POST /generate`` with a ``prompt`` (spec/interfaces.md §4.1).

``POST /generate`` is shared with TGI; ``tokenserve.server.app`` parses the body once,
routes it (spec §3.1: a non-null ``prompt`` wins) and calls :meth:`VllmApi.generate` with
the parsed object. All fields are top-level (no ``parameters`` object). The pipeline is
spec §0.4: JSON (422) -> validation (422) -> prompt length (424) -> generation; a timeout
or engine failure after a stream started is written as a plain-text last chunk and the
connection is closed (§0.4 step 9).

``n`` / ``best_of`` (spec §4.1): ``best_of`` (else ``n``) sequences are generated as that
many engine requests with seeds ``seed, seed+1, ...``; the non-stream answer lists them
best first by cumulative log-probability (submission order when the engine reports no
logprobs). The body and the answer's shapes are in :mod:`tokenserve.api.vllm.protocol`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from tokenserve.api.engine_stream import NO_FINAL_OUTPUT, FanOut, handed_plan
from tokenserve.api.errors import fail_stream
from tokenserve.api.family_api import (
    FAILED_FINISH,
    FamilyApi,
    encode_text,
    failure_text,
    guard_stream,
)
from tokenserve.api.fields import MAX_N
from tokenserve.api.framing import EVENT_STREAM, nul_chunk
from tokenserve.api.vllm.protocol import (
    VllmBody,
    parse_vllm_body,
    sequence_params,
    vllm_answer,
    vllm_prompt_logprobs,
)
from tokenserve.messages import GenerateRequest, RequestOutput
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError

logger = logging.getLogger(__name__)


class VllmApi(FamilyApi):
    """Handler of the vLLM family (spec §4.1)."""


    @property
    def default_max_tokens(self) -> int:
        """spec §1.2: ``maxIterTimes`` (engine config), else the context length."""
        return self._info.max_iter_times or self._info.max_model_len

    async def generate(
        self, request: HttpRequest, response: HttpResponse, *, body: dict[str, Any] | None = None
    ) -> None:
        """vLLM ``POST /generate``; ``body`` is the parsed JSON when the dispatcher has it."""
        if body is None:
            body = self._body(request)
        vb = self._parse(body)
        given = handed_plan()  # PD decode: P's plan of its one sequence (a second
        # one is refused at admission, as without a plan)
        reqs = [given] * vb.count if given is not None else await self._plan(request, vb)
        async with FanOut(self._engine, reqs, request.disconnected, context=self._context) as fan:
            if vb.stream:
                await self._stream(response, vb, fan, self._token_text)
            else:
                await self._complete(response, vb, fan)

    def _parse(self, obj: dict[str, Any]) -> VllmBody:
        """Steps 5-7 of spec §0.4; raises HttpError 422."""
        max_n = self._info.max_batch_size or MAX_N
        try:
            return parse_vllm_body(obj, default_max_tokens=self.default_max_tokens,
                                   model_name=self._info.model_name, max_n=min(max_n, MAX_N))
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None

    async def _plan(self, request: HttpRequest, vb: VllmBody) -> list[GenerateRequest]:
        """Step 8 of spec §0.4: the prompt's ids and one engine request per sequence;
        raises HttpError 422/424."""
        try:
            ids = await encode_text(self._engine.tokenizer, vb.text)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        self._check_fits(len(ids))
        return [GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tuple(ids),
                                params=p, arrival_time=request.arrival_time)
                for p in sequence_params(vb)]

    async def _complete(self, response: HttpResponse, vb: VllmBody, fan: FanOut) -> None:
        outs: list[list[RequestOutput]] = [[] for _ in range(vb.count)]
        done = [False] * vb.count
        while not all(done):
            for i, item in await fan.batch():
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    if not done[i]:
                        raise HttpError(500, NO_FINAL_OUTPUT)
                    continue
                outs[i].append(item)
                if item.finished:
                    if item.finish_reason in FAILED_FINISH:
                        raise HttpError(500, failure_text(item))
                    done[i] = True
        try:
            answer = vllm_answer(vb, outs, self._token_text)
        except ValueError as exc:  # prompt logprobs missing: the engine's failure
            raise HttpError(500, str(exc)) from None
        await response.send_json(200, answer)

    def _token_text(self, token_id: int) -> str:
        """One token's text, special tokens kept (``prompt_logprobs``' ``decoded_token``)."""
        return self._engine.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _stream(self, response: HttpResponse, vb: VllmBody, fan: FanOut,
                      text_of: Callable[[int], str]) -> None:
        await response.start_stream(200, EVENT_STREAM)
        if await guard_stream(response, self._pump(response, vb, fan, text_of), logger,
                              "a vLLM request", "vllm"):
            await response.end()

    @staticmethod
    async def _pump(response: HttpResponse, vb: VllmBody, fan: FanOut,
                    text_of: Callable[[int], str]) -> bool:
        """Write each step's new texts; False when it closed the stream on a failed or
        incomplete sequence (spec §0.4 step 9: the error text is the last chunk, an error
        event). [I] With ``prompt_logprobs``, the chunk where they came carries
        ``"prompt_logprobs"`` too."""
        done = [False] * vb.count
        sent = False
        while not all(done):
            deltas = [""] * vb.count
            failed: RequestOutput | None = None
            incomplete = False
            extra: dict[str, Any] = {}
            for i, item in await fan.batch():
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    incomplete = incomplete or not done[i]
                    continue
                deltas[i] += item.new_text
                if item.prompt_logprobs is not None and vb.prompt_logprobs is not None:
                    extra["prompt_logprobs"] = vllm_prompt_logprobs(
                        item.prompt_logprobs, text_of, vb.prompt_logprobs)
                if item.finished:
                    done[i] = True
                    if item.finish_reason in FAILED_FINISH:
                        failed = failed or item
            if any(deltas) or extra or (all(done) and not sent):
                await response.write(nul_chunk({"text": deltas, **extra}))
                sent = True
            if failed is not None or incomplete:
                await fail_stream(response, "vllm",
                                  failure_text(failed) if failed else NO_FINAL_OUTPUT)
                return False
        return True
