"""P and D choice, pure (spec/pd_disaggregation.md §3.4; no I/O, no clock): the pool
hands in what it knows of each usable instance and gets an index back.

DIGS load balance (MindIE-MS ``algorithm_type: load_balance``, the default), [I] our
reading of §3.4 with one scheduling group and no per-instance cap::

    P: least demand already assigned for prefill = estimated prompt tokens of the
       requests sent to it and not answered; ties: fewest submissions so far (turns),
       then list order
    D: least compute-aware load = slots share + blocks share, where
         slots share  = requests on it / the most requests on any candidate D
         blocks share = (blocks in use + blocks assigned since its last poll + this
                         request's blocks) / its total blocks
       ties: list order

Prefix-cache affinity for P (``--p-policy affinity``; SGLang's cache-aware router and
MindIE-MS ``cache_affinity`` are the anchors, [I] a stateless form): the first
``prefix_chars`` characters of the prompt pick a P by rendezvous hashing (the same
prefix lands on the same P while the membership holds; a P joining or leaving moves only
its share), and that P is taken unless it is out of balance: its prefill load exceeds
both ``bound`` times the least loaded P's and the least plus ``slack`` tokens (SGLang's
relative and absolute balance thresholds); then the DIGS choice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("load", "affinity")


@dataclass(frozen=True)
class PView:
    """A usable P: ``name`` (``host:port``), ``load`` (prompt tokens assigned, not
    answered) and ``chosen`` (submissions so far)."""

    name: str
    load: int
    chosen: int = 0


@dataclass(frozen=True)
class DView:
    """A usable D: requests on it, KV blocks free at its last poll, blocks assigned
    since, its total blocks (0 when unknown)."""

    outstanding: int
    free: int
    assigned: int
    total: int


def digs_p(cands: Sequence[PView]) -> int | None:
    """Index of the DIGS P (module docstring); None when there is none."""
    if not cands:
        return None
    return min(range(len(cands)), key=lambda i: (cands[i].load, cands[i].chosen, i))


def digs_d(cands: Sequence[DView], demand_blocks: int) -> int | None:
    """Index of the DIGS D for a request of ``demand_blocks`` blocks; None when none."""
    if not cands:
        return None
    most = max(max(d.outstanding for d in cands), 1)

    def load(i: int) -> tuple[float, int]:
        d = cands[i]
        total = d.total if d.total > 0 else max(d.free, 1)
        in_use = max(0, total - d.free)
        return d.outstanding / most + (in_use + d.assigned + demand_blocks) / total, i

    return min(range(len(cands)), key=load)


def prefix_key(prompt: str, prefix_chars: int) -> bytes:
    """What affinity hashes: the prompt's first ``prefix_chars`` characters."""
    return prompt[:prefix_chars].encode("utf-8", "surrogatepass")


def affinity_p(cands: Sequence[PView], key: bytes, bound: float, slack: int
               ) -> int | None:
    """Index of the affinity P for a prompt whose prefix is ``key`` (module
    docstring); None when there is none."""
    if not cands:
        return None
    best = max(range(len(cands)), key=lambda i: hashlib.blake2b(
        cands[i].name.encode() + b"\0" + key, digest_size=8).digest())
    least = min(c.load for c in cands)
    load = cands[best].load
    if load > bound * least and load > least + slack:
        return digs_p(cands)
    return best
