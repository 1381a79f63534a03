"""Checks shared by the kernel tests (tests/unit/test_kernel_*.py, test_decoder.py)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence

import pytest
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


def quant_weight(N: int, K: int, qtype: str, seed: int = 0):
    """A random [N, K] weight quantised to ``qtype`` (``quantize_ref``), reproducible per
    (N, K, seed); its first 32-block is shifted by 0.3 (an offset block: Q4_1's m matters)."""
    from tokenserve.ops.quant import quantize_ref

    g = torch.Generator().manual_seed(seed * 7919 + N * 31 + K)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    w[:, :32] += 0.3
    return quantize_ref(w, qtype)


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


def assert_releases_gil(call: Callable[[], object], min_ms: float = 20.0) -> None:
    """``call`` (one long kernel call) lets other Python threads run while it computes.

    A worker thread makes the call while this thread keeps taking timestamps; some must
    fall strictly inside the call. With the GIL held none can: a thread inside C++ code
    never hands the GIL over, so this thread would be blocked until the call returns."""
    span: list[float] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def work() -> None:
        try:
            t0 = time.perf_counter()
            call()
            span.extend((t0, time.perf_counter()))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
        finally:
            done.set()

    stamps = [0.0]  # at most one per 0.1 ms (memory stays bounded however long the call)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)  # GIL hand-overs within 0.5 ms, not 5
    try:
        worker = threading.Thread(target=work)
        worker.start()
        while not done.is_set():
            now = time.perf_counter()
            if now - stamps[-1] > 1e-4:
                stamps.append(now)
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    t0, t1 = span
    assert (t1 - t0) * 1e3 >= min_ms, f"the call took {(t1 - t0) * 1e3:.1f} ms: too short to tell"
    # between t0 and the call, and between its return and t1, this thread may hold the GIL
    # for a switch interval or two: leave 3 ms at both ends
    inside = sum(t0 + 3e-3 < s < t1 - 3e-3 for s in stamps)
    assert inside >= 20, f"only {inside} timestamps while the call ran: it holds the GIL"


def inner_loop_params(c) -> list:
    """The inner loops a block-quantised GEMM (csrc/quant.cpp, csrc/quant_k.cpp) can take, as
    pytest params for an indirect ``isa`` fixture, skipped where this CPU lacks one."""
    f = c.cpu_features() if c is not None and hasattr(c, "cpu_features") else {}
    return [pytest.param("avx512vnni", id="avx512vnni", marks=[] if f.get("avx512vnni") else
                         [pytest.mark.skip(reason="this CPU has no AVX-512 VNNI")]),
            pytest.param("avx2", id="avx2", marks=[] if f.get("avx2_fma") else
                         [pytest.mark.skip(reason="this CPU has no AVX2+FMA")]),
            pytest.param("portable", id="portable")]
