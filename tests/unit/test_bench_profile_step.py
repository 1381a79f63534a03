"""bench/profile_step.py's bandwidth bound: the bytes one decode token reads, the read rate."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bench.profile_step import decode_weight_bytes, read_rate_gbs
from tests.unit.test_moe import E, H, _moe
from tokenserve.ops.linear import Linear, SplitLinear


def _lin(n: int, k: int, seed: int) -> Linear:
    return Linear(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16())


def test_dense_counts_every_projection_once():
    head = _lin(512, H, 0)
    layer = {"qkv": SplitLinear([_lin(384, H, 1), _lin(128, H, 2)]), "o": _lin(H, 256, 3),
             "gate_up": _lin(1024, H, 4), "down": _lin(H, 512, 5)}
    total, how = decode_weight_bytes(SimpleNamespace(lm_head=head, layers=[layer, layer]))
    per_layer = sum(p.nbytes for p in (*layer["qkv"].parts, layer["o"], layer["gate_up"],
                                       layer["down"]))
    assert total == head.nbytes + 2 * per_layer and "MoE" not in how


def test_moe_counts_top_k_experts_not_all():
    head = _lin(512, H, 0)
    moe = _moe(torch.bfloat16, "q4_k", top_k=2, weights_fp32=False, use_c=False)
    layer = {"qkv": _lin(384, H, 1), "o": _lin(H, 256, 2), "moe": moe}
    total, how = decode_weight_bytes(SimpleNamespace(lm_head=head, layers=[layer]))
    expert = sum(gu.nbytes + d.nbytes for gu, d in moe.experts) / E
    want = (head.nbytes + layer["qkv"].nbytes + layer["o"].nbytes + moe.router.nbytes
            + round(2 * expert))
    assert total == want and "1 MoE layers at top_k of 8 experts" in how


def test_read_rate_is_a_rate():
    assert read_rate_gbs(mib=16, repeats=2) > 0.1
