"""Pure-torch reference implementations of the block-table ops.

Each function is the oracle a C++ kernel in ``csrc/`` is tested against (a later issue
adds the kernels); the engine calls these when the extension is absent.
Slot of position ``p`` under block table ``bt``: ``bt[p // block_size] * block_size +
p % block_size`` (see ``tokenserve/models/attention.py``).
"""

from __future__ import annotations

import torch


def pad_block_tables(tables: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Ragged block tables -> [B, max_blocks] int64, padded with block 0."""
    width = max((len(t) for t in tables), default=0)
    out = torch.zeros((len(tables), max(width, 1)), dtype=torch.int64)
    for i, t in enumerate(tables):
        if t:
            out[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
    return out.to(device)


def slot_mapping(block_tables: torch.Tensor, positions: torch.Tensor,
                 seq_index: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each token.

    Args:
        block_tables: [B, max_blocks] int64.
        positions: [T] int64 absolute position of each token.
        seq_index: [T] int64 row of ``block_tables`` each token belongs to.
        block_size: tokens per block.

    Returns:
        [T] int64 flattened cache slots.
    """
    blocks = block_tables[seq_index, positions // block_size]
    return blocks * block_size + positions % block_size


def context_slots(block_tables: torch.Tensor, ctx_lens: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of every context position of each sequence, padded to the longest.

    Args:
        block_tables: [B, max_blocks] int64.
        ctx_lens: [B] int64 context lengths (tokens), each <= max_blocks * block_size.
        block_size: tokens per block.

    Returns:
        (slots [B, L] int64 with padding slots = block_tables[:, 0]'s first slot,
         mask [B, L] bool, True for real positions), L = max(ctx_lens).
    """
    L = int(ctx_lens.max()) if ctx_lens.numel() else 0
    pos = torch.arange(L, device=block_tables.device)
    blk = block_tables[:, pos // block_size]
    slots = blk * block_size + pos % block_size
    mask = pos[None, :] < ctx_lens[:, None]
    return torch.where(mask, slots, torch.zeros_like(slots)), mask


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal paged attention over a ``[num_blocks, Hkv, block_size, D]`` cache (the oracle
    of the ``paged_attention`` kernel in ``csrc/attention.cpp``).

    Sequence ``s`` owns query rows ``[query_start_loc[s], query_start_loc[s+1])``; with
    ``q_len`` those rows and ``ctx = context_lens[s]`` (>= q_len, all already in the cache)
    its query ``j`` sits at position ``ctx - q_len + j`` and attends keys ``0 .. that``.
    Token at position ``p`` lives in block ``block_tables[s, p // block_size]``, row
    ``p % block_size``. GQA: query head ``h`` uses kv head ``h // (H // Hkv)``.

    Args:
        q: [T, H, D] bf16 or fp32 (any strides).
        k_cache, v_cache: [num_blocks, Hkv, block_size, D], q's dtype.
        block_tables: [S, max_blocks] integer.
        query_start_loc: [S + 1] integer, non-decreasing.
        context_lens: [S] integer.
        scale: softmax scale (usually ``D ** -0.5``).

    Returns:
        [T, H, D] in q's dtype (fp32 math, one rounding); rows of no sequence are 0.
    """
    T, H, D = q.shape
    Hkv, bs = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros((T, H, D), dtype=torch.float32)
    qsl = [int(x) for x in query_start_loc]
    for s in range(block_tables.shape[0]):
        q0, q1, ctx = qsl[s], qsl[s + 1], int(context_lens[s])
        if q1 == q0:
            continue
        pos = torch.arange(ctx)
        blk = block_tables[s].long()[pos // bs]
        k = k_cache[blk, :, pos % bs].float().repeat_interleave(H // Hkv, dim=1)  # [ctx, H, D]
        v = v_cache[blk, :, pos % bs].float().repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale
        qpos = torch.arange(ctx - (q1 - q0), ctx)
        scores = scores.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.to(q.dtype)
