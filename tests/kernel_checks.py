"""Checks shared by the GEMM kernel tests (tests/unit/test_kernel_quant*.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def activations(M: int, K: int, dtype: torch.dtype = torch.float32, seed: int = 1,
                zero_block: bool = True) -> torch.Tensor:
    """[M, K] random activations, reproducible per (M, K, seed); with ``zero_block`` and
    M > 1 the middle row's first 32 values are 0 (an all-zero block: its scale is 0)."""
    g = torch.Generator().manual_seed(seed * 104729 + M * 13 + K)
    x = torch.randn(M, K, generator=g)
    if zero_block and M > 1:
        x[M // 2, :32] = 0.0
    return x.to(dtype)


def assert_rows_invariant(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                          batch_sizes: Sequence[int]) -> None:
    """Bit for bit: each row of ``gemm(x)`` equals that row computed alone, in the first m
    rows for every m in ``batch_sizes``, in reverse row order, and at 1 and 2 threads."""
    alone = torch.cat([gemm(x[i:i + 1]) for i in range(x.shape[0])])
    for m in batch_sizes:
        assert torch.equal(gemm(x[:m]), alone[:m]), m
    assert torch.equal(gemm(x.flip(0)), alone.flip(0))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(gemm(x), alone), f"{n} threads"
    finally:
        torch.set_num_threads(threads)
