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

Decode requests are attended in one batched call over their gathered, padded
contexts; each prefill chunk gets its own call with a causal mask shifted by the
number of tokens already in the cache (chunked prefill / prefix cache).
"""

from __future__ import annotations

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
    """

    start: int
    q_len: int
    ctx_len: int
    ctx_slots: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer.

    Attributes:
        slot_mapping: [T] int64, cache slot for each token computed this step.
        num_decode: D, number of decode tokens at the front of the token axis.
        decode_slots: [D, L] int64 context slots per decode request, padded with 0.
        decode_mask: [D, 1, 1, L] bool, True where a padded context entry is real.
        prefills: the prefill chunks, in token-axis order after the decode tokens.
    """

    slot_mapping: torch.Tensor
    num_decode: int
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]


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
    nd = meta.num_decode
    if nd:
        assert meta.decode_slots is not None and meta.decode_mask is not None
        kc = flat_k[meta.decode_slots].transpose(1, 2)  # [D, Hkv, L, Dh]
        vc = flat_v[meta.decode_slots].transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [D, H, 1, Dh]
        o = F.scaled_dot_product_attention(
            qd, kc, vc, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    for pf in meta.prefills:
        s, e = pf.start, pf.start + pf.q_len
        qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q, Dh]
        if pf.ctx_slots is None:
            kp = k[s:e].transpose(0, 1).unsqueeze(0)
            vp = v[s:e].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kp = flat_k[pf.ctx_slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, Dh]
            vp = flat_v[pf.ctx_slots].transpose(0, 1).unsqueeze(0)
            # query i sits at absolute position ctx_len - q_len + i
            qpos = torch.arange(pf.ctx_len - pf.q_len, pf.ctx_len, device=q.device)
            kpos = torch.arange(pf.ctx_len, device=q.device)
            mask = kpos[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o.squeeze(0).transpose(0, 1)
    return out
