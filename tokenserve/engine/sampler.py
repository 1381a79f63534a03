"""Batched next-token sampling for the engine: the fused C++ kernel
(``tokenserve._C.sample``, ``csrc/sampling.cpp``) when the extension has it, else the
pure-torch reference (:mod:`tokenserve.ops.sampling`).

Both follow one contract, written out in :mod:`tokenserve.ops.sampling`: per row,
repetition penalty -> presence/frequency penalties -> greedy argmax | temperature ->
top-k (exactly ``k`` tokens, ties to the lowest ids, so ``top_k=1`` is greedy) -> top-p
-> min-p -> inverse-CDF draw in vocabulary order with integer (exact) masses. The uniforms
are drawn here, in Python, from each request's own ``torch.Generator`` (exactly one
``torch.rand(1, generator=g)`` per sampled row per call; greedy rows draw nothing) and
handed to either backend, which then pick the same token: a seeded request gives the same
tokens whatever shares its batch and whichever backend runs.

A row whose logits contain NaN or ``+inf`` cannot be sampled: its token is ``-1`` (the
engine fails that request alone); the other rows are unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenserve.grammar.matcher import GrammarMatcher
from tokenserve.messages import SeqStart
from tokenserve.ops.dispatch import c_op
from tokenserve.ops.sampling import (  # noqa: F401 - re-exported for tests and callers
    History,
    SamplingBatch,
    apply_presence_frequency_penalties_,
    apply_repetition_penalty,
    apply_repetition_penalty_,
    apply_top_k_top_p,
    draw_uniforms,
    greedy,
    pack_batch,
    prepare,
    sample_ref,
    sample_tensors_ref,
    top_sorted,
)
from tokenserve.sampling_params import MAX_SEED, SamplingParams


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


def generator_state(gen: torch.Generator | None) -> bytes | None:
    """``gen``'s state as bytes (travels to another instance in PD, spec §5.2); None
    for None."""
    return None if gen is None else gen.get_state().numpy().tobytes()


def restore_generator(seed: int, state: bytes | None, draws: int = 0) -> torch.Generator:
    """A generator that continues a request begun elsewhere: ``state`` (from
    :func:`generator_state`) when given, else seeded with ``seed`` and advanced by
    ``draws`` uniforms (one per token already sampled: see :func:`sample`).

    Raises:
        ValueError: a seed out of range or a state of the wrong size.
    """
    gen = make_generator(seed)
    if state is not None:
        try:
            gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        except RuntimeError as exc:
            raise ValueError(f"bad generator state: {exc}") from None
    elif draws:
        torch.rand(draws, generator=gen)
    return gen


class SamplingState:
    """One request's sampling state, owned by the model thread (keyed by request id in
    :class:`~tokenserve.engine.model_runner.ModelRunner`).

    Attributes:
        generator: the request's CPU generator (sampled requests), None for greedy.
        history: prompt + generated token ids, the penalties' input; the model thread
            appends every token it samples for the request.
        num_prompt_tokens: length of the prompt prefix of ``history``.
        matcher: structured output: the request's grammar matcher, started from
            ``start.grammar`` and advanced over the tokens generated so far (PD decode,
            recompute); None for an unconstrained request.
    """

    __slots__ = ("generator", "history", "matcher", "num_prompt_tokens")

    def __init__(self, params: SamplingParams, start: SeqStart) -> None:
        """Raises ValueError: a bad ``start.generator_state`` (see :func:`restore_generator`),
        or generated tokens the request's grammar does not allow."""
        self.generator = (restore_generator(params.seed, start.generator_state, start.draws)
                          if params.do_sample else None)
        self.history = list(start.token_ids)
        self.num_prompt_tokens = start.num_prompt_tokens
        self.matcher = (GrammarMatcher(start.grammar, start.token_ids[start.num_prompt_tokens:])
                        if start.grammar is not None else None)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[History],
    num_prompt_tokens: Sequence[int] | None = None,
) -> torch.Tensor:
    """Pick the next token of every row (rules: :mod:`tokenserve.ops.sampling`).

    Args:
        logits: float32 ``[B, V]``, the last position's logits; not modified.
        params: ``B`` :class:`SamplingParams` (reads ``greedy``, ``temperature``,
            ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
            ``presence_penalty``, ``frequency_penalty``).
        generators: ``B`` per-request CPU generators (:func:`make_generator`); ``None``
            uses torch's default generator. A sampled row consumes exactly one
            ``torch.rand(1)`` from its generator per call; a greedy row none.
        histories: ``B`` prompt + generated token ids (lists or 1-D int tensors), read
            only for rows with a penalty on.
        num_prompt_tokens: ``B`` prompt lengths within ``histories``; the presence and
            frequency penalties count only the generated part. None: no row has those
            penalties.

    Returns:
        int64 ``[B]``: token ids in ``[0, V)``, or ``-1`` for a row that cannot be
        sampled (its logits contain NaN or ``+inf``, or are all ``-inf`` after the
        penalties); the caller must fail that request.

    Raises:
        ValueError: ``logits`` not 2-D float32, a length mismatch, a history id outside
            ``[0, V)``, or presence/frequency penalties without ``num_prompt_tokens``.
    """
    batch, uniforms, x = prepare(logits, params, generators, histories, num_prompt_tokens)
    fn = c_op("sample")
    if fn is None:
        return sample_tensors_ref(x, *batch, uniforms)
    return fn(x, *batch, uniforms)
