"""Engine-side request state.

States::

    WAITING --schedule--> RUNNING --EOS/length--> FINISHED
       ^                     |
       +----- preempt -------+   (blocks freed, recomputed from scratch on resume)

    PD prefill (prefill_only):  RUNNING --first token--> PARKED (blocks held for the
                                decode instance) --release/timeout--> FINISHED
    PD decode (pull_tokens > 0): WAITING --blocks--> PULLING --KV pulled--> RUNNING;
                                 preempted -> FINISHED (RECOMPUTE: a prefill instance
                                 recomputes it, spec/pd_disaggregation.md §7)

    any state --abort/timeout--> FINISHED
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tokenserve.messages import FinishReason
from tokenserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue after losing its blocks
    PARKED = "parked"  # PD prefill done: blocks held until the decode instance pulls them
    PULLING = "pulling"  # PD decode: blocks allocated, K/V being pulled from the prefill
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it.

    Attributes:
        token_ids: prompt followed by generated tokens (the repetition penalty's history).
        num_prompt_tokens: length of the prompt prefix of ``token_ids``.
        num_computed: tokens whose K/V are in the cache (positions ``[0, num_computed)``).
        block_table: KV block ids covering positions ``[0, len(block_table) * block_size)``.
        deadline: absolute ``time.monotonic()`` (s) past which the request times out,
            and ``deadline_reason`` the name MindIE gives it (spec §0.4 step 9).
        token_timeout_s: the server's ``tokenTimeout``: max seconds between tokens.
        prefill_only: park after the first token (PD prefill instance).
        pull_tokens: K/V of positions ``[0, pull_tokens)`` are pulled from another
            instance instead of computed (PD decode); 0 once pulled or when none.
        recompute_elsewhere: on preemption, end with ``RECOMPUTE`` instead of being
            recomputed here (PD decode: it cannot prefill).
        prompt_lp_pending: the prompt's log-probabilities are still to be computed (it
            asked for them and has sampled nothing here yet); None at construction:
            asked and nothing generated. Such a request skips the prefix-cache lookup.

    Sampling state (the generator, the penalties' history) is not here: the model thread
    owns it, keyed by request id (``messages.SeqStart``).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int
    arrival_time: float
    arrival_seq: int
    deadline: float = float("inf")
    deadline_reason: str = ""
    token_timeout_s: float = float("inf")
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    #: the stop token id that ended it (``finish.after_token``), else None
    stop_reason: str | int | None = None
    #: PD adoption: ``KvAdoption.generator_state``, handed to the model thread with the
    #: request's first step (:class:`~tokenserve.messages.SeqStart`)
    adopted_state: bytes | None = None
    #: structured output: the compiled constraint (``GenerateRequest.grammar``), handed to
    #: the model thread with the first step (:class:`~tokenserve.messages.SeqStart`)
    grammar: Any = field(default=None, repr=False)
    #: the model thread holds this request's sampling state (its SeqStart was sent), so
    #: it must be told to drop it when the request ends
    on_runner: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    #: prefix-cache hashes of the full, computed blocks at the head of block_table
    block_hashes: list[int] = field(default_factory=list)
    #: leading block_table entries already given back to the pool (out of every future
    #: query's sliding window: ``Scheduler._release_out_of_window``)
    num_released: int = 0
    #: prompt tokens found in the prefix cache at first admission (usage.cached_tokens)
    num_cached_tokens: int = 0
    first_scheduled: bool = False
    #: memo of the prefix-cache keys of the prompt's full blocks: (num_tokens, keys);
    #: a waiting request's tokens do not change, so they are hashed once, not per step
    prefix_keys: tuple[int, list] | None = field(default=None, repr=False)
    prefill_only: bool = False
    pull_tokens: int = 0
    recompute_elsewhere: bool = False
    #: speculative decoding: running acceptance rate (accepted / drafted, exponential
    #: average) and decode steps left without drafts after it fell too low
    spec_acceptance: float = 1.0
    spec_backoff: int = 0
    prompt_lp_pending: bool | None = None

    def __post_init__(self) -> None:
        if self.prompt_lp_pending is None:
            self.prompt_lp_pending = (self.params.prompt_logprobs is not None
                                      and self.num_output_tokens == 0)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Waiting-queue order: priority (1 first), then arrival."""
        return (self.priority, self.arrival_seq)
