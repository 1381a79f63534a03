"""A request's token history as D reports it, and the recompute body built from it
(plan "Wire decisions": the ``ids`` kind; spec/pd_disaggregation.md §7.2).

Per submission, D's first ``ids`` message is the whole history and later ones append::

    ids:L,p1,..,pL,o1,..,oK     L prompt ids, then every output id the client was sent
    ids:o_a,o_b                 the ids of the text in the data/lastData right after it

When the request's D is lost, the coordinator resubmits the client's body with the
prompt field replaced by this history (:func:`tokenserve.pd.recompute.build_recompute_body`),
so P and the next D continue exactly after the text the client already has.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

logger = logging.getLogger(__name__)


class TokenHistory:
    """Prompt ids plus delivered output ids of one submission; empty until D's first
    ``ids`` message."""

    def __init__(self) -> None:
        self._ids: list[int] | None = None
        self._num_prompt = 0

    @property
    def known(self) -> bool:
        """D's first ``ids`` message of this submission has arrived."""
        return self._ids is not None

    def __len__(self) -> int:
        return len(self._ids or ())

    def reset(self) -> None:
        """A new submission: the next D reports the history afresh."""
        self._ids, self._num_prompt = None, 0

    def feed(self, body: str) -> bool:
        """One ``ids`` message body; False (and nothing changes) when it is malformed."""
        try:
            ids = [int(x) for x in body.split(",")]
        except ValueError:
            return False
        if self._ids is not None:
            self._ids.extend(ids)
        elif ids and 1 <= ids[0] <= len(ids) - 1:
            self._num_prompt, self._ids = ids[0], ids[1:]
        else:
            return False
        return True

    def recompute_body(self, path: str, body: dict[str, Any]) -> bytes | None:
        """``body`` (the client's, for ``path``) with its prompt replaced by the history,
        serialised; None when the history is unknown or the body cannot carry it."""
        if self._ids is None:
            return None
        from tokenserve.pd.recompute import build_recompute_body

        try:
            out = build_recompute_body(path, body, list(self._ids), self._num_prompt)
        except ValueError as exc:
            logger.warning("no recompute body for %s: %s", path, exc)
            return None
        return orjson.dumps(out)
