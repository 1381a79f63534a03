"""Property test of the scheduler on random workloads (hypothesis; no model).

Random limits (budget, long-prefill threshold and slots, batch sizes, a small KV pool
that forces preemption, prefix caching on or off, chunking on or off) and random
requests (lengths, priorities, arrival steps, shared prompt prefixes). Every step:

- with chunked prefill, the step's tokens fit the budget; without, each prefill is whole;
- every scheduled request has blocks for the tokens it computes this step, and its
  chunk continues exactly where its computed prefix ends;
- the block pool's invariants hold.

Some requests are aborted at a random step (waiting, prefilling or decoding). At the
end every other request has finished with exactly ``max_new_tokens`` tokens (no
starvation, whatever the priorities and lengths) and every block is free.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenserve.engine.block_pool import BlockPool
from tokenserve.engine.request import Request
from tokenserve.engine.scheduler import Scheduler, SchedulerConfig
from tokenserve.messages import FinishReason
from tokenserve.sampling_params import SamplingParams

TOKEN = 7  # what the fake model samples (never an EOS: lengths are exact)

REQUEST = st.tuples(
    st.integers(1, 40),  # prompt tokens
    st.integers(1, 5),  # max_new_tokens
    st.integers(1, 5),  # priority
    st.integers(0, 12),  # arrival step
    st.integers(0, 2),  # prompt family: equal families share a prefix
    st.one_of(st.none(), st.integers(0, 30)),  # step at which the client aborts, if any
)


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.integers(1, 6),
    num_blocks=st.integers(12, 40),
    budget=st.integers(2, 40),
    threshold_frac=st.floats(0.05, 1.0),
    max_long=st.integers(1, 3),
    max_batch=st.integers(1, 8),
    max_prefill_batch=st.integers(1, 8),
    chunked=st.booleans(),
    caching=st.booleans(),
    specs=st.lists(REQUEST, min_size=1, max_size=12),
)
def test_random_workloads_respect_the_budget_finish_and_free_every_block(
        block_size, num_blocks, budget, threshold_frac, max_long, max_batch,
        max_prefill_batch, chunked, caching, specs):
    cfg = SchedulerConfig(
        max_batch_size=max_batch, max_num_batched_tokens=budget,
        max_seq_len=num_blocks * block_size, max_prefill_batch_size=max_prefill_batch,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=max(1, int(budget * threshold_frac)),
        max_long_partial_prefills=max_long)
    pool = BlockPool(num_blocks, block_size, enable_caching=caching)
    s = Scheduler(cfg, pool)
    seq = itertools.count()
    pending = sorted(enumerate(specs), key=lambda e: e[1][3])
    want: dict[str, int] = {}
    done: dict[str, int] = {}
    aborts: list[tuple[int, str]] = []
    for step in range(3000):
        while pending and pending[0][1][3] <= step:
            i, (n_prompt, max_new, priority, _, family, abort_at) = pending.pop(0)
            # the request must fit an otherwise empty KV cache
            n_prompt = min(n_prompt, num_blocks * block_size - max_new - 1)
            prompt = [1000 * family + k for k in range(n_prompt // 2)]
            prompt += [100_000 + 100 * i + k for k in range(n_prompt - len(prompt))]
            rid = f"r{i}"
            s.add(Request(request_id=rid, token_ids=prompt, num_prompt_tokens=len(prompt),
                          params=SamplingParams(max_new_tokens=max_new, ignore_eos=True),
                          priority=priority, arrival_time=0.0, arrival_seq=next(seq)))
            want[rid] = max_new
            if abort_at is not None:
                aborts.append((abort_at, rid))
        for rid in [r for when, r in aborts if when == step]:
            if s.finish(rid, FinishReason.ABORT) is not None:
                del want[rid]
        if not pending and not s.has_work():
            break
        seqs = s.schedule()
        total = sum(len(q.token_ids) for q in seqs)
        if chunked:
            assert total <= budget
        assert len({q.request_id for q in seqs}) == len(seqs)
        for q in seqs:
            req = s.requests[q.request_id]
            assert q.token_ids and q.num_computed == req.num_computed
            assert list(q.token_ids) == req.token_ids[q.num_computed:q.num_computed + len(q.token_ids)]
            assert len(req.block_table) * block_size >= q.num_computed + len(q.token_ids)
            if not chunked and req.first_token_time is None:
                assert q.sample, "without chunked prefill a prompt is prefilled whole"
        pool.check()
        sampled = {q.request_id: TOKEN for q in seqs if q.sample}
        for req, _ in s.update(seqs, sampled, now=float(step)):
            if req.finished:
                done[req.request_id] = req.num_output_tokens
    else:
        raise AssertionError(f"not done after 3000 steps: {len(s.running)} running, "
                             f"{len(s.waiting)} waiting")
    assert done == want
    assert pool.all_free()
    pool.check()
