"""``paged_attention``'s sliding window and logit soft-capping (csrc/attention.cpp) against
the reference (``ops.reference.paged_attention_ref``, itself checked against a dense masked
softmax in test_attention_window_ref.py), with the tolerances of test_kernel_attention.py;
batch invariance with a window (bit-exact); blocks before every row's window never read."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_kernel_attention import PATHS, Case, _invariance, assert_matches_ref, batches
from tokenserve.ops.dispatch import load_kernels

C = load_kernels()
pytestmark = pytest.mark.skipif(C is None, reason="tokenserve._C not built")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv", ["model", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 16, 33, 1000])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_matches_reference(path, kv, dtype, window, softcap):
    bs = 16
    for ctx, ql in batches(bs).values():
        case = Case(ctx, ql, H=8, Hkv=2, D=36, bs=bs, dtype=dtype, kv=kv, window=window,
                     softcap=softcap)
        assert_matches_ref(case, case.run(path), fp32_atol=3e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv", ["model", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,bs", [(7, 5), (16, 16), (20, 16)])
def test_batch_invariance_with_a_window(path, kv, dtype, window, bs):
    """One sequence's rows as a whole prefill, as decodes, in chunks after a cached prefix,
    and in a mixed step: the same bits (test_kernel_attention's invariance check, windowed)."""
    _invariance(dtype, 9, 3, 64, bs, path, kv=kv, window=window, softcap=2.5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv", ["model", "int8"])
def test_blocks_before_every_window_are_never_read(path, kv):
    """Poison (NaN, or garbage int8 scales) every block that lies wholly before the window of
    the step's first query: the output does not change."""
    bs, window = 8, 10
    ctx, q_len = [61, 40], [3, 1]  # queries at 58..60 (keys from 49), 39 (keys from 30)
    case = Case(ctx, q_len, H=4, Hkv=2, D=16, bs=bs, kv=kv, window=window)
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
    case = Case([50], [4], H=4, Hkv=2, D=16, bs=8)
    plain = case.run()
    case.window = 6
    assert not torch.allclose(case.run(), plain)
    case.window, case.softcap = 0, 0.5
    assert not torch.allclose(case.run(), plain)


def test_negative_window_is_refused():
    case = Case([5], [1], H=4, Hkv=2, D=16, bs=8, window=-1)
    with pytest.raises(RuntimeError, match="window"):
        case.run()
