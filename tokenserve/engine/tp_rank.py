"""``python -m tokenserve.engine.tp_rank``: one tensor-parallel rank other than 0, started
by :func:`tokenserve.engine.tensor_parallel.spawn_ranks` with its arguments pickled on
stdin (the engine config, its rank, the rendezvous address, its CPUs, the log level).
Exit status: 0 when rank 0 stopped it, 1 on a fault, 2 when it could not start."""

from __future__ import annotations

import logging
import pickle
import sys


def main() -> int:
    cfg, rank, store, cpus, level = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=level,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    from tokenserve.engine.tensor_parallel import run_rank

    try:
        return run_rank(cfg, rank, store, cpus)
    except (ValueError, FileNotFoundError) as exc:
        logging.getLogger("tokenserve.engine").error("rank %d cannot start: %s", rank, exc)
        return 2
    except Exception:  # the trace, then the status rank 0 watches
        logging.getLogger("tokenserve.engine").exception("rank %d failed", rank)
        return 1


if __name__ == "__main__":
    sys.exit(main())
