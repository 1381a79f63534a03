"""One Qwen3-30B-A3B-shaped MoE layer (hidden 2048, 128 experts of width 768, top 8):
the Python expert loop vs the C++ one (csrc/moe.cpp), ms per layer call (median).

    python bench/moe_layer.py [bf16|q4_0 ...]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from tokenserve.models.config import MoeArch
from tokenserve.models.families.base import LayerWeights
from tokenserve.models.moe import MoE
from tokenserve.ops.dispatch import Kernels
from tokenserve.ops.quant import quantize_ref

H, I, E, K = 2048, 768, 128, 8


def build(wq: str) -> MoE:
    g = torch.Generator().manual_seed(0)

    def w(n: int, k: int):
        t = torch.randn(n, k, generator=g) * 0.02
        return quantize_ref(t, wq) if wq != "bf16" else t.bfloat16()

    arch = MoeArch(num_experts=E, top_k=K, norm_topk_prob=True, weights_fp32=False, intermediate_size=I)
    lw = LayerWeights(qkv=[], o=torch.empty(0), router=torch.randn(E, H, generator=g).bfloat16(),
                      experts=[([w(I, H), w(I, H)], w(H, I)) for _ in range(E)])
    return MoE(arch, lw, torch.bfloat16)


def main() -> None:
    ops = Kernels()
    for wq in sys.argv[1:] or ["bf16", "q4_0"]:
        m = build(wq)
        for T in (1, 16, 64):
            x = torch.randn(T, H).bfloat16()
            m.use_c = False
            want = m(x, ops)
            m.use_c = True
            assert torch.equal(m(x, ops), want)
            res = {}
            for name in ("python", "c++", "python", "c++"):
                m.use_c = name == "c++"
                ts = []
                for _ in range(15 if T < 64 else 7):
                    t0 = time.perf_counter()
                    m(x, ops)
                    ts.append(time.perf_counter() - t0)
                res.setdefault(name, []).extend(ts)
            print(f"{wq} T={T:3d}: python {1e3 * statistics.median(res['python']):8.2f} ms "
                  f"(min {1e3 * min(res['python']):.2f})  c++ {1e3 * statistics.median(res['c++']):8.2f} ms "
                  f"(min {1e3 * min(res['c++']):.2f})", flush=True)
        del m


if __name__ == "__main__":
    main()
