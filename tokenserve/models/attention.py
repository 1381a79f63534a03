"""Attention metadata of a continuous-batching step over the paged KV cache.

KV cache layout, one tensor per layer for K and one for V (chosen for the CPU kernel: one
block of one KV head is a contiguous ``[block_size, head_dim]`` tile)::

    k_cache: [num_blocks, num_kv_heads, block_size, head_dim]   (model dtype; an int8 cache
             has head_dim + 4 bytes a row: the values and an fp32 scale)

Position ``p`` of a sequence with block table ``bt`` lives in block ``bt[p // block_size]``,
row ``p % block_size``; its *slot* is ``bt[p // block_size] * block_size + p % block_size``
(design after vLLM, Kwon et al. 2023, "Efficient Memory Management for LLM Serving with
PagedAttention"). The step's *slot mapping* is the slot of every token it computes.

A step's flattened token axis holds each sequence's new tokens in turn; there is no
prefill or decode phase, only sequences with ``q_len`` new tokens on top of
``context_len - q_len`` cached ones (a decode has ``q_len == 1``)::

    tokens            [ s0 | s1 s1 s1 s1 | s2 | s3 s3 ... ]
    query_start_loc   0    1             5    6      ...
    seq s: queries [qsl[s], qsl[s+1]) at positions context_len[s] - q_len .. context_len[s] - 1,
           each attending to every position up to its own (causal, aligned lower-right)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenserve.ops.dispatch import Kernels


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer.

    Attributes:
        block_tables: int32 [S, max_blocks], padded with block 0 (never read past
            ``context_lens``).
        query_start_loc: int32 [S + 1], cumulative new-token counts.
        context_lens: int32 [S], tokens in the cache after this step's write.
        positions: int64 [T], absolute position of each token.
        slot_mapping: int64 [T], cache slot of each token.
    """

    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor

    @classmethod
    def build(cls, kernels: Kernels, block_tables: Sequence[Sequence[int]],
              q_lens: Sequence[int], num_computed: Sequence[int], block_size: int,
              device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for sequences with ``q_lens[s]`` new tokens after ``num_computed[s]``
        cached ones; one Python loop over sequences, none over tokens.

        Raises:
            ValueError: a block table too short for its context.
        """
        num_seqs = len(q_lens)
        width = max((len(t) for t in block_tables), default=0)
        bt = np.zeros((num_seqs, max(width, 1)), dtype=np.int32)
        for i, t in enumerate(block_tables):
            bt[i, :len(t)] = t
        q = np.asarray(q_lens, dtype=np.int32).reshape(num_seqs)
        ctx = q + np.asarray(num_computed, dtype=np.int32).reshape(num_seqs)
        lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=num_seqs)
        if num_seqs and bool((lens * block_size < ctx).any()):
            raise ValueError("a block table does not cover its context")
        qsl = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(q, out=qsl[1:])
        bt_t = torch.from_numpy(bt).to(device)
        qsl_t = torch.from_numpy(qsl).to(device)
        ctx_t = torch.from_numpy(ctx).to(device)
        positions, slots = kernels.positions_and_slots(bt_t, qsl_t, ctx_t, block_size)
        return cls(bt_t, qsl_t, ctx_t, positions, slots)

    @property
    def num_tokens(self) -> int:
        """T, tokens computed this step."""
        return int(self.positions.shape[0])
