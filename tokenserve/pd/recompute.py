"""The recompute body (spec/pd_disaggregation.md §7.2, §7.4): how a request evicted from a
decode instance (or lost with it) is sent to a prefill instance again.

The prompt history travels as the comma-separated decimal string ``"L,p1,..,pL,o1,..,oK"``
(L prompt token ids, then the K output tokens already delivered to the client) in the
family's prompt field. [I] Unlike MindIE, which rebuilds each family's body from its
parameters, we keep the client's ORIGINAL body and replace only the prompt field; the
original prompt value travels in ``origin_inputs`` (MindIE does that for TGI and vLLM; we
do it for every family), so the prefill instance validates and renders exactly what the
client sent. The prompt field of each route is the route table's ``prompt`` column
(:mod:`tokenserve.api.routes`); Triton ``/infer`` carries the history as
``inputs[0].data = [L, p.., o..]`` (UINT32) with ``origin_inputs`` the original ``inputs[0]``,
and a native body that used ``input_id`` moves it to ``origin_inputs`` (``origin_field``).
"""

from __future__ import annotations

import copy
from typing import Any

from tokenserve.api.routes import BY_NAME, Family, Route, inference_route

_TRITON_INFER = BY_NAME["triton.infer"]

#: where the original prompt value is kept (spec §7.2, TGI/vLLM ``origin_inputs``).
ORIGIN = "origin_inputs"
#: [I] the binary tensor bytes that followed a Triton infer body's JSON (the
#: ``Inference-Header-Content-Length`` extension, spec/interfaces.md §6.4), base64: a
#: recompute body is JSON, P puts them back after the restored JSON
ORIGIN_BINARY = "origin_binary"
#: [I] the logprobs of the output tokens of the history (``DecodeParameters``'
#: ``firstTokenLogprobs`` encoding), when the request asked for them: the recomputing P
#: puts them on its replay output, so a non-stream answer lists every token's
ORIGIN_LOGPROBS = "origin_logprobs"
#: [I] for /infer bodies that used ``input_id``: which field held the original prompt.
ORIGIN_FIELD = "origin_field"


def prompt_field(path: str, body: dict[str, Any]) -> str:
    """The name of ``body``'s prompt field for the inference route at ``path`` (the route
    table's ``prompt`` column; ``/generate``: ``prompt`` when non-null, else ``inputs``).

    Raises:
        ValueError: ``path`` is not an inference route.
    """
    return _prompt_field(_route(path), body)


def _prompt_field(route: Route, body: dict[str, Any]) -> str:
    if route.family is Family.GENERATE and body.get("prompt") is None:
        return "inputs"
    return route.resolve(body).prompt


def _route(path: str) -> Route:
    route = inference_route("POST", path)
    if route is None:
        raise ValueError(f"{path} is not an inference route")
    return route


def encode_history(prompt_ids: list[int], output_ids: list[int]) -> str:
    """``"L,p1,..,pL,o1,..,oK"`` (spec §7.2)."""
    return ",".join(map(str, [len(prompt_ids), *prompt_ids, *output_ids]))


def decode_history(value: Any) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids) from ``"L,p..,o.."`` or the Triton list ``[L, p.., o..]``.

    Raises:
        ValueError: not that shape (non-integers, L < 1 or longer than the list).
    """
    if isinstance(value, str):
        try:
            nums = [int(x) for x in value.split(",")]
        except ValueError:
            raise ValueError("recompute prompt must be 'L,p1,...,pL,o1,...'") from None
    elif isinstance(value, list) and all(type(x) is int for x in value):
        nums = list(value)
    else:
        raise ValueError("recompute prompt must be 'L,p1,...,pL,o1,...'")
    if not nums or not 1 <= nums[0] <= len(nums) - 1 or any(x < 0 for x in nums):
        raise ValueError("recompute prompt must be 'L,p1,...,pL,o1,...' with 1 <= L")
    n = nums[0]
    return nums[1:1 + n], nums[1 + n:]


def build_recompute_body(path: str, body: dict[str, Any], history: list[int],
                         num_prompt: int) -> dict[str, Any]:
    """The recompute body for the client's original ``body`` at ``path``: prompt field =
    ``"L,..."`` of ``history`` (prompt ids then delivered output ids; the first
    ``num_prompt`` are the prompt), original prompt kept in ``origin_inputs``.

    Raises:
        ValueError: not an inference route, or ``num_prompt`` outside ``[1, len(history)]``.
    """
    if not 1 <= num_prompt <= len(history):
        raise ValueError(f"num_prompt {num_prompt} outside [1, {len(history)}]")
    route = _route(path)
    field = _prompt_field(route, body)
    out = copy.deepcopy(body)
    prompt, outputs = history[:num_prompt], history[num_prompt:]
    if route is _TRITON_INFER:
        inputs = out.get("inputs")
        if not (isinstance(inputs, list) and inputs and isinstance(inputs[0], dict)):
            raise ValueError("Triton infer body without inputs[0]")
        out[ORIGIN] = copy.deepcopy(inputs[0])
        data = [num_prompt, *prompt, *outputs]
        inputs[0]["data"] = data
        inputs[0]["shape"] = [1, len(data)]
        return out
    if route.family is Family.MINDIE and "input_id" in out \
            and out.get("inputs") is None:
        out[ORIGIN] = out.pop("input_id")
        out[ORIGIN_FIELD] = "input_id"
    else:
        out[ORIGIN] = out.get(field)
    out[field] = encode_history(prompt, outputs)
    return out


def parse_recompute_body(path: str, body: dict[str, Any]
                         ) -> tuple[dict[str, Any], list[int], list[int]]:
    """Undo :func:`build_recompute_body`: (the original body, prompt ids, output ids).

    Raises:
        ValueError: no ``origin_inputs``, or the prompt field is not ``"L,..."``.
    """
    if ORIGIN not in body:
        raise ValueError(f"recompute body must carry {ORIGIN}")
    route = _route(path)
    field = _prompt_field(route, body)
    out = copy.deepcopy(body)
    origin = out.pop(ORIGIN)
    if route is _TRITON_INFER:
        inputs = out.get("inputs")
        if not (isinstance(inputs, list) and inputs and isinstance(inputs[0], dict)):
            raise ValueError("Triton infer body without inputs[0]")
        prompt, outputs = decode_history(inputs[0].get("data"))
        if not isinstance(origin, dict):
            raise ValueError(f"{ORIGIN} of a Triton infer body must be its inputs[0]")
        inputs[0] = origin
        return out, prompt, outputs
    prompt, outputs = decode_history(out.get(field))
    if out.pop(ORIGIN_FIELD, None) == "input_id":
        del out[field]
        out["input_id"] = origin
    else:
        out[field] = origin
    return out, prompt, outputs
