"""KV-block allocator: a free list of fixed-size blocks with reference counts.

Pure and synchronous; owned by the scheduler actor (its single writer). A block is
``block_size`` token slots in every layer's K and V cache (see
``tokenserve/models/attention.py``). Blocks are handed out in FIFO order of release,
which keeps recently freed blocks cold and leaves room for the prefix cache (a later
issue) to evict least-recently-used ones.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when the pool cannot satisfy a request."""


class BlockPool:
    """Fixed pool of ``num_blocks`` KV blocks, ids ``0 .. num_blocks - 1``.

    Invariants (checked by :meth:`check`): every block is either free (ref count 0, in
    the free list exactly once) or in use (ref count >= 1, not in the free list).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref count 1 each).

        Raises:
            NoFreeBlocksError: fewer than ``n`` blocks are free (nothing is taken).
        """
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            assert self._ref[b] == 0, f"block {b} handed out while in use"
            self._ref[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block reaching 0 returns to the free list."""
        for b in blocks:
            assert self._ref[b] > 0, f"double free of block {b}"
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def check(self) -> None:
        """Assert the pool's invariants (cheap enough for tests and idle checks)."""
        free = set(self._free)
        assert len(free) == len(self._free), "block twice in free list"
        for b, r in enumerate(self._ref):
            assert r >= 0, f"negative ref count on block {b}"
            assert (r == 0) == (b in free), f"block {b}: ref {r} but free={b in free}"

    def all_free(self) -> bool:
        """True when every block is free (the idle-engine leak invariant)."""
        return len(self._free) == self.num_blocks
