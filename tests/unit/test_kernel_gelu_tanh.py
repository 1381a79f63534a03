"""csrc/layer_ops.cpp ``gelu_tanh_and_mul`` (Gemma's MLP activation) against its torch
reference ``layer_ref.gelu_tanh_and_mul_ref`` (``F.gelu(g, approximate="tanh") * u`` in fp32,
one rounding).

The kernel computes the same function as ``g / (1 + exp(-2c (g + 0.044715 g^3)))``
(``0.5 (1 + tanh(v)) = sigmoid(2 v)``): within 1e-5 relative of the float64 truth everywhere
but fp32's underflow, and within 1e-5 absolute of the reference (torch's fp32 ``1 + tanh``
cancels for negative g: 30% relative error at g = -4, 0 below about -5, where the kernel keeps
the small true value); bf16 within 1 bf16 ulp of it. The AVX-512 path gives the AVX2 bits; a
row's bits do not depend on the batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests import kernel_checks as kc
from tokenserve.ops.dispatch import Kernels, load_kernels
from tokenserve.ops.layer_ref import gelu_tanh_and_mul_ref

C = load_kernels()
pytestmark = pytest.mark.skipif(C is None or not hasattr(C, "gelu_tanh_and_mul"),
                                reason="tokenserve._C (gelu_tanh_and_mul) not built")

DTYPES = [torch.bfloat16, torch.float32]


path = kc.layer_ops_path_fixture(C)


def _truth(x: torch.Tensor) -> torch.Tensor:
    """float64 ``gelu_tanh(g) * u`` in the sigmoid form (float64's own ``1 + tanh`` cancels
    below g ~ -8)."""
    g, u = x.double().chunk(2, dim=-1)
    v = math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)
    return g * torch.sigmoid(2 * v) * u


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [0, 1, 3, 17, 300])
@pytest.mark.parametrize("I", [1536, 37, 8, 1])
def test_gelu_tanh_and_mul_matches_reference(path, dtype, T, I):
    x, out, ref = kc.act_and_ref(C, "gelu_tanh_and_mul", gelu_tanh_and_mul_ref, T, I, dtype)
    # bf16: one rounding of nearly the same fp32 value (1 bf16 ulp at most)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out, ref, rtol=rtol, atol=1e-5)
    if dtype == torch.float32 and path != "portable":  # the exp8 polynomial, std::exp aside
        # atol: fp32's underflow
        torch.testing.assert_close(out.double(), _truth(x), rtol=1e-5, atol=1e-30)


def test_gelu_tanh_keeps_the_negative_tail():
    """Where torch's fp32 ``1 + tanh`` cancels (to 0 below g ~ -5) the kernel keeps the value."""
    g = torch.tensor([-4.0, -5.5, -7.0, -9.0])
    x = torch.cat((g, torch.ones(4))).view(1, 8)
    out, ref = torch.empty(1, 4), torch.empty(1, 4)
    C.gelu_tanh_and_mul(out, x)
    gelu_tanh_and_mul_ref(ref, x)
    truth = _truth(x)[0]
    assert (ref[0, 1:] == 0).all() and (out[0] != 0).all()
    torch.testing.assert_close(out[0].double(), truth, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_avx512_is_avx2(dtype):
    """The AVX-512 path is the AVX2 one on 16 lanes: the same bits, body and tail
    (I = 1536 + 13), NaN, inf and large |g| included."""
    x, o = kc.assert_act_avx512_is_avx2(C, "gelu_tanh_and_mul", dtype)
    # the special values as torch has them: gelu(inf) = inf, gelu(-inf) = NaN, gelu(100) = 100
    o = o.float()
    assert o[0, 0].isnan() and o[0, 1] == float("inf") * x[0, 1550].float()
    assert o[0, 2].isnan() and o[0, 3] == (100.0 * x[0, 1552].float()).to(dtype).float()


@pytest.mark.parametrize("T", [1, 300])
def test_gelu_tanh_and_mul_row_invariance(T):
    """A row's output is bit-identical alone or inside a batch (any T, any thread split)."""
    x = kc.layer_rows(T, 2 * 1536, torch.bfloat16, seed=13, scale=3.0)
    kc.assert_act_row_invariant(C, "gelu_tanh_and_mul", x)


def test_gelu_tanh_and_mul_rejects_bad_arguments():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="out must be"):
        C.gelu_tanh_and_mul(torch.empty(3, 3), x)
    with pytest.raises(RuntimeError, match=r"\[T, 2\*I\]"):
        C.gelu_tanh_and_mul(torch.empty(3, 3), torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="contiguous"):
        C.gelu_tanh_and_mul(torch.empty(8, 1), torch.randn(2, 8).t())


def test_dispatch_runs_the_kernel_or_the_reference():
    x = kc.layer_rows(5, 2 * 40, torch.bfloat16, seed=3, scale=3.0)
    ref = torch.empty(5, 40, dtype=torch.bfloat16)
    gelu_tanh_and_mul_ref(ref, x)
    assert torch.equal(Kernels(use_c=False).gelu_tanh_and_mul(x), ref)
    ours = torch.empty(5, 40, dtype=torch.bfloat16)
    C.gelu_tanh_and_mul(ours, x)
    assert torch.equal(Kernels().gelu_tanh_and_mul(x), ours)
