"""Micro-benchmark: the decoder-layer kernels (csrc/layer_ops.cpp, csrc/cache_ops.cpp) vs
their pure-torch references, SmolLM2-135M shapes, bf16.

    python -m bench.kernels_layer [threads]   # prints a table; bench() returns the rows

Shapes: hidden 576, H 9, Hkv 3, head_dim 64, intermediate 1536, block_size 128, at
T = 1, 64, 512 tokens. Each timing is the median of repeated calls (microseconds).
"""

from __future__ import annotations

import time

import torch

from tokenserve.ops import layer_ref as ref
from tokenserve.ops.dispatch import load_kernels

HIDDEN, H, HKV, D, INTER, BS = 576, 9, 3, 64, 1536, 128
EPS = 1e-5


def _time_us(fn, min_time: float = 0.2, reps: int = 5) -> float:
    """Median over `reps` batches of the per-call time in microseconds."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_time / reps:
        fn()
        n += 1
    n = max(n, 1)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(times)[len(times) // 2]


def _cases(T: int, dtype: torch.dtype):
    """(name, kernel_fn, reference_fn) for every kernel at T tokens."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, HIDDEN, generator=g).to(dtype)
    res = torch.randn(T, HIDDEN, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype)
    out = torch.empty_like(x)
    gu = torch.randn(T, 2 * INTER, generator=g).to(dtype)
    act = torch.empty(T, INTER, dtype=dtype)
    max_pos = 8192
    cs = ref.rope_cos_sin(1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D), max_pos)
    nb = 2 * ((T + BS - 1) // BS) + 8
    kc = torch.zeros(nb, HKV, BS, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    qkv = torch.randn(T, (H + 2 * HKV) * D, generator=g).to(dtype)
    pos = torch.randint(0, max_pos, (T,), generator=g)
    slots = torch.randperm(nb * BS, generator=g)[:T]
    # positions_and_slots: a decode-like batch of T sequences with 1000-token contexts
    mb = 1000 // BS + 1
    bt = torch.randperm(T * mb + 8, generator=g)[: T * mb].view(T, mb).int()
    qsl = torch.arange(T + 1, dtype=torch.int32)
    ctx = torch.full((T,), 1000, dtype=torch.int32)
    # copy_blocks: 30 layers, min(T, 16) block pairs
    L, ncb = 30, min(T, 16)
    ks = [torch.zeros(2 * ncb + 2, HKV, BS, D, dtype=dtype) for _ in range(L)]
    vs = [torch.zeros_like(k) for k in ks]
    bm = torch.stack([torch.arange(ncb), torch.arange(ncb) + ncb + 1], dim=1)
    C = load_kernels()
    k = (lambda name: getattr(C, name)) if C is not None else None

    def both(name, args_k, args_r):
        return (name, (lambda: k(name)(*args_k)) if k else None,
                lambda: getattr(ref, name + "_ref")(*args_r))

    return [
        both("rms_norm", (out, x, w, EPS), (out, x, w, EPS)),
        both("fused_add_rms_norm", (x, res, w, EPS), (x, res, w, EPS)),
        both("silu_and_mul", (act, gu), (act, gu)),
        both("rotary_embedding_write_kv", (qkv, pos, cs, kc, vc, slots, H, HKV),
             (qkv, pos, cs, kc, vc, slots, H, HKV)),
        both("positions_and_slots", (bt, qsl, ctx, BS), (bt, qsl, ctx, BS)),
        both("copy_blocks", (ks, vs, bm), (ks, vs, bm)),
    ]


def bench(tokens: tuple[int, ...] = (1, 64, 512),
          dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Time every kernel and its reference.

    Returns:
        one dict per (kernel, T): {"kernel", "T", "dtype", "kernel_us", "ref_us", "speedup"}
        (kernel_us and speedup are None when the extension is not built).
    """
    rows = []
    for T in tokens:
        for name, kfn, rfn in _cases(T, dtype):
            # fused_add_rms_norm grows the residual each call: harmless for timing
            kus = _time_us(kfn) if kfn else None
            rus = _time_us(rfn)
            rows.append({"kernel": name, "T": T, "dtype": str(dtype).replace("torch.", ""),
                         "kernel_us": kus, "ref_us": rus,
                         "speedup": (rus / kus) if kus else None})
    return rows


def main() -> None:
    import sys
    if len(sys.argv) > 1:  # optional thread count: python -m bench.kernels_layer 1
        torch.set_num_threads(int(sys.argv[1]))
    print(f"threads={torch.get_num_threads()}  shapes: hidden {HIDDEN}, H {H}, Hkv {HKV}, "
          f"D {D}, inter {INTER}, block {BS}; copy_blocks: 30 layers, min(T,16) pairs; "
          f"positions_and_slots: T seqs x 1000-token context")
    print(f"{'kernel':28s} {'T':>5s} {'kernel us':>10s} {'torch us':>10s} {'speedup':>8s}")
    for r in bench():
        ku = f"{r['kernel_us']:.1f}" if r["kernel_us"] is not None else "-"
        sp = f"{r['speedup']:.1f}x" if r["speedup"] is not None else "-"
        print(f"{r['kernel']:28s} {r['T']:5d} {ku:>10s} {r['ref_us']:10.1f} {sp:>8s}")


if __name__ == "__main__":
    main()
