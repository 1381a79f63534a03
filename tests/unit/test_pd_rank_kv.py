"""PD over tensor parallelism (issue 41), without a model: the ranks' share of the KV
hand-off over a real TCP store (engine/tp_kv.py), the rank-to-rank pull and its refusal
of another world size (pd/rank_kv.py), the coordinator never pairing a P and a D of
different world sizes (coordinator/pool.py), and what the configuration still refuses."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
import torch.distributed as dist

from tokenserve.config.tree import (
    CoordinatorConfig,
    EngineConfig,
    InstanceAddr,
    ParallelConfig,
    PdConfig,
    ServeConfig,
)
from tokenserve.coordinator.pool import InstancePool
from tokenserve.engine.tp_kv import KV_KEY, PULL_KEY, RankKv, RankKvServer
from tokenserve.messages import TpKvStart, TpPull
from tokenserve.pd.kv_transfer import KvLayout, KvRegion, KvTransferError
from tokenserve.pd.rank_kv import RankedKv


def _store():
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def _region(i: int) -> KvRegion:
    return KvRegion(f"127.0.0.1:{15000 + i}", 4096 * (i + 1), KvLayout(2, 8, 64 + i))


class FakeEndpoint:
    """A rank's transfer endpoint: records its pulls, fails when told to."""

    def __init__(self, kv: Any, region: KvRegion, fail: Exception | None = None,
                 delay_s: float = 0.0) -> None:
        self.kv, self.region, self.fail, self.delay_s = kv, region, fail, delay_s
        self.pulls: list[tuple] = []
        self.closed = False

    def descriptor(self) -> KvRegion:
        return self.region

    def pull(self, src, src_blocks, dst_blocks) -> None:
        time.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        self.pulls.append((src, list(src_blocks), list(dst_blocks)))

    def close(self) -> None:
        self.closed = True


class Ranks:
    """Rank 0's RankKv wired to in-process rank servers (the step channel's ``send``
    delivers to each rank as its step loop would)."""

    def __init__(self, world: int, store) -> None:
        self.servers = [RankKvServer(r, store) for r in range(1, world)]
        self.threads: list[threading.Thread] = []
        self.rank_kv = RankKv(self.send, store, world)

    def send(self, msg) -> None:
        for srv in self.servers:
            if isinstance(msg, TpPull):
                self.threads.append(srv.pull(msg))
            elif isinstance(msg, TpKvStart):
                srv.start(msg, f"kv of rank {srv.rank}")


def test_ranks_open_their_engines_and_publish_their_regions_as_json() -> None:
    store = _store()
    ranks = Ranks(3, store)
    opened = []

    def open_transfer(kv):
        opened.append(kv)
        return FakeEndpoint(kv, _region(len(opened)))

    docs = ranks.rank_kv.start(open_transfer)
    assert opened == ["kv of rank 1", "kv of rank 2"]  # each rank's own KV tensor
    assert [KvRegion.from_dict(d) for d in docs] == [_region(1), _region(2)]
    assert not store.check([KV_KEY.format(rank=1)])  # read once, deleted


def test_a_rank_that_cannot_open_its_engine_fails_the_start_in_one_line() -> None:
    ranks = Ranks(2, _store())

    def open_transfer(kv):
        raise KvTransferError("Mooncake initialize failed (rc=-1)")

    with pytest.raises(RuntimeError, match="rank 1's KV transfer engine: KvTransferError: "
                                           "Mooncake initialize failed"):
        ranks.rank_kv.start(open_transfer)


def test_a_rank_that_never_answers_fails_the_start() -> None:
    rank_kv = RankKv(lambda msg: None, _store(), 2)
    with pytest.raises(RuntimeError, match="rank 1 opened no KV transfer engine"):
        rank_kv.start(lambda kv: None, timeout_s=0.05)


def test_each_rank_pulls_its_own_region_and_answers_once() -> None:
    store = _store()
    ranks = Ranks(3, store)
    eps = [FakeEndpoint(None, _region(r)) for r in (1, 2)]
    it = iter(eps)
    ranks.rank_kv.start(lambda kv: next(it))
    sources = ("p0", "p1", "p2")
    pid = ranks.rank_kv.begin_pull(sources, [4, 5], [0, 1])
    assert ranks.rank_kv.end_pull(pid, 5.0) == []
    assert [e.pulls for e in eps] == [[("p1", [4, 5], [0, 1])], [("p2", [4, 5], [0, 1])]]
    for r in (1, 2):
        assert not store.check([PULL_KEY.format(pull_id=pid, rank=r)])


def test_a_rank_s_failure_is_the_pull_s_with_its_timed_out_flag() -> None:
    ranks = Ranks(3, _store())
    eps = [FakeEndpoint(None, _region(1)),
           FakeEndpoint(None, _region(2), KvTransferError("P stalled", timed_out=True))]
    it = iter(eps)
    ranks.rank_kv.start(lambda kv: next(it))
    pid = ranks.rank_kv.begin_pull(("a", "b", "c"), [1], [2])
    (fail,) = ranks.rank_kv.end_pull(pid, 5.0)
    assert (fail.rank, fail.timed_out) == (2, True) and "P stalled" in fail.error


def test_an_abandoned_rank_s_late_answer_leaves_no_key() -> None:
    store = _store()
    ranks = Ranks(2, store)
    ep = FakeEndpoint(None, _region(1), delay_s=0.3)
    ranks.rank_kv.start(lambda kv: ep)
    pid = ranks.rank_kv.begin_pull(("a", "b"), [1], [2])
    (fail,) = ranks.rank_kv.end_pull(pid, 0.05)
    assert fail.timed_out and "did not answer" in fail.error
    ranks.threads[-1].join(5)
    assert ep.pulls  # it finished after rank 0 gave up ...
    assert not store.check([PULL_KEY.format(pull_id=pid, rank=1)])  # ... and cleaned up


def test_a_rank_without_an_engine_fails_its_pull() -> None:
    ranks = Ranks(2, _store())
    pid = ranks.rank_kv.begin_pull(("a", "b"), [1], [2])
    (fail,) = ranks.rank_kv.end_pull(pid, 5.0)
    assert "no KV transfer engine" in fail.error and not fail.timed_out


# ---------------------------------------------------------------------- pd/rank_kv.py


class FakeLocal:
    timeout_s = 5

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail, self.pulls = fail, []

    def pull(self, src, src_blocks, dst_blocks) -> None:
        if self.fail is not None:
            raise self.fail
        self.pulls.append((src, list(src_blocks), list(dst_blocks)))


def test_d_refuses_a_hand_off_of_another_world_size() -> None:
    """One region from a P of worldSize 1 into a D of worldSize 2, and the reverse: a
    KvTransferError naming both sizes (the existing pull-failure path), no pull."""
    store = _store()
    ranks = Ranks(2, store)
    two = RankedKv(FakeLocal(), ranks.rank_kv, [_region(0), _region(1)])  # type: ignore[arg-type]
    with pytest.raises(KvTransferError, match=r"worldSize 1\) but this D has worldSize 2"):
        two.pull([_region(5)], [1], [2])
    one = RankedKv(FakeLocal(), None, [_region(0)])  # type: ignore[arg-type]
    with pytest.raises(KvTransferError, match=r"worldSize 2\) but this D has worldSize 1"):
        one.pull([_region(5), _region(6)], [1], [2])
    assert two.local.pulls == one.local.pulls == []


def test_the_pull_goes_rank_to_rank_and_any_failure_fails_it() -> None:
    store = _store()
    ranks = Ranks(2, store)
    ep = FakeEndpoint(None, _region(1))
    ranks.rank_kv.start(lambda kv: ep)
    kv = RankedKv(FakeLocal(), ranks.rank_kv, [_region(0), _region(1)])  # type: ignore[arg-type]
    kv.pull([_region(10), _region(11)], [3, 4], [0, 1])
    assert kv.local.pulls == [(_region(10), [3, 4], [0, 1])]
    assert ep.pulls == [(_region(11), [3, 4], [0, 1])]
    # rank 0 fails, rank 1 stalls: one error, both texts, timed out
    ep.fail = KvTransferError("stalled", timed_out=True)
    bad = RankedKv(FakeLocal(KvTransferError("P is gone")), ranks.rank_kv,  # type: ignore[arg-type]
                   [_region(0), _region(1)])
    with pytest.raises(KvTransferError, match="P is gone; rank 1: stalled") as err:
        bad.pull([_region(10), _region(11)], [3], [0])
    assert err.value.timed_out


# ---------------------------------------------------------------------- the coordinator


def _pool(p_world: int, d_worlds: list[int]) -> InstancePool:
    cfg = CoordinatorConfig(prefill=(InstanceAddr.parse("127.0.0.1:1000"),),
                            decode=tuple(InstanceAddr.parse(f"127.0.0.1:{2000 + i}")
                                         for i in range(len(d_worlds))))
    pool = InstancePool(cfg, httpx.AsyncClient())
    for inst, world in zip(pool.prefill + pool.decode, [p_world, *d_worlds]):
        inst.status = {"service": {"currentRole": "decode" if inst.is_decode else "prefill"},
                       "resource": {"availBlockNum": 100, "totalNpuBlockNums": 100,
                                    "worldSize": world}}
        inst.link_up = True
    return pool


def test_the_coordinator_pairs_only_equal_world_sizes(caplog) -> None:
    pool = _pool(2, [1, 2])
    p = pool.prefill[0]
    assert pool.choose_d(world=p.world_size()).name == "127.0.0.1:2001"
    mismatched = _pool(2, [1])
    assert mismatched.choose_d(world=2) is None and not mismatched.ready()
    assert _pool(1, [1]).ready()
    with caplog.at_level(logging.WARNING, "tokenserve.coordinator.pool"):
        new = mismatched.check_pairs(mismatched.prefill[0])
        again = mismatched.check_pairs(mismatched.decode[0])
    assert len(new) == 1 and again == []  # one line per pair, not one per poll
    lines = [r.getMessage() for r in caplog.records if "cannot be linked" in r.getMessage()]
    assert lines == [("P 127.0.0.1:1000 (worldSize 2) and D 127.0.0.1:2000 (worldSize 1) "
                     "cannot be linked: the KV hand-off is rank to rank")]


def test_a_request_goes_to_a_p_that_has_a_d_of_its_size() -> None:
    """P of 2 ranks and P of 1, one D of 1: a request is placed on the P that can hand
    off (before, DIGS could keep choosing the other and the request ended 408); the
    forwarded routes still take any P."""
    cfg = CoordinatorConfig(prefill=(InstanceAddr.parse("127.0.0.1:1000"),
                                     InstanceAddr.parse("127.0.0.1:1001")),
                            decode=(InstanceAddr.parse("127.0.0.1:2000"),))
    pool = InstancePool(cfg, httpx.AsyncClient())
    for inst, world in zip(pool.prefill + pool.decode, [2, 1, 1]):
        inst.status = {"service": {"currentRole": "decode" if inst.is_decode else "prefill"},
                       "resource": {"availBlockNum": 100, "totalNpuBlockNums": 100,
                                    "worldSize": world}}
        inst.link_up = True
    for _ in range(4):
        p = pool.choose_p(linked=True)
        assert p is not None and p.name == "127.0.0.1:1001"
        p.chosen += 1  # DIGS would now prefer the other P
    assert pool.choose_p().name == "127.0.0.1:1000"
    pool.decode[0].status = None  # no usable D at all: no P for a request
    assert pool.choose_p(linked=True) is None and pool.choose_p() is not None


def test_an_instance_that_does_not_say_has_world_size_one() -> None:
    pool = _pool(1, [1])
    del pool.decode[0].status["resource"]["worldSize"]
    assert pool.decode[0].world_size() == 1 and pool.ready()
    pool.decode[0].status = None
    assert pool.decode[0].world_size() is None


# ---------------------------------------------------------------------- configuration


def test_pd_with_tensor_parallelism_is_accepted_on_one_host() -> None:
    pd = PdConfig(infer_mode="dmi", role="decode")
    ServeConfig(engine=EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2)), pd=pd)
    with pytest.raises(ValueError, match="one host"):
        ServeConfig(engine=EngineConfig(parallel=ParallelConfig(
            tensor_parallel_size=2, nnodes=2, dist_init_addr="10.0.0.1:29500")), pd=pd)
    with pytest.raises(ValueError, match="too small for 2 ranks"):
        ServeConfig(engine=EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2)),
                    pd=PdConfig(infer_mode="dmi", kv_port_range=(16000, 16002)))
