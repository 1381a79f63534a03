"""csrc/quant_k_amx.cpp: ``quant_k_gemm`` (Q4_K / Q5_K / Q6_K) on Intel AMX-INT8 tiles, with
the VNNI int8 tiles' bits.

``quant_k_gemm`` runs a GEMM of 16+ rows on the AMX-INT8 tiles where the CPU and OS allow
(``_quant_k_amx_rows`` moves that bound, a test hook; ``_quant_k_amx_calls`` counts the
calls that took them). Checked here, bit for bit:

* the AMX-INT8 tiles give the VNNI tiles' output for every k-quant type, N tail (one 8-row
  group in the last 16-row tile, rows past N), M tail (slices of fewer than 16 rows), one
  slice and more (Q4_K / Q5_K: one product per sub-block on one slice, the scales folded
  into B from two; Q6_K: folded always, with its extreme products), K of
  one to 32 super-blocks, bias and in / out dtype, also with activation outliers (the
  int8 quantiser's -127 and 127 against Q6_K's -32 and Q5_K's 31), and across the loop's
  slice chunks and thread splits;
* both equal ``quant_k_linear_ref``, the pure-torch emulation of the super-block formula,
  on one slice and on two;
* with the default bound, a row's bits are the same alone (one-row tiles), in a small
  batch (VNNI tiles) and in any batch of 16+ (AMX), in reverse order and at 1 and 2
  threads;
* the call releases the GIL.

Skipped, with the reason, on a CPU or OS without AMX-INT8 tiles (the VNNI and AVX2 tiles
are tested on every CPU in test_kernel_quant_k.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.kernel_checks import activations, assert_releases_gil, assert_rows_invariant
from tests.unit.test_kernel_quant_k import _weight
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.linear import amx_int8_available
from tokenserve.ops.quant import quant_k_linear_ref
from tokenserve.ops.quant_blocks import QTYPE_IDS, repack_k8

C = load_kernels()
pytestmark = pytest.mark.skipif(
    not amx_int8_available(C),
    reason="no AMX-INT8 tiles on this CPU/OS (or tokenserve._C not built)")
QTYPES = ["q4_k", "q5_k", "q6_k"]
NEVER = 1 << 40


def _x(M: int, K: int, dtype=torch.bfloat16) -> torch.Tensor:
    x = activations(M, K)
    x[:, 3] *= 50.0  # an outlier channel: its block's other values quantise small
    if M > 2:
        x[2, 7] = -x[2, :256].abs().max() * 2  # the super-block's extreme is negative: q = -127
    return x.to(dtype)


def _gemm(x, w, qtype, N, bias=None, out_dtype=torch.float32, amx_rows=None):
    old = C._quant_k_amx_rows(amx_rows) if amx_rows is not None else None
    try:
        return C.quant_k_gemm(x, w, QTYPE_IDS[qtype], N, bias, out_dtype)
    finally:
        if old is not None:
            C._quant_k_amx_rows(old)


def _on_amx(call):
    """call()'s result, asserting it ran on the AMX-INT8 tiles."""
    before = C._quant_k_amx_calls()
    out = call()
    assert C._quant_k_amx_calls() == before + 1
    return out


def test_default_bound():
    old = C._quant_k_amx_rows(16)
    assert C._quant_k_amx_rows(old) == 16 == old  # csrc/quant_k_amx.h kAmxKMinRows


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("N,K", [(8, 256), (24, 512), (40, 768), (72, 2048), (16, 8192)])
def test_same_bits_as_the_vnni_tiles(qtype, N, K):
    w = repack_k8(_weight(N, K, qtype)).data
    bias = torch.randn(N)
    for M, dtype, out_dtype, b in itertools.product(
            [1, 15, 16, 17, 33], [torch.bfloat16, torch.float32],
            [torch.bfloat16, torch.float32], [None, bias]):
        x = _x(M, K, dtype)
        before = C._quant_k_amx_calls()
        vnni = _gemm(x, w, qtype, N, b, out_dtype, amx_rows=NEVER)
        assert C._quant_k_amx_calls() == before
        amx = _on_amx(lambda: _gemm(x, w, qtype, N, b, out_dtype, amx_rows=1))  # noqa: B023
        assert torch.equal(amx, vnni), (M, dtype, out_dtype, b is not None)


@pytest.mark.parametrize("qtype", QTYPES)
def test_same_bits_across_slice_chunks_and_threads(qtype):
    """Work units of up to 8 slices of 16 rows x one weight tile: M across slice chunks
    and tails (130 rows: 8 + 1 slices, the last 2 rows), N = 41 tiles (the last half a
    tile), each thread count (the split falls between units of both chunks); K of 2 and of
    8 super-blocks (each super-block's B built into a ring of three while the one before
    serves the unit's slices)."""
    N = 16 * 40 + 8
    old_threads = torch.get_num_threads()
    try:
        for K in (512, 2048):
            w = repack_k8(_weight(N, K, qtype)).data
            for threads, M in itertools.product([1, 2], [16, 64, 65, 130]):
                torch.set_num_threads(threads)
                x = _x(M, K)
                vnni = _gemm(x, w, qtype, N, amx_rows=NEVER)
                assert torch.equal(_on_amx(lambda: _gemm(x, w, qtype, N)), vnni), (K, threads, M)  # noqa: B023
    finally:
        torch.set_num_threads(old_threads)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("M", [16, 20])
def test_equals_the_reference(qtype, M):
    """One 16-row slice and two (Q4_K / Q5_K: one product per sub-block, then the scales
    in B; Q6_K: scales in B on both)."""
    qw = _weight(40, 768, qtype)
    x = _x(M, 768, torch.float32)
    b = torch.randn(40)
    got = _on_amx(lambda: _gemm(x, repack_k8(qw).data, qtype, 40, b))
    assert torch.equal(got, quant_k_linear_ref(x, qw, b, torch.float32))


@pytest.mark.parametrize("M", [16, 40])
def test_q6k_fold_extremes(M):
    """Q6_K folds (q - 32) * scale into B as a signed high and an unsigned low byte: the
    extreme products, -32 * -128 = 4096 and 31 * 127, and every sign mix, equal the reference."""
    qw = _weight(48, 512, "q6_k")
    data = qw.data.view(48, 2, 210)
    data[0:16, :, 0:192] = 0  # q = 0: q - 32 = -32
    data[0:16, :, 192:208] = 0x80  # scales -128
    data[16:32, :, 0:192] = 0xFF  # q = 63: 31
    data[16:32, :, 192:208] = 127
    data[32:48, :, 192:208] = torch.tensor([0x80, 127, 0, 1] * 4, dtype=torch.uint8)
    x = _x(M, 512, torch.float32)
    got = _on_amx(lambda: _gemm(x, repack_k8(qw).data, "q6_k", 48))
    assert torch.equal(got, quant_k_linear_ref(x, qw, None, torch.float32))
    assert got[:, :32].abs().max() > 0


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_invariant_across_all_tiles(qtype):
    """Alone a row runs on the one-row tiles, in 2-15 rows on the VNNI tiles, in 16+ on
    the AMX-INT8 tiles."""
    qw = _weight(72, 512, qtype)
    w = repack_k8(qw).data
    x = _x(70, 512)
    assert_rows_invariant(lambda xs: _gemm(xs, w, qtype, 72), x, [2, 15, 16, 17, 31, 32, 33, 64, 70])


def test_rejects_nothing_new():
    """The AMX path is chosen after quant_k_gemm's own checks: bad shapes still raise."""
    w = repack_k8(_weight(16, 512, "q4_k")).data
    with pytest.raises(RuntimeError, match="multiple of 256"):
        _gemm(activations(32, 384, torch.bfloat16), w, "q4_k", 16, amx_rows=1)


def test_releases_gil():
    w = repack_k8(_weight(4096, 2048, "q4_k")).data
    x = activations(2048, 2048, torch.bfloat16)
    assert_releases_gil(lambda: _gemm(x, w, "q4_k", 4096))
