"""Tensor parallelism's processes (issue 41): rank 0 serves, the other ranks compute.

One model is split over ``tensor_parallel_size`` processes (:mod:`tokenserve.models.
tensor_parallel` says who holds what). Rank 0 is the server: HTTP, the scheduler, the
KV-block allocator and sampling all stay where they are, and its model thread drives the
others through :class:`TpModel`, which stands in for the :class:`CausalLM` the runner
calls::

    rank 0 model thread                          rank r (r > 0) step loop
    TpModel.forward(ids, kv, meta)
      -- TpForward(ids, meta) ---------------->  CausalLM.forward(ids, kv_r, meta)
      CausalLM.forward(ids, kv_0, meta)
         all-reduce after o and down  <=======>     the same all-reduces (gloo)
    TpModel.logits_at(hidden, rows)
      -- TpLogits(rows) ---------------------->  CausalLM.logits_at(hidden_r, rows)
         all-gather of the vocab-parallel logits <=====> the same all-gather
    sample on rank 0 (fp32 logits of the whole vocabulary)

Two channels: the **step channel** (one TCP connection from each rank to rank 0, pickled
frames of :mod:`tokenserve.messages`' ``Tp*`` messages) says what to run next, and has no
timeout (an idle server sends nothing). Like torch.distributed's own rendezvous it is not
authenticated: the ranks trust each other and their network (keep these ports on a
private network); rank 0 unpickles nothing from the channel (a rank introduces itself
with fixed bytes, ``HELLO_MAGIC`` and its rank), the other ranks unpickle what rank 0
sends; **gloo** (torch.distributed, rendezvous on rank
0's TCP store at ``--dist-init-addr``) carries the tensors inside a step, with a timeout.
Every rank's hidden states after a step are the same bits (the all-reduce hands every rank
the same sums), so ``TpLogits`` names rows, not tensors.

PD (issue 41): each rank also runs its own KV transfer engine on its own KV shard
(``TpKvStart``) and pulls its share of a hand-off (``TpPull``, on a thread of its own);
the answers come back on the TCP store as JSON (:mod:`tokenserve.engine.tp_kv`).

Faults: a rank that dies closes its step connection; rank 0 sees it at once, logs one line
and exits 1 (:func:`os._exit`: a half-served model must not keep answering). Rank 0 gone,
the others see their connection close and exit. A step that raises on rank 0 after it has
announced the step (inside a collective) is fatal too: the other ranks are inside the same
collective and cannot be rewound.
"""

from __future__ import annotations

import logging
import os
import pickle
import platform
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tokenserve.config.tree import EngineConfig, ParallelConfig
from tokenserve.engine.loading import ResolvedModel, load_model, resolve
from tokenserve.engine.tp_kv import RankKv, RankKvServer
from tokenserve.messages import TpForward, TpKvStart, TpLogits, TpPull, TpStart, TpStop
from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.config import ModelConfig
from tokenserve.models.decoder import CausalLM
from tokenserve.models.tensor_parallel import TpContext, TpShard, plan_shard
from tokenserve.ops.collectives import SHM_MACHINES, Collectives, ShmCollectives
from tokenserve.ops.host_memory import process_rss

log = logging.getLogger("tokenserve.engine")

#: seconds a collective may wait for its peers before the rank gives up (a peer alive but
#: stuck); a dead peer is noticed at once through the step channel
COLLECTIVE_TIMEOUT_S = 300.0
#: seconds rank 0 waits for every rank to join at start-up
JOIN_TIMEOUT_S = 300.0
#: the TCP store key under which rank 0 publishes its step channel's ``host:port``
CHANNEL_KEY = "tokenserve/tp/step-channel"
#: the shared-memory path carries all-reduces of up to this many rows (fp32 x hidden) and
#: logits of up to SHM_LOGIT_ROWS rows; larger messages (long prefill chunks) go by gloo
SHM_ROWS = 256
SHM_LOGIT_ROWS = 16
_HEADER = struct.Struct("<Q")
#: a rank's first bytes on the step channel: the magic, then its rank
_HELLO = struct.Struct("<4sq")
HELLO_MAGIC = b"TSTP"


# ------------------------------------------------------------------ the step channel


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket):
    """The next pickled message, or None when the peer closed the connection."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)


class StepChannel:
    """Rank 0's end of the step channel: a listening socket, then one connection per
    other rank, in rank order."""

    def __init__(self, host: str, port: int) -> None:
        self.listener = socket.create_server((host, port))
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.conns: dict[int, socket.socket] = {}
        self.stopping = False
        self._send_lock = threading.Lock()  # the model thread and PD's pulls both send

    def accept(self, ranks: int, failed: Callable[[], str | None], timeout_s: float) -> None:
        """Wait until ``ranks`` ranks have connected and said who they are.

        Raises:
            ValueError: ``failed()`` names a local rank that exited first, or the wait
                passed ``timeout_s`` (one line: how many joined).
        """
        deadline = time.monotonic() + timeout_s
        self.listener.settimeout(0.5)
        while len(self.conns) < ranks:
            why = failed()
            if why is not None:
                raise ValueError(why)
            if time.monotonic() > deadline:
                raise ValueError(f"tensor parallelism: {len(self.conns) + 1} of {ranks + 1} "
                                 f"ranks joined in {timeout_s:g} s (are the other nodes "
                                 "started with the same --dist-init-addr?)")
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(10.0)  # a rank says who it is at once; anything else is dropped
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:  # not a pickle: nothing from an unknown peer is unpickled
                head = _recv_exact(conn, _HELLO.size)
            except OSError:
                head = None
            magic, rank = _HELLO.unpack(head) if head else (b"", -1)
            if magic != HELLO_MAGIC or not 0 < rank <= ranks or rank in self.conns:
                conn.close()
                continue
            conn.settimeout(None)
            self.conns[rank] = conn
        self.listener.close()

    def send(self, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            for conn in self.conns.values():
                send_frame(conn, data)

    def watch(self, on_lost: Callable[[int], None]) -> None:
        """A daemon thread per rank: its connection closing (the rank exited or its host
        went away) calls ``on_lost(rank)`` unless :meth:`close` started first."""
        for rank, conn in self.conns.items():
            def wait(rank: int = rank, conn: socket.socket = conn) -> None:
                try:
                    conn.recv(1)
                except OSError:
                    pass
                if not self.stopping:
                    on_lost(rank)
            threading.Thread(target=wait, name=f"tokenserve-tp-watch-{rank}",
                             daemon=True).start()

    def close(self) -> None:
        """Tell every rank to stop and close the connections."""
        self.stopping = True
        try:
            self.send(TpStop())
        except OSError:
            pass
        for conn in self.conns.values():
            conn.close()


def _fatal(why: str) -> None:
    """One log line and the process exits 1 (no cleanup: ranks may be mid-collective)."""
    log.critical("tensor parallelism: %s; the server stops", why)
    logging.shutdown()
    os._exit(1)


# ------------------------------------------------------------------ rank 0's model


class TpModel:
    """Rank 0's stand-in for the :class:`CausalLM` the runner drives: the same calls
    (``forward``, ``logits_at``, ``allocate_kv_cache``...), each collective one announced
    to the other ranks first. ``cfg`` is the whole model's config (the runner sizes masks
    and logits by it); everything else is rank 0's own part (:attr:`local`).
    :attr:`rank_kv` is the other ranks' share of a PD KV hand-off (``engine/tp_kv.py``).
    """

    def __init__(self, local: CausalLM, cfg: ModelConfig, shards: list[TpShard],
                 channel: StepChannel, procs: list[subprocess.Popen],
                 store: dist.TCPStore) -> None:
        self.local, self.cfg, self.shards = local, cfg, shards
        self.channel, self.procs = channel, procs
        self.world = len(shards)
        self.rank_kv = RankKv(channel.send, store, self.world)
        channel.watch(lambda rank: _fatal(f"rank {rank} is gone"))

    def __getattr__(self, name: str):
        return getattr(self.local, name)

    def kv_bytes_per_token(self, kv_dtype: torch.dtype | None = None) -> int:
        """Bytes of KV cache a token takes on the rank that holds the most KV heads (the
        KV budget is per rank; every rank has the same number of blocks)."""
        return self.local.kv_bytes_per_token(
            kv_dtype, num_kv_heads=max(s.num_kv_heads for s in self.shards))

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          kv_dtype: torch.dtype | None = None):
        dt = kv_dtype or self.local.dtype
        self.channel.send(TpStart(num_blocks, block_size, str(dt).removeprefix("torch.")))
        return self.local.allocate_kv_cache(num_blocks, block_size, kv_dtype)

    def forward(self, input_ids: torch.Tensor, kv_caches, meta: AttentionMetadata
                ) -> torch.Tensor:
        """:meth:`CausalLM.forward` on every rank (see the module doc)."""
        self.channel.send(TpForward(input_ids.numpy(), meta.block_tables.numpy(),
                                    meta.query_start_loc.numpy(), meta.context_lens.numpy(),
                                    meta.positions.numpy(), meta.slot_mapping.numpy()))
        try:
            return self.local.forward(input_ids, kv_caches, meta)
        except Exception as exc:  # the other ranks are inside the same collectives
            _fatal(f"rank 0's forward pass failed ({type(exc).__name__}: {exc})")
            raise

    def logits_at(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """:meth:`CausalLM.logits_at` on every rank: [len(rows), vocab_size] fp32."""
        self.channel.send(TpLogits(tuple(rows)))
        try:
            return self.local.logits_at(hidden, rows)
        except Exception as exc:
            _fatal(f"rank 0's logits failed ({type(exc).__name__}: {exc})")
            raise

    def close(self) -> None:
        """Stop the other ranks (the local ones are waited for, at most 10 s each)."""
        self.channel.close()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------ ranks and CPUs


def cpu_sets(binding: str, count: int, available: list[int] | None = None,
             numa_nodes: list[list[int]] | None = None) -> list[list[int]] | None:
    """The CPUs of each of ``count`` local ranks, or None (``none``: no binding).

    ``auto``: whole NUMA nodes per rank when the nodes divide among the ranks, else this
    process's CPUs (``available``) cut into ``count`` contiguous runs. A list: one CPU set
    per rank, ``"0-7;8-15"``.

    Raises:
        ValueError: a list with another number of sets, an empty set or a bad number.
    """
    if binding == "none":
        return None
    if binding != "auto":
        sets = [_cpu_list(part) for part in binding.split(";")]
        if len(sets) != count or not all(sets):
            raise ValueError(f"--cpu-binding {binding!r}: expected {count} non-empty CPU "
                             "lists separated by ';'")
        return sets
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    nodes = [n for n in (numa_nodes if numa_nodes is not None else _numa_nodes())
             if set(n) & set(cpus)]
    if len(nodes) >= count and len(nodes) % count == 0:
        per = len(nodes) // count
        return [sorted(c for n in nodes[i * per:(i + 1) * per] for c in n if c in cpus)
                for i in range(count)]
    if len(cpus) < count:
        return [cpus] * count  # fewer CPUs than ranks: share them
    return [cpus[i * len(cpus) // count:(i + 1) * len(cpus) // count] for i in range(count)]


def _cpu_list(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"--cpu-binding: {part!r} is not a CPU number or range")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _numa_nodes() -> list[list[int]]:
    root = Path("/sys/devices/system/node")
    nodes = sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    return [_cpu_list((n / "cpulist").read_text().strip()) for n in nodes
            if (n / "cpulist").is_file()]


def bind_cpus(cpus: list[int] | None, local_ranks: int) -> None:
    """This thread (and the OpenMP team it starts) on ``cpus``, one OpenMP thread each;
    ``cpus`` None (``--cpu-binding none``): unbound, with this process's share of the CPUs
    as threads (ranks whose teams together outnumber the cores spin against each other:
    a decode step measured 20-30x slower)."""
    if cpus is None:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_ranks))
        return
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


def _store_address(par: ParallelConfig) -> tuple[str, int]:
    if par.dist_init_addr is None:
        return "127.0.0.1", 0
    host, _, port = par.dist_init_addr.rpartition(":")
    return host.strip("[]"), int(port)


def _shards(model_cfg: ModelConfig, world: int) -> list[TpShard]:
    return [plan_shard(model_cfg, r, world) for r in range(world)]


def _context(shards: list[TpShard], rank: int, comm: Collectives | None = None) -> TpContext:
    """Rank ``rank``'s :class:`TpContext`; ``comm`` None: gloo collectives on the default
    group."""
    widths = [s.vocab[1] - s.vocab[0] for s in shards]
    return TpContext(shards[rank], comm or Collectives(rank, len(shards), widths))


def _collectives(shards: list[TpShard], rank: int, par: ParallelConfig, store,
                 model_cfg: ModelConfig) -> Collectives:
    """Shared-memory collectives when every rank is on this host (one node, an x86 CPU:
    measured faster than gloo, ``bench/tp_allreduce.py``), else gloo (also when rank 0
    cannot create the segment: :meth:`ShmCollectives.open_group`)."""
    widths = [s.vocab[1] - s.vocab[0] for s in shards]
    world = len(shards)
    if par.nnodes > 1 or platform.machine() not in SHM_MACHINES:
        return Collectives(rank, world, widths)
    slot = max(model_cfg.hidden_size * 4 * SHM_ROWS, max(widths) * 4 * SHM_LOGIT_ROWS)
    path = f"/dev/shm/tokenserve-tp-{os.getpid()}-{store.port}"  # rank 0's is used
    comm = ShmCollectives.open_group(rank, world, widths, path, slot)
    return comm if comm is not None else Collectives(rank, world, widths)


def _init_group(store, rank: int, world: int) -> None:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def spawn_ranks(cfg: EngineConfig, ranks: list[int], store: tuple[str, int],
                cpus: list[list[int]] | None) -> list[subprocess.Popen]:
    """Start ``ranks`` as processes of this host (``python -m tokenserve.engine.tp_rank``,
    their arguments pickled on stdin); each joins the group at ``store``."""
    procs = []
    level = logging.getLogger().level
    for i, rank in enumerate(ranks):
        p = subprocess.Popen([sys.executable, "-m", "tokenserve.engine.tp_rank"],
                             stdin=subprocess.PIPE)
        assert p.stdin is not None
        p.stdin.write(pickle.dumps((cfg, rank, store, None if cpus is None else cpus[i],
                                    level)))
        p.stdin.close()
        procs.append(p)
    return procs


def _exited(procs: list[subprocess.Popen], ranks: list[int]) -> str | None:
    for p, rank in zip(procs, ranks):
        if p.poll() is not None:
            return f"tensor parallelism: rank {rank} exited with status {p.returncode} " \
                   "before joining (its log line above says why)"
    return None


def start_rank0(r: ResolvedModel) -> TpModel:
    """Rank 0's start-up (on the model thread): check the split, open the rendezvous
    (TCP store, step channel), start this host's other ranks, wait for every rank, load
    rank 0's part.

    Raises:
        ValueError: the model cannot be split this way, a rank exited or did not join
            (one line each).
    """
    par = r.cfg.parallel
    world = par.tensor_parallel_size
    if r.device.type != "cpu":
        raise ValueError(f"tensor parallelism runs on CPU ranks for now (gloo and shared "
                         f"memory); {r.device.type} with NCCL / HCCL is not wired yet")
    shards = _shards(r.model_cfg, world)  # every rank's split, checked before any starts
    host, port = _store_address(par)
    store = dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    channel = StepChannel(host, port + 1 if par.dist_init_addr is not None else 0)
    store.set(CHANNEL_KEY, channel.address)
    local = list(par.local_ranks)
    cpus = cpu_sets(par.cpu_binding, len(local))
    procs = spawn_ranks(r.cfg, local[1:], (host, store.port), None if cpus is None else cpus[1:])
    try:
        channel.accept(world - 1, lambda: _exited(procs, local[1:]), JOIN_TIMEOUT_S)
        log.info("tensor parallelism: %d ranks joined (rendezvous %s:%d, step channel %s); "
                 "rank 0 holds %s", world, host, store.port, channel.address, shards[0])
        _init_group(store, 0, world)
        bind_cpus(None if cpus is None else cpus[0], len(local))
        comm = _collectives(shards, 0, par, store, r.model_cfg)
        model = load_model(r, _context(shards, 0, comm))
    except BaseException:
        channel.close()
        for p in procs:
            p.kill()
        raise
    return TpModel(model, r.model_cfg, shards, channel, procs, store)


# ------------------------------------------------------------------ the other ranks


def run_rank(cfg: EngineConfig, rank: int, store_addr: tuple[str, int],
             cpus: list[int] | None) -> int:
    """Rank ``rank``'s whole life (rank > 0): join, load its part, run the step loop
    until rank 0 says stop (exit status 0) or goes away (1)."""
    par = cfg.parallel
    bind_cpus(cpus, len(par.local_ranks))
    world = par.tensor_parallel_size
    r = resolve(cfg)
    shards = _shards(r.model_cfg, world)
    store = dist.TCPStore(store_addr[0], store_addr[1], world, is_master=False,
                          timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    host, _, port = store.get(CHANNEL_KEY).decode().rpartition(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(_HELLO.pack(HELLO_MAGIC, rank))
    _init_group(store, rank, world)
    comm = _collectives(shards, rank, par, store, r.model_cfg)
    model = load_model(r, _context(shards, rank, comm))
    log.info("rank %d: %s", rank, shards[rank])
    kv = region = hidden = None
    pd = RankKvServer(rank, store)  # PD: this rank's share of the KV hand-off
    while True:
        msg = recv_message(sock)
        if msg is None:
            log.error("tensor parallelism rank %d: rank 0 is gone; exiting", rank)
            return 1
        if isinstance(msg, TpForward):
            meta = AttentionMetadata(*(torch.from_numpy(a) for a in (
                msg.block_tables, msg.query_start_loc, msg.context_lens, msg.positions,
                msg.slot_mapping)))
            hidden = model.forward(torch.from_numpy(msg.input_ids), kv, meta)
        elif isinstance(msg, TpLogits):
            assert hidden is not None
            model.logits_at(hidden, list(msg.rows))
        elif isinstance(msg, TpStart):
            kv = model.allocate_kv_cache(msg.num_blocks, msg.block_size,
                                         getattr(torch, msg.kv_dtype))
            region = kv[0][0]._base  # every layer's K and V: one tensor
            rss = process_rss()
            log.info("rank %d memory: resident %.0f MiB (peak %.0f) = weights %.0f + KV cache "
                     "%.0f + the rest", rank, *(v / 2**20 for v in (
                         rss or (0, 0))), model.weight_bytes / 2**20,
                     region.numel() * region.element_size() / 2**20)
        elif isinstance(msg, TpPull):
            pd.pull(msg)
        elif isinstance(msg, TpKvStart):
            pd.start(msg, region)
        elif isinstance(msg, TpStop):
            pd.close()
            dist.destroy_process_group()
            return 0
        else:
            raise TypeError(f"unexpected step-channel message {msg!r}")


def run_node(cfg: EngineConfig) -> int:
    """A node other than 0 (``--node-rank R > 0``): start this host's ranks and wait;
    the first to exit stops the others, its status is the node's."""
    par = cfg.parallel
    local = list(par.local_ranks)
    cpus = cpu_sets(par.cpu_binding, len(local))
    procs = spawn_ranks(cfg, local, _store_address(par), cpus)
    # SIGTERM / SIGINT: leave through the finally below, which stops the ranks
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    log.info("tensor parallelism node %d: ranks %s started, joining %s", par.node_rank,
             local, par.dist_init_addr)
    try:
        while True:
            for p in procs:
                if p.poll() is not None:
                    for q in procs:
                        if q.poll() is None:
                            q.terminate()
                    return p.returncode
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
