"""Pure-torch references for the decoder-layer kernels (``csrc/layer_ops.cpp``) and the
block-table ops (``csrc/cache_ops.cpp``).

Each function is the oracle its C++ kernel is tested against and the fallback the engine
runs when ``tokenserve._C`` is absent; signatures and in-place semantics match the kernels.

KV cache layout (per layer, K and V alike, contiguous, model dtype)::

    k_cache: [num_blocks, num_kv_heads, block_size, head_dim]

or an int8 cache ``[num_blocks, num_kv_heads, block_size, head_dim + 4]``: each row is the
head's values (rounded to the model dtype) quantised by :func:`quantize_kv_rows`, then their
fp32 scale as 4 bytes (:data:`KV_SCALE_BYTES`).

Position ``p`` of a sequence with block table ``bt`` lives in block ``bt[p // block_size]``,
row ``p % block_size``; its flat *slot* is ``bt[p // block_size] * block_size + p % block_size``.
A step's tokens of sequence ``s`` are the last ``q_len`` of its ``ctx_len`` positions::

    seq s:   0 1 ... ctx_len-q_len-1 | ctx_len-q_len ... ctx_len-1
             already in the cache      computed this step (query_start_loc[s] ...)

``dt(.)`` below is rounding to the model dtype (a no-op for float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KV_SCALE_BYTES = 4  # an int8 cache row's fp32 scale, after its head_dim int8 values


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """K or V head rows to int8 cache rows (the int8 KV cache's write).

    ``x_q = round_half_even(x * (127 / amax))`` clamped to [-127, 127], ``amax = max |x|`` over
    the row, then the fp32 ``scale = amax / 127`` (an all-zero row: zeros and scale 0);
    ``x ~ scale * x_q``. Symmetric per-token, per-head int8 (as MindIE's and vLLM's int8 KV
    caches, with one scale per cache row instead of a calibrated per-channel one).

    Args:
        x: [..., D] bf16 or fp32 (read as fp32).

    Returns:
        [..., D + 4] int8: the values, then the scale's 4 bytes (little endian).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # torch.div of two tensors: one IEEE division (``127.0 / amax`` is reciprocal * 127)
    inv = torch.where(amax > 0, torch.div(torch.full_like(amax, 127.0), amax),
                      torch.zeros_like(amax))
    q = (xf * inv).round().clamp(-127, 127).to(torch.int8)
    scale = torch.div(amax, torch.full_like(amax, 127.0))  # [..., 1] fp32
    return torch.cat((q, scale.flatten().view(torch.int8).view(*amax.shape[:-1], 4)), dim=-1)


def dequantize_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """Int8 cache rows ``[..., D + 4]`` (:func:`quantize_kv_rows`) to fp32 ``[..., D]``:
    ``scale * x_q``."""
    scale = rows[..., -KV_SCALE_BYTES:].flatten().view(torch.float32)
    return rows[..., :-KV_SCALE_BYTES].float() * scale.view(*rows.shape[:-1], 1)


def rope_cos_sin(inv_freq: torch.Tensor, max_pos: int) -> torch.Tensor:
    """The RoPE table the rotary kernel reads.

    Args:
        inv_freq: [D/2] float32 radians per position (``models.config.rope_inv_freq``).
        max_pos: number of positions.

    Returns:
        [max_pos, D] float32: ``[:, :D/2] = cos(p * inv_freq)``, ``[:, D/2:] = sin(p * inv_freq)``
        (the same fp32 values as the model's ``cat(freqs, freqs).cos()`` halves).
    """
    t = torch.arange(max_pos, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


def rotary_embedding_write_kv_ref(qkv: torch.Tensor, positions: torch.Tensor,
                                  cos_sin: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                  num_heads: int, num_kv_heads: int) -> None:
    """Rotate q and k in place (rotate-half RoPE, fp32, one rounding) and write K/V to the cache.

    Args:
        qkv: [T, (H + 2*Hkv) * D] bf16/fp32, q | k | v heads; q and k rotated in place.
        positions: [T] int64 absolute positions, < max_pos.
        cos_sin: [max_pos, R] float32 from :func:`rope_cos_sin`: R = D, or R < D (partial
            rotary, Phi-4-mini: the first R dims of each q and k head rotate, the rest pass
            through, as transformers' ``partial_rotary_factor``).
        k_cache, v_cache: [num_blocks, Hkv, block_size, D] qkv's dtype, or int8
            ``[num_blocks, Hkv, block_size, D + 4]`` (rows of :func:`quantize_kv_rows`);
            written at each token's slot.
        slot_mapping: [T] int64 flat slots; < 0 = padding (not written); the others
            distinct (the kernel writes tokens in parallel).
        num_heads, num_kv_heads: H, Hkv.
    """
    T = qkv.shape[0]
    H, Hkv = num_heads, num_kv_heads
    D = qkv.shape[1] // (H + 2 * Hkv)
    rd = cos_sin.shape[1]
    half = rd // 2
    cs = cos_sin[positions]  # [T, rd]
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1).unsqueeze(1)  # [T, 1, rd]
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1).unsqueeze(1)
    qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)[..., :rd]
    x = qk.float()
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    qk.copy_((x * cos + rot * sin).to(qkv.dtype))
    write_kv_ref(qkv, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)


def write_kv_ref(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    """Write the k and v heads of ``qkv`` to the cache at ``slot_mapping``, unrotated (the
    second half of :func:`rotary_embedding_write_kv_ref`; a partial-rotary model rotates
    first).

    Args:
        qkv: [T, (H + 2*Hkv) * D] bf16/fp32, q | k | v heads.
        k_cache, v_cache: [num_blocks, Hkv, block_size, D] qkv's dtype, or int8
            ``[num_blocks, Hkv, block_size, D + 4]`` (rows of :func:`quantize_kv_rows`, the
            same bytes the C++ write produces).
        slot_mapping: [T] int64 flat slots; < 0 = padding (not written).
        num_heads, num_kv_heads: H, Hkv.
    """
    H, Hkv = num_heads, num_kv_heads
    D = qkv.shape[1] // (H + 2 * Hkv)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    bs = k_cache.shape[2]
    blk, row = slots // bs, slots % bs
    k = qkv[keep, H * D: (H + Hkv) * D].view(-1, Hkv, D)
    v = qkv[keep, (H + Hkv) * D:].view(-1, Hkv, D)
    if k_cache.dtype == torch.int8:
        k, v = quantize_kv_rows(k), quantize_kv_rows(v)
    k_cache[blk, :, row] = k
    v_cache[blk, :, row] = v


def copy_blocks_ref(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                    block_mapping: torch.Tensor) -> None:
    """Copy whole blocks ``src -> dst`` in every layer's K and V cache (copy-on-write).

    Args:
        k_caches, v_caches: per layer [num_blocks, ...].
        block_mapping: [N, 2] int64 (src, dst) pairs; destinations distinct, never a source.
    """
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for c in list(k_caches) + list(v_caches):
        c[dst] = c[src]


def positions_and_slots_ref(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor,
                            block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions and cache slots of a step's tokens.

    Args:
        block_tables: [S, max_blocks] int32.
        query_start_loc: [S+1] int32 token offsets (``qsl[s+1] - qsl[s]`` = q_len of seq s).
        context_lens: [S] int32 tokens of each sequence after this step (ctx_len >= q_len).
        block_size: tokens per block.

    Returns:
        (positions [T] int64, slot_mapping [T] int64), T = ``query_start_loc[S]``.

    Raises:
        ValueError: q_len > ctx_len, or a needed block is missing (past the table or < 0).
    """
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    ctx = context_lens.long()
    if bool((q_lens > ctx).any()) or bool((q_lens < 0).any()):
        raise ValueError("q_len must be in [0, context_len]")
    T = int(qsl[-1]) if qsl.numel() else 0
    dev = block_tables.device
    seq = torch.repeat_interleave(torch.arange(len(ctx), device=dev), q_lens)  # [T]
    pos = (ctx - q_lens)[seq] + torch.arange(T, device=dev) - qsl[:-1][seq]
    bidx = pos // block_size
    if bool((bidx >= block_tables.shape[1]).any()):
        raise ValueError("context needs more blocks than the block table has")
    blocks = block_tables.long()[seq, bidx]
    if bool((blocks < 0).any()):
        raise ValueError("a needed block is missing (< 0) in the block table")
    return pos, blocks * block_size + pos % block_size


def rms_norm_ref(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``out = weight * dt(x * rsqrt(mean(x^2) + eps))`` in fp32, as HF Llama (and
    ``models.decoder``) computes it.

    Args:
        out: [T, Hd] x's dtype, written (may be x).
        x: [T, Hd] bf16/fp32.
        weight: [Hd] x's dtype.
        eps: variance epsilon.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out.copy_(weight * xf.to(x.dtype))


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> None:
    """In place: ``residual = dt(residual + x)``; ``x = rms_norm(residual)`` (:func:`rms_norm_ref`).

    Args:
        x: [T, Hd] bf16/fp32 (the sublayer output in, the normalized hidden state out).
        residual: [T, Hd] x's dtype (the residual stream).
        weight: [Hd] x's dtype.
        eps: variance epsilon.
    """
    residual.add_(x)
    rms_norm_ref(x, residual, weight, eps)


def silu_and_mul_ref(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out = dt(silu(x[:, :I]) * x[:, I:])`` computed in fp32 with one rounding.

    The model's current bf16 ``F.silu(gate) * up`` rounds twice (after the silu and after
    the product), so it can differ from this (and the kernel) by 1 bf16 ulp.

    Args:
        out: [T, I] x's dtype, written.
        x: [T, 2*I] bf16/fp32, gate | up.
    """
    g, u = x.float().chunk(2, dim=-1)
    out.copy_((F.silu(g) * u).to(out.dtype))


def gelu_tanh_and_mul_ref(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out = dt(gelu_tanh(x[:, :I]) * x[:, I:])`` computed in fp32 with one rounding:
    torch's ``F.gelu(approximate="tanh")`` (Gemma's ``gelu_pytorch_tanh``).

    The kernel computes the same function as ``g / (1 + exp(-2c (g + 0.044715 g^3)))``
    (``0.5 (1 + tanh(v)) = sigmoid(2 v)``): within 1e-5 relative of the exact value; this
    reference is within 1e-5 absolute of it, its fp32 ``1 + tanh`` cancelling for negative g
    (0 below g ~ -5, where the kernel keeps the small value).

    Args:
        out: [T, I] x's dtype, written.
        x: [T, 2*I] bf16/fp32, gate | up.
    """
    g, u = x.float().chunk(2, dim=-1)
    out.copy_((F.gelu(g, approximate="tanh") * u).to(out.dtype))
