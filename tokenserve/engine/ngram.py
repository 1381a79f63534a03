"""Prompt-lookup (n-gram) drafting for speculative decoding: pure, no torch.

The draft for a request is the continuation of the most recent earlier occurrence of its
last ``n`` tokens in its own prompt and output, for the largest ``n`` in ``[n_min, n_max]``
that occurs (Saxena, "Prompt Lookup Decoding", 2023; vLLM's ``ngram`` method and
llama.cpp's ``--lookup`` do the same). Input-grounded work (summarise or edit a given
text, code edits, extraction, answers that quote their sources) repeats long spans of the
prompt, so such drafts are often right; a wrong draft costs only the extra positions of
one forward pass (``tokenserve/engine/scheduler.py``, "Speculative decoding").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding without a draft model, configured as vLLM's
    ``--speculative-config '{"method": "ngram", ...}'``.

    Attributes:
        num_speculative_tokens: k, draft tokens verified per step (>= 1).
        prompt_lookup_max: longest n-gram matched (tokens, >= prompt_lookup_min).
        prompt_lookup_min: shortest n-gram matched (tokens, >= 1).
        max_draft_rows: drafts only in steps with at most this many decode rows: a wider
            batch is already compute-bound on a CPU, where the extra positions cost as much
            as they save (published n-gram drafting loses under load).
        min_acceptance: a request whose running acceptance rate (accepted / drafted, an
            exponential average) falls below this stops drafting for ``backoff_steps``
            decode steps, then tries again.
        backoff_steps: see ``min_acceptance``.
    """

    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    max_draft_rows: int = 4
    min_acceptance: float = 0.2
    backoff_steps: int = 16

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative config: num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative config: need 1 <= prompt_lookup_min <= "
                             "prompt_lookup_max")
        if self.max_draft_rows < 1:
            raise ValueError("speculative config: max_draft_rows must be >= 1")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError("speculative config: min_acceptance must be in [0, 1]")
        if self.backoff_steps < 0:
            raise ValueError("speculative config: backoff_steps must be >= 0")

    @classmethod
    def from_dict(cls, d: dict) -> SpecConfig:
        """From vLLM's speculative-config object (``method`` must be ``ngram``).

        Raises:
            ValueError: another method, an unknown key, or a bad value.
        """
        d = dict(d)
        method = d.pop("method", "ngram")
        if method not in ("ngram", "prompt_lookup"):
            raise ValueError(f"speculative config: method {method!r} is not supported "
                             "(only 'ngram': drafts from the request's own tokens)")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(unknown)}")
        for k, v in d.items():
            want = float if k == "min_acceptance" else int
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                    want is int and not float(v).is_integer()):
                raise ValueError(f"speculative config: {k} must be a number, got {v!r}")
            d[k] = want(v)
        return cls(**d)


def propose(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> tuple[int, ...]:
    """Up to ``k`` draft tokens continuing ``token_ids``.

    For n from ``n_max`` down to ``n_min``: find the most recent earlier occurrence of the
    last n tokens (not the suffix itself) and return the tokens that followed it (at most
    ``k``, fewer where the sequence ends first); ``()`` when no such n-gram occurs.

    Args:
        token_ids: the request's prompt followed by its output so far.
        k: most draft tokens wanted (0 gives ``()``).
        n_min, n_max: n-gram lengths tried, longest first.

    Returns:
        the draft, ``len <= k``.
    """
    L = len(token_ids)
    if k <= 0:
        return ()
    ids = list(token_ids)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = ids[L - n:]
        first = suffix[0]
        # scan backwards from the latest start that leaves one token after the match
        for start in range(L - n - 1, -1, -1):
            if ids[start] == first and ids[start:start + n] == suffix:
                return tuple(ids[start + n:start + n + k])
    return ()
