"""Sampling parameters: the one internal model every API family maps onto.

Source: ``shared/spec/interfaces.md`` §1 (internal parameter model). Each HTTP family
validates its own body by its own rules (§8) and then builds a :class:`SamplingParams`;
the checks here are only the invariants every family shares, raising ``ValueError``
(turned into a 4xx at the HTTP edge).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

#: Largest seed MindIE accepts (spec §2.1: code caps at 2^63-1).
MAX_SEED = 2**63 - 1


class ConstraintKind(str, enum.Enum):
    """What a :class:`StructuredOutput` constrains the generated text to."""

    #: ``value`` is a JSON Schema (JSON text); the output is one JSON value valid under it.
    JSON_SCHEMA = "json_schema"
    #: any JSON object (OpenAI ``response_format: {"type": "json_object"}``); ``value`` "".
    JSON_OBJECT = "json_object"
    #: ``value`` is a regular expression the whole output must match.
    REGEX = "regex"
    #: ``value`` is a JSON array of strings; the output is exactly one of them.
    CHOICE = "choice"
    #: ``value`` is a grammar in llguidance's Lark dialect (may embed ``%json{...}``).
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's generated text (structured output, tool calls).

    Sources: OpenAI ``response_format``; vLLM ``guided_json|regex|choice|grammar``; TGI
    ``parameters.grammar``. The API families build one; the engine compiles it (off the
    event loop, cached) and masks the fp32 logits of the constrained rows with it.

    Attributes:
        kind: what ``value`` is (:class:`ConstraintKind`).
        value: the schema / regex / choice list / grammar text (see the kind).
    """

    kind: ConstraintKind
    value: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        max_new_tokens: upper bound on generated tokens (tokens, >= 0). 0 is a
            prefill-only request: nothing is generated, it ends with ``LENGTH`` once the
            prompt is computed (OpenAI completions ``echo`` with ``max_tokens: 0``).
        temperature: softmax temperature (> 0); ignored for greedy rows.
        top_k: keep the k most likely tokens; 0 disables.
        top_p: nucleus mass in (0, 1]; 1.0 disables.
        min_p: in [0, 1]; keep tokens whose probability (after temperature) is at least
            ``min_p`` times the most likely token's (vLLM/HF semantics); 0 disables.
        repetition_penalty: CTRL-style penalty (Keskar et al. 2019, as in HF/TGI) over
            prompt and generated tokens; 1.0 disables.
        do_sample: True samples, False is greedy (argmax after the penalty). [I] When a
            family leaves it unset, it sets it the TGI way: sample iff temperature,
            top_k or top_p was given.
        seed: per-request generator seed in [0, 2^63-1]; the same seed gives the same
            tokens whatever else shares the batch.
        ignore_eos: keep generating past EOS.
        stop_token_ids: extra token ids that end the request like EOS.
        skip_special_tokens: drop special tokens from the detokenized text.
        keep_special_token_ids: special tokens whose text is kept even with
            ``skip_special_tokens`` (every other special token, EOS included, is still
            dropped). The OpenAI chat handler sets it to the tool-call format's marker
            tokens while tools are active, so the tool-call reader sees the markers.
        stop: stop strings; the request ends (finish EOS) when the output text contains
            one, found across token boundaries and inside a token. Text from the match
            on is cut unless ``include_stop_str_in_output``; a possible partial match is
            held back from streaming until it is resolved.
        include_stop_str_in_output: keep the matched stop string in the text.
        presence_penalty: subtracted once from the logit of every token already generated
            (OpenAI API semantics), in [-2, 2].
        frequency_penalty: subtracted per occurrence from the logit of generated tokens
            (OpenAI API semantics), in [-2, 2].
        logprobs: None for none; k >= 0 returns each sampled token's log-probability and
            the k most likely alternatives (log-softmax of the logits after the
            penalties, before temperature/top-k/top-p, as vLLM reports them).
        speculative: False opts this request out of speculative decoding (drafts are
            verified losslessly, so this only trades its speed against the batch's).
        structured: a constraint on the generated text, or None (unconstrained).
        prompt_logprobs: None for none; k >= 0 returns the log-probability of every
            prompt token after the first, given the tokens before it, and the k most
            likely alternatives there (fp32 log-softmax of the raw logits; vLLM
            ``prompt_logprobs``, OpenAI completions ``echo`` + ``logprobs``, TGI
            ``decoder_input_details``). Such a request skips the prefix-cache lookup.
    """

    max_new_tokens: int = 20
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    do_sample: bool = False
    seed: int = field(default_factory=lambda: random.randint(0, MAX_SEED))
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    min_p: float = 0.0
    speculative: bool = True
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = None
    keep_special_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if any(i < 0 for i in self.keep_special_token_ids):
            raise ValueError("keep_special_token_ids must be token ids (>= 0)")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (after repetition penalty)."""
        return not self.do_sample
