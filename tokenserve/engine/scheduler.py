"""Continuous-batching scheduler (pure, synchronous; no torch, no asyncio).

There is no separate prefill or decode phase: each step has one token budget
(``max_num_batched_tokens``, MindIE's ``maxPrefillTokens``). Running requests are
served first (a decode needs one token, an unfinished prefill the rest of its prompt),
then waiting ones in (priority, arrival) order. A prompt longer than what is left of
the budget is prefilled in chunks across steps, so decodes keep flowing (after vLLM
v1's scheduler and Sarathi-Serve, Agrawal et al. 2024).

Long prompts must not hold short ones back (head-of-line blocking). A prefill is
*long* while more than ``long_prefill_token_threshold`` of its tokens are still to be
computed (MindIE ``longPrefillTokenThreshold``, vLLM's partial-prefill scheduler):

- a long prefill is first given only the threshold (its guaranteed progress per step);
  decodes and short prefills then take their share. If the step holds no short prefill
  of the same or higher priority, the long prefill also gets whatever budget is left
  (few, budget-sized chunks: on a CPU every chunk re-streams the weights); if it does, the
  long one stays at the threshold, so the short prompt's step, hence its TTFT, stays
  short. Short or long is judged on the tokens left to compute after the prefix cache;
- at most ``max_long_partial_prefills`` long prefills of the same or higher priority
  are in progress at once (MindIE ``maxLongPartialPrefills``); a long waiting request
  beyond that is passed over, so shorter ones queued behind it start at once instead
  of after the long one's whole prefill. It keeps its place and starts as soon as a
  slot frees, so it cannot starve.

When KV blocks run out, the lowest-priority, latest-arrived running request is
preempted by recompute: its blocks are freed and it rejoins the waiting queue with
its generated tokens, to be prefilled again later (Kwon et al. 2023, §4.5). A waiting
request of strictly higher priority than a running one also preempts it when the batch
or the KV cache is full, so urgent work never waits behind a long queue of bulk work
(but not for a request the long-prefill slots hold back: it could not start anyway).

PD disaggregation (spec/pd_disaggregation.md): a prefill instance parks a
``prefill_only`` request after its first token, its blocks held for the decode instance;
a decode instance pulls an adopted request's K/V before it runs. The requests outside the
waiting queue and the running batch, and their blocks, are ``parking.py``'s
(:class:`~tokenserve.engine.parking.Parking`); the moves between them are here.

Admission looks the prompt up in the prefix cache first (see ``block_pool.py``): the
cached blocks are shared, and only the rest is computed. The hit is capped so at least
one token is computed, since the last position's logits are needed to sample. A request
that asks for prompt log-probabilities skips the lookup (every prompt position's logits
are needed; its computed blocks still enter the cache for others), as vLLM v1 does.
A request with ``max_new_tokens == 0`` is prefilled and ends with ``LENGTH`` without
sampling (prompt log-probabilities only).

Speculative decoding (``SchedulerConfig.spec``): once the step is planned, greedy decodes
may carry draft tokens from prompt lookup, in the budget left over and in free blocks;
:meth:`Scheduler.update` commits the accepted ones. Who gets drafts, and why the output
stays bit-identical, is ``drafting.py``'s (:class:`~tokenserve.engine.drafting.Drafter`).
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Collection
from dataclasses import dataclass

from tokenserve.config.tree import SpecConfig
from tokenserve.engine import finish as rules
from tokenserve.engine.block_pool import BlockPool, block_key
from tokenserve.engine.drafting import Drafter
from tokenserve.engine.finish import Finish
from tokenserve.engine.parking import Parking
from tokenserve.engine.request import Request, RequestStatus
from tokenserve.messages import FinishReason, ScheduledSeq, SeqStart


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits (names after MindIE's ScheduleConfig, spec config.md §3).

    Attributes:
        max_batch_size: most requests in the running batch (``maxBatchSize``).
        max_num_batched_tokens: token budget of one step (``maxPrefillTokens``).
        max_seq_len: prompt + output cap per request, tokens (``maxSeqLen``).
        max_prefill_batch_size: most requests prefilling in one step
            (``maxPrefillBatchSize``).
        long_prefill_token_threshold: with chunked prefill, a prefill with more tokens
            than this still to compute is *long* (MindIE ``longPrefillTokenThreshold``,
            vLLM's ``long_prefill_token_threshold``); it is also the least a long prefill
            computes per step. 0 = a quarter of the step budget.
        max_long_partial_prefills: most long prefills of the same or higher priority in
            progress at once (MindIE ``maxLongPartialPrefills``); shorter prompts queued
            behind a long one that must wait are admitted ahead of it.
        enable_chunked_prefill: split prompts longer than the step's remaining budget
            across steps; when off, a prompt is prefilled whole in one step (the budget
            then only limits admissions), stalling running decodes for that step.
        eos_token_ids: ids that end a request (unless ``ignore_eos``), from the model's
            generation config.
        spec: speculative decoding by prompt lookup, or None (off).
        kv_window: tokens every layer's attention looks back (the model's sliding window
            when all its layers have one; Mistral), 0 = none. A running request then gives
            back each KV block no future query of it can see, so it holds about
            ``kv_window`` tokens of cache, not its whole length (:meth:`Scheduler.
            _release_out_of_window`).
    """

    max_batch_size: int = 200
    max_num_batched_tokens: int = 8192
    max_seq_len: int = 8192
    max_prefill_batch_size: int = 50
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_long_partial_prefills: int = 1
    eos_token_ids: frozenset[int] = frozenset()
    spec: SpecConfig | None = None
    kv_window: int = 0

    def __post_init__(self) -> None:
        if self.kv_window < 0:
            raise ValueError("kv_window must be >= 0")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        for name in ("max_batch_size", "max_num_batched_tokens", "max_seq_len",
                     "max_prefill_batch_size", "max_long_partial_prefills"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class Scheduler:
    """Owns the request table, the waiting queue, the running batch and the block pool."""

    def __init__(self, cfg: SchedulerConfig, pool: BlockPool) -> None:
        self.cfg = cfg
        self.pool = pool
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key
        self.running: list[Request] = []  # in admission order
        #: PD: parked (prefill) and pulling (decode) requests, their blocks, the events
        #: for the actor
        self.parking = Parking(pool)
        #: speculative decoding: drafts and their acceptance counts
        self.drafter = Drafter(cfg.spec, pool, cfg.max_seq_len)
        #: ended requests whose sampling state the model thread still holds
        self._dropped: list[str] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of which found there
        # a prefill with more tokens than this left is long; without chunking, none is
        self._long_threshold = sys.maxsize
        if cfg.enable_chunked_prefill:
            self._long_threshold = (cfg.long_prefill_token_threshold
                                    or max(1, cfg.max_num_batched_tokens // 4))

    # ------------------------------------------------------------------ queue changes

    def add(self, req: Request) -> None:
        """Queue a new request. Its id is new and its tokens fit ``max_seq_len`` and the
        KV cache with room for one more: ``AsyncEngine.generate``, the engine's one
        admission check, made sure (asserted here)."""
        assert req.request_id not in self.requests, f"duplicate request_id {req.request_id!r}"
        assert req.num_tokens < self.cfg.max_seq_len, "request longer than max_seq_len"
        assert self.pool.blocks_for(req.num_tokens + 1) <= self.pool.num_blocks, \
            "request larger than the whole KV cache"
        self.requests[req.request_id] = req
        self._enqueue(req)

    def finish(self, request_id: str, reason: FinishReason, error: str | None = None,
               stop_reason: str | int | None = None) -> Request | None:
        """End a request wherever it is (for a reason :mod:`~tokenserve.engine.finish`
        decided, or a failure); frees its blocks at once.

        Returns the request, or None if it is unknown or already finished.
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.PARKED, RequestStatus.PULLING):
            self.parking.leave(req)  # a pull in flight keeps its blocks until it returns
        elif req in self.waiting:
            self.waiting.remove(req)
        self._end(req, reason)
        req.error, req.stop_reason = error, stop_reason
        return req

    def expired(self, now: float) -> list[tuple[str, Finish]]:
        """(request_id, its TIMEOUT) for every request whose deadline has passed
        (:func:`tokenserve.engine.finish.expiry`)."""
        out = []
        for req in self.requests.values():
            fin = rules.expiry(req, now)
            if fin is not None:
                out.append((req.request_id, fin))
        return out

    def next_deadline(self) -> float:
        """Earliest instant (monotonic s) at which some request may time out."""
        return min(map(rules.next_deadline, self.requests.values()), default=float("inf"))

    def has_work(self) -> bool:
        """Anything queued, running, parked for a decode instance or pulling K/V."""
        return bool(self.running or self.waiting or self.parking.has_work())

    @property
    def num_draft_tokens(self) -> int:
        """Speculative decoding: draft tokens verified."""
        return self.drafter.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        """Speculative decoding: draft tokens accepted."""
        return self.drafter.num_accepted_tokens

    def pulled(self, request_id: str, error: str | None = None,
               quarantine: bool = False) -> Request | None:
        """A pull started for ``request_id`` returned. On success the request runs from
        the next step with ``pull_tokens`` computed. Returns the request when it failed
        (``error``; the caller ends it) or None (done, or it had ended meanwhile). With
        ``quarantine`` (a timed-out pull: late writes may still land) its blocks are
        never reused."""
        req = self.parking.pulled(request_id, error, quarantine)
        if req is None:
            return None
        if error is not None:
            self.waiting.append(req)  # WAITING: finish() frees its blocks
            return req
        self.running.append(req)
        return None

    def take_dropped(self) -> tuple[str, ...]:
        """Ids of the requests that ended since the last call and whose sampling state
        the model thread holds (they go in the next ``StepPlan.drop``)."""
        out, self._dropped = tuple(self._dropped), []
        return out

    def take_pd_events(self) -> tuple[list[Request], list[Request]]:
        """(requests whose K/V pull must start now, requests evicted for recompute on a
        prefill instance) since the last call."""
        return self.parking.take_events()

    # ------------------------------------------------------------------ one step

    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's work and reserve KV blocks for it."""
        self._preempt_for_priority()
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        plan: dict[str, int] = {}  # request_id -> tokens this step, in scheduling order
        reqs: list[Request] = []
        longs: list[Request] = []  # long prefills, given their guaranteed share so far
        prefills = 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            long_ = self._is_long(req)
            n = self._share(req, budget, long_)
            assert n > 0, "running request with nothing to compute"
            if not self._reserve(req, n, protected=plan.keys()):
                continue  # req itself was preempted; running[i] is now the next one
            plan[req.request_id] = n
            reqs.append(req)
            if long_:
                longs.append(req)
            prefills += n > 1
            budget -= n
            i += 1
        admitted, budget, prefills = self._admit_waiting(plan, reqs, longs, budget, prefills)
        while budget > 0 and longs:
            # the leftover budget goes to long prefills, unless a short prefill of the same
            # or higher priority is in the step (its step, hence its TTFT, stays short)
            ids = {r.request_id for r in longs}
            short_prio = min((r.priority for r in reqs
                              if r.request_id not in ids and _is_prefill(r)),
                             default=sys.maxsize)
            finished = 0
            for req in sorted(longs, key=Request.sort_key):
                if budget <= 0:
                    break
                if req.priority >= short_prio:
                    continue
                extra = self._grow(req, plan[req.request_id], budget)
                plan[req.request_id] += extra
                budget -= extra
                finished += extra > 0 and plan[req.request_id] == req.num_tokens - req.num_computed
            if not finished:
                break
            # a long prefill completes in this step: its slot is free for the next one
            admitted, budget, prefills = self._admit_waiting(
                plan, reqs, longs, budget, prefills, longs_only=True)
            if not admitted:
                break
        drafts = self.drafter.drafts(reqs, plan, budget)
        return [self._seq(r, plan[r.request_id], drafts.get(r.request_id, ())) for r in reqs]

    def update(self, seqs: list[ScheduledSeq], sampled: dict[str, int], now: float,
               accepted: dict[str, tuple[int, ...]] | None = None,
               ) -> list[tuple[Request, list[int]]]:
        """Apply a step's results.

        Args:
            seqs: the plan :meth:`schedule` returned.
            sampled: request_id -> sampled token for seqs with ``sample``.
            now: monotonic time (s) of the step's end.
            accepted: request_id -> the tokens after the sampled one that a seq with a
                draft gained (``StepResult.accepted``).

        Returns:
            (request, new token ids) for each request that gained tokens; finished
            requests have been removed and their blocks freed.
        """
        out = []
        accepted = accepted or {}
        for seq in seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished while the step ran
            if not seq.sample:
                req.num_computed += len(seq.token_ids)
                self._register_full_blocks(req)
                if req.params.max_new_tokens == 0 and req.num_computed == req.num_tokens:
                    # prefill only: the prompt is computed (its logprobs with it); done
                    self.finish(req.request_id, FinishReason.LENGTH)
                    out.append((req, []))
                else:
                    self._release_out_of_window(req)
                continue
            new = [sampled[seq.request_id], *accepted.get(seq.request_id, ())]
            req.prompt_lp_pending = False  # every prompt position is computed by now
            # K/V are valid for the step's own token(s) and the accepted drafts
            req.num_computed += len(seq.token_ids) - len(seq.draft) + len(new) - 1
            self._register_full_blocks(req, pending=new[:-1])
            if seq.draft:
                self.drafter.verified(req, len(seq.draft), len(new) - 1)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            fin = None
            for n, tok in enumerate(new, 1):
                req.token_ids.append(tok)
                fin = rules.after_token(
                    req.params, tok, num_output_tokens=req.num_output_tokens,
                    num_tokens=req.num_tokens, max_seq_len=self.cfg.max_seq_len,
                    eos_token_ids=self.cfg.eos_token_ids,
                    next_fits=self.pool.blocks_for(req.num_tokens + 1) <= self.pool.num_blocks)
                if fin is not None:
                    new = new[:n]
                    break
            if fin is not None:
                self.finish(req.request_id, fin.reason, stop_reason=fin.stop_reason)
            elif req.prefill_only:  # PD prefill: the blocks wait for the decode instance
                self.running.remove(req)
                self.parking.park(req, now)
            elif seq.draft:
                self.drafter.free_rejected(req)
            if req.status is RequestStatus.RUNNING:
                self._release_out_of_window(req)
            out.append((req, new))
        return out

    def _release_out_of_window(self, req: Request) -> None:
        """Give back the blocks before every future query's window (``kv_window``).

        The next query sits at position ``num_computed`` or later and sees keys from
        ``num_computed - W + 1``; a block whose last position is before that is never
        read again (``csrc/attention.cpp`` skips blocks before a tile's first window)::

            block table   [ b0 | b1 | b2 | b3 | b4 ]      block_size 4, W = 6
            positions       0-3  4-7  8-11 12-15 16..      num_computed = 17
            next query 17 sees 12..17: b0, b1, b2 released (b2's last position 11 < 12)

        Released entries stay in the table (positions keep their blocks' indices, and
        the kernel is handed a valid block id it will not read); ``num_released`` counts
        them so that they are freed once. Not on a PD prefill instance (its blocks go to
        the decode instance whole) nor before a decode instance pulled them.
        """
        w = self.cfg.kv_window
        if not w or req.prefill_only or req.pull_tokens:
            return
        out = min(max(0, (req.num_computed - w + 1) // self.pool.block_size),
                  len(req.block_table))
        if out > req.num_released:
            self.pool.free(req.block_table[req.num_released:out])
            req.num_released = out

    # ------------------------------------------------------------------ internals

    def _admit_waiting(self, plan: dict[str, int], reqs: list[Request],
                       longs: list[Request], budget: int, prefills: int,
                       longs_only: bool = False) -> tuple[int, int, int]:
        """Admit waiting requests in queue order into this step's plan (in place).

        With ``longs_only`` (after a long prefill completed mid-step), only long ones
        are considered: short ones have had their turn with more budget.

        Returns (number admitted, budget left, prefills in the step).
        """
        cfg = self.cfg
        busy = self._busy_long_prefills(plan)
        admitted = j = 0
        while (j < len(self.waiting) and budget > 0
               and len(self.running) + len(self.parking.pulling) < cfg.max_batch_size
               and prefills < cfg.max_prefill_batch_size):
            req = self.waiting[j]
            if req.pull_tokens:
                if not self.parking.start_pull(req):
                    break  # wait for blocks, in queue order
                self.waiting.pop(j)
                continue
            long_ = self._is_long(req)
            if long_ and not self._slot_free(busy, req):
                if longs_only:
                    break  # the queue is in priority order: later long ones are held too
                j += 1  # shorter prompts behind it may start; it keeps its place
                continue
            if longs_only and not long_:
                j += 1
                continue
            # without chunking a prompt is prefilled whole, overrunning the budget (a
            # budget below the prompt would otherwise starve it behind running decodes)
            limit = (self._share(req, budget, long_) if cfg.enable_chunked_prefill
                     else max(budget, req.num_tokens))
            if not self._admit(req, limit):
                break  # no preemption to admit equal-priority work: wait for blocks
            self.waiting.pop(j)
            n = min(req.num_tokens - req.num_computed, limit)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan[req.request_id] = n
            reqs.append(req)
            if long_:  # judged after the prefix cache, as _admit found it
                longs.append(req)
                if n < req.num_tokens - req.num_computed:
                    busy[req.priority] += 1
            admitted += 1
            prefills += 1
            budget -= n
        return admitted, budget, prefills

    def _busy_long_prefills(self, plan: dict[str, int]) -> collections.Counter[int]:
        """priority -> running long prefills that stay unfinished after ``plan``."""
        return collections.Counter(
            r.priority for r in self.running
            if self._is_long(r) and plan.get(r.request_id, 0) < r.num_tokens - r.num_computed)

    def _slot_free(self, busy: collections.Counter[int], req: Request) -> bool:
        """Whether the long request ``req`` may start beside the ``busy`` ones: fewer than
        ``max_long_partial_prefills`` of the same or higher priority."""
        held = sum(n for prio, n in busy.items() if prio <= req.priority)
        return held < self.cfg.max_long_partial_prefills

    def _to_compute(self, req: Request) -> int:
        """Tokens ``req`` still has to compute; for a waiting request, net of what the
        prefix cache holds (as :meth:`_admit` will find it)."""
        if req.status is RequestStatus.RUNNING:
            return req.num_tokens - req.num_computed
        if self._long_threshold == sys.maxsize or _wants_prompt_logprobs(req):
            return req.num_tokens  # nothing is long, or no lookup: no need to look
        return req.num_tokens - len(self.pool.lookup(self._prefix_keys(req))) * self.pool.block_size

    def _is_long(self, req: Request) -> bool:
        if req.num_tokens - req.num_computed <= self._long_threshold:
            return False  # short even with no prefix-cache hit: skip the lookup
        return self._to_compute(req) > self._long_threshold

    def _share(self, req: Request, budget: int, long_: bool) -> int:
        """Tokens ``req`` (``long_``: :meth:`_is_long`) is first given this step: the rest
        of its prompt (or its one decode token), but only the guaranteed threshold for a
        long prefill."""
        n = min(req.num_tokens - req.num_computed, budget)
        return min(n, self._long_threshold) if long_ else n

    def _prefix_keys(self, req: Request) -> list:
        """Prefix-cache keys of ``req``'s full blocks, at most ``(num_tokens - 1) //
        block_size`` of them (at least one token must be computed); memoized."""
        if req.prefix_keys is None or req.prefix_keys[0] != req.num_tokens:
            bs = self.pool.block_size
            keys, prev = [], None
            for i in range((req.num_tokens - 1) // bs):
                key = block_key(prev, tuple(req.token_ids[i * bs:(i + 1) * bs]))
                keys.append(key)
                prev = hash(key)
            req.prefix_keys = (req.num_tokens, keys)
        return req.prefix_keys[1]

    def _grow(self, req: Request, planned: int, budget: int) -> int:
        """Extend a long prefill planned for ``planned`` tokens by up to ``budget`` more,
        as far as free blocks allow (no preemption for this bonus). Returns the extra."""
        bs = self.pool.block_size
        room = (len(req.block_table) + self.pool.num_free) * bs - req.num_computed
        total = min(req.num_tokens - req.num_computed, planned + budget, room)
        if total <= planned:
            return 0
        need = self.pool.blocks_for(req.num_computed + total) - len(req.block_table)
        if need > 0:
            req.block_table += self.pool.allocate(need)
        return total - planned

    def _seq(self, req: Request, n: int, draft: tuple[int, ...] = ()) -> ScheduledSeq:
        start = req.num_computed
        first = None
        if not req.on_runner:  # the model thread sees it for the first time
            req.on_runner = True
            first = SeqStart(tuple(req.token_ids), req.num_prompt_tokens, req.adopted_state,
                             draws=req.num_output_tokens, grammar=req.grammar)
        # a prefill-only request (max_new_tokens 0) samples nothing
        sample = start + n == req.num_tokens and req.params.max_new_tokens > 0
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=tuple(req.token_ids[start:start + n]) + draft,
            num_computed=start,
            block_table=tuple(req.block_table),
            sample=sample,
            params=req.params,
            start=first,
            export_state=sample and req.prefill_only,
            draft=draft,
            prompt_logprobs=(_wants_prompt_logprobs(req)
                             and start < req.num_prompt_tokens - 1),
        )

    def _admit(self, req: Request, budget: int) -> bool:
        """Give a waiting request its cached prefix and blocks for its first chunk.

        Returns False (and changes nothing) when the blocks are not there.
        """
        bs = self.pool.block_size
        keys = self._prefix_keys(req)
        hits = self.pool.lookup(keys) if not _wants_prompt_logprobs(req) else []
        self.pool.acquire(hits)
        n = min(req.num_tokens - len(hits) * bs, budget)
        need = self.pool.blocks_for(len(hits) * bs + n) - len(hits)
        if need > self.pool.num_free:
            self.pool.free(hits)
            return False
        req.block_table = hits + self.pool.allocate(need)
        req.block_hashes = [hash(k) for k in keys[: len(hits)]]
        req.num_computed = len(hits) * bs
        if not req.first_scheduled:  # count a prompt once, not again after preemption
            req.first_scheduled = True
            req.num_cached_tokens = req.num_computed
            self.prefix_query_tokens += req.num_prompt_tokens
            self.prefix_hit_tokens += min(req.num_computed, req.num_prompt_tokens)
        return True

    def _register_full_blocks(self, req: Request, pending: list[int] | None = None) -> None:
        """Enter the request's newly full, computed blocks into the prefix cache;
        ``pending``: tokens after ``req.token_ids`` whose K/V are computed but that are
        not committed yet (accepted drafts)."""
        bs = self.pool.block_size
        ids = req.token_ids + pending if pending else req.token_ids
        while len(req.block_hashes) < req.num_computed // bs:
            i = len(req.block_hashes)
            prev = req.block_hashes[-1] if req.block_hashes else None
            key = block_key(prev, tuple(ids[i * bs:(i + 1) * bs]))
            req.block_hashes.append(self.pool.register(req.block_table[i], key))

    def _preempt_for_priority(self) -> None:
        """Preempt running work of strictly lower priority than the first waiting request
        that could start now (one held back by the long-prefill slots cannot) while the
        batch or the KV cache leaves it no room for its first chunk."""
        if not (self.waiting and self.running):
            return
        busy = self._busy_long_prefills({})
        head = next((r for r in self.waiting
                     if not self._is_long(r) or self._slot_free(busy, r)), None)
        if head is None:
            return
        need = self.pool.blocks_for(min(self._to_compute(head), self._long_threshold) + 1)
        while self.running:
            victim = max(self.running, key=Request.sort_key)
            if victim.priority <= head.priority:
                return
            if len(self.running) < self.cfg.max_batch_size and need <= self.pool.num_free:
                return
            self._preempt(victim)

    def _reserve(self, req: Request, n: int, protected: Collection[str]) -> bool:
        """Make sure ``req`` has blocks for ``n`` more tokens, preempting if needed.

        Returns False if ``req`` itself had to be preempted.
        """
        need = self.pool.blocks_for(req.num_computed + n) - len(req.block_table)
        while need > self.pool.num_free:
            victim = max((r for r in self.running if r.request_id not in protected),
                         key=Request.sort_key)
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.block_table += self.pool.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        if req.recompute_elsewhere:  # PD decode: a prefill instance recomputes it
            self.running.remove(req)
            del self.requests[req.request_id]
            self._end(req, FinishReason.RECOMPUTE)
            self.num_preemptions += 1
            self.parking.evicted(req)
            return
        # recompute here: the model thread keeps the request's sampling state, as a
        # recompute only recomputes K/V (the generator continues where it was)
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    def _end(self, req: Request, reason: FinishReason) -> None:
        """``req`` (out of every queue) is finished: free its blocks, tell the model
        thread to drop its sampling state."""
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req.on_runner:
            self._dropped.append(req.request_id)

    def _release(self, req: Request) -> None:
        self.pool.free(req.block_table[req.num_released:])  # the rest went back earlier
        req.block_table = []
        req.block_hashes = []
        req.num_released = 0

    def _enqueue(self, req: Request) -> None:
        key = req.sort_key()
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].sort_key() > key:
            i -= 1
        self.waiting.insert(i, req)


def _wants_prompt_logprobs(req: Request) -> bool:
    """Whether ``req``'s prompt log-probabilities are still to be computed
    (``Request.prompt_lp_pending``: cleared by its first sampled token, so a recompute
    after preemption does not send them again). Such a request skips the prefix-cache
    lookup: a cached block holds K/V but not the logits of its positions."""
    return bool(req.prompt_lp_pending)


def _is_prefill(req: Request) -> bool:
    """Whether ``req``'s work this step is (the end of) a prefill, not a decode."""
    return req.first_token_time is None or req.num_tokens - req.num_computed > 1
