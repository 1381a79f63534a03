"""P/D choice, pure (tokenserve/coordinator/policy.py; spec/pd_disaggregation.md §3.4):
DIGS for P and D, prefix affinity for P, without sockets."""

from __future__ import annotations

from tokenserve.coordinator.policy import (
    DView,
    PView,
    affinity_p,
    digs_d,
    digs_p,
    prefix_key,
)


def test_digs_p_least_load_then_turns_then_order() -> None:
    assert digs_p([]) is None
    assert digs_p([PView("a", 30), PView("b", 10), PView("c", 10)]) == 1
    assert digs_p([PView("a", 0, chosen=3), PView("b", 0, chosen=2)]) == 1
    assert digs_p([PView("a", 0, 1), PView("b", 0, 1)]) == 0


def test_digs_d_weighs_slots_and_blocks() -> None:
    assert digs_d([], 1) is None
    # same blocks: fewer requests wins
    assert digs_d([DView(4, 50, 0, 100), DView(1, 50, 0, 100)], 1) == 1
    # same requests: more free blocks (counting those assigned since the poll) wins
    assert digs_d([DView(2, 90, 60, 100), DView(2, 50, 0, 100)], 1) == 1
    # a bigger cache with the same use is less loaded
    assert digs_d([DView(0, 90, 0, 100), DView(0, 990, 0, 1000)], 4) == 1
    # unknown totals: free blocks decide
    assert digs_d([DView(0, 10, 0, 0), DView(0, 20, 0, 0)], 1) == 1


def test_affinity_same_prefix_same_p_while_in_bound() -> None:
    ps = [PView("10.0.0.1:1025", 0), PView("10.0.0.2:1025", 0), PView("10.0.0.3:1025", 0)]
    system = "You are a helpful assistant. " * 30
    keys = [prefix_key(system + f"question {i}", 512) for i in range(20)]
    picks = {affinity_p(ps, k, 2.0, 100) for k in keys}
    assert len(picks) == 1  # one shared prefix, one P
    spread = {affinity_p(ps, prefix_key(f"{i} " + system, 512), 2.0, 100) for i in range(50)}
    assert spread == {0, 1, 2}  # different prefixes use every P
    (best,) = picks
    # the affinity P out of balance (above 2x the least and the least + 100): the least
    loaded = [PView(p.name, 1000 if i == best else 10) for i, p in enumerate(ps)]
    assert affinity_p(loaded, keys[0], 2.0, 100) != best
    within = [PView(p.name, 110 if i == best else 10) for i, p in enumerate(ps)]
    assert affinity_p(within, keys[0], 2.0, 100) == best  # only 100 above the least
    within = [PView(p.name, 1000 if i == best else 600) for i, p in enumerate(ps)]
    assert affinity_p(within, keys[0], 2.0, 100) == best  # under 2x the least
    # membership change: a P leaving moves only its own prefixes
    names = [p.name for p in ps]
    before = {k: names[affinity_p(ps, prefix_key(f"{k}x", 8), 2.0, 1)] for k in range(60)}
    after = {k: names[[0, 2][affinity_p([ps[0], ps[2]], prefix_key(f"{k}x", 8), 2.0, 1)]]
             for k in range(60)}
    assert all(after[k] == before[k] for k in before if before[k] != names[1])
    assert affinity_p([], b"x", 2.0, 1) is None


def test_p_error_retries_back_off_past_kv_trans_timeout() -> None:
    from tokenserve.config.tree import CoordinatorConfig, InstanceAddr, PdConfig
    from tokenserve.coordinator.relay import retry_delay

    assert [retry_delay(1.0, n) for n in range(1, 6)] == [1, 2, 4, 8, 16]
    cfg = CoordinatorConfig(prefill=(InstanceAddr("a", 1),), decode=(InstanceAddr("b", 2),))
    waited = sum(retry_delay(cfg.retry_delay_s, n) for n in range(1, cfg.max_retry + 1))
    assert waited > PdConfig().kv_trans_timeout_s  # the default retries outlast P's wait
