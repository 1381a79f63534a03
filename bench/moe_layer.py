"""One Qwen3-30B-A3B-shaped MoE layer (hidden 2048, 128 experts of width 768, top 8):
the Python expert loop vs the C++ one (csrc/moe.cpp), the latter in both schedules (its
default: the experts side by side, one thread each, while none has more than 32 tokens;
and ``parallel_rows=0``: each expert's GEMMs on every thread), ms per layer call (median).
Each call gets new random rows, so the router picks other experts and their weights come
from memory, as in a model's step.

    python -m bench.moe_layer [bf16|q4_0|q4_k ...]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from bench.kernels_quant_k import _random_k
from tokenserve.models.config import MoeArch
from tokenserve.models.families.base import LayerWeights
from tokenserve.models.moe import MoE
from tokenserve.ops.dispatch import Kernels
from tokenserve.ops.quant import quantize_ref
from tokenserve.ops.quant_blocks import K_QTYPES

H, I, E, K = 2048, 768, 128, 8


def build(wq: str) -> MoE:
    g = torch.Generator().manual_seed(0)

    def w(n: int, k: int):
        if wq in K_QTYPES:
            return _random_k(n, k, wq, g)
        t = torch.randn(n, k, generator=g) * 0.02
        return quantize_ref(t, wq) if wq != "bf16" else t.bfloat16()

    arch = MoeArch(num_experts=E, top_k=K, norm_topk_prob=True, weights_fp32=False, intermediate_size=I)
    lw = LayerWeights(qkv=[], o=torch.empty(0), router=torch.randn(E, H, generator=g).bfloat16(),
                      experts=[([w(I, H), w(I, H)], w(H, I)) for _ in range(E)])
    return MoE(arch, lw, torch.bfloat16)


def main() -> None:
    ops = Kernels()
    g = torch.Generator().manual_seed(1)
    for wq in sys.argv[1:] or ["bf16", "q4_0"]:
        m = build(wq)
        m.use_c = True
        default = m._c_moe(ops)
        specs = [(gu.c_spec(), d.c_spec()) for gu, d in m.experts]
        per_expert = ops.c.MoeExperts([a for a, _ in specs], [b for _, b in specs], 0)
        for T in (1, 16, 64):
            x = torch.randn(T, H, generator=g).bfloat16()
            m.use_c = False
            want = m(x, ops)
            m.use_c = True
            for c in (default, per_expert):
                m._c_experts = c
                assert torch.equal(m(x, ops), want)
            res: dict[str, list[float]] = {}
            runs = 15 if T < 64 else 7
            for name in ("python", "c++", "c++ per-expert threads") * 2:
                m.use_c = name != "python"
                m._c_experts = per_expert if name == "c++ per-expert threads" else default
                for _ in range(runs):
                    x = torch.randn(T, H, generator=g).bfloat16()
                    t0 = time.perf_counter()
                    m(x, ops)
                    res.setdefault(name, []).append(time.perf_counter() - t0)
            print(f"{wq} T={T:3d}: " + "  ".join(
                f"{name} {1e3 * statistics.median(ts):7.2f} ms" for name, ts in res.items()), flush=True)
        m._c_experts = default
        del m


if __name__ == "__main__":
    main()
