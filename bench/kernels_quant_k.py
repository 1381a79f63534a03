"""Micro-benchmark of the k-quant GEMM (``csrc/quant_k.cpp``) against the Q4_1 / Q8_0 GEMM
(``csrc/quant.cpp``) and our bf16 GEMM, on the same shapes.

    python -m bench.kernels_quant_k [--ms 1,16,64] [--threads N]

Shapes (N, K): SmolLM2-135M's ``down`` [576, 1536] (its only K that is a multiple of 256) and
a 1B-class model's (hidden 2048, MLP 5632: TinyLlama / Llama-3.2-1B-like) ``qkv`` [2560,
2048], ``gate_up`` [11264, 2048], ``down`` [2048, 5632], each repeated as ``--layers`` distinct
weights so a run streams them from memory (as a decode step does) rather than from cache.
Weights are random valid blocks (timing does not depend on values; gguf-py cannot quantise
to k-quants). Per (shape, M): milliseconds for all layers (best of several runs: the host
may be shared) and the weight-read rate in GB/s, for q4_k, q5_k, q6_k, q4_1, q8_0, bf16.

    python -m bench.kernels_quant_k --isa-ab [--ms 1,16,64] [--qtypes q4_k,q6_k] [--isas ...]

times the k-quant GEMM's x86 inner loops, the same bits each (the AMX-INT8 tiles, the
default from 16 rows on Intel AMX, here forced at every M; the AVX-512 VNNI int8 tiles,
``vpdpbusd``, the default below; the AVX-512 VNNI int16 tiles, ``vpdpwssd``; the AVX2 int8 tiles,
``vpmaddubsw``, Q6_K excepted; the AVX2 int16 tiles, ``vpmaddwd``) on Llama-3.2-1B's layer shapes (qkv [3072, 2048], o [2048, 2048], gate_up [16384,
2048], down [2048, 8192]), alternating them, best of 5 (needs an AVX-512 VNNI CPU). At one
row "avx512vnni" takes the one-row tiles (``csrc/quant_k.cpp``).
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels_quant import _best_ms
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.quant import quantize_ref, repack_x8
from tokenserve.ops.quant_blocks import BLOCK_BYTES, BLOCK_ELEMS, K_QTYPES, QTYPE_IDS, QuantWeight

SHAPES = (("smol.down", 576, 1536), ("1b.qkv", 2560, 2048), ("1b.gate_up", 11264, 2048),
          ("1b.down", 2048, 5632))
FORMATS = ("q4_k", "q5_k", "q6_k", "q4_1", "q8_0", "bf16")


def _random_k(n: int, k: int, qtype: str, g: torch.Generator) -> QuantWeight:
    """Random valid k-quant blocks with small positive fp16 scales."""
    nsb, bb = k // BLOCK_ELEMS[qtype], BLOCK_BYTES[qtype]
    data = torch.randint(0, 256, (n, nsb, bb), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, nsb, 2, generator=g) * 1e-3).half().view(torch.uint8).view(n, nsb, 4)
    if qtype == "q6_k":
        data[..., 208:210] = d[..., 0:2]
    else:
        data[..., 0:4] = d
    return QuantWeight(data.reshape(n, -1).contiguous(), qtype, (n, k))


def bench(ms: tuple[int, ...] = (1, 16, 64), layers: int = 8) -> list[dict]:
    """One row per (shape, M, format): ``ms`` for ``layers`` distinct weights, ``gbs``."""
    c = load_kernels()
    if c is None or not all(hasattr(c, f) for f in ("quant_k_gemm", "quant_gemm", "gemm")):
        raise RuntimeError("tokenserve._C with quant_k_gemm, quant_gemm and gemm is not built")
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, n, k in SHAPES:
        ws: dict[str, list] = {}
        for fmt in FORMATS:
            if fmt in K_QTYPES:
                ws[fmt] = [repack_x8(_random_k(n, k, fmt, g)) for _ in range(layers)]
            elif fmt == "bf16":
                ws[fmt] = [c.gemm_prepack((torch.randn(n, k, generator=g) * k ** -0.5).bfloat16())
                           for _ in range(layers)]
            else:
                ws[fmt] = [repack_x8(quantize_ref(torch.randn(n, k, generator=g) * k ** -0.5, fmt))
                           for _ in range(layers)]
        for m in ms:
            x = torch.randn(m, k, generator=g).bfloat16()
            for fmt in FORMATS:
                if fmt == "bf16":
                    def run(ws=ws[fmt], x=x, n=n):
                        for p in ws:
                            c.gemm(x, p, n, None, torch.bfloat16)
                    nbytes = sum(p.numel() * p.element_size() for p in ws[fmt])
                else:
                    op = c.quant_k_gemm if fmt in K_QTYPES else c.quant_gemm

                    def run(ws=ws[fmt], op=op, qid=QTYPE_IDS[fmt], x=x, n=n):
                        for p in ws:
                            op(x, p.data, qid, n, None, torch.bfloat16)
                    nbytes = sum(p.nbytes for p in ws[fmt])
                t = _best_ms(run)
                rows.append({"shape": name, "N": n, "K": k, "M": m, "format": fmt,
                             "ms": round(t, 3), "gbs": round(nbytes / t / 1e6, 2)})
    return rows


L32_1B = (("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192))


ISAS = ("amx-int8", "avx512vnni", "avx512vnni-int16", "avx2", "avx2-int16")
NEVER = 1 << 40


def bench_isa(ms: tuple[int, ...], qtypes: tuple[str, ...], layers: int = 6,
              isas: tuple[str, ...] = ISAS) -> list[dict]:
    """One row per (qtype, M, shape): ms per GEMM on each of ``isas`` (``amx-int8`` only
    where the CPU and OS allow the tiles)."""
    c = load_kernels()
    if c is None or not c.cpu_features().get("avx512vnni"):
        raise RuntimeError("--isa-ab needs tokenserve._C on an AVX-512 VNNI CPU")
    if not c.quant_amx_int_available():
        isas = tuple(i for i in isas if i != "amx-int8")
    g = torch.Generator().manual_seed(0)
    rows = []
    for qt in qtypes:
        ws = {name: [repack_x8(_random_k(n, k, qt, g)).data for _ in range(layers)]
              for name, n, k in L32_1B}
        for m in ms:
            best: dict[tuple[str, str], float] = {}
            for _ in range(5):
                for isa in isas:
                    old = c._quant_k_force_avx2(isa.startswith("avx2"))
                    old_w = c._quant_k_force_int16(isa.endswith("-int16"))
                    old_a = c._quant_k_amx_rows(1 if isa == "amx-int8" else NEVER)
                    try:
                        for name, n, k in L32_1B:
                            x = torch.randn(m, k, generator=g).bfloat16()

                            def run(ws=ws[name], x=x, n=n, qid=QTYPE_IDS[qt]):
                                for w in ws:
                                    c.quant_k_gemm(x, w, qid, n, None, torch.bfloat16)
                            t = _best_ms(run) / layers
                            best[(isa, name)] = min(best.get((isa, name), 1e9), t)
                    finally:
                        c._quant_k_force_avx2(old)
                        c._quant_k_force_int16(old_w)
                        c._quant_k_amx_rows(old_a)
            for name, n, k in L32_1B:
                nbytes = ws[name][0].numel()
                rows.append({"format": qt, "M": m, "shape": name, "N": n, "K": k,
                             **{f"ms_{isa}": round(best[(isa, name)], 3) for isa in isas},
                             "gbs": round(nbytes / best[(isas[0], name)] / 1e6, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", default="1,16,64", help="batch sizes (rows of x), comma-separated")
    ap.add_argument("--layers", type=int, default=8, help="distinct weights per shape")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--isa-ab", action="store_true",
                    help="AVX-512 VNNI vs AVX2 tiles on Llama-3.2-1B's shapes")
    ap.add_argument("--qtypes", default="q4_k,q6_k", help="with --isa-ab")
    ap.add_argument("--isas", default=",".join(ISAS), help="with --isa-ab: the inner loops to time")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.isa_ab:
        isas = tuple(args.isas.split(","))
        rows = bench_isa(tuple(int(v) for v in args.ms.split(",")), tuple(args.qtypes.split(",")),
                         isas=isas)
        isas = tuple(i for i in isas if rows and f"ms_{i}" in rows[0])
        print(f"threads={torch.get_num_threads()}; ms per GEMM, " + " / ".join(isas))
        for r in rows:
            times = " / ".join(f"{r['ms_' + isa]:.3f}" for isa in isas)
            print(f"{r['format']} M={r['M']:<3} {r['shape']:<8} {times} ms "
                  f"({r['gbs']} GB/s on {isas[0]})")
        return
    rows = bench(tuple(int(v) for v in args.ms.split(",")), args.layers)
    print(f"threads={torch.get_num_threads()}; ms for {args.layers} layers (GB/s of weights)")
    print(f"{'shape':<12} {'M':>3} " + " ".join(f"{f:>16}" for f in FORMATS))
    for i in range(0, len(rows), len(FORMATS)):
        grp = rows[i:i + len(FORMATS)]
        print(f"{grp[0]['shape']:<12} {grp[0]['M']:>3} "
              + " ".join(f"{r['ms']:>8.3f} ({r['gbs']:>5.1f})" for r in grp))


if __name__ == "__main__":
    main()
