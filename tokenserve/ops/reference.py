"""Pure-torch reference of the paged attention kernel (``csrc/attention.cpp``).

The oracle the C++ kernel is tested against; the engine calls it when the extension is
absent. The other kernels' references are in ``layer_ref.py`` and ``sampling.py``.
Slot of position ``p`` under block table ``bt``: ``bt[p // block_size] * block_size +
p % block_size`` (see ``tokenserve/models/attention.py``).
"""

from __future__ import annotations

import torch

from tokenserve.ops.layer_ref import dequantize_kv_rows


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, window: int = 0,
                        softcap: float = 0.0) -> torch.Tensor:
    """Causal paged attention over a ``[num_blocks, Hkv, block_size, D]`` cache (the oracle
    of the ``paged_attention`` kernel in ``csrc/attention.cpp``).

    Sequence ``s`` owns query rows ``[query_start_loc[s], query_start_loc[s+1])``; with
    ``q_len`` those rows and ``ctx = context_lens[s]`` (>= q_len, all already in the cache)
    its query ``j`` sits at position ``ctx - q_len + j`` and attends keys ``0 .. that``.
    Token at position ``p`` lives in block ``block_tables[s, p // block_size]``, row
    ``p % block_size``. GQA: query head ``h`` uses kv head ``h // (H // Hkv)``.

    Args:
        q: [T, H, D] bf16 or fp32 (any strides).
        k_cache, v_cache: [num_blocks, Hkv, block_size, D], q's dtype, or int8
            ``[num_blocks, Hkv, block_size, D + 4]`` (read as ``scale * x_q``,
            :func:`~tokenserve.ops.layer_ref.dequantize_kv_rows`).
        block_tables: [S, max_blocks] integer.
        query_start_loc: [S + 1] integer, non-decreasing.
        context_lens: [S] integer.
        scale: softmax scale (usually ``D ** -0.5``).
        window: sliding window in tokens, 0 = none: the query at position p attends keys
            ``p - window + 1 .. p`` only (transformers ``sliding_window_overlay``:
            ``kv_idx > q_idx - sliding_window``); blocks wholly before every query's window
            are never read (they may have been freed and reused).
        softcap: attention logit soft-capping, 0 = none: a score ``s`` becomes
            ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2,
            transformers ``eager_attention_forward``).

    Returns:
        [T, H, D] in q's dtype (fp32 math, one rounding); rows of no sequence are 0.
    """
    T, H, D = q.shape
    Hkv, bs = k_cache.shape[1], k_cache.shape[2]
    dev = q.device  # the cache's too; block_tables may live on either
    out = torch.zeros((T, H, D), dtype=torch.float32, device=dev)
    qsl = [int(x) for x in query_start_loc]
    for s in range(block_tables.shape[0]):
        q0, q1, ctx = qsl[s], qsl[s + 1], int(context_lens[s])
        if q1 == q0:
            continue
        qpos = torch.arange(ctx - (q1 - q0), ctx, device=dev)
        lo = max(0, ctx - (q1 - q0) - window + 1) if window else 0  # the first key any row sees
        pos = torch.arange(lo, ctx, device=dev)
        blk = block_tables[s].to(dev).long()[pos // bs]
        k, v = k_cache[blk, :, pos % bs], v_cache[blk, :, pos % bs]  # [ctx, Hkv, D(+4)]
        if k.dtype == torch.int8:
            k, v = dequantize_kv_rows(k), dequantize_kv_rows(v)
        k = k.float().repeat_interleave(H // Hkv, dim=1)  # [ctx, H, D]
        v = v.float().repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        masked = pos[None, None, :] > qpos[None, :, None]
        if window:
            masked |= pos[None, None, :] <= qpos[None, :, None] - window
        scores = scores.masked_fill(masked, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.to(q.dtype)
