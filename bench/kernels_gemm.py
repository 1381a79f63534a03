"""Micro-benchmark of the linear layers' GEMM (``csrc/gemm.cpp``) against torch on CPU.

    python bench/kernels_gemm.py [--threads N]

For the SmolLM2-135M shapes (hidden K=576; per layer qkv [960, 576], o [576, 576],
gate_up [3072, 576], down [576, 1536]; lm_head [49152, 576]) and M in (1, 16, 64, 256)
rows, times ``gemm`` (bf16 weights, bf16 x, bf16 out; the lm_head fp32 out) on the layout the
server packs (the AVX512_BF16 pair-dot chain where the CPU has it; then ``ms_ours_fma`` is
the fp32 FMA chain, ``TOKENSERVE_GEMM=c-fma``, for comparison), torch's bf16
``F.linear`` and torch's fp32 ``F.linear`` (fp32 weights: twice the bytes). Also the sum
over one decode step: 30 layers x (qkv + o + gate_up + down) + lm_head on the M rows.
Each time is the best of several runs (the host is shared; the minimum is the least noisy).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tokenserve.ops.dispatch import load_kernels

SHAPES = {  # name: (N, K)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
LAYERS = 30
MS = (1, 16, 64, 256)


_LAST_CPU_MS = [0.0]


def _time_ms(fn, budget_s: float = 0.4, min_reps: int = 3, max_reps: int = 50) -> float:
    """Best wall time of fn in ms (best process CPU time, all threads, in _LAST_CPU_MS)."""
    fn()  # warm-up
    best, best_cpu, spent, reps = float("inf"), float("inf"), 0.0, 0
    while reps < min_reps or (spent < budget_s and reps < max_reps):
        t, c = time.perf_counter(), time.process_time()
        fn()
        dt, dc = time.perf_counter() - t, time.process_time() - c
        best, best_cpu, spent, reps = min(best, dt), min(best_cpu, dc), spent + dt, reps + 1
    _LAST_CPU_MS[0] = best_cpu * 1e3
    return best * 1e3


def bench(ms: tuple[int, ...] = MS, torch_bf16: bool = True) -> list[dict]:
    """Time every shape at every M.

    Args:
        ms: row counts M to run.
        torch_bf16: also time torch's bf16 F.linear (very slow on CPUs without native bf16).

    Returns:
        one dict per (shape, M) plus one ``step`` row per M, with keys ``name``, ``shape``
        ``(M, N, K)``, ``ms_ours``, ``ms_torch_bf16``, ``ms_torch_fp32`` (ms, best run),
        ``cpu_ms_ours`` (best process CPU time of ours, all threads; on a shared host it shows
        the kernel's own cost where the wall time includes waiting for a core),
        ``ratio`` (= ms_torch_fp32 / ms_ours, >1: ours faster), ``gflops_ours`` and
        ``gbps_ours`` (weight bytes read per ms). ``ms_ours`` is None without the extension.

    Raises:
        nothing; a missing extension gives None times for ours.
    """
    C = load_kernels()
    C = C if C is not None and hasattr(C, "gemm") else None
    torch.manual_seed(0)
    rows: list[dict] = []
    for M in ms:
        step = {"ms_ours": 0.0, "cpu_ms_ours": 0.0, "ms_ours_fma": 0.0, "ms_torch_bf16": 0.0,
                "ms_torch_fp32": 0.0}
        for name, (N, K) in SHAPES.items():
            w16 = (torch.randn(N, K) * K ** -0.5).to(torch.bfloat16)
            w32 = w16.float()
            x16 = torch.randn(M, K).to(torch.bfloat16)
            x32 = x16.float()
            out_dtype = torch.float32 if name == "lm_head" else torch.bfloat16
            r = {"name": name, "shape": (M, N, K)}
            r["ms_ours"] = r["cpu_ms_ours"] = r["ms_ours_fma"] = None
            if C is not None:
                out = torch.empty(M, N, dtype=out_dtype)
                for key, pairs in _layouts(C):
                    p = C.gemm_prepack(w16, pairs)
                    r[key] = _time_ms(lambda: C.gemm_out(x16, p, N, None, out))
                    if key == "ms_ours":
                        r["cpu_ms_ours"] = _LAST_CPU_MS[0]
            big = M * N * K > 64 * 49152 * 576
            r["ms_torch_bf16"] = (_time_ms(lambda: F.linear(x16, w16), min_reps=1 if big else 3,
                                           budget_s=0.2) if torch_bf16 else None)
            r["ms_torch_fp32"] = _time_ms(lambda: F.linear(x32, w32))
            mult = 1 if name == "lm_head" else LAYERS
            for k in step:
                step[k] = None if step[k] is None or r[k] is None else step[k] + mult * r[k]
            _finish(r, M * N * K, N * K * 2)
            rows.append(r)
        r = {"name": "step(sum of the above)", "shape": (M, None, None), **step}
        _finish(r, M * STEP_MACS, 2 * STEP_MACS)
        rows.append(r)
        rows.append(_real_step(C, M, torch_bf16))
    return rows


def _layouts(C) -> list[tuple[str, bool]]:
    """(result key, pair layout) for each GEMM chain to time: the server's first."""
    if C.cpu_features().get("avx512bf16", False):
        return [("ms_ours", True), ("ms_ours_fma", False)]
    return [("ms_ours", False)]


STEP_MACS = (LAYERS * sum(n * k for nm, (n, k) in SHAPES.items() if nm != "lm_head")
             + SHAPES["lm_head"][0] * SHAPES["lm_head"][1])  # per row


def _real_step(C, M: int, torch_bf16: bool) -> dict:
    """One decode step's GEMMs over 30 distinct layers' weights (as in the model: the
    weights stream from DRAM, ~270 MB of bf16, instead of staying in cache)."""
    g = torch.Generator().manual_seed(M)
    ws = [(torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
          for _ in range(LAYERS) for nm, (n, k) in SHAPES.items() if nm != "lm_head"]
    ws.append((torch.randn(*SHAPES["lm_head"], generator=g) * 0.04).to(torch.bfloat16))
    xs = {k: torch.randn(M, k, generator=g).to(torch.bfloat16) for k in (576, 1536)}
    r = {"name": "step(real: 30 layers' weights)", "shape": (M, None, None), "ms_ours": None,
         "cpu_ms_ours": None, "ms_ours_fma": None}
    if C is not None:
        outs = [torch.empty(M, w.shape[0], dtype=torch.bfloat16 if i < len(ws) - 1 else torch.float32)
                for i, w in enumerate(ws)]
        for key, pairs in _layouts(C):
            ps = [C.gemm_prepack(w, pairs) for w in ws]

            def ours():
                for w, p, o in zip(ws, ps, outs):
                    C.gemm_out(xs[w.shape[1]], p, w.shape[0], None, o)
            r[key] = _time_ms(ours, budget_s=1.0, min_reps=3, max_reps=10)
            if key == "ms_ours":
                r["cpu_ms_ours"] = _LAST_CPU_MS[0]
            del ps

    def run(wl, xd):
        def f():
            for w in wl:
                F.linear(xd[w.shape[1]], w)
        return f
    r["ms_torch_bf16"] = (_time_ms(run(ws, xs), budget_s=0.5, min_reps=1, max_reps=3)
                          if torch_bf16 else None)
    w32 = [w.float() for w in ws]
    x32 = {k: v.float() for k, v in xs.items()}
    r["ms_torch_fp32"] = _time_ms(run(w32, x32), budget_s=1.0, min_reps=3, max_reps=10)
    _finish(r, M * STEP_MACS, 2 * STEP_MACS)
    return r


def _finish(r: dict, macs: int, wbytes: int) -> None:
    o = r["ms_ours"]
    r["ratio"] = None if o is None else r["ms_torch_fp32"] / o
    r["ratio_bf16"] = None if o is None or r["ms_torch_bf16"] is None else r["ms_torch_bf16"] / o
    r["gflops_ours"] = None if o is None else 2 * macs / o / 1e6
    r["gbps_ours"] = None if o is None else wbytes / o / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-torch-bf16", action="store_true", help="skip torch's bf16 F.linear")
    ap.add_argument("--m", type=int, nargs="*", default=list(MS))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"# threads={torch.get_num_threads()}  ms = best run; x32 = torch fp32 / ours, "
          f"x16 = torch bf16 / ours; GF/s, GB/s (bf16 weight bytes) of ours from wall ms; "
          f"cpu_ms = ours' best process CPU time (all threads)")
    f = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"
    print(f"{'name':31s} {'M':>4s} {'N':>6s} {'K':>5s} {'ours':>9s} {'torch16':>9s} "
          f"{'torch32':>9s} {'x32':>6s} {'x16':>6s} {'GF/s':>6s} {'GB/s':>6s} {'cpu_ms':>9s} "
          f"{'fma':>9s}")
    for r in bench(tuple(a.m), not a.no_torch_bf16):
        M, N, K = r["shape"]
        print(f"{r['name']:31s} {M:4d} {N or '':>6} {K or '':>5} {f(r['ms_ours']):>9s} "
              f"{f(r['ms_torch_bf16']):>9s} {f(r['ms_torch_fp32']):>9s} {f(r['ratio'], 2):>6s} "
              f"{f(r['ratio_bf16'], 2):>6s} {f(r['gflops_ours'], 1):>6s} {f(r['gbps_ours'], 1):>6s} "
              f"{f(r['cpu_ms_ours']):>9s} {f(r['ms_ours_fma']):>9s}")


if __name__ == "__main__":
    main()
