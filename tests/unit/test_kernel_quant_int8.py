"""csrc/int8_gemm.cpp (``int8_gemm``, ``--quantization int8``) against the pure-torch references
of tokenserve/ops/quant_int8.py.

* ``quantize_int8`` is within half a step of every weight; ``pack_int8`` round-trips;
* ``int8_gemm`` equals ``int8_linear_ref`` (the sequential fp32 FMA chain, emulated) to a
  rounding of the emulated fma, and the fp32 product with the dequantised weight closely;
* the AVX2 path and the portable path give the same bits;
* a row's result is the same bits alone, in any batch, at any thread count;
* ``Linear`` picks the kernel, and the tied-table lookup reads the table as loaded.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_checks import activations, assert_rows_invariant
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.linear import Linear
from tokenserve.ops.quant import dequantize_ref, dequantize_rows_ref, repack_x8
from tokenserve.ops.quant_blocks import QuantWeight
from tokenserve.ops.quant_int8 import (
    Int8Weight,
    int8_linear_fp32_ref,
    int8_linear_ref,
    pack_int8,
    quantize_int8,
    unpack_int8,
)

C = load_kernels()
needs_c = pytest.mark.skipif(C is None or not hasattr(C, "int8_gemm"),
                             reason="tokenserve._C (int8_gemm) not built")


def _weight(N: int, K: int, seed: int = 0) -> tuple[torch.Tensor, Int8Weight]:
    g = torch.Generator().manual_seed(seed * 7919 + N * 31 + K)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    if N > 2:
        w[1] = 0.0  # an all-zero row (scale 0)
    return w, quantize_int8(w)


def _x(M: int, K: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    return activations(M, K, dtype, seed, zero_block=False)


def _gemm(x, qw: Int8Weight, bias=None, out_dtype=torch.float32):
    p = pack_int8(qw)
    return C.int8_gemm(x, p.data, p.scale, qw.shape[0], bias, out_dtype)


# ------------------------------------------------------------------ references


@pytest.mark.parametrize("N,K", [(1, 1), (3, 7), (17, 576), (33, 100)])
def test_quantize_and_pack_round_trip(N, K):
    w, qw = _weight(N, K)
    assert qw.data.dtype == torch.int8 and qw.scale.shape == (N,)
    assert int(qw.data.abs().max()) <= 127
    err = (dequantize_ref(qw) - w).abs()
    assert (err <= qw.scale.unsqueeze(1) / 2 * 1.0001 + 1e-12).all()
    p = pack_int8(qw)
    assert p.layout == "x16" and tuple(p.data.shape) == ((N + 15) // 16, K, 16)
    assert repack_x8(qw).layout == "x16"  # the model's generic packing call
    assert torch.equal(unpack_int8(p).data, qw.data)
    assert torch.equal(dequantize_ref(p), dequantize_ref(qw))
    assert isinstance(qw, QuantWeight) and p.nbytes == p.data.numel() + p.scale.numel() * 4


def test_fused_rows_and_bad_shapes():
    _, a = _weight(3, 64)
    _, b = _weight(5, 64, seed=1)
    ab = QuantWeight.cat([a, b])  # what LlamaForCausalLM.from_state_dict calls
    assert isinstance(ab, Int8Weight) and ab.shape == (8, 64)
    assert torch.equal(dequantize_ref(ab), torch.cat([dequantize_ref(a), dequantize_ref(b)]))
    with pytest.raises(ValueError):
        QuantWeight.cat([a, quantize_int8(torch.ones(2, 32))])
    with pytest.raises(ValueError, match="scale fp32"):
        Int8Weight(torch.zeros(2, 4, dtype=torch.int8), "int8", (2, 4), scale=torch.zeros(3))


# ------------------------------------------------------------------ kernel vs references


@needs_c
@pytest.mark.parametrize("M", [0, 1, 3, 17, 64])
@pytest.mark.parametrize("N,K", [(1, 32), (3, 7), (17, 576), (960, 576), (19, 1536)])
def test_int8_gemm_vs_reference(M, N, K):
    _, qw = _weight(N, K)
    x = _x(M, K)
    bias = torch.randn(N) if N % 2 else None
    y = _gemm(x, qw, bias)
    assert y.shape == (M, N) and y.dtype == torch.float32
    if M == 0:
        return
    torch.testing.assert_close(y, int8_linear_ref(x, qw, bias, torch.float32),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, int8_linear_fp32_ref(x, qw, bias, torch.float32),
                               rtol=1e-4, atol=1e-4)


@needs_c
def test_vocab_49152_lm_head_fp32_logits_from_bf16():
    _, qw = _weight(49152, 576)
    x = _x(3, 576, torch.bfloat16)
    y = _gemm(x, qw, None, torch.float32)
    assert y.shape == (3, 49152) and y.dtype == torch.float32
    torch.testing.assert_close(y, int8_linear_ref(x, qw, None, torch.float32),
                               rtol=1e-6, atol=1e-6)


@needs_c
def test_bf16_out_is_the_fp32_result_rounded():
    _, qw = _weight(33, 192)
    x = _x(5, 192, torch.bfloat16)
    y = _gemm(x, qw, None, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, _gemm(x.float(), qw, None, torch.float32).to(torch.bfloat16))


@needs_c
def test_portable_path_same_bits():
    _, qw = _weight(37, 320)
    x = _x(9, 320)
    bias = torch.randn(37)
    fast = _gemm(x, qw, bias)
    old = C._int8_force_portable(True)
    try:
        slow = _gemm(x, qw, bias)
    finally:
        C._int8_force_portable(old)
    assert torch.equal(fast, slow)


@needs_c
def test_row_invariance_batch_and_threads():
    """Bit for bit: a row alone == the same row at every position of batches of 1..65 rows,
    and with 1 or 2 threads."""
    _, qw = _weight(131, 576)
    assert_rows_invariant(lambda x: _gemm(x, qw), _x(65, 576), (2, 3, 5, 17, 65))


def test_bad_arguments():
    if C is None or not hasattr(C, "int8_gemm"):
        pytest.skip("tokenserve._C (int8_gemm) not built")
    p = pack_int8(quantize_int8(torch.randn(5, 32)))
    with pytest.raises(RuntimeError, match="pack_int8"):
        C.int8_gemm(torch.zeros(1, 32), p.data.float(), p.scale, 5)
    with pytest.raises(RuntimeError, match="scale"):
        C.int8_gemm(torch.zeros(1, 32), p.data, p.scale[:5], 5)
    with pytest.raises(RuntimeError, match="pack_int8"):
        C.int8_gemm(torch.zeros(1, 31), p.data, p.scale, 5)


# ------------------------------------------------------------------ Linear, tied table


def test_linear_picks_int8_backend_or_dequantises(monkeypatch):
    _, qw = _weight(17, 64)
    x = _x(3, 64, torch.bfloat16)
    lin = Linear(qw, out_dtype=torch.float32)
    if C is not None and hasattr(C, "int8_gemm"):
        assert lin.backend == "tokenserve.int8_gemm" and lin.qweight.layout == "x16"
        assert torch.equal(lin(x), _gemm(x, qw, None, torch.float32))
        assert lin(x.view(1, 3, 64)).shape == (1, 3, 17)
    monkeypatch.setenv("TOKENSERVE_DISABLE_C", "1")
    ref = Linear(qw, out_dtype=torch.float32, fallback_dtype=torch.float32)
    assert ref.backend == "torch"
    torch.testing.assert_close(ref(x.float()), int8_linear_fp32_ref(x.float(), qw, None,
                                                                     torch.float32))


def test_tied_table_lookup_reads_the_table():
    w, _ = _weight(40, 24)
    table = w.bfloat16()
    qw = quantize_int8(w, table=table)
    ids = torch.tensor([0, 39, 7, 7])
    p = pack_int8(qw)
    assert p.table is table and p.nbytes == p.data.numel() + p.scale.numel() * 4 + 40 * 24 * 2
    assert torch.equal(dequantize_rows_ref(ids, p, torch.bfloat16), table[ids])
    plain = pack_int8(quantize_int8(w))
    torch.testing.assert_close(dequantize_rows_ref(ids, plain, torch.float32),
                               dequantize_ref(plain)[ids])
