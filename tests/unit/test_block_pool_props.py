"""Property tests of the block pool (hypothesis state machine).

Invariants after every operation: ref counts never negative; blocks conserved (each
block is free or referenced, and the references equal what the holders own); every
cached hash matches the tokens it was registered with; releasing everything leaves
every block free.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenserve.engine.block_pool import BlockPool, NoFreeBlocksError, block_key

BLOCK = 2
TOKENS = st.tuples(st.integers(0, 3), st.integers(0, 3))  # few values: many collisions of content


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(8, BLOCK)
        self.holders: list[list[int]] = []  # each holder owns one reference per listed block
        self.registered: dict[int, tuple] = {}  # block -> key we registered it under

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        before = self.pool.num_free
        try:
            blocks = self.pool.allocate(n)
        except NoFreeBlocksError:
            assert n > before and self.pool.num_free == before
            return
        for b in blocks:
            self.registered.pop(b, None)  # reuse evicts a cached registration
        self.holders.append(blocks)

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.pool.free(self.holders.pop(i % len(self.holders)))

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 100), chain=st.lists(TOKENS, min_size=1, max_size=3))
    def register_chain(self, i, chain):
        blocks = self.holders[i % len(self.holders)]
        prev = None
        for b, toks in zip(blocks, chain):
            key = block_key(prev, toks)
            prev = self.pool.register(b, key)
            if self.pool.lookup([key]) == [b]:  # b now caches this key
                self.registered[b] = key

    @rule(chain=st.lists(TOKENS, min_size=1, max_size=3))
    def lookup_and_acquire(self, chain):
        keys, prev = [], None
        for toks in chain:
            keys.append(block_key(prev, toks))
            prev = hash(keys[-1])
        hits = self.pool.lookup(keys)
        for b, key in zip(hits, keys):
            assert self.registered.get(b) == key, "a hit must hold exactly the looked-up prefix"
        if hits:
            self.pool.acquire(hits)
            self.holders.append(hits)

    @invariant()
    def conserved(self):
        self.pool.check()
        owned = [0] * self.pool.num_blocks
        for h in self.holders:
            for b in h:
                owned[b] += 1
        assert owned == [self.pool.ref_count(b) for b in range(self.pool.num_blocks)]
        assert self.pool.num_free == sum(1 for r in owned if r == 0)

    def teardown(self):
        for h in self.holders:
            self.pool.free(h)
        assert self.pool.all_free()
        self.pool.check()


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None)
TestBlockPool = PoolMachine.TestCase
