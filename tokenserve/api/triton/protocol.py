"""Request parsing of the Triton family (spec/interfaces.md §6.3, §6.4), by Triton's own
rules (§8: temperature (0, inf), top_k [0, 2^31), top_p (0, 1] -- never the native ones).

[I] ``/infer`` bodies may use Triton's binary tensor extension (``tritonclient``'s
default): an input with ``parameters.binary_data_size`` takes its little-endian UINT32
data from the bytes after the JSON header; parameters are read at the top level
(``tritonclient``) and inside ``inputs[0]`` (MindIE), inside winning.
"""

# ValueError, not TypeError, is the contract of every parser here (the family answers 422).
# ruff: noqa: TRY004

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenserve.api.fields import (
    INT32_MAX,
    MAX_TIMEOUT_S,
    MAX_TOKENS_NUM,
    Bounds,
    check_id,
    check_token_ids,
    get_bool,
    get_int,
    get_object,
    parse_sampling,
)
from tokenserve.api.structured import parse_response_format
from tokenserve.sampling_params import SamplingParams

#: spec §6.3 / §8: ``top_k`` [0, 2^31-1], ``top_p`` (0, 1] (1.0 is valid here).
TRITON_TOP_K = Bounds(0, INT32_MAX)
TRITON_TOP_P = Bounds(0.0, 1.0, lo_open=True)


@dataclass(frozen=True)
class TritonParams:
    """Validated Triton ``parameters`` (spec §6.3)."""

    sampling: SamplingParams
    priority: int
    timeout_s: float | None
    details: bool


def parse_parameters(p: dict[str, Any], *, typical_p: bool) -> TritonParams:
    """spec §6.3 ranges (``typical_p`` only on generate; /infer ignores it, §6.4).
    ``do_sample`` [I]: explicit wins, else sample iff temperature/top_k/top_p given."""
    kw, priority = parse_sampling(p, top_k=TRITON_TOP_K, top_p=TRITON_TOP_P,
                                  typical_p=typical_p, priority=True)
    details = get_bool(p, "details", False)
    get_int(p, "batch_size", 0, INT32_MAX, lo_open=True)
    timeout = get_int(p, "timeout", 0, MAX_TIMEOUT_S, lo_open=True)
    # [I] MindIE's response_format (spec §1.1, §5.5), as on the native family
    kw["structured"] = parse_response_format(p.get("response_format"))
    return TritonParams(SamplingParams(**kw), priority or 5,
                        float(timeout) if timeout is not None else None, bool(details))


def parse_id(obj: dict[str, Any]) -> str | None:
    """The optional request ``id`` (spec §6.3: ``^[a-zA-Z0-9_-]{1,256}$``)."""
    rid = obj.get("id")
    return None if rid is None else check_id(rid)


def parse_triton_text(value: Any) -> str:
    """``text_input``: a non-empty string, or a list of ``{"type": "text"}`` parts
    (media parts are rejected: the models we serve are text-only [I])."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value:
        texts = []
        for item in value:
            if not isinstance(item, dict) or item.get("type") != "text":
                raise ValueError("Only text elements are supported in text_input.")
            if not isinstance(item.get("text"), str):
                raise ValueError("The text of a text element in text_input must be a string.")
            texts.append(item["text"])
        if "".join(texts):
            return "".join(texts)
    raise ValueError("Parameter text_input must be a non-empty string or a list.")


@dataclass(frozen=True)
class TritonInferBody:
    """A validated ``/infer`` body (spec §6.4)."""

    id: str | None
    input_ids: list[int]
    params: TritonParams
    output_name: str
    binary_output: bool


def _tensor_ids(inp: dict[str, Any], binary: bytes, vocab_size: int) -> list[int]:
    shape = inp.get("shape")
    if (not isinstance(shape, list) or len(shape) not in (1, 2)
            or not all(type(d) is int for d in shape) or (len(shape) == 2 and shape[0] != 1)):
        raise ValueError("Parameter shape must be [n] or [1, n].")
    n = shape[-1]
    if not 0 < n <= MAX_TOKENS_NUM:
        raise ValueError(f"Parameter shape must have 0 < n <= {MAX_TOKENS_NUM}, got {n}.")
    if inp.get("datatype") != "UINT32":
        raise ValueError("Parameter datatype must be UINT32.")
    size = get_int(get_object(inp, "parameters"), "binary_data_size", 0)
    if size is not None:
        if size != 4 * n or len(binary) != size:
            raise ValueError(f"Binary data of input must be {4 * n} bytes for shape {shape}.")
        data: Any = np.frombuffer(binary, dtype="<u4").tolist()
    else:
        data = inp.get("data")
        if isinstance(data, list) and len(data) == 1 and isinstance(data[0], list):
            data = data[0]  # [I] nested [[...]] for shape [1, n]
        if not isinstance(data, list) or len(data) != n:
            raise ValueError(f"Parameter data must be an array of {n} elements.")
    return check_token_ids(data, vocab_size, "data")


def parse_triton_infer_body(
    obj: dict[str, Any], binary: bytes, vocab_size: int
) -> TritonInferBody:
    """Validate an ``/infer`` body (spec §6.4 rules; [I] top-level parameters too)."""
    rid = parse_id(obj)
    inputs = obj.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise ValueError("Parameter inputs must be an array of exactly one input.")
    inp = inputs[0]
    name = inp.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 256:
        raise ValueError("Parameter name of the input must be a string of 1..256 characters.")
    ids = _tensor_ids(inp, binary, vocab_size)
    top = get_object(obj, "parameters")
    params = parse_parameters({**top, **get_object(inp, "parameters")}, typical_p=False)
    binary_output = bool(get_bool(top, "binary_data_output", False))
    output_name = "output0"
    outputs = obj.get("outputs")
    if outputs is not None:  # [I] tritonclient omits it
        if (not isinstance(outputs, list) or len(outputs) != len(inputs)
                or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                           for o in outputs)):
            raise ValueError("Parameter outputs must be an array of one {\"name\": str}.")
        output_name = outputs[0]["name"]
        binary_output = bool(get_bool(get_object(outputs[0], "parameters"), "binary_data",
                                      binary_output))
    return TritonInferBody(rid, ids, params, output_name, binary_output)


def triton_text_output(rid: str, model_name: str, text: str) -> dict[str, Any]:
    """A generate answer or stream event (spec §6.3), before its ``details``."""
    return {"id": rid, "model_name": model_name, "model_version": None, "text_output": text}
