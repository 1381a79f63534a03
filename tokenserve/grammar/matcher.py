"""One request's grammar state and the batch's token masks (the model thread's side).

A :class:`GrammarMatcher` follows one request's generated tokens through its compiled
grammar; the model thread owns it (next to the request's generator and history). Per
step, :func:`fill_masks` writes the allowed-token bitmask of the constrained rows only
(llguidance, which releases the GIL: it may run on a helper thread while the forward pass
computes) and unpacks it (:func:`blocked_tokens`, numpy), and :func:`apply_masks` sets the disallowed logits of those rows to ``-inf``
before the sampler's penalties, temperature, top-k and top-p. EOS is in the mask only
where the grammar accepts the text so far.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher

from tokenserve.grammar.compiler import CompiledGrammar


class GrammarMatcher:
    """One request's position in its grammar.

    Args:
        compiled: the request's compiled constraint.
        tokens: tokens already generated (PD decode, recompute: the matcher is rebuilt
            from the grammar and the tokens so far).

    Raises:
        ValueError: ``tokens`` are not a prefix the grammar allows.
    """

    __slots__ = ("matcher",)

    def __init__(self, compiled: CompiledGrammar, tokens: Sequence[int] = ()) -> None:
        self.matcher: LLMatcher = compiled.matcher()
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise ValueError("the tokens generated so far do not follow the constraint: "
                             + self.matcher.get_error())

    def advance(self, token: int) -> str | None:
        """Consume one sampled token; the error (the request must fail) or None."""
        if self.matcher.consume_token(token):
            return None
        return "the output left its constraint: " + (self.matcher.get_error() or "")

    @property
    def error(self) -> str | None:
        """Why the matcher cannot go on (a parser limit hit, say), or None."""
        return self.matcher.get_error() if self.matcher.is_error() else None


def mask_words(vocab_size: int) -> int:
    """int32 words in one row's bitmask: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def fill_masks(executor: LLExecutor, matchers: Sequence[GrammarMatcher],
               bitmask: torch.Tensor) -> None:
    """Write each matcher's allowed tokens into its row of ``bitmask``.

    Args:
        executor: llguidance's thread pool (matchers are filled in parallel, GIL released).
        matchers: row i of ``bitmask`` is ``matchers[i]``'s.
        bitmask: int32 ``[len(matchers), mask_words(V)]``, contiguous, CPU; bit ``t % 32``
            of word ``t // 32`` is set when token ``t`` is allowed. A matcher in an error
            state writes a mask with only EOS (llguidance's behaviour): check
            :attr:`GrammarMatcher.error` after sampling.
    """
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.dim() == 2
    assert bitmask.shape[0] == len(matchers)
    if not matchers:
        return
    row_bytes = bitmask.shape[1] * 4
    executor.unsafe_compute_mask_ptr([(m.matcher, i) for i, m in enumerate(matchers)],
                                     bitmask.data_ptr(), row_bytes, bitmask.shape[0])


def blocked_tokens(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """The tokens each row of ``bitmask`` does NOT allow, as a bool array.

    Pure numpy (no torch op, so no OpenMP region): runs on the mask helper thread.

    Args:
        bitmask: int32 ``[n, mask_words(V)]`` (:func:`fill_masks`).
        vocab_size: ``V``.

    Returns:
        bool ``[n, V]``: True where the token is disallowed.
    """
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab_size,
                         bitorder="little")
    return bits == 0


def apply_masks(logits: torch.Tensor, rows: Sequence[int], blocked: np.ndarray) -> None:
    """Set ``logits[rows[i], t] = -inf`` wherever ``blocked[i, t]``, in place; other
    rows are not read or written.

    Args:
        logits: float32 ``[B, V]``, contiguous, CPU.
        rows: indices into ``logits``, one per row of ``blocked``.
        blocked: bool ``[len(rows), V]`` (:func:`blocked_tokens`).
    """
    assert logits.dtype == torch.float32 and logits.is_contiguous()
    assert blocked.shape == (len(rows), logits.shape[1])
    view = logits.numpy()  # shares memory (numpy writes bypass inference-mode checks)
    for i, r in enumerate(rows):
        np.copyto(view[r], -np.inf, where=blocked[i])
