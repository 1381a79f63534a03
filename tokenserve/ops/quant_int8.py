"""Weight-only int8 (``--quantization int8``): symmetric, per output channel.

An :class:`Int8Weight` holds a ``[N, K]`` weight as int8 quants ``q`` and one fp32 scale per
output row, ``w[n, k] ~ s[n] * q[n, k]`` with ``s[n] = max_k |w[n, k]| / 127`` and
``q = round_half_even(w / s)`` in ``[-127, 127]`` (:func:`quantize_int8`, from the checkpoint's
own bf16/fp32 values). Two layouts::

    "rows"  data int8 [N, K]                         scale fp32 [N]
    "x16"   data int8 [ceil(N / 16), K, 16]          scale fp32 [ceil(N / 16) * 16]
            (pack_int8: 16 output rows interleaved per k, zero past N; csrc/int8_gemm.cpp)

It is a :class:`~tokenserve.ops.quant_blocks.QuantWeight` (qtype ``"int8"``) so the model's
loading code treats it like GGUF blocks: fused projections concatenate rows
(:meth:`Int8Weight.cat`), ``repack_x8`` packs it for the kernel, ``dequantize_ref`` gives its
fp32 weight (both in ``tokenserve/ops/quant.py``). A tied
embedding / lm_head keeps the table as loaded in :attr:`Int8Weight.table`: the lm_head
computes in int8, the embedding lookup reads the table (``dequantize_rows_ref``).

:func:`int8_linear_ref` emulates the kernel's arithmetic; :func:`int8_linear_fp32_ref` is the
plain fp32 product with the dequantised weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenserve.ops.quant_blocks import QuantWeight

NR = 16  #: output rows per panel in the "x16" layout


@dataclass(frozen=True)
class Int8Weight(QuantWeight):
    """A ``[N, K]`` weight as int8 quants and fp32 row scales (see the module doc).

    Attributes:
        data: int8, layout ``"rows"`` ``[N, K]`` or ``"x16"`` ``[ceil(N/16), K, 16]``.
        qtype: ``"int8"``.
        shape: ``(N, K)``.
        layout: ``"rows"`` or ``"x16"``.
        scale: fp32 ``[N]`` (rows) or ``[ceil(N/16) * 16]`` (x16, zero past N).
        table: the ``[N, K]`` weight as loaded (the model's dtype) when it is also a tied
            embedding table, else None.
    """

    scale: torch.Tensor | None = None
    table: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.shape
        np_ = (n + NR - 1) // NR
        want = {"rows": ((n, k), (n,)), "x16": ((np_, k, NR), (np_ * NR,))}.get(self.layout)
        if self.qtype != "int8" or want is None:
            raise ValueError(f"Int8Weight: qtype int8 and layout rows|x16, got "
                             f"{self.qtype!r} {self.layout!r}")
        if (self.data.dtype != torch.int8 or tuple(self.data.shape) != want[0]
                or self.scale is None or self.scale.dtype != torch.float32
                or tuple(self.scale.shape) != want[1]):
            raise ValueError(f"Int8Weight {self.layout}: data int8 {want[0]} and scale fp32 "
                             f"{want[1]}, got {self.data.dtype} {tuple(self.data.shape)}, "
                             f"{None if self.scale is None else tuple(self.scale.shape)}")
        if self.table is not None and tuple(self.table.shape) != (n, k):
            raise ValueError(f"Int8Weight: table must be {(n, k)}")

    @property
    def nbytes(self) -> int:
        """Bytes held: quants, scales and the embedding table if any."""
        t = 0 if self.table is None else self.table.numel() * self.table.element_size()
        return self.data.numel() + self.scale.numel() * 4 + t

    @staticmethod
    def cat(parts: list[QuantWeight]) -> Int8Weight:
        """Rows of ``parts`` (``"rows"`` layout, same K, no table) one after the other."""
        if (any(not isinstance(p, Int8Weight) or p.layout != "rows" or p.table is not None
                for p in parts) or len({p.shape[1] for p in parts}) != 1):
            raise ValueError(f"cannot fuse {[(p.qtype, p.shape) for p in parts]}")
        return Int8Weight(torch.cat([p.data for p in parts]), "int8",
                          (sum(p.shape[0] for p in parts), parts[0].shape[1]),
                          scale=torch.cat([p.scale for p in parts]))


def quantize_int8(w: torch.Tensor, table: torch.Tensor | None = None) -> Int8Weight:
    """``[N, K]`` float weight -> :class:`Int8Weight` (layout ``"rows"``).

    ``s = amax / 127`` per row (fp32; 0 for an all-zero row, whose quants are 0) and
    ``q = round_half_even(w / s)``, so ``|w - s q| <= s / 2`` elementwise.
    """
    wf = w.float()
    s = wf.abs().amax(dim=1) / 127.0
    inv = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(wf / inv.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), "int8", (int(w.shape[0]), int(w.shape[1])),
                      scale=s.contiguous(), table=table)


def pack_int8(w: Int8Weight) -> Int8Weight:
    """The kernel's ``"x16"`` layout (module doc); a no-op on a packed weight."""
    if w.layout == "x16":
        return w
    n, k = w.shape
    np_ = (n + NR - 1) // NR
    q = torch.zeros(np_ * NR, k, dtype=torch.int8)
    q[:n] = w.data
    s = torch.zeros(np_ * NR, dtype=torch.float32)
    s[:n] = w.scale
    return Int8Weight(q.view(np_, NR, k).transpose(1, 2).contiguous(), "int8", w.shape, "x16",
                      scale=s, table=w.table)


def unpack_int8(w: Int8Weight) -> Int8Weight:
    """Inverse of :func:`pack_int8`."""
    if w.layout == "rows":
        return w
    n, k = w.shape
    q = w.data.transpose(1, 2).reshape(-1, k)[:n].contiguous()
    return Int8Weight(q, "int8", w.shape, scale=w.scale[:n].contiguous(), table=w.table)


def dequantize_int8(w: Int8Weight) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight ``s[n] * q[n, k]``."""
    r = unpack_int8(w)
    return r.data.float() * r.scale.unsqueeze(1)


def embedding_rows_int8(ids: torch.Tensor, w: Int8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (int [T]) of the table: the table as loaded when kept, else dequantised."""
    if w.table is not None:
        return F.embedding(ids.long(), w.table).to(out_dtype)
    r = unpack_int8(w)
    ids = ids.long()
    return (r.data[ids].float() * r.scale[ids].unsqueeze(1)).to(out_dtype)


def int8_linear_ref(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Emulation of ``int8_gemm``: per output element ::

        acc = 0; for k in 0..K-1: acc = fma(x[m, k], float(q[n, k]), acc)
        y = fl(acc * s[n]) (+ b[n]), rounded once to out_dtype

    The fma is emulated in fp64 (``x * q`` is exact there; the sum is rounded to fp64, then
    fp32: equal to the fused result except on rare double-rounding ties), so compare with a
    ~1e-6 relative tolerance. O(K) torch ops on [M, N]: for tests.

    Args:
        x: [M, K] float. w: either layout. bias: [N] or None. out_dtype: None = x's dtype.

    Returns:
        [M, N] in ``out_dtype``.
    """
    r = unpack_int8(w)
    xd = x.float().double()
    qd = r.data.double()
    acc = torch.zeros(x.shape[0], r.shape[0], dtype=torch.float32)
    for k in range(r.shape[1]):
        acc = (xd[:, k:k + 1] * qd[:, k] + acc.double()).float()
    y = acc * r.scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def int8_linear_fp32_ref(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ dequantize(W).T (+ b)`` in fp32 (torch's summation order)."""
    y = F.linear(x.float(), dequantize_int8(w), None if bias is None else bias.float())
    return y.to(out_dtype or x.dtype)
