"""csrc/quant_k.cpp (``quant_k_gemm``) on GGUF k-quant super-blocks (Q4_K, Q5_K, Q6_K),
against the pure-torch references of tokenserve/ops/quant.py, with ``gguf.quants`` (llama.cpp's
own reference decoding, gguf-py) as a second oracle for the block formats.

Weights are random *valid* blocks: random bytes for every scale, min and quant field, with
finite fp16 ``d`` / ``dmin`` (both signs, normals and subnormals), so every bit of the formats
is exercised (gguf-py cannot quantise to k-quants; tests/integration/test_quantization.py has
a min/max quantiser for a real model).

* ``dequantize_ref`` equals ``gguf.quants.dequantize`` bit for bit; ``repack_k8`` (the
  kernel's 8-row interleave) round-trips; ``QuantWeight.rows`` on the packed layout;
* ``fma32`` (the emulated fused multiply-add) is correctly rounded, double-rounding cases
  included, so ``quant_k_linear_ref`` is a bit-exact emulation;
* ``quant_k_gemm`` equals ``quant_k_linear_ref`` bit for bit (awkward N, K = 1..6
  super-blocks, bias, vocab-sized N), and is within the activation rounding of the fp32
  product with the dequantised weight;
* the AVX2 path and the portable path give the same bits;
* a row's result is the same bits alone, in any batch, at 1 or 2 threads.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from tests.kernel_checks import (
    act_rounding_bound,
    activations,
    assert_rows_invariant,
    inner_loop_params,
)
from tokenserve.ops.dispatch import Kernels, load_kernels
from tokenserve.ops.linear import Linear, SplitLinear, fused_linear, leaf_linears
from tokenserve.ops.quant import (
    act_sums16_ref,
    dequantize_ref,
    dequantize_rows_ref,
    fma32,
    quant_k_linear_ref,
    quant_linear_fp32_ref,
    quantize_act_ref,
    repack_x8,
)
from tokenserve.ops.quant_blocks import (
    BLOCK_BYTES,
    GROUP_BYTES,
    K_QTYPES,
    QTYPE_IDS,
    QuantWeight,
    repack_k8,
    unpack_k8,
    unpack_x8,
)

C = load_kernels()
HAVE_C = C is not None and hasattr(C, "quant_k_gemm")
needs_c = pytest.mark.skipif(not HAVE_C, reason="tokenserve._C (quant_k_gemm) not built")
QTYPES = list(K_QTYPES)


def _f16_bits(n: int, g: torch.Generator, max_exp: int = 14) -> torch.Tensor:
    """n finite fp16 values as uint8 [n, 2]: random sign and mantissa, exponent field
    0..max_exp (0: subnormals / zero; 14: up to ~1), so products stay far from overflow."""
    sign = torch.randint(0, 2, (n,), generator=g) << 15
    exp = torch.randint(0, max_exp + 1, (n,), generator=g) << 10
    man = torch.randint(0, 1024, (n,), generator=g)
    return (sign | exp | man).to(torch.int16).view(torch.uint8).view(n, 2)


def _weight(N: int, K: int, qtype: str, seed: int = 0) -> QuantWeight:
    """Random valid GGUF super-blocks, rows layout [N, K // 256 * BLOCK_BYTES]."""
    g = torch.Generator().manual_seed(seed * 7919 + N * 31 + K + QTYPE_IDS[qtype])
    nsb, bb = K // 256, BLOCK_BYTES[qtype]
    data = torch.randint(0, 256, (N, nsb, bb), generator=g, dtype=torch.uint8)
    if qtype == "q6_k":
        data[..., 208:210] = _f16_bits(N * nsb, g).view(N, nsb, 2)
    else:
        data[..., 0:2] = _f16_bits(N * nsb, g).view(N, nsb, 2)
        data[..., 2:4] = _f16_bits(N * nsb, g).view(N, nsb, 2)
    return QuantWeight(data.reshape(N, -1).contiguous(), qtype, (N, K))


_x = activations  # an all-zero block (d = 0) in the middle row


def _gemm(x, qw: QuantWeight, bias=None, out_dtype=torch.float32):
    p = repack_k8(qw)
    return C.quant_k_gemm(x, p.data, QTYPE_IDS[qw.qtype], qw.shape[0], bias, out_dtype)


# ------------------------------------------------------------------ references vs gguf


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("N,K", [(1, 256), (3, 512), (17, 768), (5, 1536)])
def test_dequantize_ref_equals_gguf_and_k8_round_trips(qtype, N, K):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qw = _weight(N, K, qtype)
    theirs = dequantize(qw.data.numpy(), GGMLQuantizationType[qtype.upper()])
    ours = dequantize_ref(qw)
    assert ours.dtype == torch.float32 and ours.shape == (N, K)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs)).reshape(N, K))
    packed = repack_k8(qw)
    assert repack_x8(qw).layout == "k8"  # the model's generic packing call
    assert packed.layout == "k8"
    assert tuple(packed.data.shape) == ((N + 7) // 8, K // 256, GROUP_BYTES[qtype])
    assert GROUP_BYTES[qtype] == 8 * BLOCK_BYTES[qtype]  # no extra bytes, only padding rows
    assert torch.equal(unpack_k8(packed).data, qw.data)
    assert torch.equal(unpack_x8(packed).data, qw.data)
    assert torch.equal(dequantize_ref(packed), ours)
    ids = torch.tensor([N - 1, 0, N // 2, N - 1])
    assert torch.equal(packed.rows(ids).data, qw.data[ids])
    assert torch.equal(dequantize_rows_ref(ids, packed, torch.bfloat16),
                       ours[ids].to(torch.bfloat16))


def test_k_not_a_multiple_of_the_super_block_is_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantWeight(torch.zeros(2, 144, dtype=torch.uint8), "q4_k", (2, 288))
    with pytest.raises(ValueError, match="layout"):
        QuantWeight(torch.zeros(1, 1, 1152, dtype=torch.uint8), "q4_k", (2, 256), "x8")
    with pytest.raises(ValueError, match="not a k-quant"):
        repack_k8(QuantWeight(torch.zeros(2, 18, dtype=torch.uint8), "q4_0", (2, 32)))
    if HAVE_C:
        w = repack_k8(_weight(2, 256, "q4_k")).data
        with pytest.raises(RuntimeError, match="multiple of 256"):
            C.quant_k_gemm(torch.zeros(1, 288), w, QTYPE_IDS["q4_k"], 2)
        with pytest.raises(RuntimeError, match="repack_k8"):  # GGUF rows, not k8
            C.quant_k_gemm(torch.zeros(1, 256), _weight(2, 256, "q4_k").data,
                           QTYPE_IDS["q4_k"], 2)
        with pytest.raises(RuntimeError, match="qtype"):
            C.quant_k_gemm(torch.zeros(1, 256), w, QTYPE_IDS["q4_1"], 2)


def _round_f32(v: Fraction) -> float:
    """The exact rational v rounded to the nearest fp32 (ties to even), normal range."""
    if v == 0:
        return 0.0
    e = 0
    a = abs(v)
    while a >= 2 ** 24:
        a /= 2
        e += 1
    while a < 2 ** 23:
        a *= 2
        e -= 1
    r = round(a)  # Fraction rounds half to even
    return float(np.float32(float(r) * 2.0 ** e * (1 if v > 0 else -1)))


def test_fma32_is_correctly_rounded():
    # exact = 1 + 2^-23 + 2^-24 - 2^-54: fp64 rounds it onto the fp32 midpoint, and a naive
    # fp64-then-fp32 rounding would give 1 + 2^-22; the correct fmaf result is 1 + 2^-23.
    a = torch.tensor([2.0 ** -24 + 2.0 ** -39])
    b = torch.tensor([1.0 - 2.0 ** -15])
    c = torch.tensor([1.0 + 2.0 ** -23])
    naive = (a.double() * b.double() + c.double()).float()
    assert naive.item() == 1.0 + 2.0 ** -22
    assert fma32(a, b, c).item() == 1.0 + 2.0 ** -23
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(2000, generator=g) for _ in range(3))
    c[:500] = -(a[:500] * b[:500])  # heavy cancellation
    got = fma32(a, b, c)
    for i in range(0, 2000, 7):
        want = _round_f32(Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item()))
        assert got[i].item() == want, (i, a[i].item(), b[i].item(), c[i].item())


def test_act_sums16_ref():
    q, _, _ = quantize_act_ref(_x(3, 256))
    s = act_sums16_ref(q)
    assert s.dtype == torch.int32 and s.shape == (3, 16)
    assert torch.equal(s[:, 1], q[:, 16:32].to(torch.int32).sum(-1))


# ------------------------------------------------------------------ kernel vs references


@needs_c
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("M", [0, 1, 3, 17])
@pytest.mark.parametrize("N,K", [(1, 256), (3, 512), (17, 768), (960, 256), (19, 1536)])
def test_quant_k_gemm_vs_reference(qtype, M, N, K):
    qw = _weight(N, K, qtype)
    x = _x(M, K)
    bias = torch.randn(N) if N % 2 else None
    y = _gemm(x, qw, bias)
    assert y.shape == (M, N) and y.dtype == torch.float32
    if M == 0:
        return
    assert torch.equal(y, quant_k_linear_ref(x, qw, bias, torch.float32))
    exact = quant_linear_fp32_ref(x, qw, bias, torch.float32)
    # within the int8 (per 256) activation rounding's bound
    bound = act_rounding_bound(x, dequantize_ref(qw), 127, 256) + 1e-5 * (1 + exact.abs())
    assert ((y - exact).abs() <= bound).all()


@needs_c
@pytest.mark.parametrize("qtype", QTYPES)
def test_quant_k_gemm_bf16_in_and_out(qtype):
    qw = _weight(33, 512, qtype)
    x = _x(5, 512, torch.bfloat16)
    y = _gemm(x, qw, None, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, _gemm(x.float(), qw, None, torch.float32).to(torch.bfloat16))
    assert torch.equal(y, quant_k_linear_ref(x, qw, None, torch.bfloat16))


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", QTYPES)
def test_portable_path_same_bits(qtype, dtype):
    """AVX2 and portable code give the same bits, for fp32 and bf16 activations (read
    directly, widened exactly)."""
    qw = _weight(37, 768, qtype)
    x = _x(9, 768, dtype)
    fast = _gemm(x, qw)
    old = C._quant_k_force_portable(True)
    try:
        slow = _gemm(x, qw)
    finally:
        C._quant_k_force_portable(old)
    assert torch.equal(fast, slow)
    if dtype == torch.bfloat16:  # the same rows given as fp32
        assert torch.equal(slow, _gemm(x.float(), qw).to(slow.dtype))


@pytest.fixture
def isa(request):
    """quant_k_gemm held on one inner loop for the test (the hooks restore the old state):
    "avx512vnni" / "avx2" are the int8 tiles (vpdpbusd / vpmaddubsw; AVX2 Q6_K stays int16),
    "...-int16" the int16 ones (vpdpwssd / vpmaddwd)."""
    old_p = C._quant_k_force_portable(request.param == "portable")
    old_a = C._quant_k_force_avx2(request.param.startswith("avx2"))
    old_w = C._quant_k_force_int16(request.param.endswith("-int16"))
    yield request.param
    C._quant_k_force_portable(old_p)
    C._quant_k_force_avx2(old_a)
    C._quant_k_force_int16(old_w)


def _inner_loops() -> list:
    """The shared inner loops, each SIMD one also on quant_k_gemm's int16 tiles."""
    out = []
    for loop in inner_loop_params(C):
        out.append(loop)
        name = loop.values[0]
        if name != "portable":
            out.append(pytest.param(f"{name}-int16", id=f"{name}-int16", marks=loop.marks))
    return out


@needs_c
@pytest.mark.parametrize("isa", _inner_loops(), indirect=True)
@pytest.mark.parametrize("qtype", QTYPES)
def test_row_invariance_batch_and_threads(qtype, isa):
    """Bit for bit, on each inner loop this CPU has: a row alone == the same row at every
    position of batches of 1..33 rows (16 included), and with 1 or 2 threads."""
    qw = _weight(131, 512, qtype)
    assert_rows_invariant(lambda x: _gemm(x, qw), _x(33, 512), (2, 3, 5, 16, 33))


@needs_c
@pytest.mark.parametrize("isa", _inner_loops(), indirect=True)
@pytest.mark.parametrize("qtype", QTYPES)
def test_each_inner_loop_equals_reference(qtype, isa):
    """Each inner loop against the pure-torch oracle at the row counts that cut its tiles
    differently (8-row AVX-512 blocks, 4-row AVX2 blocks, an odd last group)."""
    qw = _weight(37, 768, qtype)  # 5 groups: two pairs and a lone one
    bias = torch.randn(37)
    for M in (1, 2, 7, 9, 17):
        x = _x(M, 768)
        assert torch.equal(_gemm(x, qw, bias), quant_k_linear_ref(x, qw, bias, torch.float32)), M


@needs_c
@pytest.mark.skipif(not (HAVE_C and C.cpu_features().get("avx512vnni")),
                    reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("qtype", QTYPES)
def test_avx512_tiles_same_bits_as_avx2(qtype):
    """The AVX-512 VNNI tiles (two groups, up to 8 rows; int8 vpdpbusd and int16 vpdpwssd)
    give the AVX2 tiles' bits (int8 vpmaddubsw) for every row count and group parity, bf16
    and fp32 out, with a bias."""
    def forced(hook, *args):
        old = hook(True)
        try:
            return _gemm(*args)
        finally:
            hook(old)

    for N, K in ((40, 512), (37, 1024)):
        qw = _weight(N, K, qtype)
        bias = torch.randn(N) if N % 2 else None
        for M in (1, 2, 3, 7, 8, 9, 16, 17, 64):
            x = _x(M, K, torch.bfloat16)
            for od in (torch.float32, torch.bfloat16):
                fast = _gemm(x, qw, bias, od)
                assert torch.equal(fast, forced(C._quant_k_force_avx2, x, qw, bias, od)), (N, K, M, od)
                assert torch.equal(fast, forced(C._quant_k_force_int16, x, qw, bias, od)), (N, K, M, od)


@needs_c
@pytest.mark.skipif(not (HAVE_C and C.cpu_features().get("avx512vnni")),
                    reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("qtype", QTYPES)
def test_16_row_tiles_same_bits(qtype):
    """Whole 16-row blocks of int8 activations run on the 16-row tiles (weight lanes built
    once for 16 rows): the bits of the 8-row tiles (test hook) and of the reference for 16,
    17, 31, 32, 33 and 64 rows (16-row blocks plus a remainder on the 8-row tiles), an odd
    last group, bf16 and fp32 out, a bias, one and two threads (AMX-INT8 held off: on an
    AMX CPU these rows would run there)."""
    def hooked(*args):
        old = C._quant_k_no_tile16(True)
        try:
            return _gemm(*args)
        finally:
            C._quant_k_no_tile16(old)

    threads = torch.get_num_threads()
    old_amx = C._quant_k_amx_rows(1 << 40)
    try:
        _check_16_row_tiles(qtype, hooked, threads)
    finally:
        C._quant_k_amx_rows(old_amx)


def _check_16_row_tiles(qtype, hooked, threads):
    for N, K in ((40, 512), (37, 1024)):
        qw = _weight(N, K, qtype)
        bias = torch.randn(N) if N % 2 else None
        for M in (16, 17, 31, 32, 33, 64):
            x = _x(M, K, torch.bfloat16)
            ref = quant_k_linear_ref(x, qw, bias, torch.float32)
            for od in (torch.float32, torch.bfloat16):
                for nt in (1, 2):
                    torch.set_num_threads(nt)
                    try:
                        fast = _gemm(x, qw, bias, od)
                    finally:
                        torch.set_num_threads(threads)
                    assert torch.equal(fast, hooked(x, qw, bias, od)), (N, K, M, od, nt)
                    assert torch.equal(fast, ref.to(od)), (N, K, M, od, nt)


@needs_c
@pytest.mark.skipif(not (HAVE_C and C.cpu_features().get("avx512vnni")),
                    reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("qtype", QTYPES)
def test_one_row_tiles_same_bits(qtype):
    """A one-row GEMM on an AVX-512 VNNI CPU runs on the one-row tiles (vpdpbusd on one
    group of 8 weight rows: one stream of weights per thread): the bits of the AVX2 tile it
    replaced (test hook), of the reference, and of the same row inside a batch; full and
    partial groups, K of one to sixteen super-blocks."""
    for N, K in ((8, 256), (37, 1024), (203, 4096)):
        qw = _weight(N, K, qtype)
        bias = torch.randn(N)
        x = _x(6, K)
        got = _gemm(x[:1], qw, bias)
        old = C._quant_k_no_row_tile(True)
        try:
            replaced = _gemm(x[:1], qw, bias)
        finally:
            C._quant_k_no_row_tile(old)
        assert torch.equal(got, replaced), (N, K)
        assert torch.equal(got, quant_k_linear_ref(x[:1], qw, bias, torch.float32)), (N, K)
        assert torch.equal(got, _gemm(x, qw, bias)[:1]), (N, K)


@needs_c
def test_vocab_49152_lm_head_q6_k_fp32_logits():
    """Q4_K_M files keep the lm_head (or a tied embedding) in Q6_K."""
    qw = _weight(49152, 256, "q6_k")
    x = _x(3, 256, torch.bfloat16)
    y = _gemm(x, qw, None, torch.float32)
    assert y.shape == (3, 49152) and y.dtype == torch.float32
    assert torch.equal(y, quant_k_linear_ref(x, qw, None, torch.float32))


@needs_c
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequant_rows_equals_reference(qtype, out_dtype):
    """The embedding lookup on a k8 table (a Q4_K_M file's tied Q6_K embedding) equals
    ``dequantize_rows_ref`` (gguf-py's dequantisation) bit for bit, ids in any order, and
    the Kernels dispatch takes it; an id outside the table is a RuntimeError."""
    qw = _weight(37, 512, qtype, seed=5)
    p = repack_k8(qw)
    ids = torch.tensor([0, 36, 7, 7, 20, 8])
    got = C.quant_k_dequant_rows(ids, p.data, QTYPE_IDS[qtype], 37, 512, out_dtype)
    assert got.shape == (6, 512) and got.dtype == out_dtype
    assert torch.equal(got, dequantize_rows_ref(ids, qw, out_dtype))
    assert torch.equal(Kernels(use_c=True).embedding(ids, p, out_dtype), got)
    with pytest.raises(RuntimeError, match="out of range"):
        C.quant_k_dequant_rows(torch.tensor([37]), p.data, QTYPE_IDS[qtype], 37, 512, out_dtype)


# ------------------------------------------------------------------ Linear


@pytest.mark.parametrize("qtype", QTYPES)
def test_linear_picks_quant_k_backend_or_dequantises(qtype, monkeypatch):
    qw = _weight(17, 512, qtype)
    x = _x(3, 512, torch.bfloat16)
    lin = Linear(qw, out_dtype=torch.float32)
    if HAVE_C:
        assert lin.backend == "tokenserve.quant_k_gemm" and lin.qweight.layout == "k8"
        assert lin.nbytes == lin.qweight.nbytes == qw.nbytes * 24 // 17  # N padded to 8
        assert torch.equal(lin(x), _gemm(x, qw, None, torch.float32))
        assert torch.equal(lin(x.view(3, 1, 512)).view(3, 17), lin(x))
    monkeypatch.setenv("TOKENSERVE_DISABLE_C", "1")
    ref = Linear(qw, out_dtype=torch.float32, fallback_dtype=torch.float32)
    assert ref.backend == "torch"
    torch.testing.assert_close(ref(x.float()), quant_linear_fp32_ref(x.float(), qw, None,
                                                                     torch.float32))


@needs_c
def test_fused_rows_of_mixed_formats_run_per_part():
    """A Q4_K_M layer's fused q|k|v (q, k Q4_K; v Q6_K) runs per run of same-format rows,
    never widened: each part's bits are the k-quant kernel's, concatenated in order, and the
    C++ spec is a split (csrc/proj_spec.h kind 5)."""
    q, k, v = _weight(64, 512, "q4_k", 1), _weight(16, 512, "q4_k", 2), _weight(16, 512, "q6_k", 3)
    bias = torch.randn(96)
    lin = fused_linear([q, k, v], bias, torch.bfloat16)
    assert isinstance(lin, SplitLinear) and lin.out_features == 96 and lin.in_features == 512
    assert [(p.backend, p.qweight.qtype, p.out_features) for p in lin.parts] == [
        ("tokenserve.quant_k_gemm", "q4_k", 80), ("tokenserve.quant_k_gemm", "q6_k", 16)]
    x = _x(5, 512, torch.bfloat16)
    want = torch.cat([quant_k_linear_ref(x, QuantWeight.cat([q, k]), bias[:80], torch.bfloat16),
                      quant_k_linear_ref(x, v, bias[80:], torch.bfloat16)], dim=1)
    assert torch.equal(lin(x), want)
    spec = lin.c_spec()
    assert spec[0] == 5 and spec[4] == 96 and [s[0] for s in spec[1]] == [3, 3]
    assert leaf_linears([lin]) == lin.parts
    # one format: one Linear over the concatenated blocks, as before
    one = fused_linear([q, k], None, torch.bfloat16)
    assert isinstance(one, Linear) and one.backend == "tokenserve.quant_k_gemm"
    assert torch.equal(one(x), quant_k_linear_ref(x, QuantWeight.cat([q, k]), None, torch.bfloat16))
    # a float part next to blocks: its own Linear too
    f = torch.randn(8, 512)
    mixed = fused_linear([q, f], None, torch.bfloat16)
    assert isinstance(mixed, SplitLinear) and mixed.parts[1].backend == "tokenserve.gemm"
