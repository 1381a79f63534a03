"""One client request through the P/D cluster: submit to P, relay P's answer and D's
``/dresult`` messages, resubmit on ``retry:`` or a lost D (spec/pd_disaggregation.md
§4.1, §5.3, §7.3, §10, §11; plan "Wire decisions").

::

    place: choose P and D (coordinator/policy.py: DIGS, or prefix affinity)  [408]
    submit: POST <path> to P, headers req-type/req-id/d-target/d-port
            (+ is-recompute), body unchanged or the recompute body
            connect failed -> another P, p_connect_tries in all          [500 connect]
            P lost before answering (reset, read/write error) -> the same body on
                another P under a fresh req-id (what the lost P handed to D is
                stopped, and its late messages match no request), max_retry  [503]
    P answer (D's messages wait in the inbox meanwhile, §11 ordering)  [408 first token]
        non-200 -> forwarded unchanged (while retrying: resubmit, §7.3, after
                   retry_delay_s doubling each time: [I] the retries outlast P's
                   kv_trans_timeout)
        stream: head + output; isLastResp -> end
        non-stream: isLastResp -> output is the body
    D messages, from the request's current D only                       [408 inference]
        ids       -> token history (never relayed)
        data      -> stream: written as is
        lastData  -> stream: written, end; non-stream: the JSON body
        lastBytes -> non-stream: the bytes, content type and headers it holds ([I]
                     Triton's binary tensors, pd/wire.py WholeAnswer)
        error     -> stream: the family's error event, close; else 500, family shape
        retry     -> resubmit its body with is-recompute: true            [500 retry]
        (drop)    -> the D's /dresult ended: resubmit the recompute body built from
                     the history on another D (nothing lost, nothing repeated)
    client gone at any point -> stopInfer on P and D (best effort)

The history is what D reports in ``ids`` messages: its first one per submission is
``L,p1..pL,o1..oK`` (prompt and every token the client has been sent), later ones append
the ids of the text they come with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from tokenserve.api.errors import ERROR_CONTENT_TYPE, error_json, error_message, fail_stream
from tokenserve.api.ids import derived_id
from tokenserve.api.routes import match
from tokenserve.config.tree import CoordinatorConfig
from tokenserve.coordinator import ingress as msg
from tokenserve.coordinator.history import TokenHistory
from tokenserve.coordinator.ingress import Ingress
from tokenserve.coordinator.metrics import CoordinatorMetrics, refused_before_engine
from tokenserve.coordinator.pool import Instance, InstancePool
from tokenserve.pd.messages import PrefillAnswer, PrefillHeaders, WireError, forward_headers
from tokenserve.pd.wire import DMessage, WholeAnswer, vllm_body
from tokenserve.transport.cycle import ClientDisconnected, HttpRequest, HttpResponse

logger = logging.getLogger(__name__)

#: how often a request waiting for a usable P and D looks again (seconds).
PLACE_POLL_S = 0.05
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


def retry_delay(base_s: float, retry: int) -> float:
    """Seconds before resending to a P that answered an error while the request was
    being retried, for the ``retry``-th resubmission (1-based): ``base_s`` doubling each
    time (§7.3 says 1 s, fixed; [I] doubling, so ``max_retry`` = 5 retries span 31 s and
    outlast what P may still wait for, ``kv_trans_timeout`` 10 s by default)."""
    return base_s * 2 ** max(0, retry - 1)


class PLost(Exception):
    """The P a submission went to failed before answering (connection reset, read or
    write error): the request may be placed again."""


class Failure(Exception):
    """Ends a request with ``status`` and ``message`` (§3.2's, or D's ``error:`` text) in
    the family's error shape (§3.2 rule [I]); on a started stream, the family's error
    event (:mod:`tokenserve.api.errors`)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Event:
    """An inbox entry: a D message (``d``), a lost D (``drop``, during submission
    number ``epoch``) or the client gone (``gone``); ``source`` names the D."""

    kind: str
    source: str = ""
    message: DMessage | None = None
    epoch: int = 0


@dataclass(frozen=True)
class PReply:
    """P's HTTP answer."""

    status: int
    content_type: str
    body: bytes


def refused_for_good(status: int) -> bool:
    """A P answer that a resubmission of the same body would get again: a 4xx other than
    408 (timeout) and 429 (busy)."""
    return 400 <= status < 500 and status not in (408, 429)


@dataclass(frozen=True)
class FlowContext:
    """What a flow uses of its coordinator: config, instances, the upstream client and
    ``spawn`` (runs a best-effort coroutine in the background)."""

    cfg: CoordinatorConfig
    pool: InstancePool
    client: httpx.AsyncClient
    spawn: Callable[[Awaitable[None]], None]
    #: gives the flow registered under an id a fresh id (and registers it under it)
    rekey: Callable[[str], str] | None = None
    metrics: CoordinatorMetrics | None = None


class Flow:
    """One request (module docstring). The coordinator registers it under ``req_id``
    before :meth:`run` and feeds :meth:`on_d_message` / :meth:`on_d_dropped`."""

    def __init__(self, ctx: FlowContext, req_id: str, request: HttpRequest,
                 response: HttpResponse, ingress: Ingress) -> None:
        loop = asyncio.get_running_loop()
        self.req_id = req_id
        self._ctx, self._request, self._response, self._in = ctx, request, response, ingress
        self._inbox: asyncio.Queue[Event] = asyncio.Queue()
        self._gone: asyncio.Future[None] = loop.create_future()
        now = loop.time()
        self._first_deadline = now + ctx.cfg.first_token_timeout_s
        self._deadline = now + ctx.cfg.infer_timeout_s
        self._answered = False  # P has answered 200 once
        self._completed = False  # the request ended on P/D: no stop needed
        self.p: Instance | None = None
        self.d: Instance | None = None
        self._body = request.body
        self._recompute = False
        self._retries = 0
        self._lost: set[str] = set()  # Ds this request was lost on
        self._d_lost = False  # the current D dropped
        self._epoch = 0  # submissions so far
        self._prefer_p: Instance | None = None
        self._delay = 0.0
        self._history = TokenHistory()
        self._p_lost = False  # the last submission's P failed before answering
        self._arrival = now
        self._delivered = False  # the client got the whole 200 answer
        self._p_refused = False  # P's refusal (before its engine) was relayed
        #: the cluster series (coordinator/metrics.py): counted once, ended once
        self._count_in = ctx.metrics.request(now) if ctx.metrics is not None else None

    @property
    def cost(self) -> int:
        """The request's estimated prompt tokens."""
        return self._in.cost

    def known_as(self, rid: str) -> bool:
        """Whether a client may name this request ``rid`` in ``stopInfer`` (interfaces
        §2.3): its req-id, the ``id`` its body gave (Triton), or the response id the
        family wrote (:func:`tokenserve.api.ids.derived_id`, the first one)."""
        return rid in (self.req_id, self._in.body.get("id"), derived_id(self.req_id, 1))

    # ------------------------------------------------------------------ inputs

    def on_d_message(self, source: str, message: DMessage) -> None:
        """A ``/dresult`` message for this request from the D named ``source``."""
        self._inbox.put_nowait(Event("d", source, message))

    def on_d_dropped(self, source: str) -> None:
        """The ``/dresult`` stream of the D named ``source`` ended."""
        if self.d is not None and source == self.d.name and not self._d_lost:
            self._d_lost = True
            self._inbox.put_nowait(Event("drop", source, epoch=self._epoch))

    def _on_gone(self) -> None:
        if not self._gone.done():
            self._gone.set_result(None)
            self._inbox.put_nowait(Event("gone"))

    # ------------------------------------------------------------------ driver

    async def run(self) -> None:
        """Serve the request to its end; never raises but for cancellation."""
        self._request.disconnected.subscribe(self._on_gone)
        if self._request.disconnected.is_set():
            self._on_gone()
        gone = False
        try:
            while not await self._attempt():
                pass
        except ClientDisconnected:
            gone = True
            logger.info("request %s: client gone", self.req_id)
        except Failure as f:
            logger.warning("request %s failed: %d %s", self.req_id, f.status, f.message)
            with contextlib.suppress(ClientDisconnected):
                await self._fail(f)
        finally:
            self._request.disconnected.unsubscribe(self._on_gone)
            if self.d is not None:
                self.d.outstanding -= 1
            self._record_end(gone)
            if not self._completed and self.p is not None:
                stop = [i for i in (self.p, self.d) if i is not None]
                self._ctx.spawn(self._ctx.pool.stop_infer(stop, self.req_id))

    async def _attempt(self) -> bool:
        """One submission to P and its relay; True when the request is done."""
        try:
            reply = await self._submit()
        except PLost:
            self._after_p_lost()
            return False
        self._p_lost = False
        done = await self._on_p(reply)
        if done is None:  # resubmit (P error while retrying)
            return False
        return done or await self._relay()

    async def _fail(self, f: Failure) -> None:
        resp = self._response
        if resp.finished:
            return
        family = self._in.family
        if resp.started:  # as a mixed server's failed stream: 500 in the event
            await fail_stream(resp, family, f.message)
        else:
            await resp.send(f.status, error_json(family, f.status, f.message),
                            ERROR_CONTENT_TYPE)

    # ------------------------------------------------------------------ P

    async def _submit(self) -> PReply:
        """Place and send to P, racing the client and the deadlines."""
        loop = asyncio.get_running_loop()
        if self._answered:
            deadline, text = self._deadline, msg.INFER_TIMEOUT
        else:
            deadline, text = min((self._first_deadline, msg.FIRST_TOKEN_TIMEOUT),
                                 (self._deadline, msg.INFER_TIMEOUT))
        task = loop.create_task(self._call_p())
        try:
            await asyncio.wait({task, self._gone}, timeout=max(0.0, deadline - loop.time()),
                               return_when=asyncio.FIRST_COMPLETED)
            if self._gone.done():
                raise ClientDisconnected()
            if not task.done():
                raise Failure(408, text)
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Failure):
                    await task

    async def _call_p(self) -> PReply:
        """§10: up to ``p_connect_tries`` P instances until one takes the connection."""
        if self._delay:
            await asyncio.sleep(self._delay)
            self._delay = 0.0
        for attempt in range(self._ctx.cfg.p_connect_tries):
            placed = await self._place(wait=attempt == 0)
            if placed is None:  # every P refused the connection
                break
            p, d = placed
            try:
                return await self._post(p, d)
            except _CONNECT_ERRORS as exc:
                logger.warning("request %s: cannot connect to P %s: %r", self.req_id,
                               p.name, exc)
                self._ctx.pool.mark_unreachable(p)
                self._prefer_p = None
        self._completed = True  # no P has it, and no D either: nothing to stop
        raise Failure(500, msg.CONNECT_P_FAILED)

    async def _place(self, *, wait: bool) -> tuple[Instance, Instance] | None:
        """A usable P and D, waiting up to ``schedule_timeout_s`` for them; without
        ``wait`` (a P just refused the connection) None when there is none now."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._ctx.cfg.schedule_timeout_s
        pool = self._ctx.pool
        blocks = pool.blocks_for(self._in.cost + len(self._history))
        while True:
            p = self._prefer_p
            if p is None or not p.usable():
                p = pool.choose_p(prompt=self._in.prompt, cost=self._in.cost, linked=True)
            if p is not None:
                world = p.world_size()  # a D of P's worldSize: rank to rank KV
                d = (pool.choose_d(frozenset(self._lost), assign=blocks, avoid=p.name,
                                   world=world)
                     or pool.choose_d(assign=blocks, avoid=p.name, world=world))
                if d is not None:
                    return p, d
            if not wait:
                return None
            if loop.time() >= deadline:
                if self._p_lost:  # [I] no P took over from a lost one: unavailable
                    raise Failure(503, msg.NOT_READY)
                raise Failure(408, msg.SCHEDULE_TIMEOUT)
            await asyncio.sleep(PLACE_POLL_S)

    async def _post(self, p: Instance, d: Instance) -> PReply:
        """The request to P (§4.1); transport errors other than connect ones become
        the §3.2 failures."""
        headers = forward_headers(self._request.headers)
        headers.update(PrefillHeaders(self.req_id, d.d_target(), str(d.addr.port),
                                      self._recompute).encode())
        url = p.addr.base_url + self._request.path
        if self._request.query:
            url += "?" + self._request.query
        if self.d is not None:
            self.d.outstanding -= 1
        d.outstanding += 1
        self.p, self.d, self._d_lost = p, d, False
        self._history.reset()
        self._epoch += 1
        self._purge_inbox()
        logger.debug("request %s -> P %s, D %s%s", self.req_id, p.name, d.name,
                     " (recompute)" if self._recompute else "")
        cost = self._in.cost
        p.prefill_load += cost
        p.outstanding += 1
        p.chosen += 1
        try:
            resp = await self._ctx.client.post(
                url, content=self._body, headers=headers,
                timeout=httpx.Timeout(None, connect=self._ctx.cfg.connect_timeout_s))
        except _CONNECT_ERRORS:
            raise
        except (httpx.WriteError, httpx.ReadError, httpx.RemoteProtocolError) as exc:
            logger.warning("request %s: P %s lost: %r", self.req_id, p.name, exc)
            raise PLost() from None
        except httpx.WriteTimeout:
            raise Failure(500, msg.SEND_P_FAILED) from None
        except httpx.HTTPError:
            raise Failure(500, msg.RECV_P_FAILED) from None
        finally:
            p.prefill_load -= cost
            p.outstanding -= 1
        return PReply(resp.status_code, resp.headers.get("content-type", "application/json"),
                      resp.content)

    async def _on_p(self, reply: PReply) -> bool | None:
        """P's answer (§5.3): True when the request is done, False to go on with D's
        messages, None to resubmit."""
        if reply.status != 200:
            return await self._on_p_error(reply)
        try:
            ans = PrefillAnswer.decode(reply.body)
        except WireError:
            raise Failure(500, msg.P_ERROR) from None
        if ans.req_id != self.req_id:
            raise Failure(500, msg.P_ERROR)
        last, output = ans.is_last is True, ans.output
        resp = self._response
        if self._in.stream:
            if output is None or ans.is_last is None:
                raise Failure(500, msg.P_ERROR)
            if not resp.started:
                await resp.start_stream(200, "text/event-stream")
            if output:
                await resp.write(output.encode())
            if last:
                await resp.end()
        elif last:
            if output is None:
                raise Failure(500, msg.P_ERROR)
            if ans.output_bytes is not None:  # [I] not JSON text (pd/wire.py)
                await self._send_whole(ans.output_bytes)
            else:
                await resp.send(200, output.encode(), "application/json")
        self._first_token()
        self._answered = True
        self._completed = self._delivered = last
        return last

    async def _send_whole(self, whole: WholeAnswer) -> None:
        """A whole answer that is not JSON text (:class:`WholeAnswer`: Triton's binary
        tensors), sent with its own bytes, content type and headers."""
        await self._response.send(200, whole.body, whole.content_type, whole.headers)

    async def _on_p_error(self, reply: PReply) -> bool | None:
        """A non-200 P answer: forwarded unchanged, unless the request is being retried
        (§7.3: again on the same P after ``retry_delay_s``) or its D was lost (another
        D at once)."""
        if (self._recompute or self._d_lost) and refused_for_good(reply.status):
            # [I] P refused the resubmitted body itself (a 4xx other than 408/429):
            # sending it again cannot help; the client gets P's error now
            raise Failure(reply.status, error_message(reply.body))
        if self._recompute or self._d_lost:
            self._count_retry()
            if self._d_lost:
                assert self.d is not None
                self._lost.add(self.d.name)
            else:
                self._prefer_p = self.p
                self._delay = retry_delay(self._ctx.cfg.retry_delay_s, self._retries)
            return None
        if self._response.started:  # cannot happen before a resubmission; be safe
            raise Failure(reply.status, reply.body.decode(errors="replace"))
        await self._response.send(reply.status, reply.body, reply.content_type)
        self._completed = True  # P refused it: nothing runs
        self._p_refused = refused_before_engine(reply.status)
        return True

    def _count_retry(self, status: int = 500, text: str = msg.RETRY_FAILED) -> None:
        if self._retries >= self._ctx.cfg.max_retry:
            raise Failure(status, text)
        self._retries += 1
        if self._ctx.metrics is not None:
            self._ctx.metrics.retries.inc()

    def _count(self, what: str, kind: str = "") -> None:
        """Metrics: a recompute, or a failover of an instance of ``kind``."""
        m = self._ctx.metrics
        if m is None:
            return
        if what == "recompute":
            m.recomputes.inc()
        else:
            m.failovers.labels(kind).inc()

    def _first_token(self) -> None:
        """Metrics: P answered 200, so the first token exists (and a stream's first
        bytes have just gone out): the request is received, its TTFT observed (once)."""
        if self._count_in is not None:
            self._count_in.first_token(asyncio.get_running_loop().time())

    def _record_end(self, gone: bool) -> None:
        """Metrics: the request is over (``gone``: its client went away)."""
        m = self._ctx.metrics
        if m is None:
            return
        route = match(self._request.method, self._request.path)
        status = self._response.status if self._response.started else 499
        m.requests.labels(route.name if route else "other", str(status)).inc()
        if self._count_in is not None:
            self._count_in.ended(asyncio.get_running_loop().time(), ok=self._delivered,
                                 disconnected=gone and not self._delivered,
                                 refused=self._p_refused)

    def _after_p_lost(self) -> None:
        """The P of the last submission failed before answering: whatever it handed to
        its D is stopped, and the same body goes to another P (out of scheduling until
        its next good status poll) under a fresh req-id, so the lost submission's late
        D messages match nothing; 503 once ``max_retry`` is spent."""
        assert self.p is not None
        self._ctx.pool.mark_unreachable(self.p)
        self._prefer_p, self._p_lost = None, True
        self._count("failover", "prefill")
        stop = [self.d] if self.d is not None else []
        self._ctx.spawn(self._ctx.pool.stop_infer(stop, self.req_id))
        self._count_retry(503, msg.NOT_READY)
        if self._ctx.rekey is not None:
            self.req_id = self._ctx.rekey(self.req_id)
        self.p = None

    # ------------------------------------------------------------------ D

    async def _relay(self) -> bool:
        """D's messages until the request is done (True) or must be resubmitted."""
        assert self.d is not None
        while True:
            ev = await self._next_event()
            if ev.kind == "gone":
                raise ClientDisconnected()
            if ev.source != self.d.name:
                continue  # a D this request has left
            if ev.kind == "drop":
                if ev.epoch == self._epoch:
                    return self._after_drop()
                continue
            assert ev.message is not None
            done = await self._on_d(ev.message)
            if done is not None:
                return done

    async def _next_event(self) -> Event:
        left = self._deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(self._inbox.get(), max(0.0, left))
        except asyncio.TimeoutError:
            raise Failure(408, msg.INFER_TIMEOUT) from None

    async def _on_d(self, m: DMessage) -> bool | None:
        """One D message: True done, False resubmit, None go on."""
        resp, stream = self._response, self._in.stream
        if m.kind == "ids":
            if not self._history.feed(m.body):
                logger.warning("request %s: bad ids message %r", self.req_id, m.body[:100])
        elif m.kind == "data":
            if stream:
                await resp.write(self._stream_body(m.body))
        elif m.kind == "lastData":
            self._completed = True
            if stream:
                # a blank body is D's placeholder for "no final bytes" (an empty field
                # would be ignored, §6.3): the client gets nothing for it
                if m.body.strip():
                    await resp.write(self._stream_body(m.body))
                await resp.end()
            else:
                await resp.send(200, m.body.encode(), "application/json")
            self._delivered = True
            return True
        elif m.kind == "lastBytes" and not stream:  # [I] not JSON text (pd/wire.py)
            self._completed = True
            try:
                whole = WholeAnswer.decode(m.body)
            except ValueError:
                raise Failure(500, msg.P_ERROR) from None
            await self._send_whole(whole)
            self._delivered = True
            return True
        elif m.kind == "error":
            self._completed = True
            raise Failure(500, m.body)
        elif m.kind == "retry":
            self._count_retry()
            logger.info("request %s: D %s asks for a recompute", self.req_id, self.d.name)
            self._body, self._recompute = m.body.encode(), True
            self._count("recompute")
            return False
        return None

    def _stream_body(self, body: str) -> bytes:
        """A D stream body as the client's bytes (a NUL-delimited family's, vLLM's:
        newlines back to NULs)."""
        swap = self._in.description.framing.nul_delimited
        return (vllm_body(body) if swap else body).encode()

    def _after_drop(self) -> bool:
        """The current D's stream ended: resubmit on another D (False), from the
        history when there is one, from the start when the client has nothing yet."""
        assert self.d is not None
        lost = self.d
        self._lost.add(lost.name)
        self._ctx.spawn(self._ctx.pool.stop_infer([lost], self.req_id))
        self._count_retry()
        self._count("failover", "decode")
        body = self._history.recompute_body(self._request.path, self._in.body)
        if body is not None:
            self._body, self._recompute = body, True
            self._count("recompute")
        elif not self._response.started:
            self._body, self._recompute = self._request.body, False
        else:
            raise Failure(500, msg.RETRY_FAILED)
        logger.warning("request %s: D %s lost, resubmitting", self.req_id, lost.name)
        return False

    def _purge_inbox(self) -> None:
        """Drop the D events of earlier submissions (a D that kept messages while its
        stream was down may flush them on re-link); a client gone stays."""
        kept = []
        while not self._inbox.empty():
            ev = self._inbox.get_nowait()
            if ev.kind == "gone":
                kept.append(ev)
        for ev in kept:
            self._inbox.put_nowait(ev)
