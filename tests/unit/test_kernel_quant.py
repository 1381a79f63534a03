"""csrc/quant.cpp (``quant_gemm``, ``quant_dequant_rows``) on GGUF Q4_0 / Q4_1 / Q8_0 blocks,
against the pure-torch references of tokenserve/ops/quant.py, with ``gguf.quants`` (llama.cpp's
own reference code) as a second oracle for the block formats.

* ``dequantize_ref`` equals ``gguf.quants.dequantize`` bit for bit; ``repack_x8`` (the
  kernel's 8-row interleave) round-trips;
* ``quant_gemm`` equals ``quant_linear_ref`` (the bit-level emulation: int16 activations,
  exact integer block dots, one fp32 fma per block) to a rounding of the emulated fma, and is
  within the activation rounding (half an int16 step of each block's max) of the fp32
  product with the dequantised weight;
* the AVX2 path and the portable path give the same bits;
* a row's result is the same bits alone, in any batch, at any thread count.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernel_checks import (
    act_rounding_bound,
    activations,
    assert_releases_gil,
    assert_rows_invariant,
    inner_loop_params,
)
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.linear import Linear
from tokenserve.ops.quant import (
    dequantize_ref,
    dequantize_rows_ref,
    quant_linear_fp32_ref,
    quant_linear_ref,
    quantize_act_ref,
    quantize_ref,
    repack_x8,
)
from tokenserve.ops.quant_blocks import BLOCK_BYTES, QTYPE_IDS, QuantWeight, unpack_x8

C = load_kernels()
needs_c = pytest.mark.skipif(C is None or not hasattr(C, "quant_gemm"),
                             reason="tokenserve._C (quant_gemm) not built")
QTYPES = ["q4_0", "q4_1", "q8_0"]


def _weight(N: int, K: int, qtype: str, seed: int = 0) -> tuple[torch.Tensor, QuantWeight]:
    g = torch.Generator().manual_seed(seed * 7919 + N * 31 + K)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    w[:, :32] += 0.3  # a block with an offset (Q4_1's m matters)
    return w, quantize_ref(w, qtype)


_x = activations  # an all-zero block (d = 0) in the middle row


def _gemm(x, qw: QuantWeight, bias=None, out_dtype=torch.float32):
    p = repack_x8(qw)
    return C.quant_gemm(x, p.data, QTYPE_IDS[qw.qtype], qw.shape[0], bias, out_dtype)


# ------------------------------------------------------------------ references vs gguf


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("N,K", [(1, 32), (3, 96), (17, 576), (5, 1536)])
def test_dequantize_ref_equals_gguf(qtype, N, K):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    _, qw = _weight(N, K, qtype)
    assert tuple(qw.data.shape) == (N, K // 32 * BLOCK_BYTES[qtype])
    theirs = dequantize(qw.data.numpy(), GGMLQuantizationType[qtype.upper()])
    assert torch.equal(dequantize_ref(qw), torch.from_numpy(np.ascontiguousarray(theirs)).reshape(N, K))
    packed = repack_x8(qw)
    assert packed.layout == "x8" and tuple(packed.data.shape)[:2] == ((N + 7) // 8, K // 32)
    assert torch.equal(unpack_x8(packed).data, qw.data)
    assert torch.equal(dequantize_ref(packed), dequantize_ref(qw))


def test_quantize_act_ref_bounds():
    x = _x(5, 96)
    q, d, s = quantize_act_ref(x)
    back = (q.float().reshape(5, 3, 32) * d.unsqueeze(-1)).reshape(5, 96)
    assert ((back - x).abs() <= (d.repeat_interleave(32, 1) / 2) * 1.001 + 1e-6).all()
    assert q.dtype == torch.int16 and q.abs().max() <= 2047
    assert torch.allclose(s, d * q.reshape(5, 3, 32).float().sum(-1))


def test_k_not_a_multiple_of_the_block_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantWeight(torch.zeros(2, 18, dtype=torch.uint8), "q4_0", (2, 31))
    if C is not None and hasattr(C, "quant_gemm"):
        with pytest.raises(RuntimeError, match="multiple of 32"):
            C.quant_gemm(torch.zeros(1, 33), torch.zeros(1, 1, 144, dtype=torch.uint8), 0, 2)
        with pytest.raises(RuntimeError, match="repack_x8"):  # GGUF rows, not x8
            C.quant_gemm(torch.zeros(1, 32), torch.zeros(2, 18, dtype=torch.uint8), 0, 2)


# ------------------------------------------------------------------ kernel vs references


@needs_c
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("M", [0, 1, 3, 17, 64])
@pytest.mark.parametrize("N,K", [(1, 32), (3, 96), (17, 576), (960, 576), (19, 1536)])
def test_quant_gemm_vs_reference(qtype, M, N, K):
    _, qw = _weight(N, K, qtype)
    x = _x(M, K)
    bias = torch.randn(N) if N % 2 else None
    y = _gemm(x, qw, bias)
    assert y.shape == (M, N) and y.dtype == torch.float32
    if M == 0:
        return
    emu = quant_linear_ref(x, qw, bias, torch.float32)
    # the emulation rounds its fma in fp64 then fp32: equal up to a rare double rounding
    torch.testing.assert_close(y, emu, rtol=1e-6, atol=1e-6)
    exact = quant_linear_fp32_ref(x, qw, bias, torch.float32)
    # within the int12 activation rounding's bound
    bound = act_rounding_bound(x, dequantize_ref(qw), 2047) + 1e-5
    assert ((y - exact).abs() <= bound).all()


@needs_c
@pytest.mark.parametrize("qtype", QTYPES)
def test_quant_gemm_bf16_in_and_out(qtype):
    _, qw = _weight(33, 192, qtype)
    x = _x(5, 192, torch.bfloat16)
    y = _gemm(x, qw, None, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, _gemm(x.float(), qw, None, torch.float32).to(torch.bfloat16))


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", QTYPES)
def test_portable_path_same_bits(qtype, dtype):
    """AVX2 and portable code give the same bits, for fp32 and bf16 activations (read
    directly, widened exactly)."""
    _, qw = _weight(37, 320, qtype)
    x = _x(9, 320, dtype)
    fast = _gemm(x, qw)
    old = C._quant_force_portable(True)
    try:
        slow = _gemm(x, qw)
    finally:
        C._quant_force_portable(old)
    assert torch.equal(fast, slow)
    if dtype == torch.bfloat16:  # the same rows given as fp32
        assert torch.equal(slow, _gemm(x.float(), qw).to(slow.dtype))


@pytest.fixture
def isa(request):
    """quant_gemm held on one inner loop for the test (the hooks restore the old state)."""
    old_p = C._quant_force_portable(request.param == "portable")
    old_a = C._quant_force_avx2(request.param == "avx2")
    yield request.param
    C._quant_force_portable(old_p)
    C._quant_force_avx2(old_a)


@needs_c
@pytest.mark.parametrize("isa", inner_loop_params(C), indirect=True)
@pytest.mark.parametrize("qtype", QTYPES)
def test_row_invariance_batch_and_threads(qtype, isa):
    """Bit for bit, on each inner loop this CPU has: a row alone == the same row at every
    position of batches of 1..65 rows, and with 1 or 2 threads."""
    _, qw = _weight(131, 576, qtype)
    assert_rows_invariant(lambda x: _gemm(x, qw), _x(65, 576), (2, 3, 5, 17, 65))


@needs_c
@pytest.mark.parametrize("qtype", QTYPES)
def test_thread_ranges_and_stealing_same_bits(qtype):
    """Each thread walks its own contiguous range of work units and then takes units from
    the others' ranges (csrc/quant_act.h run_units): with 3 and 5 threads on this machine's
    cores (oversubscribed, so some threads finish their range early and steal), every
    batch size gives the one-thread bits."""
    _, qw = _weight(1000, 576, qtype)
    threads = torch.get_num_threads()
    try:
        for M in (1, 2, 9, 64):
            x = _x(M, 576, torch.bfloat16)
            torch.set_num_threads(1)
            ref = _gemm(x, qw)
            for n in (3, 5):
                torch.set_num_threads(n)
                for _ in range(3):
                    assert torch.equal(_gemm(x, qw), ref), (M, n)
    finally:
        torch.set_num_threads(threads)


@needs_c
@pytest.mark.skipif(C is None or not C.cpu_features().get("avx512vnni", False),
                    reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("N,K", [(8, 32), (24, 64), (131, 576), (1536, 576), (576, 1536)])
def test_avx512_tiles_same_bits_as_avx2(qtype, N, K):
    """The AVX-512 VNNI tiles (two 8-row groups per zmm, 1..8 rows, an odd last group on the
    AVX2 tile) give the AVX2 tiles' bits for every batch size, bias or none, bf16 or fp32 out."""
    _, qw = _weight(N, K, qtype)
    bias = torch.randn(N) if N % 2 else None
    for M in (1, 2, 3, 7, 8, 9, 16, 17, 64):
        x = _x(M, K, torch.bfloat16)
        for od in (torch.float32, torch.bfloat16):
            fast = _gemm(x, qw, bias, od)
            old = C._quant_force_avx2(True)
            try:
                ref = _gemm(x, qw, bias, od)
            finally:
                C._quant_force_avx2(old)
            assert torch.equal(fast, ref), (M, od)


@needs_c
def test_vocab_49152_lm_head_q8_0_fp32_logits():
    _, qw = _weight(49152, 576, "q8_0")
    x = _x(3, 576, torch.bfloat16)
    y = _gemm(x, qw, None, torch.float32)
    assert y.shape == (3, 49152) and y.dtype == torch.float32
    torch.testing.assert_close(y, quant_linear_ref(x, qw, None, torch.float32),
                               rtol=1e-6, atol=1e-6)


@needs_c
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequant_rows_equals_reference(qtype, out_dtype):
    _, qw = _weight(300, 96, qtype)
    ids = torch.tensor([0, 299, 7, 7, 150])
    p = repack_x8(qw)
    got = C.quant_dequant_rows(ids, p.data, QTYPE_IDS[qtype], 300, 96, out_dtype)
    assert torch.equal(got, dequantize_rows_ref(ids, qw, out_dtype))
    with pytest.raises(RuntimeError, match="out of range"):
        C.quant_dequant_rows(torch.tensor([300]), p.data, QTYPE_IDS[qtype], 300, 96, out_dtype)


# ------------------------------------------------------------------ Linear


@pytest.mark.parametrize("qtype", QTYPES)
def test_linear_picks_quant_backend_or_dequantises(qtype, monkeypatch):
    _, qw = _weight(17, 64, qtype)
    x = _x(3, 64, torch.bfloat16)
    lin = Linear(qw, out_dtype=torch.float32)
    if C is not None and hasattr(C, "quant_gemm"):
        assert lin.backend == "tokenserve.quant_gemm" and lin.qweight.layout == "x8"
        assert lin.nbytes == lin.qweight.nbytes <= qw.nbytes * 24 // 17  # N padded to 8
        assert torch.equal(lin(x), _gemm(x, qw, None, torch.float32))
    monkeypatch.setenv("TOKENSERVE_DISABLE_C", "1")
    ref = Linear(qw, out_dtype=torch.float32, fallback_dtype=torch.float32)
    assert ref.backend == "torch"
    torch.testing.assert_close(ref(x.float()), quant_linear_fp32_ref(x.float(), qw, None,
                                                                     torch.float32))


@needs_c
def test_quant_gemm_releases_the_gil():
    """The server's event loop runs while the model thread is in a quantised GEMM."""
    _, qw = _weight(2048, 1024, "q4_0")
    p = repack_x8(qw)
    x = _x(4096, 1024, torch.bfloat16)  # >= 20 ms on the AVX-512 VNNI tiles too
    assert_releases_gil(lambda: C.quant_gemm(x, p.data, QTYPE_IDS["q4_0"], 2048))
