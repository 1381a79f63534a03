"""Prompt-lookup (n-gram) drafting for speculative decoding: pure, no torch.

The draft for a request is the continuation of the most recent earlier occurrence of its
last ``n`` tokens in its own prompt and output, for the largest ``n`` in ``[n_min, n_max]``
that occurs (Saxena, "Prompt Lookup Decoding", 2023; vLLM's ``ngram`` method and
llama.cpp's ``--lookup`` do the same). Input-grounded work (summarise or edit a given
text, code edits, extraction, answers that quote their sources) repeats long spans of the
prompt, so such drafts are often right; a wrong draft costs only the extra positions of
one forward pass (``tokenserve/engine/drafting.py``).
"""

from __future__ import annotations

from collections.abc import Sequence


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
