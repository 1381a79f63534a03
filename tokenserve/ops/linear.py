"""The model's linear layers: ``y = x @ W.T (+ b)`` on the fastest row-invariant backend.

:class:`Linear` picks one backend per layer, once, at construction (``Linear.backend``
says which, for the start-up log):

``"tokenserve.gemm"``
    our kernel (``csrc/gemm.cpp``) on a weight prepacked once in its own dtype (bf16: half
    the bytes of fp32). Two arithmetic chains, chosen per weight at construction
    (``Linear.isa``):

    * ``"avx512bf16"``: a bf16 weight on a CPU with AVX512_BF16 (AMD Zen 4/5, Intel Cooper
      Lake, Sapphire Rapids and later) is packed in k pairs and computed with
      ``vdpbf16ps`` on bf16 activations (2 multiply-adds per lane and instruction: about
      twice the FMA chain's speed once a step is compute-bound, 16+ rows);
    * ``"avx2"`` / ``"portable"``: the fp32 FMA chain over k, the AVX2+FMA loop or its
      scalar twin (``std::fma``, bit-equal), for fp32 weights, CPUs without AVX512_BF16, and
      ``TOKENSERVE_GEMM=c-fma``.

    Any out dtype (bf16/fp32), so the lm_head produces fp32 logits straight from the fp32
    accumulators.
``"onednn"``
    oneDNN's bf16 GEMM on a weight reordered ahead of time
    (``torch.ops.mkldnn._reorder_linear_weight``), only when asked for
    (``TOKENSERVE_GEMM=onednn``): its blocking over rows depends on M on AMX (a request's
    logits moved by up to 0.2 between alone and batched on a Sapphire Rapids, issue 20), so
    it is not batch-invariant and is never the default.
``"tokenserve.quant_gemm"``
    a :class:`~tokenserve.ops.quant_blocks.QuantWeight` (the GGUF's own Q4_0 / Q4_1 / Q8_0 blocks,
    regrouped 8 rows per block once: ``repack_x8``) on our kernel (``csrc/quant.cpp``):
    activations quantised to int12 per 32-block, exact integer block dots, fp32
    accumulation; any out dtype. The default for those formats on every CPU, with one
    arithmetic and so the same bits everywhere: AVX-512 VNNI tiles where the CPU has them,
    else AVX2 or portable code, and from 16 rows on Intel AMX-INT8 tiles where the CPU and
    OS allow (``csrc/quant_amx_int.cpp``: the 12-bit activations split into two bytes, so
    the int8 tile product is the exact block dot). Row-invariant like ``tokenserve.gemm``,
    and a row's bits do not depend on which of those tiles ran it.
``"tokenserve.quant_amx"``
    the same GGUF blocks (regrouped 16 rows per block once: ``repack_t16``) on Intel AMX-BF16
    tiles (``csrc/quant_amx.cpp``), only when asked for (``TOKENSERVE_GEMM=amx-bf16``): each
    16 x 32 weight tile is dequantised to bf16 in L1 right before its tile products, the
    activations stay bf16, fp32 accumulation. Served on a 2-core Sapphire Rapids it gave
    1.2-1.3x the default's output under load (16 and 64 concurrent) and 0.57x alone
    (bench/README.md, issue 24). Other bits than ``tokenserve.quant_gemm``'s (a server runs
    one of the two); row-invariant like it.
``"tokenserve.quant_k_gemm"``
    the same for the k-quants Q4_K / Q5_K / Q6_K (``csrc/quant_k.cpp``, layout ``repack_k8``:
    8 rows interleaved per 256-weight super-block; the sub-block scales applied in integers,
    one fp32 step per super-block) but on int8 activations per 256-element super-block
    (llama.cpp's Q8_K): AVX-512 VNNI ``vpdpbusd`` tiles (two 8-row groups per zmm, up to 8
    activation rows) where the CPU has them from two rows on, AMX-INT8 tiles from 16 rows,
    else AVX2 (``vpmaddubsw``) or portable code, the same bits on each. A fused projection
    whose parts differ in format (a Q4_K_M layer's q|k in Q4_K, v in Q6_K) runs per part
    (:class:`SplitLinear`), never widened to bf16.
``"tokenserve.int8_gemm"``
    an :class:`~tokenserve.ops.quant_int8.Int8Weight` (``--quantization int8``: int8 quants,
    one fp32 scale per output row), packed 16 rows per k once (``pack_int8``), on our AVX2
    kernel (``csrc/int8_gemm.cpp``): the weight is dequantised in registers and multiplied
    with fp32 FMAs against unquantised activations, the row scale applied last. Row-invariant
    like ``tokenserve.gemm`` (the same sequential FMA chain over k).
``"torch"``
    ``F.linear`` (then ``.to(out_dtype)``): non-CPU devices, other dtypes, or no extension
    (a quantised weight is then dequantised once, to ``fallback_dtype``).

Batch invariance: with ``tokenserve.gemm`` every output element is one fixed chain (the fp32
FMA chain over k = 0..K-1, or the ``vdpbf16ps`` chain over the k pairs), plus the bias,
rounded once, whatever the number of rows, the row's position in the batch and the thread
count: a token's output row never depends on what else is in the step
(``tests/unit/test_kernel_gemm.py`` checks it bit for bit, per chain; the integration tests
check the model per backend). The two chains differ in the last bits, so a given machine
and weight always use one. ``F.linear`` through MKL/oneDNN is NOT row-invariant (its
kernel and blocking depend on M).

``TOKENSERVE_GEMM`` forces a backend where it can run (for experiments): ``c`` (ours, the
default), ``c-fma`` (ours, FMA chain even where AVX512_BF16 exists), ``amx-bf16`` (the GGUF
blocks on ``tokenserve.quant_amx`` where AMX-BF16 exists), ``onednn``, ``torch``.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from tokenserve.config import env
from tokenserve.ops.dispatch import Kernels
from tokenserve.ops.host_memory import (
    HUGE_PAGE,
    HUGE_WEIGHT_MIN_BYTES,
    drop_file_pages,
    on_one_huge_region,
    trim_heap,
    weight_on_huge_pages,
)
from tokenserve.ops.quant import dequantize_ref, repack_x8
from tokenserve.ops.quant_blocks import K_QTYPES, QTYPE_IDS, QuantWeight, repack_t16

log = logging.getLogger("tokenserve.ops")

BACKENDS = ("onednn", "tokenserve.gemm", "tokenserve.quant_gemm", "tokenserve.quant_amx",
            "tokenserve.quant_k_gemm", "tokenserve.int8_gemm", "torch")
# the backends whose rows never depend on the batch (see the module doc)
INVARIANT_BACKENDS = ("tokenserve.gemm", "tokenserve.quant_gemm", "tokenserve.quant_amx",
                      "tokenserve.quant_k_gemm", "tokenserve.int8_gemm")
FORCE_VALUES = ("", "c", "c-fma", "amx-bf16", "onednn", "torch")
#: the GGUF formats ``tokenserve.quant_amx`` takes
AMX_QTYPES = ("q4_0", "q4_1", "q8_0")


def forced_backend() -> str:
    """``TOKENSERVE_GEMM`` ('' when unset).

    Raises:
        ValueError: a value other than those in ``FORCE_VALUES``.
    """
    force = env.gemm()
    if force not in FORCE_VALUES:
        raise ValueError(f"TOKENSERVE_GEMM={force!r}: expected one of "
                         f"{', '.join(v for v in FORCE_VALUES if v)}")
    return force


def vector_isa(c) -> str:
    """The inner loop our FMA-chain kernels run on this CPU: ``"avx2"`` or ``"portable"``."""
    return "avx2" if c is not None and c.cpu_features().get("avx2_fma", False) else "portable"


def quant_k_isa(c) -> str:
    """The inner loops of ``quant_k_gemm`` on this CPU: ``"avx512vnni"`` (``vpdpbusd`` on two
    8-row groups per zmm from two rows on, the AVX2 tiles for one; ``quant_gemm``'s are
    ``vpdpwssd``), ``"avx2"`` or ``"portable"``; all give the same bits."""
    if c is not None and c.cpu_features().get("avx512vnni", False):
        return "avx512vnni"
    return vector_isa(c)


def quant_isa(c) -> str:
    """The inner loops of ``quant_gemm`` on this CPU: those of :func:`quant_k_isa`, with
    ``"+amx_int8"`` after ``"avx512vnni"`` where 16+ rows run on AMX-INT8 tiles; all of them
    give the same bits."""
    isa = quant_k_isa(c)
    return isa + "+amx_int8" if isa == "avx512vnni" and amx_int8_available(c) else isa


def amx_available(c) -> bool:
    """True when this CPU has AMX-BF16 (with AVX512-VBMI) and the OS granted the process the
    tile state (``quant_amx_available`` asks it once)."""
    return c is not None and hasattr(c, "quant_amx_available") and bool(c.quant_amx_available())


def amx_int8_available(c) -> bool:
    """True when ``quant_gemm`` runs 16+ rows on AMX-INT8 tiles here: the CPU has them (with
    AVX512-VBMI and VNNI) and the OS granted the tile state (``quant_amx_int_available``)."""
    return (c is not None and hasattr(c, "quant_amx_int_available")
            and bool(c.quant_amx_int_available()))


def pair_dot_available(c) -> bool:
    """True when this CPU (and the extension) can run the ``vdpbf16ps`` pair-dot GEMM."""
    return c is not None and bool(c.cpu_features().get("avx512bf16", False))


def linear_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pure-torch reference of ``gemm``: fp32 math, one rounding to ``out_dtype``.

    Args:
        x: [M, K] (or [..., K]) any float dtype.
        w: [N, K] any float dtype.
        b: [N] or None.
        out_dtype: result dtype; None means x's dtype.

    Returns:
        [M, N] (or [..., N]) ``F.linear(x.float(), w.float(), b.float())`` in ``out_dtype``.
    """
    y = F.linear(x.float(), w.float(), None if b is None else b.float())
    return y.to(out_dtype or x.dtype)


def _try_onednn(weight: torch.Tensor, bias: torch.Tensor | None):
    """The reordered weight, or None when oneDNN refuses it on this CPU / torch build."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        probe = torch.zeros((1, weight.shape[1]), dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
        return packed
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


class Linear:
    """``y = x @ W.T (+ b)`` with the weight prepared once for the chosen backend.

    Args:
        weight: [N, K] (out_features, in_features), bf16 or fp32 (any float on ``"torch"``),
            or a :class:`~tokenserve.ops.quant_blocks.QuantWeight` (GGUF blocks, or an
            :class:`~tokenserve.ops.quant_int8.Int8Weight`).
        bias: [N] or None.
        out_dtype: dtype of the result; None means x's dtype (the lm_head passes
            ``torch.float32`` for fp32 logits).
        fallback_dtype: dtype a quantised weight is dequantised to when the quantised
            kernel cannot run (no extension, not a CPU).

    Attributes:
        backend: ``"onednn"``, ``"tokenserve.gemm"``, ``"tokenserve.quant_gemm"``,
            ``"tokenserve.quant_amx"``, ``"tokenserve.quant_k_gemm"``,
            ``"tokenserve.int8_gemm"`` or ``"torch"`` (see the module doc).
        weight, bias, out_dtype: as given (``weight`` is None on ``tokenserve.quant_gemm``,
            the dequantised weight on ``"torch"`` for a quantised one).
        qweight: the packed :class:`~tokenserve.ops.quant_blocks.QuantWeight` on
            ``tokenserve.quant_gemm`` (x8), ``tokenserve.quant_amx`` (t16),
            ``tokenserve.quant_k_gemm`` (k8) or ``tokenserve.int8_gemm`` (x16), else None.
    """

    def __init__(self, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None,
                 fallback_dtype: torch.dtype = torch.bfloat16) -> None:
        self.qweight: QuantWeight | None = None
        force = forced_backend()
        self.isa: str | None = None
        kernels = Kernels()
        if isinstance(weight, QuantWeight):
            c = kernels.c
            op = ("int8_gemm" if weight.qtype == "int8" else
                  "quant_k_gemm" if weight.qtype in K_QTYPES else "quant_gemm")
            if kernels.op(op) is not None and force in ("", "c", "c-fma", "amx-bf16"):
                amx = (op == "quant_gemm" and weight.qtype in AMX_QTYPES and force == "amx-bf16"
                       and amx_available(c))
                # GGUF blocks -> t16 tiles (AMX) or x8 (k-quants: k8) groups; Int8Weight ->
                # x16 panels
                packed = repack_t16(weight) if amx else repack_x8(weight, c)
                self.qweight = dataclasses.replace(packed, data=weight_on_huge_pages(packed.data))
                if packed is not weight:  # the file's blocks, if mapped, leave the RSS
                    drop_file_pages(weight.data)
                self.bias, self.out_dtype = bias, out_dtype
                self.weight = None
                self.out_features, self.in_features = weight.shape
                self._c, self._packed = c, None
                self._bias_f32 = None if bias is None else bias.float().contiguous()
                self.backend = "tokenserve.quant_amx" if amx else f"tokenserve.{op}"
                self.isa = ("amx_bf16" if amx else quant_isa(c) if op == "quant_gemm"
                            else quant_k_isa(c) if op == "quant_k_gemm" else vector_isa(c))
                return
            weight = dequantize_ref(weight).to(fallback_dtype)
        if weight.dim() != 2:
            raise ValueError(f"Linear: weight must be [N, K], got {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"Linear: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
        self.weight, self.bias, self.out_dtype = weight, bias, out_dtype
        self.out_features, self.in_features = weight.shape
        self._packed = None
        self._bias_f32 = None
        self._c = None
        c = kernels.c if kernels.op("gemm") is not None else None
        self.backend = "torch"
        if (force == "onednn" and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                and out_dtype in (None, weight.dtype)):
            self._packed = _try_onednn(weight, bias)
            if self._packed is not None:
                self.backend = "onednn"
                return
        if (force != "torch" and c is not None and weight.device.type == "cpu"
                and weight.dtype in (torch.bfloat16, torch.float32)):
            self._c = c
            pairs = (weight.dtype == torch.bfloat16 and force != "c-fma"
                     and pair_dot_available(c))
            self._packed = weight_on_huge_pages(c.gemm_prepack(weight, pairs))
            if bias is not None:
                self._bias_f32 = bias.float().contiguous()
            self.backend = "tokenserve.gemm"
            self.isa = "avx512bf16" if pairs else vector_isa(c)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N] in ``out_dtype`` (None: x's dtype).

        Raises:
            RuntimeError: x's last dimension is not K (from the backend).
        """
        if self.qweight is not None:
            x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            if x2.dtype not in (torch.bfloat16, torch.float32):
                x2 = x2.float()
            q = self.qweight
            if q.qtype == "int8":
                y = self._c.int8_gemm(x2, q.data, q.scale, self.out_features, self._bias_f32,
                                      self.out_dtype or x.dtype)
            else:
                op = (self._c.quant_amx_gemm if q.layout == "t16" else
                      self._c.quant_k_gemm if q.qtype in K_QTYPES else self._c.quant_gemm)
                y = op(x2, q.data, QTYPE_IDS[q.qtype], self.out_features, self._bias_f32,
                       self.out_dtype or x.dtype)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        if self.backend == "tokenserve.gemm":
            x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            if x2.dtype not in (torch.bfloat16, torch.float32):
                x2 = x2.float()
            y = self._c.gemm(x2, self._packed, self.out_features, self._bias_f32,
                             self.out_dtype or x.dtype)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        y = F.linear(x, self.weight, self.bias)
        return y if self.out_dtype is None else y.to(self.out_dtype)

    @property
    def dtype_name(self) -> str:
        """The stored weight's kind for the log: ``bf16``, ``fp32``, ``q4_1``, ``int8``, ..."""
        if self.qweight is not None:
            return self.qweight.qtype
        return {torch.bfloat16: "bf16", torch.float32: "fp32",
                torch.float16: "fp16"}.get(self.weight.dtype, str(self.weight.dtype))

    def describe(self) -> str:
        """What this layer really runs on, e.g. ``tokenserve.gemm avx512bf16 (invariant)``
        or ``onednn (not batch-invariant)``."""
        name = self.backend if self.isa is None else f"{self.backend} {self.isa}"
        if self.backend == "torch" and self.weight.device.type != "cpu":
            return f"torch {self.weight.device.type}"
        ok = self.backend in INVARIANT_BACKENDS
        return f"{name} ({'invariant' if ok else 'not batch-invariant'})"

    def c_spec(self) -> tuple | None:
        """This projection for ``csrc/decoder.cpp``: ``(kind, weight, scale, qtype, N,
        bias)`` with kind 0 ``gemm`` (prepacked panels), 1 ``quant_gemm`` (x8 GGUF blocks),
        2 ``int8_gemm`` (int8 panels + fp32 scales), 3 ``quant_k_gemm`` (k8 k-quant
        super-blocks), 4 ``quant_amx_gemm`` (t16 GGUF blocks); bias fp32 [N] or None. None when the projection does not run on
        one of those kernels or has its own out dtype."""
        if self.out_dtype is not None:
            return None
        q = self.qweight
        if q is not None and self.backend == "tokenserve.int8_gemm":
            return (2, q.data, q.scale, 0, self.out_features, self._bias_f32)
        if q is not None and self.backend == "tokenserve.quant_gemm":
            return (1, q.data, None, QTYPE_IDS[q.qtype], self.out_features, self._bias_f32)
        if q is not None and self.backend == "tokenserve.quant_amx":
            return (4, q.data, None, QTYPE_IDS[q.qtype], self.out_features, self._bias_f32)
        if q is not None and self.backend == "tokenserve.quant_k_gemm":
            return (3, q.data, None, QTYPE_IDS[q.qtype], self.out_features, self._bias_f32)
        if q is None and self.backend == "tokenserve.gemm":
            return (0, self._packed, None, 0, self.out_features, self._bias_f32)
        return None

    @property
    def packed(self) -> torch.Tensor | None:
        """The weight tensor our C++ kernels read (the quantised blocks' ``data`` or the
        prepacked bf16 / fp32 panels), or None (torch and oneDNN backends)."""
        if self.qweight is not None:
            return self.qweight.data
        return self._packed if self.backend == "tokenserve.gemm" else None

    @packed.setter
    def packed(self, t: torch.Tensor) -> None:
        """Replace it with the same bytes elsewhere (:func:`colocate_on_huge_pages`)."""
        old = self.packed
        assert old is not None and t.shape == old.shape and t.dtype == old.dtype
        if self.qweight is not None:
            self.qweight = dataclasses.replace(self.qweight, data=t)
        else:
            self._packed = t

    @property
    def nbytes(self) -> int:
        """Bytes of weight (and bias) the backend reads: the packed or quantised copy."""
        if self.qweight is not None:
            w = self.qweight.nbytes
        elif self.backend == "tokenserve.gemm":
            w = self._packed.numel() * self._packed.element_size()
        else:
            w = self.weight.numel() * self.weight.element_size()
        return w + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __repr__(self) -> str:
        dtype = self.qweight.qtype if self.qweight is not None else self.weight.dtype
        return (f"Linear(N={self.out_features}, K={self.in_features}, "
                f"dtype={dtype}, backend={self.backend})")



class SplitLinear:
    """A fused row-block projection (q | k | v, gate | up) whose parts are stored in
    different formats, run part by part in their own formats and concatenated: a GGUF
    Q4_K_M layer keeps q and k in Q4_K and v in Q6_K, and widening the whole fused weight to
    bf16 would read ~3.5x its bytes per step. Each part is a :class:`Linear`, so the result
    is row-invariant like its parts.

    Args:
        parts: the :class:`Linear` of each run of rows, in output order (same K).

    Attributes:
        parts: as given;  out_features: the sum of the parts' N;  in_features: K.
    """

    def __init__(self, parts: list[Linear]) -> None:
        if len(parts) < 2 or len({p.in_features for p in parts}) != 1:
            raise ValueError("SplitLinear: two or more parts with the same in_features")
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N] (the parts' outputs concatenated along the last dim)."""
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def c_spec(self) -> tuple | None:
        """``(5, [part specs], None, 0, N, None)`` for ``csrc/proj_spec.h`` (kind 5: split),
        or None when a part has no C++ spec."""
        specs = [p.c_spec() for p in self.parts]
        if any(s is None for s in specs):
            return None
        return (5, specs, None, 0, self.out_features, None)

    def __repr__(self) -> str:
        return f"SplitLinear({', '.join(map(repr, self.parts))})"



def leaf_linears(lins) -> list[Linear]:
    """Each :class:`Linear`, a :class:`SplitLinear` replaced by its parts (for byte counts
    and the start-up log)."""
    return [p for lin in lins for p in (lin.parts if isinstance(lin, SplitLinear) else [lin])]


def colocate_on_huge_pages(linears) -> int:
    """Move the small packed weights of these projections (each under
    :data:`~tokenserve.ops.host_memory.HUGE_WEIGHT_MIN_BYTES`, so not on huge pages of their
    own: a layer's qkv and o, a mixture-of-experts layer's experts) side by side, in the
    order given, into one region on huge pages: a one-row step streams them from memory, and
    on 4 KiB pages the hardware prefetchers stop at every page boundary. Measured on Zen 4 (2
    threads): a Qwen3-30B-A3B-shaped Q4_K MoE layer (128 experts of 0.9-1.8 MB) at one token
    0.86-0.91 -> 0.81-0.82 ms, at 16 tokens 9.1-9.4 -> 8.3-8.6 ms (bench/README.md "Small
    weights on huge pages"). Each copy replaces its original before the next is made, and the heap is trimmed
    as they go (a MoE layer's 0.9 MB experts are freed into glibc's heap, under the load's
    mmap threshold). Same bytes, so the same results.

    Args:
        linears: :class:`Linear` / :class:`SplitLinear` (parts taken in order).

    Returns:
        Bytes moved (0 when there was under one huge page's worth).
    """
    small = [lin for lin in leaf_linears(linears)
             if (t := lin.packed) is not None and t.device.type == "cpu" and t.is_contiguous()
             and t.numel() * t.element_size() < HUGE_WEIGHT_MIN_BYTES]
    total = sum(lin.packed.numel() * lin.packed.element_size() for lin in small)
    if total < HUGE_PAGE:
        return 0
    views = on_one_huge_region([(tuple(lin.packed.shape), lin.packed.dtype) for lin in small])
    for i, (lin, v) in enumerate(zip(small, views)):
        v.copy_(lin.packed)
        lin.packed = v
        if i % 32 == 31:  # originals under the mmap threshold freed into glibc's heap
            trim_heap()
    trim_heap()
    return total


def fused_linear(parts: list[torch.Tensor | QuantWeight], bias: torch.Tensor | None,
                 dtype: torch.dtype) -> Linear | SplitLinear:
    """One projection over row blocks (q | k | v, gate | up): a single :class:`Linear` over
    the concatenated rows when they share a format (GGUF blocks of one type stay blocks,
    ``QuantWeight.cat``), else a :class:`SplitLinear` with one :class:`Linear` per run of
    consecutive same-format parts (nothing widened).

    Args:
        parts: [N_i, K] weights, float or :class:`QuantWeight`, in output order.
        bias: [sum N_i] or None.
        dtype: the model dtype (fallback for quantised weights the kernels cannot run).
    """
    def fmt(p):
        return (p.qtype, p.shape[1]) if isinstance(p, QuantWeight) else ("float", p.dtype)

    runs: list[list] = []
    for p in parts:
        if runs and fmt(runs[-1][-1]) == fmt(p):
            runs[-1].append(p)
        else:
            runs.append([p])

    def cat(run):
        if len(run) == 1:
            return run[0]
        if isinstance(run[0], QuantWeight):
            fused = QuantWeight.cat(run)
            for p in run:  # copied: the file's blocks, if mapped, leave the RSS
                drop_file_pages(p.data)
            return fused
        return torch.cat(run)

    if len(runs) == 1 or not any(isinstance(p, QuantWeight) for p in parts):
        w = cat(parts) if len(runs) == 1 else torch.cat([p.to(dtype) for p in parts])
        return Linear(w, bias, fallback_dtype=dtype)
    lins, n0 = [], 0
    for run in runs:
        w = cat(run)
        n = w.shape[0]
        lins.append(Linear(w, None if bias is None else bias[n0:n0 + n], fallback_dtype=dtype))
        n0 += n
    return SplitLinear(lins)


def describe_gemms(linears) -> str:
    """One line for the start-up log naming what each kind of layer runs on, e.g. ``bf16 →
    tokenserve.gemm avx512bf16 (invariant)`` or ``q4_1 → tokenserve.quant_gemm avx2
    (invariant); q8_0 → ...``; the lm_head is named apart when it differs from the layers
    of its kind.

    Args:
        linears: the model's :class:`Linear` layers, lm_head first.
    """
    linears = list(linears)
    kinds: dict[str, str] = {}
    for lin in linears[1:]:
        kinds.setdefault(lin.dtype_name, lin.describe())
    parts = [f"{k} → {v}" for k, v in kinds.items()]
    head = linears[0]
    if kinds.get(head.dtype_name) != head.describe():
        parts.append(f"lm_head {head.dtype_name} → {head.describe()}")
    return "; ".join(parts)
