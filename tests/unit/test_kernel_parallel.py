"""csrc/parallel.h: a range of work units per task, an idle task taking the others' units.

Which thread computes a unit must never change a result: the kernels that share their rows
this way (layer ops, RoPE + KV write, sampling, the activation quantiser and the block
GEMMs) give the same bits on 1, 2 and 3 threads.
"""

from __future__ import annotations

import pytest
import torch

from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.layer_ref import rope_cos_sin
from tokenserve.ops.sampling import pack_batch
from tokenserve.sampling_params import SamplingParams

C = load_kernels()
pytestmark = pytest.mark.skipif(C is None, reason="tokenserve._C not built")


class _Threads:
    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.old = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("units,ntasks", [(0, 2), (1, 3), (5, 8), (64, 2), (1000, 3), (7, 1)])
def test_every_unit_runs_exactly_once(threads, units, ntasks):
    with _Threads(threads):
        owners = C._parallel_units_owners(units, ntasks, 0)
    assert len(owners) == units
    assert all(0 <= o < ntasks for o in owners), owners  # -1: never ran, -2: ran twice


def test_idle_task_takes_the_slow_tasks_units():
    # task 0 sleeps 2 ms per unit: task 1 finishes its own 10 units, then runs task 0's
    with _Threads(2):
        owners = C._parallel_units_owners(20, 2, 2000)
    assert all(o in (0, 1) for o in owners)
    assert owners[10:] == [1] * 10
    # task 1 ran units of task 0's range (task 0 usually starts on its first unit, but on a
    # loaded host its thread may start after task 1 has taken all ten)
    assert 1 in owners[:10], owners


def test_one_thread_runs_every_task_in_order():
    with _Threads(1):
        assert C._parallel_units_owners(9, 3, 0) == [0] * 9  # task 0 ran, then took the rest


def _on_threads(fn):
    """fn() on 1, 2 and 3 threads: the three results (tuples of tensors)."""
    outs = []
    for n in (1, 2, 3):
        with _Threads(n):
            outs.append(fn())
    return outs


def _same(outs):
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def test_layer_ops_same_bits_on_any_thread_count():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 2 * 1536, generator=g) * 3).bfloat16()
    h = (torch.randn(64, 576, generator=g) * 3).bfloat16()
    res = (torch.randn(64, 576, generator=g) * 3).bfloat16()
    w = (1 + 0.5 * torch.randn(576, generator=g)).bfloat16()

    def run():
        silu = torch.empty(64, 1536, dtype=torch.bfloat16)
        C.silu_and_mul(silu, x)
        norm = torch.empty_like(h)
        C.rms_norm(norm, h, w, 1e-5)
        fx, fres = h.clone(), res.clone()
        C.fused_add_rms_norm(fx, fres, w, 1e-5)
        return silu, norm, fx, fres

    _same(_on_threads(run))


def test_rope_and_kv_write_same_bits_on_any_thread_count():
    g = torch.Generator().manual_seed(4)
    T, H, Hkv, D, bs, nb = 300, 9, 3, 64, 16, 40
    qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=g) * 3).bfloat16()
    pos = torch.randint(0, 2048, (T,), generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    cs = rope_cos_sin(1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D), 2048)

    def run():
        q = qkv.clone()
        kc = torch.zeros(nb, Hkv, bs, D, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        C.rotary_embedding_write_kv(q, pos, cs, kc, vc, slots, H, Hkv)
        return q, kc, vc

    _same(_on_threads(run))


def test_sampling_same_tokens_on_any_thread_count():
    rows, vocab = 64, 49152
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=g) * 3
    params = [SamplingParams(do_sample=bool(r % 2), temperature=0.8, top_k=40 * (r % 3),
                             top_p=0.9, repetition_penalty=1.1, seed=r) for r in range(rows)]
    hists = [torch.randint(0, vocab, (30,), generator=g).tolist() for _ in range(rows)]
    batch = pack_batch(params, hists, [15] * rows, vocab)
    u = torch.rand(rows, generator=g)
    outs = _on_threads(lambda: (C.sample(logits, *batch, u),))
    _same(outs)
    assert bool((outs[0][0] >= 0).all())
