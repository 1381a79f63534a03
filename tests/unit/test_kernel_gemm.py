"""csrc/gemm.cpp (``gemm_prepack``, ``gemm``, ``gemm_out``) against an fp64 reference, its
row invariance (bit-exact), and the :class:`tokenserve.ops.linear.Linear` wrapper.

Both chains run here where the CPU has them (the ``layout`` parameter: ``k16`` is the fp32
FMA chain, ``pairs`` the AVX512_BF16 ``vdpbf16ps`` chain, skipped with its reason on a CPU
without AVX512_BF16). The pair-dot chain takes its activations in bf16, so its reference
is computed on x rounded to bf16; each ``vdpbf16ps`` adds two exact bf16 products with at
most two roundings, so the same gamma_K bound holds, plus 2^-126 per step for its
flush-to-zero of subnormals.

Tolerances (rigorous, so a wrong kernel fails them): every output element is a sequential
fp32 FMA chain over k, so with u = 2^-24 its error against the exact (fp64) dot product is
at most gamma_K * sum_k |x_k w_k|, gamma_K = K u / (1 - K u) (Higham, Accuracy and
Stability, 3.1; an FMA rounds once per step, which only tightens it). The bias add adds
u * |acc + b|. For a bf16 result the final rounding adds at most half a bf16 ulp
(2^-8 relative); we allow a whole bf16 ulp of the reference (the brief's "within 1 ulp").
Inputs are exactly representable in the weight/x dtype, so the fp64 reference is exact.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernel_checks import assert_releases_gil
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.linear import Linear, linear_ref

C = load_kernels()
pytestmark = pytest.mark.skipif(C is None or not hasattr(C, "gemm"),
                                reason="tokenserve._C (gemm) not built")

U32 = 2.0 ** -24
HAS_PAIRS = C is not None and bool(C.cpu_features().get("avx512bf16", False))


@pytest.fixture(params=["k16", "pairs"])
def layout(request) -> str:
    """The packed layout (and so the arithmetic chain) under test."""
    if request.param == "pairs" and not HAS_PAIRS:
        pytest.skip("pair-dot GEMM: this CPU has no AVX512_BF16")
    return request.param


def _pack(w: torch.Tensor, layout: str) -> torch.Tensor:
    """w packed for ``layout``; an fp32 weight has only the k16 layout."""
    return C.gemm_prepack(w, layout == "pairs" and w.dtype == torch.bfloat16)


def _x_seen(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The activations the kernel computes with: bf16-rounded on pair panels."""
    return x.to(torch.bfloat16) if p.shape[-1] == 32 else x


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Error bound of the fp32 FMA chain or the pair-dot chain (+ bias add) against the
    exact result, [M, N]."""
    K = x.shape[1]
    gamma = K * U32 / (1 - K * U32)
    absdot = x.double().abs() @ w.double().abs().T
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    return gamma * absdot + U32 * exact.abs() * 2 + K * 2.0 ** -126 + 1e-300


def _exact(x, w, b):
    return x.double() @ w.double().T + (0 if b is None else b.float().double())


def _check(y: torch.Tensor, x, w, b, out_dtype):
    exact = _exact(x, w, b)
    tol = _bound(x, w, b)
    err = (y.double() - exact).abs()
    if out_dtype == torch.bfloat16:
        # one bf16 ulp of the value (ulp = 2^(e-7) for |v| in [2^e, 2^(e+1))) + chain error
        mag = exact.abs() + tol
        ulp = torch.where(mag > 0, torch.exp2(torch.floor(torch.log2(mag)) - 7),
                          torch.zeros_like(mag))
        tol = tol + ulp + 2.0 ** -133  # subnormal floor
    bad = err > tol
    assert not bad.any(), (f"max err {err.max().item():.3e}, tol at worst "
                           f"{tol.flatten()[err.flatten().argmax()].item():.3e}, "
                           f"{int(bad.sum())} of {bad.numel()} outside")


def _data(M, N, K, wdt, xdt, bias, seed=0):
    g = torch.Generator().manual_seed(seed * 1000003 + M * 7919 + N * 31 + K)
    x = torch.randn(M, K, generator=g).to(xdt)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(wdt)
    b = torch.randn(N, generator=g).to(wdt) if bias else None
    return x, w, b


_NO_PAIRS = [pytest.mark.skip(reason="pair-dot GEMM: this CPU has no AVX512_BF16")] \
    if not HAS_PAIRS else []


@pytest.mark.parametrize("wdt,layout", [
    pytest.param(torch.bfloat16, "k16", id="bf16-k16"),
    pytest.param(torch.bfloat16, "pairs", id="bf16-pairs", marks=_NO_PAIRS),
    pytest.param(torch.float32, "k16", id="fp32-k16")])  # the pair layout is bf16 only
@pytest.mark.parametrize("M", [0, 1, 3, 17, 64, 257])
@pytest.mark.parametrize("N,K", [(1, 1), (17, 3), (960, 576), (3072, 576), (17, 1536), (1, 576),
                                 (960, 3)])
def test_gemm_vs_fp64(M, N, K, wdt, layout):
    if M * N * K > 257 * 3072 * 576 // 2 and wdt == torch.float32:
        M = 64  # keep the largest fp32 case quick; bf16 covers M=257 at this size
    x, w, b = _data(M, N, K, wdt, wdt, bias=(N % 2 == 1))
    p = _pack(w, layout)
    shape = ((N + 15) // 16, (K + 1) // 2, 32) if layout == "pairs" else ((N + 15) // 16, K, 16)
    assert p.dtype == w.dtype and tuple(p.shape) == shape
    for out_dtype in (wdt, torch.float32):
        y = C.gemm(x, p, N, b, out_dtype)
        assert y.dtype == out_dtype and tuple(y.shape) == (M, N)
        _check(y, x, w, b, out_dtype)


def test_pair_layout_refuses_fp32_weights():
    with pytest.raises(RuntimeError, match="pair layout takes a bfloat16"):
        C.gemm_prepack(torch.zeros(4, 4), True)


@pytest.mark.skipif(HAS_PAIRS, reason="this CPU has AVX512_BF16: pair panels run here")
def test_pair_panels_refused_without_avx512bf16():
    p = torch.zeros(1, 2, 32, dtype=torch.bfloat16)  # what gemm_prepack(w[16, 4], True) gives
    with pytest.raises(RuntimeError, match="AVX512_BF16"):
        C.gemm(torch.zeros(1, 4, dtype=torch.bfloat16), p, 16, None, None)


@pytest.mark.parametrize("xdt,wdt", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                     (torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
def test_mixed_dtypes_and_fp32_logits(xdt, wdt, layout):
    """bf16 x with bf16 weights -> fp32 out is the lm_head's call (fp32 logits)."""
    x, w, b = _data(33, 257, 576, wdt, xdt, bias=True)
    p = _pack(w, layout)
    y = C.gemm(x, p, 257, b, torch.float32)
    assert y.dtype == torch.float32
    _check(y, _x_seen(x, p), w, b, torch.float32)
    y16 = C.gemm(x, p, 257, None, None)  # None: x's dtype
    assert y16.dtype == xdt
    _check(y16, _x_seen(x, p), w, None, xdt)


def test_bias_is_added_after_the_chain(layout):
    """The bias is one fp32 add after the chain: y == fp32(acc) + fp32(b) bit for bit."""
    x, w, b = _data(5, 40, 64, torch.bfloat16, torch.bfloat16, bias=True)
    p = _pack(w, layout)
    y0 = C.gemm(x, p, 40, None, torch.float32)
    y1 = C.gemm(x, p, 40, b, torch.float32)
    assert torch.equal(y1, y0 + b.float())
    assert not torch.equal(y1, y0)


def test_strided_rows_and_noncontiguous(layout):
    x, w, b = _data(19, 50, 96, torch.bfloat16, torch.bfloat16, bias=False)
    big = torch.randn(19, 300).to(torch.bfloat16)
    big[:, 100:196] = x
    xs = big[:, 100:196]  # row stride 300, stride(1) == 1
    assert xs.stride() == (300, 1)
    p = _pack(w, layout)
    ref = C.gemm(x.contiguous(), p, 50, None, torch.float32)
    assert torch.equal(C.gemm(xs, p, 50, None, torch.float32), ref)
    assert torch.equal(C.gemm(xs.float(), p, 50, None, torch.float32), ref)
    xt = x.t().contiguous().t()  # stride(1) != 1: copied, same bits
    assert torch.equal(C.gemm(xt, p, 50, None, torch.float32), ref)
    # a transposed (non-contiguous) weight packs the same
    wt = w.t().contiguous().t()
    assert torch.equal(_pack(wt, layout), p)


def test_gemm_out_writes_in_place(layout):
    x, w, b = _data(7, 33, 40, torch.bfloat16, torch.bfloat16, bias=True)
    p = _pack(w, layout)
    out = torch.full((7, 33), float("nan"), dtype=torch.float32)
    r = C.gemm_out(x, p, 33, b, out)
    assert r.data_ptr() == out.data_ptr()
    assert torch.equal(out, C.gemm(x, p, 33, b, torch.float32))


@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [576, 131])
def test_row_invariance(wdt, K, layout):
    """A row's output is bit-identical alone and at any position of any batch size, with
    any thread count (K = 131: an odd K, the pair chain's last half pair)."""
    rng = random.Random(1)
    N = 200  # 13 panels: a tail panel of 8 columns
    x, w, b = _data(300, N, K, wdt, torch.bfloat16, bias=True, seed=3)
    p = _pack(w, layout)
    alone = torch.cat([C.gemm(x[i:i + 1], p, N, b, torch.float32) for i in range(300)])
    alone16 = torch.cat([C.gemm(x[i:i + 1], p, N, b, torch.bfloat16) for i in range(300)])
    threads = torch.get_num_threads()
    try:
        for trial, M in enumerate([1, 2, 3, 4, 5, 6, 7, 13, 64, 300] + rng.sample(range(8, 300), 8)):
            torch.set_num_threads(1 + trial % max(threads, 2))
            start = rng.randrange(0, 300 - M + 1)
            y = C.gemm(x[start:start + M], p, N, b, torch.float32)
            assert torch.equal(y, alone[start:start + M]), f"M={M} start={start}"
            y16 = C.gemm(x[start:start + M], p, N, b, torch.bfloat16)
            assert torch.equal(y16, alone16[start:start + M]), f"bf16 out M={M} start={start}"
            # the same rows in another order give the same rows
            perm = torch.randperm(M, generator=torch.Generator().manual_seed(trial))
            yp = C.gemm(x[start:start + M][perm], p, N, b, torch.float32)
            assert torch.equal(yp, alone[start:start + M][perm])
    finally:
        torch.set_num_threads(threads)


def test_k_zero_and_n_zero():
    w = torch.zeros(5, 0, dtype=torch.bfloat16)
    p = C.gemm_prepack(w)
    b = torch.arange(5, dtype=torch.float32)
    y = C.gemm(torch.zeros(3, 0, dtype=torch.bfloat16), p, 5, b, torch.float32)
    assert torch.equal(y, b.expand(3, 5))
    p0 = C.gemm_prepack(torch.zeros(0, 8))
    assert C.gemm(torch.ones(4, 8), p0, 0, None, None).shape == (4, 0)


def test_nan_inf_propagate(layout):
    x = torch.ones(2, 4)
    w = torch.ones(3, 4)
    w[0, 1] = float("nan")
    w[1, 2] = float("inf")
    p = _pack(w.to(torch.bfloat16), layout)
    y = C.gemm(x, p, 3, None, torch.bfloat16).float()
    assert y[:, 0].isnan().all() and (y[:, 1] == float("inf")).all() and (y[:, 2] == 4).all()


def test_bf16_rounding_matches_torch(layout):
    """fp32 -> bf16 rounding of the result is torch's (nearest even), checked with a
    K=1 product whose fp32 value is exact: y_bf16 == fp32(y).to(bf16) (on pair panels x
    is rounded to bf16 first, which gives the same bf16)."""
    vals = torch.randn(4096) * 10
    vals[:4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.0e38])
    x = vals.view(-1, 1)
    w = torch.ones(1, 1)
    p = _pack(w.to(torch.bfloat16) if layout == "pairs" else w, layout)
    y16 = C.gemm(x, p, 1, None, torch.bfloat16)
    assert torch.equal(y16, x.to(torch.bfloat16))


def test_bad_arguments():
    p = C.gemm_prepack(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="K="):
        C.gemm(torch.randn(2, 9), p, 20, None, None)
    with pytest.raises(RuntimeError, match="N="):
        C.gemm(torch.randn(2, 8), p, 40, None, None)
    with pytest.raises(RuntimeError, match="bias"):
        C.gemm(torch.randn(2, 8), p, 20, torch.zeros(3), None)
    with pytest.raises(RuntimeError, match="dtype"):
        C.gemm_prepack(torch.zeros(4, 4, dtype=torch.float16))


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_linear_wrapper(out_dtype):
    x, w, b = _data(9, 70, 64, torch.bfloat16, torch.bfloat16, bias=True)
    lin = Linear(w, b, out_dtype=out_dtype)
    assert lin.backend == "tokenserve.gemm"  # the default is ours on every CPU (issue 20)
    assert lin.isa == ("avx512bf16" if HAS_PAIRS else
                       "avx2" if C.cpu_features()["avx2_fma"] else "portable")
    y = lin(x)
    assert y.dtype == (out_dtype or x.dtype) and y.shape == (9, 70)
    ref = linear_ref(x, w, b, out_dtype)
    tol = 2.0 ** -7 if (out_dtype or x.dtype) == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol)
    y3 = lin(x.view(3, 3, 64))  # leading dims
    assert y3.shape == (3, 3, 70) and torch.equal(y3.reshape(9, 70), y)


def test_forced_backends_and_their_description(monkeypatch):
    """``TOKENSERVE_GEMM`` picks the backend; ``describe`` says whether it is invariant;
    the start-up line names each kind of layer."""
    from tokenserve.ops.linear import describe_gemms

    x, w, b = _data(9, 70, 64, torch.bfloat16, torch.bfloat16, bias=True)
    monkeypatch.setenv("TOKENSERVE_GEMM", "c-fma")
    fma = Linear(w, b)
    assert (fma.backend, fma.isa) == ("tokenserve.gemm", "avx2" if C.cpu_features()["avx2_fma"]
                                      else "portable")
    assert fma.describe().endswith("(invariant)")
    assert fma._packed.shape[-1] == 16
    monkeypatch.setenv("TOKENSERVE_GEMM", "torch")
    assert Linear(w, b).describe() == "torch (not batch-invariant)"
    monkeypatch.setenv("TOKENSERVE_GEMM", "onednn")
    one = Linear(w, b)
    assert one.backend in ("onednn", "tokenserve.gemm")  # ours where oneDNN refuses the weight
    if one.backend == "onednn":
        assert one.describe() == "onednn (not batch-invariant)"
    monkeypatch.setenv("TOKENSERVE_GEMM", "fast")
    with pytest.raises(ValueError, match="TOKENSERVE_GEMM='fast'"):
        Linear(w, b)
    monkeypatch.delenv("TOKENSERVE_GEMM")
    head = Linear(w, out_dtype=torch.float32)
    line = describe_gemms([head, Linear(w, b), Linear(w.float())])
    assert line.startswith(f"bf16 → {fma.describe()}" if not HAS_PAIRS
                           else "bf16 → tokenserve.gemm avx512bf16 (invariant)")
    assert "fp32 → tokenserve.gemm" in line and "lm_head" not in line


@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
def test_portable_path_is_bit_equal(wdt):
    """The scalar fallback computes the same FMA chains (std::fma), so the same bits."""
    x, w, b = _data(23, 70, 130, wdt, torch.bfloat16, bias=True, seed=5)
    p = C.gemm_prepack(w)
    fast32 = C.gemm(x, p, 70, b, torch.float32)
    fast16 = C.gemm(x, p, 70, b, torch.bfloat16)
    old = C._gemm_force_portable(True)
    try:
        slow32 = C.gemm(x, p, 70, b, torch.float32)
        slow16 = C.gemm(x, p, 70, b, torch.bfloat16)
        one = C.gemm(x[4:5], p, 70, b, torch.float32)
    finally:
        C._gemm_force_portable(old)
    assert torch.equal(slow32, fast32) and torch.equal(slow16, fast16)
    assert torch.equal(one, fast32[4:5])
    _check(slow32, x, w, b, torch.float32)


@pytest.mark.skipif(C is None, reason="tokenserve._C not built")
def test_gemm_releases_the_gil():
    """The server's event loop runs while the model thread is in a GEMM."""
    g = torch.Generator().manual_seed(0)
    p = C.gemm_prepack(torch.randn(2048, 1024, generator=g).bfloat16())
    x = torch.randn(1024, 1024, generator=g).bfloat16()
    assert_releases_gil(lambda: C.gemm(x, p, 2048, None, None))
