"""Run a function on several tensor-parallel ranks (processes, gloo) and collect results."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, rank: int, world: int, port: int, args: tuple, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        # plain pickle bytes: a queue would share tensors by file descriptor, gone once
        # this process exits
        out.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = 120.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned processes joined in one gloo group;
    their return values in rank order (a rank's exception fails the call with its trace)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, args, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = out.get(timeout=timeout_s)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
