"""Micro-benchmark: fused C++ sampling (``tokenserve._C.sample``) vs the pure-torch
reference (``tokenserve.ops.sampling.sample_tensors_ref``) on the same packed batch.

    python bench/kernels_sampling.py

Shapes: batch 64 x vocab 49152 (SmolLM2), float32 logits ~ N(0, 3^2) with a few boosted
ids per row (LM-like), history of 200 ids per row. Cases: top-k 50 + top-p 0.9 +
repetition penalty 1.1 (the target: C++ >= 5x the reference), greedy only, plain
temperature 0.8. Times are the median of ``repeats`` calls, milliseconds per batch.
"""

from __future__ import annotations

import statistics
import time

import torch

from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.sampling import pack_batch, sample_tensors_ref
from tokenserve.sampling_params import SamplingParams

CASES = {
    "topk50_topp0.9_rep1.1": {"do_sample": True, "top_k": 50, "top_p": 0.9,
                              "repetition_penalty": 1.1},
    "greedy": {"do_sample": False},
    "temperature0.8": {"do_sample": True, "temperature": 0.8},
}


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench(batch: int = 64, vocab: int = 49152, history: int = 200,
          repeats: int = 5) -> list[dict]:
    """One dict per case: ``{case, batch, vocab, ref_ms, cpp_ms, speedup, same_tokens}``
    (``cpp_ms``/``speedup`` None when the extension is absent)."""
    C = load_kernels()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    hot = torch.randint(0, vocab, (batch, 8), generator=gen)
    logits.scatter_add_(1, hot, torch.rand(batch, 8, generator=gen) * 12)
    hists = [torch.randint(0, vocab, (history,), generator=gen).tolist() for _ in range(batch)]
    uniforms = torch.rand(batch, generator=gen)
    rows = []
    for name, kw in CASES.items():
        params = [SamplingParams(seed=0, **kw) for _ in range(batch)]
        packed = pack_batch(params, hists, [history // 2] * batch, vocab)
        ref_ms = _median_ms(lambda: sample_tensors_ref(logits, *packed, uniforms), repeats)
        row = {"case": name, "batch": batch, "vocab": vocab, "ref_ms": round(ref_ms, 3),
               "cpp_ms": None, "speedup": None, "same_tokens": None}
        if C is not None:
            cpp_ms = _median_ms(lambda: C.sample(logits, *packed, uniforms), max(repeats, 20))
            same = torch.equal(C.sample(logits, *packed, uniforms),
                               sample_tensors_ref(logits, *packed, uniforms))
            row.update(cpp_ms=round(cpp_ms, 3), speedup=round(ref_ms / cpp_ms, 1),
                       same_tokens=same)
        rows.append(row)
    return rows


if __name__ == "__main__":
    print(f"torch threads: {torch.get_num_threads()}")
    for r in bench():
        print(r)
