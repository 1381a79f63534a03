"""TGI family: the body and its validation, and the answer's pieces (spec/interfaces.md
§3.2-§3.5).

Response shapes (spec §3.3, §3.4)::

    /generate      {"generated_text": ".."}  or, with details / decoder_input_details,
                   {"details": {"prompt_tokens", "finish_reason", "generated_tokens",
                                "prefill": [..], "seed", "tokens": [..]}, "generated_text": ".."}
                   (prefill, with decoder_input_details: {id, logprob, special, text} per
                   prompt token, the first logprob null; TGI refuses it when streaming)
    POST /         the same object inside a one-element array
    stream         data: {"token": {"id": [..], "text": "..", "logprob": null, "special": null},
                          "generated_text": null, "details": null}
                   last: generated_text = all text, details {prompt_tokens, finish_reason,
                         generated_tokens, seed} or null
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tokenserve
from tokenserve.api.engine_client import EngineInfo
from tokenserve.api.family_api import Collected, mindie_finish_reason, reported_seed
from tokenserve.api.fields import (
    INT32_MAX,
    NATIVE_TOP_K,
    NATIVE_TOP_P,
    STOP_COUNT_MAX,
    get_bool,
    get_int,
    get_object,
    get_str,
    parse_sampling,
    parse_stop,
    parse_text_input,
    required,
)
from tokenserve.api.structured import parse_tgi_grammar
from tokenserve.messages import GenerateRequest, RequestOutput, TokenLogprob
from tokenserve.sampling_params import SamplingParams

#: spec §3.2 ``adapter_id``.
_ADAPTER_ID = re.compile(r"[a-zA-Z0-9_./-]{1,256}", re.ASCII)
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

    @property
    def prefix(self) -> str:
        """spec §3.2 ``return_full_text``: ``inputs + " "`` before the generated text."""
        return self.text + " " if self.return_full_text else ""


def parse_tgi_body(obj: dict[str, Any], stream: bool, model_name: str) -> TgiBody:
    """Validate a TGI body (spec §3.2) and map it onto the internal model (§1).

    ``do_sample`` [I]: explicit wins, else sample iff temperature/top_k/top_p was given
    (as the native family). ``typical_p`` and ``watermark`` are validated, then ignored;
    fields the spec does not list (``best_of``, ``top_n_tokens``,
    ``frequency_penalty``...) are ignored, never rejected. ``grammar`` ({type: json|regex,
    value}) constrains the output (spec §5.5, :mod:`tokenserve.api.structured`). ``stop`` (spec §3.2): at most
    1024 strings, each 1024 UTF-16 units, 32768 in total (a lone string is one item).

    Raises:
        ValueError: any violation (422).
    """
    text = parse_text_input(required(obj, "inputs"), "inputs")
    p = get_object(obj, "parameters")
    kwargs, _ = parse_sampling(p, top_k=NATIVE_TOP_K, top_p=NATIVE_TOP_P)
    kwargs["stop"] = parse_stop(p.get("stop"), max_items=STOP_COUNT_MAX)
    kwargs["structured"] = parse_tgi_grammar(p.get("grammar"))  # spec §3.2, §5.5
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
    if decoder_input_details:  # the prefill tokens' logprobs (no alternatives)
        kwargs["prompt_logprobs"] = 0
    return TgiBody(text, SamplingParams(**kwargs), details, decoder_input_details,
                   return_full_text, truncate)


def tgi_prefill(ids: tuple[int, ...], entries: tuple[TokenLogprob | None, ...] | None,
                text_of: Callable[[int], str]) -> list[dict[str, Any]]:
    """``details.prefill`` with ``decoder_input_details`` (TGI ``PrefillToken``): one
    ``{id, logprob, special, text}`` per prompt token, ``logprob`` null for the first.
    [I] MindIE leaves ``logprob`` and ``text`` null (spec §3.3 [V]); we compute them as
    TGI does (``special`` stays null, as MindIE's).

    Raises:
        ValueError: ``entries`` is None (the engine did not compute them)."""
    if entries is None:
        raise ValueError("the prompt's log-probabilities were not computed")
    return [{"id": i, "logprob": None if e is None else max(e.logprob, -9999.0),
             "special": None, "text": text_of(i)} for i, e in zip(ids, entries, strict=True)]


def tgi_answer(got: Collected, greq: GenerateRequest, body: TgiBody,
               prefill: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The non-stream answer (spec §3.3), before ``POST /`` wraps it in an array;
    ``prefill``: :func:`tgi_prefill` with ``decoder_input_details``."""
    last = got.last
    result: dict[str, Any] = {}
    if body.details or body.decoder_input_details:
        result["details"] = {
            "prompt_tokens": len(greq.prompt_token_ids),
            "finish_reason": mindie_finish_reason(last.finish_reason),
            "generated_tokens": last.num_output_tokens,
            "prefill": prefill or [],
            "seed": reported_seed(last, greq),
            "tokens": [{"id": i, **_NULL_TOKEN} for i in got.ids],
        }
    result["generated_text"] = body.prefix + got.text
    return result


def tgi_token_event(out: RequestOutput) -> dict[str, Any]:
    """A stream event carrying ``out``'s new tokens (spec §3.4)."""
    return {
        "token": {"id": list(out.new_token_ids), "text": out.new_text,
                  "logprob": None, "special": None},
        "generated_text": None,
        "details": None,
    }


def tgi_stream_details(out: RequestOutput, greq: GenerateRequest) -> dict[str, Any]:
    """The ``details`` of a stream's last event (spec §3.4)."""
    return {
        "prompt_tokens": len(greq.prompt_token_ids),
        "finish_reason": mindie_finish_reason(out.finish_reason),
        "generated_tokens": out.num_output_tokens,
        "seed": reported_seed(out, greq),
    }


def tgi_info(info: EngineInfo) -> dict[str, Any]:
    """``GET /info`` (spec §3.5).

    [I] ``model_device_type`` is the device the model runs on (MindIE: always npu);
    ``model_dtype`` the dtype the weights are served in; ``max_input_length`` is
    ``max_model_len - 1`` (the prompt must leave room for one token)."""
    return {
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
    }
