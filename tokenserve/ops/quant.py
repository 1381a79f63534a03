"""Any quantised weight, and the pure-torch oracles of the quantised kernels.

The three calls the model makes on a :class:`~tokenserve.ops.quant_blocks.QuantWeight` of
either kind, GGUF blocks (``tokenserve/ops/quant_blocks.py``) or weight-only int8
(:class:`~tokenserve.ops.quant_int8.Int8Weight`):

* :func:`repack_x8` packs it once for its kernel (x8 / k8 groups, or int8 x16 panels);
* :func:`dequantize_ref` turns it into the fp32 weight (``gguf.quants.dequantize`` is a
  second oracle in the tests);
* :func:`dequantize_rows_ref` is the embedding lookup on a quantised table.

The rest is the pure-torch oracle of ``csrc/quant.cpp`` and ``csrc/quant_k.cpp``:

* :func:`quantize_act_ref` quantises activations per row and 32-block to int12, as the kernel
  does before its integer dot products (llama.cpp's Q8_1 activations, with 12 bits instead of
  8, see ``csrc/quant.cpp`` and bench/README.md "Quantised weights"); for the k-quants
  :func:`quantize_act_k_ref` quantises to int8 per 256-element super-block (llama.cpp's Q8_K,
  ``csrc/quant_k.cpp``, bench/README.md "K-quant scales folded into the AMX tiles");
* :func:`quant_linear_ref` emulates the kernel's arithmetic (exact integer block dots, one
  fp32 fma per block) and :func:`quant_linear_fp32_ref` is the "true" product with the
  dequantised weight in fp32 (what the kernel approximates to the activation rounding);
* :func:`quant_amx_linear_ref` is the reference of ``csrc/quant_amx.cpp`` (the weight
  dequantised to bf16, :func:`dequantize_bf16_ref`, times bf16 activations);
* :func:`quant_k_linear_ref` is :func:`quant_linear_ref` for the k-quants (layouts: the "k-quants"
  section of ``tokenserve/ops/quant_blocks.py``).
"""

from __future__ import annotations

from types import ModuleType

import torch

from tokenserve.ops.quant_blocks import (
    BLOCK_BYTES,
    FROM_GGML,
    K_QTYPES,
    QK,
    QK_K,
    QTYPE_IDS,
    QuantWeight,
    k_fields,
    repack_blocks,
    unpack_k8,
    unpack_x8,
)
from tokenserve.ops.quant_int8 import dequantize_int8, embedding_rows_int8, pack_int8


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 -> fp32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _blocks(w: QuantWeight) -> torch.Tensor:
    if w.layout != "rows":
        w = unpack_x8(w)
    n, k = w.shape
    return w.data.view(n, k // QK, BLOCK_BYTES[w.qtype])


def repack_x8(w: QuantWeight, c: ModuleType | None = None) -> QuantWeight:
    """``w`` in its kernel's layout, packed once: GGUF blocks as 8 rows interleaved per block
    (:func:`~tokenserve.ops.quant_blocks.repack_blocks`; k-quants: ``"k8"``), an
    ``Int8Weight`` as its ``"x16"`` panels (:func:`~tokenserve.ops.quant_int8.pack_int8`).

    Args:
        w: the weight (any layout; a packed one comes back as it is).
        c: the extension module ``tokenserve._C``, or None. With it a k-quant's GGUF rows
            are regrouped by its ``repack_k8`` (``csrc/quant_k_pack.cpp``: the same bytes as
            :func:`~tokenserve.ops.quant_blocks.repack_k8`, in one pass with no transient
            memory; the torch version takes ~0.2 s and ~30 bytes a weight per 1B-model
            tensor, most of a 1B Q6_K file's 28 s start-up).
    """
    if w.qtype == "int8":  # Int8Weight: its kernel's own layout
        return pack_int8(w)
    pack_k8 = getattr(c, "repack_k8", None)
    if pack_k8 is not None and w.qtype in K_QTYPES and w.layout == "rows":
        n, k = w.shape
        data = pack_k8(w.data.reshape(n, -1).contiguous(), QTYPE_IDS[w.qtype], k)
        return QuantWeight(data, w.qtype, w.shape, "k8")
    return repack_blocks(w)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 16] -> int32 [..., 32] (low nibbles then high nibbles)."""
    q = qs.to(torch.int32)
    return torch.cat((q & 0x0F, q >> 4), dim=-1)


def _block_parts(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d fp32 [N, nb], m fp32 [N, nb], q int32 [N, nb, 32]) with ``w = d * q + m``
    (Q4_0: q in 0..15 and m = -8 d; Q8_0: m = 0)."""
    b = _blocks(w)
    d = _f16(b[..., 0:2])
    if w.qtype == "q4_0":
        return d, -8.0 * d, _nibbles(b[..., 2:18])
    if w.qtype == "q4_1":
        return d, _f16(b[..., 2:4]), _nibbles(b[..., 4:20])
    return d, torch.zeros_like(d), b[..., 2:34].contiguous().view(torch.int8).to(torch.int32)


def dequantize_ref(w: QuantWeight) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight the blocks stand for (ggml's dequantize_row_*; for an
    ``Int8Weight``, ``s[n] * q[n, k]``)."""
    if w.qtype == "int8":
        return dequantize_int8(w)
    if w.qtype in K_QTYPES:
        return dequantize_k_ref(w)
    n, k = w.shape
    b = _blocks(w)
    d = _f16(b[..., 0:2]).unsqueeze(-1)
    if w.qtype == "q4_0":
        y = (_nibbles(b[..., 2:18]) - 8).float() * d
    elif w.qtype == "q4_1":
        y = _nibbles(b[..., 4:20]).float() * d + _f16(b[..., 2:4]).unsqueeze(-1)
    else:
        y = b[..., 2:34].contiguous().view(torch.int8).float() * d
    return y.reshape(n, k)


def quantize_act_ref(x: torch.Tensor, qmax: int = 2047
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations -> int12 (or int8) blocks (stored as int16), the kernel's first step (row
    by row, 32-block by 32-block; ``csrc/quant_act.h``).

    ``d = amax / qmax`` (fp32), ``q = round_half_even(x * (1/d))`` (0 where d = 0,
    ``|q| <= qmax``), and ``s = d * sum(q)`` (as llama.cpp's Q8_1 ``s``, for the Q4 offset
    term). ``quant_gemm`` (Q4_0 / Q4_1 / Q8_0) uses 12 bits (qmax 2047) so that
    ``q = 16 h + l`` (``h`` a signed byte, ``l`` 0..15) and an AMX-INT8 tile product is the
    exact block dot (``csrc/quant_amx_int.cpp``). (``quant_k_gemm`` quantises per 256-element
    super-block instead: :func:`quantize_act_k_ref`.)

    Args:
        x: [M, K] any float dtype (used as fp32), K a multiple of 32.
        qmax: 2047 (int12) or 127 (int8: the rounding bound of tests/kernel_checks.py).

    Returns:
        (q int16 [M, K], d fp32 [M, K // 32], s fp32 [M, K // 32]).
    """
    m, k = x.shape
    xb = x.float().reshape(m, k // QK, QK)
    d = xb.abs().amax(-1) / float(qmax)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int32)
    s = d * q.sum(-1).float()
    return q.to(torch.int16).reshape(m, k), d, s


def quant_linear_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Bit-level emulation of ``quant_gemm``: ``y = x @ W.T (+ b)``. Per output element::

        acc = 0; summ = 0
        for each block b:  isum = sum_32 qw * qx                      (exact)
                           acc  = fma(fl(dw_b * dx_b), float(isum), acc)
                           summ = fma(mw_b, sx_b, summ)               # Q4 only
        y = (acc + summ) (+ b)

    torch has no fused multiply-add, so each fma is emulated in fp64 (exact product, one
    rounding, then the fp64 sum rounded to fp32: equal to the fused result except on
    double-rounding ties, vanishingly rare; the tests compare with a 1e-6 tolerance).

    Args:
        x: [M, K] float. w: the weight (either layout). bias: [N] or None.
        out_dtype: result dtype (None: x's dtype).

    Returns:
        [M, N] in ``out_dtype``.
    """
    qx, dx, sx = quantize_act_ref(x)
    dw, mw, qw = _block_parts(w)  # [N, nb], [N, nb], [N, nb, 32]
    m_rows, _ = x.shape
    n, nb = dw.shape
    isum = torch.einsum("mbe,nbe->mnb", qx.reshape(m_rows, nb, QK).to(torch.int64),
                        qw.to(torch.int64))
    isum_f = isum.to(torch.float32).double()  # one rounding (exact for Q4)
    scale = (dw.unsqueeze(0) * dx.unsqueeze(1)).double()  # [M, N, nb] fp32 products
    acc = torch.zeros(m_rows, n, dtype=torch.float32)
    summ = torch.zeros(m_rows, n, dtype=torch.float32)
    off = w.qtype != "q8_0"
    for b in range(nb):
        acc = (scale[:, :, b] * isum_f[:, :, b] + acc.double()).float()
        if off:
            summ = (mw[None, :, b].double() * sx[:, None, b].double() + summ.double()).float()
    y = acc + summ
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def dequantize_bf16_ref(w: QuantWeight) -> torch.Tensor:
    """The bf16 ``[N, K]`` weight ``quant_amx_gemm`` multiplies: per element
    ``bf16(fl(fma(q, d, m)))`` (Q4_0: ``m = -8 d``; Q8_0: ``fl(q * d)``), one fp32 rounding
    (the product and sum are exact in fp64: fp16 d, m and a 4- or 8-bit q) then one to bf16,
    as the kernel's ``vfmadd`` and ``vcvtne2ps2bf16`` do."""
    d, m, q = _block_parts(w)
    v = torch.addcmul(m.double().unsqueeze(-1), q.double(), d.double().unsqueeze(-1)).float()
    return v.to(torch.bfloat16).reshape(w.shape)


def quant_amx_linear_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference of ``quant_amx_gemm`` (``csrc/quant_amx.cpp``): ``bf16(x) @
    dequantize_bf16_ref(W).T (+ b)`` with fp32 accumulation. The kernel adds its bf16 pair
    products in AMX's own order (one ``tdpbf16ps`` per 32-block), so the two agree to fp32
    rounding, not bit for bit; the kernel's own bits are checked for invariance instead.

    Args:
        x: [M, K] float. w: the weight (any layout). bias: [N] or None.
        out_dtype: result dtype (None: x's dtype).

    Returns:
        [M, N] in ``out_dtype``.
    """
    y = torch.nn.functional.linear(x.to(torch.bfloat16).double(), dequantize_bf16_ref(w).double(),
                                   None if bias is None else bias.double())
    return y.float().to(out_dtype or x.dtype)


def quant_linear_fp32_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ dequantize(W).T (+ b)`` in fp32 (no activation quantisation)."""
    y = torch.nn.functional.linear(x.float(), dequantize_ref(w),
                                   None if bias is None else bias.float())
    return y.to(out_dtype or x.dtype)


def dequantize_rows_ref(ids: torch.Tensor, w: QuantWeight,
                        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Embedding lookup on a quantised table: rows ``ids`` (int [T]) dequantised, [T, K]
    (an ``Int8Weight`` with a kept ``table`` reads the table as loaded)."""
    if w.qtype == "int8":
        return embedding_rows_int8(ids, w, out_dtype)
    return dequantize_ref(w.rows(ids.long())).to(out_dtype)


def quantize_ref(w: torch.Tensor, qtype: str) -> QuantWeight:
    """An fp32 ``[N, K]`` weight in a GGUF block format, via ``gguf.quants.quantize``
    (llama.cpp's reference quantisers; for tests and for the default-model-free benches).

    Raises:
        NotImplementedError: a k-quant (gguf-py has no k-quant quantiser).
    """
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    ggml = {v: k for k, v in FROM_GGML.items()}[qtype]
    raw = quantize(np.ascontiguousarray(w.float().numpy()), GGMLQuantizationType[ggml])
    data = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).reshape(w.shape[0], -1)
    return QuantWeight(data.clone(), qtype, (int(w.shape[0]), int(w.shape[1])))


# ------------------------------------------------------------------------------ k-quants
#
# Block layouts: the "k-quants" section of tokenserve/ops/quant_blocks.py.


def _k_scales(sc12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K packed scales: uint8 [..., 12] -> (sc int32 [..., 8], m int32 [..., 8])."""
    b = sc12.to(torch.int32)
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat((lo & 63, (hi & 15) | ((lo >> 6) << 4)), dim=-1)
    m = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=-1)
    return sc, m


def _k_blocks(w: QuantWeight) -> torch.Tensor:
    """uint8 [N, K // 256, BLOCK_BYTES] GGUF super-blocks of a k-quant weight (any layout)."""
    if w.layout == "k8":
        w = unpack_k8(w)
    n, k = w.shape
    return w.data.view(n, k // QK_K, BLOCK_BYTES[w.qtype])


def _k_parts(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sub-block form ``w = dw * q + mw`` of a k-quant weight: (dw fp32 [N, S], mw fp32
    [N, S], q int32 [N, S, L]); Q4_K / Q5_K: S = K / 32 sub-blocks of L = 32, dw = d * sc,
    mw = -(dmin * m); Q6_K: S = K / 16, L = 16, dw = d * sc, q = quant - 32 (signed), mw = 0."""
    f = k_fields(_k_blocks(w), w.qtype)
    n = w.shape[0]
    d = _f16(f["d"]).unsqueeze(-1)  # [N, nsb, 1]
    if w.qtype == "q6_k":
        sc = f["scales"].contiguous().view(torch.int8).float()
        dw = (d * sc).reshape(n, -1)
        q = f["q"].to(torch.int32).reshape(n, -1, 16) - 32
        return dw, torch.zeros_like(dw), q
    sc, m = _k_scales(f["scales"])
    dw = (d * sc.float()).reshape(n, -1)
    mw = -(_f16(f["dmin"]).unsqueeze(-1) * m.float()).reshape(n, -1)
    return dw, mw, f["q"].to(torch.int32).reshape(n, -1, 32)


def dequantize_k_ref(w: QuantWeight) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight of a Q4_K / Q5_K / Q6_K weight (either layout), with
    ggml's / gguf-py's roundings: ``fl(fl(d*sc) * q) - fl(dmin*m)`` (Q6_K: ``fl(d*sc) *
    (q - 32)``), equal to ``gguf.quants.dequantize`` bit for bit."""
    dw, mw, q = _k_parts(w)
    y = dw.unsqueeze(-1) * q.float()
    if w.qtype != "q6_k":
        y = y + mw.unsqueeze(-1)  # x + (-m) == x - m exactly
    return y.reshape(w.shape)


def act_sums16_ref(qx: torch.Tensor) -> torch.Tensor:
    """int32 ``[M, K // 16]``: sums of each 16 consecutive int16 activation quants (the Q6_K
    kernel folds its ``- 32`` into ``isum - 32 * sum16``; exact, so the result is as if the
    signed quants were multiplied)."""
    m, k = qx.shape
    return qx.to(torch.int32).reshape(m, k // 16, 16).sum(-1, dtype=torch.int32)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Fused multiply-add on fp32 tensors, correctly rounded (IEEE ``fmaf``), broadcasting.

    ``a * b`` is exact in fp64; the fp64 sum ``s`` and its exact error ``e`` (Knuth's
    TwoSum) give the sum rounded to odd (``s`` moved one ulp towards ``e`` when inexact and
    even), and round-to-odd at 53 bits then to nearest at 24 is a correct rounding. Finite
    inputs only.
    """
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bv = s - p
    e = (p - (s - bv)) + (cd - bv)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(e > 0, torch.full_like(s, float("inf")), torch.full_like(s, -float("inf")))
    s = torch.where((e != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def quantize_act_k_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations -> int8 per row and 256-element super-block (llama.cpp's Q8_K), the first
    step of ``quant_k_gemm`` (``csrc/quant_act.h`` quantize_rows_k).

    ``d = amax / 127`` (fp32, per 256), ``q = round_half_even(x * (1/d))`` (0 where d = 0,
    ``|q| <= 127``), and the exact integer sums of each 32 quants (the Q4_K / Q5_K min term).

    Args:
        x: [M, K] any float dtype (used as fp32), K a multiple of 256.

    Returns:
        (q int16 [M, K], d fp32 [M, K // 256], bsum int32 [M, K // 32]).
    """
    m, k = x.shape
    xb = x.float().reshape(m, k // QK_K, QK_K)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int32).reshape(m, k)
    bsum = q.reshape(m, k // QK, QK).sum(-1, dtype=torch.int32)
    return q.to(torch.int16), d, bsum


def _k_ints(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer form of a k-quant weight, per super-block: (d fp32 [N, nsb], dmin fp32 [N, nsb]
    (0 for Q6_K), sc int64 [N, nsb, S], m int64 [N, nsb, 8] (0 for Q6_K), q int64
    [N, nsb, S, L]); Q4_K / Q5_K: S = 8 sub-blocks of L = 32, q unsigned; Q6_K: S = 16,
    L = 16, sc signed, q = quant - 32."""
    f = k_fields(_k_blocks(w), w.qtype)
    n, k = w.shape
    nsb = k // QK_K
    d = _f16(f["d"]).reshape(n, nsb)
    if w.qtype == "q6_k":
        sc = f["scales"].contiguous().view(torch.int8).to(torch.int64).reshape(n, nsb, 16)
        q = f["q"].to(torch.int64).reshape(n, nsb, 16, 16) - 32
        return d, torch.zeros_like(d), sc, torch.zeros(n, nsb, 8, dtype=torch.int64), q
    sc, m = _k_scales(f["scales"])
    return (d, _f16(f["dmin"]).reshape(n, nsb), sc.to(torch.int64).reshape(n, nsb, 8),
            m.to(torch.int64).reshape(n, nsb, 8), f["q"].to(torch.int64).reshape(n, nsb, 8, 32))


def quant_k_linear_ref(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Bit-exact emulation of ``quant_k_gemm`` (``csrc/quant_k.cpp``): ``y = x @ W.T (+ b)``.

    Activations as :func:`quantize_act_k_ref` (int8 per 256-element super-block: q, dx, and
    the 32-element sums bsum). Per output element, super-blocks B in k order::

        isum = sum_s sc_s * sum_L qw * qx       (exact int32; Q6_K: 16 sub-blocks, qw - 32)
        msum = sum_s m_s * bsum_s               (exact int32; Q4_K / Q5_K)
        acc  = fma(fl(d * dx_B), float(isum), acc)
        acc  = fma(-fl(dmin * dx_B), float(msum), acc)   (Q4_K / Q5_K)
        y = acc (+ b, fp32), rounded to out_dtype

    llama.cpp's k-quant dot (ggml's vec_dot_q4_K_q8_K) has this shape: one fp32 step per
    super-block, the 6-bit (Q6_K: 8-bit) sub-block scales applied to the integer dots.
    ``float(isum)`` is correctly rounded (|isum| < 2^31).

    Args:
        x: [M, K] float (used as fp32). w: a k-quant weight [N, K] (either layout).
        bias: [N] or None. out_dtype: result dtype (None: x's dtype).

    Returns:
        [M, N] in ``out_dtype``.
    """
    qx, dx, bsum = quantize_act_k_ref(x)
    d, dmin, sc, mn, qw = _k_ints(w)
    m_rows = x.shape[0]
    n, nsb, s_count, sub = qw.shape
    dots = torch.einsum("mbse,nbse->mnbs", qx.reshape(m_rows, nsb, s_count, sub).to(torch.int64), qw)
    isum = (dots * sc[None]).sum(-1)  # [M, N, nsb]
    msum = (bsum.to(torch.int64).reshape(m_rows, 1, nsb, 8) * mn[None]).sum(-1)
    assert not isum.numel() or isum.abs().max().item() < 2 ** 31
    acc = torch.zeros(m_rows, n, dtype=torch.float32)
    for b in range(nsb):
        acc = fma32(d[None, :, b] * dx[:, None, b], isum[:, :, b].to(torch.float32), acc)
        if w.qtype != "q6_k":
            acc = fma32(-(dmin[None, :, b] * dx[:, None, b]), msum[:, :, b].to(torch.float32), acc)
    y = acc
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)
