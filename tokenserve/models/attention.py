"""Paged attention over a block-table KV cache (pure torch; CPU, CUDA or NPU).

KV cache layout, one tensor per layer for K and one for V::

    k_cache: [num_blocks, block_size, num_kv_heads, head_dim]   (model dtype)

A token at position ``p`` of a request whose block table is ``bt`` lives in slot
``bt[p // block_size] * block_size + p % block_size`` of the flattened cache
``k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)``. The *slot mapping*
of a step is that slot for every token the step computes (design after vLLM,
Kwon et al. 2023, "Efficient Memory Management for LLM Serving with PagedAttention").

A step's flattened token axis holds the decode tokens first (one per decode request),
then each prefill chunk in turn::

    tokens  [ d0 d1 ... d(D-1) | p0 p0 p0 p0 | p1 p1 ... ]
              decode (q_len 1)    prefill 0     prefill 1

Decode requests are attended in batched calls over their gathered, padded contexts,
grouped by context length so padding stays bounded; each prefill chunk gets its own
call with a causal mask shifted by the number of tokens already in the cache (chunked
prefill / prefix cache).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One request's prefill chunk inside a step.

    Attributes:
        start: index of the chunk's first token in the step's token axis.
        q_len: tokens computed this step.
        ctx_len: tokens attended to (cached prefix + this chunk), >= q_len.
        ctx_slots: [ctx_len] int64 cache slots of all context tokens; None when
            ``ctx_len == q_len`` (no cached prefix: attend to the fresh K/V directly).
        attn_mask: [q_len, ctx_len] additive mask in the model dtype (0 where query
            ``i`` may attend, -inf elsewhere), built once per step by
            :func:`prefix_causal_mask` and shared by every layer; None with no prefix.
    """

    start: int
    q_len: int
    ctx_len: int
    ctx_slots: torch.Tensor | None
    attn_mask: torch.Tensor | None = None


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = may attend) as an additive one in ``dtype``: 0 where allowed,
    -inf elsewhere. Built once per step: SDPA would otherwise convert a bool mask in
    every layer.

    Returns:
        a tensor of ``allowed``'s shape and device.
    """
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


def prefix_causal_mask(q_len: int, ctx_len: int, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    """Causal mask for ``q_len`` queries that follow ``ctx_len - q_len`` cached tokens.

    Query ``i`` sits at absolute position ``ctx_len - q_len + i`` and sees keys
    ``0 .. ctx_len - q_len + i`` (causality aligned to the lower right).

    Returns:
        [q_len, ctx_len] :func:`additive_mask` of ``dtype``.
    """
    qpos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    kpos = torch.arange(ctx_len, device=device)
    return additive_mask(kpos[None, :] <= qpos[:, None], dtype)


@dataclass
class DecodeGroup:
    """Decode requests attended in one batched call over padded, gathered contexts.

    The runner sorts decodes by context length and splits them where padding to the
    group's longest context would waste too much (one 3000-token context must not make
    fifteen 100-token ones gather 3000 slots each).

    Attributes:
        start, end: the group's rows ``[start, end)`` of the step's token axis.
        slots: [n, L] int64 context slots per request, padded with slot 0.
        mask: [n, 1, 1, L] additive mask in the model dtype: 0 where a padded context
            entry is real, -inf on padding (a bool mask, True = real, is also accepted).
    """

    start: int
    end: int
    slots: torch.Tensor
    mask: torch.Tensor


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer.

    Attributes:
        slot_mapping: [T] int64, cache slot for each token computed this step.
        num_decode: D, number of decode tokens at the front of the token axis.
        decode_groups: groups covering rows ``[0, D)`` (see :class:`DecodeGroup`).
        prefills: the prefill chunks, in token-axis order after the decode tokens.
    """

    slot_mapping: torch.Tensor
    num_decode: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


def group_by_length(ctx_lens: list[int], max_waste: float = 0.5) -> list[tuple[int, int]]:
    """Split decodes, sorted by context length (ascending), into ``[start, end)`` groups.

    A group grows while padding every member to its longest context keeps the padded
    slots within ``1 + max_waste`` times the real ones; each extra group costs one more
    attention call per layer, each padded slot a gathered K/V row.

    Raises:
        ValueError: ``ctx_lens`` not sorted ascending.
    """
    if any(a > b for a, b in itertools.pairwise(ctx_lens)):
        raise ValueError("ctx_lens must be sorted ascending")
    groups, start, real = [], 0, 0
    for i, n in enumerate(ctx_lens):
        if i > start and n * (i - start + 1) > (1 + max_waste) * (real + n):
            groups.append((start, i))
            start, real = i, 0
        real += n
    if ctx_lens:
        groups.append((start, len(ctx_lens)))
    return groups


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys/values into the paged cache.

    Args:
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        k, v: [T, Hkv, D], same dtype as the cache.
        slot_mapping: [T] int64 flattened slots.
    """
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, k)
    flat_v.index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Attention for one layer of one step. The step's K/V must already be written.

    Args:
        q: [T, H, D] queries (rotary applied).
        k, v: [T, Hkv, D] this step's keys/values (used directly by prefills with no
            cached prefix).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        meta: the step's :class:`AttentionMetadata`.
        scale: softmax scale, usually ``D ** -0.5``.

    Returns:
        [T, H, D] attention output (GQA: H must be a multiple of Hkv).
    """
    out = torch.empty_like(q)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    for g in meta.decode_groups:
        # index_select on the flat slot list copies whole [Hkv, Dh] rows (4x faster
        # on CPU than advanced indexing with the 2-D slot tensor)
        idx = g.slots.view(-1)
        shape = (*g.slots.shape, *flat_k.shape[1:])
        kc = flat_k.index_select(0, idx).view(shape).transpose(1, 2)  # [n, Hkv, L, Dh]
        vc = flat_v.index_select(0, idx).view(shape).transpose(1, 2)
        qd = q[g.start:g.end].unsqueeze(2)  # [n, H, 1, Dh]
        o = F.scaled_dot_product_attention(
            qd, kc, vc, attn_mask=g.mask, scale=scale, enable_gqa=True)
        out[g.start:g.end] = o.squeeze(2)
    for pf in meta.prefills:
        s, e = pf.start, pf.start + pf.q_len
        qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q, Dh]
        if pf.ctx_slots is None:
            kp = k[s:e].transpose(0, 1).unsqueeze(0)
            vp = v[s:e].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kp = flat_k.index_select(0, pf.ctx_slots).transpose(0, 1).unsqueeze(0)
            vp = flat_v.index_select(0, pf.ctx_slots).transpose(0, 1).unsqueeze(0)
            mask = pf.attn_mask
            if mask is None:
                mask = prefix_causal_mask(pf.q_len, pf.ctx_len, q.dtype, q.device)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o.squeeze(0).transpose(0, 1)
    return out
