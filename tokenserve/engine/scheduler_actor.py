"""SchedulerActor: the async shell around the pure Scheduler.

The single writer of the Scheduler, its BlockPool and the request table. Its loop::

    drain inbox (block only when idle) -> timeouts -> schedule() -> executor step
        -> update() -> detokenize -> push RequestOutputs to each request's stream

Messages come in on ``inbox`` (GenerateRequest | AbortRequest, see messages.py); the
output stream of a request is registered in ``streams`` by the engine before the
GenerateRequest is queued.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import replace

from tokenserve.engine.detokenizer import IncrementalDetokenizer
from tokenserve.engine.executor import ExecutorActor
from tokenserve.engine.output_stream import RequestStream
from tokenserve.engine.request import Request
from tokenserve.engine.sampler import make_generator
from tokenserve.engine.scheduler import Scheduler
from tokenserve.engine.stop_strings import StopStringMatcher
from tokenserve.messages import (
    AbortRequest,
    FinishReason,
    GenerateRequest,
    RequestOutput,
    StepPlan,
    TokenLogprob,
)

log = logging.getLogger("tokenserve.engine")


class _Tracked:
    """Actor-side bookkeeping of one live request."""

    __slots__ = (
        "detok",
        "emitted_first",
        "last_emit",
        "queue_time_ms",
        "seed",
        "stop",
        "stream",
    )

    def __init__(self, stream: RequestStream, detok: IncrementalDetokenizer,
                 stop: StopStringMatcher | None, now: float, seed: int) -> None:
        self.stream = stream
        self.detok = detok
        self.stop = stop
        self.last_emit = now
        self.seed = seed
        self.emitted_first = False
        self.queue_time_ms: float | None = None

    def text(self, delta: str, final: bool) -> str:
        """Pass detokenized text through the stop-string matcher; on the final output
        also release whatever the detokenizer or the matcher held back."""
        if final:
            delta += self.detok.flush()
        if self.stop is None:
            return delta
        out = self.stop.feed(delta)
        if final and self.stop.hit is None:
            out += self.stop.flush()
        return out


class SchedulerActor:
    """Drives continuous batching; see the module docstring."""

    def __init__(self, scheduler: Scheduler, executor: ExecutorActor, tokenizer,
                 streams: dict[str, RequestStream], *, max_iter_times: int,
                 token_timeout_s: float, e2e_timeout_s: float) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.streams = streams
        self.inbox: asyncio.Queue[GenerateRequest | AbortRequest] = asyncio.Queue()
        self.max_iter_times = max_iter_times
        self.token_timeout_s = token_timeout_s
        self.e2e_timeout_s = e2e_timeout_s
        self._tracked: dict[str, _Tracked] = {}
        self._seq = itertools.count()
        self._step = itertools.count()
        self.idle = asyncio.Event()
        self.idle.set()
        #: finished requests by reason (for metrics and tests)
        self.finished_by_reason: collections.Counter[FinishReason] = collections.Counter()

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        """The actor's task body; runs until cancelled."""
        while True:
            if not self.scheduler.has_work():
                self._check_idle()
                self._handle(await self.inbox.get())
            while not self.inbox.empty():
                self._handle(self.inbox.get_nowait())
            self._expire(time.monotonic())
            if not self.scheduler.has_work():
                continue
            self.idle.clear()
            seqs = self.scheduler.schedule()
            if not seqs:  # waiting work that cannot be admitted yet: wait for a message
                delay = max(0.0, self.scheduler.next_deadline() - time.monotonic())
                try:
                    msg = await asyncio.wait_for(self.inbox.get(), timeout=min(delay, 1.0))
                    self._handle(msg)
                except asyncio.TimeoutError:
                    pass
                continue
            plan = StepPlan(next(self._step), seqs)
            self._note_scheduled(seqs)
            result = await self.executor.run(plan)
            if result.error is not None:
                for s in seqs:
                    self._finish(s.request_id, FinishReason.ERROR, result.error)
                continue
            if log.isEnabledFor(logging.DEBUG):
                log.debug("step %d: %.1f ms, %d decodes, prefill chunks %s, %d waiting",
                          plan.step_id, result.forward_ms,
                          sum(s.is_decode for s in seqs),
                          [len(s.token_ids) for s in seqs if not s.is_decode],
                          len(self.scheduler.waiting))
            now = time.monotonic()
            for req, toks in self.scheduler.update(seqs, result.sampled, now):
                self._emit(req, toks, now, result.logprobs.get(req.request_id))

    def _check_idle(self) -> None:
        pool = self.scheduler.pool
        assert pool.all_free(), f"idle engine holds {pool.num_blocks - pool.num_free} KV blocks"
        self.idle.set()

    # ------------------------------------------------------------------ messages

    def _handle(self, msg: GenerateRequest | AbortRequest) -> None:
        if isinstance(msg, AbortRequest):
            self._finish(msg.request_id, msg.reason, None)
        elif isinstance(msg, GenerateRequest):
            self._admit(msg)
        else:
            raise TypeError(f"unknown message {type(msg).__name__}")

    def _admit(self, g: GenerateRequest) -> None:
        stream = self.streams.get(g.request_id)
        if stream is None:
            return  # the client left before the engine saw the request
        params = g.params
        if params.max_new_tokens > self.max_iter_times:
            params = replace(params, max_new_tokens=self.max_iter_times)
        arrival = g.arrival_time or time.monotonic()
        deadline, reason = arrival + self.e2e_timeout_s, "server e2eTimeout"
        if g.timeout_s is not None and arrival + g.timeout_s < deadline:
            deadline, reason = arrival + g.timeout_s, "client timeout"
        req = Request(
            request_id=g.request_id, token_ids=list(g.prompt_token_ids),
            num_prompt_tokens=len(g.prompt_token_ids), params=params, priority=g.priority,
            arrival_time=arrival, arrival_seq=next(self._seq), deadline=deadline,
            deadline_reason=reason, token_timeout_s=self.token_timeout_s,
            generator=make_generator(params.seed) if params.do_sample else None)
        detok = IncrementalDetokenizer(self.tokenizer, g.prompt_token_ids,
                                       params.skip_special_tokens)
        try:
            self.scheduler.add(req)
        except ValueError as exc:
            stream.put(RequestOutput(g.request_id, (), "", True, FinishReason.ERROR,
                                     req.num_prompt_tokens, 0, error=str(exc), seed=params.seed))
            return
        stop = (StopStringMatcher(params.stop, params.include_stop_str_in_output)
                if params.stop else None)
        self._tracked[g.request_id] = _Tracked(stream, detok, stop, arrival, params.seed)

    def _expire(self, now: float) -> None:
        for rid, why in self.scheduler.expired(now):
            self._finish(rid, FinishReason.TIMEOUT, f"Engine callback timeout: {why}")

    # ------------------------------------------------------------------ outputs

    def _finish(self, rid: str, reason: FinishReason, error: str | None) -> None:
        req = self.scheduler.finish(rid, reason, error)
        if req is None:
            return
        t = self._tracked.pop(rid)
        self.finished_by_reason[reason] += 1
        if reason is not FinishReason.ABORT:
            t.stream.put(RequestOutput(rid, (), t.text("", final=True), True, reason,
                                       req.num_prompt_tokens, req.num_output_tokens,
                                       error=error, seed=t.seed))

    def _note_scheduled(self, seqs) -> None:
        now = None
        for s in seqs:
            t = self._tracked.get(s.request_id)
            if t is not None and t.queue_time_ms is None:
                now = now or time.monotonic()
                t.queue_time_ms = (now - self.scheduler.requests[s.request_id].arrival_time) * 1e3

    def _emit(self, req: Request, toks: list[int], now: float,
              logprob: TokenLogprob | None) -> None:
        t = self._tracked[req.request_id]
        text = t.text(t.detok.add(toks), final=req.finished)
        stop_reason: str | int | None = None
        if t.stop is not None and t.stop.hit is not None:
            # a stop string completed: the request ends here, as if on EOS
            stop_reason = t.stop.hit
            if not req.finished:
                self.scheduler.finish(req.request_id, FinishReason.EOS)
            req.finish_reason = FinishReason.EOS
        elif req.finished and req.finish_reason is FinishReason.EOS \
                and toks[-1] in req.params.stop_token_ids:
            stop_reason = toks[-1]
        first = not t.emitted_first
        t.emitted_first = True
        out = RequestOutput(
            request_id=req.request_id, new_token_ids=tuple(toks), new_text=text,
            finished=req.finished, finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            prefill_time_ms=(now - req.arrival_time) * 1e3 if first else None,
            decode_time_ms=None if first else (now - t.last_emit) * 1e3,
            seed=t.seed, logprobs=(logprob,) if logprob is not None else None,
            stop_reason=stop_reason if req.finished else None,
            queue_time_ms=t.queue_time_ms if first else None,
            num_cached_tokens=req.num_cached_tokens)
        t.last_emit = now
        if req.finished:
            self._tracked.pop(req.request_id)
            self.finished_by_reason[req.finish_reason] += 1
        t.stream.put(out)
