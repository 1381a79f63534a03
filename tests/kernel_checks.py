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


def act_rounding_bound(x: torch.Tensor, w: torch.Tensor, qmax: int, block: int = 32) -> torch.Tensor:
    """[M, N] bound on |x_q @ w.T - x @ w.T| from quantising x's activations per ``block``
    elements to ``qmax`` levels (``quantize_act_ref`` per 32-block; ``quantize_act_k_ref``,
    block 256, qmax 127, for the k-quants): each element moves by at most d / 2, so a block
    adds at most (d / 2) * sum_k |w_k|; times 1.01 for the fp32 accumulation.
    x: [M, K] float; w: [N, K] the dequantised weight. Callers add their output rounding."""
    from tokenserve.ops.quant import quantize_act_k_ref, quantize_act_ref

    if block == 32:
        _, dx, _ = quantize_act_ref(x, qmax)
    else:
        assert block == 256 and qmax == 127, (block, qmax)
        _, dx, _ = quantize_act_k_ref(x)
    wabs = w.float().abs().reshape(w.shape[0], -1, block).sum(-1)  # [N, K / block]
    return (dx / 2) @ wabs.T * 1.01


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


# --------------------------------------------------------------------- csrc/layer_ops.cpp
# The forced paths and the act-and-mul checks (silu_and_mul, gelu_tanh_and_mul) shared by
# test_kernel_layer_ops.py and test_kernel_gelu_tanh.py.

LAYER_OPS_PATHS = ("vector", "avx2", "portable")


class ForcedLayerOps:
    """The layer_ops path of the extension ``C`` forced for a block: "vector" (the machine's
    best: AVX-512 where it has it), "avx2" (AVX2 even on an AVX-512 machine) or "portable"."""

    def __init__(self, C, name: str):
        assert name in LAYER_OPS_PATHS, name
        self.C, self.name = C, name

    def __enter__(self):
        self.old = (self.C._layer_ops_force_portable(self.name == "portable"),
                    self.C._layer_ops_force_avx2(self.name == "avx2"))

    def __exit__(self, *exc):
        self.C._layer_ops_force_portable(self.old[0])
        self.C._layer_ops_force_avx2(self.old[1])


def layer_ops_path_fixture(C):
    """A ``path`` fixture for a test module (``path = layer_ops_path_fixture(C)``): each test
    that takes it runs on the machine's best layer_ops path, then with the AVX2 and the
    portable one forced."""

    @pytest.fixture(params=list(LAYER_OPS_PATHS))
    def path(request):
        with ForcedLayerOps(C, request.param):
            yield request.param

    return path


def layer_rows(T: int, n: int, dtype: torch.dtype, seed: int, scale: float = 1.0,
               strided: bool = False) -> torch.Tensor:
    """[T, n] random rows (``scale`` times standard normal) in ``dtype``, reproducible per
    seed; ``strided``: a view of the first n columns of [T, n + 7] (row stride n + 7)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n + (7 if strided else 0), generator=g) * scale
    x = x.to(dtype)
    return x[:, :n] if strided else x


def act_and_mul(C, op: str, x: torch.Tensor) -> torch.Tensor:
    """``C.<op>(out, x)`` (op: silu_and_mul, gelu_tanh_and_mul) into a new [T, I] ``out``."""
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    getattr(C, op)(out, x)
    return out


def act_and_ref(C, op: str, ref_fn: Callable[[torch.Tensor, torch.Tensor], None], T: int,
                I: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An act-and-mul reference case: x (T rows of 2 * I, 4 times standard normal, seeded by
    T and I), ``C.<op>``'s output (into NaNs: each element must be written) and
    ``ref_fn``'s."""
    x = layer_rows(T, 2 * I, dtype, seed=T * 23 + I, scale=4.0)
    out = torch.full((T, I), float("nan"), dtype=dtype)
    getattr(C, op)(out, x)
    ref = torch.empty_like(out)
    ref_fn(ref, x)
    return x, out, ref


def assert_act_avx512_is_avx2(C, op: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The AVX-512 path of ``C.<op>`` is the AVX2 one on 16 lanes: the same bits, body and
    tail (I = 1536 + 13), NaN, inf and large |g| included. Returns x and the output; x[0, :4]
    (g) is NaN, inf, -inf, 100."""
    x = layer_rows(9, 2 * (1536 + 13), dtype, seed=11, scale=6.0)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 100.0])
    x[1, 1536 + 13: 1536 + 17] = torch.tensor([-100.0, 90.0, -90.0, 0.0])
    outs = []
    for name in ("vector", "avx2"):
        with ForcedLayerOps(C, name):
            outs.append(act_and_mul(C, op, x))
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # NaN == NaN as bits
    assert torch.equal(outs[0].view(bits), outs[1].view(bits))
    return x, outs[0]


def assert_act_row_invariant(C, op: str, x: torch.Tensor) -> None:
    """Bit for bit: rows 0, T // 2 and T - 1 of ``C.<op>(x)`` equal each row computed
    alone (whatever else is in the batch, however the threads split it)."""
    out = act_and_mul(C, op, x)
    T = x.shape[0]
    for t in sorted({0, T // 2, T - 1}):
        assert torch.equal(act_and_mul(C, op, x[t: t + 1].clone())[0], out[t]), t
