"""tokenserve/pd/kv_transfer.py: segment planning (pure) and real Mooncake pulls between two
processes on 127.0.0.1 (a child plays P, this process plays D).

Mooncake is never skipped silently: without it these tests skip locally and fail in CI.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from tokenserve.pd.kv_transfer import (
    MAX_SEGMENTS_PER_CALL,
    KvLayout,
    KvRegion,
    KvTransfer,
    KvTransferError,
    load_mooncake,
    merge_runs,
    plan_segments,
    pull_blocks_ref,
)

try:
    load_mooncake()
    HAVE_MOONCAKE = True
except KvTransferError:
    HAVE_MOONCAKE = False

ROOT = Path(__file__).resolve().parents[2]

# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, bf16; blocks of 16 tokens
LAYERS, HKV, BS, HD = 30, 3, 16, 64
P_BLOCKS, D_BLOCKS = 200, 256  # P and D hold different numbers of blocks
BLOCK_BYTES = HKV * BS * HD * 2


def random_kv(num_layers: int, num_blocks: int, seed: int) -> torch.Tensor:
    """[num_layers, 2, num_blocks, HKV, BS, HD] bf16 of random bits (NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**15, 2**15, (num_layers, 2, num_blocks, HKV, BS, HD),
                         dtype=torch.int16, generator=g)
    return bits.view(torch.bfloat16)


# P: allocate the same random KV as random_kv(), register it, print the descriptor, wait
# for stdin to close.
CHILD = """
import json, sys, torch
from tokenserve.pd.kv_transfer import KvTransfer
layers, blocks, seed, hkv, bs, hd = map(int, sys.argv[1:7])
g = torch.Generator().manual_seed(seed)
kv = torch.randint(-2**15, 2**15, (layers, 2, blocks, hkv, bs, hd), dtype=torch.int16,
                   generator=g).view(torch.bfloat16)
with KvTransfer("127.0.0.1", kv) as t:
    print(json.dumps(t.descriptor().to_dict()), flush=True)
    sys.stdin.readline()
"""


class PeerP:
    """A child process holding a registered KV region (the prefill side)."""

    def __init__(self, num_layers: int, num_blocks: int, seed: int) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(num_layers), str(num_blocks), str(seed),
             str(HKV), str(BS), str(HD)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            self.log.seek(0)
            pytest.fail("the P child did not start: " + self.log.read().decode()[-2000:])
        self.region = KvRegion.from_dict(json.loads(line))

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------------------- pure


@pytest.mark.parametrize("src,dst,runs", [
    ([], [], []),
    ([5], [2], [(5, 2, 1)]),
    ([4, 5, 6, 9], [0, 1, 2, 3], [(4, 0, 3), (9, 3, 1)]),
    ([1, 2, 3], [7, 9, 10], [(1, 7, 1), (2, 9, 2)]),  # consecutive on one side only
    ([3, 2, 1], [0, 1, 2], [(3, 0, 1), (2, 1, 1), (1, 2, 1)]),  # reversed
    ([0, 1, 2, 3], [4, 5, 6, 7], [(0, 4, 4)]),
    ([2, 3, 0, 1], [2, 3, 0, 1], [(2, 2, 2), (0, 0, 2)]),  # order kept, no sorting
])
def test_merge_runs(src, dst, runs):
    assert merge_runs(src, dst) == runs


def test_plan_segments_offsets():
    src, dst = KvLayout(2, 4, 10), KvLayout(2, 6, 10)
    # one run of two blocks, once per plane (layer, K/V): plane p starts at p * num_blocks
    assert plan_segments(src, dst, [1, 2], [4, 5]) == [
        ((p * 4 + 1) * 10, (p * 6 + 4) * 10, 20) for p in range(4)]
    assert plan_segments(src, dst, [], []) == []
    # the whole cache between equal layouts is one segment
    assert plan_segments(src, src, [0, 1, 2, 3], [0, 1, 2, 3]) == [(0, 0, 2 * 2 * 4 * 10)]
    # the last block of one plane and the first of the next touch on both sides: merged
    assert plan_segments(src, src, [0, 3], [0, 3]) == [
        (0, 0, 10)] + [(p * 40 - 10, p * 40 - 10, 20) for p in range(1, 4)] + [(150, 150, 10)]


@pytest.mark.parametrize("src_blocks,dst_blocks,match", [
    ([0, 1], [0], "2 source blocks for 1"),
    ([4], [0], r"source block ids \[4\] out of range \[0, 4\)"),
    ([0], [-1], r"destination block ids \[-1\] out of range"),
    ([0, 1], [3, 3], "listed twice"),
    ([0.0], [1], "must be ints"),
    (["1"], [1], "must be ints"),
])
def test_plan_segments_rejects(src_blocks, dst_blocks, match):
    with pytest.raises(KvTransferError, match=match):
        plan_segments(KvLayout(2, 4, 10), KvLayout(2, 6, 10), src_blocks, dst_blocks)


def test_plan_segments_rejects_another_model():
    for other in (KvLayout(3, 4, 10), KvLayout(2, 4, 12)):
        with pytest.raises(KvTransferError, match="layouts differ"):
            plan_segments(KvLayout(2, 4, 10), other, [0], [0])


@pytest.mark.parametrize("seed", range(20))
def test_segments_copy_equals_reference(seed):
    """Copying plan_segments' byte ranges does what pull_blocks_ref does."""
    rng = random.Random(seed)
    layers, ns, nd = rng.randint(1, 4), rng.randint(1, 9), rng.randint(1, 9)
    shape = (layers, 2, ns, 2, 3, 4)
    src = torch.randn(shape).to(torch.bfloat16)
    dst = torch.randn((layers, 2, nd, 2, 3, 4)).to(torch.bfloat16)
    n = rng.randint(0, min(ns, nd))
    sb, db = rng.sample(range(ns), n), rng.sample(range(nd), n)
    if rng.random() < 0.3:  # runs consecutive on both sides
        s0, d0 = rng.randint(0, ns - n), rng.randint(0, nd - n)
        sb, db = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    want = dst.clone()
    pull_blocks_ref(src, want, sb, db)
    got = dst.clone()
    sbytes, gbytes = src.view(-1).view(torch.uint8), got.view(-1).view(torch.uint8)
    for so, do, length in plan_segments(KvLayout.from_tensor(src), KvLayout.from_tensor(dst),
                                        sb, db):
        gbytes[do:do + length] = sbytes[so:so + length]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_layout_and_region():
    kv = torch.zeros(LAYERS, 2, 7, HKV, BS, HD, dtype=torch.bfloat16)
    layout = KvLayout.from_tensor(kv)
    assert layout == KvLayout(LAYERS, 7, 6144) and layout.nbytes == kv.numel() * 2
    assert KvLayout.from_tensor(kv.float()).block_bytes == 2 * 6144
    for bad in (kv[:, 0], kv.transpose(0, 2), torch.zeros(2, 3, 4, 1, 1, 1)):
        with pytest.raises(ValueError):
            KvLayout.from_tensor(bad)
    with pytest.raises(ValueError, match="num_blocks"):
        KvLayout(1, 0, 8)
    r = KvRegion("10.1.2.3:15123", 140000000000, layout)
    assert KvRegion.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    for bad in ([], {"session_id": "h:1"}, {**r.to_dict(), "session_id": "noport"},
                {**r.to_dict(), "base_addr": "1"}, {**r.to_dict(), "block_bytes": -1},
                {**r.to_dict(), "num_layers": True}):
        with pytest.raises(ValueError):
            KvRegion.from_dict(bad)


# ---------------------------------------------------------------------------- Mooncake


@pytest.fixture(scope="module")
def mooncake_ok():
    if not HAVE_MOONCAKE:
        if os.environ.get("CI"):
            pytest.fail("CI: mooncake (pip install mooncake-transfer-engine-non-cuda) is "
                        "not installed; the PD KV transfer tests would skip")
        pytest.skip("mooncake not installed (pip install mooncake-transfer-engine-non-cuda)")


@pytest.fixture(scope="module")
def d_side(mooncake_ok):
    """This process as D: its own random KV, registered; stalled pulls end after 5 s."""
    kv = torch.zeros(LAYERS, 2, D_BLOCKS, HKV, BS, HD, dtype=torch.bfloat16)
    with KvTransfer("127.0.0.1", kv, timeout_s=5) as t:
        yield t, kv


@pytest.fixture(scope="module")
def p_side(mooncake_ok):
    p = PeerP(LAYERS, P_BLOCKS, seed=1)
    yield p.region, random_kv(LAYERS, P_BLOCKS, seed=1)
    p.stop()


def test_listeners_bind_inside_the_port_range(mooncake_ok):
    """``port_range`` (``--kv-port-range``) bounds Mooncake's listener; in a fresh process,
    as the server's, where the KvTransfer is what imports Mooncake."""
    child = ("import torch\n"
             "from tokenserve.pd.kv_transfer import KvTransfer\n"
             "kv = torch.zeros(1, 2, 2, 1, 2, 2, dtype=torch.bfloat16)\n"
             "with KvTransfer('127.0.0.1', kv, port_range=(16511, 16531)) as t:\n"
             "    print('SESSION', t.session_id, flush=True)\n")
    for _ in range(3):  # three fresh processes: three random ports, each inside
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                             timeout=60)
        line = next(x for x in out.stdout.splitlines() if x.startswith("SESSION"))
        port = int(line.rsplit(":", 1)[1])
        assert 16511 <= port <= 16531, out.stdout + out.stderr


def test_engine_rejects_bad_regions(mooncake_ok):
    with pytest.raises(KvTransferError, match="contiguous tensor"):
        KvTransfer("127.0.0.1", torch.zeros(4, 2, 3, 1, 2, 2).transpose(0, 2))
    with pytest.raises(KvTransferError, match="reads host memory only"):
        KvTransfer("127.0.0.1", torch.empty(1, 2, 3, 1, 2, 2, device="meta"))


def _check_pull(d_side, p_side, src_blocks, dst_blocks):
    (d, d_kv), (region, p_kv) = d_side, p_side
    d_kv.fill_(-1.0)
    d.pull(region, src_blocks, dst_blocks)
    want = torch.full_like(d_kv, -1.0)
    pull_blocks_ref(p_kv, want, src_blocks, dst_blocks)
    assert torch.equal(d_kv.view(torch.int16), want.view(torch.int16))  # bytes, NaNs too


@pytest.mark.parametrize("case", ["one", "scattered", "reversed", "runs", "all", "empty",
                                  "many"])
def test_pull_awkward_blocks(d_side, p_side, case):
    rng = random.Random(case)
    src, dst = {
        "one": ([P_BLOCKS - 1], [0]),
        "scattered": (rng.sample(range(P_BLOCKS), 37), rng.sample(range(D_BLOCKS), 37)),
        "reversed": (list(range(60, 40, -1)), list(range(100, 120))),
        "runs": ([5, 6, 7, 100, 101, 3], [200, 201, 202, 9, 10, 255]),
        "all": (list(range(P_BLOCKS)), list(range(D_BLOCKS - P_BLOCKS, D_BLOCKS))),
        "empty": ([], []),
        # 150 * 60 = 9000 one-block segments: two Mooncake calls, far over the TCP
        # transport's default per-peer queue of 1024
        "many": (rng.sample(range(P_BLOCKS), 150), rng.sample(range(D_BLOCKS), 150)),
    }[case]
    if case == "many":
        assert len(plan_segments(p_side[0].layout, d_side[0].layout, src, dst)) > \
            MAX_SEGMENTS_PER_CALL
    _check_pull(d_side, p_side, src, dst)


def test_pull_rejects_bad_requests(d_side, p_side):
    (d, _), (region, _) = d_side, p_side
    with pytest.raises(KvTransferError, match="out of range"):
        d.pull(region, [P_BLOCKS], [0])
    with pytest.raises(KvTransferError, match="out of range"):
        d.pull(region, [0], [D_BLOCKS])
    other = KvRegion(region.session_id, region.base_addr, KvLayout(LAYERS, P_BLOCKS, 4096))
    with pytest.raises(KvTransferError, match="layouts differ"):
        d.pull(other, [0], [0])
    # addresses P never registered: P's engine refuses the read, nothing hangs
    lying = KvRegion(region.session_id, region.base_addr + 4096, region.layout)
    with pytest.raises(KvTransferError) as e:
        d.pull(lying, [P_BLOCKS - 1], [0])
    assert not e.value.timed_out


def test_concurrent_pulls(d_side, p_side):
    """Four worker threads pull disjoint blocks at once through one engine."""
    (d, d_kv), (region, p_kv) = d_side, p_side
    d_kv.zero_()
    jobs = [(list(range(10 * i, 10 * i + 5)), [50 * i + 3 * j for j in range(5)])
            for i in range(4)]
    errors = []

    def run(sb, db):
        try:
            d.pull(region, sb, db)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    want = torch.zeros_like(d_kv)
    for sb, db in jobs:
        pull_blocks_ref(p_kv, want, sb, db)
    assert torch.equal(d_kv.view(torch.int16), want.view(torch.int16))


def test_pull_from_absent_session_fails_fast(d_side, p_side):
    (d, _), (region, _) = d_side, p_side
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # nothing listens: refused at once; a name that does not resolve: as fast as the DNS
    for sid, bound_s in ((f"127.0.0.1:{port}", 3), ("no-such-host.invalid:15000", 10)):
        absent = KvRegion(sid, region.base_addr, region.layout)
        t0 = time.monotonic()
        with pytest.raises(KvTransferError, match="failed") as e:
            d.pull(absent, [0, 1], [0, 1])
        assert time.monotonic() - t0 < bound_s and not e.value.timed_out


def test_pull_from_stalled_then_dead_peer(d_side):
    """P stalled (SIGSTOP): the pull ends at D's 5 s timeout, flagged timed_out; P killed:
    the next pull fails at once."""
    d, _ = d_side
    p = PeerP(LAYERS, 8, seed=2)
    try:
        d.pull(p.region, [0, 1], [0, 1])  # handshake done, connection up
        os.kill(p.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(KvTransferError, match="stalled") as e:
            d.pull(p.region, list(range(8)), list(range(8)))
        assert 4.5 < time.monotonic() - t0 < 8 and e.value.timed_out
        p.proc.kill()  # never resumed: its late data cannot land anywhere
        p.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(KvTransferError) as e:
            d.pull(p.region, [2], [2])
        assert time.monotonic() - t0 < 3 and not e.value.timed_out
    finally:
        p.proc.kill()
        p.stop()


def test_pull_throughput(d_side, p_side, capsys):
    """Hand-off cost over TCP on this machine (printed, not asserted)."""
    (d, _), (region, _) = d_side, p_side
    rng = random.Random(0)
    cases = {  # name: (src blocks, dst blocks)
        "20 blocks, runs": (list(range(20)), list(range(100, 120))),
        "20 blocks, scattered": (rng.sample(range(P_BLOCKS), 20),
                                 rng.sample(range(D_BLOCKS), 20)),
        "182 blocks (64 MiB)": (list(range(182)), list(range(182))),
    }
    lines = []
    for name, (sb, db) in cases.items():
        d.pull(region, sb, db)  # warm
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            d.pull(region, sb, db)
            times.append(time.perf_counter() - t0)
        dt = sorted(times)[len(times) // 2]
        nbytes = len(sb) * 2 * LAYERS * BLOCK_BYTES
        nseg = len(plan_segments(region.layout, d.layout, sb, db))
        lines.append(f"KV pull {name}: {nbytes / 2**20:.1f} MiB in {nseg} segments, "
                     f"median {dt * 1e3:.2f} ms, {nbytes / dt / 1e6:.0f} MB/s")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
