"""Micro-benchmark of the quantised GEMMs (``csrc/quant.cpp`` with ``csrc/quant_amx_int.cpp``,
``csrc/quant_amx.cpp``) against our bf16 GEMM.

    python bench/kernels_quant.py [--ms 1,16,64] [--qtype q4_1] [--fixed-cost]
    python -m bench.kernels quant

One decode step's GEMMs of SmolLM2-135M with the default GGUF's formats: 30 layers x (qkv
[960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536]) in ``--qtype`` (Q4_1 in the
file) plus the tied lm_head [49152, 576] in Q8_0 (fp32 logits), against the same shapes as
bf16 ``gemm``. Every layer has its own weights, so the step streams them from memory as a
real one does (92 MB quantised, 270 MB bf16). On a CPU with AMX-INT8 tiles a row per M
times the default step (``quant_gemm``: AMX-INT8 tiles from 16 rows) against the VNNI tiles
alone (``ms_ref``; the same bits), and with AMX-BF16 another the step on ``quant_amx_gemm``
(opt-in, t16 layout, other bits) against the default. Times are the best of several runs (the
host is shared; the minimum is the least noisy). Weights are random, quantised with
``gguf.quants.quantize`` (llama.cpp's reference quantisers).
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.linear import amx_available, amx_int8_available
from tokenserve.ops.quant import quantize_ref, repack_x8
from tokenserve.ops.quant_blocks import QTYPE_IDS, repack_t16

LAYER_SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536))
VOCAB, HIDDEN, LAYERS = 49152, 576, 30
MS = (1, 16, 64)


def _best_ms(fn, reps: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def bench(ms: tuple[int, ...] = MS, qtype: str = "q4_1") -> list[dict]:
    """One ``step`` row per M: ``ms_ours`` (quantised), ``ms_bf16`` (our bf16 GEMM in the
    layout the server uses here: pair-dot on AVX512_BF16 CPUs, else the FMA chain), ratio
    bf16 / quantised (> 1: quantised faster), and the weight bytes each streams; on an
    AVX-512 VNNI CPU also a row of the VNNI tiles against the AVX2 tiles (``ms_ref``)."""
    c = load_kernels()
    if c is None or not hasattr(c, "quant_gemm") or not hasattr(c, "gemm"):
        raise RuntimeError("tokenserve._C with quant_gemm and gemm is not built")
    g = torch.Generator().manual_seed(0)
    vnni = bool(c.cpu_features().get("avx512vnni")) and hasattr(c, "_quant_force_avx2")
    amx = amx_available(c)
    amx_int = amx_int8_available(c)
    # the bf16 layout the server uses on this CPU: k pairs (vdpbf16ps) where it has
    # AVX512_BF16, else the FMA chain's panels
    pairs = bool(c.cpu_features().get("avx512bf16"))

    def rand(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=g) * k ** -0.5

    q_layers, b_layers, t_layers = [], [], []
    for _ in range(LAYERS):
        ws = [(rand(n, k), n) for _, n, k in LAYER_SHAPES]
        q_layers.append([(repack_x8(quantize_ref(w, qtype)), n) for w, n in ws])
        if amx:
            t_layers.append([(repack_t16(w), n) for w, n in q_layers[-1]])
        b_layers.append([(c.gemm_prepack(w.bfloat16(), pairs), n) for w, n in ws])
    head = rand(VOCAB, HIDDEN)
    q_head = repack_x8(quantize_ref(head, "q8_0"))
    t_head = repack_t16(q_head) if amx else None
    b_head = c.gemm_prepack(head.bfloat16(), pairs)
    q_bytes = sum(w.nbytes for layer in q_layers for w, _ in layer) + q_head.nbytes
    b_bytes = sum(p.numel() * 2 for layer in b_layers for p, _ in layer) + b_head.numel() * 2
    rows = []
    for m in ms:
        x = torch.randn(m, HIDDEN, generator=g).bfloat16()
        x2 = torch.randn(m, 1536, generator=g).bfloat16()
        ins = (x, x, x, x2)

        def q_step(x=x, ins=ins) -> None:
            for layer in q_layers:
                for (w, n), xi in zip(layer, ins):
                    c.quant_gemm(xi, w.data, QTYPE_IDS[w.qtype], n, None, None)
            c.quant_gemm(x, q_head.data, QTYPE_IDS["q8_0"], VOCAB, None, torch.float32)

        def b_step(x=x, ins=ins) -> None:
            for layer in b_layers:
                for (p, n), xi in zip(layer, ins):
                    c.gemm(xi, p, n, None, None)
            c.gemm(x, b_head, VOCAB, None, torch.float32)

        tq, tb = _best_ms(q_step), _best_ms(b_step)
        rows.append({"name": "step", "shape": (m, f"{qtype}+q8_0 head", HIDDEN), "ms_ours": tq,
                     "ms_bf16": tb, "ratio": tb / tq, "MB_ours": q_bytes / 1e6,
                     "MB_bf16": b_bytes / 1e6})
        # the default (AVX-512 VNNI tiles, AMX-INT8 from 16 rows) against the AVX2 tiles and
        # against the VNNI tiles alone (test hooks; the same bits)
        for on, hook, value, name in ((vnni, "_quant_force_avx2", True, "default vs avx2 tiles"),
                                      (amx_int, "_quant_amx_rows", 1 << 40,
                                       "vnni+amx_int8 vs avx512vnni tiles")):
            if on:
                old = getattr(c, hook)(value)
                try:
                    tr = _best_ms(q_step)
                finally:
                    getattr(c, hook)(old)
                rows.append({"name": f"step {name}", "shape": (m, f"{qtype}+q8_0 head", HIDDEN),
                             "ms_ours": tq, "ms_ref": tr, "ratio": tr / tq})
        if amx:  # the opt-in AMX-BF16 tiles (other bits) against the default
            def t_step(x=x, ins=ins) -> None:
                for layer in t_layers:
                    for (w, n), xi in zip(layer, ins):
                        c.quant_amx_gemm(xi, w.data, QTYPE_IDS[w.qtype], n, None, None)
                c.quant_amx_gemm(x, t_head.data, QTYPE_IDS["q8_0"], VOCAB, None, torch.float32)

            tt = _best_ms(t_step)
            rows.append({"name": "step amx_bf16 vs default",
                         "shape": (m, f"{qtype}+q8_0 head", HIDDEN), "ms_ours": tt,
                         "ms_ref": tq, "ratio": tq / tt})
    return rows


def fixed_cost_us(qtype: str = "q4_1", n: int = 64, k: int = HIDDEN, calls: int = 5000) -> float:
    """Microseconds per ``quant_gemm`` call at M = 1 on a small [n, k] weight that stays in
    cache (bf16 activations, as the decoder passes them): the per-call cost a batch-1 step
    pays ~120 times (argument checks, activation quantisation, output allocation, the
    parallel region), best of 7 loops of ``calls`` calls from Python."""
    c = load_kernels()
    if c is None or not hasattr(c, "quant_gemm"):
        raise RuntimeError("tokenserve._C with quant_gemm is not built")
    g = torch.Generator().manual_seed(0)
    w = repack_x8(quantize_ref(torch.randn(n, k, generator=g), qtype)).data
    x = torch.randn(1, k, generator=g).bfloat16()
    qid = QTYPE_IDS[qtype]

    def loop() -> None:
        for _ in range(calls):
            c.quant_gemm(x, w, qid, n)

    return _best_ms(loop) * 1e3 / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--qtype", default="q4_1", choices=sorted(QTYPE_IDS))
    p.add_argument("--fixed-cost", action="store_true",
                   help="only the per-call cost at M = 1 on a cached [64, 576] weight")
    args = p.parse_args()
    if args.fixed_cost:
        print(f"quant_gemm M=1 N=64 K={HIDDEN} {args.qtype}: {fixed_cost_us(args.qtype):.2f} us/call")
        return
    for r in bench(tuple(int(v) for v in args.ms.split(",")), args.qtype):
        if "ms_bf16" not in r:
            print(f"M={r['shape'][0]:<3} {r['name']}: {r['ms_ours']:.2f} ms vs {r['ms_ref']:.2f} ms, "
                  f"{r['ratio']:.2f}x")
            continue
        print(f"M={r['shape'][0]:<3} {r['shape'][1]}: quantised {r['ms_ours']:.2f} ms "
              f"({r['MB_ours']:.0f} MB), bf16 {r['ms_bf16']:.2f} ms ({r['MB_bf16']:.0f} MB), "
              f"bf16/quantised {r['ratio']:.2f}x")


if __name__ == "__main__":
    main()
