"""Batched next-token sampling: the pure-torch reference for the fused C++ kernel.

Per row, in the order HF ``generate`` and TGI apply their logits processors/warpers::

    logits --repetition penalty--> greedy? --yes--> argmax (first maximal id)
                                      |no
                                      v
            / temperature --> top-k --> top-p --> softmax --> inverse-CDF draw

Contract every implementation (this module, ``csrc/`` later) follows:

* **Repetition penalty** (CTRL, Keskar et al. 2019; HF ``RepetitionPenaltyLogitsProcessor``):
  for each distinct id in the row's history (prompt + generated), ``x > 0 -> x / p``,
  else ``x * p``.
* **top-k** keeps every token whose logit is >= the k-th largest logit (ties at the
  boundary are all kept, as HF ``TopKLogitsWarper`` and TGI do); ``k == 0`` or ``k >= V``
  is off.
* **top-p** (Holtzman et al. 2019) works on the softmax of the top-k survivors: keep the
  smallest set of most likely tokens whose mass is >= p (the top token is always kept;
  tokens tied with the last kept one are kept too); ``p == 1.0`` is off.
* **Draw**: one float32 uniform ``u = torch.rand(1, generator=g)`` per *sampled* row and
  call (greedy rows draw nothing); the token is the smallest vocabulary id ``j`` among
  the kept ones with ``cumsum(q)[j] > u * sum(q)``, ``q = softmax(logits / T)`` over the
  kept ids taken in vocabulary order. Every row has its own generator, and every op is
  row-wise with a result that does not depend on the other rows (no cross-row
  reductions, no tie order that depends on a batch-wide width), so a seeded request gets
  the same tokens whatever else shares the batch (tested bit for bit). The C++ kernel
  must consume its generator the same way; its float rounding may differ.

Tensor layout: ``B`` rows (batch), ``V`` vocabulary entries; logits are float32 ``[B, V]``,
never modified in place by :func:`sample`.

Speed (why the code is not a plain full sort): at ``V = 49152`` a full sort costs ~3 ms per
row on CPU. top-k and top-p only ever keep a short head of the sorted row, so they find an
exact sorted *prefix* of ``L`` entries instead (:func:`top_n`, via chunk maxima) and widen
it (``L -> 512 -> 4096 -> 16384 -> V``) only for rows whose kept set does not provably fit.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import NamedTuple

import torch

from tokenserve.sampling_params import MAX_SEED, SamplingParams

#: Chunk sizes for the chunk-maximum top-n search (:func:`top_n`), largest first.
_CHUNKS = (32, 16, 8)
#: Prefix width tried first for top-p-only rows; retries take the next of ``_WIDER`` up to
#: V/2 (``torch.topk``: 0.3-0.6 ms per row at V = 49152), then V (a sort: ~1.5-3 ms).
_FIRST_PREFIX = 64
_WIDER = (512, 4096, 16384)

#: Token ids of one request (prompt + generated): a list, or a 1-D integer tensor.
History = Sequence[int] | torch.Tensor


def make_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed`` (int in ``[0, 2^63-1]``).

    Raises:
        ValueError: ``seed`` outside ``[0, 2^63-1]`` (the range MindIE accepts).
    """
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, {MAX_SEED}], got {seed}")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


# --------------------------------------------------------------------------- logits processors


def _history_tensor(history: History) -> torch.Tensor:
    """``history`` as an int64 tensor (list -> tensor through ``array``: ~4x faster)."""
    if isinstance(history, torch.Tensor):
        return history.to(torch.int64).reshape(-1)
    if len(history) == 0:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", history), dtype=torch.int64)


def apply_repetition_penalty_(
    logits: torch.Tensor,
    histories: Sequence[History],
    penalties: Sequence[float],
) -> torch.Tensor:
    """In place: CTRL repetition penalty (Keskar et al. 2019), as HF/TGI apply it.

    For every distinct token id ``t`` in ``histories[i]``: ``logits[i, t] /= p`` when
    ``logits[i, t] > 0``, else ``logits[i, t] *= p`` (``p = penalties[i]``). Repeated ids
    are penalised once. Rows with ``p == 1.0`` or an empty history are untouched (and
    their history is never read).

    Args:
        logits: float ``[B, V]``, contiguous; modified in place.
        histories: ``B`` sequences (or 1-D int tensors) of token ids in ``[0, V)``:
            prompt + generated ids.
        penalties: ``B`` floats > 0.

    Returns:
        ``logits``.

    Raises:
        ValueError: length mismatch, or a history id outside ``[0, V)``.
    """
    num_rows, vocab = logits.shape
    if len(histories) != num_rows or len(penalties) != num_rows:
        raise ValueError(
            f"need one history and penalty per row: {num_rows} rows, "
            f"{len(histories)} histories, {len(penalties)} penalties"
        )
    assert logits.is_contiguous(), "logits must be contiguous"
    flat_ids: list[torch.Tensor] = []
    factors: list[torch.Tensor] = []
    for row in range(num_rows):
        penalty = float(penalties[row])
        if penalty == 1.0 or len(histories[row]) == 0:
            continue
        ids = _history_tensor(histories[row])
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"row {row}: history id out of range [0, {vocab}): {lo}..{hi}")
        flat_ids.append(ids + row * vocab)  # offset into the flattened [B*V] view
        factors.append(torch.full((ids.numel(),), penalty, dtype=logits.dtype))
    if not flat_ids:
        return logits
    index = torch.cat(flat_ids)
    penalty_t = torch.cat(factors)
    flat = logits.view(-1)
    # Gather every value before writing: a repeated id then writes the same value twice.
    picked = flat[index]
    flat[index] = torch.where(picked > 0, picked / penalty_t, picked * penalty_t)
    return logits


def apply_presence_frequency_penalties_(
    logits: torch.Tensor,
    outputs: Sequence[History],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> torch.Tensor:
    """In place: OpenAI's presence and frequency penalties (OpenAI API reference,
    "Parameter details"): ``logits[i, t] -= frequency[i] * count_i(t) +
    presence[i] * (count_i(t) > 0)``, counting ``t`` in the row's *generated* tokens.

    Args:
        logits: float ``[B, V]``; modified in place.
        outputs: ``B`` generated-token id sequences (prompt excluded), ids in ``[0, V)``.
        presence, frequency: ``B`` floats in [-2, 2]; rows with both 0 are untouched.

    Returns:
        ``logits``.
    """
    vocab = logits.shape[1]
    for row, ids in enumerate(outputs):
        pres, freq = float(presence[row]), float(frequency[row])
        if (pres == 0.0 and freq == 0.0) or len(ids) == 0:
            continue
        counts = torch.bincount(_history_tensor(ids), minlength=vocab)[:vocab]
        counts = counts.to(logits.dtype)
        logits[row] -= freq * counts + pres * (counts > 0).to(logits.dtype)
    return logits


def apply_repetition_penalty(
    logits: torch.Tensor,
    histories: Sequence[History],
    penalties: Sequence[float],
) -> torch.Tensor:
    """Out-of-place :func:`apply_repetition_penalty_`: returns a penalised copy ``[B, V]``."""
    return apply_repetition_penalty_(logits.clone(), histories, penalties)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row, the lowest id among equal maxima: int64 ``[B]`` from float ``[B, V]``.

    ``torch.max(dim)`` rather than ``torch.argmax``: same answer (both return the first
    maximal index), ~3x faster on CPU at V = 49152.
    """
    return logits.max(dim=1).indices


# --------------------------------------------------------------------------- top-k / top-p


def top_n(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` largest logits of each row, in descending order, and their ids.

    Values are exact (the row's order statistics); which id comes first among *equal*
    values is unspecified (callers here only rely on the values, see :func:`_kept_prefix`).

    Chunk-maximum search when ``n`` is small against ``V``: split each row into chunks of
    ``c`` elements, keep the ``n`` chunks with the largest maxima, and take the top ``n``
    of their ``n * c`` elements. Exact: those ``n`` chunk maxima are ``n`` elements >=
    ``tau`` (the n-th largest chunk maximum), so the n-th largest element is >= ``tau``,
    while every element outside the kept chunks is <= ``tau``. ``torch.topk`` on the whole
    row costs ~0.1 ms per row at V = 49152 whatever ``n``; this is 2-10x cheaper.

    Args:
        logits: float ``[B, V]``, contiguous.
        n: ``1 <= n <= V``.

    Returns:
        ``(values [B, n] float, ids [B, n] int64)``.
    """
    num_rows, vocab = logits.shape
    assert 1 <= n <= vocab, (n, vocab)
    if n == vocab:
        return logits.sort(dim=1, descending=True)
    chunk = next((c for c in _CHUNKS if vocab % c == 0 and n * c * 4 <= vocab), 0)
    if not chunk:
        return logits.topk(n, dim=1)
    chunks = logits.view(num_rows, vocab // chunk, chunk)
    best_chunks = chunks.amax(dim=2).topk(n, dim=1).indices  # [B, n]
    members = chunks.gather(1, best_chunks.unsqueeze(2).expand(num_rows, n, chunk))
    values, pos = members.view(num_rows, n * chunk).topk(n, dim=1)
    ids = best_chunks.gather(1, pos // chunk) * chunk + pos % chunk
    return values, ids


def _exp_weights(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``exp((x - max x) / T)`` per row: float32 ``[R, V]`` in ``(0, 1]``, a new tensor.

    ``softmax(x / T)`` up to the per-row factor; computed in one buffer because at
    V = 49152 every extra ``[64, V]`` temporary costs page faults, not only bandwidth.
    ``logits`` float32 ``[R, V]`` is not modified; ``temperatures`` float32 ``[R]``.
    """
    weights = logits - logits.amax(dim=1, keepdim=True)
    if bool((temperatures != 1.0).any()):
        weights.div_(temperatures.unsqueeze(1))
    return weights.exp_()


def _row_total(weights: torch.Tensor) -> torch.Tensor:
    """Sum of each row of float32 ``[R, V]``: ``[R]``.

    Summed as chunk sums then a sequential cumsum, not ``sum(dim=1)``: for a single row
    torch splits a long reduction across threads, so a row's total would depend on how
    many rows share the batch (in the last bits, which can flip a draw).
    """
    num_rows, vocab = weights.shape
    if vocab % 64 == 0:
        weights = weights.view(num_rows, vocab // 64, 64).sum(dim=2)
    return weights.cumsum(dim=1)[:, -1]


def _kept_prefix(
    values: torch.Tensor,
    weights: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    row_mass: torch.Tensor,
    whole_row: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """top-k then top-p on a sorted prefix of each row.

    Layout of one row (``L`` entries, descending logits)::

        position   0 .............. m-1 | m ............. L-1
                   kept (logit >= tau)  | dropped (logit < tau)

    The answer is exact when the prefix provably holds every kept token: its last entry
    is dropped (``m < L``), or the prefix is the whole row. Other rows come back
    unresolved and need a wider prefix. Which id sits where among equal logits does not
    matter: equal logits carry equal weights, so every cumulative sum at the end of a
    run of equal values, and hence ``tau``, is the same in any order.

    Args:
        values: float32 ``[R, L]``, tempered logits, sorted descending.
        weights: float32 ``[R, L]``, ``exp(values)`` up to a per-row factor.
        top_k: int64 ``[R]``; 0 = off, else ``1 <= k < L`` or ``L`` = whole row.
        top_p: float32 ``[R]``; 1.0 = off.
        row_mass: float32 ``[R]``, the weight of the whole row, in the units of
            ``weights``: the top-p reference for rows with top-k off (with top-k on,
            top-p is relative to the weight of the top-k survivors, as in HF).
        whole_row: the prefix is the entire row (``L == V``).

    Returns:
        ``(kept count m [R] int64, threshold tau [R] float32, resolved [R] bool)``.
    """
    width = values.shape[1]
    cdf = weights.cumsum(dim=1)
    k_on = top_k > 0
    # top-k: tau_k = k-th largest logit; every entry >= tau_k survives (ties included).
    kth = (torch.where(k_on, top_k, width) - 1).clamp(max=width - 1).unsqueeze(1)
    tau_k = torch.where(k_on.unsqueeze(1), values.gather(1, kth), float("-inf"))
    kept_k = (values >= tau_k).sum(dim=1, keepdim=True)
    mass = torch.where(k_on.unsqueeze(1), cdf.gather(1, kept_k - 1), row_mass.unsqueeze(1))
    # top-p: the first position whose cumulative mass reaches p * mass is the last one
    # needed; it sits at index #{j < kept_k - 1 : cdf[j] < p * mass}.
    positions = torch.arange(width).unsqueeze(0)
    short = (cdf < top_p.unsqueeze(1) * mass) & (positions < kept_k - 1)
    last_needed = short.sum(dim=1, keepdim=True)
    tau = torch.where((top_p < 1.0).unsqueeze(1), values.gather(1, last_needed), tau_k)
    kept = (values >= tau).sum(dim=1)
    resolved = kept < width if not whole_row else torch.ones_like(kept, dtype=torch.bool)
    return kept, tau.squeeze(1), resolved


class _Kept(NamedTuple):
    """Rows resolved on one prefix width ``L`` (see :func:`_kept_prefix`)."""

    rows: torch.Tensor  # int64 [r]: indexes into the rows given to _filter
    ids: torch.Tensor  # int64 [r, L]: token ids, descending logit
    weights: torch.Tensor  # float32 [r, L]: their exp(logit / T), up to a row factor
    kept: torch.Tensor  # int64 [r]: the first `kept` entries survive
    tau: torch.Tensor  # float32 [r]: the smallest surviving tempered logit


def _filter(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> list[_Kept]:
    """top-k/top-p for rows that have at least one of them on, on sorted prefixes.

    Rows with top-k on work in the prefix alone: the temperature is applied to the
    prefix values only (``x / T`` keeps the order) and their weights are
    ``exp(v - v_max)``. Rows with top-p alone need the weight of the whole tempered row
    as the top-p reference mass (:func:`_exp_weights`, :func:`_row_total`). The first
    prefix is ``max(64, k + 1)`` wide; a row whose kept set does not fit is retried wider
    (``_WIDER``), then on the whole row (a full sort, reached only by very flat
    distributions: top-p 0.95 on SmolLM2 needs > 16384 tokens only far above T = 1.3).

    Args:
        logits: float32 ``[R, V]``, penalised, **not** tempered; contiguous.
        temperatures: float32 ``[R]``.
        top_k: int64 ``[R]``, 0 = off (values >= V must already be 0).
        top_p: float32 ``[R]``, 1.0 = off; every row has ``k > 0`` or ``p < 1``.

    Returns:
        One :class:`_Kept` per prefix width used; together they cover every row once.
    """
    vocab = logits.shape[1]
    done = []
    for rows in ((top_k > 0).nonzero().squeeze(1), (top_k == 0).nonzero().squeeze(1)):
        if rows.numel() == 0:
            continue
        x = logits if rows.numel() == logits.shape[0] else logits.index_select(0, rows)
        temp, k, p = temperatures[rows], top_k[rows], top_p[rows]
        if bool(k[0] > 0):  # top-k rows: weights relative to the prefix maximum
            full, mass = None, torch.ones(rows.numel())
        else:  # top-p rows: weights relative to the row maximum, and the row's total
            full = _exp_weights(x, temp)
            mass = _row_total(full)
        width = min(vocab, max(_FIRST_PREFIX, int(k.max()) + 1))
        while True:
            values, ids = top_n(x, width)
            values = values / temp.unsqueeze(1)
            if full is None:
                weights = torch.exp(values - values[:, :1])
            else:
                weights = full.gather(1, ids)
            kept, tau, ok = _kept_prefix(values, weights, k, p, mass, width == vocab)
            if bool(ok.all()):
                done.append(_Kept(rows, ids, weights, kept, tau))
                break
            if bool(ok.any()):  # keep the unresolved rows only (copies: skip if none left)
                done.append(_Kept(rows[ok], ids[ok], weights[ok], kept[ok], tau[ok]))
                retry = (~ok).nonzero().squeeze(1)
                rows, x, temp, k, p = rows[retry], x[retry], temp[retry], k[retry], p[retry]
                full, mass = (None if full is None else full[retry]), mass[retry]
            width = next((w for w in _WIDER if width < w <= vocab // 2), vocab)
    return done


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """top-k then top-p filtering (HF ``TopKLogitsWarper`` then ``TopPLogitsWarper``).

    Dropped tokens get ``-inf``; ties at either boundary are kept (module docstring).

    Args:
        logits: float32 ``[B, V]``, already divided by the temperature.
        top_k: int64 ``[B]``; 0 or >= V = off.
        top_p: float32 ``[B]`` in ``(0, 1]``; 1.0 = off.

    Returns:
        A new float32 ``[B, V]`` tensor.
    """
    num_rows, vocab = logits.shape
    assert top_k.shape == (num_rows,) and top_p.shape == (num_rows,)
    top_k = torch.where(top_k >= vocab, 0, top_k)
    tau = torch.full((num_rows,), float("-inf"))
    active = ((top_k > 0) | (top_p < 1.0)).nonzero().squeeze(1)
    if active.numel():
        x = logits.index_select(0, active)
        ones = torch.ones(active.numel())
        for part in _filter(x, ones, top_k[active], top_p[active]):
            tau[active[part.rows]] = part.tau
    return logits.masked_fill(logits < tau.unsqueeze(1), float("-inf"))


# --------------------------------------------------------------------------- the draw


def _inverse_cdf(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Position ``j`` of the first ``cdf[j] > u * cdf[-1]`` per row.

    ``cdf``: float32 ``[R, L]`` non-decreasing (a cumsum of non-negative terms);
    ``uniforms``: float32 ``[R]`` in ``[0, 1)``. Returns int64 ``[R]``. The result is
    capped at the first position where the cdf reaches its total, so a rounding of
    ``u * total`` up to ``total`` can never land on a zero-probability entry.
    """
    total = cdf[:, -1:].contiguous()
    target = uniforms.unsqueeze(1) * total
    pos = torch.searchsorted(cdf, target, right=True)
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(pos, last).squeeze(1)


def draw_uniforms(generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One float32 ``U[0, 1)`` per row from the row's own generator: ``[R]``.

    ``None`` uses torch's default generator (no reproducibility).
    """
    draws = [
        torch.rand(1, generator=gen).item() if gen is not None else torch.rand(1).item()
        for gen in generators
    ]
    return torch.tensor(draws, dtype=torch.float32)


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Inverse-CDF draw in vocabulary order, one uniform per row.

    Args:
        probs: float32 ``[B, V]``, non-negative, each row with a positive sum (need not be
            normalised).
        generators: ``B`` generators (``None`` = torch's default).

    Returns:
        int64 ``[B]``: the smallest id ``j`` with ``cumsum(probs)[j] > u * sum(probs)``.
    """
    assert probs.shape[0] == len(generators)
    return _inverse_cdf(probs.cumsum(dim=1), draw_uniforms(generators))


def _sample_filtered(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Draw for rows with top-k and/or top-p on; arguments as in :func:`_filter`.

    Returns int64 ``[R]``.
    """
    vocab = logits.shape[1]
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    for part in _filter(logits, temperatures, top_k, top_p):
        # Re-order the survivors by token id (dropped ones last, with zero weight) so the
        # draw walks the vocabulary in the same order as for an unfiltered row.
        dropped = torch.arange(part.ids.shape[1]).unsqueeze(0) >= part.kept.unsqueeze(1)
        by_id, order = part.ids.masked_fill(dropped, vocab).sort(dim=1)
        mass = part.weights.masked_fill(dropped, 0.0).gather(1, order)
        pos = _inverse_cdf(mass.cumsum(dim=1), uniforms[part.rows])
        tokens[part.rows] = by_id.gather(1, pos.unsqueeze(1)).squeeze(1)
    return tokens


# --------------------------------------------------------------------------- entry point


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``: the tensor itself when ``rows`` is every row in order, else a copy."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, torch.tensor(rows, dtype=torch.int64))


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[History],
    num_prompt_tokens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Pick the next token of every row (the exact rules are in the module docstring).

    Rows that take the same path are computed together: greedy rows in one ``max``;
    unfiltered sampled rows in one exp + cumsum over the vocabulary; rows with top-k on
    in one sorted prefix; rows with top-p alone in one exp + sorted prefix. Only
    the uniform draws loop over rows, each from the row's own generator.

    Args:
        logits: float32 ``[B, V]``, the last position's logits; not modified.
        params: ``B`` :class:`SamplingParams` (reads ``greedy``, ``temperature``,
            ``top_k``, ``top_p``, ``repetition_penalty``).
        generators: ``B`` per-request CPU generators (:func:`make_generator`); ``None``
            uses torch's default generator. A sampled row consumes exactly one
            ``torch.rand(1)`` from its generator per call; a greedy row none.
        histories: ``B`` prompt + generated token ids (lists or 1-D int tensors), read
            only for rows with a penalty on.
        num_prompt_tokens: ``B`` prompt lengths within ``histories``; the presence and
            frequency penalties (applied after the repetition penalty) count only the
            generated part. None: no row has those penalties.

    Returns:
        int64 ``[B]``, token ids in ``[0, V)``.

    Raises:
        ValueError: ``logits`` not 2-D float32, a length mismatch, or a history id
            outside ``[0, V)``.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 [B, V], got {logits.dtype} {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    if not len(params) == len(generators) == len(histories) == num_rows:
        raise ValueError(
            f"need one params/generator/history per row: {num_rows} rows, {len(params)} "
            f"params, {len(generators)} generators, {len(histories)} histories"
        )
    logits = logits.contiguous()
    tokens = torch.empty(num_rows, dtype=torch.int64)

    def prepare(rows: list[int]) -> torch.Tensor:
        """Penalised logits of ``rows`` (a copy, or ``logits`` itself if untouched)."""
        x = _rows(logits, rows)
        if any(params[r].repetition_penalty != 1.0 for r in rows):
            x = x.clone() if x is logits else x
            apply_repetition_penalty_(
                x,
                [histories[r] for r in rows],
                [params[r].repetition_penalty for r in rows],
            )
        if any(params[r].presence_penalty or params[r].frequency_penalty for r in rows):
            assert num_prompt_tokens is not None, "presence/frequency penalty needs prompt lengths"
            x = x.clone() if x is logits else x
            apply_presence_frequency_penalties_(
                x,
                [histories[r][num_prompt_tokens[r]:] for r in rows],
                [params[r].presence_penalty for r in rows],
                [params[r].frequency_penalty for r in rows],
            )
        return x

    def temperatures(rows: list[int]) -> torch.Tensor:
        return torch.tensor([params[r].temperature for r in rows], dtype=torch.float32)

    greedy_rows, plain, top_k_rows, top_p_rows = [], [], [], []
    for r, prm in enumerate(params):
        if prm.greedy:
            greedy_rows.append(r)
        elif 0 < prm.top_k < vocab:
            top_k_rows.append(r)
        elif prm.top_p < 1.0:
            top_p_rows.append(r)
        else:
            plain.append(r)
    if greedy_rows:
        tokens[greedy_rows] = greedy(prepare(greedy_rows))
    if plain:
        cdf = _exp_weights(prepare(plain), temperatures(plain)).cumsum_(dim=1)
        tokens[plain] = _inverse_cdf(cdf, draw_uniforms([generators[r] for r in plain]))
    filtered = top_k_rows + top_p_rows
    if filtered:
        tokens[filtered] = _sample_filtered(
            prepare(filtered),
            temperatures(filtered),
            torch.tensor(
                [params[r].top_k for r in top_k_rows] + [0] * len(top_p_rows), dtype=torch.int64
            ),
            torch.tensor([params[r].top_p for r in filtered], dtype=torch.float32),
            draw_uniforms([generators[r] for r in filtered]),
        )
    return tokens
