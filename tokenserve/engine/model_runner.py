"""The model thread: :class:`ModelRunner` turns a StepPlan into input tensors, runs the
forward pass and samples; :class:`ExecutorActor` is its async shell.

ModelRunner is synchronous and thread-confined: only the executor's worker thread calls
:meth:`ModelRunner.step`. It owns the model, the KV cache tensors and every request's
sampling state (generator, token history); the scheduler owns the block *ids* and the
request's tokens.

ExecutorActor runs ModelRunner.step() on that worker thread, one step in flight. The
forward pass never runs on the event loop: torch releases the GIL inside its ops, so HTTP
stays responsive while a step computes.

The worker thread (the *model thread*) should also load the model
(:meth:`ExecutorActor.start`): it is then the process's only OpenMP master. Every thread
that enters an OpenMP parallel region gets a team of its own, and once libgomp manages
more threads than there are CPUs it stops spinning and puts idle workers to sleep after
each region; with ~300 short parallel regions per decode step the wake-ups cost more than
the kernels (measured on 2 cores: a batch-1 step 15 ms with one master, 23-27 ms once a
second thread had used OpenMP).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from tokenserve.engine.sampler import SamplingState, generator_state, sample
from tokenserve.grammar.matcher import (
    GrammarMatcher,
    apply_masks,
    blocked_tokens,
    fill_masks,
    mask_words,
)
from tokenserve.messages import (
    PromptLogprobs,
    ScheduledSeq,
    StepPlan,
    StepResult,
    TokenLogprob,
)
from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.decoder import CausalLM

log = logging.getLogger("tokenserve.engine")


class ModelRunner:
    """Runs one continuous-batching step at a time on ``model`` with a paged KV cache.

    Args:
        model: the decoder.
        num_blocks: KV blocks to allocate.
        block_size: tokens per block.
    """

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        #: the KV cache's element type (None given: the model dtype; ``torch.int8``: rows
        #: with a scale each, ``CausalLM.kv_cache_dtype``)
        self.kv_dtype = kv_dtype or model.dtype
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, self.kv_dtype)
        #: every layer's K and V in one contiguous tensor ``[layers, 2, num_blocks, Hkv,
        #: block_size, R]`` (what a KV transfer engine registers, PD; R = head_dim, or
        #: head_dim + 4 for int8)
        self.kv_region = self.kv_caches[0][0]._base
        assert self.kv_region is not None and self.kv_region.is_contiguous()
        #: test hook: called with each (sub-)plan's seqs before its forward pass; raising
        #: there injects a fault into the step (tests of per-request failure isolation)
        self.fault_hook: Callable[[list[ScheduledSeq]], None] | None = None
        #: request_id -> its sampling state (generator, history); the model thread's alone
        self.states: dict[str, SamplingState] = {}
        #: structured output: the helper thread that fills the constrained rows' token
        #: masks while the forward pass runs (llguidance releases the GIL; it runs no
        #: torch op, so this thread stays the only OpenMP master), started on first use
        self._mask_thread: ThreadPoolExecutor | None = None
        self._mask_executor = None
        #: structured output: ms the current step spent on masks (StepResult.mask_ms)
        self.mask_ms = 0.0

    def close(self) -> None:
        """Release the model (tensor parallelism: the other ranks stop); the executor
        calls it once its thread has finished the last step."""
        self.model.close()

    def prepare(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Input ids [T] int64 and the step's attention metadata, seqs in plan order."""
        ids = list(itertools.chain.from_iterable(s.token_ids for s in seqs))
        meta = AttentionMetadata.build(
            self.model.kernels, [s.block_table for s in seqs], [len(s.token_ids) for s in seqs],
            [s.num_computed for s in seqs], self.block_size, self.device)
        return torch.tensor(ids, dtype=torch.int64, device=self.device), meta

    def step(self, plan: StepPlan) -> StepResult:
        """Drop the state of ``plan.drop``, then forward + sample every seq in ``plan``.

        The model thread owns each request's sampling state (:class:`SamplingState`,
        generator and history), created from the seq's ``start`` the first time a request
        is seen and kept until a plan drops it; a token sampled here is appended to the
        request's history when the step stands.

        One bad request never fails the others: a row that cannot be sampled
        (non-finite logits) or whose state cannot be built fails alone, and when the step
        raises, every seq is run again on its own (generators rewound first, so seeded
        requests draw the same numbers; KV rows are rewritten with the same values), and
        only the seqs that still raise fail, in ``StepResult.failed``. A one-seq step that
        raises raises.
        """
        t0 = time.perf_counter()
        self.mask_ms = 0.0
        for rid in plan.drop:
            self.states.pop(rid, None)
        failed: dict[str, str] = {}
        seqs = []
        for s in plan.seqs:
            if s.request_id not in self.states:
                assert s.start is not None, f"first step of {s.request_id!r} without a SeqStart"
                try:
                    self.states[s.request_id] = SamplingState(s.params, s.start)
                except ValueError as exc:  # a bad adopted generator state: this row alone
                    failed[s.request_id] = str(exc)
                    continue
            seqs.append(s)
        if not seqs:
            return StepResult(plan.step_id, {}, (time.perf_counter() - t0) * 1e3,
                              failed=failed)
        gens = {s.request_id: g for s in seqs
                if (g := self.states[s.request_id].generator) is not None}
        rewind = {rid: g.get_state() for rid, g in gens.items()}
        try:
            sampled, logprobs, bad, accepted, prompt_lps = self._step(plan.step_id, seqs)
        except Exception as exc:
            self.mask_ms = 0.0
            if len(seqs) == 1:
                raise
            log.warning("step %d failed (%s: %s); re-running its %d requests one by one",
                        plan.step_id, type(exc).__name__, exc, len(seqs))
            sampled, logprobs, bad, accepted, prompt_lps = {}, {}, {}, {}, {}
            for s in seqs:
                if s.request_id in gens:
                    gens[s.request_id].set_state(rewind[s.request_id])
                try:
                    r = self._step(plan.step_id, [s])
                except Exception as exc:  # noqa: BLE001 - this request alone fails
                    log.warning("request %s fails alone: %s: %s", s.request_id,
                                type(exc).__name__, exc)
                    bad[s.request_id] = f"{type(exc).__name__}: {exc}"
                    continue
                sampled.update(r[0])
                logprobs.update(r[1])
                bad.update(r[2])
                accepted.update(r[3])
                prompt_lps.update(r[4])
        for rid, tok in list(sampled.items()):
            st = self.states[rid]
            if st.matcher is not None:
                assert rid not in accepted, "a constrained request carried a draft"
                why = st.matcher.advance(tok)
                if why is not None:  # a parser limit hit, say: this request alone fails
                    del sampled[rid]
                    bad[rid] = why
                    continue
            st.history.append(tok)
            st.history.extend(accepted.get(rid, ()))
        exported = {s.request_id: generator_state(gens[s.request_id]) for s in seqs
                    if s.export_state and s.request_id in sampled and s.request_id in gens}
        return StepResult(plan.step_id, sampled, (time.perf_counter() - t0) * 1e3,
                          logprobs=logprobs, failed={**failed, **bad},
                          generator_states=exported, accepted=accepted,
                          prompt_logprobs={k: v for k, v in prompt_lps.items() if k not in bad},
                          mask_ms=self.mask_ms)

    def _step(self, step_id: int, seqs: list[ScheduledSeq]
              ) -> tuple[dict[str, int], dict[str, TokenLogprob], dict[str, str],
                         dict[str, tuple[int, ...]], dict[str, PromptLogprobs]]:
        """One forward + sample over ``seqs`` (their states exist); histories untouched.
        Returns (sampled, logprobs, failed rows, accepted draft continuations, prompt
        log-probabilities of the seqs with ``prompt_logprobs``).

        A seq with a draft has its last ``1 + len(draft)`` positions sampled, position j
        with the history extended by the draft's first j tokens, exactly as plain decoding
        would sample them once those tokens were generated; the draft's longest prefix
        that equals the samples is accepted, plus the sample after it."""
        if self.fault_hook is not None:
            self.fault_hook(seqs)
        input_ids, meta = self.prepare(seqs)
        masks = self._start_masks(seqs)
        hidden = self.model.forward(input_ids, self.kv_caches, meta)
        sampled: dict[str, int] = {}
        failed: dict[str, str] = {}
        logprobs: dict[str, TokenLogprob] = {}
        accepted: dict[str, tuple[int, ...]] = {}
        prompt_lps: dict[str, PromptLogprobs] = {}
        if any(s.prompt_logprobs for s in seqs):
            starts = meta.query_start_loc[:-1].tolist()
            for s, row0 in zip(seqs, starts):
                if s.prompt_logprobs:
                    st = self.states[s.request_id]
                    got = prompt_logprobs(self.model, hidden, row0, s,
                                          st.history[:st.num_prompt_tokens])
                    if got is not None:
                        prompt_lps[s.request_id] = got
        to_sample = [s for s in seqs if s.sample]
        if to_sample:
            ends = meta.query_start_loc[1:].tolist()
            rows, params, gens, hists, nprompt = [], [], [], [], []
            for s, end in zip(seqs, ends):
                if not s.sample:
                    continue
                st = self.states[s.request_id]
                for j in range(len(s.draft) + 1):  # the draft's positions, then the last
                    rows.append(end - 1 - len(s.draft) + j)
                    params.append(s.params)
                    gens.append(st.generator)
                    hists.append(st.history + list(s.draft[:j]) if j else st.history)
                    nprompt.append(st.num_prompt_tokens)
            logits = self.model.logits_at(hidden, rows).cpu()
            if masks is not None:
                self._apply_masks(logits, to_sample, masks)
            toks = sample(logits, params, gens, hists, num_prompt_tokens=nprompt).tolist()
            first_rows, i = [], 0
            for s in to_sample:
                mine = toks[i:i + len(s.draft) + 1]
                first_rows.append(i)
                i += len(mine)
                a = 0  # a failed row (< 0) never equals a draft token: acceptance stops
                while a < len(s.draft) and s.draft[a] == mine[a]:
                    a += 1
                if min(mine[:a + 1]) < 0:  # only the rows plain decoding would compute
                    failed[s.request_id] = ("the model produced non-finite logits for this "
                                            "request (NaN or inf); it cannot be sampled")
                    continue
                sampled[s.request_id] = mine[0]
                if s.draft:
                    accepted[s.request_id] = tuple(mine[1:a + 1])
            want = [k for k, s in enumerate(to_sample)
                    if s.params.logprobs is not None and s.request_id in sampled]
            if want:  # drafts never carry logprobs: their one row is first_rows[k]
                sel = torch.tensor([first_rows[k] for k in want])
                logprobs = token_logprobs(logits[sel], torch.tensor(toks)[sel],
                                          list(range(len(want))), [to_sample[k] for k in want])
        return sampled, logprobs, failed, accepted, prompt_lps

    # ------------------------------------------------------------------ structured output

    def _start_masks(self, seqs: list[ScheduledSeq]):
        """Start filling the token masks of this step's constrained sampled rows on the
        helper thread (overlapping the forward pass); None when no row is constrained, so
        an unconstrained batch pays nothing. Returns (the fill's future, each constrained
        row's position among the step's sampled rows)."""
        matchers: list[GrammarMatcher] = []
        where: list[int] = []
        k = 0
        for s in seqs:
            if not s.sample:
                continue
            m = self.states[s.request_id].matcher
            if m is not None:
                assert not s.draft, "a constrained request carried a draft"
                matchers.append(m)
                where.append(k)
            k += len(s.draft) + 1
        if not matchers:
            return None
        if self._mask_thread is None:
            from llguidance import LLExecutor
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenserve-masks")
            self._mask_executor = LLExecutor()
        fut = self._mask_thread.submit(_timed_fill, self._mask_executor, matchers,
                                       self.model.cfg.vocab_size)
        return fut, where

    def _apply_masks(self, logits: torch.Tensor, to_sample: list[ScheduledSeq], masks) -> None:
        """Wait for the masks and set the disallowed logits of the constrained rows to
        ``-inf`` (fp32, before penalties/temperature/top-k/top-p)."""
        fut, where = masks
        blocked, fill_ms = fut.result()
        t0 = time.perf_counter()
        apply_masks(logits, where, blocked)
        # the work, not the wait: the fill overlapped the forward pass
        self.mask_ms += fill_ms + (time.perf_counter() - t0) * 1e3


#: prompt rows projected to logits at once (bounds the [rows, vocab] fp32 temporaries:
#: 256 x 49152 x 4 B = 48 MiB for SmolLM2)
PROMPT_LOGPROB_ROWS = 256


def prompt_logprobs(model: CausalLM, hidden: torch.Tensor, row0: int,
                    seq: ScheduledSeq, prompt: list[int]) -> PromptLogprobs | None:
    """Log-probabilities of the prompt tokens that ``seq``'s positions predict.

    The row at position ``p`` predicts prompt token ``p + 1``, so the positions
    ``[num_computed, num_computed + n)`` of this step give the entries of prompt positions
    ``num_computed + 1 ..`` up to the prompt's last token (the last prompt position
    predicts the first generated token: that one is a sampled token's logprob). Each
    entry is the fp32 log-softmax of the raw logits (no penalties or temperature, as
    vLLM reports ``prompt_logprobs``), at the target token (with its rank) and the ``k``
    most likely.
    The lm_head rows are computed in slices of :data:`PROMPT_LOGPROB_ROWS`; every row's
    GEMM has the same reduction order whatever the slice holds (batch invariance).

    Args:
        model: the decoder (its ``logits_at``).
        hidden: [T, hidden_size] the step's final hidden states, model dtype.
        row0: ``seq``'s first row in ``hidden``.
        seq: a scheduled seq with ``prompt_logprobs`` and ``params.prompt_logprobs = k``.
        prompt: the request's prompt token ids.

    Returns:
        The entries (:class:`PromptLogprobs`, ``start = num_computed + 1``), or None
        when this step's positions predict no prompt token.
    """
    k = seq.params.prompt_logprobs
    assert k is not None
    first = seq.num_computed
    count = min(len(seq.token_ids) - len(seq.draft), len(prompt) - 1 - first)
    if count <= 0:
        return None
    entries: list[TokenLogprob] = []
    for lo in range(0, count, PROMPT_LOGPROB_ROWS):
        hi = min(count, lo + PROMPT_LOGPROB_ROWS)
        logits = model.logits_at(hidden, list(range(row0 + lo, row0 + hi))).float().cpu()
        lp = torch.log_softmax(logits, dim=-1)  # [R, V] fp32
        targets = torch.tensor(prompt[first + lo + 1:first + hi + 1], dtype=torch.int64)
        chosen = lp.gather(1, targets.unsqueeze(1))  # [R, 1]
        # counted in fp32 (exact below 2^24 tokens): twice as fast as summing the bools
        ranks = (torch.gt(lp, chosen).to(torch.float32).sum(dim=1) + 1).long().tolist()
        chosen = chosen.squeeze(1).tolist()
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, tok in enumerate(targets.tolist()):
            entries.append(TokenLogprob(tok, chosen[j], tuple(zip(top_i[j], top_v[j])),
                                        ranks[j]))
    return PromptLogprobs(first + 1, tuple(entries))


def _timed_fill(executor, matchers: list[GrammarMatcher], vocab_size: int):
    """On the mask helper thread (no torch op runs here, so it opens no OpenMP region):
    fill the matchers' bitmask and unpack it; (blocked bool ``[n, V]``, wall ms)."""
    t0 = time.perf_counter()
    bitmask = torch.empty(len(matchers), mask_words(vocab_size), dtype=torch.int32)
    fill_masks(executor, matchers, bitmask)
    blocked = blocked_tokens(bitmask, vocab_size)
    return blocked, (time.perf_counter() - t0) * 1e3


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int],
                   seqs: list[ScheduledSeq]) -> dict[str, TokenLogprob]:
    """Log-probabilities of the sampled tokens and their top alternatives.

    Taken from the raw logits (before penalties, temperature, top-k/top-p), which is
    what vLLM v1 reports by default; for a constrained row, after its grammar mask
    (disallowed tokens are ``-inf``), as vLLM applies the bitmask before its sampler.

    Args:
        logits: [S, V] float32 logits of the sampled rows.
        tokens: [S] int64 sampled ids.
        rows: indices into ``seqs``/``logits`` of the seqs asking for logprobs.
        seqs: the sampled seqs, aligned with ``logits``.
    """
    idx = torch.tensor(rows)
    lp = torch.log_softmax(logits[idx], dim=-1)  # [R, V]
    chosen = lp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
    k = max(seqs[r].params.logprobs for r in rows)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    out = {}
    for j, r in enumerate(rows):
        n = seqs[r].params.logprobs
        top = tuple(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()))
        out[seqs[r].request_id] = TokenLogprob(int(tokens[r]), chosen[j], top)
    return out


#: longest hold of the event loop while the model thread takes a step (s); see ExecutorActor.run
START_WAIT_S = 0.005


class ExecutorActor:
    """Owns the ModelRunner and its single worker thread."""

    def __init__(self, runner: ModelRunner, thread: ThreadPoolExecutor | None = None) -> None:
        self.runner = runner
        self._thread = thread or ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="tokenserve-executor")

    @classmethod
    def start(cls, load: Callable[[], ModelRunner]) -> ExecutorActor:
        """Run ``load`` (blocking) on a new model thread and keep that thread for the steps.

        Raises:
            whatever ``load`` raises (the thread is shut down first).
        """
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenserve-executor")
        try:
            runner = thread.submit(load).result()
        except BaseException:
            thread.shutdown(wait=False)
            raise
        return cls(runner, thread)

    async def run(self, plan: StepPlan) -> StepResult:
        """Execute ``plan``; a failure comes back as ``StepResult.error``, never raises.

        The event loop is held (at most :data:`START_WAIT_S`; typically < 0.1 ms) until
        the model thread has taken the plan. Otherwise the tasks that run next (writing
        the last step's tokens to every stream) take the core the woken model thread
        needs, while the OpenMP worker still spins on the other: measured 1.3-1.5 ms from
        submit to the step's start at 64 concurrent streams on 2 cores (3 % of a step),
        0.1 ms with the hold."""
        loop = asyncio.get_running_loop()
        started = threading.Event()

        def step() -> StepResult:
            started.set()
            return self.runner.step(plan)

        try:
            fut = loop.run_in_executor(self._thread, step)
            started.wait(START_WAIT_S)
            return await fut
        except Exception as exc:
            log.exception("step %d failed", plan.step_id)
            return StepResult(plan.step_id, {}, 0.0, error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.runner.close()
        mask_thread = getattr(self.runner, "_mask_thread", None)
        if mask_thread is not None:
            mask_thread.shutdown(wait=True)
