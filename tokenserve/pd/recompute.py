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
and a body that used one of its family's prompt aliases (:mod:`tokenserve.api.families`:
a native body's ``input_id``) moves it to ``origin_inputs`` (``origin_field``).

:class:`RecomputeBody` is the message (D's ``retry:`` body, the coordinator's body after a
lost D, what P reads under ``is-recompute: true``); :func:`build_recompute_body` and
:func:`parse_recompute_body` are its prompt-field rewrite. The history's own codec is
:class:`tokenserve.pd.messages.History`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import orjson

from tokenserve.api.families import FAMILIES
from tokenserve.api.routes import BY_NAME, Family, Route, inference_route
from tokenserve.messages import TokenLogprob
from tokenserve.pd.messages import (
    History,
    WireError,
    b64_bytes,
    b64_text,
    decode_logprobs,
    encode_logprobs,
)

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


def _aliases(route: Route) -> tuple[str, ...]:
    """The fields that may hold ``route``'s prompt instead of its own: its family's
    description's (MindIE ``input_id``); none for ``/generate``."""
    desc = FAMILIES.get(route.family)
    return desc.prompt_aliases if desc is not None else ()


def _route(path: str) -> Route:
    route = inference_route("POST", path)
    if route is None:
        raise ValueError(f"{path} is not an inference route")
    return route


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
    h = History(tuple(history[:num_prompt]), tuple(history[num_prompt:]))
    if route is _TRITON_INFER:
        inputs = out.get("inputs")
        if not (isinstance(inputs, list) and inputs and isinstance(inputs[0], dict)):
            raise ValueError("Triton infer body without inputs[0]")
        out[ORIGIN] = copy.deepcopy(inputs[0])
        data = h.numbers()
        inputs[0]["data"] = data
        inputs[0]["shape"] = [1, len(data)]
        return out
    alias = next((a for a in _aliases(route) if a in out), None)
    if alias is not None and out.get(field) is None:
        out[ORIGIN] = out.pop(alias)
        out[ORIGIN_FIELD] = alias
    else:
        out[ORIGIN] = out.get(field)
    out[field] = h.encode()
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
        h = History.decode(inputs[0].get("data"))
        if not isinstance(origin, dict):
            raise ValueError(f"{ORIGIN} of a Triton infer body must be its inputs[0]")
        inputs[0] = origin
        return out, list(h.prompt), list(h.outputs)
    h = History.decode(out.get(field))
    alias = out.pop(ORIGIN_FIELD, None)
    if alias in _aliases(route):
        del out[field]
        out[alias] = origin
    else:
        out[field] = origin
    return out, list(h.prompt), list(h.outputs)


@dataclass(frozen=True)
class RecomputeBody:
    """A recompute body (§7.2, module docstring) as a message.

    Attributes:
        original: the client's JSON body as it sent it (its binary tail apart).
        history: the prompt's ids and the output ids the client already has.
        binary: [I] ``origin_binary``: the bytes that followed the JSON (Triton's
            ``Inference-Header-Content-Length`` extension); ``b""``: none.
        logprobs: [I] ``origin_logprobs``: one entry per ``history.outputs``
            (:func:`~tokenserve.pd.messages.encode_logprobs`), when the request asked.
    """

    original: dict[str, Any]
    history: History
    binary: bytes = b""
    logprobs: tuple[TokenLogprob, ...] | None = None

    def encode(self, path: str) -> bytes:
        """The JSON body for the inference route at ``path``.

        Raises:
            ValueError: ``path`` is not an inference route, or ``original`` cannot carry
                a history (a Triton infer body without ``inputs[0]``).
        """
        h = self.history
        out = build_recompute_body(path, self.original, [*h.prompt, *h.outputs],
                                   len(h.prompt))
        if self.binary:
            out[ORIGIN_BINARY] = b64_text(self.binary)
        if self.logprobs is not None:
            out[ORIGIN_LOGPROBS] = encode_logprobs(self.logprobs)
        return orjson.dumps(out)

    @staticmethod
    def decode(path: str, body: dict[str, Any]) -> RecomputeBody:
        """The inverse of :meth:`encode`, from the parsed JSON ``body``.

        Raises:
            ValueError: no ``origin_inputs``, a prompt field that is not ``"L,..."``, a
                malformed ``origin_binary`` / ``origin_logprobs``, or not one logprob
                entry per output token (P answers 422).
        """
        restored, prompt, outputs = parse_recompute_body(path, body)
        binary = restored.pop(ORIGIN_BINARY, None)
        logprobs = decode_logprobs(restored.pop(ORIGIN_LOGPROBS, None), ORIGIN_LOGPROBS,
                                   nulls=False)
        if logprobs is not None and len(logprobs) != len(outputs):
            raise WireError(f"{ORIGIN_LOGPROBS} must hold one entry per output token")
        return RecomputeBody(restored, History(tuple(prompt), tuple(outputs)),
                             b64_bytes(binary, ORIGIN_BINARY) if binary is not None else b"",
                             logprobs)  # type: ignore[arg-type]  # no null entries
