"""``tokenserve bench --response-format json-schema``: every request constrained to one
JSON schema, in each backend's own field, so the cost of constraints shows next to the
same workload unconstrained.

The schema (:data:`BENCH_SCHEMA`: an object holding an array of order objects with
strings, integers, numbers and enums) needs at least :data:`MIN_ORDERS` orders, so it
cannot complete within any bench ``--output-len`` we run: the constrained requests
generate exactly as many tokens as the unconstrained ones (with ``ignore_eos``), all
under the mask.
"""

from __future__ import annotations

import json
from typing import Any

#: "orders" needs this many items: ~40 tokens each, so the grammar never completes early
MIN_ORDERS = 64
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 40},
        "orders": {
            "type": "array", "minItems": MIN_ORDERS,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "item": {"type": "string", "maxLength": 30},
                    "price": {"type": "number"},
                    "status": {"enum": ["open", "shipped", "closed"]},
                },
                "required": ["id", "item", "price", "status"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["customer", "orders"],
    "additionalProperties": False,
}
RESPONSE_FORMATS = ("text", "json-schema")


def add_response_format(backend: str, body: dict[str, Any],
                        schema: dict[str, Any] = BENCH_SCHEMA) -> None:
    """Add ``schema`` to a request ``body`` of ``backend`` in that family's field
    (OpenAI ``response_format``, vLLM ``guided_json``, TGI ``parameters.grammar``, MindIE
    and Triton ``parameters.response_format``, llama.cpp ``json_schema``), in place.

    Raises:
        ValueError: a backend with no such field.
    """
    fmt = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    if backend in ("openai", "openai-chat"):
        body["response_format"] = fmt
    elif backend == "vllm":
        body["guided_json"] = schema
    elif backend == "tgi":
        body["parameters"]["grammar"] = {"type": "json", "value": schema}
    elif backend in ("mindie", "mindie-text", "triton"):
        body["parameters"]["response_format"] = fmt
    elif backend == "llamacpp":
        body["json_schema"] = schema
    else:
        raise ValueError(f"backend {backend} has no structured-output field")


def structured_output(response_format: str):
    """The engine-side constraint of ``--response-format`` (None for ``text``)."""
    if response_format == "text":
        return None
    from tokenserve.sampling_params import ConstraintKind, StructuredOutput

    return StructuredOutput(ConstraintKind.JSON_SCHEMA, json.dumps(BENCH_SCHEMA))


def mask_counters_from_metrics(text: str) -> tuple[float, int] | None:
    """(mask ms, steps with a constrained row) from a tokenserve ``/metrics`` page, or
    None when it has no such counters (another server)."""
    vals: dict[str, float] = {}
    for line in text.splitlines():
        for key in ("structured_output_mask_ms_total", "structured_output_mask_steps_total"):
            if line.startswith(key):
                vals[key] = float(line.rsplit(" ", 1)[1])
    if len(vals) != 2:
        return None
    return vals["structured_output_mask_ms_total"], int(vals["structured_output_mask_steps_total"])
