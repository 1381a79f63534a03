"""MindIE native family: the ``/infer`` body and its validation, and the answer's pieces
(spec/interfaces.md §2.1).

Response shapes (spec §2.1)::

    non-stream  {"generated_text": "...", "details"?: {"finish_reason", "generated_tokens",
                 "generated_token_ids", "seed"}}
    stream      data: {"prefill_time": 45, "decode_time": null, "token": {"id": [..], "text": ".."}}
                data: {"prefill_time": null, "decode_time": 17, "token": {...}}
                data: {..., "generated_text": "<all>", "details": {..}|null,
                       "token": {"id": [last ids], "text": null}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenserve.api.family_api import Collected, mindie_finish_reason, reported_seed
from tokenserve.api.fields import (
    MAX_TIMEOUT_S,
    MEDIA_TYPES,
    NATIVE_TOP_K,
    NATIVE_TOP_P,
    check_token_ids,
    get_bool,
    get_int,
    get_object,
    parse_sampling,
    parse_text_input,
)
from tokenserve.api.structured import parse_response_format
from tokenserve.messages import GenerateRequest, RequestOutput
from tokenserve.sampling_params import SamplingParams

#: spec §1.5: at most this many media items in a multimodal ``inputs`` list; they are
#: counted and checked, then refused (the models we serve are text-only [I]).
MAX_MEDIA_ITEMS = 20


@dataclass(frozen=True)
class MindieBody:
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


def parse_mindie_body(obj: dict[str, Any], vocab_size: int) -> MindieBody:
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
        text = parse_text_input(obj["inputs"], "inputs", media_types=MEDIA_TYPES,
                                max_media=MAX_MEDIA_ITEMS)
    ids = check_token_ids(obj["input_id"], vocab_size, "input_id") if has_ids else None

    stream = get_bool(obj, "stream", False)
    p = get_object(obj, "parameters")
    kwargs, priority = parse_sampling(p, top_k=NATIVE_TOP_K, top_p=NATIVE_TOP_P, priority=True)
    # spec §1.1 response_format (a JSON string; [I] or an object), the OpenAI shape (§5.5)
    kwargs["structured"] = parse_response_format(p.get("response_format"),
                                                 name="response_format")
    timeout = get_int(p, "timeout", 0, MAX_TIMEOUT_S, lo_open=True)
    details = get_bool(p, "details", False)
    return MindieBody(
        text=text,
        input_ids=ids,
        stream=bool(stream),
        details=bool(details),
        params=SamplingParams(**kwargs),
        priority=priority if priority is not None else 5,
        timeout_s=float(timeout) if timeout is not None else None,
    )


def mindie_answer(got: Collected, greq: GenerateRequest, details: bool) -> dict[str, Any]:
    """The non-stream answer (spec §2.1)."""
    last = got.last
    result: dict[str, Any] = {"generated_text": got.text}
    if details:
        result["details"] = {
            "finish_reason": mindie_finish_reason(last.finish_reason),
            "generated_tokens": last.num_output_tokens,
            "generated_token_ids": got.ids,
            "seed": reported_seed(last, greq),
        }
    return result


def mindie_stream_details(out: RequestOutput, greq: GenerateRequest) -> dict[str, Any]:
    """The ``details`` of a stream's last event (spec §2.1)."""
    return {
        "finish_reason": mindie_finish_reason(out.finish_reason),
        "generated_tokens": out.num_output_tokens,
        "seed": reported_seed(out, greq),
    }


def mindie_token(out: RequestOutput) -> dict[str, Any]:
    """A stream event's ``token``: ``out``'s new ids and text (spec §2.1)."""
    return {"id": list(out.new_token_ids), "text": out.new_text}
