"""The decode (D) side of PD disaggregation (spec/pd_disaggregation.md §6, §7.1, §8).

``POST /v1/pd/decode`` (management plane; our stand-in for MindIE's gRPC
``DecodeRequestChannel``) carries the request P started (its ``DecodeParameters``, §5.2:
the client's method, path and body, the prompt ids, the tokens generated so far, the
generator state, P's block ids and KV region). D then runs the SAME family handler on
the client's body, so every byte it sends is what a mixed instance would send::

    handler admits its engine request   -> observer: id = reqId, prompt = P's ids,
                                           adopt (tokens so far, generator, KV source)
    engine: allocate blocks, pull K/V   -> puller (worker thread): Mooncake read of P's
                                           blocks, then POST /v1/pd/release to P
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

``GET /dresult`` (business plane) is served by :class:`DresultHub`: one consumer, a new
one closes the old (§6.2), ``ka:heartbeat`` after 5 s idle, messages kept while no
consumer is connected (bounded) instead of dropped [I]. With no consumer for
``dresult_orphan_timeout_s`` (the coordinator died), every running request is ended as a
client disconnect ends it: its KV blocks are freed [I].
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import logging
import time
from dataclasses import replace
from typing import Any

import httpx
import orjson

from tokenserve.aio import Signal
from tokenserve.api.common import FAILED_FINISH, failure_text, parse_json_object
from tokenserve.api.engine_stream import observed
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
from tokenserve.pd.node import PD_ONE_SEQUENCE, PdNode, inter_comm_url
from tokenserve.pd.prefill import decode_prompt_logprobs, encode_prompt_logprobs
from tokenserve.pd.recompute import (
    ORIGIN_BINARY,
    ORIGIN_LOGPROBS,
    build_recompute_body,
    encode_history,
)
from tokenserve.pd.sinks import CaptureResponse
from tokenserve.pd.wire import HEARTBEAT, WholeAnswer, close_message, encode
from tokenserve.transport.cycle import ClientDisconnected, HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError
from tokenserve.transport.router import Handler, Router

logger = logging.getLogger(__name__)

#: §6.2: heartbeat after this many idle seconds.
HEARTBEAT_S = 5.0
#: [I] messages kept while no /dresult consumer is connected.
BACKLOG = 100_000
_CLOSE = object()


class DresultHub:
    """The one ``GET /dresult`` stream of a decode instance (§6.2)."""

    def __init__(self, heartbeat_s: float = HEARTBEAT_S, backlog: int = BACKLOG) -> None:
        self.heartbeat_s = heartbeat_s
        self._queue: asyncio.Queue | None = None  # the connected consumer's
        self._backlog: collections.deque[bytes] = collections.deque(maxlen=backlog)
        #: time.monotonic() when the last consumer left; None while one is connected
        self.orphaned_since: float | None = time.monotonic()

    def publish(self, msg: bytes) -> None:
        """Queue one chunk (whole messages) for the consumer; never blocks."""
        if self._queue is not None:
            self._queue.put_nowait(msg)
        else:
            self._backlog.append(msg)

    @property
    def connected(self) -> bool:
        return self._queue is not None

    async def serve(self, request: HttpRequest, response: HttpResponse) -> None:
        """Stream messages to this consumer until it leaves or a newer one replaces it."""
        if self._queue is not None:
            self._queue.put_nowait(_CLOSE)
        queue: asyncio.Queue = asyncio.Queue()
        while self._backlog:
            queue.put_nowait(self._backlog.popleft())
        self._queue = queue
        self.orphaned_since = None
        gone = asyncio.Event()
        request.disconnected.subscribe(gone.set)
        request.disconnected.subscribe(lambda: queue.put_nowait(_CLOSE))
        try:
            await response.start_stream(200, "text/event-stream")
            while not gone.is_set():
                try:
                    msg = await asyncio.wait_for(queue.get(), self.heartbeat_s)
                except TimeoutError:
                    msg = HEARTBEAT
                if msg is _CLOSE:
                    if not gone.is_set():
                        await response.write(close_message())
                        await response.end()
                    return
                try:
                    await response.write(msg)
                except ClientDisconnected:
                    self._backlog.appendleft(msg)
                    return
        finally:
            if self._queue is queue:
                self._queue = None
                self.orphaned_since = time.monotonic()
                while not queue.empty():  # keep what this consumer did not get
                    m = queue.get_nowait()
                    if m is not _CLOSE:
                        self._backlog.append(m)


class DecodeObserver:
    """The engine side of one D request (module docstring)."""

    def __init__(self, node: PdNode, hub: DresultHub, params: dict[str, Any],
                 body: dict[str, Any]) -> None:
        self.node, self.hub, self.params, self.body = node, hub, params, body
        self.req_id: str = params["reqId"]
        self.prompt: list[int] = params["tokens"]
        self.delivered: list[int] = list(params["firstToken"])
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
        #: what P computed of the prompt's logprobs (checked by DecodeServer.decode)
        self.prompt_logprobs = decode_prompt_logprobs(params.get("promptLogprobs"))
        self.output_logprobs = decode_prompt_logprobs(params.get("firstTokenLogprobs"))
        if self.output_logprobs is not None and None in self.output_logprobs:
            raise ValueError("firstTokenLogprobs holds a null")
        #: the logprobs of ``delivered`` when the request asked (a recompute carries them)
        self.delivered_logprobs: list[Any] = list(self.output_logprobs or ())

    def admit(self, greq: GenerateRequest) -> GenerateRequest:
        if self.admitted.is_set():
            raise HttpError(422, PD_ONE_SEQUENCE)
        p = self.params
        state = p.get("generatorState")
        source = {"reqId": self.req_id, "kv": p.get("kv"), "blocks": p["blockTable"][0],
                  "pNodeAddr": p["pNodeAddr"]}
        self.admitted.set()
        params = greq.params
        if isinstance(p.get("seed"), int):  # the seed P drew (or the client gave)
            params = replace(params, seed=p["seed"])
        return replace(greq, request_id=self.req_id, prompt_token_ids=tuple(self.prompt),
                       params=params,
                       arrival_time=time.monotonic(), adopt=KvAdoption(
                           tuple(p["firstToken"]),
                           base64.b64decode(state) if state is not None else None,
                           int(p["numComputed"]), source,
                           int(p.get("prefixCachedTokenNums") or 0),
                           self.prompt_logprobs, self.output_logprobs))

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
            rb = build_recompute_body(self.params["path"], self.body,
                                      [*self.prompt, *self.delivered], len(self.prompt))
            raw = client_body(self.params)
            tail = raw[json_length(self.params, raw):]
            if tail:  # [I] Triton's binary tensors ride along, base64 (pd/recompute.py)
                rb[ORIGIN_BINARY] = base64.b64encode(tail).decode()
            if self.delivered_logprobs and len(self.delivered_logprobs) == len(self.delivered):
                rb[ORIGIN_LOGPROBS] = encode_prompt_logprobs(tuple(self.delivered_logprobs))
            self.send_last("retry", orjson.dumps(rb).decode())
        elif out.finish_reason in FAILED_FINISH:
            self.send_last("error", failure_text(out))

    def _ids(self) -> bytes:
        ids, self.pending_ids = self.pending_ids, ()
        return encode(self.req_id, "ids", ",".join(map(str, ids))) if ids else b""

    def send_data(self, chunk: bytes) -> None:
        if self.done:
            return
        self.hub.publish(self._ids() + encode(self.req_id, "data", _body(chunk)))

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
        self.obs.send_last("lastData", _body(b"".join(self.tail)))

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
            self.obs.send_last("error", _error_text(text))


def client_body(params: dict[str, Any]) -> bytes:
    """The client's body from ``DecodeParameters``: ``bodyB64`` [I] (bytes that are not
    UTF-8 text: Triton's binary tensors) or ``body`` (text).

    Raises:
        ValueError: a malformed ``bodyB64``.
        KeyError: neither is there.
    """
    b64 = params.get("bodyB64")
    if b64 is None:
        return params["body"].encode()
    try:
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, TypeError) as exc:
        raise ValueError(f"bad bodyB64: {exc}") from None


def json_length(params: dict[str, Any], raw: bytes) -> int:
    """How many leading bytes of the client's body are its JSON: the client's
    ``Inference-Header-Content-Length`` (Triton's binary extension, spec/interfaces.md
    §6.4) when it is a number, else all of them (the handler itself rejects a bad one)."""
    headers = params.get("headers") or {}
    value = next((str(v) for k, v in headers.items()
                  if str(k).lower() == BINARY_HEADER), "")
    return int(value) if value.strip().isdigit() and int(value) <= len(raw) else len(raw)


def _body(chunk: bytes) -> str:
    """A /dresult body never holds NUL (spec §6.3): [I] the NUL that ends each vLLM
    stream chunk (``{json}\\0``) travels as a newline (JSON never holds a raw one); the
    coordinator turns them back (:func:`tokenserve.pd.wire.vllm_body`)."""
    return chunk.decode("utf-8").replace("\0", "\n")


def _error_text(body: str) -> str:
    try:
        obj = orjson.loads(body)
        return str(obj.get("error", body)) if isinstance(obj, dict) else body
    except orjson.JSONDecodeError:
        return body


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

    def pull(self, source: dict[str, Any], dst_blocks: list[int], num_tokens: int) -> None:
        """The engine's KV puller (worker thread): read P's blocks with the transfer
        engine, then release them on P whatever happened (spec §6.1, §8.1)."""
        p_addr = source["pNodeAddr"]
        try:
            if self.node.kv is None:
                raise RuntimeError("no KV transfer engine")
            from tokenserve.pd.kv_transfer import KvRegion

            src = KvRegion.from_dict(source["kv"])
            self.node.kv.pull(src, list(source["blocks"][:len(dst_blocks)]), dst_blocks)
            self.node.links[p_addr] = "ok"
        except Exception:
            self.node.links[p_addr] = "failed : pull kv failed."
            raise
        finally:
            try:
                self._release.post(inter_comm_url(p_addr, path_of("pd.release")),
                                   json={"reqId": source["reqId"]})
            except httpx.HTTPError as exc:
                logger.warning("release of %s on %s failed: %s", source["reqId"], p_addr, exc)

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
            params = parse_json_object(request.body, 64)
            raw = client_body(params)
            body = parse_json_object(raw[:json_length(params, raw)], 64)
            for key in ("reqId", "tokens", "firstToken", "path", "blockTable", "pNodeAddr",
                        "numComputed"):
                params[key]
            handler, path_params = self.router.resolve(params.get("method", "POST"),
                                                       params["path"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            await response.send_json(200, {"isValidDecodeParameters": False,
                                           "errorMessage": f"bad DecodeParameters: {exc}"})
            return
        except HttpError as exc:
            await response.send_json(200, {"isValidDecodeParameters": False,
                                           "errorMessage": exc.message})
            return
        try:
            obs = DecodeObserver(self.node, self.hub, params, body)
        except ValueError as exc:
            await response.send_json(200, {"isValidDecodeParameters": False,
                                           "errorMessage": f"bad DecodeParameters: {exc}"})
            return
        inner = HttpRequest(method=params.get("method", "POST"), path=params["path"],
                            query=params.get("query", ""), headers=params.get("headers", {}),
                            body=raw, disconnected=Signal(),
                            arrival_time=time.monotonic(), path_params=path_params)
        # the coordinator learns the request's history first (plan: ids)
        self.hub.publish(encode(obs.req_id, "ids", encode_history(obs.prompt, obs.delivered)))
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
            await response.send_json(200, {"isValidDecodeParameters": True, "errorMessage": ""})
        else:
            await response.send_json(200, {"isValidDecodeParameters": False,
                                           "errorMessage": obs.error_message})

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
