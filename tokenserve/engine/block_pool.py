"""KV-block allocator with a prefix cache: ref counts, hash-chained full blocks, LRU.

Pure and synchronous; owned by the scheduler actor (its single writer). A block is
``block_size`` token slots in every layer's K and V cache (see
``tokenserve/models/attention.py``).

Prefix cache (after vLLM's automatic prefix caching, Kwon et al. 2023, and SGLang's
RadixAttention, Zheng et al. 2024): once a block is *full* of computed tokens, it is
registered under a key that chains its tokens to the key of the block before it::

    key_0 = (None,  tokens[0:B])          hash_i = hash(key_i)
    key_1 = (hash_0, tokens[B:2B])        ...

so equal hashes mean equal whole prefixes; the full key is stored and compared on a
hit, so a hash collision can never alias two prefixes. A freed block keeps its
registration and joins the free list's tail; allocation takes from the head (least
recently freed), evicting the registration of a cached block it reuses. A later
request whose prompt starts with a cached prefix takes those blocks again (ref count
+1) instead of recomputing them.
"""

from __future__ import annotations

from collections import OrderedDict

BlockKey = tuple[int | None, tuple[int, ...]]


def block_key(prev_hash: int | None, tokens: tuple[int, ...]) -> BlockKey:
    """The prefix-cache key of a full block: its parent's hash and its tokens."""
    return (prev_hash, tokens)


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when the pool cannot satisfy a request."""


class BlockPool:
    """Fixed pool of ``num_blocks`` KV blocks, ids ``0 .. num_blocks - 1``.

    Invariants (checked by :meth:`check`): a block is free (ref count 0, in the free
    list exactly once) or in use (ref count >= 1, not in the free list); every cached
    hash maps to a block registered under exactly that key.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._key: list[BlockKey | None] = [None] * num_blocks  # registration per block
        self._cached: dict[int, int] = {}  # hash -> block

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (in use or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def all_free(self) -> bool:
        """True when every block is free (the idle-engine leak invariant)."""
        return len(self._free) == self.num_blocks

    # ------------------------------------------------------------------ allocation

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref count 1 each), least recently freed first; a
        cached block taken this way leaves the prefix cache.

        Raises:
            NoFreeBlocksError: fewer than ``n`` blocks are free (nothing is taken).
        """
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            assert self._ref[b] == 0, f"block {b} handed out while in use"
            self._evict(b)
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Blocks reaching 0 join the free list's tail
        in reverse order, so a request's last blocks are evicted before its first ones
        (a shared prefix outlives the suffixes that hang off it)."""
        for b in reversed(blocks):
            assert self._ref[b] > 0, f"double free of block {b}"
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, keys: list[BlockKey]) -> list[int]:
        """Blocks caching the longest prefix of ``keys`` (a chain from block 0)."""
        if not self.enable_caching:
            return []
        hits = []
        for key in keys:
            b = self._cached.get(hash(key))
            if b is None or self._key[b] != key:
                break
            hits.append(b)
        return hits

    def acquire(self, blocks: list[int]) -> None:
        """Take one more reference to each (cached) block; free ones leave the free list."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def register(self, block: int, key: BlockKey) -> int:
        """Register a full, computed, in-use block under ``key``; returns ``hash(key)``.

        A no-op (besides returning the hash) when caching is off, when the block is
        already registered, or when another block already caches the same prefix.
        """
        h = hash(key)
        assert self._ref[block] > 0, f"registering free block {block}"
        if self.enable_caching and self._key[block] is None and h not in self._cached:
            self._key[block] = key
            self._cached[h] = block
        return h

    def _evict(self, b: int) -> None:
        key = self._key[b]
        if key is not None:
            self._key[b] = None
            del self._cached[hash(key)]

    # ------------------------------------------------------------------ invariants

    def check(self) -> None:
        """Assert the pool's invariants (cheap enough for tests and idle checks)."""
        free = set(self._free)
        assert len(free) == len(self._free), "block twice in free list"
        for b, r in enumerate(self._ref):
            assert r >= 0, f"negative ref count on block {b}"
            assert (r == 0) == (b in free), f"block {b}: ref {r} but free={b in free}"
        for h, b in self._cached.items():
            assert self._key[b] is not None and hash(self._key[b]) == h, f"block {b} hash"
        assert sum(k is not None for k in self._key) == len(self._cached)
