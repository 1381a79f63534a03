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
from tokenserve.messages import AbortRequest, FinishReason, GenerateRequest, RequestOutput, StepPlan

log = logging.getLogger("tokenserve.engine")


class _Tracked:
    """Actor-side bookkeeping of one live request."""

    __slots__ = ("stream", "detok", "last_emit", "seed", "emitted_first")

    def __init__(self, stream: RequestStream, detok: IncrementalDetokenizer, now: float,
                 seed: int) -> None:
        self.stream = stream
        self.detok = detok
        self.last_emit = now
        self.seed = seed
        self.emitted_first = False


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
            result = await self.executor.run(plan)
            if result.error is not None:
                for s in seqs:
                    self._finish(s.request_id, FinishReason.ERROR, result.error)
                continue
            now = time.monotonic()
            for req, toks in self.scheduler.update(seqs, result.sampled, now):
                self._emit(req, toks, now)

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
        self._tracked[g.request_id] = _Tracked(stream, detok, arrival, params.seed)

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
            t.stream.put(RequestOutput(rid, (), t.detok.flush(), True, reason,
                                       req.num_prompt_tokens, req.num_output_tokens,
                                       error=error, seed=t.seed))

    def _emit(self, req: Request, toks: list[int], now: float) -> None:
        t = self._tracked[req.request_id] if not req.finished else self._tracked.pop(req.request_id)
        text = t.detok.add(toks)
        if req.finished:
            text += t.detok.flush()
            self.finished_by_reason[req.finish_reason] += 1
        first = not t.emitted_first
        t.emitted_first = True
        out = RequestOutput(
            request_id=req.request_id, new_token_ids=tuple(toks), new_text=text,
            finished=req.finished, finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            prefill_time_ms=(now - req.arrival_time) * 1e3 if first else None,
            decode_time_ms=None if first else (now - t.last_emit) * 1e3,
            seed=t.seed)
        t.last_emit = now
        t.stream.put(out)
