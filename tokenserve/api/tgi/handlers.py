"""TGI-compatible family: ``POST /generate_stream``, ``POST /``, the TGI side of
``POST /generate`` and ``GET /info`` (spec/interfaces.md §3).

``POST /generate`` is shared with the vLLM family; ``tokenserve.server.app`` parses the body
once, routes it (spec §3.1) and calls :meth:`TgiApi.generate` with the parsed object.
Stream-ness (spec §3.2): ``/generate`` never streams, ``/generate_stream`` always does,
``POST /`` reads ``stream`` from the body. The pipeline is spec §0.4: JSON (422) ->
validation (422, MindIE's ``{"error", "error_type"}`` wrapper) -> prompt length (424) ->
generation; a timeout or engine failure after a stream started is written as a plain-text
last chunk and the connection is closed (§0.4 step 9).

Response shapes (spec §3.3, §3.4)::

    /generate      {"generated_text": ".."}  or, with details / decoder_input_details,
                   {"details": {"prompt_tokens", "finish_reason", "generated_tokens",
                                "prefill": [..], "seed", "tokens": [..]}, "generated_text": ".."}
    POST /         the same object inside a one-element array
    stream         data: {"token": {"id": [..], "text": "..", "logprob": null, "special": null},
                          "generated_text": null, "details": null}
                   last: generated_text = all text, details {prompt_tokens, finish_reason,
                         generated_tokens, seed} or null
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

import tokenserve
from tokenserve.api.common import (
    FamilyApi,
    collect,
    encode_text,
    mindie_finish_reason,
    run_stream,
)
from tokenserve.api.engine_client import engine_healthy
from tokenserve.api.fields import (
    INT32_MAX,
    Bounds,
    get_bool,
    get_int,
    get_object,
    get_str,
    parse_sampling,
    parse_stop,
    parse_text_input,
)
from tokenserve.api.framing import sse
from tokenserve.messages import GenerateRequest, RequestOutput
from tokenserve.sampling_params import SamplingParams
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError

logger = logging.getLogger(__name__)

#: spec §3.2 ``stop``: at most this many strings, each this many UTF-16 units, this in total
#: (a lone string is one item).
MAX_STOP_ITEMS = 1024
MAX_STOP_LEN = 1024
MAX_STOP_TOTAL = 32768
#: spec §3.2 ``adapter_id``.
_ADAPTER_ID = re.compile(r"[a-zA-Z0-9_./-]{1,256}", re.ASCII)
#: spec §3.2: ``top_k`` (0, 2^31-1], ``top_p`` (0, 1).
TOP_K = Bounds(0, INT32_MAX, lo_open=True)
TOP_P = Bounds(0.0, 1.0, lo_open=True, hi_open=True)
_NULL_TOKEN = {"logprob": None, "special": None, "text": None}


@dataclass(frozen=True)
class TgiBody:
    """A validated TGI body (spec §3.2), before tokenisation."""

    text: str
    params: SamplingParams
    details: bool
    decoder_input_details: bool
    return_full_text: bool
    truncate: int | None


def parse_tgi_body(obj: dict[str, Any], stream: bool, model_name: str) -> TgiBody:
    """Validate a TGI body (spec §3.2) and map it onto the internal model (§1).

    ``do_sample`` [I]: explicit wins, else sample iff temperature/top_k/top_p was given
    (as the native family). ``typical_p`` and ``watermark`` are validated, then ignored;
    fields the spec does not list (``best_of``, ``top_n_tokens``, ``grammar``,
    ``frequency_penalty``...) are ignored, never rejected.

    Raises:
        ValueError: any violation (422).
    """
    if obj.get("inputs") is None:
        raise ValueError("Not found inputs.")
    text = parse_text_input(obj["inputs"], "inputs")
    p = get_object(obj, "parameters")
    kwargs, _ = parse_sampling(p, top_k=TOP_K, top_p=TOP_P)
    kwargs["stop"] = parse_stop(p.get("stop"), max_items=MAX_STOP_ITEMS,
                                max_len=MAX_STOP_LEN, max_total=MAX_STOP_TOTAL)
    details = bool(get_bool(p, "details", False))
    decoder_input_details = bool(get_bool(p, "decoder_input_details", False))
    return_full_text = bool(get_bool(p, "return_full_text", False))
    truncate = get_int(p, "truncate", 0, INT32_MAX, lo_open=True)
    adapter = get_str(p, "adapter_id")
    if adapter is not None:
        if not _ADAPTER_ID.fullmatch(adapter):
            raise ValueError("Parameter adapter_id must match ^[a-zA-Z0-9_./-]{1,256}$.")
        if adapter not in (model_name, "None"):  # [I] no LoRA adapters are served
            raise ValueError(f"Adapter {adapter} not found.")
    if stream and decoder_input_details:
        raise ValueError("decoder_input_details == true is not supported when streaming tokens.")
    return TgiBody(text, SamplingParams(**kwargs), details, decoder_input_details,
                   return_full_text, truncate)


def _token_event(out: RequestOutput) -> dict[str, Any]:
    """A stream event carrying ``out``'s new tokens (spec §3.4)."""
    return {
        "token": {"id": list(out.new_token_ids), "text": out.new_text,
                  "logprob": None, "special": None},
        "generated_text": None,
        "details": None,
    }


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
        """``GET /info`` (spec §3.5); 503 with an empty body when the engine is unhealthy.

        [I] ``model_device_type`` is the device the model runs on (MindIE: always npu);
        ``model_dtype`` the dtype the weights are served in; ``max_input_length`` is
        ``max_model_len - 1`` (the prompt must leave room for one token)."""
        eng = self._engine
        if not engine_healthy(eng):
            await response.send(503, b"", "application/json")
            return
        info = self._info
        await response.send_json(200, {
            "docker_label": None,
            "max_batch_total_tokens": info.max_num_batched_tokens,
            "max_best_of": 1,
            "max_concurrent_requests": info.max_batch_size,
            "max_stop_sequences": None,
            "max_waiting_tokens": None,
            "sha": None,
            "validation_workers": None,
            "version": getattr(tokenserve, "__version__", "1.0.0"),
            "waiting_served_ratio": None,
            "models": [{
                "model_device_type": info.device,
                "model_dtype": info.dtype,
                "model_id": info.model_name,
                "model_pipeline_tag": "text-generation",
                "model_sha": None,
                "max_total_tokens": info.max_model_len,
            }],
            "max_input_length": info.max_model_len - 1,
        })

    # ------------------------------------------------------------------ pipeline

    async def _build(
        self, request: HttpRequest, obj: dict[str, Any], stream: bool
    ) -> tuple[TgiBody, GenerateRequest]:
        """Steps 5-8 of spec §0.4; raises HttpError 422/424."""
        try:
            body = parse_tgi_body(obj, stream, self._info.model_name)
            ids = await encode_text(self._engine.tokenizer, body.text)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        if body.truncate is not None and len(ids) > body.truncate:
            ids = ids[-body.truncate:]  # spec §1.2: keep the last N prompt tokens
        self._check_fits(len(ids))
        greq = GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=tuple(ids),
            params=body.params,
            arrival_time=request.arrival_time,
        )
        return body, greq

    async def _run(
        self, request: HttpRequest, response: HttpResponse, obj: dict[str, Any], *,
        stream: bool, wrap: bool,
    ) -> None:
        body, greq = await self._build(request, obj, stream)
        if stream:
            await self._stream(request, response, body, greq)
        else:
            await self._complete(request, response, body, greq, wrap)

    def _prefix(self, body: TgiBody) -> str:
        """spec §3.2 ``return_full_text``: ``inputs + " "`` before the generated text."""
        return body.text + " " if body.return_full_text else ""

    @staticmethod
    def _seed(out: RequestOutput, greq: GenerateRequest) -> int:
        return out.seed if out.seed is not None else greq.params.seed

    async def _complete(
        self, request: HttpRequest, response: HttpResponse, body: TgiBody,
        greq: GenerateRequest, wrap: bool,
    ) -> None:
        async with collect(self._engine, greq, request, context=self._context) as got:
            last = got.last
            result: dict[str, Any] = {}
            if body.details or body.decoder_input_details:
                prefill = greq.prompt_token_ids if body.decoder_input_details else ()
                result["details"] = {
                    "prompt_tokens": len(greq.prompt_token_ids),
                    "finish_reason": mindie_finish_reason(last.finish_reason),
                    "generated_tokens": last.num_output_tokens,
                    "prefill": [{"id": i, **_NULL_TOKEN} for i in prefill],
                    "seed": self._seed(last, greq),
                    "tokens": [{"id": i, **_NULL_TOKEN} for i in got.ids],
                }
            result["generated_text"] = self._prefix(body) + got.text
            await response.send_json(200, [result] if wrap else result)

    async def _stream(
        self, request: HttpRequest, response: HttpResponse, body: TgiBody, greq: GenerateRequest
    ) -> None:
        texts: list[str] = []

        def on_output(out: RequestOutput) -> bytes | None:
            if not out.finished and not out.new_token_ids and not out.new_text:
                return None
            texts.append(out.new_text)
            event = _token_event(out)
            if out.finished:
                event["generated_text"] = self._prefix(body) + "".join(texts)
                if body.details:
                    event["details"] = {
                        "prompt_tokens": len(greq.prompt_token_ids),
                        "finish_reason": mindie_finish_reason(out.finish_reason),
                        "generated_tokens": out.num_output_tokens,
                        "seed": self._seed(out, greq),
                    }
            return sse(event)

        def on_failure(out: RequestOutput) -> bytes | None:
            """Timeout / engine error (spec §0.4 step 9): tokens that came with the final
            output go out as a normal event before the error text."""
            return sse(_token_event(out)) if out.new_token_ids else None

        await run_stream(self._engine, greq, request, response, on_output, on_failure,
                         context=self._context,
                         log=logger)
