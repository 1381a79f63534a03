"""csrc/quant_amx.cpp (``quant_amx_gemm``): GGUF Q4_0 / Q4_1 / Q8_0 blocks on AMX tiles,
against the pure-torch reference of tokenserve/ops/quant.py.

* ``repack_t16`` round-trips (``unpack_t16``), and ``QuantWeight.rows`` reads it;
* ``dequantize_bf16_ref`` is the fp32 dequantisation (``dequantize_ref``) rounded to bf16;
* ``quant_amx_gemm`` equals ``quant_amx_linear_ref`` (bf16 weights and activations, fp32
  sums) to fp32 rounding, for every format, N and M tail, bias, fp32 or bf16 in and out;
* a row's result is the same bits alone, in any batch (1..70 rows: the fused and the
  panel loop), in reverse order, at 1 and 2 threads;
* ``Linear`` picks it on an AMX CPU with ``TOKENSERVE_GEMM=amx-bf16`` (never by default).

The kernel tests skip, with the reason, on a CPU or OS without AMX; the layout tests run
everywhere.
"""

from __future__ import annotations

import pytest
import torch

from tests.backends import gemm_env
from tests.kernel_checks import (
    activations,
    assert_releases_gil,
    assert_rows_invariant,
    quant_weight,
)
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.linear import Linear, amx_available
from tokenserve.ops.quant import (
    dequantize_bf16_ref,
    dequantize_ref,
    quant_amx_linear_ref,
)
from tokenserve.ops.quant_blocks import (
    QTYPE_IDS,
    QuantWeight,
    repack_blocks,
    repack_t16,
    unpack_t16,
)

C = load_kernels()
needs_amx = pytest.mark.skipif(not amx_available(C),
                               reason="no AMX-BF16 tiles on this CPU/OS (or tokenserve._C not built)")
QTYPES = ["q4_0", "q4_1", "q8_0"]


def _gemm(x, qw: QuantWeight, bias=None, out_dtype=torch.float32):
    p = repack_t16(qw)
    return C.quant_amx_gemm(x, p.data, QTYPE_IDS[qw.qtype], qw.shape[0], bias, out_dtype)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("N", [1, 16, 40])
def test_t16_round_trip(qtype, N):
    qw = quant_weight(N, 96, qtype)
    t = repack_t16(qw)
    assert t.layout == "t16" and tuple(t.data.shape) == ((N + 15) // 16, 3, t.data.shape[2])
    assert torch.equal(unpack_t16(t).data, qw.data)
    assert torch.equal(repack_t16(repack_blocks(qw)).data, t.data)  # from x8 too
    idx = torch.tensor([N - 1, 0])
    assert torch.equal(t.rows(idx).data, qw.data[[N - 1, 0]])


def test_t16_rejects_k_quants():
    with pytest.raises(ValueError, match="t16"):
        repack_t16(QuantWeight(torch.zeros(1, 144, dtype=torch.uint8), "q4_k", (1, 256)))


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_bf16_is_fp32_rounded(qtype):
    qw = quant_weight(24, 128, qtype)
    assert torch.equal(dequantize_bf16_ref(qw), dequantize_ref(qw).to(torch.bfloat16))


@needs_amx
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 16, 32), (3, 40, 96), (17, 576, 576), (33, 24, 1536),
                                   (70, 200, 64)])
def test_matches_reference(qtype, M, N, K):
    qw = quant_weight(N, K, qtype)
    x = activations(M, K, torch.bfloat16)
    y = _gemm(x, qw)
    ref = quant_amx_linear_ref(x, qw, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    tol = 2e-6 * float(ref.abs().max()) * K ** 0.5 + 1e-6
    assert float((y - ref).abs().max()) <= tol


@needs_amx
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_bias_fp32_input_and_dtypes(out_dtype):
    qw = quant_weight(40, 96, "q4_1")
    x = activations(5, 96)  # fp32: rounded to bf16 first
    b = torch.randn(40)
    y = _gemm(x, qw, b, out_dtype)
    assert y.dtype == out_dtype
    ref = quant_amx_linear_ref(x, qw, b, torch.float32)
    assert torch.allclose(y.float(), ref, atol=1e-2 if out_dtype == torch.bfloat16 else 1e-4, rtol=1e-2)
    assert torch.equal(_gemm(x, qw, None, out_dtype), _gemm(x.to(torch.bfloat16), qw, None, out_dtype))


@needs_amx
@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_invariant(qtype):
    qw = quant_weight(72, 192, qtype, seed=3)
    p = repack_t16(qw)
    assert_rows_invariant(
        lambda x: C.quant_amx_gemm(x, p.data, QTYPE_IDS[qtype], 72, None, torch.float32),
        activations(70, 192, torch.bfloat16), [1, 2, 15, 16, 17, 32, 33, 48, 64])


@needs_amx
def test_bad_weight_shape_is_rejected():
    qw = quant_weight(16, 64, "q4_1")
    with pytest.raises(RuntimeError, match="repack_t16"):
        C.quant_amx_gemm(activations(1, 64, torch.bfloat16), repack_blocks(qw).data, 1, 16, None, None)


@needs_amx
def test_releases_gil():
    qw = repack_t16(quant_weight(4096, 1536, "q4_1"))
    x = activations(4096, 1536, torch.bfloat16)  # ~47 ms on 2 Sapphire Rapids cores: over twice the 20 it needs
    assert_releases_gil(lambda: C.quant_amx_gemm(x, qw.data, 1, 4096, None, None))


@needs_amx
def test_linear_picks_amx_bf16_only_when_asked():
    qw = quant_weight(48, 64, "q4_1")
    x = activations(3, 64, torch.bfloat16)
    default = Linear(qw)
    assert default.backend == "tokenserve.quant_gemm" and default.qweight.layout == "x8"
    with gemm_env("amx-bf16"):
        lin = Linear(qw)
    assert lin.backend == "tokenserve.quant_amx" and lin.qweight.layout == "t16"
    assert lin.c_spec()[0] == 4
    assert torch.equal(lin(x), _gemm(x, qw, out_dtype=torch.bfloat16))


@needs_amx
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_embedding_rows_match_the_x8_lookup(qtype, out_dtype):
    qw = quant_weight(40, 96, qtype)
    ids = torch.tensor([0, 39, 17, 17, 5])
    got = C.quant_t16_dequant_rows(ids, repack_t16(qw).data, QTYPE_IDS[qtype], 40, 96, out_dtype)
    want = C.quant_dequant_rows(ids, repack_blocks(qw).data, QTYPE_IDS[qtype], 40, 96, out_dtype)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="out of range"):
        C.quant_t16_dequant_rows(torch.tensor([40]), repack_t16(qw).data, QTYPE_IDS[qtype], 40, 96,
                                 out_dtype)
