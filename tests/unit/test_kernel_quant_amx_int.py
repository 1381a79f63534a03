"""csrc/quant_amx_int.cpp: ``quant_gemm`` on Intel AMX-INT8 tiles, with the VNNI tiles' bits.

``quant_gemm`` runs a GEMM of 16+ rows on the AMX-INT8 tiles where the CPU and OS allow
(``_quant_amx_rows`` moves that bound, a test hook). Checked here, bit for bit:

* the AMX-INT8 tiles give the VNNI tiles' output for every format, N tail (one 8-row
  group in the last tile, rows past N), M tail, K, bias and in/out dtype, also with
  activation outliers (the int12 quantiser's extremes, -2047 and 2047), and across the
  loop's slice chunks and thread splits;
* both equal ``quant_linear_ref``, the pure-torch emulation of the block formula;
* with the default bound, a row's bits are the same alone (VNNI) and in any batch (AMX
  from 16 rows), in reverse order and at 1 and 2 threads;
* the call releases the GIL.

Skipped, with the reason, on a CPU or OS without AMX-INT8 tiles.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.kernel_checks import (
    activations,
    assert_releases_gil,
    assert_rows_invariant,
    quant_weight,
)
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.linear import amx_int8_available
from tokenserve.ops.quant import quant_linear_ref, repack_x8
from tokenserve.ops.quant_blocks import QTYPE_IDS

C = load_kernels()
needs_amx_int = pytest.mark.skipif(
    not amx_int8_available(C),
    reason="no AMX-INT8 tiles on this CPU/OS (or tokenserve._C not built)")
pytestmark = needs_amx_int
QTYPES = ["q4_0", "q4_1", "q8_0"]
NEVER = 1 << 40


def _x(M: int, K: int, dtype=torch.bfloat16) -> torch.Tensor:
    x = activations(M, K)
    x[:, 3] *= 50.0  # an outlier channel: its block's other values quantise small
    if M > 2:
        x[1, :32] = 0.0  # an all-zero block: scale 0
        x[2, 7] = -x[2, :32].abs().max() * 2  # the block's extreme is negative: q = -2047
    return x.to(dtype)


def _gemm(x, w, qtype, N, bias=None, out_dtype=torch.float32, amx_rows=None):
    old = C._quant_amx_rows(amx_rows) if amx_rows is not None else None
    try:
        return C.quant_gemm(x, w, QTYPE_IDS[qtype], N, bias, out_dtype)
    finally:
        if old is not None:
            C._quant_amx_rows(old)


def test_default_bound():
    old = C._quant_amx_rows(16)
    assert C._quant_amx_rows(old) == 16 == old  # csrc/quant_amx_int.h kAmxIntMinRows


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("N,K", [(8, 32), (24, 96), (40, 64), (72, 576), (48, 1536)])
def test_same_bits_as_the_vnni_tiles(qtype, N, K):
    w = repack_x8(quant_weight(N, K, qtype)).data
    bias = torch.randn(N)
    for M, dtype, out_dtype, b in itertools.product(
            [1, 15, 16, 17, 33, 64], [torch.bfloat16, torch.float32],
            [torch.bfloat16, torch.float32], [None, bias]):
        x = _x(M, K, dtype)
        vnni = _gemm(x, w, qtype, N, b, out_dtype, amx_rows=NEVER)
        amx = _gemm(x, w, qtype, N, b, out_dtype, amx_rows=1)
        assert torch.equal(amx, vnni), (M, dtype, out_dtype, b is not None)


@pytest.mark.parametrize("qtype", QTYPES)
def test_same_bits_across_slice_chunks_and_threads(qtype):
    """Work units of up to 8 slices of 16 rows x one weight tile: M across slice chunks
    and tails (130 rows: 8 + 1 slices, the last 2 rows), N = 129 tiles (the last half a
    tile), each thread count (the split falls between units of both chunks)."""
    N, K = 16 * 128 + 8, 7 * 32
    w = repack_x8(quant_weight(N, K, qtype)).data
    old_threads = torch.get_num_threads()
    try:
        for threads, M in itertools.product([1, 2], [16, 64, 65, 130]):
            torch.set_num_threads(threads)
            x = _x(M, K)
            vnni = _gemm(x, w, qtype, N, amx_rows=NEVER)
            assert torch.equal(_gemm(x, w, qtype, N, amx_rows=1), vnni), (threads, M)
    finally:
        torch.set_num_threads(old_threads)


@pytest.mark.parametrize("qtype", QTYPES)
def test_equals_the_reference(qtype):
    qw = quant_weight(40, 96, qtype)
    x = _x(20, 96, torch.float32)
    b = torch.randn(40)
    got = _gemm(x, repack_x8(qw).data, qtype, 40, b, amx_rows=1)
    assert torch.equal(got, quant_linear_ref(x, qw, b, torch.float32))


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_invariant_across_both_tiles(qtype):
    """Alone a row runs on the VNNI tiles, in a batch of 16+ on the AMX-INT8 tiles."""
    qw = quant_weight(72, 96, qtype)
    w = repack_x8(qw).data
    x = _x(70, 96)
    assert_rows_invariant(lambda xs: _gemm(xs, w, qtype, 72), x, [2, 15, 16, 17, 31, 32, 33, 64, 70])


def test_rejects_nothing_new():
    """The AMX path is chosen after quant_gemm's own checks: bad shapes still raise."""
    qw = quant_weight(16, 64, "q4_1")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        _gemm(activations(32, 48, torch.bfloat16), repack_x8(qw).data, "q4_1", 16, amx_rows=1)


def test_releases_gil():
    w = repack_x8(quant_weight(4096, 1536, "q4_1")).data
    x = activations(4096, 1536, torch.bfloat16)  # ~62 ms on 2 Sapphire Rapids cores
    assert_releases_gil(lambda: _gemm(x, w, "q4_1", 4096))
