"""SchedulerActor: the async shell around the pure Scheduler.

The single writer of the Scheduler, its BlockPool and the request table. Its loop::

    drain inbox (block only when idle) -> timeouts -> schedule() -> executor step
        -> update() -> detokenize -> push RequestOutputs to each request's stream

Messages come in on ``inbox`` (GenerateRequest | AbortRequest, see messages.py); the
:class:`RequestHandle` of a request is registered in ``streams`` by the engine before the
GenerateRequest is queued, and removed here when its final output is put.

One place ends a request: :meth:`SchedulerActor._finish`. Whatever decided it (the
scheduler's EOS / stop id / length rule in ``Scheduler.update``, a stop string found in the
text, a timeout, an abort, an executor error), the request's blocks are freed and its one
final output is put there, with the text the detokenizer and stop-string matcher held back.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tokenserve.engine.detokenizer import IncrementalDetokenizer
from tokenserve.engine.executor import ExecutorActor
from tokenserve.engine.output_stream import RequestHandle
from tokenserve.engine.request import Request, RequestStatus
from tokenserve.engine.sampler import generator_state, make_generator, restore_generator
from tokenserve.engine.scheduler import Scheduler
from tokenserve.engine.stop_strings import StopStringMatcher
from tokenserve.messages import (
    AbortRequest,
    FinishReason,
    GenerateRequest,
    KvHandoff,
    KvPulled,
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

    def __init__(self, stream: RequestHandle, detok: IncrementalDetokenizer,
                 stop: StopStringMatcher | None, now: float, seed: int) -> None:
        self.stream = stream
        self.detok = detok
        self.stop = stop
        self.last_emit = now
        self.seed = seed
        self.emitted_first = False
        self.queue_time_ms: float | None = None

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
        self.inbox: asyncio.Queue[GenerateRequest | AbortRequest | KvPulled] = asyncio.Queue()
        #: PD decode: ``kv_puller(source, dst_blocks, num_tokens)`` copies the K/V of
        #: positions ``[0, num_tokens)`` from ``source`` (a KvAdoption's) into this
        #: instance's ``dst_blocks``; blocking (run in a worker thread), raises on failure
        self.kv_puller: Callable[[Any, list[int], int], None] | None = None
        self._pull_tasks: set[asyncio.Task] = set()
        self._sources: dict[str, Any] = {}  # request_id -> KvAdoption.source, until pulled
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
            self._pd_events()
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
            for rid, why in result.failed.items():  # rows that failed alone
                self._finish(rid, FinishReason.ERROR, why)
            now = time.monotonic()
            for req, toks in self.scheduler.update(seqs, result.sampled, now):
                self._emit(req, toks, now, result.logprobs.get(req.request_id))

    def _check_idle(self) -> None:
        pool = self.scheduler.pool
        held = pool.num_blocks - pool.num_free - len(self.scheduler.quarantined)
        assert held == 0, f"idle engine holds {held} KV blocks"
        self.idle.set()

    # ------------------------------------------------------------------ messages

    def _handle(self, msg: GenerateRequest | AbortRequest | KvPulled) -> None:
        if isinstance(msg, AbortRequest):
            self._finish(msg.request_id, msg.reason, msg.error)
        elif isinstance(msg, GenerateRequest):
            self._admit(msg)
        elif isinstance(msg, KvPulled):
            if msg.quarantine:
                log.error("KV pull for %s timed out: its blocks are quarantined (never "
                          "reused)", msg.request_id)
            failed = self.scheduler.pulled(msg.request_id, msg.error, msg.quarantine)
            if failed is not None:
                self._finish(msg.request_id, FinishReason.ERROR, msg.error)
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
        generator = None
        if params.do_sample:
            generator = (make_generator(params.seed) if adopt is None else restore_generator(
                params.seed, adopt.generator_state, len(outputs)))
        pull = adopt.num_computed if adopt is not None else 0
        req = Request(
            request_id=g.request_id, token_ids=[*g.prompt_token_ids, *outputs],
            num_prompt_tokens=len(g.prompt_token_ids), params=params, priority=g.priority,
            arrival_time=arrival, arrival_seq=next(self._seq), deadline=deadline,
            deadline_reason=reason, token_timeout_s=self.token_timeout_s,
            generator=generator, prefill_only=g.prefill_only, pull_tokens=pull,
            recompute_elsewhere=pull > 0,
            num_cached_tokens=adopt.num_cached_tokens if adopt is not None else 0)
        detok = IncrementalDetokenizer(self.tokenizer, g.prompt_token_ids,
                                       params.skip_special_tokens)
        try:
            self.scheduler.add(req)  # AsyncEngine.generate checked the id and the length
        except ValueError as exc:  # adopted tokens beyond max_seq_len or the KV cache
            self.streams.pop(g.request_id, None)
            stream.put(RequestOutput(g.request_id, (), "", True, FinishReason.ERROR,
                                     len(g.prompt_token_ids), len(outputs), error=str(exc)))
            return
        stop = (StopStringMatcher(params.stop, params.include_stop_str_in_output)
                if params.stop else None)
        t = _Tracked(stream, detok, stop, arrival, params.seed)
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
                req.num_output_tokens, seed=params.seed, replay=True))

    def _pd_events(self) -> None:
        """Start the K/V pulls the scheduler asked for; end the requests it evicted for
        recompute on a prefill instance (spec/pd_disaggregation.md §7.1)."""
        pulls, evicted = self.scheduler.take_pd_events()
        for req in evicted:
            self._finish(req.request_id, FinishReason.RECOMPUTE, req=req)
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
            error = f"Pull kv failed irreversibly. {exc}"
            quarantine = bool(getattr(exc, "timed_out", False))  # KvTransferError's flag
        self.inbox.put_nowait(KvPulled(req.request_id, error, quarantine))

    def _expire(self, now: float) -> None:
        for rid, why in self.scheduler.expired(now):
            self._finish(rid, FinishReason.TIMEOUT, f"Engine callback timeout: {why}")

    # ------------------------------------------------------------------ outputs

    def _finish(self, rid: str, reason: FinishReason, error: str | None = None, *,
                req: Request | None = None, toks: list[int] | None = None, text: str = "",
                now: float | None = None, logprob: TokenLogprob | None = None,
                stop_reason: str | int | None = None) -> None:
        """The one place a request ends: free its blocks (unless ``Scheduler.update``
        already did, passing the finished ``req``), count it, and put its one final
        output: ``toks`` / ``text`` of its last step plus what was held back."""
        live = self.scheduler.finish(rid, reason, error)
        req = live or req
        self._sources.pop(rid, None)
        t = self._tracked.pop(rid, None)
        if t is None or req is None:
            return  # unknown or already ended
        text = t.text(text, final=True)
        if (stop_reason is None and t.stop is not None and t.stop.hit is not None
                and reason in (FinishReason.EOS, FinishReason.LENGTH)):
            reason, stop_reason = FinishReason.EOS, t.stop.hit  # completed by the held text
            req.finish_reason = reason
        self.finished_by_reason[reason] += 1
        self.streams.pop(rid, None)
        t.stream.put(self._output(req, t, toks or [], text, now, logprob, finished=True,
                                  reason=reason, error=error, stop_reason=stop_reason))

    def _output(self, req: Request, t: _Tracked, toks: list[int], text: str,
                now: float | None, logprob: TokenLogprob | None, *, finished: bool,
                reason: FinishReason | None = None, error: str | None = None,
                stop_reason: str | int | None = None) -> RequestOutput:
        first = bool(toks) and not t.emitted_first
        out = RequestOutput(
            request_id=req.request_id, new_token_ids=tuple(toks), new_text=text,
            finished=finished, finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            prefill_time_ms=(now - req.arrival_time) * 1e3 if first and now else None,
            decode_time_ms=(now - t.last_emit) * 1e3 if toks and not first and now else None,
            error=error, seed=t.seed, logprobs=(logprob,) if logprob is not None else None,
            stop_reason=stop_reason,
            queue_time_ms=t.queue_time_ms if first else None,
            num_cached_tokens=req.num_cached_tokens)
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
              logprob: TokenLogprob | None) -> None:
        """Put the output of a step that gave ``req`` tokens; end it when the scheduler
        did (EOS, stop id, length) or the text completed a stop string."""
        t = self._tracked[req.request_id]
        t_stop = t.stop
        text = t.detok.add(toks)
        if t_stop is not None:
            text = t_stop.feed(text)
        if t_stop is not None and t_stop.hit is not None:
            # a stop string completed: the request ends here, as if on EOS
            self._finish(req.request_id, FinishReason.EOS, req=req, toks=toks, text=text,
                         now=now, logprob=logprob, stop_reason=t_stop.hit)
        elif req.finished:
            reason = req.finish_reason or FinishReason.EOS
            stop_id = (toks[-1] if reason is FinishReason.EOS
                       and toks[-1] in req.params.stop_token_ids else None)
            self._finish(req.request_id, reason, req.error, req=req, toks=toks, text=text,
                         now=now, logprob=logprob, stop_reason=stop_id)
        else:
            out = self._output(req, t, toks, text, now, logprob, finished=False)
            if req.status is RequestStatus.PARKED:  # PD prefill: the decode instance's part
                out = replace(out, handoff=KvHandoff(
                    tuple(req.block_table), req.num_computed, generator_state(req.generator)))
            t.stream.put(out)
