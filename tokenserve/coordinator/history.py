"""A request's token history as D reports it, and the recompute body built from it
(plan "Wire decisions": the ``ids`` kind; spec/pd_disaggregation.md §7.2).

Per submission, D's first ``ids`` message is the whole history and later ones append::

    ids:L,p1,..,pL,o1,..,oK     L prompt ids, then every output id the client was sent
    ids:o_a,o_b                 the ids of the text in the data/lastData right after it

When the request's D is lost, the coordinator resubmits the client's body with the
prompt field replaced by this history (:class:`tokenserve.pd.recompute.RecomputeBody`),
so P and the next D continue exactly after the text the client already has. The bodies'
codec is :mod:`tokenserve.pd.messages` (``History``, ``decode_ids``).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenserve.pd.messages import History, WireError, decode_ids
from tokenserve.pd.recompute import RecomputeBody

logger = logging.getLogger(__name__)


class TokenHistory:
    """Prompt ids plus delivered output ids of one submission; empty until D's first
    ``ids`` message."""

    def __init__(self) -> None:
        self._prompt: tuple[int, ...] | None = None
        self._outputs: list[int] = []

    @property
    def known(self) -> bool:
        """D's first ``ids`` message of this submission has arrived."""
        return self._prompt is not None

    def __len__(self) -> int:
        return len(self._prompt or ()) + len(self._outputs)

    def reset(self) -> None:
        """A new submission: the next D reports the history afresh."""
        self._prompt, self._outputs = None, []

    def feed(self, body: str) -> bool:
        """One ``ids`` message body; False (and nothing changes) when it is malformed."""
        try:
            if self._prompt is None:
                h = History.decode(body)
                self._prompt, self._outputs = h.prompt, list(h.outputs)
            else:
                self._outputs.extend(decode_ids(body))
        except WireError:
            return False
        return True

    def recompute_body(self, path: str, body: dict[str, Any]) -> bytes | None:
        """``body`` (the client's, for ``path``) with its prompt replaced by the history,
        serialised; None when the history is unknown or the body cannot carry it."""
        if self._prompt is None:
            return None
        try:
            return RecomputeBody(body, History(self._prompt, tuple(self._outputs))
                                 ).encode(path)
        except ValueError as exc:
            logger.warning("no recompute body for %s: %s", path, exc)
            return None
