"""The scheduler's speculative drafting (``SchedulerConfig.spec``): pure, no torch.

Once the step is planned, a greedy decode may carry up to k draft tokens from prompt
lookup (``ngram.py``), in the budget left over and in blocks that are free (a draft never
preempts). The model thread verifies them in the same forward pass; ``Scheduler.update``
commits the accepted tokens (their K/V are already in the cache), checks the finish rules
token by token, and frees the blocks that only rejected drafts used
(:meth:`Drafter.free_rejected`; the K/V of a rejected position is overwritten when the
position is computed again). Greedy tokens are the model's own argmax at every position
and our logits do not depend on how a step is shaped, so the output is bit-identical to
plain decoding. Drafts go only to requests that can use them losslessly and cheaply:
greedy, no logprobs, no stop strings (text after a stop must not be generated), no
structured-output constraint (its matcher would have to follow each draft position), not
a PD prefill; only in steps with at most ``max_draft_rows`` decodes (a wider batch is
already compute-bound on a CPU); and not for a request whose acceptance rate has fallen
below ``min_acceptance`` (it backs off for ``backoff_steps`` decode steps).
"""

from __future__ import annotations

from tokenserve.config.tree import SpecConfig
from tokenserve.engine.block_pool import BlockPool
from tokenserve.engine.ngram import propose
from tokenserve.engine.request import Request


class Drafter:
    """Draft tokens for a step's decodes, and the acceptance they earned."""

    def __init__(self, spec: SpecConfig | None, pool: BlockPool, max_seq_len: int) -> None:
        self.spec = spec  # None: no drafts
        self.pool = pool
        self.max_seq_len = max_seq_len
        self.num_draft_tokens = 0  # draft tokens verified
        self.num_accepted_tokens = 0  # of which accepted

    def drafts(self, reqs: list[Request], plan: dict[str, int],
               budget: int) -> dict[str, tuple[int, ...]]:
        """Draft tokens for this step's eligible decodes (``reqs``, ``plan``: request_id
        -> tokens this step), in the ``budget`` left and in free blocks (allocated here);
        request_id -> draft."""
        spec = self.spec
        if spec is None or budget <= 0:
            return {}
        decodes = [r for r in reqs if plan[r.request_id] == 1
                   and r.num_tokens - r.num_computed == 1]
        if not decodes or len(decodes) > spec.max_draft_rows:
            return {}
        bs, out = self.pool.block_size, {}
        for req in decodes:
            if budget <= 0 or not may_draft(req):
                continue
            room = ((len(req.block_table) + self.pool.num_free) * bs
                    - req.num_computed - 1)  # positions after the decode's own token
            k = min(spec.num_speculative_tokens, budget, room,
                    req.params.max_new_tokens - req.num_output_tokens - 1,
                    self.max_seq_len - req.num_tokens - 1)
            draft = propose(req.token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
            if not draft:
                continue
            need = self.pool.blocks_for(req.num_computed + 1 + len(draft)) - len(req.block_table)
            if need > 0:
                req.block_table += self.pool.allocate(need)
            out[req.request_id] = draft
            budget -= len(draft)
        return out

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        """Count a verified draft; a request whose running acceptance rate falls below
        ``min_acceptance`` backs off."""
        spec = self.spec
        assert spec is not None
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        req.spec_acceptance = 0.7 * req.spec_acceptance + 0.3 * (accepted / drafted)
        if req.spec_acceptance < spec.min_acceptance:
            req.spec_backoff, req.spec_acceptance = spec.backoff_steps, 1.0

    def free_rejected(self, req: Request) -> None:
        """Give back the blocks that only ``req``'s rejected drafts used (it goes on
        running)."""
        keep = self.pool.blocks_for(req.num_tokens)
        if len(req.block_table) > keep:
            self.pool.free(req.block_table[keep:])
            del req.block_table[keep:]


def may_draft(req: Request) -> bool:
    """Whether ``req``'s decode may carry a draft (see the module doc); a request backing
    off counts down one step."""
    p = req.params
    if (p.do_sample or p.logprobs is not None or p.stop or not p.speculative
            or p.structured is not None or req.prefill_only or req.first_token_time is None):
        return False
    if req.spec_backoff > 0:
        req.spec_backoff -= 1
        return False
    return True
