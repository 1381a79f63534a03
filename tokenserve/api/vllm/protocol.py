"""vLLM family: the ``/generate`` body and its validation, and the answer's pieces
(spec/interfaces.md §4.1).

Response shapes (spec §4.1, §9.5)::

    non-stream  {"text": ["<prompt> <generated>", ...]}
    stream      text/event-stream, but NUL-delimited JSON, not SSE:
                {"text": ["<new text of seq 0>", ...]}\\0{"text": [...]}\\0 ...
                (per step, the new text of each sequence; "" for one with nothing new)
    [I] with ``prompt_logprobs: k``: the non-stream answer and the stream's chunk of the
    first token also carry ``"prompt_logprobs": [null, {"<id>": {logprob, rank,
    decoded_token}, ...}, ...]`` (vLLM's ``RequestOutput.prompt_logprobs``)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tokenserve.api.fields import (
    FLT_MAX,
    INT32_MAX,
    MAX_BEST_OF,
    MAX_N,
    STOP_TOTAL_MAX,
    choice_seed,
    get_bool,
    get_float,
    get_int,
    get_str,
    given,
    parse_stop,
    parse_stop_token_ids,
    parse_text_input,
    required,
)
from tokenserve.api.structured import parse_guided
from tokenserve.messages import RequestOutput, TokenLogprob
from tokenserve.sampling_params import MAX_SEED, SamplingParams

#: vLLM's default ``max_logprobs``: the largest ``prompt_logprobs`` it accepts.
MAX_PROMPT_LOGPROBS = 20
#: vLLM's floor for reported log-probabilities (keeps ``-inf`` out of JSON).
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class VllmBody:
    """A validated vLLM ``/generate`` body (spec §4.1) before tokenisation.

    ``count`` is how many sequences to generate and return (``best_of`` else ``n``).
    """

    text: str
    stream: bool
    params: SamplingParams
    count: int
    #: ``prompt_logprobs`` (k) as asked, or None
    prompt_logprobs: int | None = None


def parse_vllm_body(
    obj: dict[str, Any], *, default_max_tokens: int, model_name: str, max_n: int = MAX_N
) -> VllmBody:
    """Validate a vLLM ``/generate`` body (spec §4.1) and map it onto the internal model.

    Sampling [I]: ``temperature`` 0 is greedy, > 0 samples; unset, it samples iff
    ``top_k`` (other than -1) or ``top_p`` was given (the rule of the other families).
    ``best_of``/``n`` > 1 need a non-zero ``temperature`` (spec §4.1). ``model`` must name
    the served model (or be "None"): no LoRA adapters are served [I].

    ``stop`` (spec §4.1): one string up to 32768 UTF-16 units, list items up to 1024
    each, 32768 in total, no count limit.

    Raises:
        ValueError: any violation (422).
    """
    text = parse_text_input(required(obj, "prompt"), "prompt")
    stream = bool(get_bool(obj, "stream", False))
    max_tokens = get_int(obj, "max_tokens", 0, INT32_MAX, lo_open=True, default=default_max_tokens)
    temperature = get_float(obj, "temperature", 0.0, FLT_MAX)
    top_k = get_int(obj, "top_k")
    if top_k is not None and top_k != -1 and not 0 < top_k <= INT32_MAX:
        raise ValueError(f"Parameter top_k must be -1 or in (0,{INT32_MAX}], got {top_k}.")
    top_p = get_float(obj, "top_p", 0.0, 1.0, lo_open=True)
    seed = get_int(obj, "seed", 0, MAX_SEED)
    repetition_penalty = get_float(obj, "repetition_penalty", 0.0, FLT_MAX, lo_open=True)
    frequency_penalty = get_float(obj, "frequency_penalty", -2.0, 2.0, default=0.0)
    presence_penalty = get_float(obj, "presence_penalty", -2.0, 2.0, default=0.0)
    stop = parse_stop(obj.get("stop"), max_single=STOP_TOTAL_MAX)
    stop_token_ids = parse_stop_token_ids(obj.get("stop_token_ids"))
    include_stop = False
    if obj.get("stop") is not None or obj.get("stop_token_ids") is not None:  # spec §1.2
        include_stop = bool(get_bool(obj, "include_stop_str_in_output", False))
    ignore_eos = bool(get_bool(obj, "ignore_eos", False))
    skip_special_tokens = bool(get_bool(obj, "skip_special_tokens", True))
    best_of = get_int(obj, "best_of", 1, MAX_BEST_OF)
    n = get_int(obj, "n", 1, MAX_N, default=1)
    model = get_str(obj, "model")
    if model is not None:
        if not 0 < len(model) <= 256:
            raise ValueError("Parameter model must have 1 to 256 characters.")
        if model not in (model_name, "None"):
            raise ValueError(f"Model {model} not found.")

    assert n is not None and max_tokens is not None
    if best_of is not None and best_of < n:
        raise ValueError(f"best_of must be greater than or equal to n, got n={n}, best_of={best_of}.")
    count = best_of if best_of is not None else n
    if count > max_n:
        raise ValueError(f"Parameter n must not exceed the maximum batch size {max_n}, got {count}.")
    if count > 1 and not temperature:
        raise ValueError("best_of and n must be 1 when temperature is 0 or not set (greedy).")

    if temperature is not None:
        do_sample = temperature > 0
    else:
        do_sample = (top_k is not None and top_k != -1) or top_p is not None
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_tokens, "do_sample": do_sample, "stop": stop,
        "stop_token_ids": stop_token_ids, "include_stop_str_in_output": include_stop,
        "ignore_eos": ignore_eos, "skip_special_tokens": skip_special_tokens,
        "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
        # ours [I]: false opts the request out of speculative decoding
        "speculative": bool(get_bool(obj, "speculative", True)),
        "prompt_logprobs": parse_prompt_logprobs(obj),
        # structured output (spec §5.5): vLLM's guided_json|regex|choice|grammar
        "structured": parse_guided(obj),
    }
    if temperature:
        kwargs["temperature"] = temperature
    if top_k is not None and top_k != -1:
        kwargs["top_k"] = top_k
    kwargs.update(given(top_p=top_p, repetition_penalty=repetition_penalty, seed=seed))
    return VllmBody(text, stream, SamplingParams(**kwargs), count, kwargs["prompt_logprobs"])


def parse_prompt_logprobs(obj: dict[str, Any]) -> int | None:
    """vLLM's ``prompt_logprobs`` (SamplingParams): an integer in [0, 20] (vLLM refuses
    more than its ``max_logprobs``, 20 by default), or absent / null."""
    return get_int(obj, "prompt_logprobs", 0, MAX_PROMPT_LOGPROBS)


def vllm_prompt_logprobs(
    entries: tuple[TokenLogprob | None, ...], text_of: Any, k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` (its ``RequestOutput.prompt_logprobs`` as the OpenAI
    server renders it): per prompt token, None for the first, else ``{token_id: {logprob,
    rank, decoded_token}}`` holding the prompt token first, then the ``k`` most likely
    (rank 1 = most likely, over the whole vocabulary). JSON turns the ids into strings.
    ``text_of(token_id)`` is the token's text."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        item = {str(e.token_id): {"logprob": max(e.logprob, LOGPROB_FLOOR), "rank": e.rank,
                                  "decoded_token": text_of(e.token_id)}}
        for r, (tid, lp) in enumerate(e.top[:k], 1):
            item.setdefault(str(tid), {"logprob": max(lp, LOGPROB_FLOOR), "rank": r,
                                       "decoded_token": text_of(tid)})
        out.append(item)
    return out


def cum_logprob(outs: list[RequestOutput]) -> float | None:
    total = 0.0
    for out in outs:
        if out.new_token_ids and out.logprobs is None:
            return None
        total += sum(lp.logprob for lp in out.logprobs or ())
    return total


def sequence_params(vb: VllmBody) -> list[SamplingParams]:
    """The parameters of each of the ``count`` sequences: distinct seeds, and logprobs to
    rank them by (spec §4.1)."""
    if vb.count <= 1:
        return [vb.params]
    # the prompt is the same for all: its logprobs come from the first sequence alone
    return [dataclasses.replace(vb.params, seed=choice_seed(vb.params.seed, i),
                                logprobs=vb.params.logprobs or 0,
                                prompt_logprobs=vb.params.prompt_logprobs if i == 0 else None)
            for i in range(vb.count)]


def vllm_answer(vb: VllmBody, outs: list[list[RequestOutput]],
                text_of: Any = None) -> dict[str, Any]:
    """The non-stream answer (spec §4.1): each sequence's text after the prompt and a
    space, best first by cumulative log-probability (submission order when the engine
    reports no logprobs). [I] With ``prompt_logprobs``, also ``"prompt_logprobs"``: the
    prompt's list (:func:`vllm_prompt_logprobs`; ``text_of`` gives token texts)."""
    order = list(range(vb.count))
    scores = [cum_logprob(o) for o in outs]
    if vb.count > 1 and all(s is not None for s in scores):
        order.sort(key=lambda i: -scores[i])  # type: ignore[operator]
    answer: dict[str, Any] = {
        "text": [vb.text + " " + "".join(o.new_text for o in outs[i]) for i in order]}
    if vb.prompt_logprobs is not None:
        entries = next((o.prompt_logprobs for o in outs[0] if o.prompt_logprobs is not None),
                       None)
        if entries is None:
            raise ValueError("the prompt's log-probabilities were not computed")
        answer["prompt_logprobs"] = vllm_prompt_logprobs(entries, text_of, vb.prompt_logprobs)
    return answer
