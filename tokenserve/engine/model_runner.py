"""ModelRunner: turns a StepPlan into input tensors, runs the forward pass, samples.

Synchronous and thread-confined: only the executor's worker thread calls :meth:`step`.
It owns the model and the KV cache tensors; the scheduler owns the block *ids*.
"""

from __future__ import annotations

import time

import torch

from tokenserve.engine.sampler import sample
from tokenserve.messages import ScheduledSeq, StepPlan, StepResult, TokenLogprob
from tokenserve.models.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
    additive_mask,
    group_by_length,
    prefix_causal_mask,
)
from tokenserve.models.llama import LlamaForCausalLM
from tokenserve.ops.reference import context_slots, pad_block_tables, slot_mapping


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

    def step(self, plan: StepPlan) -> StepResult:
        """Forward + sample for every seq in ``plan``. Raises whatever the model raises."""
        t0 = time.perf_counter()
        # decodes sorted by context length, so that length groups are contiguous rows
        decodes = sorted((s for s in plan.seqs if s.is_decode), key=lambda s: s.num_computed)
        prefills = [s for s in plan.seqs if not s.is_decode]
        order = decodes + prefills
        input_ids, positions, seq_index, sample_rows = [], [], [], []
        for i, s in enumerate(order):
            input_ids += s.token_ids
            positions += range(s.num_computed, s.num_computed + len(s.token_ids))
            seq_index += [i] * len(s.token_ids)
            if s.sample:
                sample_rows.append(len(input_ids) - 1)
        dev = self.device
        bt = pad_block_tables([s.block_table for s in order], dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping(bt, pos_t, torch.tensor(seq_index, device=dev),
                                      self.block_size),
            num_decode=len(decodes), decode_groups=[], prefills=[])
        ctx_lens = [s.num_computed + 1 for s in decodes]
        for a, b in group_by_length(ctx_lens):
            slots, real = context_slots(bt[a:b], torch.tensor(ctx_lens[a:b], device=dev),
                                        self.block_size)
            mask = additive_mask(real, self.model.dtype)[:, None, None, :]
            meta.decode_groups.append(DecodeGroup(a, b, slots, mask))
        start = len(decodes)
        for j, s in enumerate(prefills):
            q_len, ctx_len = len(s.token_ids), s.num_computed + len(s.token_ids)
            ctx_slots = mask = None
            if s.num_computed > 0:
                row = bt[len(decodes) + j: len(decodes) + j + 1]
                ctx_slots = context_slots(row, torch.tensor([ctx_len], device=dev),
                                          self.block_size)[0][0]
                mask = prefix_causal_mask(q_len, ctx_len, self.model.dtype, dev)
            meta.prefills.append(PrefillChunk(start, q_len, ctx_len, ctx_slots, mask))
            start += q_len
        hidden = self.model.forward(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                                    pos_t, self.kv_caches, meta)
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprob] = {}
        to_sample = [s for s in order if s.sample]
        if to_sample:
            logits = self.model.compute_logits(hidden[sample_rows]).cpu()
            toks = sample(logits, [s.params for s in to_sample],
                          [s.generator for s in to_sample], [s.history for s in to_sample],
                          num_prompt_tokens=[s.num_prompt_tokens for s in to_sample])
            sampled = {s.request_id: int(t) for s, t in zip(to_sample, toks.tolist())}
            want = [i for i, s in enumerate(to_sample) if s.params.logprobs is not None]
            if want:
                logprobs = token_logprobs(logits, toks, want, to_sample)
        return StepResult(plan.step_id, sampled, (time.perf_counter() - t0) * 1e3,
                          logprobs=logprobs)


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
