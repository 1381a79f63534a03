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

import logging
import time
from dataclasses import replace

import orjson

from tokenserve.api.engine_stream import observed
from tokenserve.api.family_api import parse_json_object
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
from tokenserve.pd.messages import (
    DecodeParameters,
    DecodeVerdict,
    PrefillAnswer,
    PrefillHeaders,
    RequestPlan,
    WireError,
    forward_headers,
)
from tokenserve.pd.node import PD_ONE_SEQUENCE, PdNode, RoleStatus, inter_comm_url
from tokenserve.pd.recompute import RecomputeBody
from tokenserve.pd.sinks import CaptureResponse
from tokenserve.pd.wire import WholeAnswer
from tokenserve.transport.cycle import HandlerExit, HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError
from tokenserve.transport.router import Handler

logger = logging.getLogger(__name__)


class RequestHandedOff(HandlerExit):
    """Raised out of the family handler (by :meth:`PrefillObserver.before_wait`) when its
    request continues on a decode instance (spec §5): the handler stops, and the engine
    request is NOT aborted (:meth:`PrefillObserver.hands_off`: its KV blocks wait for D).
    Not a disconnect: :func:`serve_prefill` matches it and answers the coordinator."""


def prefill_gate(node: PdNode, headers: dict[str, str]) -> PrefillHeaders:
    """spec §4.2 checks, in order: the role here, then the headers
    (:meth:`PrefillHeaders.decode`).

    Raises:
        HttpError: 503 (unknown role status) or 400 with the spec's messages.
    """
    if node.role_status is RoleStatus.UNKNOWN or node.role is None:
        raise HttpError(503, "The server cannot process the inference request due to an "
                        "unknown status. ")
    if not node.is_prefill:
        raise HttpError(400, "DMI inference requests can be sent only to the prefill node "
                        "or p_percentage of the flex node == 0")
    try:
        return PrefillHeaders.decode(headers)
    except WireError as exc:
        raise HttpError(400, str(exc)) from None


class PrefillObserver:
    """The engine side of one P request (see the module docstring)."""

    def __init__(self, node: PdNode, req_id: str, target: str, request: HttpRequest,
                 body: bytes, recompute: RecomputeBody | None,
                 sink: CaptureResponse) -> None:
        self.node = node
        self.sink = sink
        # recompute: the client already has what the handler writes before the replay
        # ends (e.g. OpenAI's role chunk)
        sink.muted = recompute is not None
        self.req_id = req_id
        self.target = target
        self.request = request
        self.body = body  # what D renders from: the client's body (recompute: restored)
        self.recompute = recompute
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
        if self.recompute is not None:
            h = self.recompute.history
            prompt = h.prompt
            adopt = KvAdoption(h.outputs, output_logprobs=self.recompute.logprobs)
            self.delivered = len(h.outputs)
        self.greq = replace(greq, request_id=self.req_id, prompt_token_ids=prompt,
                            prefill_only=True, adopt=adopt)
        return self.greq

    def handed_plan(self) -> GenerateRequest | None:
        return None  # P plans (templates, tokenizes) the request itself

    def hands_off(self, exc: BaseException | None) -> bool:
        return isinstance(exc, RequestHandedOff)

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

    def decode_parameters(self) -> DecodeParameters:
        """What this P hands D (spec §5.2, :class:`DecodeParameters`)."""
        assert self.greq is not None and self.handoff is not None
        h, g, node = self.handoff, self.greq, self.node
        return DecodeParameters(
            req_id=self.req_id,
            tokens=tuple(g.prompt_token_ids),
            first_token=tuple(self.output_ids),
            path=self.request.path,
            block_table=(tuple(h.block_table),),
            p_node_addr=node.address,
            num_computed=h.num_computed,
            body=self.body,
            method=self.request.method,
            query=self.request.query,
            headers=forward_headers(self.request.headers),
            generator_state=h.generator_state,
            seed=g.params.seed,
            prefix_cached_tokens=self.num_cached_tokens,
            kv=(tuple(r.to_dict() for r in node.kv.descriptor())
                if node.kv is not None else None),
            post_single_text=self.text,
            prefill_token_num=len(self.output_ids) - self.delivered,
            pre_output_token_num=self.delivered,
            e2e_start_time_us=int(time.time() * 1e6),
            prompt_logprobs=self.prompt_logprobs,
            # a recompute: its history's entries first, as the recompute body carried them
            first_token_logprobs=self._all_output_logprobs(),
            # D runs this plan as it is: no chat template, no tokenizer there (issue 40)
            plan=RequestPlan(g.params, g.priority, g.timeout_s),
        )

    def _all_output_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The logprobs of every one of ``output_ids`` (a recompute's history first, as
        the recompute body carried them), or None when they are not all known."""
        history = () if not self.delivered else (
            self.recompute.logprobs if self.recompute is not None else None)
        if history is None:
            return None
        out = (*history, *self.output_logprobs)
        return out if out and len(out) == len(self.output_ids) else None

    async def _send_decode(self) -> None:
        url = inter_comm_url(self.target, path_of("pd.decode"))
        t0 = time.perf_counter()
        r = await self.node.http().post(url, content=self.decode_parameters().encode(),
                                        headers={"content-type": "application/json"})
        logger.debug("request %s handed to %s in %.1f ms", self.req_id, self.target,
                     (time.perf_counter() - t0) * 1e3)
        if r.status_code != 200:
            raise RuntimeError(f"D answered {r.status_code}: {r.text[:200]}")
        verdict = DecodeVerdict.decode(r.content)
        if not verdict.valid:
            raise RuntimeError(verdict.error_message or "D refused the request")


def _answer(req_id: str, sink: CaptureResponse, *, last: bool) -> bytes:
    """The spec §5.3 body (:class:`PrefillAnswer`) for what ``sink`` captured."""
    whole = None
    if last and not sink.is_stream and WholeAnswer.needed(sink.content_type, sink.headers):
        # [I] an answer that is not JSON text (Triton's binary tensors): its bytes,
        # content type and headers, base64 (the coordinator sends them as they are)
        whole = WholeAnswer(sink.content_type, sink.headers, b"".join(sink.chunks))
    return PrefillAnswer.of(req_id, sink.is_stream, sink.text, last=last,
                            whole=whole).encode()


async def serve_prefill(node: PdNode, handler: Handler, request: HttpRequest,
                        response: HttpResponse) -> None:
    """Run one coordinator request on this prefill instance (module docstring)."""
    gate = prefill_gate(node, request.headers)
    req_id, target, recompute = gate.req_id, gate.d_target, gate.recompute
    # a resubmission of a request this P still parks for a D that died before pulling
    # it: the new submission replaces the parked copy (its blocks freed first)
    if await node.engine.evict(req_id):
        logger.info("request %s: resubmitted, the copy parked here was freed", req_id)
    if node.is_self(target):  # spec §4.3: flex-local, an ordinary mixed request
        await handler(request, response)
        return
    body = request.body
    rb = None
    if recompute:
        try:
            rb = RecomputeBody.decode(request.path, parse_json_object(request.body))
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        head = orjson.dumps(rb.original)
        body = head + rb.binary
        if rb.binary:  # the JSON, then the binary tensors, as the client sent them
            request = replace(request, headers={**request.headers,
                                                BINARY_HEADER: str(len(head))})
    sink = CaptureResponse()
    inner = replace(request, body=body)
    obs = PrefillObserver(node, req_id, target, inner, body, rb, sink)
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
