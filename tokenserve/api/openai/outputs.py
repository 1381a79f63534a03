"""OpenAI family: the answer's pieces (spec/interfaces.md §5.1-§5.4, §1.4): the error
body, ``finish_reason``, ``usage`` and ``logprobs``.

Output shapes follow spec §5.1/§5.2 and the OpenAI API reference (Chat Completions /
Completions objects, their chunk objects and ``logprobs``).
"""

from __future__ import annotations

from typing import Any

from tokenserve.messages import FinishReason, TokenLogprob
from tokenserve.transport.errors import error_type_for

#: vLLM's floor for reported log-probabilities (keeps ``-inf`` out of JSON).
LOGPROB_FLOOR = -9999.0


def openai_error(status: int, message: str, error_type: str | None = None) -> dict[str, Any]:
    """The error body of every OpenAI route ([I], issue "errors in each family's own shape").

    OpenAI's ``{"error": {message, type, param, code}}``, so the ``openai`` SDK shows the
    message, plus MindIE's top-level ``error_type`` (spec §0.3) for MindIE tooling; both
    ``type`` fields carry the MindIE class of ``status`` (e.g. ``Input Validation Error``)
    and ``code`` is the status. The status codes themselves are MindIE's (spec §0.4).
    """
    kind = error_type or error_type_for(status)
    return {"error": {"message": message, "type": kind, "param": None, "code": status},
            "error_type": kind}


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
