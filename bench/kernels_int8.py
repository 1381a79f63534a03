"""Micro-benchmark of the weight-only int8 GEMM (``csrc/int8_gemm.cpp``) against our bf16 GEMM
and the Q8_0 GGUF kernel (int16 activations, ``vpmaddwd``: the other design for int8 weights).

    python -m bench.kernels_int8 [--ms 1,16,64]
    python -m bench.kernels int8

One decode step's GEMMs of SmolLM2-135M: 30 layers x (qkv [960, 576], o [576, 576], gate_up
[3072, 576], down [576, 1536]) plus the lm_head [49152, 576] with fp32 logits, each layer its
own weights (the step streams them from memory as a real one does). Best of several runs.
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels_quant import HIDDEN, LAYER_SHAPES, LAYERS, VOCAB, _best_ms
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.quant import quantize_ref, repack_x8
from tokenserve.ops.quant_blocks import QTYPE_IDS
from tokenserve.ops.quant_int8 import pack_int8, quantize_int8

MS = (1, 16, 64)


def bench(ms: tuple[int, ...] = MS) -> list[dict]:
    """One ``step`` row per M: ``ms_ours`` (int8), ``ms_bf16``, ``ms_q8_0``, ratio bf16 / int8
    (> 1: int8 faster), and the MB of weights each streams."""
    c = load_kernels()
    if c is None or not all(hasattr(c, f) for f in ("int8_gemm", "gemm", "quant_gemm")):
        raise RuntimeError("tokenserve._C with int8_gemm, gemm and quant_gemm is not built")
    g = torch.Generator().manual_seed(0)

    def rand(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, generator=g) * k ** -0.5

    ws = [[rand(n, k) for _, n, k in LAYER_SHAPES] for _ in range(LAYERS)] + [[rand(VOCAB, HIDDEN)]]
    i8 = [[pack_int8(quantize_int8(w)) for w in layer] for layer in ws]
    bf = [[c.gemm_prepack(w.bfloat16()) for w in layer] for layer in ws]
    q8 = [[repack_x8(quantize_ref(w, "q8_0")) for w in layer] for layer in ws]
    mb = {"int8": sum(w.nbytes for layer in i8 for w in layer) / 1e6,
          "bf16": sum(p.numel() * 2 for layer in bf for p in layer) / 1e6,
          "q8_0": sum(w.nbytes for layer in q8 for w in layer) / 1e6}
    rows = []
    for m in ms:
        x = torch.randn(m, HIDDEN, generator=g).bfloat16()
        x2 = torch.randn(m, 1536, generator=g).bfloat16()
        ins = (x, x, x, x2)

        def run(gemm, weights, ins=ins, x=x) -> None:
            for layer in weights[:-1]:
                for w, xi in zip(layer, ins):
                    gemm(xi, w, None)
            gemm(x, weights[-1][0], torch.float32)

        t = {
            "int8": _best_ms(lambda: run(lambda xi, w, o: c.int8_gemm(xi, w.data, w.scale, w.shape[0],
                                                                      None, o), i8)),
            # every N here is a multiple of 16: the packed panels give it back
            "bf16": _best_ms(lambda: run(lambda xi, p, o: c.gemm(xi, p, p.shape[0] * 16, None, o),
                                         bf)),
            "q8_0": _best_ms(lambda: run(lambda xi, w, o: c.quant_gemm(xi, w.data, QTYPE_IDS["q8_0"],
                                                                       w.shape[0], None, o), q8)),
        }
        rows.append({"name": "step", "M": m, "ms_ours": t["int8"], "ms_bf16": t["bf16"],
                     "ms_q8_0": t["q8_0"], "ratio": t["bf16"] / t["int8"],
                     **{f"MB_{k}": v for k, v in mb.items()}})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default=",".join(map(str, MS)))
    args = p.parse_args()
    for r in bench(tuple(int(v) for v in args.ms.split(","))):
        print(f"M={r['M']:<3} int8 {r['ms_ours']:.2f} ms ({r['MB_int8']:.0f} MB), "
              f"bf16 {r['ms_bf16']:.2f} ms ({r['MB_bf16']:.0f} MB), "
              f"q8_0 {r['ms_q8_0']:.2f} ms ({r['MB_q8_0']:.0f} MB); "
              f"bf16/int8 {r['ratio']:.2f}x, q8_0/int8 {r['ms_q8_0'] / r['ms_ours']:.2f}x")


if __name__ == "__main__":
    main()
