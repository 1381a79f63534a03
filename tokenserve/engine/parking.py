"""The scheduler's PD bookkeeping (spec/pd_disaggregation.md): pure, synchronous, no torch.

On a prefill instance a ``prefill_only`` request is *parked* after its first token, its
blocks held for the decode instance to pull, until :meth:`Scheduler.finish
<tokenserve.engine.scheduler.Scheduler.finish>` (release, evict) or its park deadline
(``kv_trans_timeout``). On a decode instance a request with ``pull_tokens`` is admitted
by allocating blocks for those tokens and moving to PULLING (not computed; the actor
pulls them) until :meth:`Scheduler.pulled` makes it RUNNING; evicting such a request
(``recompute_elsewhere``) ends it with ``RECOMPUTE`` instead of queueing it again.
Blocks of a request that ends while its pull is in flight stay reserved until the pull
returns (nothing may write into a block another request owns); those of a pull that
timed out are quarantined, never reused (a late write may still land).

The scheduler owns the waiting queue and the running batch and moves requests between
them; :class:`Parking` holds the requests outside both (parked, pulling) and the events
the scheduler actor drains (:meth:`Parking.take_events`)::

    running --park()--> parked --leave()--> (finished: blocks freed)
    waiting --start_pull()--> pulling --pulled()--> running | waiting (failed: ended)
                                      --leave()---> orphaned blocks --pulled()--> freed
"""

from __future__ import annotations

from tokenserve.engine.block_pool import BlockPool
from tokenserve.engine.request import Request, RequestStatus


class Parking:
    """Parked (P) and pulling (D) requests, with their blocks' fate."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.parked: dict[str, Request] = {}  # PD prefill: blocks held for a decode
        self.pulling: dict[str, Request] = {}  # PD decode: K/V being pulled
        #: blocks of requests that ended while their pull was in flight: freed by pulled()
        self._pull_orphans: dict[str, list[int]] = {}
        #: blocks a timed-out pull may still write into: never reused (logged, counted)
        self.quarantined: list[int] = []
        #: PD decode: requests that started pulling in the last schedule() (the actor
        #: starts their pulls) and requests evicted for recompute elsewhere (the actor
        #: ends them); both drained with take_events()
        self._new_pulls: list[Request] = []
        self._evicted: list[Request] = []
        #: seconds a parked request keeps its blocks (``kv_trans_timeout``)
        self.timeout_s = 10.0

    def has_work(self) -> bool:
        """Anything parked for a decode instance, pulling K/V, or a pull still in flight
        for a request that ended."""
        return bool(self.parked or self.pulling or self._pull_orphans)

    def park(self, req: Request, now: float) -> None:
        """PD prefill: keep the blocks of ``req`` (out of the running batch) for the
        decode instance; it is not scheduled again."""
        req.status = RequestStatus.PARKED
        req.deadline, req.deadline_reason = now + self.timeout_s, "kv_trans_timeout"
        req.token_timeout_s = float("inf")
        self.parked[req.request_id] = req

    def leave(self, req: Request) -> None:
        """``req`` (PARKED or PULLING) is ending: take it out of parked or pulling (a
        pull in flight keeps its blocks as orphans until it returns)."""
        if req.status is RequestStatus.PARKED:
            del self.parked[req.request_id]
        else:
            assert req.status is RequestStatus.PULLING, req.status
            del self.pulling[req.request_id]
            self._pull_orphans[req.request_id] = req.block_table  # the pull still writes them
            req.block_table = []

    def start_pull(self, req: Request) -> bool:
        """Allocate blocks for an adopted request's pulled K/V (no prefix cache: the K/V
        come from the other instance); False when they are not free."""
        need = self.pool.blocks_for(req.pull_tokens)
        if need > self.pool.num_free:
            return False
        req.block_table = self.pool.allocate(need)
        req.status = RequestStatus.PULLING
        req.first_scheduled = True
        self.pulling[req.request_id] = req
        self._new_pulls.append(req)
        return True

    def pulled(self, request_id: str, error: str | None, quarantine: bool) -> Request | None:
        """A pull started for ``request_id`` returned: the request, out of ``pulling``,
        RUNNING with ``pull_tokens`` computed, or WAITING when it failed (``error``; it
        is to be ended, which frees its blocks); None when it had ended meanwhile (its
        orphaned blocks freed, or quarantined) or is unknown."""
        orphan = self._pull_orphans.pop(request_id, None)
        if orphan is not None:
            if quarantine:
                self.quarantined += orphan
            else:
                self.pool.free(orphan)
            return None
        req = self.pulling.pop(request_id, None)
        if req is None:
            return None
        if quarantine:
            self.quarantined += req.block_table
            req.block_table = []
        if error is not None:
            req.status = RequestStatus.WAITING
            return req
        req.num_computed, req.pull_tokens = req.pull_tokens, 0
        req.status = RequestStatus.RUNNING
        return req

    def evicted(self, req: Request) -> None:
        """``req`` (PD decode) was evicted and ended, to be recomputed on a prefill
        instance: the actor sends it there (:meth:`take_events`)."""
        self._evicted.append(req)

    def take_events(self) -> tuple[list[Request], list[Request]]:
        """(requests whose K/V pull must start now, requests evicted for recompute on a
        prefill instance) since the last call."""
        pulls, evicted = self._new_pulls, self._evicted
        self._new_pulls, self._evicted = [], []
        return pulls, evicted
