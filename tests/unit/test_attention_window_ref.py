"""The reference paged attention's sliding window and logit soft-capping
(``ops.reference.paged_attention_ref``): against a dense masked softmax computed here, and
blocks wholly outside every query's window never read (poisoned with NaN, same output)."""

from __future__ import annotations

import pytest
import torch

from tokenserve.ops.dispatch import Kernels
from tokenserve.ops.reference import paged_attention_ref

BS, H, HKV, D = 4, 4, 2, 8


def _case(ctx: int, q_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    nb = -(-ctx // BS)
    table = torch.randperm(nb + 3, generator=g)[:nb].int().view(1, nb)
    k_cache = torch.randn(nb + 3, HKV, BS, D, generator=g)
    v_cache = torch.randn(nb + 3, HKV, BS, D, generator=g)
    q = torch.randn(q_len, H, D, generator=g)
    return q, k_cache, v_cache, table


def _dense(q, k_cache, v_cache, table, ctx, window, softcap, scale):
    pos = torch.arange(ctx)
    blk = table[0].long()[pos // BS]
    k = k_cache[blk, :, pos % BS].repeat_interleave(H // HKV, dim=1)  # [ctx, H, D]
    v = v_cache[blk, :, pos % BS].repeat_interleave(H // HKV, dim=1)
    qpos = torch.arange(ctx - q.shape[0], ctx)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    visible = (pos[None, :] <= qpos[:, None]) & (pos[None, :] > qpos[:, None] - window)
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("ctx,q_len", [(1, 1), (13, 1), (13, 13), (22, 5), (40, 9)])
@pytest.mark.parametrize("window", [1, 3, 4, 7, 64])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_window_and_softcap_match_dense(ctx, q_len, window, softcap):
    q, kc, vc, table = _case(ctx, q_len)
    got = paged_attention_ref(q, kc, vc, table, torch.tensor([0, q_len]), torch.tensor([ctx]),
                              0.3, window, softcap)
    torch.testing.assert_close(got, _dense(q, kc, vc, table, ctx, window, softcap, 0.3))


def test_blocks_outside_every_window_are_never_read():
    ctx, q_len, window = 40, 3, 6  # queries at 37..39 see keys 32..39: blocks 8, 9 only
    q, kc, vc, table = _case(ctx, q_len)
    args = (torch.tensor([0, q_len]), torch.tensor([ctx]), 0.3, window)
    before = paged_attention_ref(q, kc, vc, table, *args)
    for b in table[0, : (ctx - q_len - window + 1) // BS].tolist():
        kc[b], vc[b] = float("nan"), float("nan")
    assert torch.equal(paged_attention_ref(q, kc, vc, table, *args), before)


def test_window_changes_the_answer():
    """Negative control: the window is not a no-op on a context longer than it."""
    q, kc, vc, table = _case(22, 5)
    args = (q, kc, vc, table, torch.tensor([0, 5]), torch.tensor([22]), 0.3)
    assert not torch.allclose(paged_attention_ref(*args, 4), paged_attention_ref(*args))


def test_dispatch_takes_window_and_softcap_on_either_implementation():
    q, kc, vc, table = _case(22, 5)
    args = (q, kc, vc, table, torch.tensor([0, 5], dtype=torch.int32),
            torch.tensor([22], dtype=torch.int32), 0.3)
    ref = paged_attention_ref(*args, 4, 2.0)
    for use_c in (True, False):
        torch.testing.assert_close(Kernels(use_c=use_c).paged_attention(
            *args, window=4, softcap=2.0), ref)
