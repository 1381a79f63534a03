"""The prefill (P) side of PD disaggregation (spec/pd_disaggregation.md §4, §5, §7.4).

An inference request from the coordinator carries ``req-type: prefill``, ``req-id``,
``d-target`` (and ``is-recompute: true`` on a resubmission). :func:`prefill_gate` checks
them in the spec's order (§4.2); then the family's own handler runs unchanged, writing into
a :class:`~tokenserve.pd.sinks.CaptureResponse`, with a :class:`PrefillObserver` on the
engine side::

    handler admits its engine request   -> observer: id = req-id, prefill_only (+ the
                                           recompute history, §7.4)
    engine: prefill, first token, park  -> handler renders the first output (captured)
    handler waits for the next output   -> observer: POST the decode request to D (§5.2),
                                           raise RequestHandedOff (the request stays parked)
    P answers the coordinator           -> {"reqId","isStream","isLastResp","output"} (§5.3)

A request that finishes on P (EOS or max_new_tokens on the first token) never goes to D:
P answers ``isLastResp: true`` with the whole output. D pulls the parked KV blocks and then
calls ``POST /v1/pd/release`` (management plane); P frees them then, or after
``kv_trans_timeout``.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import logging
import re
import time
from dataclasses import replace
from typing import Any

import orjson

from tokenserve.api.common import parse_json_object
from tokenserve.api.engine_stream import RequestHandedOff, observed
from tokenserve.api.ids import derived_id
from tokenserve.api.routes import path_of
from tokenserve.api.triton.handlers import BINARY_HEADER
from tokenserve.messages import (
    GenerateRequest,
    KvAdoption,
    KvHandoff,
    RequestOutput,
    TokenLogprob,
)
from tokenserve.pd.node import PD_ONE_SEQUENCE, PdNode, RoleStatus, inter_comm_url
from tokenserve.pd.recompute import ORIGIN_BINARY, ORIGIN_LOGPROBS, parse_recompute_body
from tokenserve.pd.sinks import CaptureResponse
from tokenserve.pd.wire import WholeAnswer
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError
from tokenserve.transport.router import Handler

logger = logging.getLogger(__name__)

_HEX = re.compile(r"[0-9a-fA-F]+")
MAX_REQ_ID = 1024
#: hop-by-hop and PD headers not carried to D with the request
_DROP_HEADERS = frozenset({"connection", "content-length", "transfer-encoding", "keep-alive",
                           "req-type", "req-id", "d-target", "d-port", "is-recompute", "host"})


def prefill_gate(node: PdNode, headers: dict[str, str]) -> tuple[str, str, bool]:
    """spec §4.2 checks, in order; returns (req-id, d-target, is-recompute).

    Raises:
        HttpError: 503 (unknown role status) or 400 with the spec's messages.
    """
    if node.role_status is RoleStatus.UNKNOWN or node.role is None:
        raise HttpError(503, "The server cannot process the inference request due to an "
                        "unknown status. ")
    if not node.is_prefill:
        raise HttpError(400, "DMI inference requests can be sent only to the prefill node "
                        "or p_percentage of the flex node == 0")
    req_type, req_id, target = (headers.get("req-type"), headers.get("req-id"),
                                headers.get("d-target"))
    if req_type is None or req_id is None or target is None:
        raise HttpError(400, "DMI request must have req-type, req-id, d-target headers")
    if not _HEX.fullmatch(req_id):
        raise HttpError(400, "Invalid req-id, the character of req-id should be hex char "
                        f"[0-9, a-f, A-F], but got {req_id}")
    if len(req_id) > MAX_REQ_ID:
        raise HttpError(400, f"The length of req-id cannot exceed {MAX_REQ_ID}")
    if req_type != "prefill":
        raise HttpError(400, f"Parameter req-type must be prefill but got {req_type}")
    try:
        ipaddress.ip_address(target.partition(";")[0])
    except ValueError:
        raise HttpError(400, "Parameter d-target must be an IPv4 address") from None
    recompute = headers.get("is-recompute")
    if recompute not in (None, "true", "false"):
        raise HttpError(400, "Parameter is-recompute is an optional parameter. When it is "
                        "set, it must be true or false.")
    return req_id, target, recompute == "true"


class PrefillObserver:
    """The engine side of one P request (see the module docstring)."""

    def __init__(self, node: PdNode, req_id: str, target: str, request: HttpRequest,
                 body: bytes,
                 history: tuple[list[int], list[int], tuple[TokenLogprob, ...] | None] | None,
                 sink: CaptureResponse) -> None:
        self.node = node
        self.sink = sink
        # recompute: the client already has what the handler writes before the replay
        # ends (e.g. OpenAI's role chunk)
        sink.muted = history is not None
        self.req_id = req_id
        self.target = target
        self.request = request
        self.body = body  # what D renders from: the client's body (recompute: restored)
        self.history = history
        self.greq: GenerateRequest | None = None
        self.output_ids: list[int] = []  # every output token so far (replayed included)
        self.delivered = 0  # of which already shown to the client before this P
        self.text = ""  # text this P rendered (postsingletext)
        self.handoff: KvHandoff | None = None
        self.num_cached_tokens = 0
        #: the prompt's logprobs when the request asked (handed to D with the request)
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        #: the logprobs of the tokens this P generated, when the request asked
        self.output_logprobs: list[TokenLogprob] = []
        self.handed_off = False
        self.error: str | None = None
        self.ids_given = 0  # response ids handed to the handler (derived_id)

    def admit(self, greq: GenerateRequest) -> GenerateRequest:
        if self.greq is not None:
            raise HttpError(422, PD_ONE_SEQUENCE)
        prompt = greq.prompt_token_ids
        adopt = None
        if self.history is not None:
            prompt = tuple(self.history[0])
            adopt = KvAdoption(tuple(self.history[1]), output_logprobs=self.history[2])
            self.delivered = len(self.history[1])
        self.greq = replace(greq, request_id=self.req_id, prompt_token_ids=prompt,
                            prefill_only=True, adopt=adopt)
        return self.greq

    def response_id(self, fresh: str) -> str:
        self.ids_given += 1
        return derived_id(self.req_id, self.ids_given)

    def on_output(self, out: RequestOutput) -> None:
        self.sink.muted = out.replay  # recompute: the client has these tokens' text
        self.output_ids.extend(out.new_token_ids)
        if not out.replay:
            self.text += out.new_text
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if not out.replay:
            self.output_logprobs.extend(out.logprobs or ())
        if out.handoff is not None:
            self.handoff = out.handoff
            self.num_cached_tokens = out.num_cached_tokens

    async def before_wait(self) -> None:
        if self.handoff is None or self.handed_off:
            return
        self.handed_off = True
        try:
            await self._send_decode()
        except Exception as exc:  # noqa: BLE001 - any failure: 500 to the coordinator
            self.error = f"[P Node] Send D request failed:{exc}"
            logger.warning("request %s: %s", self.req_id, self.error)
            self.node.engine.release(self.req_id)
        raise RequestHandedOff()

    def decode_parameters(self) -> dict[str, Any]:
        """Our ``DecodeParameters`` (spec §5.2 field names where one exists)."""
        assert self.greq is not None and self.handoff is not None
        h, g, node = self.handoff, self.greq, self.node
        kv = node.kv.descriptor().to_dict() if node.kv is not None else None
        headers = {k: v for k, v in self.request.headers.items() if k not in _DROP_HEADERS}
        return {
            "reqId": self.req_id,
            "tokens": list(g.prompt_token_ids),
            "firstToken": self.output_ids,
            "method": self.request.method,
            "path": self.request.path,
            "query": self.request.query,
            "headers": headers,
            **_client_body(self.body),
            "generatorState": (base64.b64encode(h.generator_state).decode()
                               if h.generator_state is not None else None),
            "numComputed": h.num_computed,
            "seed": g.params.seed,
            "prefixCachedTokenNums": self.num_cached_tokens,
            "blockTable": [list(h.block_table)],
            "pNodeAddr": node.address,
            "kv": kv,
            "postsingletext": self.text,
            "prefillTokenNum": len(self.output_ids) - self.delivered,
            "preOutputTokenNum": self.delivered,
            "e2eStartTime": int(time.time() * 1e6),
            # ours [I]: the prompt's logprobs (echo / prompt_logprobs /
            # decoder_input_details), so D's answer carries them as a mixed server's
            "promptLogprobs": encode_prompt_logprobs(self.prompt_logprobs),
            # ours [I]: the logprobs of firstToken (when asked; a recompute: its history's
            # entries first, as the recompute body carried them)
            "firstTokenLogprobs": encode_prompt_logprobs(self._all_output_logprobs()),
        }

    def _all_output_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The logprobs of every one of ``output_ids`` (a recompute's history first, as
        the recompute body carried them), or None when they are not all known."""
        history = () if not self.delivered else (
            self.history[2] if self.history is not None else None)
        if history is None:
            return None
        out = (*history, *self.output_logprobs)
        return out if out and len(out) == len(self.output_ids) else None

    async def _send_decode(self) -> None:
        url = inter_comm_url(self.target, path_of("pd.decode"))
        t0 = time.perf_counter()
        r = await self.node.http().post(url, content=orjson.dumps(self.decode_parameters()),
                                        headers={"content-type": "application/json"})
        logger.debug("request %s handed to %s in %.1f ms", self.req_id, self.target,
                     (time.perf_counter() - t0) * 1e3)
        if r.status_code != 200:
            raise RuntimeError(f"D answered {r.status_code}: {r.text[:200]}")
        ans = r.json()
        if not ans.get("isValidDecodeParameters"):
            raise RuntimeError(ans.get("errorMessage") or "D refused the request")


def _binary_tail(restored: dict[str, Any]) -> bytes:
    """The binary tensor bytes a restored recompute body carries in ``origin_binary``
    (removed from it; :data:`~tokenserve.pd.recompute.ORIGIN_BINARY`), else ``b""``.

    Raises:
        HttpError: 422, a malformed ``origin_binary``.
    """
    b64 = restored.pop(ORIGIN_BINARY, None)
    if b64 is None:
        return b""
    try:
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, TypeError, ValueError) as exc:
        raise HttpError(422, f"bad {ORIGIN_BINARY}: {exc}") from None


def _client_body(body: bytes) -> dict[str, str]:
    """``DecodeParameters.body`` (the client's body as text) or, for bytes that are not
    UTF-8 (Triton's binary tensors, spec/interfaces.md §6.4), ``bodyB64`` [I]: base64."""
    try:
        return {"body": body.decode("utf-8")}
    except UnicodeDecodeError:
        return {"bodyB64": base64.b64encode(body).decode()}


def encode_prompt_logprobs(entries: tuple[TokenLogprob | None, ...] | None
                           ) -> list[Any] | None:
    """``DecodeParameters.promptLogprobs`` and ``firstTokenLogprobs`` [I]: per token null
    (the prompt's first) or ``[token_id, logprob, rank, [[id, logprob], ...]]``; None when
    there are none. JSON floats round-trip exactly, so D answers the bits P computed."""
    if entries is None:
        return None
    return [None if e is None else [e.token_id, e.logprob, e.rank, [list(t) for t in e.top]]
            for e in entries]


def decode_prompt_logprobs(value: Any) -> tuple[TokenLogprob | None, ...] | None:
    """The inverse of :func:`encode_prompt_logprobs`.

    Raises:
        ValueError: a malformed value."""
    if value is None:
        return None
    try:
        return tuple(None if e is None else TokenLogprob(
            int(e[0]), float(e[1]), tuple((int(t), float(lp)) for t, lp in e[3]), int(e[2]))
            for e in value)
    except (TypeError, IndexError, ValueError) as exc:
        raise ValueError(f"bad promptLogprobs: {exc}") from None


def _answer(req_id: str, sink: CaptureResponse, *, last: bool) -> bytes:
    """spec §5.3 body, key order reqId, isStream, isLastResp, output."""
    body: dict[str, Any] = {"reqId": req_id, "isStream": sink.is_stream}
    if sink.is_stream or last:
        body["isLastResp"] = last
        body["output"] = sink.text
    if last and not sink.is_stream and WholeAnswer.needed(sink.content_type, sink.headers):
        # [I] an answer that is not JSON text (Triton's binary tensors): its bytes,
        # content type and headers, base64 (the coordinator sends them as they are)
        body["outputBytes"] = WholeAnswer(sink.content_type, sink.headers,
                                          b"".join(sink.chunks)).encode()
    return orjson.dumps(body)


async def serve_prefill(node: PdNode, handler: Handler, request: HttpRequest,
                        response: HttpResponse) -> None:
    """Run one coordinator request on this prefill instance (module docstring)."""
    req_id, target, recompute = prefill_gate(node, request.headers)
    # a resubmission of a request this P still parks for a D that died before pulling
    # it: the new submission replaces the parked copy (its blocks freed first)
    if await node.engine.evict(req_id):
        logger.info("request %s: resubmitted, the copy parked here was freed", req_id)
    if node.is_self(target):  # spec §4.3: flex-local, an ordinary mixed request
        await handler(request, response)
        return
    body = request.body
    history = None
    if recompute:
        try:
            restored, prompt, outputs = parse_recompute_body(
                request.path, parse_json_object(request.body))
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        tail = _binary_tail(restored)
        try:
            logprobs = decode_prompt_logprobs(restored.pop(ORIGIN_LOGPROBS, None))
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        if logprobs is not None and (len(logprobs) != len(outputs) or None in logprobs):
            raise HttpError(422, f"{ORIGIN_LOGPROBS} must hold one entry per output token")
        head = orjson.dumps(restored)
        body, history = head + tail, (prompt, outputs, logprobs)
        if tail:  # the JSON, then the binary tensors, as the client sent them
            request = replace(request, headers={**request.headers,
                                                BINARY_HEADER: str(len(head))})
    sink = CaptureResponse()
    inner = replace(request, body=body)
    obs = PrefillObserver(node, req_id, target, inner, body, history, sink)
    try:
        with observed(obs):
            await handler(inner, sink)
    except RequestHandedOff:
        assert obs.handed_off, "only the observer hands the request off"
        if obs.error is not None:
            raise HttpError(500, obs.error) from None
        await response.send(200, _answer(req_id, sink, last=False))
        return
    if sink.status is not None and sink.status != 200:  # forwarded as is (spec §5.3)
        await response.send(sink.status, b"".join(sink.chunks), sink.content_type)
        return
    if not sink.finished:
        raise HttpError(500, "[P Node] Failed to get tokenIds from inferResponse.")
    await response.send(200, _answer(req_id, sink, last=True))
