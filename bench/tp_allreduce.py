"""Tensor parallelism's communication (issue 41): all-reduce latency by message size, gloo
vs shared memory, and where a TP = 2 decode step's time goes.

    python -m bench.tp_allreduce [--world 2] [--iters 200] [--step] [--model PATH]
                                 [--batch 1,16,64] [--context 128]

Spawns ``--world`` ranks (one thread each, bound to their own CPU when the machine has
enough), joined in one gloo group and one shared-memory segment
(``tokenserve.ops.collectives``), and prints the median latency (us) of an fp32 all-reduce
of ``rows x hidden`` for the default model's hidden (576) and Llama-3.2-1B's (2048).

``--step``: loads the model's part on every rank (the default model unless ``--model``)
and times ``--steps`` decode steps of ``--batch`` requests at ``--context`` tokens, with
the time inside collectives (all-reduces, logits gather) named, against the same model in
one process on the same number of threads.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import time

SIZES = [(576, r) for r in (1, 16, 64, 256)] + [(2048, r) for r in (1, 16, 64, 256)]


def _bind(rank: int) -> None:
    import torch

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, [cpus[rank % len(cpus)]])
    torch.set_num_threads(1)


def _group(rank: int, world: int, port: int):
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return store


def _allreduce_rank(rank: int, world: int, port: int, iters: int, out) -> None:
    import torch

    from tokenserve.ops.collectives import Collectives, ShmCollectives

    _bind(rank)
    store = _group(rank, world, port)
    gloo = Collectives(rank, world, [1] * world)
    shm = ShmCollectives.open_group(rank, world, [1] * world,
                                    f"/dev/shm/tokenserve-bench-{store.port}", 2048 * 256 * 4)
    assert shm is not None, "no shared-memory segment (rank 0 logged why)"
    rows = {}
    for hidden, n in SIZES:
        x = torch.randn(n, hidden)
        for name, comm in (("gloo", gloo), ("shm", shm)):
            for _ in range(10):
                comm.all_reduce(x, torch.float32)
            t = []
            for _ in range(iters):
                t0 = time.perf_counter()
                comm.all_reduce(x, torch.float32)
                t.append((time.perf_counter() - t0) * 1e6)
            rows[(hidden, n, name)] = statistics.median(t)
    out.put((rank, pickle.dumps(rows)))


class _Timed:
    """A Collectives wrapper adding up the seconds spent inside it."""

    def __init__(self, comm) -> None:
        self.comm, self.s = comm, 0.0

    def __getattr__(self, name):
        fn = getattr(self.comm, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.s += time.perf_counter() - t0
        return timed


def _steps(model, batch: int, context: int, steps: int, comm=None) -> tuple[float, float]:
    """(median ms per decode step of ``batch`` requests at ``context`` tokens, median ms
    of it inside collectives)."""
    import torch

    from tokenserve.models.attention import AttentionMetadata

    bs = 16
    per = (context + steps + bs) // bs + 1
    kv = model.allocate_kv_cache(batch * per, bs, model.kv_cache_dtype("auto"))
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (batch * context,), generator=g)
    meta = AttentionMetadata.build(model.kernels, tables, [context] * batch, [0] * batch, bs)
    h = model.forward(ids, kv, meta)
    model.logits_at(h, [context * (i + 1) - 1 for i in range(batch)])
    times, comms = [], []
    for s in range(steps):
        c0 = comm.s if comm is not None else 0.0
        t0 = time.perf_counter()
        meta = AttentionMetadata.build(model.kernels, tables, [1] * batch,
                                       [context + s] * batch, bs)
        h = model.forward(torch.randint(100, 1000, (batch,), generator=g), kv, meta)
        model.logits_at(h, list(range(batch)))
        times.append((time.perf_counter() - t0) * 1e3)
        comms.append(((comm.s - c0) if comm is not None else 0.0) * 1e3)
    return statistics.median(times), statistics.median(comms)


def _step_rank(rank: int, world: int, port: int, args, out) -> None:
    from tokenserve.config.tree import EngineConfig, ParallelConfig
    from tokenserve.engine.loading import load_model, resolve
    from tokenserve.engine.tensor_parallel import _collectives, _context, _shards

    _bind(rank)
    store = _group(rank, world, port)
    r = resolve(EngineConfig(model=args.model, dtype=args.dtype,
                             parallel=ParallelConfig(tensor_parallel_size=world)))
    shards = _shards(r.model_cfg, world)
    comm = _Timed(_collectives(shards, rank, r.cfg.parallel, store, r.model_cfg))
    model = load_model(r, _context(shards, rank, comm))
    rows = {b: _steps(model, b, args.context, args.steps, comm)
            for b in map(int, args.batch.split(","))}
    out.put((rank, pickle.dumps(rows)))


def _one_process(args) -> dict:
    import torch

    from tokenserve.config.tree import EngineConfig
    from tokenserve.engine.loading import load_model, resolve

    torch.set_num_threads(args.world)
    model = load_model(resolve(EngineConfig(model=args.model, dtype=args.dtype)))
    return {b: _steps(model, b, args.context, args.steps)
            for b in map(int, args.batch.split(","))}


def _spawn(target, world: int, *args) -> list:
    from tokenserve.loadgen.server import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=1800) for _ in range(world))
    for p in procs:
        p.join()
    return [pickle.loads(got[r]) for r in range(world)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--step", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    from bench.profile_step import cpu_summary

    print(f"# {cpu_summary()}; load {os.getloadavg()[0]:.2f}")
    if not args.step:
        rows = _spawn(_allreduce_rank, args.world, args.iters)[0]
        print("| hidden | rows | bytes | gloo us | shared memory us | gloo / shm |")
        print("|---:|---:|---:|---:|---:|---:|")
        for hidden, n in SIZES:
            g, s = rows[(hidden, n, "gloo")], rows[(hidden, n, "shm")]
            print(f"| {hidden} | {n} | {hidden * n * 4} | {g:.1f} | {s:.1f} | {g / s:.1f}x |")
        return 0
    tp = _spawn(_step_rank, args.world, args)[0]
    one = _one_process(args)
    print(f"| batch | TP=1 ms/step ({args.world} threads) | TP={args.world} ms/step | "
          "of it in collectives | share |")
    print("|---:|---:|---:|---:|---:|")
    for b, (ms, comm) in tp.items():
        print(f"| {b} | {one[b][0]:.2f} | {ms:.2f} | {comm:.2f} | {100 * comm / ms:.0f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
