"""Every message that crosses an actor boundary, in one module.

Actors (see ARCHITECTURE.md, "Actors and queues")::

    HTTP handler --GenerateRequest/AbortRequest--> SchedulerActor inbox
    AsyncEngine --AbortRequest(done)/WaitIdle--> SchedulerActor inbox --done.set_result
    SchedulerActor --StepPlan--> ExecutorActor (worker thread) --StepResult--> SchedulerActor
    SchedulerActor --RequestOutput--> per-request RequestHandle --> HTTP handler

Every request ends with exactly one final RequestOutput (``finished``), aborted ones too.

Messages are plain frozen dataclasses: no behaviour, no references to actor state (a
reply future, ``done``, is the sender's channel, not the actor's state).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenserve.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request ended (engine-side; each API family maps it to its own string).

    MindIE native/TGI/Triton strings (spec §1.4): EOS -> ``eos_token``; LENGTH ->
    ``length``; ABORT, TIMEOUT, ERROR -> ``stop_sequence``.
    """

    EOS = "eos"  # EOS token or a stop token id
    LENGTH = "length"  # max_new_tokens, maxIterTimes or the context length reached
    ABORT = "abort"  # client disconnected or stopInfer
    TIMEOUT = "timeout"  # client timeout, tokenTimeout or e2eTimeout fired
    ERROR = "error"  # the executor failed
    #: PD decode instance: the request was evicted (KV blocks ran out) and must be
    #: recomputed by a prefill instance (spec/pd_disaggregation.md §7.1: ``retry:``)
    RECOMPUTE = "recompute"


# --------------------------------------------------------------------------- HTTP -> engine


class EngineOverloadedError(RuntimeError):
    """Raised by ``AsyncEngine.generate`` when its waiting queue is full
    (``EngineConfig.max_queue_size``); the HTTP layer answers 503 at once."""


@dataclass(frozen=True)
class KvAdoption:
    """A request whose first output tokens were generated elsewhere (PD: on a prefill
    instance, or before a recompute; spec/pd_disaggregation.md §5.2, §7.4).

    The engine starts it with ``prompt + output_token_ids`` and first puts one ``replay``
    output carrying ``output_token_ids`` and their text (already delivered to the client:
    the consumer renders it to restore its own state and sends nothing), then continues.

    Attributes:
        output_token_ids: tokens generated so far, in order (len >= 1 on a decode
            instance; may be empty only with ``num_computed == 0``).
        generator_state: ``torch.Generator.get_state()`` bytes after the last draw, so a
            seeded sampled request continues identically; None: a fresh generator from the
            seed, advanced one draw per output token (recompute).
        num_computed: tokens whose K/V are pulled from ``source`` instead of computed here
            (positions ``[0, num_computed)``); 0: compute everything (recompute on P).
        source: opaque to the engine: where the K/V are, handed to the engine's KV puller.
        num_cached_tokens: prompt tokens the first instance found in its prefix cache
            (reported in usage as if computed here).
        prompt_logprobs: the prompt's log-probabilities the first instance computed
            (``RequestOutput.prompt_logprobs``), put on the replay output; None: none
            (a recompute, ``num_computed == 0``, computes them again when asked).
        output_logprobs: the :class:`TokenLogprob` of each of ``output_token_ids`` the
            first instance computed (``SamplingParams.logprobs``), put on the replay
            output; None: none.
    """

    output_token_ids: tuple[int, ...]
    generator_state: bytes | None = None
    num_computed: int = 0
    source: Any = None
    num_cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    output_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class KvHandoff:
    """What a prefill-only request leaves for a decode instance (spec §5.2 ``blockTable``).

    Attributes:
        block_table: this instance's KV blocks covering positions ``[0, num_computed)``;
            held until ``AsyncEngine.release`` or the park timeout.
        num_computed: tokens whose K/V are in those blocks (the prompt, plus any
            recomputed outputs; the newest sampled token has no K/V yet).
        generator_state: ``torch.Generator.get_state()`` bytes after the first token's
            draw (None for a greedy request).
    """

    block_table: tuple[int, ...]
    num_computed: int
    generator_state: bytes | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """A validated, tokenized request entering the engine.

    Attributes:
        request_id: unique id (the server's, or the client's where the API carries one).
        prompt_token_ids: prompt, len >= 1, each id < vocab size.
        params: sampling and stopping parameters.
        priority: 1 (most urgent) .. 5 (default), spec §1.2.
        timeout_s: the client's ``timeout`` (seconds), or None; the engine also applies
            the server's ``tokenTimeout`` / ``e2eTimeout`` (spec config.md §1).
        arrival_time: ``time.monotonic()`` when the HTTP request arrived (seconds).
        prefill_only: PD prefill instance: after the first token the request is parked
            with its KV blocks held (its output carries a :class:`KvHandoff`) until
            ``AsyncEngine.release`` or the park timeout (``kv_trans_timeout``).
        adopt: the request's first tokens were generated elsewhere (:class:`KvAdoption`).
        grammar: ``params.structured`` compiled for this engine's tokenizer
            (``tokenserve.grammar.compiler.CompiledGrammar``, from
            ``AsyncEngine.compile_grammar``); set iff ``params.structured`` is.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 5
    timeout_s: float | None = None
    arrival_time: float = 0.0
    prefill_only: bool = False
    adopt: KvAdoption | None = None
    grammar: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request (client gone, stopInfer, drain time over); its KV blocks are freed
    at once and it ends with a final output: ``reason`` (ABORT), or ERROR carrying
    ``error`` when one is given."""

    request_id: str
    reason: FinishReason = FinishReason.ABORT
    error: str | None = None
    #: ``asyncio.Future[None]`` the actor resolves once the request has left the engine,
    #: its KV blocks freed (those of a D request still pulling: when the pull returns),
    #: or at once when it was not there (``AsyncEngine.evict``); None: nobody waits
    done: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class WaitIdle:
    """Reply on ``done`` (``asyncio.Future[None]``) when no request is queued, running,
    parked or pulling and the inbox is empty: the moment the scheduler actor blocks for
    its next message (``AsyncEngine.wait_idle``)."""

    done: Any = field(compare=False, repr=False)


#: how the error of a request whose KV pull failed begins (D recomputes it elsewhere).
KV_PULL_FAILED = "Pull kv failed irreversibly."


@dataclass(frozen=True)
class KvPulled:
    """The engine's KV puller finished pulling an adopted request's blocks (``error``:
    why it failed, e.g. ``Pull kv failed irreversibly.``; spec §6.1)."""

    request_id: str
    error: str | None = None
    #: the pull timed out: the source may still write into the destination blocks, so
    #: they are never reused (kept in ``Parking.quarantined``)
    quarantine: bool = False


# --------------------------------------------------------------------------- engine -> HTTP


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one sampled token and its top alternatives.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability (natural log).
        top: the ``SamplingParams.logprobs`` most likely (token_id, logprob) pairs,
            most likely first.
        rank: 1 + the number of tokens more likely than ``token_id`` (vLLM's ``rank``);
            set for prompt tokens (:class:`PromptLogprobs`), 0 where not computed.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Log-probabilities of a run of prompt tokens, computed in one step (one prefill
    chunk's positions).

    Attributes:
        start: prompt position (0-based) of ``entries[0]``; >= 1 (the first prompt token
            has no log-probability).
        entries: for each prompt position ``start + i``: that prompt token's
            log-probability given the tokens before it, and the ``prompt_logprobs`` most
            likely (token_id, logprob) pairs at that position (fp32 log-softmax of the
            raw logits), as :class:`TokenLogprob` (``token_id`` = the prompt token).
    """

    start: int
    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class RequestOutput:
    """What one request gained since the last output (one engine step, or several merged
    when the consumer was slower than the engine).

    Attributes:
        request_id: the request.
        new_token_ids: ids generated since the previous output (may be empty on the final
            output of an aborted/timed-out request).
        new_text: detokenized text of those ids (UTF-8 safe: an incomplete multi-byte
            character is held back until complete).
        finished: True on the last output of the request; nothing follows it.
        finish_reason: set when ``finished``.
        num_prompt_tokens: prompt length (tokens).
        num_output_tokens: tokens generated so far, including ``new_token_ids``.
        prefill_time_ms: on the first output: arrival -> first token (ms); else None.
        decode_time_ms: on later outputs: time since the previous output (ms); else None.
        error: on TIMEOUT/ERROR, MindIE's message, e.g.
            ``"Engine callback timeout: client timeout"`` (spec §0.4 step 9).
        seed: the seed the request sampled with.
        logprobs: one :class:`TokenLogprob` per id in ``new_token_ids`` when the request
            asked for logprobs, else None.
        stop_reason: on a finished output: the stop string or stop token id that ended
            it (vLLM's ``stop_reason``); None for EOS, length and the rest.
        queue_time_ms: on the first output: arrival -> first scheduled (ms).
        num_cached_tokens: prompt tokens served from the prefix cache (OpenAI
            ``usage.prompt_tokens_details.cached_tokens``).
        replay: this output re-delivers tokens generated elsewhere (a
            :class:`KvAdoption`'s); never merged with other outputs.
        handoff: on a prefill-only request's first output: its parked KV blocks.
        prompt_logprobs: when the request asked (``SamplingParams.prompt_logprobs``), on
            its first output with tokens (or its final output when it generates none):
            one entry per prompt token, the first None (vLLM's ``prompt_logprobs``
            shape), else None.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    prefill_time_ms: float | None = None
    decode_time_ms: float | None = None
    error: str | None = None
    seed: int | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    stop_reason: str | int | None = None
    queue_time_ms: float | None = None
    num_cached_tokens: int = 0
    replay: bool = False
    handoff: KvHandoff | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


# --------------------------------------------------------------------------- scheduler <-> executor


@dataclass(frozen=True, slots=True)
class SeqStart:
    """What the model thread builds a request's sampling state from, the first time a
    step holds the request (the scheduler sends it once; the model thread keeps the state,
    keyed by request id, until a :attr:`StepPlan.drop` names the request).

    The state is a ``torch.Generator`` (sampled requests only: seeded with
    ``params.seed``, or restored from ``generator_state``, else advanced ``draws``
    uniforms) and the token history the penalties read (``token_ids``, then every token
    the model thread samples for the request).

    Attributes:
        token_ids: prompt followed by any tokens generated elsewhere (PD adoption).
        num_prompt_tokens: length of the prompt prefix of ``token_ids``.
        generator_state: ``KvAdoption.generator_state`` (bytes of
            ``torch.Generator.get_state()``), or None.
        draws: without ``generator_state``: uniforms already drawn for this request
            elsewhere (one per generated token in ``token_ids``), skipped on restore.
        grammar: the request's compiled constraint (``GenerateRequest.grammar``) or None;
            the model thread starts its matcher from it and the generated part of
            ``token_ids``.
    """

    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    generator_state: bytes | None = None
    draws: int = 0
    grammar: Any = None


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request's share of a step.

    ``token_ids`` are the tokens to compute this step, at positions
    ``[num_computed, num_computed + len(token_ids))``. ``block_table`` lists the KV
    blocks covering positions ``[0, num_computed + len(token_ids))``::

        positions  0 ........ num_computed ........ num_computed+len(token_ids)
                   |  cached  |   computed this step   |
        blocks     [b0][b1][b2][b3]   (block_size tokens each; last may be partial)

    ``sample`` is True when this step reaches the end of the known tokens (the last
    prefill chunk, or a decode step), so a next token is sampled.

    ``start`` is set the first time the request is scheduled (see :class:`SeqStart`);
    the model thread ignores it for a request whose state it holds. A request preempted
    by recompute keeps its state (its generator is not rewound, its history keeps its
    tokens), so it is not sent again. ``export_state``: return the generator's state
    after this step's draw in :attr:`StepResult.generator_states` (PD prefill: the
    decode instance continues from it).

    ``prompt_logprobs``: compute the log-probabilities of the prompt tokens that follow
    this step's positions (those before ``SeqStart.num_prompt_tokens``), returned in
    :attr:`StepResult.prompt_logprobs`; set only while the request has generated nothing.

    ``draft`` (speculative decoding, ``tokenserve/engine/ngram.py``): draft tokens appended
    to a decode's one token, so ``token_ids`` is ``(last token, *draft)``; the block table
    covers them too. The model thread verifies them in this one forward pass: it samples
    every position and returns, beyond the first token, the accepted ones
    (:attr:`StepResult.accepted`).
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_computed: int
    block_table: tuple[int, ...]
    sample: bool
    params: SamplingParams
    start: SeqStart | None = None
    export_state: bool = False
    draft: tuple[int, ...] = ()
    prompt_logprobs: bool = False

    @property
    def is_decode(self) -> bool:
        """A decode computes one token (plus any draft) on top of a non-empty cache."""
        return len(self.token_ids) - len(self.draft) == 1 and self.num_computed > 0


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Everything the executor needs for one forward pass (a continuous-batching step).

    ``drop``: requests that ended (finished, aborted, evicted) since the last plan; the
    model thread discards their sampling state before running ``seqs``. A plan with no
    seqs only drops (the scheduler actor sends one before it goes idle).
    """

    step_id: int
    seqs: tuple[ScheduledSeq, ...]
    drop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StepResult:
    """The executor's answer to a :class:`StepPlan`.

    ``sampled`` maps request_id -> the sampled token id, for the seqs with ``sample``;
    ``logprobs`` maps request_id -> its :class:`TokenLogprob` for seqs whose params ask
    for logprobs.
    ``error`` carries the exception text when the step failed (every seq of the plan
    then fails with FinishReason.ERROR). ``failed`` maps request_id -> message for rows
    that could not be computed alone (the rest of the step stands): those requests
    fail with FinishReason.ERROR, the others continue. ``generator_states`` maps
    request_id -> ``torch.Generator.get_state()`` bytes after this step's draw, for
    sampled seqs with ``export_state`` (greedy requests have none). ``accepted`` maps
    request_id -> the tokens after the sampled one that a seq with a ``draft`` gained
    (t1..ta where the draft's first a tokens equal t0..t(a-1), the model's own choices:
    each ti is what plain decoding would have produced next; empty when none matched).
    ``prompt_logprobs`` maps request_id -> the prompt log-probabilities of the seqs with
    ``prompt_logprobs`` (:class:`PromptLogprobs`; absent when the step had none for it).
    """

    step_id: int
    sampled: Mapping[str, int]
    forward_ms: float
    error: str | None = None
    logprobs: Mapping[str, TokenLogprob] = field(default_factory=dict)
    failed: Mapping[str, str] = field(default_factory=dict)
    generator_states: Mapping[str, bytes] = field(default_factory=dict)
    accepted: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    prompt_logprobs: Mapping[str, PromptLogprobs] = field(default_factory=dict)
    #: structured output: wall ms this step spent on token masks (fill + apply), 0 when
    #: no row was constrained
    mask_ms: float = 0.0


# ---------------------------------------------------------------- tensor parallelism
# Rank 0's model thread -> every other rank's step loop (tokenserve/engine/tensor_parallel.py),
# over the step channel (one TCP connection per rank, pickled frames). Each one announces a
# collective call the ranks then make together; arrays are numpy (no torch at import).
# PD's TpKvStart / TpPull (sent by rank 0's PD layer, engine/tp_kv.py) are answered on the
# TCP store as JSON, never on the channel.


@dataclass(frozen=True, slots=True)
class TpStart:
    """Allocate the KV cache: ``num_blocks`` blocks of ``block_size`` tokens of
    ``kv_dtype`` (a torch dtype name, ``"int8"`` / ``"bfloat16"`` ...), the same block ids
    on every rank (rank 0's allocator owns them)."""

    num_blocks: int
    block_size: int
    kv_dtype: str


@dataclass(frozen=True, slots=True)
class TpForward:
    """Run the decoder over one step's tokens (``CausalLM.forward``): the input ids
    (int64 [T]) and the step's attention metadata (``AttentionMetadata``'s fields, as
    numpy arrays of their dtypes)."""

    input_ids: Any
    block_tables: Any
    query_start_loc: Any
    context_lens: Any
    positions: Any
    slot_mapping: Any


@dataclass(frozen=True, slots=True)
class TpLogits:
    """The logits of ``rows`` of the last forward's hidden states (``CausalLM.logits_at``:
    each rank its vocabulary rows, gathered)."""

    rows: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TpStop:
    """The server stops: leave the step loop, exit 0."""


@dataclass(frozen=True, slots=True)
class TpKvStart:
    """PD (issue 41): open this rank's KV transfer engine on its own KV shard.

    ``open_transfer(kv)`` (a picklable callable the PD layer gives, e.g. a partial of
    ``tokenserve.pd.kv_transfer.KvTransfer``) takes the rank's whole KV tensor and returns
    its endpoint (``descriptor()``, ``pull(source, src_blocks, dst_blocks)``, ``close()``);
    the rank answers on the TCP store (``tokenserve/engine/tp_kv.py``: JSON, never a
    pickle)."""

    open_transfer: Any


@dataclass(frozen=True, slots=True)
class TpPull:
    """PD decode (issue 41): every rank ``r > 0`` pulls ``src_blocks`` of P's rank-``r``
    region (``sources[r]``, the endpoint's descriptor type; ``sources[0]`` is rank 0's
    own) into its own ``dst_blocks``, on a thread, and answers under ``pull_id`` on the
    TCP store (``tokenserve/engine/tp_kv.py``)."""

    pull_id: int
    sources: tuple[Any, ...]
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
