"""Batched next-token sampling: the pure-torch reference of the fused C++ kernel
(``csrc/sampling.cpp``, ``tokenserve._C.sample``).

Contract (both implementations; ``B`` rows, vocabulary ``V``, logits float32 ``[B, V]``,
never modified). Per row, in this order:

1. **Repetition penalty** (CTRL, Keskar et al. 2019; HF ``RepetitionPenaltyLogitsProcessor``):
   for each *distinct* id in the row's history (prompt + generated), ``x > 0 -> x / p``
   else ``x * p``. ``p`` is taken as float32 and clamped into ``[FLT_MIN, FLT_MAX]``, and a
   quotient that overflows is clamped to ``FLT_MAX``: a penalty of ``1e-300`` or ``1e300``
   never yields NaN (``x * p`` may reach ``-inf``: that token is then never picked).
2. **Presence / frequency penalties** (OpenAI): over the *generated* ids only,
   ``x -= s`` with ``s = freq * count + pres`` for ``count > 0`` (float32: the product,
   then the sum, each rounded, no FMA; ``s`` clamped to ``[-FLT_MAX, FLT_MAX]``; a result
   of ``+inf`` is clamped to ``FLT_MAX``).
3. **Greedy** rows return the argmax of the penalised row (lowest id among equal maxima).
4. **Temperature**: ``T`` float32 clamped into ``[FLT_MIN, FLT_MAX]``; the weight of id
   ``j`` is ``w_j = float32(exp(float64(max(float32((x_j - m) / T), -32))))`` with ``m``
   the row maximum: in ``[0, 1]``, exactly 1 for the maximum, no overflow, and a tiny ``T``
   (1e-300 is 0 in float32, hence ``FLT_MIN``) gives weight 0 to every non-maximal token
   (greedy-like). The exponential is evaluated in float64 and rounded once, so any
   accurate ``exp`` gives the same float32 weight (up to a ~2^-28 chance per element).
   Every mass below is an integer: ``q_j = trunc(w_j * 2^30)`` (int64 sums are exact, so
   their order does not matter); a token with ``w_j < 2^-30`` (more than ~20.8 nats under
   the maximum at ``T``) has ``q_j = 0`` and is never drawn.
5. **Order** of a row: logit (penalised, before temperature) descending, then id
   ascending.
6. **top-k** keeps *exactly* the first ``k`` tokens of that order (ties at the boundary go
   to the lowest ids), so ``top_k = 1`` is the greedy token. ``k == 0`` or ``k >= V``: off.
7. **top-p** keeps the smallest prefix (of that order, among the top-k survivors, or the
   whole row when top-k is off) whose mass reaches ``p``: the first ``n`` with
   ``float64(sum_{i<n} q) >= float64(p) * float64(M)``, ``M`` the mass of the top-k
   survivors (the whole row's when top-k is off); at least the first token; ``p >= 1``:
   off.
8. **min-p** (vLLM/HF): of the survivors, keep those with ``w_j >= min_p`` (``prob >=
   min_p * max_prob``: the maximum has ``w = 1``, so it always survives). ``0``: off.
9. **Draw**: ``u`` float32 in ``[0, 1)``; the token is the smallest kept id ``j``
   (walking kept ids in vocabulary order) with ``float64(cumsum(q)[j]) > float64(u) *
   float64(sum(q))``.

A row whose input logits contain NaN or ``+inf``, or whose penalised logits are all
``-inf``, cannot be sampled: its token is ``-1``; the other rows are unaffected. A token is
otherwise always in ``[0, V)``. Every step is row-wise with exact or order-fixed
arithmetic, so a row's token does not depend on the other rows of the batch.

Generators: :func:`draw_uniforms` takes exactly one ``torch.rand(1, generator=g)`` per
*sampled* (non-greedy) row per call, from the row's own generator (greedy rows draw
nothing), so a seeded request is reproducible whatever shares its batch.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import NamedTuple

import torch

from tokenserve.sampling_params import SamplingParams

#: Token ids of one request (prompt + generated): a list, or a 1-D integer tensor.
History = Sequence[int] | torch.Tensor

FLT_MIN = torch.finfo(torch.float32).tiny
FLT_MAX = torch.finfo(torch.float32).max
#: Fixed-point scale of the masses: ``q = trunc(w * Q_SCALE)``.
Q_SCALE = 2.0**30
#: Tempered logit offsets below this are clamped before the exponential (weight < 2^-46).
Z_MIN = -32.0
#: Largest vocabulary: ``V * 2^30`` must stay below 2^53 (exact int64 -> float64).
MAX_VOCAB = 2**23
#: Prefix widths tried for rows with top-p alone (then the whole row).
_TOP_P_WIDTHS = (64, 512, 4096)


class SamplingBatch(NamedTuple):
    """Per-row parameters as tensors: the argument list of ``tokenserve._C.sample``.

    Rows are ``B``; ``N`` = total history ids passed (rows without a penalty pass none).
    """

    greedy: torch.Tensor  # bool [B]
    temperature: torch.Tensor  # float32 [B], >= 0 (0, an underflow, acts as FLT_MIN)
    top_k: torch.Tensor  # int32 [B], 0 = off (values >= V are stored as 0)
    top_p: torch.Tensor  # float32 [B], 1 = off
    min_p: torch.Tensor  # float32 [B], 0 = off
    repetition_penalty: torch.Tensor  # float32 [B], >= 0 (clamped as above), 1 = off
    presence: torch.Tensor  # float32 [B]
    frequency: torch.Tensor  # float32 [B]
    history_ids: torch.Tensor  # int32 [N], ids in [0, V)
    history_offsets: torch.Tensor  # int64 [B + 1], row b = ids[off[b]:off[b+1]]
    num_prompt: torch.Tensor  # int32 [B], prompt length within each row's history


def _history_tensor(history: History) -> torch.Tensor:
    """``history`` as a 1-D int64 tensor (list -> tensor through ``array``: ~4x faster)."""
    if isinstance(history, torch.Tensor):
        return history.to(torch.int64).reshape(-1)
    if len(history) == 0:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", history), dtype=torch.int64)


def pack_batch(
    params: Sequence[SamplingParams],
    histories: Sequence[History],
    num_prompt_tokens: Sequence[int] | None,
    vocab: int,
) -> SamplingBatch:
    """Turn per-request parameters into a :class:`SamplingBatch`.

    Histories are read only for rows with a penalty on (repetition penalty != 1, or a
    presence/frequency penalty != 0); the other rows pass an empty range.

    Args:
        params: ``B`` :class:`SamplingParams` (reads ``greedy``, ``temperature``,
            ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
            ``presence_penalty``, ``frequency_penalty``).
        histories: ``B`` prompt + generated ids (lists or 1-D int tensors).
        num_prompt_tokens: ``B`` prompt lengths within ``histories`` (clamped to
            ``[0, len]``); None is allowed only when no row has a presence/frequency
            penalty.
        vocab: ``V``.

    Raises:
        ValueError: a length mismatch, a history id outside ``[0, V)``, missing prompt
            lengths, or ``V > 2^23``.
    """
    rows = len(params)
    if len(histories) != rows or (num_prompt_tokens is not None and len(num_prompt_tokens) != rows):
        raise ValueError(f"need one history (and prompt length) per row: {rows} rows")
    if vocab > MAX_VOCAB:
        raise ValueError(f"vocabulary {vocab} exceeds {MAX_VOCAB}")
    parts: list[torch.Tensor] = []
    offsets = [0]
    prompt = []
    for r, p in enumerate(params):
        pf = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        need = p.repetition_penalty != 1.0 or pf
        n_prompt = 0
        if need and len(histories[r]):
            ids = _history_tensor(histories[r])
            if pf:
                if num_prompt_tokens is None:
                    raise ValueError("presence/frequency penalties need num_prompt_tokens")
                n_prompt = min(max(int(num_prompt_tokens[r]), 0), ids.numel())
            parts.append(ids)
            offsets.append(offsets[-1] + ids.numel())
        else:
            offsets.append(offsets[-1])
        prompt.append(n_prompt)
    hist = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    if hist.numel() and (int(hist.min()) < 0 or int(hist.max()) >= vocab):
        raise ValueError(f"history id out of range [0, {vocab}): {int(hist.min())}..{int(hist.max())}")

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32)

    return SamplingBatch(
        greedy=torch.tensor([p.greedy for p in params], dtype=torch.bool),
        temperature=f32([p.temperature for p in params]),
        top_k=torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params],
                           dtype=torch.int32),
        top_p=f32([p.top_p for p in params]),
        min_p=f32([getattr(p, "min_p", 0.0) for p in params]),
        repetition_penalty=f32([p.repetition_penalty for p in params]),
        presence=f32([p.presence_penalty for p in params]),
        frequency=f32([p.frequency_penalty for p in params]),
        history_ids=hist.to(torch.int32),
        history_offsets=torch.tensor(offsets, dtype=torch.int64),
        num_prompt=torch.tensor(prompt, dtype=torch.int32),
    )


def draw_uniforms(
    generators: Sequence[torch.Generator | None], greedy: Sequence[bool]
) -> torch.Tensor:
    """float32 ``[B]``: one ``torch.rand(1, generator=g)`` per sampled row, in row order;
    greedy rows get 0 and draw nothing. ``None`` uses torch's default generator."""
    draws = [
        0.0 if g_row else
        (torch.rand(1, generator=gen).item() if gen is not None else torch.rand(1).item())
        for gen, g_row in zip(generators, greedy, strict=True)
    ]
    return torch.tensor(draws, dtype=torch.float32)


# --------------------------------------------------------------------------- penalties


def apply_repetition_penalty_(
    logits: torch.Tensor, histories: Sequence[History], penalties: Sequence[float]
) -> torch.Tensor:
    """In place: the repetition penalty of step 1 (module docstring) on float32 ``[B, V]``.

    Args:
        logits: float32 ``[B, V]``; modified in place.
        histories: ``B`` id sequences (prompt + generated), ids in ``[0, V)``.
        penalties: ``B`` floats > 0; rows with 1.0 or an empty history are untouched.

    Returns:
        ``logits``.

    Raises:
        ValueError: length mismatch, or a history id outside ``[0, V)``.
    """
    rows, vocab = logits.shape
    if len(histories) != rows or len(penalties) != rows:
        raise ValueError(f"need one history and penalty per row: {rows} rows")
    for r in range(rows):
        p = float(penalties[r])
        if p == 1.0 or len(histories[r]) == 0:
            continue
        ids = _history_tensor(histories[r])
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"row {r}: history id out of range [0, {vocab})")
        _rep_row_(logits[r], ids.unique(), torch.tensor(p, dtype=torch.float32))
    return logits


def apply_repetition_penalty(
    logits: torch.Tensor, histories: Sequence[History], penalties: Sequence[float]
) -> torch.Tensor:
    """Out-of-place :func:`apply_repetition_penalty_`: a penalised copy ``[B, V]``."""
    return apply_repetition_penalty_(logits.clone(), histories, penalties)


def apply_presence_frequency_penalties_(
    logits: torch.Tensor,
    outputs: Sequence[History],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> torch.Tensor:
    """In place: step 2 (module docstring): ``x -= freq * count + pres`` for ids generated
    ``count > 0`` times.

    Args:
        logits: float32 ``[B, V]``; modified in place.
        outputs: ``B`` generated-id sequences (prompt excluded), ids in ``[0, V)``.
        presence, frequency: ``B`` floats; rows with both 0 are untouched.

    Returns:
        ``logits``.
    """
    for r, ids in enumerate(outputs):
        pres, freq = float(presence[r]), float(frequency[r])
        if (pres == 0.0 and freq == 0.0) or len(ids) == 0:
            continue
        _pf_row_(logits[r], _history_tensor(ids), torch.tensor(pres, dtype=torch.float32),
                 torch.tensor(freq, dtype=torch.float32))
    return logits


def _rep_row_(row: torch.Tensor, distinct: torch.Tensor, p: torch.Tensor) -> None:
    """One row of step 1 on the ``distinct`` ids; ``p`` a float32 0-dim tensor."""
    p = p.clamp(FLT_MIN, FLT_MAX)
    v = row[distinct]
    row[distinct] = torch.where(v > 0, (v / p).clamp(max=FLT_MAX), v * p)


def _pf_row_(row: torch.Tensor, generated: torch.Tensor, pres: torch.Tensor,
             freq: torch.Tensor) -> None:
    """One row of step 2; ``pres``/``freq`` float32 0-dim tensors."""
    if generated.numel() == 0:
        return
    ids, counts = generated.unique(return_counts=True)
    sub = freq * counts.to(torch.float32)  # float32 product, rounded
    sub = (sub + pres).clamp(-FLT_MAX, FLT_MAX)  # then the sum, rounded
    new = row[ids] - sub
    row[ids] = torch.where(new == float("inf"), FLT_MAX, new)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row, the lowest id among equal maxima: int64 ``[B]`` from ``[B, V]``."""
    return logits.max(dim=1).indices


# --------------------------------------------------------------------------- filtering


def top_sorted(row: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` ids of the row's order (logit descending, id ascending): int64 ``[n]``.

    ``row`` float32 ``[V]`` without NaN; ``1 <= n <= V``.
    """
    values, ids = row.topk(n)
    tau = values[-1]
    if int((row == tau).sum()) != int((values == tau).sum()):  # a tie cut at the boundary
        above = (row > tau).nonzero().squeeze(1)  # ids ascending, fewer than n
        at = (row == tau).nonzero().squeeze(1)[: n - above.numel()]
        ids = torch.cat([above, at])
    else:
        ids = ids.sort().values
    return ids[row[ids].sort(descending=True, stable=True).indices]


def _kept_ids(row: torch.Tensor, q: torch.Tensor, k: int, p: float) -> torch.Tensor | None:
    """Ids kept by top-k then top-p (steps 6-7) of one row; None = every id.

    ``row`` float32 ``[V]`` penalised logits; ``q`` int64 ``[V]`` masses; ``p`` float32.
    """
    vocab = row.numel()
    k_on, p_on = 0 < k < vocab, p < 1.0
    if not (k_on or p_on):
        return None
    if k_on:
        cand = top_sorted(row, k)
        mass = q[cand].sum()
    else:
        mass = q.sum()
    if not p_on:
        return cand
    thr = float(torch.tensor(p, dtype=torch.float32).double()) * float(mass.double())
    if not k_on:
        for width in _TOP_P_WIDTHS + (vocab,):
            cand = top_sorted(row, min(width, vocab))
            if width >= vocab or float(q[cand].sum()) >= thr:
                break
    cum = q[cand].cumsum(0).double()
    n = min(int((cum < thr).sum()) + 1, cand.numel())
    return cand[:n]


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """top-k then top-p (steps 6-7 at ``T = 1``): dropped tokens set to ``-inf``.

    Args:
        logits: float32 ``[B, V]`` (already tempered if a temperature applies), no NaN.
        top_k: int ``[B]``; 0 or >= V = off.
        top_p: float ``[B]`` in ``(0, 1]``; 1 = off.

    Returns:
        A new float32 ``[B, V]`` tensor.
    """
    out = logits.clone()
    for r in range(logits.shape[0]):
        row = logits[r]
        q = _masses(row.unsqueeze(0), torch.ones(1))[0][0]
        kept = _kept_ids(row, q, int(top_k[r]), float(top_p[r]))
        if kept is not None:
            mask = torch.ones_like(row, dtype=torch.bool)
            mask[kept] = False
            out[r].masked_fill_(mask, float("-inf"))
    return out


def _masses(x: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4 on float32 ``[R, V]`` rows without NaN/+inf and with a finite maximum.

    Returns ``(q int64 [R, V], w float32 [R, V])``.
    """
    t = temperature.to(torch.float32).clamp(FLT_MIN, FLT_MAX).unsqueeze(1)
    z = ((x - x.amax(dim=1, keepdim=True)) / t).clamp(min=Z_MIN)
    w = z.double().exp().to(torch.float32)
    return (w * Q_SCALE).to(torch.int64), w


# --------------------------------------------------------------------------- entry points


def sample_tensors_ref(
    logits: torch.Tensor,
    greedy: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    history_ids: torch.Tensor,
    history_offsets: torch.Tensor,
    num_prompt: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Reference of ``tokenserve._C.sample``: the tokens for given uniforms.

    Args: as :class:`SamplingBatch`, plus ``logits`` float32 ``[B, V]`` (not modified)
        and ``uniforms`` float32 ``[B]`` in ``[0, 1)`` (read for sampled rows only).

    Returns:
        int64 ``[B]``: ids in ``[0, V)``, or -1 for a row that cannot be sampled.
    """
    rows, vocab = logits.shape
    out = torch.full((rows,), -1, dtype=torch.int64)
    if rows == 0:
        return out
    bad = torch.isnan(logits).any(dim=1) | (logits == float("inf")).any(dim=1)
    x = logits.clone()
    offs = history_offsets.tolist()
    for r in range(rows):
        if offs[r + 1] == offs[r]:
            continue
        ids = history_ids[offs[r] : offs[r + 1]].to(torch.int64)
        if float(repetition_penalty[r]) != 1.0:
            _rep_row_(x[r], ids.unique(), repetition_penalty[r])
        if float(presence[r]) != 0.0 or float(frequency[r]) != 0.0:
            _pf_row_(x[r], ids[int(num_prompt[r]):], presence[r], frequency[r])
    m, am = x.max(dim=1)
    bad |= m == float("-inf")
    take = greedy & ~bad
    out[take] = am[take]
    sampled = (~greedy & ~bad).nonzero().squeeze(1)
    if sampled.numel() == 0:
        return out
    xs = x[sampled]
    q, w = _masses(xs, temperature[sampled])
    keep = torch.ones_like(q, dtype=torch.bool)
    for i, r in enumerate(sampled.tolist()):
        kept = _kept_ids(xs[i], q[i], int(top_k[r]), float(top_p[r]))
        if kept is not None:
            keep[i] = False
            keep[i, kept] = True
    mp = min_p[sampled]
    if bool((mp > 0).any()):
        keep &= w >= mp.unsqueeze(1)
    # Exact int64 cumulative masses, compared in float64 (exact below 2^53).
    cdf = torch.where(keep, q, 0).cumsum(dim=1)
    total = cdf[:, -1:].double()
    target = uniforms[sampled].double().unsqueeze(1) * total
    cdf = cdf.double()
    j = torch.searchsorted(cdf, target, right=True)
    cap = torch.searchsorted(cdf, total, right=False)  # never reached: target < total
    out[sampled] = torch.minimum(j, cap).squeeze(1)
    return out


def sample_ref(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[History],
    num_prompt_tokens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Pick the next token of every row by the module's contract, in pure torch.

    Args:
        logits: float32 ``[B, V]``, the last position's logits; not modified.
        params: ``B`` :class:`SamplingParams`.
        generators: ``B`` per-request CPU generators; ``None`` = torch's default. A
            sampled row consumes exactly one ``torch.rand(1)`` per call, a greedy row none.
        histories: ``B`` prompt + generated ids, read only for rows with a penalty on.
        num_prompt_tokens: ``B`` prompt lengths within ``histories`` (presence/frequency
            penalties count only the generated part); None when no row has those.

    Returns:
        int64 ``[B]``: ids in ``[0, V)``, or -1 for a row whose logits contain NaN or
        ``+inf`` (or are all ``-inf`` after the penalties).

    Raises:
        ValueError: ``logits`` not 2-D float32, a length mismatch, or a history id
            outside ``[0, V)``.
    """
    batch, uniforms, x = prepare(logits, params, generators, histories, num_prompt_tokens)
    return sample_tensors_ref(x, *batch, uniforms)


def prepare(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[History],
    num_prompt_tokens: Sequence[int] | None,
) -> tuple[SamplingBatch, torch.Tensor, torch.Tensor]:
    """Validate, pack the parameters and draw the uniforms (shared by every backend).

    Returns ``(batch, uniforms float32 [B], logits contiguous float32 [B, V])``.

    Raises:
        ValueError: as :func:`sample_ref`.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 [B, V], got {logits.dtype} {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if not len(params) == len(generators) == len(histories) == rows:
        raise ValueError(
            f"need one params/generator/history per row: {rows} rows, {len(params)} "
            f"params, {len(generators)} generators, {len(histories)} histories"
        )
    batch = pack_batch(params, histories, num_prompt_tokens, vocab)
    uniforms = draw_uniforms(generators, [p.greedy for p in params])
    return batch, uniforms, logits.contiguous()
