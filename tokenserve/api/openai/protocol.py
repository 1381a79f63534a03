"""OpenAI family: the request bodies and their validation, and the answer's pieces (the
error body, ``finish_reason``, ``usage``, ``logprobs``) (spec/interfaces.md §5, §8, §1.4):
what a client sends and sees, as vLLM's ``protocol.py`` keeps them.

Bodies are checked by the vLLM-flavoured rules of spec §5.1/§5.2 (the MindIE default,
``openAiSupport="vllm"``); ``native=True`` applies the "native OpenAI" ranges of §5.1 to
chat. Never the MindIE native ``/infer`` rules: ``temperature`` 0 is allowed and means
greedy, ``top_p`` 1.0 is allowed, ``top_k`` -1 means off. Unknown keys (``user``,
``logit_bias``, ``suffix``...) are ignored (spec §8). Every violation raises ``ValueError``;
the handler answers 422 (spec §0.4 steps 5-6) with
:func:`openai_error` (the OpenAI error shape, keeping MindIE's ``error_type``). Output
shapes follow spec §5.1/§5.2 and the OpenAI API reference (Chat Completions /
Completions objects, their chunk objects and ``logprobs``).
"""

# ValueError, not TypeError, is the contract of every parser here (the family answers 422).
# ruff: noqa: TRY004

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tokenserve.api.errors import openai_error  # noqa: F401 - the family's error body
from tokenserve.api.fields import (
    FLT_MAX,
    INT32_MAX,
    MAX_BEST_OF,
    MAX_N,
    MEDIA_TYPES,
    STOP_COUNT_MAX,
    STOP_ITEM_MAX,
    STOP_TOTAL_MAX,
    check_token_ids,
    get_bool,
    get_float,
    get_int,
    get_object,
    get_str,
    parse_stop_token_ids,
    utf16_len,
)
from tokenserve.api.openai.tools import ToolChoice, parse_tool_choice, tool_constraint
from tokenserve.api.structured import parse_openai_structured
from tokenserve.api.vllm.protocol import parse_prompt_logprobs
from tokenserve.messages import FinishReason, TokenLogprob
from tokenserve.sampling_params import MAX_SEED

#: spec §5.1: ``top_logprobs`` in [0, 20] (``n``, ``best_of``: ``MAX_N``, ``MAX_BEST_OF``).
MAX_TOP_LOGPROBS = 20
#: spec §5.2: completions ``logprobs`` is an integer in [0, 5].
MAX_COMPLETION_LOGPROBS = 5
#: [I] temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``).
GREEDY_EPS = 1e-5
#: spec §5.1: roles checked strictly when ``tools`` is given.
ROLES = ("system", "user", "assistant", "tool")
_MEDIA_PARTS = (*MEDIA_TYPES, "input_audio")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_\u4e00-\u9fa5-]{1,64}")
#: template variables a request may not override through ``chat_template_kwargs``.
_RESERVED_TEMPLATE_VARS = ("messages", "add_generation_prompt", "tools")


@dataclass(frozen=True)
class Prompt:
    """One completions prompt: text to tokenise, or token ids (exactly one is set)."""

    text: str | None = None
    ids: list[int] | None = None


@dataclass(frozen=True)
class OpenAIBody:
    """A validated chat or completions body (spec §5.1/§5.2).

    ``sampling`` holds :class:`SamplingParams` keyword arguments except
    ``max_new_tokens`` and ``seed``, which depend on the prompt and the choice.
    ``n`` is the number of choices per prompt (``max(n, best_of)``, spec §5.2).
    """

    model: str
    stream: bool
    include_usage: bool
    n: int
    max_tokens: int | None
    seed: int | None
    sampling: dict[str, Any]
    echo: bool = False
    messages: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    prompts: list[Prompt] | None = None
    #: vLLM's ``prompt_logprobs`` (k) as the client gave it, or None
    prompt_logprobs: int | None = None
    tool_choice: ToolChoice | None = None


def parse_openai_stop(obj: dict[str, Any], native: bool = False) -> tuple[str, ...]:
    """``stop``: a string or a list of strings (spec §4.1 vLLM rules; §5.1 native: a
    string <= 1024 or at most 1024 items). An empty list means none; duplicates are
    dropped. Its messages and de-duplication are this family's own, hence not
    :func:`tokenserve.api.fields.parse_stop`."""
    value = obj.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        limit = STOP_ITEM_MAX if native else STOP_TOTAL_MAX
        if not 0 < utf16_len(value) <= limit:
            raise ValueError(f"Parameter stop must be a string of 1 to {limit} characters.")
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError("Parameter stop must be a string or a list of strings.")
    if native and len(value) > STOP_COUNT_MAX:
        raise ValueError(f"Parameter stop must hold at most {STOP_COUNT_MAX} strings.")
    sizes = [utf16_len(s) for s in value]
    if any(not 0 < n <= STOP_ITEM_MAX for n in sizes) or sum(sizes) > STOP_TOTAL_MAX:
        raise ValueError(
            f"Each stop string must have 1 to {STOP_ITEM_MAX} characters and all together "
            f"at most {STOP_TOTAL_MAX}."
        )
    return tuple(dict.fromkeys(value))


def _parse_sampling(obj: dict[str, Any], native: bool) -> tuple[dict[str, Any], bool]:
    """The sampling and stopping fields shared by chat and completions (spec §5.1, §8).

    Returns:
        (SamplingParams kwargs, greedy). [I] An absent ``temperature`` samples at 1.0 (the
        OpenAI default); 0 (below ``GREEDY_EPS``) is greedy.
    """
    temperature = get_float(obj, "temperature", 0.0, 2.0 if native else FLT_MAX)
    top_k = get_int(obj, "top_k", -1 if not native else 0, INT32_MAX)
    if top_k == 0 and not native:
        raise ValueError("Parameter top_k must be -1 or in (0,2147483647], got 0.")
    top_p = get_float(obj, "top_p", 0.0, 1.0, lo_open=True)
    rep = get_float(obj, "repetition_penalty", 0.0, 2.0, lo_open=True)
    greedy = temperature is not None and temperature < GREEDY_EPS
    kwargs: dict[str, Any] = {
        "do_sample": not greedy,
        "temperature": 1.0 if greedy or temperature is None else temperature,
        "top_k": 0 if top_k in (None, -1) else top_k,
        "top_p": 1.0 if top_p is None else top_p,
        "repetition_penalty": 1.0 if rep is None else rep,
        "presence_penalty": get_float(obj, "presence_penalty", -2.0, 2.0, default=0.0),
        "frequency_penalty": get_float(obj, "frequency_penalty", -2.0, 2.0, default=0.0),
        "stop": parse_openai_stop(obj, native),
        "stop_token_ids": parse_stop_token_ids(obj.get("stop_token_ids")),
        "include_stop_str_in_output": get_bool(obj, "include_stop_str_in_output", False),
        "ignore_eos": get_bool(obj, "ignore_eos", False),
        "skip_special_tokens": get_bool(obj, "skip_special_tokens", True),
        # ours [I]: false opts the request out of speculative decoding
        "speculative": get_bool(obj, "speculative", True),
    }
    return kwargs, greedy


def _parse_common(
    obj: dict[str, Any], native: bool, completions: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fields common to both routes; returns (OpenAIBody kwargs, sampling kwargs)."""
    model = get_str(obj, "model")
    if not model:
        raise ValueError("Parameter model must be a non-empty string.")
    stream = bool(get_bool(obj, "stream", False))
    include_usage = bool(get_bool(get_object(obj, "stream_options"), "include_usage", False,
                                  name="stream_options.include_usage"))
    # spec §5.1 [I]: max_completion_tokens is an alias of max_tokens; [I] completions
    # accept 0 (prompt only: ``echo`` with ``logprobs``, as lm-evaluation-harness asks)
    max_tokens = get_int(obj, "max_tokens", 0, INT32_MAX, lo_open=not completions)
    alias = get_int(obj, "max_completion_tokens", 0, INT32_MAX, lo_open=not completions)
    if max_tokens is not None and alias is not None and alias != max_tokens:
        raise ValueError("Parameters max_tokens and max_completion_tokens differ.")
    sampling, greedy = _parse_sampling(obj, native)

    n = get_int(obj, "n", 1, MAX_N)
    best_of = get_int(obj, "best_of", 1, MAX_BEST_OF)
    if get_bool(obj, "use_beam_search", False):
        raise ValueError("Parameter use_beam_search is not supported.")
    if stream and best_of is not None:
        if completions and n is None:
            raise ValueError("Parameter n must be given together with best_of when streaming.")
        if best_of != (n or 1):
            raise ValueError("Parameter best_of must equal n when streaming.")
    if best_of is not None and n is not None and best_of < n:
        raise ValueError(f"Parameter best_of must be >= n, got best_of={best_of}, n={n}.")
    count = max(n or 1, best_of or 1)
    if count > 1 and greedy:
        raise ValueError("Parameters n and best_of must be 1 when temperature is 0.")

    # structured output (spec §5.5): response_format, or vLLM's guided_* on these routes
    sampling["structured"] = parse_openai_structured(obj)

    body = {"model": model, "stream": stream, "include_usage": include_usage, "n": count,
            "max_tokens": max_tokens if max_tokens is not None else alias,
            "seed": get_int(obj, "seed", 0, MAX_SEED)}
    return body, sampling


# --------------------------------------------------------------------------- chat


def _message_text(content: Any, where: str) -> str | None:
    """``content``: a string, or a list of parts whose text parts are concatenated
    (spec §5.1); media parts are refused [I] (the models we serve are text-only)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of parts.")
    texts: list[str] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in _MEDIA_PARTS:
            raise ValueError("Multimodal content is not supported by this model.")
        else:
            raise ValueError(f"{where}.content parts must be {{type: text, text: <string>}}.")
    return "".join(texts)


def _parse_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ValueError(f"{where}.tool_calls must be a list.")
    for call in value:
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call.get("id"), str) and call.get("type") == "function"
                and isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments"), str)):
            raise ValueError(
                f"{where}.tool_calls items must be {{id, type: function, "
                "function: {name, arguments}}} with string values."
            )
    return value


def parse_messages(value: Any, strict_roles: bool) -> list[dict[str, Any]]:
    """``messages`` (spec §5.1) -> template-ready dicts ``{role, content[, name,
    tool_calls, tool_call_id]}``."""
    if not isinstance(value, list) or not value:
        raise ValueError("Parameter messages must be a non-empty array.")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where} must be an object.")
        role = msg.get("role")
        if not isinstance(role, str) or not role or (strict_roles and role not in ROLES):
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}.")
        text = _message_text(msg.get("content"), where)
        item: dict[str, Any] = {"role": role, "content": text}
        if msg.get("tool_calls") is not None:
            item["tool_calls"] = _parse_tool_calls(msg["tool_calls"], where)
        if role == "assistant":
            if text is None and "tool_calls" not in item:
                raise ValueError(f"{where}.content is required without tool_calls.")
            item["content"] = text or ""
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"{where}.tool_call_id must be a non-empty string.")
            item["tool_call_id"] = call_id
            item["content"] = text or ""
        elif not text:
            raise ValueError(f"{where}.content must be a non-empty string.")
        if isinstance(msg.get("name"), str):
            item["name"] = msg["name"]
        out.append(item)
    return out


def parse_tools(obj: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The shapes of ``tools`` and ``tool_choice`` (spec §5.1; a named ``tool_choice``
    may leave out ``"type"``, as TGI's does); the rest of their checks, the prompt and
    the constraint are :mod:`tokenserve.api.openai.tools`."""
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError("Parameter tools must be a list.")
        for tool in tools:
            fn = tool.get("function") if isinstance(tool, dict) else None
            if (not isinstance(fn, dict) or tool.get("type") != "function"
                    or not isinstance(fn.get("name"), str)
                    or not _TOOL_NAME.fullmatch(fn["name"])):
                raise ValueError("Each tool must be {type: function, function: {name, ...}} "
                                 "with a name of 1-64 letters, digits, _ or -.")
    choice = obj.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required"):
        fn = choice.get("function") if isinstance(choice, dict) else None
        # [I] "type" may be left out, as TGI takes it (huggingface_hub's
        # ChatCompletionInputToolChoiceClass sends only {"function": {"name"}})
        if not isinstance(fn, dict) or choice.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str):
            raise ValueError("Parameter tool_choice must be none, auto, required or "
                             "{type: function, function: {name}}.")
    return tools or None


def parse_chat_body(obj: dict[str, Any], native: bool = False) -> OpenAIBody:
    """Validate a ``POST /v1/chat/completions`` body (spec §5.1)."""
    body, sampling = _parse_common(obj, native, completions=False)
    tools = parse_tools(obj)
    messages = parse_messages(obj.get("messages"), strict_roles=tools is not None)
    logprobs = get_bool(obj, "logprobs")
    top = get_int(obj, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if logprobs is False and top is not None:
        raise ValueError("Parameter top_logprobs requires logprobs to be true.")
    if logprobs or top is not None:
        sampling["logprobs"] = top or 0
    kwargs = dict(get_object(obj, "chat_template_kwargs"))
    get_bool(kwargs, "enable_thinking", name="chat_template_kwargs.enable_thinking")
    get_int(kwargs, "thinking_budget", 1, INT32_MAX, name="chat_template_kwargs.thinking_budget")
    for key in _RESERVED_TEMPLATE_VARS:
        kwargs.pop(key, None)
    choice = parse_tool_choice(obj) if tools is not None or "tool_choice" in obj else None
    constraint = tool_constraint(choice) if choice is not None else None
    if constraint is not None:
        if sampling.get("structured") is not None:  # [I] one constraint per answer
            raise ValueError("Parameters tools and response_format cannot be used together.")
        sampling["structured"] = constraint
    if obj.get("chat_template") is not None:  # [I] a path or template text from a client
        raise ValueError("Parameter chat_template is not supported; the model's own is used.")
    plp = parse_prompt_logprobs(obj)  # vLLM's extension: a top-level list in the answer
    if plp is not None:
        if body["stream"]:  # as vLLM: no place for them in a chat chunk
            raise ValueError("Parameter prompt_logprobs is not available when stream is true.")
        sampling["prompt_logprobs"] = plp
    return OpenAIBody(**body, sampling=sampling, messages=messages, template_kwargs=kwargs,
                      prompt_logprobs=plp, tool_choice=choice)


# --------------------------------------------------------------------------- completions


def parse_prompts(value: Any, vocab_size: int) -> list[Prompt]:
    """``prompt``: a string, a list of strings, token ids, or a list of id lists."""
    if isinstance(value, str):
        return [Prompt(text=value)]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return [Prompt(text=p) for p in value]
        if all(isinstance(p, list) for p in value):
            return [Prompt(ids=check_token_ids(p, vocab_size, "prompt")) for p in value]
        return [Prompt(ids=check_token_ids(value, vocab_size, "prompt"))]
    raise ValueError("Parameter prompt must be a string, a list of strings, a list of token "
                     "ids or a list of token-id lists.")


def parse_completion_body(obj: dict[str, Any], vocab_size: int) -> OpenAIBody:
    """Validate a ``POST /v1/completions`` body (spec §5.2; always vLLM-flavoured)."""
    body, sampling = _parse_common(obj, native=False, completions=True)
    prompts = parse_prompts(obj.get("prompt"), vocab_size)
    logprobs = get_int(obj, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    echo = bool(get_bool(obj, "echo", False))
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    # OpenAI: echo + logprobs gives the prompt's tokens their logprobs too; vLLM's
    # extension ``prompt_logprobs`` (k) adds its own per-choice list
    plp = parse_prompt_logprobs(obj)  # vLLM's own rule
    want = [k for k in ((logprobs if echo else None), plp) if k is not None]
    if want:
        sampling["prompt_logprobs"] = max(want)
    return OpenAIBody(**body, sampling=sampling, prompts=prompts, echo=echo,
                      prompt_logprobs=plp)


# ---------------------------------------------------------------------- the answer

#: vLLM's floor for reported log-probabilities (keeps ``-inf`` out of JSON).
LOGPROB_FLOOR = -9999.0


def openai_finish_reason(reason: FinishReason | None) -> str:
    """spec §1.4 last paragraph: ``length`` for length, otherwise ``stop``."""
    return "length" if reason is FinishReason.LENGTH else "stop"


def openai_usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
) -> dict[str, Any]:
    """The ``usage`` object (spec §5.1/§5.2; ``prompt_tokens_details.cached_tokens`` as
    OpenAI reports prefix-cache hits, spec §5.1 note)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` (byte-level BPE token spelling)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_DECODER = _byte_decoder()


class TokenTexts:
    """Token id -> (text, UTF-8 bytes) for logprobs, cached.

    The text is ``decode([id])`` (special tokens kept). When that holds U+FFFD (a token
    carrying part of a multi-byte character), the bytes come from the byte-level BPE
    spelling (``convert_ids_to_tokens``), so ``bytes`` of consecutive tokens join into
    the exact UTF-8 text, as the OpenAI reference describes the field.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            raw = text.encode("utf-8")
            if "\ufffd" in text and hasattr(self._tok, "convert_ids_to_tokens"):
                spelled = self._tok.convert_ids_to_tokens([token_id])[0]
                if spelled and all(c in _BYTE_DECODER for c in spelled):
                    raw = bytes(_BYTE_DECODER[c] for c in spelled)
            hit = self._cache[token_id] = (text, list(raw))
        return hit


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """Chat ``logprobs`` (spec §5.1): ``{"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}``."""
    content = []
    for e in entries:
        text, raw = texts.get(e.token_id)
        top = []
        for tid, lp in e.top:
            t, b = texts.get(tid)
            top.append({"token": t, "logprob": _lp(lp), "bytes": b})
        content.append({"token": text, "logprob": _lp(e.logprob), "bytes": raw,
                        "top_logprobs": top})
    return {"content": content}


def completion_prompt_logprobs(
    ids: tuple[int, ...] | list[int], entries: tuple[TokenLogprob | None, ...],
    texts: TokenTexts, k: int,
) -> dict[str, Any]:
    """The prompt's part of completions ``logprobs`` with ``echo`` (OpenAI legacy
    Completions: the prompt's tokens come first; the first has ``null`` logprob and
    ``null`` top_logprobs): the same keys as :func:`completion_logprobs`, offsets from 0.
    ``k``: alternatives per position (the request's ``logprobs``)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    offset = 0
    for tid, e in zip(ids, entries, strict=True):
        text = texts.get(tid)[0]
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {texts.get(t)[0]: _lp(lp) for t, lp in e.top[:k]}
        top.setdefault(text, _lp(e.logprob))
        out["token_logprobs"].append(_lp(e.logprob))
        out["top_logprobs"].append(top)
    return out


def join_logprobs(head: dict[str, Any] | None, tail: dict[str, Any] | None
                  ) -> dict[str, Any] | None:
    """Two completions ``logprobs`` objects, one after the other (prompt, then output)."""
    if head is None or tail is None:
        return head or tail
    return {key: head[key] + tail[key] for key in head}


def completion_logprobs(
    entries: list[TokenLogprob], texts: TokenTexts, offset: int
) -> tuple[dict[str, Any], int]:
    """Completions ``logprobs`` (spec §5.2): ``{tokens, token_logprobs, top_logprobs,
    text_offset}``; ``top_logprobs[i]`` maps token text -> logprob for the top
    alternatives plus the sampled token (OpenAI: up to ``logprobs + 1`` entries).
    ``offset`` is the character offset of the first token in the choice's text.

    Returns:
        (the object, the offset after the last token).
    """
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for e in entries:
        text = texts.get(e.token_id)[0]
        top = {texts.get(tid)[0]: _lp(lp) for tid, lp in e.top}
        top.setdefault(text, _lp(e.logprob))
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(e.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset
