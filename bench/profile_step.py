"""Where one engine step's time goes: the real model, synthetic decode (or prefill) batches.

    python -m bench.profile_step [--model PATH|FILE.gguf] [--batch 1,16,64] [--context 160]
                                 [--prefill 0] [--dtype bfloat16] [--steps 5] [--no-c] [--bound]

Builds the model (the default one unless ``--model``; a GGUF runs on its own blocks as
served, ``--quantization auto`` by default; ``none`` profiles its dequantised bf16
weights) and a ModelRunner, fills the KV cache of ``batch`` requests to ``context`` tokens
(one prefill step), then times ``steps`` decode steps. Every kernel call (``Kernels``
methods), every GEMM (by layer role) and the sampler are wrapped with a timer, so the table
splits a step into: GEMMs by role, attention, rope + KV write, norms, activation, sampling,
and the rest (metadata, Python, embedding). ``--prefill N`` times
one N-token prefill per request instead of decodes. Prints the CPU model and flags too.

``--bound`` adds, at batch 1, the memory-bandwidth bound of a decode step: the bytes of
weights one token reads (:func:`decode_weight_bytes`) over this machine's read rate measured
in the same run (:func:`read_rate_gbs`), and the fused step's time as a fraction of it
(issue 42: "batch 1 within 80 % of the bandwidth bound").
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import torch

from tokenserve.loadgen.server import lscpu_text, parse_lscpu


def cpu_summary() -> str:
    """``lscpu`` model name, the thread count and the SIMD flags
    (:data:`tokenserve.loadgen.server.SIMD_FLAGS`) present."""
    info = parse_lscpu(lscpu_text())
    return (f"{info['model'] or '?'}, {torch.get_num_threads()} threads, "
            f"flags: {' '.join(f for f, on in info['flags'].items() if on)}")


def decode_weight_bytes(model) -> tuple[int, str]:
    """(bytes of weights one decode token reads, how they were counted): every projection's
    packed bytes (``Linear.nbytes``), the lm_head once; in a mixture-of-experts layer the
    router, the shared expert and ``top_k`` experts of mean size (which ones a token picks
    varies; their sizes do not). The embedding lookup (one row) and the norms are left out
    (under 0.1 %)."""
    from tokenserve.ops.linear import leaf_linears

    def nbytes(lins) -> int:
        return sum(lin.nbytes for lin in leaf_linears(lins))

    total, moe = nbytes([model.lm_head]), 0
    for layer in model.layers:
        total += nbytes([layer["qkv"], layer["o"]])
        if "moe" not in layer:
            total += nbytes([layer["gate_up"], layer["down"]])
            continue
        m = layer["moe"]
        experts = [nbytes(list(pair)) for pair in m.experts]
        total += nbytes([m.router, *(m.shared or ())])
        total += round(m.arch.top_k * sum(experts) / len(experts))
        moe += 1
    how = (f"lm_head + attention + MLP; {moe} MoE layers at top_k of {len(m.experts)} experts"
           if moe else "lm_head + attention + MLP")
    return total, how


def read_rate_gbs(mib: int = 1024, repeats: int = 7) -> float:
    """This machine's memory read rate (GB/s, 1e9 bytes): the best of ``repeats`` fp32 sums
    (``torch.sum``, vectorised, on ``torch.get_num_threads()`` threads) over ``mib`` MiB on
    huge pages (as the packed weights live), far beyond any cache."""
    from tokenserve.ops.host_memory import zeros_on_huge_pages

    x = zeros_on_huge_pages(((mib << 20) // 4,), torch.float32)
    x.add_(1.0)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


class Timers:
    """Accumulated wall time (ms) per label."""

    def __init__(self) -> None:
        self.ms: collections.Counter[str] = collections.Counter()

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.ms[label] += (time.perf_counter() - t) * 1e3
        return timed


def instrument(runner, timers: Timers) -> None:
    """Wrap the runner's model kernels, GEMMs and sampler with timers (in place)."""
    import tokenserve.engine.model_runner as mr

    model = runner.model
    ops = model.kernels
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding_write_kv",
                 "paged_attention", "positions_and_slots"):
        setattr(ops, name, timers.wrap(name, getattr(ops, name)))
    for layer in model.layers:
        for role, lin in list(layer.items()):
            if callable(lin) and not isinstance(lin, torch.Tensor):  # GEMMs (not norms)
                layer[role] = timers.wrap(f"gemm {role}", lin)
    model.lm_head = timers.wrap("gemm lm_head", model.lm_head)
    mr.sample = timers.wrap("sampling", mr.sample)


def uninstrument(runner, model) -> None:
    """Undo :func:`instrument` (the timers are instance attributes over class methods)."""
    import tokenserve.engine.model_runner as mr

    ops = model.kernels
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding_write_kv",
                 "paged_attention", "positions_and_slots"):
        vars(ops).pop(name, None)
    for layer in model.layers:
        for role, lin in list(layer.items()):
            layer[role] = getattr(lin, "__wrapped__", lin)
    model.lm_head = model.lm_head.__wrapped__
    mr.sample = mr.sample.__wrapped__


def main() -> None:
    from tokenserve.engine.model_runner import ModelRunner
    from tokenserve.messages import ScheduledSeq, SeqStart, StepPlan
    from tokenserve.models.decoder import CausalLM
    from tokenserve.models.loader import load_config, load_weights, resolve_model
    from tokenserve.ops.dispatch import Kernels
    from tokenserve.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model dir or .gguf (default: the default model)")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--no-c", action="store_true", help="torch references only")
    ap.add_argument("--quantization", default="auto", choices=["none", "gguf", "auto"],
                    help="gguf: a GGUF model's own blocks (Q4_0/Q4_1/Q8_0, Q4_K/Q5_K/Q6_K); "
                         "none: dequantised to --dtype; auto (default): as a server with "
                         "--max-batch-size the largest --batch resolves it "
                         "(models/loader.py resolve_quantization)")
    ap.add_argument("--bound", action="store_true",
                    help="at batch 1: the step against the memory-bandwidth bound")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "model"],
                    help="the KV cache's rows (CausalLM.kv_cache_dtype; auto as the "
                         "server: int8 on a CPU with the C++ kernels at bfloat16)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    d = resolve_model(args.model)
    cfg = load_config(d)
    batches = [int(b) for b in args.batch.split(",")]
    # auto: as a server whose --max-batch-size is the largest batch profiled
    weights = load_weights(d, dtype, args.quantization, model=args.model,
                           max_batch_size=max(batches))
    model = CausalLM.from_state_dict(cfg, weights, dtype,
                                             torch.device("cpu"), Kernels(use_c=not args.no_c))
    print(f"# {cpu_summary()}")
    kv_dtype = model.kv_cache_dtype(args.kv_cache_dtype)
    print(f"# kernels: {model.kernels.describe()}; GEMM: {model.lm_head.backend}; {args.dtype}; "
          f"KV cache {str(kv_dtype).removeprefix('torch.')}")
    bs = args.block_size
    greedy = SamplingParams(do_sample=False, max_new_tokens=1 << 20)
    for batch in batches:
        ctx = args.context + 2 * args.steps + max(args.prefill, 1) + 1  # two timed runs
        per = (ctx + bs - 1) // bs
        runner = ModelRunner(model, num_blocks=batch * per + 1, block_size=bs, kv_dtype=kv_dtype)
        g = torch.Generator().manual_seed(batch)
        hist = [torch.randint(100, 40000, (args.context,), generator=g).tolist()
                for _ in range(batch)]
        tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
        tables = [tuple(t) for t in tables]
        # fill the cache: a prefill of every request (chunks of <= 2048 tokens per step)
        done = 0
        while done < args.context:
            n = min(args.context - done, max(1, 2048 // batch))
            runner.step(StepPlan(0, tuple(
                ScheduledSeq(f"r{i}", tuple(h[done:done + n]), done, t, False, greedy,
                             SeqStart(tuple(h), len(h)) if done == 0 else None)
                for i, (h, t) in enumerate(zip(hist, tables)))))
            done += n
        q = args.prefill or 1

        def run_steps(n_steps: int, hist=hist, tables=tables, q=q, runner=runner) -> float:
            """Mean ms per step over ``n_steps`` steps."""
            total = 0.0
            for step in range(n_steps):
                seqs = []
                for i, (h, t) in enumerate(zip(hist, tables)):
                    if args.prefill:  # q new tokens after the context (the same slots each step)
                        seqs.append(ScheduledSeq(f"r{i}", tuple(h[-1:] * q), args.context, t,
                                                 True, greedy))
                    else:  # one decode token after everything computed so far
                        seqs.append(ScheduledSeq(f"r{i}", tuple(h[-1:]), len(h) - 1, t, True,
                                                 greedy))
                t0 = time.perf_counter()
                res = runner.step(StepPlan(step, tuple(seqs)))
                total += (time.perf_counter() - t0) * 1e3
                if not args.prefill:
                    for i, h in enumerate(hist):
                        h.append(res.sampled[f"r{i}"])
            return total / n_steps

        fused = None
        if model.decoder is not None:  # the whole step as served: layers looped in C++
            fused = run_steps(args.steps)
        decoder, model.decoder = model.decoder, None  # per-kernel timers need the Python loop
        timers = Timers()
        instrument(runner, timers)
        step_ms = run_steps(args.steps)
        model.decoder = decoder
        uninstrument(runner, model)
        toks = batch * q
        kind = f"prefill {q}" if args.prefill else "decode"
        if fused is not None:
            print(f"\n## batch {batch}, context {args.context}, {kind}, csrc/decoder.cpp: "
                  f"{fused:.1f} ms/step, {toks / fused * 1e3:.0f} tok/s")
        if args.bound and batch == 1 and not args.prefill:
            nbytes, how = decode_weight_bytes(model)
            rate = read_rate_gbs()
            bound = nbytes / rate / 1e6
            step = fused if fused is not None else step_ms
            print(f"\n## bandwidth bound, batch 1: {nbytes / 2**20:.0f} MiB of weights a token "
                  f"({how}); read rate {rate:.1f} GB/s (fp32 sum of 1 GiB on huge pages, "
                  f"{torch.get_num_threads()} threads, best of 7); bound {bound:.1f} ms/step; "
                  f"the step {step:.1f} ms = {bound / step:.0%} of the bound's speed")
        print(f"\n## batch {batch}, context {args.context}, {kind}, Python layer loop "
              f"(timed per kernel): {step_ms:.1f} ms/step, {toks / step_ms * 1e3:.0f} tok/s")
        print("| part | ms/step | share |\n|---|---|---|")
        accounted = 0.0
        for label, ms in sorted(timers.ms.items(), key=lambda kv: -kv[1]):
            ms /= args.steps
            accounted += ms
            print(f"| {label} | {ms:.2f} | {ms / step_ms:.0%} |")
        rest = step_ms - accounted
        print(f"| rest (metadata, embedding, Python) | {rest:.2f} | {rest / step_ms:.0%} |")


if __name__ == "__main__":
    main()
