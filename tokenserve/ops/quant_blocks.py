"""Quantised weights in GGUF block formats: the type, its formats and its byte layouts.

Formats: Q4_0 / Q4_1 / Q8_0, k-quants Q4_K / Q5_K / Q6_K. A :class:`QuantWeight` holds a
``[N, K]`` weight as raw GGUF blocks, either one output row per tensor row as in the file
(layout ``"rows"``: uint8 ``[N, (K // 32) * block_bytes]``) or regrouped for the kernel
(layout ``"x8"``, :func:`repack_blocks`: the same bytes, 8 rows interleaved per block;
``csrc/quant.cpp`` draws it). The block layouts (ggml ``ggml-common.h``; 32 weights per
block, little-endian)::

    Q4_0  18 bytes  | d: fp16 | qs: 16 bytes |            w[j] = d * (q[j] - 8)
    Q4_1  20 bytes  | d: fp16 | m: fp16 | qs: 16 bytes |  w[j] = d * q[j] + m
    Q8_0  34 bytes  | d: fp16 | qs: 32 x int8 |           w[j] = d * qs[j]

    Q4 nibbles: byte i of qs holds q[i] in its low nibble and q[i + 16] in its high one.

The k-quants (ggml ``ggml-common.h`` ``block_q4_K`` / ``block_q5_K`` / ``block_q6_K``,
gguf-py ``gguf.quants.Q4_K`` ...) have 256-weight super-blocks; their layouts and the
kernel's ``"k8"`` regrouping (:func:`repack_k8`, ``csrc/quant_k.cpp``) are described in
the "k-quants" section below.

The weight-only int8 type (:class:`~tokenserve.ops.quant_int8.Int8Weight`) is a
:class:`QuantWeight` too (``tokenserve/ops/quant_int8.py``); the calls that take either
kind (``repack_x8``, ``dequantize_ref``, ``dequantize_rows_ref``) and the pure-torch
oracles of the kernels' arithmetic are in ``tokenserve/ops/quant.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32  #: weights per block (Q4_0 / Q4_1 / Q8_0), and per activation block of every kernel
QK_K = 256  #: weights per k-quant super-block
#: the k-quant formats (``csrc/quant_k.cpp``, layout ``"k8"``)
K_QTYPES = ("q4_k", "q5_k", "q6_k")
#: bytes per block (``BLOCK_ELEMS`` weights), by format
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "q4_k": 144, "q5_k": 176, "q6_k": 210}
#: weights per block, by format
BLOCK_ELEMS = {"q4_0": QK, "q4_1": QK, "q8_0": QK, "q4_k": QK_K, "q5_k": QK_K, "q6_k": QK_K}
#: ids passed to the C++ kernels (``quant_gemm``: 0..2; ``quant_k_gemm``: ggml's type ids)
QTYPE_IDS = {"q4_0": 0, "q4_1": 1, "q8_0": 2, "q4_k": 12, "q5_k": 13, "q6_k": 14}
#: GGML type names (gguf.GGMLQuantizationType) -> our names
FROM_GGML = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0",
             "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}
RG = 8  #: rows per group in the x8 and k8 layouts
NT = 16  #: rows per tile in the t16 layout (``csrc/quant_amx.cpp``)
#: bytes per (tile of 16 rows, block) in the t16 layout: fp16 d[16], (Q4_1) fp16 m[16], quants
T16_BYTES = {"q4_0": 288, "q4_1": 320, "q8_0": 544}
#: bytes per (group of 8 rows, block) in the x8 layout, (group, super-block) in k8
GROUP_BYTES = {"q4_0": 144, "q4_1": 160, "q8_0": 272, "q4_k": 1152, "q5_k": 1408, "q6_k": 1680}


@dataclass(frozen=True)
class QuantWeight:
    """A ``[N, K]`` weight in a GGUF block format.

    Attributes:
        data: layout ``"rows"``: uint8 ``[N, (K // BLOCK_ELEMS[qtype]) * BLOCK_BYTES[qtype]]``,
            row n's blocks in k order, exactly the bytes of the GGUF tensor; layout ``"x8"``
            (Q4_0 / Q4_1 / Q8_0): uint8 ``[ceil(N / 8), K // 32, GROUP_BYTES[qtype]]``
            (:func:`repack_x8`); layout ``"k8"`` (k-quants): uint8
            ``[ceil(N / 8), K // 256, GROUP_BYTES[qtype]]`` (:func:`repack_k8`); layout
            ``"t16"`` (Q4_0 / Q4_1 / Q8_0, the AMX kernel's): uint8
            ``[ceil(N / 16), K // 32, T16_BYTES[qtype]]`` (:func:`repack_t16`). Contiguous.
        qtype: ``"q4_0"``, ``"q4_1"``, ``"q8_0"``, ``"q4_k"``, ``"q5_k"`` or ``"q6_k"``.
        shape: ``(N, K)``; K a multiple of ``BLOCK_ELEMS[qtype]`` (32, or 256 for k-quants).
        layout: ``"rows"``, ``"x8"``, ``"k8"`` or ``"t16"``.

    Raises:
        ValueError: an unknown format or layout, K not a multiple of the block, or data of
            the wrong dtype / shape.
    """

    data: torch.Tensor
    qtype: str
    shape: tuple[int, int]
    layout: str = "rows"

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported quantisation {self.qtype!r}; known {sorted(BLOCK_BYTES)}")
        n, k = self.shape
        qk = BLOCK_ELEMS[self.qtype]
        if k % qk:
            raise ValueError(f"{self.qtype}: K={k} is not a multiple of {qk}")
        kquant = self.qtype in K_QTYPES
        if self.layout == "rows":
            want = (n, k // qk * BLOCK_BYTES[self.qtype])
        elif self.layout == ("k8" if kquant else "x8"):
            want = ((n + RG - 1) // RG, k // qk, GROUP_BYTES[self.qtype])
        elif self.layout == "t16" and self.qtype in T16_BYTES:
            want = ((n + NT - 1) // NT, k // qk, T16_BYTES[self.qtype])
        else:
            raise ValueError(f"unknown layout {self.layout!r} for {self.qtype}")
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"{self.qtype} data must be uint8 {want}, got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, idx: torch.Tensor) -> QuantWeight:
        """The weight restricted to rows ``idx`` (int64 [R]), layout ``"rows"``."""
        if self.layout == "k8":  # unpack only the groups holding the rows (embedding lookups)
            g = self.data.index_select(0, idx // RG)
            sub = unpack_k8(QuantWeight(g, self.qtype, (g.shape[0] * RG, self.shape[1]), "k8"))
            rows = sub.data.view(g.shape[0], RG, -1)[torch.arange(idx.numel()), idx % RG]
            return QuantWeight(rows.contiguous(), self.qtype, (int(idx.numel()), self.shape[1]))
        w = unpack_x8(self) if self.layout in ("x8", "t16") else self
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


def _head_bytes(qtype: str) -> int:
    """Bytes before the quants in a GGUF block (d, and m for Q4_1)."""
    return 4 if qtype == "q4_1" else 2


def _row_groups(w: QuantWeight, rows: int) -> torch.Tensor:
    """The GGUF blocks of ``w`` (layout ``"rows"``) as uint8 ``[ceil(N / rows), K // 32, rows,
    block_bytes]``: groups of ``rows`` output rows per block, rows past N zero."""
    n, k = w.shape
    nb, bb = k // QK, BLOCK_BYTES[w.qtype]
    g = (n + rows - 1) // rows
    blocks = torch.zeros(g * rows, nb, bb, dtype=torch.uint8)
    blocks[:n] = w.data.view(n, nb, bb)
    return blocks.view(g, rows, nb, bb).permute(0, 2, 1, 3)


def repack_blocks(w: QuantWeight) -> QuantWeight:
    """GGUF blocks in the kernel's layout: 8 rows interleaved per block (``csrc/quant.cpp``
    header); a k-quant in its ``"k8"`` layout (:func:`repack_k8`).

    Per (group g, block b): the 8 rows' fp16 ``d`` (16 bytes), for Q4_1 their fp16 ``m``
    (16 bytes), then the quants in 16-byte chunks, chunk p holding each row's bytes
    ``2p, 2p+1`` of its quants (``qs``) at ``2r, 2r+1``. Rows past N are zeros.
    """
    if w.qtype in K_QTYPES:  # k-quants: csrc/quant_k.cpp's own layout
        return repack_k8(w)
    if w.layout == "x8":
        return w
    blocks = _row_groups(w, RG)  # [g, nb, 8, bb]
    g, nb, _, bb = blocks.shape
    h = _head_bytes(w.qtype)
    parts = [blocks[..., 0:2].reshape(g, nb, 16)]  # d of the 8 rows
    if w.qtype == "q4_1":
        parts.append(blocks[..., 2:4].reshape(g, nb, 16))
    qs = blocks[..., h:].reshape(g, nb, RG, (bb - h) // 2, 2)  # [g, nb, row, chunk, 2]
    parts.append(qs.permute(0, 1, 3, 2, 4).reshape(g, nb, -1))
    return QuantWeight(torch.cat(parts, dim=-1).contiguous(), w.qtype, w.shape, "x8")


def unpack_x8(w: QuantWeight) -> QuantWeight:
    """Inverse of :func:`repack_blocks` (and of :func:`repack_k8`, :func:`repack_t16`): the
    GGUF rows again."""
    if w.layout == "rows":
        return w
    if w.layout == "k8":
        return unpack_k8(w)
    if w.layout == "t16":
        return unpack_t16(w)
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


def repack_t16(w: QuantWeight) -> QuantWeight:
    """Q4_0 / Q4_1 / Q8_0 blocks in the AMX kernel's layout (``csrc/quant_amx.cpp`` header):
    per (tile t of 16 rows, block b), the 16 rows' fp16 ``d`` (32 bytes), for Q4_1 their
    fp16 ``m`` (32 bytes), then each row's GGUF quants in row order (16 x 16 bytes, Q8_0
    16 x 32): the file's bytes regrouped, as many as in the file. Rows past N are zeros.

    Raises:
        ValueError: a k-quant or int8 weight (no t16 layout).
    """
    if w.qtype not in T16_BYTES:
        raise ValueError(f"no t16 layout for {w.qtype}")
    if w.layout == "t16":
        return w
    blocks = _row_groups(unpack_x8(w), NT)  # [t, nb, 16, bb]
    t, nb, _, bb = blocks.shape
    h = _head_bytes(w.qtype)
    parts = [blocks[..., 0:2].reshape(t, nb, 2 * NT)]  # d of the 16 rows
    if w.qtype == "q4_1":
        parts.append(blocks[..., 2:4].reshape(t, nb, 2 * NT))
    parts.append(blocks[..., h:].reshape(t, nb, NT * (bb - h)))
    return QuantWeight(torch.cat(parts, dim=-1).contiguous(), w.qtype, w.shape, "t16")


def unpack_t16(w: QuantWeight) -> QuantWeight:
    """Inverse of :func:`repack_t16`: the GGUF rows again."""
    n, k = w.shape
    nb, bb, h = k // QK, BLOCK_BYTES[w.qtype], _head_bytes(w.qtype)
    t = w.data.shape[0]
    parts = [w.data[..., 0:2 * NT].reshape(t, nb, NT, 2)]
    off = 2 * NT
    if w.qtype == "q4_1":
        parts.append(w.data[..., off:off + 2 * NT].reshape(t, nb, NT, 2))
        off += 2 * NT
    parts.append(w.data[..., off:].reshape(t, nb, NT, bb - h))
    blocks = torch.cat(parts, dim=-1).permute(0, 2, 1, 3).reshape(t * NT, nb * bb)
    return QuantWeight(blocks[:n].contiguous(), w.qtype, w.shape)


# ------------------------------------------------------------------------------ k-quants
#
# GGUF block layouts (ggml ggml-common.h block_q4_K / block_q5_K / block_q6_K; decoding as
# ggml-quants.c dequantize_row_q*_K and gguf-py gguf/quants.py Q4_K / Q5_K / Q6_K), 256
# weights per super-block, little-endian:
#
#   Q4_K 144 B | d fp16 | dmin fp16 | scales 12 B | qs 128 B |
#   Q5_K 176 B | d fp16 | dmin fp16 | scales 12 B | qh 32 B | qs 128 B |
#        8 sub-blocks of 32, each a 6-bit scale sc[j] and 6-bit min m[j] packed in the 12
#        bytes (j < 4: sc = b[j] & 63, m = b[j+4] & 63; j >= 4: sc = (b[j+4] & 15) |
#        (b[j-4] >> 6) << 4, m = (b[j+4] >> 4) | (b[j] >> 6) << 4). qs bytes 32i..32i+31
#        hold sub-block 2i in their low nibbles and 2i+1 in their high ones; Q5_K's fifth bit
#        of element l of sub-block j is bit j of qh[l].      w = (d*sc[j]) * q - (dmin*m[j])
#   Q6_K 210 B | ql 128 B | qh 64 B | scales 16 x int8 | d fp16 |
#        16 sub-blocks of 16, one int8 scale each. Half h (128 weights): element
#        128h + 32c + l (c = 0..3, l = 0..31) has its low 4 bits in ql[64h + 32(c%2) + l]
#        (low nibble for c < 2, high for c >= 2) and its high 2 bits at bits 2c of
#        qh[32h + l].                                        w = (d*sc[s]) * (q - 32)
#
# The products d*sc and dmin*m are exact in fp32 (11-bit by <= 8-bit mantissas).


def k_fields(blocks: torch.Tensor, qtype: str) -> dict[str, torch.Tensor]:
    """Decode GGUF k-quant super-blocks (uint8 [..., BLOCK_BYTES]) into fields:
    ``d`` (and ``dmin``) uint8 [..., 2] fp16 bytes, ``scales`` (Q4_K / Q5_K: the packed
    uint8 [..., 12]; Q6_K: uint8 [..., 16] holding int8), ``q`` uint8 [..., 256]: the
    unsigned quant of each weight in element order (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63)."""
    lead = blocks.shape[:-1]
    if qtype == "q6_k":
        ql, qh = blocks[..., 0:128].to(torch.int32), blocks[..., 128:192].to(torch.int32)
        shifts = torch.tensor([0, 4], dtype=torch.int32).view(2, 1)
        lo4 = ((ql.reshape(*lead, 2, 1, 64) >> shifts) & 15).reshape(*lead, 2, 4, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(4, 1)
        hi2 = ((qh.reshape(*lead, 2, 1, 32) >> shifts) & 3)
        q = (lo4 | (hi2 << 4)).reshape(*lead, QK_K)
        return {"d": blocks[..., 208:210], "scales": blocks[..., 192:208],
                "q": q.to(torch.uint8)}
    off = 16 if qtype == "q4_k" else 48
    qs = blocks[..., off:off + 128].to(torch.int32).reshape(*lead, 4, 1, 32)
    q = ((qs >> torch.tensor([0, 4], dtype=torch.int32).view(2, 1)) & 15).reshape(*lead, 8, 32)
    if qtype == "q5_k":
        qh = blocks[..., 16:48].to(torch.int32).unsqueeze(-2)  # [..., 1, 32]
        q = q | (((qh >> torch.arange(8, dtype=torch.int32).view(8, 1)) & 1) << 4)
    return {"d": blocks[..., 0:2], "dmin": blocks[..., 2:4], "scales": blocks[..., 4:16],
            "q": q.reshape(*lead, QK_K).to(torch.uint8)}


def _k_encode(f: dict[str, torch.Tensor], qtype: str) -> torch.Tensor:
    """Inverse of :func:`k_fields`: GGUF super-block bytes uint8 [..., BLOCK_BYTES]."""
    q = f["q"].to(torch.int32)
    lead = q.shape[:-1]
    if qtype == "q6_k":
        lo4, hi2 = (q & 15).reshape(*lead, 2, 4, 32), (q >> 4).reshape(*lead, 2, 4, 32)
        ql = (lo4[..., 0:2, :] | (lo4[..., 2:4, :] << 4)).reshape(*lead, 128)
        qh = (hi2[..., 0, :] | (hi2[..., 1, :] << 2) | (hi2[..., 2, :] << 4)
              | (hi2[..., 3, :] << 6)).reshape(*lead, 64)
        return torch.cat((ql.to(torch.uint8), qh.to(torch.uint8), f["scales"], f["d"]), dim=-1)
    sub = q.reshape(*lead, 4, 2, 32)
    qs = ((sub[..., 0, :] & 15) | ((sub[..., 1, :] & 15) << 4)).reshape(*lead, 128)
    parts = [f["d"], f["dmin"], f["scales"]]
    if qtype == "q5_k":
        bits = (q.reshape(*lead, 8, 32) >> 4) << torch.arange(8, dtype=torch.int32).view(8, 1)
        parts.append(bits.sum(-2).to(torch.uint8))
    parts.append(qs.to(torch.uint8))
    return torch.cat(parts, dim=-1)


# The "k8" layout (csrc/quant_k.cpp draws it): 8 output rows interleaved per super-block, per
# (group g, super-block B) GROUP_BYTES bytes. Chunks are 16 bytes: row r's two bytes at 2r,
# 2r + 1 (byte j of a row serves element pair member j), so a chunk widened to int16 holds 8
# rows x 2 elements, one vpmaddwd operand. Quants are regrouped per 32-weight block:
#
#   Q4_K 1152 B: | d[8] fp16 | dmin[8] fp16 | scale words: row r's 12 scale bytes as three
#                  u32 words, word w at 32 + 32w + 4r (96 B) | 8 sub-blocks x 128 B |
#       sub-block j: chunks p = 0..7: byte j of row r = q[2p + j] | q[16 + 2p + j] << 4
#                    (element numbers within the sub-block; the Q4_0/Q4_1 x8 pairing)
#   Q5_K 1408 B: as Q4_K with 160 B sub-blocks: the 128 B of low nibbles, then two 16 B
#       chunks of fifth bits: chunk h = 0, 1: byte j of row r has bit i = q[16h + 2i + j] >> 4
#   Q6_K 1680 B: | d[8] fp16 | scales[16][8] int8 (sub-block s, row r at 16 + 8s + r) |
#       8 blocks of 32 weights x 192 B: 8 chunks of low 4 bits, byte j of row r in chunk p =
#       lo4(q[2p + j]) | lo4(q[16 + 2p + j]) << 4; then 4 chunks of high 2 bits, byte j of
#       row r in chunk c: bits 2t..2t+1 = hi2(q[2c + j + 8t]), t = 0..3 (q unsigned 0..63)
#
# Rows past N are zero bytes (d = 0: they compute to 0 and are never stored).


#: Weights repacked at a time: the decode below holds ~30 bytes a weight in transient int32
#: fields, so 2M weights is ~60 MB (a 128256-row Q6_K table in one piece peaked at ~6 GB;
#: 4096-row pieces still put ~300 MB on a 1B model's peak RSS at K = 8192).
_REPACK_WEIGHTS = 1 << 21


def repack_k8(w: QuantWeight) -> QuantWeight:
    """A k-quant weight in the kernel's ``"k8"`` layout (see above; same byte count as the
    GGUF rows, padded to a multiple of 8 rows).

    Args:
        w: a Q4_K / Q5_K / Q6_K :class:`QuantWeight` (either layout).

    Returns:
        layout ``"k8"``: uint8 ``[ceil(N / 8), K // 256, GROUP_BYTES[qtype]]``.

    Raises:
        ValueError: not a k-quant.
    """
    if w.qtype not in K_QTYPES:
        raise ValueError(f"repack_k8: {w.qtype} is not a k-quant {K_QTYPES}")
    if w.layout == "k8":
        return w
    n, k = w.shape
    nsb, bb = k // QK_K, BLOCK_BYTES[w.qtype]
    g = (n + RG - 1) // RG
    step = max(1, _REPACK_WEIGHTS // (RG * k)) * RG
    if n > step:  # the decode below holds ~30 bytes a weight: bound the peak
        rows = w.data.view(n, nsb * bb)
        parts = [repack_k8(QuantWeight(rows[r:r + step], w.qtype, (min(step, n - r), k))).data
                 for r in range(0, n, step)]
        return QuantWeight(torch.cat(parts), w.qtype, w.shape, "k8")
    rows = torch.zeros(g * RG, nsb, bb, dtype=torch.uint8)
    rows[:n] = w.data.view(n, nsb, bb)
    f = k_fields(rows.view(g, RG, nsb, bb).permute(0, 2, 1, 3), w.qtype)  # [g, nsb, 8, ...]
    q = f["q"].to(torch.int32)

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [g, nsb, 8 rows, ..., 2] -> rows inside
        nd = x.dim()
        return x.permute(0, 1, *range(3, nd - 1), 2, nd - 1)

    if w.qtype == "q6_k":
        blk = q.reshape(g, nsb, RG, 8, 32)
        lo4, hi2 = (blk & 15).reshape(g, nsb, RG, 8, 2, 16), (blk >> 4).reshape(
            g, nsb, RG, 8, 4, 8)
        ql = (lo4[..., 0, :] | (lo4[..., 1, :] << 4)).reshape(g, nsb, RG, 8, 8, 2)
        qh = sum(hi2[..., t, :] << (2 * t) for t in range(4)).reshape(g, nsb, RG, 8, 4, 2)
        body = torch.cat((chunks(ql).reshape(g, nsb, 8, 128),
                          chunks(qh).reshape(g, nsb, 8, 64)), dim=-1).reshape(g, nsb, -1)
        sc = f["scales"].permute(0, 1, 3, 2).reshape(g, nsb, 128)
        parts = [f["d"].reshape(g, nsb, 16), sc, body.to(torch.uint8)]
    else:
        sub = q.reshape(g, nsb, RG, 8, 2, 16)
        nib = ((sub[..., 0, :] & 15) | ((sub[..., 1, :] & 15) << 4)).reshape(g, nsb, RG, 8, 8, 2)
        body = chunks(nib).reshape(g, nsb, 8, 128)
        if w.qtype == "q5_k":
            hb = (sub >> 4).reshape(g, nsb, RG, 8, 2, 8, 2)  # [.., sub, half, i, j]
            bits = (hb << torch.arange(8, dtype=torch.int32).view(8, 1)).sum(-2)
            body = torch.cat((body, chunks(bits).reshape(g, nsb, 8, 32)), dim=-1)
        words = f["scales"].reshape(g, nsb, RG, 3, 4).permute(0, 1, 3, 2, 4)
        parts = [f["d"].reshape(g, nsb, 16), f["dmin"].reshape(g, nsb, 16),
                 words.reshape(g, nsb, 96), body.reshape(g, nsb, -1).to(torch.uint8)]
    data = torch.cat(parts, dim=-1).contiguous()
    return QuantWeight(data, w.qtype, w.shape, "k8")


def unpack_k8(w: QuantWeight) -> QuantWeight:
    """Inverse of :func:`repack_k8`: the GGUF rows (layout ``"rows"``) again."""
    if w.layout == "rows":
        return w
    n = w.shape[0]
    g, nsb, _ = w.data.shape
    data = w.data.to(torch.int32)

    def rows_first(x: torch.Tensor) -> torch.Tensor:  # [g, nsb, ..., 8 rows, 2] -> rows 3rd
        nd = x.dim()
        return x.permute(0, 1, nd - 2, *range(2, nd - 2), nd - 1)

    f: dict[str, torch.Tensor] = {"d": w.data[..., 0:16].reshape(g, nsb, RG, 2)}
    if w.qtype == "q6_k":
        f["scales"] = w.data[..., 16:144].reshape(g, nsb, 16, RG).permute(0, 1, 3, 2)
        body = data[..., 144:].reshape(g, nsb, 8, 192)
        ql = rows_first(body[..., :128].reshape(g, nsb, 8, 8, RG, 2))  # [g,nsb,8r,blk,p,j]
        qh = rows_first(body[..., 128:].reshape(g, nsb, 8, 4, RG, 2))  # [g,nsb,8r,blk,c,j]
        lo4 = torch.stack((ql & 15, ql >> 4), dim=-3)  # [.., blk, half, p, j]
        hi2 = torch.stack([(qh >> (2 * t)) & 3 for t in range(4)], dim=-3)  # [.., blk, t, c, j]
        q = lo4.reshape(g, nsb, RG, 8, 32) | (hi2.reshape(g, nsb, RG, 8, 32) << 4)
    else:
        f["dmin"] = w.data[..., 16:32].reshape(g, nsb, RG, 2)
        f["scales"] = w.data[..., 32:128].reshape(g, nsb, 3, RG, 4).permute(0, 1, 3, 2, 4).reshape(
            g, nsb, RG, 12)
        sb = 128 if w.qtype == "q4_k" else 160
        body = data[..., 128:].reshape(g, nsb, 8, sb)
        nib = rows_first(body[..., :128].reshape(g, nsb, 8, 8, RG, 2))  # [g,nsb,8r,sub,p,j]
        q = torch.stack((nib & 15, nib >> 4), dim=-3).reshape(g, nsb, RG, 8, 32)
        if w.qtype == "q5_k":
            bits = rows_first(body[..., 128:].reshape(g, nsb, 8, 2, RG, 2))  # [.., sub, h, j]
            hb = (bits.unsqueeze(-2) >> torch.arange(8, dtype=torch.int32).view(8, 1)) & 1
            q = q | (hb.reshape(g, nsb, RG, 8, 32) << 4)  # [.., sub, h, i, j] = element order
    f["q"] = q.reshape(g, nsb, RG, QK_K).to(torch.uint8)
    f = {key: v.permute(0, 2, 1, 3) for key, v in f.items()}  # [g, 8 rows, nsb, ...]
    blocks = _k_encode(f, w.qtype).reshape(g * RG, nsb * BLOCK_BYTES[w.qtype])
    return QuantWeight(blocks[:n].contiguous(), w.qtype, w.shape)
