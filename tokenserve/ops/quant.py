"""Quantised weights: the GGUF's own Q4_0 / Q4_1 / Q8_0 blocks.

A :class:`QuantWeight` holds a ``[N, K]`` weight as raw GGUF blocks, either one output row
per tensor row as in the file (layout ``"rows"``: uint8 ``[N, (K // 32) * block_bytes]``)
or regrouped for the kernel (layout ``"x8"``, :func:`repack_x8`: the same bytes, 8 rows
interleaved per block; ``csrc/quant.cpp`` draws it). The block layouts (ggml
``ggml-common.h``; 32 weights per block, little-endian)::

    Q4_0  18 bytes  | d: fp16 | qs: 16 bytes |            w[j] = d * (q[j] - 8)
    Q4_1  20 bytes  | d: fp16 | m: fp16 | qs: 16 bytes |  w[j] = d * q[j] + m
    Q8_0  34 bytes  | d: fp16 | qs: 32 x int8 |           w[j] = d * qs[j]

    Q4 nibbles: byte i of qs holds q[i] in its low nibble and q[i + 16] in its high one.

This module is the pure-torch oracle of ``csrc/quant.cpp``:

* :func:`dequantize_ref` turns blocks into fp32 weights (``gguf.quants.dequantize`` is a
  second oracle in the tests);
* :func:`quantize_act_ref` quantises activations per row and 32-block to int16, as the kernel
  does before its integer dot products (llama.cpp's Q8_1 activations, with 16 bits instead of
  8, see ``csrc/quant.cpp`` and bench/README.md "Quantised weights");
* :func:`quant_linear_ref` emulates the kernel's arithmetic (exact integer block dots, one
  fp32 fma per block) and :func:`quant_linear_fp32_ref` is the "true" product with the
  dequantised weight in fp32 (what the kernel approximates to the activation rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32  #: weights per block
#: bytes per 32-weight block, by format
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
#: ids passed to the C++ kernels
QTYPE_IDS = {"q4_0": 0, "q4_1": 1, "q8_0": 2}
#: GGML type names (gguf.GGMLQuantizationType) -> our names
FROM_GGML = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}
RG = 8  #: rows per group in the x8 layout
#: bytes per (group of 8 rows, block) in the x8 layout
GROUP_BYTES = {"q4_0": 144, "q4_1": 160, "q8_0": 272}


@dataclass(frozen=True)
class QuantWeight:
    """A ``[N, K]`` weight in a GGUF block format.

    Attributes:
        data: layout ``"rows"``: uint8 ``[N, (K // 32) * BLOCK_BYTES[qtype]]``, row n's
            blocks in k order, exactly the bytes of the GGUF tensor; layout ``"x8"``: uint8
            ``[ceil(N / 8), K // 32, GROUP_BYTES[qtype]]`` (:func:`repack_x8`). Contiguous.
        qtype: ``"q4_0"``, ``"q4_1"`` or ``"q8_0"``.
        shape: ``(N, K)``.
        layout: ``"rows"`` or ``"x8"``.
    """

    data: torch.Tensor
    qtype: str
    shape: tuple[int, int]
    layout: str = "rows"

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported quantisation {self.qtype!r}; known {sorted(BLOCK_BYTES)}")
        n, k = self.shape
        if k % QK:
            raise ValueError(f"{self.qtype}: K={k} is not a multiple of {QK}")
        if self.layout == "rows":
            want = (n, k // QK * BLOCK_BYTES[self.qtype])
        elif self.layout == "x8":
            want = ((n + RG - 1) // RG, k // QK, GROUP_BYTES[self.qtype])
        else:
            raise ValueError(f"unknown layout {self.layout!r}")
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"{self.qtype} data must be uint8 {want}, got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, idx: torch.Tensor) -> QuantWeight:
        """The weight restricted to rows ``idx`` (int64 [R]), layout ``"rows"``."""
        w = unpack_x8(self) if self.layout == "x8" else self
        return QuantWeight(w.data.index_select(0, idx).contiguous(), self.qtype,
                           (int(idx.numel()), self.shape[1]))

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Rows of ``parts`` (same format and K) one after the other (a fused projection)."""
        if parts and parts[0].qtype == "int8":  # Int8Weight (quant_int8.py)
            return type(parts[0]).cat(parts)
        qtypes = {p.qtype for p in parts}
        ks = {p.shape[1] for p in parts}
        if len(qtypes) != 1 or len(ks) != 1 or any(p.layout != "rows" for p in parts):
            raise ValueError(f"cannot fuse {[(p.qtype, p.shape) for p in parts]}")
        return QuantWeight(torch.cat([p.data for p in parts]).contiguous(), parts[0].qtype,
                           (sum(p.shape[0] for p in parts), parts[0].shape[1]))


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 -> fp32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _blocks(w: QuantWeight) -> torch.Tensor:
    if w.layout == "x8":
        w = unpack_x8(w)
    n, k = w.shape
    return w.data.view(n, k // QK, BLOCK_BYTES[w.qtype])


def _head_bytes(qtype: str) -> int:
    """Bytes before the quants in a GGUF block (d, and m for Q4_1)."""
    return 4 if qtype == "q4_1" else 2


def repack_x8(w: QuantWeight) -> QuantWeight:
    """The kernel's layout: 8 rows interleaved per block (``csrc/quant.cpp`` header).

    Per (group g, block b): the 8 rows' fp16 ``d`` (16 bytes), for Q4_1 their fp16 ``m``
    (16 bytes), then the quants in 16-byte chunks, chunk p holding each row's bytes
    ``2p, 2p+1`` of its quants (``qs``) at ``2r, 2r+1``. Rows past N are zeros.
    """
    if w.qtype == "int8":  # Int8Weight: its kernel's own layout (quant_int8.pack_int8)
        from tokenserve.ops.quant_int8 import pack_int8

        return pack_int8(w)
    if w.layout == "x8":
        return w
    n, k = w.shape
    nb, bb, h = k // QK, BLOCK_BYTES[w.qtype], _head_bytes(w.qtype)
    g = (n + RG - 1) // RG
    blocks = torch.zeros(g * RG, nb, bb, dtype=torch.uint8)
    blocks[:n] = w.data.view(n, nb, bb)
    blocks = blocks.view(g, RG, nb, bb).permute(0, 2, 1, 3)  # [g, nb, 8, bb]
    parts = [blocks[..., 0:2].reshape(g, nb, 16)]  # d of the 8 rows
    if w.qtype == "q4_1":
        parts.append(blocks[..., 2:4].reshape(g, nb, 16))
    qs = blocks[..., h:].reshape(g, nb, RG, (bb - h) // 2, 2)  # [g, nb, row, chunk, 2]
    parts.append(qs.permute(0, 1, 3, 2, 4).reshape(g, nb, -1))
    return QuantWeight(torch.cat(parts, dim=-1).contiguous(), w.qtype, w.shape, "x8")


def unpack_x8(w: QuantWeight) -> QuantWeight:
    """Inverse of :func:`repack_x8`: the GGUF rows again."""
    if w.layout == "rows":
        return w
    n, k = w.shape
    nb, bb, h = k // QK, BLOCK_BYTES[w.qtype], _head_bytes(w.qtype)
    g = w.data.shape[0]
    d = w.data[..., 0:16].reshape(g, nb, RG, 2)
    parts = [d]
    off = 16
    if w.qtype == "q4_1":
        parts.append(w.data[..., 16:32].reshape(g, nb, RG, 2))
        off = 32
    qs = w.data[..., off:].reshape(g, nb, (bb - h) // 2, RG, 2).permute(0, 1, 3, 2, 4)
    parts.append(qs.reshape(g, nb, RG, bb - h))
    blocks = torch.cat(parts, dim=-1).permute(0, 2, 1, 3).reshape(g * RG, nb * bb)
    return QuantWeight(blocks[:n].contiguous(), w.qtype, w.shape)


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
        from tokenserve.ops.quant_int8 import dequantize_int8

        return dequantize_int8(w)
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


def quantize_act_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations -> int16 blocks, the kernel's first step (row by row, 32-block by 32-block).

    ``d = amax / 32767`` (fp32), ``q = round_half_even(x * (1/d))`` (0 where d = 0), and
    ``s = d * sum(q)`` (as llama.cpp's Q8_1 ``s``, for the Q4 offset term).

    Args:
        x: [M, K] any float dtype (used as fp32), K a multiple of 32.

    Returns:
        (q int16 [M, K], d fp32 [M, K // 32], s fp32 [M, K // 32]).
    """
    m, k = x.shape
    xb = x.float().reshape(m, k // QK, QK)
    d = xb.abs().amax(-1) / 32767.0
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
        from tokenserve.ops.quant_int8 import embedding_rows_int8

        return embedding_rows_int8(ids, w, out_dtype)
    return dequantize_ref(w.rows(ids.long())).to(out_dtype)


def quantize_ref(w: torch.Tensor, qtype: str) -> QuantWeight:
    """An fp32 ``[N, K]`` weight in a GGUF block format, via ``gguf.quants.quantize``
    (llama.cpp's reference quantisers; for tests and for the default-model-free benches)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    ggml = {v: k for k, v in FROM_GGML.items()}[qtype]
    raw = quantize(np.ascontiguousarray(w.float().numpy()), GGMLQuantizationType[ggml])
    data = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).reshape(w.shape[0], -1)
    return QuantWeight(data.clone(), qtype, (int(w.shape[0]), int(w.shape[1])))
