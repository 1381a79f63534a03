"""``paged_attention``'s sliding window and logit soft-capping (csrc/attention.cpp) against
the reference (``ops.reference.paged_attention_ref``, itself checked against a dense masked
softmax in test_attention_window_ref.py), with the tolerances of test_kernel_attention.py;
batch invariance with a window (bit-exact); blocks before every row's window never read."""

from __future__ import annotations

import math

import pytest
import torch

from tests.unit.test_kernel_attention import PATHS, Case, batches
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.reference import paged_attention_ref

C = load_kernels()
pytestmark = pytest.mark.skipif(C is None, reason="tokenserve._C not built")


class WCase(Case):
    def __init__(self, *a, window=0, softcap=0.0, **kw):
        super().__init__(*a, **kw)
        self.window, self.softcap = window, softcap

    def run(self, path="paged_attention", q=None, block_tables=None, qsl=None, ctx=None):
        q = self.q if q is None else q
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        getattr(C, path)(out, q, self.k_cache, self.v_cache,
                         self.block_tables if block_tables is None else block_tables,
                         self.query_start_loc if qsl is None else qsl,
                         self.context_lens if ctx is None else ctx, self.scale,
                         self.window, self.softcap)
        return out

    def ref(self):
        int8 = self.k_cache.dtype == torch.int8
        return paged_attention_ref(self.q.float(), self.k_cache if int8 else self.k_cache.float(),
                                   self.v_cache if int8 else self.v_cache.float(),
                                   self.block_tables, self.query_start_loc, self.context_lens,
                                   self.scale, self.window, self.softcap)


def _close(case, out):
    ref = case.ref()
    if ref.numel() == 0:
        return
    if case.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=3e-5, rtol=1e-5)
    else:
        ulp = 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - 7)
        assert (out.float() - ref).abs().max().item() <= ulp


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv", ["model", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 16, 33, 1000])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_matches_reference(path, kv, dtype, window, softcap):
    bs = 16
    for ctx, ql in batches(bs).values():
        case = WCase(ctx, ql, H=8, Hkv=2, D=36, bs=bs, dtype=dtype, kv=kv, window=window,
                     softcap=softcap)
        _close(case, case.run(path))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv", ["model", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,bs", [(7, 5), (16, 16), (20, 16)])
def test_batch_invariance_with_a_window(path, kv, dtype, window, bs):
    """One sequence's rows as a whole prefill, as decodes, in chunks after a cached prefix,
    and in a mixed step: the same bits (as test_kernel_attention's invariance test)."""
    L = 70
    case = WCase([L], [L], H=9, Hkv=3, D=64, bs=bs, dtype=dtype, seed=1, kv=kv, window=window,
                 softcap=2.5)
    bt, q = case.block_tables, case.q
    full = case.run(path)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    dec = case.run(path, block_tables=bt.repeat(L, 1),
                   qsl=torch.arange(L + 1, dtype=torch.int32), ctx=i32(list(range(1, L + 1))))
    assert torch.equal(dec, full), "decode rows differ from prefill rows"
    for cuts in ([23], [1, 17, 50], [L - 1]):
        edges = [0] + cuts + [L]
        for a, b in zip(edges, edges[1:]):
            out = case.run(path, q=q[a:b], qsl=i32([0, b - a]), ctx=i32([b]))
            assert torch.equal(out, full[a:b]), f"chunk [{a}, {b}) differs"
    qm = torch.cat([q[5:8], q[23:L], q[:40]])
    out = case.run(path, q=qm, block_tables=torch.cat([bt] * 5),
                   qsl=i32([0, 1, 2, 3, 3 + L - 23, 3 + L - 23 + 40]), ctx=i32([6, 7, 8, L, 40]))
    assert torch.equal(out[:3], full[5:8]) and torch.equal(out[3:3 + L - 23], full[23:L])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv", ["model", "int8"])
def test_blocks_before_every_window_are_never_read(path, kv):
    """Poison (NaN, or garbage int8 scales) every block that lies wholly before the window of
    the step's first query: the output does not change."""
    bs, window = 8, 10
    ctx, q_len = [61, 40], [3, 1]  # queries at 58..60 (keys from 49), 39 (keys from 30)
    case = WCase(ctx, q_len, H=4, Hkv=2, D=16, bs=bs, kv=kv, window=window)
    before = case.run(path)
    for s, (c, ql) in enumerate(zip(ctx, q_len)):
        first = c - ql - window + 1  # the first key any of the sequence's queries sees
        for b in case.block_tables[s, : first // bs].tolist():
            if kv == "int8":
                case.k_cache[b] = 127
                case.v_cache[b] = -1  # scale bytes become NaN
            else:
                case.k_cache[b] = float("nan")
                case.v_cache[b] = float("nan")
    assert torch.equal(case.run(path), before)


def test_window_and_softcap_change_the_answer():
    """Negative controls: both arguments reach the kernel."""
    case = WCase([50], [4], H=4, Hkv=2, D=16, bs=8)
    plain = case.run()
    case.window = 6
    assert not torch.allclose(case.run(), plain)
    case.window, case.softcap = 0, 0.5
    assert not torch.allclose(case.run(), plain)


def test_negative_window_is_refused():
    case = WCase([5], [1], H=4, Hkv=2, D=16, bs=8, window=-1)
    with pytest.raises(RuntimeError, match="window"):
        case.run()
