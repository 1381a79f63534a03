"""Tests for tokenserve.engine.sampler: the engine's sampling entry point.

``sample`` runs the C++ kernel when ``tokenserve._C`` has it, else the pure-torch reference
(``tokenserve.ops.sampling``); these tests hold for both (run them with
``TOKENSERVE_DISABLE_C=1`` for the reference). Kernel-vs-reference agreement is in
``test_kernel_sampling.py``.

Changed semantics (issue "top_k=1 must equal greedy"): top-k used to keep every token
tied with the k-th largest logit (HF ``TopKLogitsWarper``), so with tied maxima
``top_k=1`` could return a tied id other than the greedy one. It now keeps exactly ``k``
tokens in the order (logit descending, id ascending), and top-p no longer keeps tokens
tied with its last kept one; the oracle below sorts stably to match.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenserve.engine.sampler import (
    apply_repetition_penalty,
    apply_repetition_penalty_,
    apply_top_k_top_p,
    greedy,
    make_generator,
    sample,
    sample_ref,
    top_sorted,
)
from tokenserve.sampling_params import MAX_SEED, SamplingParams

BIG_V = 49152  # SmolLM2's vocabulary: exercises the chunked top-n path


def _params(**kw) -> SamplingParams:
    kw.setdefault("seed", 0)
    return SamplingParams(**kw)


def _logits(rows: int, vocab: int, seed: int, kind: str = "gauss") -> torch.Tensor:
    """Reproducible test logits: gaussian, integer-valued (many ties), or LM-like peaked."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    if kind == "ties":
        return (x * 2).round()
    if kind == "peaked":  # a few strong candidates over a long tail, like an LM
        boost = torch.zeros(rows, vocab)
        hot = torch.randint(0, vocab, (rows, 8), generator=gen)
        boost.scatter_(1, hot, torch.rand(rows, 8, generator=gen) * 12)
        return x * 2 + boost
    return x * 3


def _oracle_keep(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """top-k then top-p on one tempered row, by a full stable sort in float64: the first
    k ids of (logit descending, id ascending), then the shortest prefix reaching p."""
    x = x.double()
    vocab = x.numel()
    order = x.sort(descending=True, stable=True).indices
    n = top_k if 0 < top_k < vocab else vocab
    cand = order[:n]
    if top_p < 1.0:
        cum = torch.softmax(x[cand], dim=0).cumsum(0)
        cand = cand[: min(int((cum < top_p).sum()) + 1, n)]
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[cand] = True
    return keep


# --------------------------------------------------------------------------- basics


def test_make_generator_seeds_reproducibly():
    a, b = make_generator(MAX_SEED), make_generator(MAX_SEED)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    assert not torch.equal(torch.rand(5, generator=make_generator(1)), torch.rand(5, generator=a))
    for bad in (-1, MAX_SEED + 1):
        with pytest.raises(ValueError):
            make_generator(bad)


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_greedy_is_argmax(rows, vocab):
    logits = _logits(rows, vocab, seed=rows + vocab)
    before = logits.clone()
    out = sample(logits, [_params()] * rows, [None] * rows, [[]] * rows)
    assert out.dtype == torch.int64 and out.shape == (rows,)
    assert torch.equal(out, logits.argmax(dim=1))
    assert torch.equal(logits, before)


def test_greedy_ties_pick_the_lowest_id():
    logits = torch.zeros(2, BIG_V)
    logits[0, [7, 30000, 40000]] = 5.0
    assert greedy(logits).tolist() == [7, 0]


def test_repetition_penalty_arithmetic():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0], [2.0, -1.0, 0.5, 0.0, 3.0]])
    # row 0: ids 0, 1 (twice) and 3 penalised by 2; row 1: penalty 1 leaves it alone
    out = apply_repetition_penalty(logits, [[0, 1, 1, 3], [0, 1]], [2.0, 1.0])
    assert out[0].tolist() == [1.0, -2.0, 0.5, 0.0, 3.0]
    assert torch.equal(out[1], logits[1])
    assert logits[0, 0] == 2.0  # out-of-place version leaves the input alone
    # a penalty < 1 rewards instead; tensors are accepted as histories
    inplace = logits.clone()
    apply_repetition_penalty_(inplace, [torch.tensor([0, 1]), []], [0.5, 3.0])
    assert inplace[0, :2].tolist() == [4.0, -0.5] and torch.equal(inplace[1], logits[1])


def test_repetition_penalty_changes_the_greedy_pick():
    logits = torch.tensor([[2.0, 1.5, -3.0]])
    assert sample(logits, [_params(repetition_penalty=2.0)], [None], [[0]]).item() == 1
    assert sample(logits, [_params()], [None], [[0]]).item() == 0


def test_invalid_inputs_raise():
    logits = torch.zeros(2, 17)
    with pytest.raises(ValueError):
        sample(logits, [_params()], [None, None], [[], []])
    with pytest.raises(ValueError):
        sample(logits.double(), [_params()] * 2, [None] * 2, [[], []])
    with pytest.raises(ValueError):
        sample(logits, [_params(repetition_penalty=1.1)] * 2, [None] * 2, [[0], [17]])


def test_empty_batch():
    out = sample(torch.zeros(0, 17), [], [], [])
    assert out.shape == (0,) and out.dtype == torch.int64


@pytest.mark.parametrize("vocab", [17, BIG_V])
@pytest.mark.parametrize("kind", ["gauss", "ties"])
def test_top_sorted_is_the_stable_sorted_prefix(vocab, kind):
    logits = _logits(5, vocab, seed=3, kind=kind)
    for n in (1, 2, 16, 64, 100, 192, 500, vocab):
        if n > vocab:
            continue
        for row in logits:
            expect = row.sort(descending=True, stable=True).indices[:n]
            assert torch.equal(top_sorted(row, n), expect), n


def test_nan_or_inf_row_returns_minus_one_alone():
    logits = _logits(3, 17, seed=1)
    params = [_params(do_sample=True, seed=i) for i in range(3)]
    clean = sample(logits, params, [make_generator(i) for i in range(3)], [[]] * 3)
    for bad in (math.nan, math.inf):
        x = logits.clone()
        x[1, 4] = bad
        out = sample(x, params, [make_generator(i) for i in range(3)], [[]] * 3)
        assert out.tolist() == [int(clean[0]), -1, int(clean[2])]


# --------------------------------------------------------------------------- filtering


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_top_k_1_and_tiny_top_p_are_greedy(vocab):
    rows = 17
    logits = _logits(rows, vocab, seed=5, kind="peaked")
    expect = logits.argmax(dim=1)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 3, "top_p": 1e-6}):
        params = [_params(do_sample=True, temperature=1.3, seed=i, **kw) for i in range(rows)]
        gens = [make_generator(i) for i in range(rows)]
        assert torch.equal(sample(logits, params, gens, [[]] * rows), expect), kw


@pytest.mark.parametrize("vocab", [17, 1000, BIG_V])
@pytest.mark.parametrize("kind", ["gauss", "ties", "peaked"])
def test_apply_top_k_top_p_matches_sort_oracle(vocab, kind):
    settings_ = [
        (0, 0.5),
        (0, 0.9),
        (0, 0.999),
        (1, 1.0),
        (5, 1.0),
        (40, 0.8),
        (200, 0.95),
        (vocab - 1, 0.7),
        (vocab, 0.9),
        (3, 0.3),
    ]
    logits = _logits(len(settings_), vocab, seed=vocab, kind=kind)
    top_k = torch.tensor([k for k, _ in settings_])
    top_p = torch.tensor([p for _, p in settings_], dtype=torch.float32)
    masked = apply_top_k_top_p(logits, top_k, top_p)
    for row, (k, p) in enumerate(settings_):
        kept = torch.isfinite(masked[row])
        # float32 vs float64 cumulative sums may disagree right at the p boundary
        low = _oracle_keep(logits[row], k, max(p - 1e-4, 1e-9) if p < 1 else 1.0)
        high = _oracle_keep(logits[row], k, min(p + 1e-4, 1.0) if p < 1 else 1.0)
        assert bool((low <= kept).all()) and bool((kept <= high).all()), (row, k, p)
        assert torch.equal(masked[row][kept], logits[row][kept])


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    vocab=st.sampled_from([2, 17, 100, 16384, BIG_V]),
    kind=st.sampled_from(["gauss", "ties", "peaked"]),
    top_k=st.one_of(st.just(0), st.integers(1, 70), st.integers(1, 60000)),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    temperature=st.floats(0.05, 3.0),
)
def test_filtered_sampling_never_picks_an_excluded_token(
    seed, vocab, kind, top_k, top_p, temperature
):
    rows = 4
    logits = _logits(rows, vocab, seed, kind)
    params = [
        _params(do_sample=True, top_k=top_k, top_p=top_p, temperature=temperature, seed=i)
        for i in range(rows)
    ]
    gens = [make_generator(seed + i) for i in range(rows)]
    p_hi = min(top_p + 1e-4, 1.0) if top_p < 1 else 1.0
    allowed = [_oracle_keep(logits[r] / temperature, top_k, p_hi) for r in range(rows)]
    for _ in range(3):
        out = sample(logits, params, gens, [[]] * rows)
        for r in range(rows):
            assert allowed[r][out[r]], (r, int(out[r]))


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_top_k_1_equals_greedy_with_tied_maxima(vocab):
    """Issue "top_k=1 must equal greedy": three ids tie at the maximum; top_k=1 (any
    temperature, any seed) returns the lowest of them, as greedy does."""
    rows = 6
    logits = torch.zeros(rows, vocab)
    for r in range(rows):
        logits[r, torch.randperm(vocab, generator=torch.Generator().manual_seed(r))[:3]] = 2.0
    expect = sample(logits, [_params()] * rows, [None] * rows, [[]] * rows)
    assert torch.equal(expect, logits.max(dim=1).indices)
    for seed in range(5):
        params = [_params(do_sample=True, top_k=1, temperature=2.0, seed=seed)] * rows
        gens = [make_generator(seed * 100 + r) for r in range(rows)]
        assert torch.equal(sample(logits, params, gens, [[]] * rows), expect)


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_sample_matches_the_reference(vocab):
    """The dispatched backend picks what sample_ref picks for the same seeds."""
    rows = 24
    rng = torch.Generator().manual_seed(vocab)
    params = [_random_params(rng) for _ in range(rows)]
    logits = _logits(rows, vocab, seed=11, kind="peaked")
    histories = [torch.randint(0, vocab, (30,), generator=rng).tolist() for _ in range(rows)]
    got = sample(logits, params, [make_generator(p.seed) for p in params], histories)
    want = sample_ref(logits, params, [make_generator(p.seed) for p in params], histories)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------- distributions


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def _assert_matches(freq: torch.Tensor, probs: torch.Tensor, draws: int):
    tol = 5 * (probs * (1 - probs) / draws).sqrt() + 2e-3
    assert bool(((freq - probs).abs() <= tol).all()), (freq, probs)


def test_temperature_sampling_matches_softmax():
    vocab, draws, temperature = 17, 20000, 0.7
    row = _logits(1, vocab, seed=2)[0]
    logits = row.expand(draws, vocab)
    params = [_params(do_sample=True, temperature=temperature)] * draws
    gens = [make_generator(1000 + i) for i in range(draws)]
    tokens = sample(logits, params, gens, [[]] * draws)
    _assert_matches(
        _frequencies(tokens, vocab), torch.softmax(row.double() / temperature, 0), draws
    )


def test_top_k_top_p_sampling_matches_renormalised_softmax():
    vocab, draws = 17, 20000
    row = _logits(1, vocab, seed=4)[0] / 3
    keep = _oracle_keep(row, 6, 0.8)
    assert 1 < int(keep.sum()) < 6
    probs = torch.softmax(row.double().masked_fill(~keep, -math.inf), 0)
    params = [_params(do_sample=True, top_k=6, top_p=0.8)] * draws
    gens = [make_generator(i) for i in range(draws)]
    tokens = sample(row.expand(draws, vocab), params, gens, [[]] * draws)
    _assert_matches(_frequencies(tokens, vocab), probs, draws)


# --------------------------------------------------------------------------- reproducibility


def _run(logit_steps, params, gens, vocab) -> list[int]:
    history: list[int] = [1, 2, 3]
    out = []
    for step_logits in logit_steps:
        token = int(sample(step_logits[None, :], [params], [gens], [history])[0])
        history.append(token)
        out.append(token)
    return out


@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_same_seed_same_sequence(vocab):
    steps = _logits(50, vocab, seed=8, kind="peaked")
    params = _params(do_sample=True, top_p=0.95, temperature=1.2, seed=42)
    first = _run(steps, params, make_generator(42), vocab)
    assert first == _run(steps, params, make_generator(42), vocab)
    assert first != _run(steps, params, make_generator(43), vocab)


TARGETS = {
    "plain": {"do_sample": True},
    "temperature": {"do_sample": True, "temperature": 0.6},
    "top_k": {"do_sample": True, "top_k": 40, "temperature": 1.5},
    "top_p": {"do_sample": True, "top_p": 0.9},
    "top_k_top_p_penalty": {
        "do_sample": True,
        "top_k": 300,
        "top_p": 0.7,
        "repetition_penalty": 1.3,
    },
    "greedy_penalty": {"repetition_penalty": 1.2},
}


def _random_params(gen: torch.Generator) -> SamplingParams:
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    return SamplingParams(
        do_sample=pick([True, True, True, False]),
        temperature=pick([0.3, 0.7, 1.0, 1.8]),
        top_k=pick([0, 0, 1, 20, 50, 1000]),
        top_p=pick([1.0, 1.0, 0.5, 0.9, 0.99]),
        repetition_penalty=pick([1.0, 1.0, 1.2, 0.8]),
        min_p=pick([0.0, 0.0, 0.05]),
        seed=int(torch.randint(2**62, (1,), generator=gen)),
    )


@pytest.mark.parametrize("vocab", [17, BIG_V])
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_seeded_row_is_independent_of_its_batch(vocab, target):
    """A seeded row gives the same 50 tokens alone and inside a batch of 5 other rows."""
    steps, seed = 50, 1234
    params = _params(seed=seed, **TARGETS[target])
    logits = [
        _logits(6, vocab, seed=100 + s, kind=("peaked", "gauss")[s % 2]) for s in range(steps)
    ]
    alone = _run([step[2] for step in logits], params, make_generator(seed), vocab)

    rng = torch.Generator().manual_seed(7)
    others = [_random_params(rng) for _ in range(5)]
    batch_params = others[:2] + [params] + others[2:]
    gens = [make_generator(p.seed) for p in batch_params]
    histories = [[5, 6, 7] + [r] for r in range(6)]
    histories[2] = [1, 2, 3]
    together = []
    for step in logits:
        out = sample(step, batch_params, gens, histories)
        for r in range(6):
            histories[r].append(int(out[r]))
        together.append(int(out[2]))
    assert together == alone


@pytest.mark.parametrize("vocab", [17, BIG_V])
@pytest.mark.parametrize("kind", ["ties", "peaked"])
def test_every_row_alone_equals_its_batch_result(vocab, kind):
    """One step, 24 random rows: each row alone picks what it picks in the batch, also
    with integer logits where equal values are everywhere (tie order must not leak)."""
    rows = 24
    rng = torch.Generator().manual_seed(vocab)
    params = [_random_params(rng) for _ in range(rows)]
    logits = _logits(rows, vocab, seed=9, kind=kind)
    histories = [torch.randint(0, vocab, (30,), generator=rng).tolist() for _ in range(rows)]
    together = sample(logits, params, [make_generator(p.seed) for p in params], histories)
    for r, p in enumerate(params):
        alone = sample(logits[r : r + 1], [p], [make_generator(p.seed)], [histories[r]])
        assert int(alone[0]) == int(together[r]), (r, p)


# --------------------------------------------------------------------------- odd sizes


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("vocab", [17, BIG_V])
def test_mixed_batches_of_odd_sizes(rows, vocab):
    rng = torch.Generator().manual_seed(rows * vocab)
    params = [_random_params(rng) for _ in range(rows)]
    logits = _logits(rows, vocab, seed=rows, kind="peaked")
    before = logits.clone()
    histories = [torch.randint(0, vocab, (20,), generator=rng).tolist() for _ in range(rows)]
    out = sample(logits, params, [make_generator(p.seed) for p in params], histories)
    assert out.shape == (rows,) and out.dtype == torch.int64
    assert bool(((out >= 0) & (out < vocab)).all())
    assert torch.equal(logits, before)
    for r, p in enumerate(params):
        if p.greedy:
            penalised = apply_repetition_penalty(
                logits[r : r + 1], [histories[r]], [p.repetition_penalty]
            )
            assert int(out[r]) == int(penalised.argmax())


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    from tokenserve.engine.sampler import apply_presence_frequency_penalties_

    logits = torch.zeros(2, 6)
    apply_presence_frequency_penalties_(logits, [[1, 1, 3], []], [0.5, 0.5], [0.25, 0.25])
    assert logits[0].tolist() == [0.0, -1.0, 0.0, -0.75, 0.0, 0.0]
    assert logits[1].tolist() == [0.0] * 6
    # in sample(): the prompt part of the history is not penalised
    x = torch.tensor([[0.0, 1.0, 0.9]])
    p = SamplingParams(frequency_penalty=2.0, seed=0)
    assert sample(x, [p], [None], [[1, 1]], num_prompt_tokens=[2]).item() == 1
    assert sample(x, [p], [None], [[1, 1]], num_prompt_tokens=[1]).item() == 2
