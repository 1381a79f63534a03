"""SchedulerActor: the async shell around the pure Scheduler.

The single writer of the Scheduler, its BlockPool and the request table. Its loop::

    drain inbox (block only when idle) -> timeouts -> schedule() -> executor step
        -> update() -> detokenize -> push RequestOutputs to each request's stream

Messages come in on ``inbox`` (GenerateRequest | AbortRequest | KvPulled | WaitIdle, see
messages.py); an AbortRequest's ``done`` is resolved once the request has left, a
WaitIdle's when the actor next blocks with no work and an empty inbox. The
:class:`RequestHandle` of a request is registered in ``streams`` by the engine before the
GenerateRequest is queued, and removed here when its final output is put.

One module decides that a request is finished (:mod:`tokenserve.engine.finish`: EOS, stop
id and length through ``Scheduler.update``, a stop string in the text, a timeout, an
abort), and one place ends it: :meth:`SchedulerActor._finish`, which frees its blocks and
puts its one final output, with the text the detokenizer and stop-string matcher held
back. The model thread drops the request's sampling state with the next plan.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tokenserve.engine import finish as rules
from tokenserve.engine.detokenizer import IncrementalDetokenizer
from tokenserve.engine.finish import Finish, StopStringMatcher
from tokenserve.engine.output_stream import RequestHandle
from tokenserve.engine.request import Request, RequestStatus
from tokenserve.engine.scheduler import Scheduler
from tokenserve.messages import (
    KV_PULL_FAILED,
    AbortRequest,
    FinishReason,
    GenerateRequest,
    KvHandoff,
    KvPulled,
    PromptLogprobs,
    RequestOutput,
    StepPlan,
    TokenLogprob,
    WaitIdle,
)

if TYPE_CHECKING:  # the shell itself needs no torch: the model thread has it all
    from tokenserve.engine.model_runner import ExecutorActor

log = logging.getLogger("tokenserve.engine")

#: PD decode: ``puller(source, dst_blocks, num_tokens)`` copies the K/V of positions
#: ``[0, num_tokens)`` from ``source`` (a KvAdoption's) into this instance's
#: ``dst_blocks``; blocking (run in a worker thread), raises on failure
KvPuller = Callable[[Any, list[int], int], None]


class _Tracked:
    """Actor-side bookkeeping of one live request."""

    __slots__ = (
        "detok",
        "emitted_first",
        "last_emit",
        "prompt_lps",
        "queue_time_ms",
        "seed",
        "stop",
        "stream",
    )

    def __init__(self, stream: RequestHandle, detok: IncrementalDetokenizer,
                 stop: StopStringMatcher | None, now: float, seed: int) -> None:
        self.stream = stream
        self.detok = detok
        self.stop = stop
        self.last_emit = now
        self.seed = seed
        self.emitted_first = False
        self.queue_time_ms: float | None = None
        #: prompt log-probabilities gathered so far (first entry None), until sent; None
        #: when the request asked for none or they were sent
        self.prompt_lps: list[TokenLogprob | None] | None = None

    def add_prompt_logprobs(self, got: PromptLogprobs) -> None:
        """Append a chunk's prompt log-probabilities; positions already held (a prefill
        recomputed after preemption) are skipped."""
        if self.prompt_lps is None:
            return
        have = len(self.prompt_lps)
        assert got.start <= have, f"prompt logprobs from {got.start}, have {have}"
        self.prompt_lps.extend(got.entries[have - got.start:])

    def take_prompt_logprobs(self, num_prompt_tokens: int
                             ) -> tuple[TokenLogprob | None, ...] | None:
        """All of them, once, when complete (``num_prompt_tokens`` entries)."""
        if self.prompt_lps is None or len(self.prompt_lps) < num_prompt_tokens:
            return None
        out, self.prompt_lps = tuple(self.prompt_lps), None
        return out

    def text(self, delta: str, final: bool) -> str:
        """``delta`` (text already through the stop-string matcher) and, on the final
        output, whatever the detokenizer or the matcher still held back."""
        if not final or (self.stop is not None and self.stop.hit is not None):
            return delta
        rest = self.detok.flush(drop_incomplete=True)
        if self.stop is None:
            return delta + rest
        return delta + self.stop.feed(rest) + (self.stop.flush() if self.stop.hit is None else "")


class SchedulerActor:
    """Drives continuous batching; see the module docstring."""

    def __init__(self, scheduler: Scheduler, executor: ExecutorActor, tokenizer,
                 streams: dict[str, RequestHandle], *, max_iter_times: int,
                 token_timeout_s: float, e2e_timeout_s: float) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.streams = streams
        self.inbox: asyncio.Queue[GenerateRequest | AbortRequest | KvPulled | WaitIdle] = \
            asyncio.Queue()
        self.kv_puller: KvPuller | None = None  # PD decode
        self._pull_tasks: set[asyncio.Task] = set()
        self._sources: dict[str, Any] = {}  # request_id -> KvAdoption.source, until pulled
        self.max_iter_times = max_iter_times
        self.token_timeout_s = token_timeout_s
        self.e2e_timeout_s = e2e_timeout_s
        self._tracked: dict[str, _Tracked] = {}
        self._seq = itertools.count()
        self._step = itertools.count()
        #: WaitIdle replies, resolved when the actor next blocks idle (:meth:`_check_idle`)
        self._idle_waiters: list[asyncio.Future[None]] = []
        #: finished requests by reason (for metrics and tests)
        self.finished_by_reason: collections.Counter[FinishReason] = collections.Counter()
        #: structured output: ms spent on token masks, and the steps that had any
        self.mask_ms = 0.0
        self.mask_steps = 0

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        """The actor's task body; runs until cancelled."""
        while True:
            if not self.scheduler.has_work():
                await self._drop_states()
                self._check_idle()
                self._handle(await self.inbox.get())
            while not self.inbox.empty():
                self._handle(self.inbox.get_nowait())
            self._expire(time.monotonic())
            if not self.scheduler.has_work():
                continue
            seqs = self.scheduler.schedule()
            self._pd_events()
            if not seqs:  # waiting work that cannot be admitted yet: wait for a message
                delay = max(0.0, self.scheduler.next_deadline() - time.monotonic())
                # asyncio.timeout, not wait_for: on Python 3.11 a cancel that lands as the
                # get completes is swallowed by wait_for, and the actor then blocks on an
                # empty inbox while stop() waits for it (seen after a PD release)
                try:
                    async with asyncio.timeout(min(delay, 1.0)):
                        msg = await self.inbox.get()
                except TimeoutError:
                    continue
                self._handle(msg)
                continue
            plan = StepPlan(next(self._step), tuple(seqs), self.scheduler.take_dropped())
            self._note_scheduled(seqs)
            result = await self.executor.run(plan)
            if result.error is not None:
                for s in seqs:
                    self._finish(s.request_id, Finish(FinishReason.ERROR, error=result.error))
                continue
            if log.isEnabledFor(logging.DEBUG):
                log.debug("step %d: %.1f ms, %d decodes, prefill chunks %s, %d waiting",
                          plan.step_id, result.forward_ms,
                          sum(s.is_decode for s in seqs),
                          [len(s.token_ids) for s in seqs if not s.is_decode],
                          len(self.scheduler.waiting))
            for rid, got in result.prompt_logprobs.items():
                t = self._tracked.get(rid)
                if t is not None:
                    t.add_prompt_logprobs(got)
            if result.mask_ms:
                self.mask_ms += result.mask_ms
                self.mask_steps += 1
            for rid, why in result.failed.items():  # rows that failed alone
                self._finish(rid, Finish(FinishReason.ERROR, error=why))
            now = time.monotonic()
            for req, toks in self.scheduler.update(seqs, result.sampled, now, result.accepted):
                self._emit(req, toks, now, result.logprobs.get(req.request_id),
                           result.generator_states.get(req.request_id))

    async def _drop_states(self) -> None:
        """Before going idle: have the model thread drop the sampling state of the
        requests that ended since the last step (a plan with no seqs)."""
        drop = self.scheduler.take_dropped()
        if drop:
            result = await self.executor.run(StepPlan(next(self._step), (), drop))
            assert not result.sampled, "a drop-only plan sampled"

    def _check_idle(self) -> None:
        """About to block with no work: the leak invariant, then answer the WaitIdle
        messages unless another message is already waiting."""
        pool = self.scheduler.pool
        held = pool.num_blocks - pool.num_free - len(self.scheduler.parking.quarantined)
        assert held == 0, f"idle engine holds {held} KV blocks"
        if self.inbox.empty():
            waiters, self._idle_waiters = self._idle_waiters, []
            for done in waiters:
                _reply(done)

    # ------------------------------------------------------------------ messages

    def _handle(self, msg: GenerateRequest | AbortRequest | KvPulled | WaitIdle) -> None:
        if isinstance(msg, AbortRequest):
            self._finish(msg.request_id, Finish(msg.reason, error=msg.error))
            if msg.done is not None:  # it has left: blocks freed, final output put
                _reply(msg.done)
        elif isinstance(msg, WaitIdle):
            self._idle_waiters.append(msg.done)
        elif isinstance(msg, GenerateRequest):
            self._admit(msg)
        elif isinstance(msg, KvPulled):
            if msg.quarantine:
                log.error("KV pull for %s timed out: its blocks are quarantined (never "
                          "reused)", msg.request_id)
            failed = self.scheduler.pulled(msg.request_id, msg.error, msg.quarantine)
            if failed is not None:
                self._finish(msg.request_id, Finish(FinishReason.ERROR, error=msg.error))
        else:
            raise TypeError(f"unknown message {type(msg).__name__}")

    def _admit(self, g: GenerateRequest) -> None:
        stream = self.streams.get(g.request_id)
        if stream is None:
            return  # the client left before the engine saw the request
        params = g.params
        if params.max_new_tokens > self.max_iter_times:
            params = replace(params, max_new_tokens=self.max_iter_times)
        adopt = g.adopt
        outputs = list(adopt.output_token_ids) if adopt is not None else []
        arrival = g.arrival_time or time.monotonic()
        deadline, reason = arrival + self.e2e_timeout_s, "server e2eTimeout"
        if g.timeout_s is not None and arrival + g.timeout_s < deadline:
            deadline, reason = arrival + g.timeout_s, "client timeout"
        pull = adopt.num_computed if adopt is not None else 0
        req = Request(
            request_id=g.request_id, token_ids=[*g.prompt_token_ids, *outputs],
            num_prompt_tokens=len(g.prompt_token_ids), params=params, priority=g.priority,
            arrival_time=arrival, arrival_seq=next(self._seq), deadline=deadline,
            deadline_reason=reason, token_timeout_s=self.token_timeout_s,
            adopted_state=adopt.generator_state if adopt is not None else None,
            grammar=g.grammar,
            prefill_only=g.prefill_only, pull_tokens=pull,
            recompute_elsewhere=pull > 0,
            num_cached_tokens=adopt.num_cached_tokens if adopt is not None else 0,
            # computed here unless another instance did (PD: P, for the adopting D)
            prompt_lp_pending=params.prompt_logprobs is not None and (
                adopt is None or (pull == 0 and adopt.prompt_logprobs is None)))
        detok = IncrementalDetokenizer(self.tokenizer, g.prompt_token_ids,
                                       params.skip_special_tokens,
                                       params.keep_special_token_ids)
        self.scheduler.add(req)  # AsyncEngine.generate checked the id and the length
        stop = (StopStringMatcher(params.stop, params.include_stop_str_in_output)
                if params.stop else None)
        t = _Tracked(stream, detok, stop, arrival, params.seed)
        if req.prompt_lp_pending:
            t.prompt_lps = [None]
        self._tracked[g.request_id] = t
        if pull:
            self._sources[g.request_id] = adopt.source
        if outputs:  # generated elsewhere: one replay output restores the consumer's state
            text = detok.add(outputs)
            if stop is not None:
                text = stop.feed(text)
            t.emitted_first = True
            stream.put(RequestOutput(
                g.request_id, tuple(outputs), text, False, None, req.num_prompt_tokens,
                req.num_output_tokens, seed=params.seed, replay=True,
                logprobs=(adopt.output_logprobs
                          if adopt.output_logprobs is not None
                          and len(adopt.output_logprobs) == len(outputs) else None),
                prompt_logprobs=adopt.prompt_logprobs if params.prompt_logprobs is not None
                else None))

    def _pd_events(self) -> None:
        """Start the K/V pulls the scheduler asked for; end the requests it evicted for
        recompute on a prefill instance (spec/pd_disaggregation.md §7.1)."""
        pulls, evicted = self.scheduler.take_pd_events()
        for req in evicted:
            self._finish(req.request_id, Finish(FinishReason.RECOMPUTE), req=req)
        for req in pulls:
            task = asyncio.create_task(self._pull(req), name=f"kv-pull-{req.request_id}")
            self._pull_tasks.add(task)
            task.add_done_callback(self._pull_tasks.discard)

    async def _pull(self, req: Request) -> None:
        """Run the KV puller in a worker thread; its answer is a KvPulled message."""
        error, quarantine = None, False
        try:
            if self.kv_puller is None:
                raise RuntimeError("this instance cannot pull K/V (not a decode instance)")
            source = self._sources.pop(req.request_id, None)
            await asyncio.to_thread(self.kv_puller, source, list(req.block_table),
                                    req.pull_tokens)
        except Exception as exc:  # noqa: BLE001 - any failure fails this request alone
            log.warning("KV pull for %s failed: %s", req.request_id, exc)
            error = f"{KV_PULL_FAILED} {exc}"
            quarantine = bool(getattr(exc, "timed_out", False))  # KvTransferError's flag
        self.inbox.put_nowait(KvPulled(req.request_id, error, quarantine))

    def _expire(self, now: float) -> None:
        for rid, fin in self.scheduler.expired(now):
            self._finish(rid, fin)

    # ------------------------------------------------------------------ outputs

    def _finish(self, rid: str, fin: Finish, *, req: Request | None = None,
                toks: list[int] | None = None, text: str = "", now: float | None = None,
                logprob: TokenLogprob | None = None) -> None:
        """The one place a request ends, for the reason ``fin`` (a rule of
        :mod:`tokenserve.engine.finish`, or a failure): free its blocks (unless
        ``Scheduler`` already did, passing the finished ``req``), count it, and put its
        one final output: ``toks`` / ``text`` of its last step plus what was held back."""
        live = self.scheduler.finish(rid, fin.reason, fin.error, fin.stop_reason)
        req = live or req
        self._sources.pop(rid, None)
        t = self._tracked.pop(rid, None)
        if t is None or req is None:
            return  # unknown or already ended
        text = t.text(text, final=True)
        fin = rules.at_end(fin, t.stop)  # the held text may complete a stop string
        req.finish_reason = fin.reason
        self.finished_by_reason[fin.reason] += 1
        self.streams.pop(rid, None)
        t.stream.put(self._output(req, t, toks or [], text, now, logprob, finished=True,
                                  fin=fin))

    def _output(self, req: Request, t: _Tracked, toks: list[int], text: str,
                now: float | None, logprob: TokenLogprob | None, *, finished: bool,
                fin: Finish | None = None) -> RequestOutput:
        first = bool(toks) and not t.emitted_first
        out = RequestOutput(
            request_id=req.request_id, new_token_ids=tuple(toks), new_text=text,
            finished=finished, finish_reason=fin.reason if fin is not None else None,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            prefill_time_ms=(now - req.arrival_time) * 1e3 if first and now else None,
            decode_time_ms=(now - t.last_emit) * 1e3 if toks and not first and now else None,
            error=fin.error if fin is not None else None, seed=t.seed,
            logprobs=(logprob,) if logprob is not None else None,
            stop_reason=fin.stop_reason if fin is not None else None,
            queue_time_ms=t.queue_time_ms if first else None,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=(t.take_prompt_logprobs(req.num_prompt_tokens)
                             if toks or finished else None))
        if toks:
            t.emitted_first = True
            if now is not None:
                t.last_emit = now
        return out

    def _note_scheduled(self, seqs) -> None:
        now = None
        for s in seqs:
            t = self._tracked.get(s.request_id)
            if t is not None and t.queue_time_ms is None:
                now = now or time.monotonic()
                t.queue_time_ms = (now - self.scheduler.requests[s.request_id].arrival_time) * 1e3

    def _emit(self, req: Request, toks: list[int], now: float,
              logprob: TokenLogprob | None, gen_state: bytes | None = None) -> None:
        """Put the output of a step that gave ``req`` tokens; end it when the scheduler
        did (EOS, stop id, length) or the text completed a stop string."""
        t = self._tracked[req.request_id]
        text = t.detok.add(toks)
        if t.stop is not None:
            text = t.stop.feed(text)
        fin = rules.after_text(t.stop)
        if fin is None and req.finished:
            assert req.finish_reason is not None
            fin = Finish(req.finish_reason, req.stop_reason, req.error)
        if fin is not None:
            self._finish(req.request_id, fin, req=req, toks=toks, text=text, now=now,
                         logprob=logprob)
            return
        out = self._output(req, t, toks, text, now, logprob, finished=False)
        if req.status is RequestStatus.PARKED:  # PD prefill: the decode instance's part
            out = replace(out, handoff=KvHandoff(tuple(req.block_table), req.num_computed,
                                                 gen_state))
        t.stream.put(out)


def _reply(done: asyncio.Future[None]) -> None:
    """Answer a message's reply future (its sender may have stopped waiting)."""
    if not done.done():
        done.set_result(None)
