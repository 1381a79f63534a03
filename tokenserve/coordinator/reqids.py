"""The coordinator's request ids (spec/pd_disaggregation.md §3.3). Its configuration is
:class:`tokenserve.config.tree.CoordinatorConfig`."""

from __future__ import annotations

import secrets

MAX_U64 = 2**64 - 1


class ReqIdGenerator:
    """Unique request ids: unsigned 64-bit decimal strings (§3.3).

    ``id_n = (base + n * step) mod 2**64`` with a random base and a random odd step is a
    bijection of the counter ``n``, so ids never repeat within 2**64 requests of one
    coordinator and differ between coordinators (and restarts) with high probability.
    """

    def __init__(self) -> None:
        self._base = secrets.randbits(64)
        self._step = secrets.randbits(64) | 1
        self._n = 0

    def next(self) -> str:
        """The next id, e.g. ``"11528317054338029012"``."""
        self._n += 1
        return str((self._base + self._n * self._step) & MAX_U64)
