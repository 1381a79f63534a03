"""The decode (D) side of PD disaggregation (spec/pd_disaggregation.md §6, §7.1, §8).

``POST /v1/pd/decode`` (management plane; our stand-in for MindIE's gRPC
``DecodeRequestChannel``) carries the request P started (its ``DecodeParameters``, §5.2:
the client's method, path and body, the prompt ids, the tokens generated so far, the
generator state, P's block ids and KV region, and P's plan of the engine request:
sampling and stopping parameters, priority, timeout). D then runs the SAME family handler
on the client's body, so every byte it sends is what a mixed instance would send; its
plan stage takes P's plan instead of templating and tokenizing the prompt again::

    handler parses the body             -> what it renders with (stream, details, tools..)
    handler's plan stage                -> observer: P's plan (prompt = P's ids), as is
    handler admits its engine request   -> observer: id = reqId, prompt = P's ids,
                                           adopt (tokens so far, generator, KV source)
    engine: allocate blocks, pull K/V   -> puller (worker thread): Mooncake read of P's
                                           blocks (tensor parallelism: rank to rank, every
                                           rank's shard, pd/rank_kv.py), then POST
                                           /v1/pd/release to P
    engine: replay output (P's tokens)  -> handler renders it; muted (P sent it already)
    engine: each decode step            -> handler renders -> ``data:`` on /dresult
    final output                        -> everything rendered after it -> one ``lastData:``
                                           (a whole answer that is not JSON text, e.g.
                                           Triton's binary tensors: ``lastBytes:``, [I])
    evicted (KV ran out), or the pull   -> ``retry:`` with the recompute body (§7.2)
    failed (P died)
    failure (pull, engine, timeout)     -> ``error:``

Every request message is preceded, in the same chunk, by an ``ids:`` message with the
token ids it carries (and D's first message for a request is ``ids:L,p..,o..``), so the
coordinator can recompute the request elsewhere if this D dies (plan, [I]).

``GET /dresult`` (business plane) is served by ``dresult_hub.py``'s
:class:`~tokenserve.pd.dresult_hub.DresultHub` (one consumer, heartbeats, the backlog).
With no consumer for ``dresult_orphan_timeout_s`` (the coordinator died), every running
request is ended as a client disconnect ends it: its KV blocks are freed [I].
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import httpx

from tokenserve.aio import Signal
from tokenserve.api.engine_stream import observed
from tokenserve.api.errors import error_message
from tokenserve.api.family_api import FAILED_FINISH, failure_text, parse_json_object
from tokenserve.api.ids import derived_id
from tokenserve.api.routes import path_of
from tokenserve.api.triton.handlers import BINARY_HEADER
from tokenserve.messages import (
    KV_PULL_FAILED,
    FinishReason,
    GenerateRequest,
    KvAdoption,
    RequestOutput,
)
from tokenserve.pd.dresult_hub import DresultHub
from tokenserve.pd.messages import (
    DecodeParameters,
    DecodeVerdict,
    History,
    Release,
    encode_ids,
)
from tokenserve.pd.node import PD_ONE_SEQUENCE, PdNode, inter_comm_url
from tokenserve.pd.recompute import RecomputeBody
from tokenserve.pd.sinks import CaptureResponse
from tokenserve.pd.wire import WholeAnswer, dresult_body, encode
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError
from tokenserve.transport.router import Handler, Router

logger = logging.getLogger(__name__)

class DecodeObserver:
    """The engine side of one D request (module docstring)."""

    def __init__(self, node: PdNode, hub: DresultHub, params: DecodeParameters,
                 body: dict[str, Any]) -> None:
        self.node, self.hub, self.params, self.body = node, hub, params, body
        self.req_id = params.req_id
        self.prompt = list(params.tokens)
        self.delivered = list(params.first_token)
        self.admitted = asyncio.Event()
        self.sink = DecodeSink(self)  # where the family handler writes
        # what the handler writes before the replay output ends (e.g. OpenAI's role
        # chunk) was sent by P already
        self.sink.muted = True
        self.final = False
        self.done = False  # the request's last message (lastData/error/retry) is out
        self.pending_ids: tuple[int, ...] = ()
        self.error_message = "refused"  # why the handler refused it (before admission)
        self.ids_given = 0  # response ids handed to the handler (derived_id, as on P)
        #: the logprobs of ``delivered`` when the request asked (a recompute carries them)
        self.delivered_logprobs = list(params.first_token_logprobs or ())

    def handed_plan(self) -> GenerateRequest | None:
        """P's plan (:class:`RequestPlan`) as the engine request the family runs: its
        prompt is P's tokens, so D neither templates nor tokenizes it; None from a P that
        sends no plan (the family then plans from the body, as P did)."""
        p = self.params
        if p.plan is None:
            return None
        return GenerateRequest(self.req_id, p.tokens, p.plan.params, p.plan.priority,
                               p.plan.timeout_s)

    def hands_off(self, exc: BaseException | None) -> bool:
        return False

    def admit(self, greq: GenerateRequest) -> GenerateRequest:
        if self.admitted.is_set():
            raise HttpError(422, PD_ONE_SEQUENCE)
        p = self.params
        self.admitted.set()
        params = greq.params
        if p.seed is not None:  # the seed P drew (or the client gave)
            params = replace(params, seed=p.seed)
        # the KV source, opaque to the engine, is P's DecodeParameters (DecodeServer.pull)
        return replace(greq, request_id=self.req_id, prompt_token_ids=p.tokens,
                       params=params,
                       arrival_time=time.monotonic(), adopt=KvAdoption(
                           p.first_token, p.generator_state, p.num_computed, p,
                           p.prefix_cached_tokens, p.prompt_logprobs,
                           p.first_token_logprobs))

    async def before_wait(self) -> None:
        return

    def response_id(self, fresh: str) -> str:
        self.ids_given += 1
        return derived_id(self.req_id, self.ids_given)

    def on_output(self, out: RequestOutput) -> None:
        self.sink.muted = out.replay
        if out.replay:
            return
        # an output that writes nothing (text held back) leaves its ids for the next write
        self.pending_ids += out.new_token_ids
        if not out.finished:
            self.delivered.extend(out.new_token_ids)
            self.delivered_logprobs.extend(out.logprobs or ())
            return
        self.final = True
        pull_failed = (out.finish_reason is FinishReason.ERROR
                       and (out.error or "").startswith(KV_PULL_FAILED))
        if out.finish_reason is FinishReason.RECOMPUTE or pull_failed:
            # [I] a failed pull (P died before D read its blocks) is recomputed on a P
            # as an eviction is, not failed
            lps = self.delivered_logprobs
            rb = RecomputeBody(
                self.body, self.history(),
                # [I] Triton's binary tensors ride along (pd/recompute.py)
                self.params.body[json_length(self.params):],
                tuple(lps) if lps and len(lps) == len(self.delivered) else None)
            self.send_last("retry", rb.encode(self.params.path).decode())
        elif out.finish_reason in FAILED_FINISH:
            self.send_last("error", failure_text(out))

    def history(self) -> History:
        """The prompt and every output token the client has been sent so far."""
        return History(tuple(self.prompt), tuple(self.delivered))

    def _ids(self) -> bytes:
        ids, self.pending_ids = self.pending_ids, ()
        return encode(self.req_id, "ids", encode_ids(ids)) if ids else b""

    def send_data(self, chunk: bytes) -> None:
        if self.done:
            return
        self.hub.publish(self._ids() + encode(self.req_id, "data", dresult_body(chunk)))

    def send_last(self, kind: str, body: str) -> None:
        if self.done:
            return
        self.done = True
        ids = self._ids() if kind in ("lastData", "lastBytes") else b""
        # " ": an empty field is ignored by the reader (§6.3); the coordinator sends a
        # blank stream lastData as nothing
        self.hub.publish(ids + encode(self.req_id, kind, body or " "))


class DecodeSink(CaptureResponse):
    """Where the family handler's writes go on D (module docstring)."""

    def __init__(self, obs: DecodeObserver) -> None:
        super().__init__()
        self.obs = obs
        self.tail: list[bytes] = []

    def on_chunk(self, chunk: bytes) -> None:
        if self.obs.final:
            self.tail.append(chunk)  # the final events: all in the one lastData
        else:
            self.obs.send_data(chunk)

    def on_end(self) -> None:
        self.obs.send_last("lastData", dresult_body(b"".join(self.tail)))

    def on_whole(self, status: int, body: bytes) -> None:
        text = body.decode("utf-8", errors="replace")
        if status == 200 and WholeAnswer.needed(self.content_type, self.headers):
            # [I] bytes, content type and headers as a mixed server sends them (Triton's
            # binary tensors): base64 in a lastBytes message
            self.obs.send_last("lastBytes",
                               WholeAnswer(self.content_type, self.headers, body).encode())
        elif status == 200:
            self.obs.send_last("lastData", text)
        else:
            self.obs.send_last("error", error_message(body))


def json_length(params: DecodeParameters) -> int:
    """How many leading bytes of the client's body are its JSON: the client's
    ``Inference-Header-Content-Length`` (Triton's binary extension, spec/interfaces.md
    §6.4) when it is a number, else all of them (the handler itself rejects a bad one)."""
    raw = params.body
    value = next((v for k, v in params.headers.items() if k.lower() == BINARY_HEADER), "")
    return int(value) if value.strip().isdigit() and int(value) <= len(raw) else len(raw)


async def _verdict(response: HttpResponse, valid: bool, error: str = "") -> None:
    """D's 200 answer to P's hand-off (:class:`DecodeVerdict`)."""
    await response.send(200, DecodeVerdict(valid, error).encode(), "application/json")


class DecodeServer:
    """D's routes and request runner."""

    def __init__(self, node: PdNode, router: Router) -> None:
        self.node = node
        self.router = router
        self.hub = DresultHub()
        self._tasks: set[asyncio.Task] = set()
        self._release = httpx.Client(timeout=node.cfg.kv_trans_timeout_s)
        #: req-id -> the disconnect signal of the request running its handler
        self._live: dict[str, Signal] = {}
        self._watchdog: asyncio.Task | None = None

    async def drain(self) -> None:
        """The server is stopping (its listeners take no new connections): once the
        running requests have ended (their last messages published), end the ``/dresult``
        stream with the close message, so the server's drain does not wait on that one
        long-lived response for its whole timeout."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
        self.hub.close()

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._release.close()

    def abort_orphans(self, now: float) -> int:
        """End every running request when no ``/dresult`` consumer has been connected
        for ``dresult_orphan_timeout_s`` at ``now`` (monotonic s); returns how many."""
        since = self.hub.orphaned_since
        if since is None or now - since < self.node.cfg.dresult_orphan_timeout_s:
            return 0
        live = list(self._live.values())
        for gone in live:
            gone.set()
        if live:
            logger.warning("no /dresult consumer for %.0f s: %d requests aborted",
                           now - since, len(live))
        return len(live)

    async def _watch_orphans(self) -> None:
        period = min(1.0, self.node.cfg.dresult_orphan_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self.abort_orphans(time.monotonic())

    # ------------------------------------------------------------------ KV pull (thread)

    def pull(self, source: DecodeParameters, dst_blocks: list[int], num_tokens: int) -> None:
        """The engine's KV puller (worker thread): read P's blocks (``source``: what P
        handed over, the adopted request's ``KvAdoption.source``) with the transfer
        engine, then release them on P whatever happened (spec §6.1, §8.1)."""
        p_addr = source.p_node_addr
        try:
            if self.node.kv is None:
                raise RuntimeError("no KV transfer engine")
            from tokenserve.pd.kv_transfer import KvRegion

            # one region per P rank, pulled rank to rank (pd/rank_kv.py)
            srcs = [KvRegion.from_dict(None if r is None else dict(r))
                    for r in source.kv or (None,)]
            self.node.kv.pull(srcs, list(source.block_table[0][:len(dst_blocks)]), dst_blocks)
            self.node.links[p_addr] = "ok"
        except Exception:
            self.node.links[p_addr] = "failed : pull kv failed."
            raise
        finally:
            try:
                self._release.post(inter_comm_url(p_addr, path_of("pd.release")),
                                   content=Release(source.req_id).encode(),
                                   headers={"content-type": "application/json"})
            except httpx.HTTPError as exc:
                logger.warning("release of %s on %s failed: %s", source.req_id, p_addr, exc)

    # ------------------------------------------------------------------ routes

    async def dresult(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /dresult`` (spec §6.2)."""
        node = self.node
        if not node.cfg.pd:
            raise HttpError(400, "Non DMI does not support dresult request")
        if not node.is_decode:
            raise HttpError(400, "Only the Decode node supports dresult but you send to "
                            f"{node.role or 'none'}")
        await self.hub.serve(request, response)

    async def decode(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v1/pd/decode``: accept a request from P; answers
        ``{"isValidDecodeParameters", "errorMessage"}`` once the engine admitted it."""
        if not self.node.is_decode:
            raise HttpError(400, f"not a decode instance (role {self.node.role or 'none'})")
        try:
            params = DecodeParameters.decode(request.body)
            body = parse_json_object(params.body[:json_length(params)], 64)
            handler, path_params = self.router.resolve(params.method, params.path)
        except ValueError as exc:  # WireError, or the client's body is not a JSON object
            await _verdict(response, False, f"bad DecodeParameters: {exc}")
            return
        except HttpError as exc:
            await _verdict(response, False, exc.message)
            return
        obs = DecodeObserver(self.node, self.hub, params, body)
        inner = HttpRequest(method=params.method, path=params.path, query=params.query,
                            headers=dict(params.headers), body=params.body,
                            disconnected=Signal(),
                            arrival_time=time.monotonic(), path_params=path_params)
        # the coordinator learns the request's history first (plan: ids)
        self.hub.publish(encode(obs.req_id, "ids", obs.history().encode()))
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch_orphans())
        task = asyncio.create_task(self._run(handler, inner, obs), name=f"pd-decode-{obs.req_id}")
        self._tasks.add(task)
        self._live[obs.req_id] = inner.disconnected
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _t, rid=obs.req_id, sig=inner.disconnected:
                               self._live.pop(rid, None) if self._live.get(rid) is sig
                               else None)
        admitted = asyncio.create_task(obs.admitted.wait())
        await asyncio.wait({task, admitted}, return_when=asyncio.FIRST_COMPLETED)
        admitted.cancel()
        if obs.admitted.is_set():
            await _verdict(response, True)
        else:
            await _verdict(response, False, obs.error_message)

    async def _run(self, handler: Handler, request: HttpRequest, obs: DecodeObserver) -> None:
        try:
            with observed(obs):
                await handler(request, obs.sink)
        except HttpError as exc:
            obs.error_message = exc.message
            if obs.admitted.is_set():
                obs.send_last("error", exc.message)
        except Exception as exc:
            logger.exception("decode of %s failed", obs.req_id)
            obs.error_message = str(exc)
            if obs.admitted.is_set():
                obs.send_last("error", "Failed forward in for infer engine.")
        finally:
            if obs.admitted.is_set() and not obs.done:
                obs.send_last("error", "Failed to get token id from infer response.")
