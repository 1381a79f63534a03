"""The fused C++ sampling kernel (``tokenserve._C.sample``) against its pure-torch reference
(``tokenserve.ops.sampling.sample_tensors_ref``): the same token for the same uniforms.

Exact agreement is expected (not a tolerance): masses are integers and the float32
weights are rounded once from a float64 exp, so the two implementations can only differ
when an exp lands within ~1e-16 of a float32 rounding boundary (~2^-28 per element) and
that flips a draw boundary: never observed; a mismatch here is a bug.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.sampling import SamplingBatch, pack_batch, sample_tensors_ref
from tokenserve.sampling_params import SamplingParams

C = load_kernels()
pytestmark = pytest.mark.skipif(C is None, reason="tokenserve._C is not built")

BIG_V = 49152
FLT_MAX = torch.finfo(torch.float32).max


def _logits(rows: int, vocab: int, seed: int, kind: str = "gauss") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    if kind == "ties":  # integers: equal values everywhere, including at the maximum
        return (x * 2).round()
    if kind == "peaked":  # a few strong candidates over a long tail, like an LM
        boost = torch.zeros(rows, vocab)
        hot = torch.randint(0, vocab, (rows, 8), generator=gen)
        boost.scatter_(1, hot, torch.rand(rows, 8, generator=gen) * 12)
        return x * 2 + boost
    return x * 3


def _batch(rows: int, vocab: int, seed: int = 0, params=None, hist_len: int = 40,
           **kw) -> SamplingBatch:
    gen = torch.Generator().manual_seed(seed + 7)
    if params is None:
        params = [SamplingParams(do_sample=True, seed=0, **kw) for _ in range(rows)]
    hists = [torch.randint(0, vocab, (hist_len,), generator=gen).tolist() for _ in range(rows)]
    return pack_batch(params, hists, [hist_len // 2] * rows, vocab)


def _both(logits, batch, uniforms):
    before = logits.clone()
    got = C.sample(logits, *batch, uniforms)
    want = sample_tensors_ref(logits, *batch, uniforms)
    torch.testing.assert_close(logits, before, rtol=0, atol=0, equal_nan=True)  # unmodified
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],)
    vocab = logits.shape[1]
    assert bool(((got == -1) | ((got >= 0) & (got < vocab))).all())
    return got, want


def _check(logits, batch, seeds=range(3)):
    for s in seeds:
        u = torch.rand(logits.shape[0], generator=torch.Generator().manual_seed(1000 + s))
        got, want = _both(logits, batch, u)
        assert torch.equal(got, want), (s, (got != want).nonzero().flatten().tolist())
    return got


CONFIGS = {
    "plain": {},
    "temperature": {"temperature": 0.6},
    "hot": {"temperature": 2.5},
    "top_k": {"top_k": 40},
    "top_k_1": {"top_k": 1},
    "top_p": {"top_p": 0.9},
    "top_p_low_t": {"top_p": 0.5, "temperature": 0.3},
    "min_p": {"min_p": 0.05},
    "repetition": {"repetition_penalty": 1.3},
    "reward": {"repetition_penalty": 0.7},
    "pres_freq": {"presence_penalty": 1.0, "frequency_penalty": 0.5},
    "combined": {"top_k": 50, "top_p": 0.9, "min_p": 0.02, "temperature": 0.8,
                 "repetition_penalty": 1.1, "presence_penalty": 0.3,
                 "frequency_penalty": -0.2},
    "greedy": {"do_sample": False, "repetition_penalty": 1.2},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("rows", [0, 1, 3, 17, 64])
def test_matches_reference_small_vocab(config, rows):
    kw = {"do_sample": True, **CONFIGS[config]}
    params = [SamplingParams(seed=0, **kw) for _ in range(rows)]
    for kind in ("gauss", "ties", "peaked"):
        logits = _logits(rows, 17, seed=rows, kind=kind)
        _check(logits, _batch(rows, 17, params=params, hist_len=6), seeds=range(20))


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("kind", ["gauss", "peaked"])
def test_matches_reference_big_vocab(config, kind):
    rows = 17
    kw = {"do_sample": True, **CONFIGS[config]}
    params = [SamplingParams(seed=0, **kw) for _ in range(rows)]
    logits = _logits(rows, BIG_V, seed=5, kind=kind)
    _check(logits, _batch(rows, BIG_V, params=params, hist_len=200), seeds=range(2))


def _random_params(gen: torch.Generator) -> SamplingParams:
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    return SamplingParams(
        do_sample=pick([True, True, True, False]),
        temperature=pick([0.3, 0.7, 1.0, 1.8]),
        top_k=pick([0, 0, 1, 20, 50, 1000, BIG_V, BIG_V + 5]),
        top_p=pick([1.0, 1.0, 0.5, 0.9, 0.99]),
        min_p=pick([0.0, 0.0, 0.1]),
        repetition_penalty=pick([1.0, 1.0, 1.2, 0.8]),
        presence_penalty=pick([0.0, 0.0, 0.5]),
        frequency_penalty=pick([0.0, 0.0, -0.3, 1.0]),
        seed=0,
    )


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_mixed_batch_of_64_matches_reference(vocab):
    rng = torch.Generator().manual_seed(vocab)
    params = [_random_params(rng) for _ in range(64)]
    logits = _logits(64, vocab, seed=2, kind="peaked")
    _check(logits, _batch(64, vocab, params=params, hist_len=200), seeds=range(2))


def test_many_seeds_at_draw_boundaries():
    """1000 uniforms per row: every draw lands on the same side of every cdf boundary."""
    rows, vocab = 4, 300
    params = [SamplingParams(do_sample=True, seed=0, **kw) for kw in
              ({}, {"top_k": 30}, {"top_p": 0.8, "temperature": 0.5}, {"min_p": 0.2})]
    logits = _logits(rows, vocab, seed=3, kind="peaked")
    batch = _batch(rows, vocab, params=params)
    u = torch.rand(1000, rows, generator=torch.Generator().manual_seed(4))
    for i in range(u.shape[0]):
        got, want = _both(logits, batch, u[i].contiguous())
        assert torch.equal(got, want), i


# --------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_top_k_1_is_greedy_with_tied_maxima(vocab):
    """Issue "top_k=1 must equal greedy": with ties at the maximum, top-k used to keep
    every tied token; now it keeps exactly k tokens, ties going to the lowest id."""
    rows = 8
    logits = torch.zeros(rows, vocab)
    for r in range(rows):
        ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(r))[:3]
        logits[r, ids] = 4.0
    greedy = logits.max(dim=1).indices
    batch = _batch(rows, vocab, top_k=1, temperature=1.7)
    for s in range(10):
        u = torch.rand(rows, generator=torch.Generator().manual_seed(s))
        got, want = _both(logits, batch, u)
        assert torch.equal(got, greedy) and torch.equal(want, greedy)


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_top_k_keeps_exactly_k_lowest_ids_among_ties(vocab):
    """All-equal logits with top_k=5: only ids 0..4 can come out, uniformly."""
    rows = 200
    logits = torch.zeros(rows, vocab)
    u = torch.rand(rows, generator=torch.Generator().manual_seed(0))
    got, want = _both(logits, _batch(rows, vocab, top_k=5), u)
    assert torch.equal(got, want)
    assert torch.equal(got, (u.double() * 5).floor().long())


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_top_k_at_least_vocab_is_off(vocab):
    rows = 5
    logits = _logits(rows, vocab, seed=1)
    u = torch.rand(rows, generator=torch.Generator().manual_seed(1))
    off, _ = _both(logits, _batch(rows, vocab), u)
    for k in (vocab, vocab + 1, 2**31 - 1):
        got, want = _both(logits, _batch(rows, vocab, top_k=k), u)
        assert torch.equal(got, off) and torch.equal(want, off)


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_all_equal_logits_draw_uniformly_by_id(vocab):
    rows = 64 if vocab < 1000 else 8  # top-p on a flat big row is a full sort (slow ref)
    logits = torch.full((rows, vocab), 1.25)
    u = torch.rand(rows, generator=torch.Generator().manual_seed(2))
    for kw in ({}, {"top_p": 0.999999}, {"min_p": 1.0}, {"temperature": 1e-300}):
        got, want = _both(logits, _batch(rows, vocab, **kw), u)
        assert torch.equal(got, want), kw
    got, _ = _both(logits, _batch(rows, vocab), u)
    assert torch.equal(got, (u.double() * vocab).floor().long())


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_tiny_top_p_and_tiny_temperature_are_greedy(vocab):
    """top-p -> 0 is greedy (the first token of the order is always kept); T -> 0 gives
    weight 1 to every maximal token and 0 to the rest: a draw among tied maxima only."""
    rows = 17
    logits = _logits(rows, vocab, seed=5, kind="ties")
    greedy = logits.max(dim=1).indices
    is_max = logits == logits.max(dim=1, keepdim=True).values
    for kw in ({"top_p": 1e-6}, {"temperature": 1e-300}, {"temperature": 1e-45},
               {"top_p": 1e-9, "top_k": 7}):
        for s in range(5):
            u = torch.rand(rows, generator=torch.Generator().manual_seed(s))
            got, want = _both(logits, _batch(rows, vocab, **kw), u)
            assert torch.equal(got, want), kw
            if "top_p" in kw:
                assert torch.equal(got, greedy), kw
            else:
                assert bool(is_max.gather(1, got.unsqueeze(1)).all()), kw
    distinct = _logits(rows, vocab, seed=5)  # no ties: exactly greedy
    u = torch.rand(rows, generator=torch.Generator().manual_seed(9))
    got, want = _both(distinct, _batch(rows, vocab, temperature=1e-300), u)
    assert torch.equal(got, distinct.max(dim=1).indices) and torch.equal(want, got)


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_huge_temperature_is_uniform(vocab):
    rows = 17
    logits = _logits(rows, vocab, seed=6)
    u = torch.rand(rows, generator=torch.Generator().manual_seed(3))
    got, want = _both(logits, _batch(rows, vocab, temperature=1e300), u)
    assert torch.equal(got, want)
    assert torch.equal(got, (u.double() * vocab).floor().long())


@pytest.mark.parametrize("penalty", [1e-300, 1e-30, 1e30, 1e300])
@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_extreme_repetition_penalties(penalty, vocab):
    rows = 17
    logits = _logits(rows, vocab, seed=7) * 10
    logits[:, :3] = torch.tensor([FLT_MAX, -FLT_MAX, 0.0])  # overflow and 0 * p cases
    for greedy in (False, True):
        params = [SamplingParams(do_sample=not greedy, repetition_penalty=penalty, seed=0)
                  ] * rows
        batch = _batch(rows, vocab, params=params, hist_len=vocab // 2)
        got = _check(logits, batch, seeds=range(4))
        assert bool(((got >= 0) & (got < vocab)).all())


def test_repetition_penalty_overflow_clamps_to_flt_max():
    """x / 1e-300 overflows: clamped to FLT_MAX, so the two boosted ids tie and the lower
    one wins greedily (not NaN, not a -1)."""
    logits = torch.tensor([[4.0, 5.0, 8.0, 9.0]])  # 4 / FLT_MIN = 2^128 overflows
    params = [SamplingParams(repetition_penalty=1e-300, seed=0)]
    batch = pack_batch(params, [[2, 0]], None, 4)
    got, want = _both(logits, batch, torch.zeros(1))
    assert got.tolist() == want.tolist() == [0]


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_presence_frequency_count_generated_tokens_only(vocab):
    logits = torch.zeros(2, vocab)
    logits[:, 1] = 1.0
    logits[:, 2] = 0.9
    params = [SamplingParams(frequency_penalty=2.0, seed=0)] * 2
    batch = pack_batch(params, [[1, 1], [1, 1]], [2, 1], vocab)
    got, want = _both(logits, batch, torch.zeros(2))
    assert got.tolist() == want.tolist() == [1, 2]


@pytest.mark.parametrize("vocab", [17, BIG_V])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_inf_row_gives_minus_one_alone(vocab, bad):
    rows = 17
    rng = torch.Generator().manual_seed(11)
    params = [_random_params(rng) for _ in range(rows)]
    logits = _logits(rows, vocab, seed=8, kind="peaked")
    u = torch.rand(rows, generator=torch.Generator().manual_seed(5))
    batch = _batch(rows, vocab, params=params)
    clean, _ = _both(logits, batch, u)
    poisoned = logits.clone()
    poisoned[4, vocab // 2] = bad
    poisoned[9, vocab - 1] = bad
    got, want = _both(poisoned, batch, u)
    assert torch.equal(got, want)
    expect = clean.clone()
    expect[[4, 9]] = -1
    assert torch.equal(got, expect)


def test_minus_inf_logits_are_never_drawn_and_all_minus_inf_is_minus_one():
    vocab = 17
    logits = torch.full((3, vocab), float("-inf"))
    logits[0, 5] = 0.0
    logits[1, [3, 11]] = 2.0
    for kw in ({}, {"top_k": 10}, {"top_p": 0.5}, {"do_sample": False}):
        params = [SamplingParams(**{"do_sample": True, **kw}, seed=0)] * 3
        for s in range(10):
            u = torch.rand(3, generator=torch.Generator().manual_seed(s))
            got, want = _both(logits, pack_batch(params, [[]] * 3, None, vocab), u)
            assert torch.equal(got, want)
            assert got[0] == 5 and int(got[1]) in (3, 11) and got[2] == -1, kw


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_row_alone_equals_row_in_batch_of_64(vocab):
    rows = 64
    rng = torch.Generator().manual_seed(vocab + 1)
    params = [_random_params(rng) for _ in range(rows)]
    logits = _logits(rows, vocab, seed=9, kind="ties")
    batch = _batch(rows, vocab, params=params, hist_len=50)
    u = torch.rand(rows, generator=torch.Generator().manual_seed(6))
    together = C.sample(logits, *batch, u)
    hist = batch.history_ids
    off = batch.history_offsets
    for r in range(rows):
        one = SamplingBatch(
            *(getattr(batch, f)[r : r + 1] for f in SamplingBatch._fields[:8]),
            hist[int(off[r]) : int(off[r + 1])].contiguous(),
            torch.tensor([0, int(off[r + 1] - off[r])]),
            batch.num_prompt[r : r + 1],
        )
        alone = C.sample(logits[r : r + 1].contiguous(), *one, u[r : r + 1].contiguous())
        assert int(alone[0]) == int(together[r]), r


def test_fuzz_never_out_of_range():
    rng = torch.Generator().manual_seed(12)
    for trial in range(30):
        vocab = int(torch.randint(1, 3000, (1,), generator=rng))
        rows = int(torch.randint(1, 9, (1,), generator=rng))
        logits = torch.randn(rows, vocab, generator=rng) * float(torch.rand(1, generator=rng) * 50)
        logits[torch.rand(rows, vocab, generator=rng) < 0.2] = float("-inf")
        params = [_random_params(rng) for _ in range(rows)]
        batch = _batch(rows, vocab, params=params, hist_len=10)
        got = _check(logits, batch, seeds=[trial])
        finite = torch.isfinite(logits).any(dim=1)
        assert bool(((got >= 0) & (got < vocab) | ~finite).all())


def test_bad_arguments_raise():
    logits = torch.zeros(2, 17)
    batch = _batch(2, 17, repetition_penalty=1.5)
    assert batch.history_ids.numel() > 0
    u = torch.zeros(2)
    with pytest.raises(RuntimeError):
        C.sample(logits.double(), *batch, u)
    with pytest.raises(RuntimeError):
        C.sample(logits, *batch, torch.zeros(3))
    with pytest.raises(RuntimeError):  # history id out of range
        C.sample(logits, *batch._replace(history_ids=batch.history_ids + 17), u)
    with pytest.raises(RuntimeError):
        C.sample(logits, *batch._replace(temperature=torch.full((2,), -1.0)), u)
    with pytest.raises(RuntimeError):
        C.sample(logits, *batch._replace(min_p=torch.full((2,), 1.5)), u)


def test_portable_path_matches_reference():
    """The scalar fallback (forced by TOKENSERVE_SAMPLING_PORTABLE=1, read once per
    process, hence the subprocess) picks the reference's tokens too."""
    code = """
import torch
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.sampling import pack_batch, sample_tensors_ref
from tokenserve.sampling_params import SamplingParams
C = load_kernels()
g = torch.Generator().manual_seed(0)
for vocab in (17, 49152):
    x = torch.randn(16, vocab, generator=g) * 3
    hists = [torch.randint(0, vocab, (50,), generator=g).tolist() for _ in range(16)]
    for kw in ({}, {"top_k": 40, "top_p": 0.9, "repetition_penalty": 1.2},
               {"top_p": 0.3, "min_p": 0.1, "frequency_penalty": 0.5}, {"do_sample": False}):
        params = [SamplingParams(**{"do_sample": True, **kw}, seed=0)] * 16
        b = pack_batch(params, hists, [25] * 16, vocab)
        for s in range(3):
            u = torch.rand(16, generator=g)
            assert torch.equal(C.sample(x, *b, u), sample_tensors_ref(x, *b, u)), (vocab, kw, s)
print("ok")
"""
    env = {**os.environ, "TOKENSERVE_SAMPLING_PORTABLE": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
