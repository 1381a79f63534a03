"""csrc/layer_ops.cpp vs its pure-torch references (tokenserve/ops/layer_ref.py).

Tolerances:
- rms_norm / fused_add_rms_norm: the kernel sums squares in its own fixed order, torch in
  another, so the fp32 inverse RMS can differ in its last bit: bf16 outputs within 1 bf16
  ulp of the torch reference (and almost all bit-equal), fp32 within 4 fp32 ulps. The
  residual of fused_add_rms_norm is one rounded add: bit-exact. The AVX2 and portable
  paths use the same order: bit-identical.
- silu_and_mul: the AVX2 exp is a polynomial (~1-2 fp32 ulp): bf16 within 1 bf16 ulp of
  the fp32-then-round-once reference, fp32 rtol 1e-5; vs torch's bf16 ``F.silu(g) * u``
  (two roundings) within 2 bf16 ulps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests import kernel_checks as kc
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.layer_ref import fused_add_rms_norm_ref, rms_norm_ref, silu_and_mul_ref

C = load_kernels()
pytestmark = pytest.mark.skipif(C is None, reason="tokenserve._C not built")

DTYPES = [torch.bfloat16, torch.float32]
EPS = 1e-5


path = kc.layer_ops_path_fixture(C)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of b's dtype (int distance of the bit patterns)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    it = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    ia, ib = a.view(it).long(), b.view(it).long()
    sign = 1 << (16 if a.dtype == torch.bfloat16 else 32) - 1
    # map sign-magnitude to a monotonic integer line
    ia = torch.where(ia < 0, -(ia + sign), ia)
    ib = torch.where(ib < 0, -(ib + sign), ib)
    return (ia - ib).abs()


def _max_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int(_ulps(a, b).max()) if a.numel() else 0


def _weight(Hd, dtype, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return (1 + 0.5 * torch.randn(Hd, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [0, 1, 3, 17, 300])
@pytest.mark.parametrize("Hd", [576, 37, 8, 1])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_matches_reference(path, dtype, T, Hd, strided):
    x = kc.layer_rows(T, Hd, dtype, seed=T * 13 + Hd, scale=3.0, strided=strided)
    w = _weight(Hd, dtype, Hd)
    out = torch.full((T, Hd), float("nan"), dtype=dtype)
    ref = torch.empty_like(out)
    x0 = x.clone()
    C.rms_norm(out, x, w, EPS)
    rms_norm_ref(ref, x, w, EPS)
    assert torch.equal(x, x0)
    limit = 1 if dtype == torch.bfloat16 else 4
    u = _ulps(out, ref)
    assert (int(u.max()) if u.numel() else 0) <= limit
    if dtype == torch.bfloat16 and out.numel() > 1000:
        assert (u > 0).float().mean() < 0.01  # nearly all bit-equal


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [0, 1, 3, 17, 300])
@pytest.mark.parametrize("Hd", [576, 37])
@pytest.mark.parametrize("strided", [False, True])
def test_fused_add_rms_norm_matches_reference(path, dtype, T, Hd, strided):
    x = kc.layer_rows(T, Hd, dtype, seed=T * 17 + Hd, strided=strided)
    res = kc.layer_rows(T, Hd, dtype, seed=T * 19 + Hd + 1, scale=4.0, strided=strided)
    w = _weight(Hd, dtype, Hd + 3)
    rx, rres = x.clone(), res.clone()
    C.fused_add_rms_norm(x, res, w, EPS)
    fused_add_rms_norm_ref(rx, rres, w, EPS)
    assert torch.equal(res, rres)
    limit = 1 if dtype == torch.bfloat16 else 4
    assert _max_ulps(x, rx) <= limit


def test_fused_add_rms_norm_matches_the_model_code():
    """The residual stream and the norm as HF Llama computes them in bf16:
    ``h = h + a``; ``w * (hf * rsqrt(mean(hf^2) + eps)).to(bf16)`` with ``hf = h.float()``."""
    a = kc.layer_rows(17, 576, torch.bfloat16, seed=1)
    h = kc.layer_rows(17, 576, torch.bfloat16, seed=2, scale=5.0)
    w = _weight(576, torch.bfloat16, 4)
    want_h = h + a
    hf = want_h.float()
    want_x = w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    C.fused_add_rms_norm(a, h, w, EPS)
    assert torch.equal(h, want_h)
    assert _max_ulps(a, want_x) <= 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_paths_bit_identical(dtype):
    x = kc.layer_rows(17, 576 + 13, dtype, seed=5, scale=2.0)
    w = _weight(576 + 13, dtype, 5)
    outs = []
    for name in ("vector", "avx2", "portable"):
        with kc.ForcedLayerOps(C, name):
            o = torch.empty_like(x)
            C.rms_norm(o, x, w, EPS)
            xx, rr = x.clone(), x.flip(0).contiguous()
            C.fused_add_rms_norm(xx, rr, w, EPS)
            outs.append((o, xx, rr))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_avx512_is_avx2(dtype):
    """The AVX-512 path is the AVX2 one on 16 lanes (exp16 = exp8 lane for lane): the same
    bits, body and tail (I = 1536 + 13), NaN, inf and large |g| included."""
    kc.assert_act_avx512_is_avx2(C, "silu_and_mul", dtype)


def test_rms_norm_in_place_and_nan():
    x = kc.layer_rows(3, 37, torch.bfloat16, seed=8)
    w = _weight(37, torch.bfloat16, 8)
    ref = torch.empty_like(x)
    rms_norm_ref(ref, x, w, EPS)
    x[2, 5] = float("nan")
    C.rms_norm(x, x, w, EPS)  # out may be x
    assert _max_ulps(x[:2], ref[:2]) <= 1
    assert x[2].isnan().all()  # a NaN poisons only its own row


@pytest.mark.parametrize("T", [1, 300])
def test_layer_ops_row_invariance(T):
    """A row's output is bit-identical alone or inside a batch (any T, any thread split)."""
    dtype = torch.bfloat16
    x = kc.layer_rows(T, 576, dtype, seed=11, scale=2.0)
    res = kc.layer_rows(T, 576, dtype, seed=12, scale=3.0)
    w = _weight(576, dtype, 11)
    xi = kc.layer_rows(T, 2 * 1536, dtype, seed=13, scale=3.0)
    out, bx, bres = torch.empty_like(x), x.clone(), res.clone()
    C.rms_norm(out, x, w, EPS)
    C.fused_add_rms_norm(bx, bres, w, EPS)
    for t in sorted({0, T // 2, T - 1}):
        o1 = torch.empty(1, 576, dtype=dtype)
        C.rms_norm(o1, x[t: t + 1].clone(), w, EPS)
        assert torch.equal(o1[0], out[t])
        x1, r1 = x[t: t + 1].clone(), res[t: t + 1].clone()
        C.fused_add_rms_norm(x1, r1, w, EPS)
        assert torch.equal(x1[0], bx[t]) and torch.equal(r1[0], bres[t])
    kc.assert_act_row_invariant(C, "silu_and_mul", xi)


def test_rms_norm_rejects_bad_arguments():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="weight"):
        C.rms_norm(torch.empty_like(x), x, torch.ones(7), EPS)
    with pytest.raises(RuntimeError, match="dtype"):
        C.rms_norm(torch.empty_like(x).bfloat16(), x, torch.ones(8), EPS)
    with pytest.raises(RuntimeError, match="contiguous"):
        C.rms_norm(torch.empty_like(x), torch.randn(8, 3).t(), torch.ones(8), EPS)
    with pytest.raises(RuntimeError, match="alias"):
        C.fused_add_rms_norm(x, x, torch.ones(8), EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [0, 1, 3, 17, 300])
@pytest.mark.parametrize("I", [1536, 37, 8, 1])
def test_silu_and_mul_matches_reference(path, dtype, T, I):
    x, out, ref = kc.act_and_ref(C, "silu_and_mul", silu_and_mul_ref, T, I, dtype)
    if dtype == torch.bfloat16:
        assert _max_ulps(out, ref) <= 1
        g, u = x.chunk(2, dim=-1)
        assert _max_ulps(out, F.silu(g) * u) <= 2  # torch bf16: 2 roundings
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-30)


def test_silu_and_mul_extremes():
    g = torch.tensor([0.0, -0.0, 1e-30, -100.0, -88.5, -87.0, 88.5, 100.0, 1e30, -1e30,
                      float("inf"), float("-inf"), float("nan"), 3.0, -3.0, 20.0, -20.0])
    u = torch.full_like(g, 2.0)
    x = torch.cat([g, u]).view(1, -1)
    out, ref = torch.empty(1, g.numel()), torch.empty(1, g.numel())
    C.silu_and_mul(out, x)
    silu_and_mul_ref(ref, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-30, equal_nan=True)


def test_silu_and_mul_rejects_bad_arguments():
    with pytest.raises(RuntimeError):
        C.silu_and_mul(torch.empty(2, 3), torch.randn(2, 7))
    with pytest.raises(RuntimeError):
        C.silu_and_mul(torch.empty(2, 4), torch.randn(2, 6))
