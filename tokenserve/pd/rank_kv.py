"""An instance's KV hand-off over all its tensor-parallel ranks (issue 41).

Each rank holds the K/V of its own KV heads, the same block ids on every rank, so P and D
of the same ``worldSize`` hand the KV off rank to rank: every rank has its own Mooncake
engine on its own shard (:class:`~tokenserve.pd.kv_transfer.KvTransfer`; ranks > 0 open
theirs through the engine's ``rank_kv``, ``engine/tp_kv.py``), P advertises one
:class:`~tokenserve.pd.kv_transfer.KvRegion` per rank in rank order
(``DecodeParameters.kv``), and D's rank r reads P's region r::

    P rank 0 region ----> D rank 0 (this process, KvTransfer.pull)
    P rank 1 region ----> D rank 1 (its process, a TpPull on the step channel)
    ...                   every rank's answer in before the request decodes

One process (``worldSize`` 1) is the same with one region. A hand-off whose region count
differs from this instance's world size is refused (:class:`KvTransferError`): the
coordinator never pairs such a P and D, this is the last check.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

from tokenserve.pd.kv_transfer import KvRegion, KvTransfer, KvTransferError

#: seconds D waits for its other ranks beyond the transfer timeout (their engines start
#: their reads a little after rank 0's)
RANK_SLACK_S = 5.0


def mismatch(theirs: int, ours: int) -> str:
    """The one line a hand-off between instances of different world sizes fails with."""
    return (f"P hands over {theirs} KV region(s) (worldSize {theirs}) but this D has "
            f"worldSize {ours}: the KV hand-off is rank to rank, P and D need the same "
            "--tensor-parallel-size")


class RankedKv:
    """This instance's transfer engines, one per rank (module docstring). Thread-safe
    like :class:`KvTransfer`: pulls may run concurrently from worker threads.

    Args:
        local: rank 0's (this process's) transfer engine.
        ranks: the engine's ``rank_kv`` (None on one process).
        regions: every rank's region, rank order (``regions[0]`` is ``local``'s).
    """

    def __init__(self, local: KvTransfer, ranks: Any, regions: Sequence[KvRegion]) -> None:
        assert regions and (ranks is None) == (len(regions) == 1)
        self.local, self._ranks, self.regions = local, ranks, tuple(regions)

    @classmethod
    def open(cls, engine: Any, host: str, **kwargs: Any) -> RankedKv:
        """Open a transfer engine on every rank of ``engine`` (a ``PdEngine``) at
        ``host`` (blocking); ``kwargs`` are :class:`KvTransfer`'s (protocol, device name,
        timeout, port range), the same on every rank.

        Raises:
            KvTransferError: any rank's engine could not start (one line naming it).
        """
        open_transfer = functools.partial(KvTransfer, host, **kwargs)
        local = open_transfer(engine.kv_region)
        ranks = engine.rank_kv
        regions = [local.descriptor()]
        try:
            if ranks is not None:
                try:
                    regions += [KvRegion.from_dict(d) for d in ranks.start(open_transfer)]
                except (RuntimeError, ValueError) as exc:
                    raise KvTransferError(str(exc)) from None
        except BaseException:
            local.close()
            raise
        return cls(local, ranks, regions)

    @property
    def world(self) -> int:
        """Ranks (regions) of this instance."""
        return len(self.regions)

    def descriptor(self) -> tuple[KvRegion, ...]:
        """What P puts in ``DecodeParameters.kv``: every rank's region, rank order."""
        return self.regions

    def pull(self, sources: Sequence[KvRegion], src_blocks: Sequence[int],
             dst_blocks: Sequence[int]) -> None:
        """Read P's ``src_blocks`` into this instance's ``dst_blocks`` on every rank,
        ``sources[r]`` into rank r's shard (BLOCKING: a worker thread). Returns once every
        rank has its blocks.

        Raises:
            KvTransferError: ``sources`` is not one region per rank (:func:`mismatch`), or
                any rank's read failed (rank 0's error first; ``timed_out`` when any
                rank's read may still land, so the caller keeps those blocks from others).
        """
        if len(sources) != self.world:
            raise KvTransferError(mismatch(len(sources), self.world))
        if self._ranks is None:
            self.local.pull(sources[0], src_blocks, dst_blocks)
            return
        t0 = time.monotonic()
        pull_id = self._ranks.begin_pull(sources, src_blocks, dst_blocks)
        error: KvTransferError | None = None
        try:
            self.local.pull(sources[0], src_blocks, dst_blocks)
        except KvTransferError as exc:
            error = exc
        finally:  # the other ranks' reads end (or are abandoned) before the blocks move on
            left = self.local.timeout_s + RANK_SLACK_S - (time.monotonic() - t0)
            failures = self._ranks.end_pull(pull_id, max(left, RANK_SLACK_S))
        if error is None and not failures:
            return
        timed_out = (error is not None and error.timed_out) or any(
            f.timed_out for f in failures)
        texts = ([str(error)] if error is not None else []) + [f.error for f in failures]
        raise KvTransferError("; ".join(texts), timed_out=timed_out)

    def close(self) -> None:
        """Close rank 0's engine (the other ranks close theirs when the server stops
        them). Idempotent; after the last pull."""
        self.local.close()
