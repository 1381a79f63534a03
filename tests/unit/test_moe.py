"""The C++ MoE expert loop (csrc/moe.cpp ``MoeExperts``) against the Python loop
(``MoE(..., use_c=False)``): same bits for every expert weight format, and batch
invariance (a token's row depends on its own routing alone)."""

from __future__ import annotations

import pytest
import torch

from tokenserve.models.config import MoeArch
from tokenserve.models.families.base import LayerWeights
from tokenserve.models.moe import MoE
from tokenserve.ops.dispatch import Kernels, load_kernels
from tokenserve.ops.quant import quantize_ref
from tokenserve.ops.quant_blocks import BLOCK_BYTES, K_QTYPES, QuantWeight

pytestmark = pytest.mark.skipif(load_kernels() is None or not hasattr(load_kernels(), "MoeExperts"),
                                reason="needs the C++ kernels with MoeExperts")

H, I, E = 256, 256, 8  # k-quant super-blocks need K % 256 == 0


def _w(n: int, k: int, wq: str, g: torch.Generator):
    """A random [n, k] expert weight in format ``wq`` (as tests/unit/test_decoder.py)."""
    if wq in K_QTYPES:  # random valid super-blocks, fp16 d (and dmin) in [2^-9, 2^-7)
        data = torch.randint(0, 256, (n, k // 256, BLOCK_BYTES[wq]), generator=g, dtype=torch.uint8)
        f16 = (torch.rand(n, k // 256, 2, generator=g) * 2**-8 + 2**-9).half().view(torch.uint8)
        if wq == "q6_k":
            data[..., 208:210] = f16[..., :2]
        else:
            data[..., 0:4] = f16
        return QuantWeight(data.reshape(n, -1).contiguous(), wq, (n, k))
    t = torch.randn(n, k, generator=g) * 0.08
    if wq in ("q4_0", "q8_0"):
        return quantize_ref(t, wq)
    return t.to({"fp32": torch.float32, "bf16": torch.bfloat16}[wq])


def _moe(dtype: torch.dtype, wq: str, top_k: int, weights_fp32: bool, use_c: bool, seed: int = 0) -> MoE:
    g = torch.Generator().manual_seed(seed)
    arch = MoeArch(num_experts=E, top_k=top_k, norm_topk_prob=True, weights_fp32=weights_fp32,
                   intermediate_size=I)
    experts = [([_w(I, H, wq, g), _w(I, H, wq, g)], _w(H, I, wq, g)) for _ in range(E)]
    lw = LayerWeights(qkv=[], o=torch.empty(0), router=torch.randn(E, H, generator=g).to(dtype),
                      experts=experts)
    return MoE(arch, lw, dtype, use_c=use_c)


def _x(T: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("T", [1, 3, 17, 40])
@pytest.mark.parametrize("wq", ["fp32", "bf16", "q4_0", "q8_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_matches_python(dtype: torch.dtype, wq: str, T: int) -> None:
    """Both C++ schedules equal the Python loop (on two threads at least: one thread always
    takes the loop): the default (experts side by side while none has more than 32 tokens:
    all but T 40 at top-8, where each of the 8 experts gets all 40), each expert's GEMMs on
    every thread (``parallel_rows=0``) and side by side at any size."""
    ops = Kernels()
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        _c_matches_python(ops, dtype, wq, T)
    finally:
        torch.set_num_threads(threads)


def _c_matches_python(ops: Kernels, dtype: torch.dtype, wq: str, T: int) -> None:
    for top_k, fp32w in ((1, True), (2, False), (8, True), (8, False)):
        c, py = _moe(dtype, wq, top_k, fp32w, True), _moe(dtype, wq, top_k, fp32w, False)
        default = c._c_moe(ops)
        assert default is not None  # the C++ path really runs
        x = _x(T, dtype)
        want = py(x, ops)
        specs = [(gu.c_spec(), d.c_spec()) for gu, d in c.experts]
        for rows in (None, 0, 10**6):
            c._c_experts = default if rows is None else ops.c.MoeExperts(
                [a for a, _ in specs], [b for _, b in specs], rows)
            got = c(x, ops)
            assert got.dtype == dtype
            assert torch.equal(got, want), (rows, top_k, fp32w, (got.float() - want.float()).abs().max())


def test_parallel_rows_must_not_be_negative() -> None:
    ops = Kernels()
    c = _moe(torch.float32, "q8_0", 2, True, True)
    c._c_moe(ops)
    specs = [(gu.c_spec(), d.c_spec()) for gu, d in c.experts]
    with pytest.raises(RuntimeError, match="parallel_rows"):
        ops.c.MoeExperts([a for a, _ in specs], [b for _, b in specs], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance(dtype: torch.dtype) -> None:
    """Token 0 alone == token 0 among others that share its experts (duplicates of it and
    random rows), and == among tokens whose experts are all distinct from its own."""
    ops = Kernels()
    m = _moe(dtype, "q8_0", 2, False, True)
    x = _x(17, dtype)
    alone = m(x[:1], ops)
    batch = torch.cat([x[:1], x[1:8], x[:1], x[8:]])  # 18 rows, row 8 == row 0
    out = m(batch, ops)
    assert torch.equal(out[0], alone[0]) and torch.equal(out[8], alone[0])
    # distinct experts: route by hand (ids/weights as MoE.route gives them)
    c = m._c_moe(ops)
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(3)).to(dtype)
    ids = torch.tensor([[6, 7], [0, 1], [2, 3], [4, 5], [1, 0]])
    solo = c.forward(x[:1], ids[:1], w[:1])
    mixed = c.forward(x[:5], ids, w)
    assert torch.equal(mixed[0], solo[0])
    assert not torch.equal(mixed[1], torch.zeros_like(mixed[1]))
