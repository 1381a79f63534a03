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
logprobs).

Response shapes (spec §4.1, §9.5)::

    non-stream  {"text": ["<prompt> <generated>", ...]}
    stream      text/event-stream, but NUL-delimited JSON, not SSE:
                {"text": ["<new text of seq 0>", ...]}\\0{"text": [...]}\\0 ...
                (per step, the new text of each sequence; "" for one with nothing new)
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from tokenserve.api.common import (
    FAILED_FINISH,
    FamilyApi,
    encode_text,
    failure_text,
    guard_stream,
)
from tokenserve.api.engine_stream import NO_FINAL_OUTPUT, FanOut
from tokenserve.api.fields import (
    FLT_MAX,
    INT32_MAX,
    get_bool,
    get_float,
    get_int,
    get_str,
    given,
    parse_stop,
    parse_stop_token_ids,
    parse_text_input,
)
from tokenserve.api.framing import close_stream, nul_chunk
from tokenserve.messages import GenerateRequest, RequestOutput
from tokenserve.sampling_params import MAX_SEED, SamplingParams
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError

logger = logging.getLogger(__name__)

#: spec §4.1 ``stop``: one string up to 32768 UTF-16 units, list items up to 1024 each,
#: 32768 in total, no count limit.
MAX_STOP_SINGLE = 32768
MAX_STOP_LEN = 1024
MAX_STOP_TOTAL = 32768
MAX_BEST_OF = 128
MAX_N = 8192


@dataclass(frozen=True)
class VllmBody:
    """A validated vLLM ``/generate`` body (spec §4.1) before tokenisation.

    ``count`` is how many sequences to generate and return (``best_of`` else ``n``).
    """

    text: str
    stream: bool
    params: SamplingParams
    count: int


def parse_vllm_body(
    obj: dict[str, Any], *, default_max_tokens: int, model_name: str, max_n: int = MAX_N
) -> VllmBody:
    """Validate a vLLM ``/generate`` body (spec §4.1) and map it onto the internal model.

    Sampling [I]: ``temperature`` 0 is greedy, > 0 samples; unset, it samples iff
    ``top_k`` (other than -1) or ``top_p`` was given (the rule of the other families).
    ``best_of``/``n`` > 1 need a non-zero ``temperature`` (spec §4.1). ``model`` must name
    the served model (or be "None"): no LoRA adapters are served [I].

    Raises:
        ValueError: any violation (422).
    """
    if obj.get("prompt") is None:
        raise ValueError("Not found prompt.")
    text = parse_text_input(obj["prompt"], "prompt")
    stream = bool(get_bool(obj, "stream", False))
    max_tokens = get_int(obj, "max_tokens", 0, INT32_MAX, lo_open=True, default=default_max_tokens)
    temperature = get_float(obj, "temperature", 0.0, FLT_MAX)
    top_k = get_int(obj, "top_k")
    if top_k is not None and top_k != -1 and not 0 < top_k <= INT32_MAX:
        raise ValueError(f"Parameter top_k must be -1 or in (0,{INT32_MAX}], got {top_k}.")
    top_p = get_float(obj, "top_p", 0.0, 1.0, lo_open=True)
    seed = get_int(obj, "seed", 0, MAX_SEED)
    repetition_penalty = get_float(obj, "repetition_penalty", 0.0, FLT_MAX, lo_open=True)
    frequency_penalty = get_float(obj, "frequency_penalty", -2.0, 2.0, default=0.0)
    presence_penalty = get_float(obj, "presence_penalty", -2.0, 2.0, default=0.0)
    stop = parse_stop(obj.get("stop"), max_single=MAX_STOP_SINGLE, max_len=MAX_STOP_LEN,
                      max_total=MAX_STOP_TOTAL)
    stop_token_ids = parse_stop_token_ids(obj.get("stop_token_ids"))
    include_stop = False
    if obj.get("stop") is not None or obj.get("stop_token_ids") is not None:  # spec §1.2
        include_stop = bool(get_bool(obj, "include_stop_str_in_output", False))
    ignore_eos = bool(get_bool(obj, "ignore_eos", False))
    skip_special_tokens = bool(get_bool(obj, "skip_special_tokens", True))
    best_of = get_int(obj, "best_of", 1, MAX_BEST_OF)
    n = get_int(obj, "n", 1, MAX_N, default=1)
    model = get_str(obj, "model")
    if model is not None:
        if not 0 < len(model) <= 256:
            raise ValueError("Parameter model must have 1 to 256 characters.")
        if model not in (model_name, "None"):
            raise ValueError(f"Model {model} not found.")

    assert n is not None and max_tokens is not None
    if best_of is not None and best_of < n:
        raise ValueError(f"best_of must be greater than or equal to n, got n={n}, best_of={best_of}.")
    count = best_of if best_of is not None else n
    if count > max_n:
        raise ValueError(f"Parameter n must not exceed the maximum batch size {max_n}, got {count}.")
    if count > 1 and not temperature:
        raise ValueError("best_of and n must be 1 when temperature is 0 or not set (greedy).")

    if temperature is not None:
        do_sample = temperature > 0
    else:
        do_sample = (top_k is not None and top_k != -1) or top_p is not None
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_tokens, "do_sample": do_sample, "stop": stop,
        "stop_token_ids": stop_token_ids, "include_stop_str_in_output": include_stop,
        "ignore_eos": ignore_eos, "skip_special_tokens": skip_special_tokens,
        "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
        # ours [I]: false opts the request out of speculative decoding
        "speculative": bool(get_bool(obj, "speculative", True)),
    }
    if temperature:
        kwargs["temperature"] = temperature
    if top_k is not None and top_k != -1:
        kwargs["top_k"] = top_k
    kwargs.update(given(top_p=top_p, repetition_penalty=repetition_penalty, seed=seed))
    return VllmBody(text, stream, SamplingParams(**kwargs), count)


def _cum_logprob(outs: list[RequestOutput]) -> float | None:
    total = 0.0
    for out in outs:
        if out.new_token_ids and out.logprobs is None:
            return None
        total += sum(lp.logprob for lp in out.logprobs or ())
    return total


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
        vb, reqs = await self._build(request, body)
        async with FanOut(self._engine, reqs, request.disconnected, context=self._context) as fan:
            if vb.stream:
                await self._stream(response, vb, fan)
            else:
                await self._complete(response, vb, fan)

    async def _build(
        self, request: HttpRequest, obj: dict[str, Any]
    ) -> tuple[VllmBody, list[GenerateRequest]]:
        """Steps 5-8 of spec §0.4; raises HttpError 422/424."""
        max_n = self._info.max_batch_size or MAX_N
        try:
            vb = parse_vllm_body(obj, default_max_tokens=self.default_max_tokens,
                                 model_name=self._info.model_name, max_n=min(max_n, MAX_N))
            ids = await encode_text(self._engine.tokenizer, vb.text)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        self._check_fits(len(ids))
        params = [vb.params]
        if vb.count > 1:  # distinct seeds; logprobs rank the sequences
            params = [dataclasses.replace(vb.params, seed=(vb.params.seed + i) % (MAX_SEED + 1),
                                          logprobs=vb.params.logprobs or 0)
                      for i in range(vb.count)]
        reqs = [GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tuple(ids),
                                params=p, arrival_time=request.arrival_time) for p in params]
        return vb, reqs

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
        order = list(range(vb.count))
        scores = [_cum_logprob(o) for o in outs]
        if vb.count > 1 and all(s is not None for s in scores):
            order.sort(key=lambda i: -scores[i])  # type: ignore[operator]
        texts = [vb.text + " " + "".join(o.new_text for o in outs[i]) for i in order]
        await response.send_json(200, {"text": texts})

    async def _stream(self, response: HttpResponse, vb: VllmBody, fan: FanOut) -> None:
        await response.start_stream(200, "text/event-stream")
        if await guard_stream(response, self._pump(response, vb, fan), logger,
                              "a vLLM request"):
            await response.end()

    @staticmethod
    async def _pump(response: HttpResponse, vb: VllmBody, fan: FanOut) -> bool:
        """Write each step's new texts; False when it closed the stream on a failed or
        incomplete sequence (spec §0.4 step 9: the error text is the last chunk)."""
        done = [False] * vb.count
        sent = False
        while not all(done):
            deltas = [""] * vb.count
            failed: RequestOutput | None = None
            incomplete = False
            for i, item in await fan.batch():
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    incomplete = incomplete or not done[i]
                    continue
                deltas[i] += item.new_text
                if item.finished:
                    done[i] = True
                    if item.finish_reason in FAILED_FINISH:
                        failed = failed or item
            if any(deltas) or (all(done) and not sent):
                await response.write(nul_chunk({"text": deltas}))
                sent = True
            if failed is not None or incomplete:
                await close_stream(response, failure_text(failed) if failed else NO_FINAL_OUTPUT)
                return False
        return True
