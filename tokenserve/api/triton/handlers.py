"""Triton-compatible family (spec/interfaces.md §6): token ``infer``, text ``generate`` /
``generate_stream``, health and metadata.

Routes (planes per spec §0.1; ``tokenserve.transport.planes`` decides which listener answers)::

    POST /v2/models/{m}/infer            §6.4  UINT32 token ids in, generated ids out
    POST /v2/models/{m}/generate         §6.3  text in, text out
    POST /v2/models/{m}/generate_stream  §6.3  SSE ``data:<json>`` (no space, spec §9.4)
    GET  /v2/health/live | /v2/health/ready | /v2/models/{m}/ready      §6.1 (management)
    GET  /v2 | /v2/models/{m} | /v2/models/{m}/config                    §6.2
    GET  /v2/models/{m}/getSlotCount                                     §6.2 (management)

Pipeline (spec §0.4): unknown model -> 404 ``Model <m> not found.`` -> JSON (422) ->
validation by Triton's own rules (§6.3 / §8: temperature (0, inf), top_k [0, 2^31),
top_p (0, 1] -- 1.0 is valid here, unlike ``/infer``) -> prompt length (424) ->
generation. The request ``id`` is echoed (the server request id when absent) and
registered with the request, so ``POST /v2/models/{m}/stopInfer`` can stop it by either.

[I] ``/infer`` also speaks Triton's binary tensor extension, as ``tritonclient`` uses it
by default: with header ``Inference-Header-Content-Length: <n>`` the JSON is the first
``n`` bytes and an input with ``parameters.binary_data_size`` reads its little-endian
UINT32 data from the rest; ``parameters.binary_data_output`` (or an output's
``parameters.binary_data``) returns the ids the same way. Request parameters are read at
the top level (``tritonclient``) and inside ``inputs[0]`` (MindIE); inside wins.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import replace
from typing import Any

import numpy as np
import orjson

import tokenserve
from tokenserve.api.engine_client import EngineStats, engine_healthy
from tokenserve.api.engine_stream import handed_plan, response_id
from tokenserve.api.family_api import (
    SERVER_NAME,
    FamilyApi,
    check_json_content_type,
    collect,
    encode_text,
    mindie_finish_reason,
    parse_json_object,
    run_stream,
    step_times,
)
from tokenserve.api.fields import INT32_MAX, get_int, get_object, required
from tokenserve.api.framing import sse
from tokenserve.api.management import kv_mem_sizes
from tokenserve.api.triton.protocol import (
    TritonParams,
    parse_id,
    parse_parameters,
    parse_triton_infer_body,
    parse_triton_text,
    triton_text_output,
)
from tokenserve.messages import GenerateRequest, RequestOutput
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError

logger = logging.getLogger(__name__)

BINARY_HEADER = "inference-header-content-length"


class TritonApi(FamilyApi):
    """Handlers of the Triton family (spec §6)."""


    # ------------------------------------------------------------------ helpers

    def _stats(self) -> EngineStats | None:
        try:
            return self._engine.stats()
        except Exception:
            logger.exception("engine.stats() failed")
            return None

    async def _plan(self, request: HttpRequest, text: str | None, ids: list[int] | None,
                    p: TritonParams) -> GenerateRequest:
        """The plan stage: the prompt's ids (``text`` tokenised: 422; too long: 424) and
        the engine request, or the plan handed over (PD decode), under this request's
        id."""
        given = handed_plan()
        if given is None:
            if ids is None:
                assert text is not None
                try:
                    ids = await encode_text(self._engine.tokenizer, text)
                except ValueError as exc:
                    raise HttpError(422, str(exc)) from None
            self._check_fits(len(ids))
        rid = response_id(uuid.uuid4().hex)
        if given is not None:
            return replace(given, request_id=rid, arrival_time=request.arrival_time)
        assert ids is not None
        return GenerateRequest(request_id=rid, prompt_token_ids=tuple(ids), params=p.sampling,
                               priority=p.priority, timeout_s=p.timeout_s,
                               arrival_time=request.arrival_time)

    # ------------------------------------------------------------------ health / metadata

    async def health_live(self, request: HttpRequest, response: HttpResponse) -> None:
        """spec §6.1: 200 empty when healthy, 500 ``{"message"}`` when abnormal."""
        if engine_healthy(self._engine):
            await response.send(200, b"")
        else:
            await response.send_json(500, {"message": "Engine is not running."})

    async def health_ready(self, request: HttpRequest, response: HttpResponse) -> None:
        """spec §6.1 (same answers as live: we have no busy state)."""
        await self.health_live(request, response)

    async def model_ready(self, request: HttpRequest, response: HttpResponse) -> None:
        """spec §6.1: 200 empty; 404 unknown model; 500 wrapper when abnormal."""
        self._served_model(request)
        if not engine_healthy(self._engine):
            raise HttpError(500, "Engine is not running.")
        await response.send(200, b"")

    async def server_metadata(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /v2`` (spec §6.2)."""
        await response.send_json(200, {
            "name": SERVER_NAME, "version": tokenserve.__version__,
            "extensions": {
                "max_iter_times": self._info.max_iter_times,
                "prefill_policy_type": 0, "decode_policy_type": 0,
                "max_prefill_batch_size": self._info.max_prefill_batch_size,
                "max_prefill_tokens": self._info.max_num_batched_tokens}})

    async def model_metadata(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /v2/models/{m}`` (spec §6.2)."""
        name = self._served_model(request)
        await response.send_json(200, {
            "name": name, "platform": SERVER_NAME,
            "inputs": [{"name": "input0", "shape": [-1], "datatype": "UINT32"}],
            "outputs": [{"name": "output0", "shape": [-1], "datatype": "UINT32"}]})

    async def model_config(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /v2/models/{m}/config`` (spec §6.2)."""
        name = self._served_model(request)
        info = self._info
        path = info.model_path
        npu_gb, cpu_gb = kv_mem_sizes(info.kv_cache_bytes, info.device != "cpu")  # as /v1/config
        await response.send_json(200, {
            "model_name": name, "input_datatype": "UINT32", "output_datatype": "UINT32",
            "max_seq_len": info.max_model_len, "npu_mem_size": npu_gb,
            "cpu_mem_size": cpu_gb, "world_size": 1,
            "model_weight_path": str(path).rstrip("/").rsplit("/", 1)[-1] if path else name,
            "model_instance_type": "Standard"})

    async def slot_count(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /v2/models/{m}/getSlotCount`` (spec §6.2)."""
        self._served_model(request)
        total = self._info.max_batch_size
        st = self._stats()
        running = st.num_running if st is not None else 0
        free_blocks = st.num_free_blocks if st is not None else 0
        await response.send_json(200, {
            "total_slots": total, "free_slots": max(0, total - running),
            "available_tokens_length": free_blocks * self._info.block_size})

    # ------------------------------------------------------------------ infer (§6.4)

    async def infer(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v2/models/{m}/infer``: token ids in, generated ids out (spec §6.4)."""
        self._served_model(request)
        try:
            body, binary = request.body, b""
            hlen = request.headers.get(BINARY_HEADER)
            if hlen is not None:
                n = int(hlen) if hlen.strip().isdigit() else -1
                if not 0 <= n <= len(body):
                    raise ValueError(f"Invalid {BINARY_HEADER}: {hlen[:32]}")
                body, binary = body[:n], body[n:]
            else:
                check_json_content_type(request.headers)
            parsed = parse_triton_infer_body(parse_json_object(body, self._max_json_depth),
                                             binary, self._info.vocab_size)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        greq = await self._plan(request, None, parsed.input_ids, parsed.params)
        aliases = (parsed.id,) if parsed.id else ()
        async with collect(self._engine, greq, request, context=self._context, aliases=aliases) as got:
            ids = got.ids
            output: dict[str, Any] = {"name": parsed.output_name, "shape": [1, len(ids)],
                                      "datatype": "UINT32"}
            if not parsed.binary_output:
                output["data"] = ids
                await response.send_json(200, {"id": parsed.id or greq.request_id,
                                               "outputs": [output]})
                return
            raw = np.asarray(ids, dtype="<u4").tobytes()
            output["parameters"] = {"binary_data_size": len(raw)}
            head = orjson.dumps({"id": parsed.id or greq.request_id, "outputs": [output]})
            await response.send(200, head + raw, "application/octet-stream",
                                {"Inference-Header-Content-Length": str(len(head))})

    # ------------------------------------------------------------------ generate (§6.3)

    async def _parse_generate(self, request: HttpRequest) -> tuple[str | None, TritonParams,
                                                                   GenerateRequest]:
        self._served_model(request)
        try:
            obj = self._json(request)
            rid = parse_id(obj)
            text = parse_triton_text(required(obj, "text_input"))
            p = get_object(obj, "parameters")
            max_tokens = get_int(obj, "max_tokens", 0, INT32_MAX, lo_open=True)
            if max_tokens is not None and p.get("max_new_tokens") is None:
                p = {**p, "max_new_tokens": max_tokens}  # [I] TensorRT-LLM benchmark alias
            params = parse_parameters(p, typical_p=True)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        return rid, params, await self._plan(request, text, None, params)

    def _text_output(self, rid: str, text: str) -> dict[str, Any]:
        return triton_text_output(rid, self._info.model_name, text)

    def _batch_size(self) -> int | None:
        """[I] ``details.batch_size`` per step: the running batch when the output came."""
        st = self._stats()
        return st.num_running if st is not None else None

    async def generate(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v2/models/{m}/generate`` (spec §6.3, non-stream)."""
        rid, params, greq = await self._parse_generate(request)
        batch: list[int | None] = []
        queue: list[float] = []

        def on_output(out: RequestOutput) -> None:
            if params.details and out.new_token_ids:
                batch.append(self._batch_size())
                queue.append(round(out.queue_time_ms or 0.0, 3))

        aliases = (rid,) if rid else ()
        async with collect(self._engine, greq, request, context=self._context, aliases=aliases,
                           on_output=on_output) as got:
            last = got.last
            result = self._text_output(rid or greq.request_id, got.text)
            if params.details:
                result["details"] = {
                    "finish_reason": mindie_finish_reason(last.finish_reason),
                    "generated_tokens": last.num_output_tokens, "first_token_cost": None,
                    "decode_cost": None, "batch_size": batch, "queue_wait_time": queue}
            await response.send_json(200, result)

    async def generate_stream(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v2/models/{m}/generate_stream`` (spec §6.3): ``data:<json>`` events,
        ``text_output`` = that step's new text; no ``[DONE]``."""
        rid, params, greq = await self._parse_generate(request)
        rid = rid or greq.request_id
        first = True
        last_time = request.arrival_time or time.monotonic()
        aliases = (rid,)  # PD: P and D admit it under the req-id

        def on_output(out: RequestOutput) -> bytes | None:
            nonlocal first, last_time
            now = time.monotonic()
            if not out.finished and not out.new_token_ids and not out.new_text:
                return None
            event = self._text_output(rid, out.new_text)
            if params.details:
                event.update(step_times(out, first, (now - last_time) * 1e3))
                details: dict[str, Any] = {
                    "generated_tokens": out.num_output_tokens,
                    "batch_size": self._batch_size(),
                    "queue_wait_time": round(out.queue_time_ms or 0.0, 3)}
                if out.finished:
                    details["finish_reason"] = mindie_finish_reason(out.finish_reason)
                event["details"] = details
            last_time = now
            first = False
            return sse(event, space=False)  # no space (spec §6.3, §9.4)

        def on_failure(out: RequestOutput) -> bytes | None:
            """Timeout / engine error (spec §0.4 step 9): the text that came with the final
            output goes out as a normal event before the error text."""
            return sse(self._text_output(rid, out.new_text), space=False) if out.new_text else None

        await run_stream(self._engine, greq, request, response, on_output, on_failure,
                         family="triton",
                         context=self._context,
                         aliases=aliases, log=logger)
