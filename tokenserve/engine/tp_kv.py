"""PD over tensor parallelism (issue 41): every rank's share of the KV hand-off.

Each rank holds the KV cache of its own KV heads (the same block ids on every rank), so a
hand-off between a P and a D of the same ``worldSize`` goes rank to rank: P's rank r
region into D's rank r region. Each rank runs its own transfer engine on its own shard;
the engine knows nothing of Mooncake: the PD layer hands it ``open_transfer`` (a picklable
callable, kv tensor -> endpoint) and the endpoint's descriptors, which the engine carries
without looking inside::

    rank 0 (RankKv)                               rank r > 0 (RankKvServer, step loop)
    start(open_transfer) --TpKvStart---------->   endpoint = open_transfer(kv_r)
         <-- store "tokenserve/tp/kv/<r>": {"region": {...}} | {"error": "..."}
    begin_pull(sources, src, dst) --TpPull----->  thread: endpoint.pull(sources[r], src, dst)
    (rank 0 pulls its own shard meanwhile)
    end_pull(id, timeout_s)
         <-- store "tokenserve/tp/pull/<id>/<r>": {"ok": true} | {"error", "timed_out"}

The step channel is one-way by design (rank 0 unpickles nothing a rank sends), so the
answers come back as JSON on the TCP store the ranks already share. A rank's pull runs on
its own thread: its step loop keeps computing the other requests' steps (the destination
blocks are fresh, no running request reads them), and rank 0 lets the request decode only
once every rank has answered. A rank that has not answered by the deadline is abandoned
with ``compare_set`` (its late answer then finds the key taken and deletes it), and its
blocks count as timed out (its read may still land): no key is left behind either way.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tokenserve.messages import TpKvStart, TpPull

log = logging.getLogger("tokenserve.engine")

#: the store key of rank ``r``'s answer to :class:`TpKvStart`
KV_KEY = "tokenserve/tp/kv/{rank}"
#: the store key of rank ``r``'s answer to the :class:`TpPull` ``pull_id``
PULL_KEY = "tokenserve/tp/pull/{pull_id}/{rank}"
#: what rank 0 writes in place of an answer it stopped waiting for
ABANDONED = b"abandoned"
#: seconds rank 0 waits for the ranks' transfer engines to start
START_TIMEOUT_S = 120.0
#: seconds between two looks at the store while waiting (``TCPStore.wait`` would hold
#: the client's lock: concurrent pulls share one client)
POLL_S = 0.001


class Store(Protocol):
    """The torch.distributed ``TCPStore`` calls used here."""

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def compare_set(self, key: str, expected: str, desired: str | bytes) -> bytes: ...

    def delete_key(self, key: str) -> bool: ...


@dataclass(frozen=True)
class RankPullFailure:
    """One rank's failed share of a pull.

    Attributes:
        rank: the rank (> 0).
        error: its error text (one line).
        timed_out: its read may still land in the destination blocks (the transfer
            engine said so, or the rank did not answer in time): keep them from others.
    """

    rank: int
    error: str
    timed_out: bool


class RankKv:
    """Rank 0's side: tell the other ranks to open their transfer engines and to pull,
    and collect their answers (module docstring). Thread-safe: pulls run on worker
    threads while the model thread sends steps (``send`` serialises the channel).

    Args:
        send: the step channel's ``send`` (every other rank gets the message).
        store: the TCP store every rank shares.
        world: the number of ranks.
    """

    def __init__(self, send: Callable[[Any], None], store: Store, world: int) -> None:
        assert world > 1
        self._send, self._store, self.world = send, store, world
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def start(self, open_transfer: Callable[[torch.Tensor], Any],
              timeout_s: float = START_TIMEOUT_S) -> list[dict[str, Any]]:
        """Open a transfer engine on every rank > 0 (blocking, once).

        Returns:
            their regions' JSON descriptors (``descriptor().to_dict()``), ranks 1..world-1.

        Raises:
            RuntimeError: a rank could not open its engine, or not every rank answered in
                ``timeout_s`` (one line naming the rank).
        """
        self._send(TpKvStart(open_transfer))
        keys = [KV_KEY.format(rank=r) for r in range(1, self.world)]
        deadline = time.monotonic() + timeout_s
        docs = []
        for rank, key in enumerate(keys, 1):
            raw = self._wait(key, deadline)
            if raw is None:
                raise RuntimeError(f"tensor parallelism: rank {rank} opened no KV transfer "
                                   f"engine in {timeout_s:g} s")
            doc = json.loads(raw)
            if "error" in doc:
                raise RuntimeError(f"tensor parallelism: rank {rank}'s KV transfer engine: "
                                   f"{doc['error']}")
            docs.append(doc["region"])
        return docs

    def begin_pull(self, sources: Sequence[Any], src_blocks: Sequence[int],
                   dst_blocks: Sequence[int]) -> int:
        """Tell every rank > 0 to pull ``src_blocks`` of ``sources[rank]`` into its
        ``dst_blocks``; returns the pull's id for :meth:`end_pull`."""
        assert len(sources) == self.world
        with self._lock:
            pull_id = next(self._ids)
        self._send(TpPull(pull_id, tuple(sources), tuple(src_blocks), tuple(dst_blocks)))
        return pull_id

    def end_pull(self, pull_id: int, timeout_s: float) -> list[RankPullFailure]:
        """Wait up to ``timeout_s`` seconds for every rank's answer to ``pull_id``; the
        failures (empty: every rank has its blocks). A rank that did not answer is
        abandoned (its key taken, so its late answer deletes itself) and fails with
        ``timed_out``. Every key of the pull is gone afterwards."""
        deadline = time.monotonic() + timeout_s
        failures = []
        for rank in range(1, self.world):
            key = PULL_KEY.format(pull_id=pull_id, rank=rank)
            raw = self._wait(key, deadline)
            if raw is None:
                raw = self._store.compare_set(key, "", ABANDONED)  # unless it just came
                if raw == ABANDONED:
                    failures.append(RankPullFailure(
                        rank, f"rank {rank} did not answer the KV pull in {timeout_s:g} s",
                        True))
                    continue
                self._store.delete_key(key)
            doc = json.loads(raw)
            if "error" in doc:
                failures.append(RankPullFailure(rank, f"rank {rank}: {doc['error']}",
                                                bool(doc.get("timed_out"))))
        return failures

    def _wait(self, key: str, deadline: float) -> bytes | None:
        """The value under ``key`` (deleted from the store), or None at ``deadline``."""
        while not self._store.check([key]):
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)
        raw = self._store.get(key)
        self._store.delete_key(key)
        return raw


class RankKvServer:
    """A rank's side (rank > 0, in its step loop): its transfer endpoint, its pulls on
    threads, its answers on the store (module docstring)."""

    def __init__(self, rank: int, store: Store) -> None:
        assert rank > 0
        self.rank, self._store = rank, store
        self.endpoint: Any = None

    def start(self, msg: TpKvStart, kv: torch.Tensor | None) -> None:
        """Open the endpoint on ``kv`` (the rank's whole KV tensor) and answer."""
        try:
            if kv is None:
                raise RuntimeError("no KV cache allocated yet")
            self.endpoint = msg.open_transfer(kv)
            doc: dict[str, Any] = {"region": self.endpoint.descriptor().to_dict()}
        except Exception as exc:  # noqa: BLE001 - sent to rank 0, which fails its start
            doc = {"error": f"{type(exc).__name__}: {exc}"}
        self._store.set(KV_KEY.format(rank=self.rank), json.dumps(doc))

    def pull(self, msg: TpPull) -> threading.Thread:
        """Start the rank's share of ``msg`` on a thread (returned, for tests)."""
        t = threading.Thread(target=self._pull, args=(msg,), daemon=True,
                             name=f"tokenserve-tp-pull-{msg.pull_id}")
        t.start()
        return t

    def _pull(self, msg: TpPull) -> None:
        try:
            if self.endpoint is None:
                raise RuntimeError("no KV transfer engine on this rank")
            self.endpoint.pull(msg.sources[self.rank], list(msg.src_blocks),
                               list(msg.dst_blocks))
            doc: dict[str, Any] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - any failure is the pull's, on rank 0
            log.warning("rank %d: KV pull %d failed: %s", self.rank, msg.pull_id, exc)
            doc = {"error": str(exc), "timed_out": bool(getattr(exc, "timed_out", False))}
        key = PULL_KEY.format(pull_id=msg.pull_id, rank=self.rank)
        if self._store.compare_set(key, "", json.dumps(doc)) == ABANDONED:
            self._store.delete_key(key)  # rank 0 stopped waiting: leave nothing behind

    def close(self) -> None:
        """Close the endpoint (after the last pull)."""
        if self.endpoint is not None:
            endpoint, self.endpoint = self.endpoint, None
            endpoint.close()
