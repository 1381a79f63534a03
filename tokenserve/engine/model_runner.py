"""ModelRunner: turns a StepPlan into input tensors, runs the forward pass, samples.

Synchronous and thread-confined: only the executor's worker thread calls :meth:`step`.
It owns the model and the KV cache tensors; the scheduler owns the block *ids*.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import torch

from tokenserve.engine.sampler import sample
from tokenserve.messages import ScheduledSeq, StepPlan, StepResult, TokenLogprob
from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.llama import LlamaForCausalLM

log = logging.getLogger("tokenserve.engine")


class ModelRunner:
    """Runs one continuous-batching step at a time on ``model`` with a paged KV cache.

    Args:
        model: the decoder.
        num_blocks: KV blocks to allocate.
        block_size: tokens per block.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        #: every layer's K and V in one contiguous tensor ``[layers, 2, num_blocks, Hkv,
        #: block_size, D]`` (what a KV transfer engine registers, PD)
        self.kv_region = self.kv_caches[0][0]._base
        assert self.kv_region is not None and self.kv_region.is_contiguous()
        #: test hook: called with each (sub-)plan's seqs before its forward pass; raising
        #: there injects a fault into the step (tests of per-request failure isolation)
        self.fault_hook: Callable[[list[ScheduledSeq]], None] | None = None

    def prepare(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Input ids [T] int64 and the step's attention metadata, seqs in plan order."""
        ids = list(itertools.chain.from_iterable(s.token_ids for s in seqs))
        meta = AttentionMetadata.build(
            self.model.kernels, [s.block_table for s in seqs], [len(s.token_ids) for s in seqs],
            [s.num_computed for s in seqs], self.block_size, self.device)
        return torch.tensor(ids, dtype=torch.int64, device=self.device), meta

    def step(self, plan: StepPlan) -> StepResult:
        """Forward + sample for every seq in ``plan``.

        One bad request never fails the others: a row that cannot be sampled
        (non-finite logits) fails alone, and when the step raises, every seq is run again
        on its own (generators rewound first, so seeded requests draw the same numbers;
        KV rows are rewritten with the same values), and only the seqs that still raise
        fail, in ``StepResult.failed``. A one-seq step that raises raises.
        """
        t0 = time.perf_counter()
        states = {s.request_id: s.generator.get_state() for s in plan.seqs
                  if s.generator is not None}
        try:
            return self._step(plan.step_id, plan.seqs, t0)
        except Exception as exc:
            if len(plan.seqs) == 1:
                raise
            log.warning("step %d failed (%s: %s); re-running its %d requests one by one",
                        plan.step_id, type(exc).__name__, exc, len(plan.seqs))
        merged = StepResult(plan.step_id, {}, 0.0)
        for s in plan.seqs:
            if s.generator is not None:
                s.generator.set_state(states[s.request_id])
            try:
                r = self._step(plan.step_id, [s], t0)
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                log.warning("request %s fails alone: %s: %s", s.request_id,
                            type(exc).__name__, exc)
                merged.failed[s.request_id] = f"{type(exc).__name__}: {exc}"
                continue
            merged.sampled.update(r.sampled)
            merged.logprobs.update(r.logprobs)
            merged.failed.update(r.failed)
        merged.forward_ms = (time.perf_counter() - t0) * 1e3
        return merged

    def _step(self, step_id: int, seqs: list[ScheduledSeq], t0: float) -> StepResult:
        if self.fault_hook is not None:
            self.fault_hook(seqs)
        plan = StepPlan(step_id, seqs)
        input_ids, meta = self.prepare(plan.seqs)
        hidden = self.model.forward(input_ids, self.kv_caches, meta)
        sampled: dict[str, int] = {}
        failed: dict[str, str] = {}
        logprobs: dict[str, TokenLogprob] = {}
        rows = [i for i, s in enumerate(plan.seqs) if s.sample]
        if rows:
            to_sample = [plan.seqs[i] for i in rows]
            last = meta.query_start_loc[1:].to(torch.int64)[rows] - 1  # each seq's last token
            logits = self.model.compute_logits(hidden.index_select(0, last)).cpu()
            toks = sample(logits, [s.params for s in to_sample],
                          [s.generator for s in to_sample], [s.history for s in to_sample],
                          num_prompt_tokens=[s.num_prompt_tokens for s in to_sample]).tolist()
            for s, t in zip(to_sample, toks):
                if t < 0:
                    failed[s.request_id] = ("the model produced non-finite logits for this "
                                            "request (NaN or inf); it cannot be sampled")
                else:
                    sampled[s.request_id] = t
            want = [i for i, s in enumerate(to_sample)
                    if s.params.logprobs is not None and toks[i] >= 0]
            if want:
                logprobs = token_logprobs(logits, torch.tensor(toks), want, to_sample)
        return StepResult(plan.step_id, sampled, (time.perf_counter() - t0) * 1e3,
                          logprobs=logprobs, failed=failed)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int],
                   seqs: list[ScheduledSeq]) -> dict[str, TokenLogprob]:
    """Log-probabilities of the sampled tokens and their top alternatives.

    Taken from the raw logits (before penalties, temperature, top-k/top-p), which is
    what vLLM v1 reports by default.

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
