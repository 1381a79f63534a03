"""Incremental, UTF-8 safe detokenization: token ids in, text deltas out.

The algorithm of vLLM's ``detokenize_incrementally`` and TGI's ``decode_token``: decode a
short window of ids twice, with and without the newest ones, and emit the difference.
Decoding whole windows (not single tokens) keeps byte-level BPE spacing and multi-token
characters right; diffing keeps the per-call cost O(window), not O(output length)::

    ids      ... | prefix_offset ........ read_offset ......... len(ids) |
                   \\_ already emitted __/ \\__ new, not yet emitted __/
    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

UTF-8 safety: a byte-level token may hold part of a multi-byte character, which decodes
to U+FFFD until the rest arrives. While the window's text ends with U+FFFD nothing is
emitted past the last id boundary that no character straddles, so characters come out
whole. :meth:`IncrementalDetokenizer.flush` emits whatever is still held back when the
generation ends (replacement characters included, unless ``drop_incomplete``: the engine
drops an incomplete trailing character, so no final text ends in a broken one).

Invariant (tested): ``"".join(deltas) + flush() == tokenizer.decode(output_ids,
skip_special_tokens)`` for tokenizers whose decode concatenates (byte-level BPE:
SmolLM2, Llama 3, Qwen2), and no delta holds U+FFFD unless that full decode does.
SentencePiece tokenizers that strip a leading space at the start of a decode differ by
that space: with the prompt as context the first delta keeps it (as in vLLM and TGI's
stream), where ``decode(output_ids)`` drops it.

Kept special tokens (``keep_special_ids``, a request's
``SamplingParams.keep_special_token_ids``: the tool-call markers, which real tokenizers
hold as special tokens): with ``skip_special_tokens`` every special id but those is
filtered out before ``decode(..., skip_special_tokens=False)``; that is what
``skip_special_tokens`` itself does (the tokenizers library drops the added tokens marked
special, the ones ``all_special_ids`` lists, before its decoder), less the kept ones. The
invariant above then holds with that filtered decode.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

#: What an incomplete UTF-8 sequence decodes to.
REPLACEMENT = "\ufffd"
#: Prompt tokens decoded in front of the output as context (vLLM uses 5): tokenizers that
#: strip a leading space at the start of a decode (SentencePiece) then keep the output's
#: first space.
PROMPT_CONTEXT = 5
#: Ids before ``prefix_offset`` are dropped once this many pile up (keeps memory O(window)).
_TRIM_AT = 256
#: Byte-level tokens one character can span (UTF-8 encodes a character in <= 4 bytes).
_MAX_CHAR_TOKENS = 4


class Decoder(Protocol):
    """The part of a tokenizer this module needs (``tokenserve.models.tokenizer.Tokenizer``)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output ids into text deltas as they are generated.

    Args:
        tokenizer: has ``decode(ids, skip_special_tokens=...) -> str``.
        prompt_token_ids: the request's prompt; its last ``PROMPT_CONTEXT`` ids are decoded
            in front of the output as context (dropped if they end inside a character,
            so the output text does not depend on the prompt's broken tail).
        skip_special_tokens: drop special tokens from the text (passed to ``decode``).
        keep_special_ids: special tokens whose text stays in despite
            ``skip_special_tokens`` (module docstring); the tokenizer must then also have
            ``all_special_ids``.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        keep_special_ids: Collection[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        #: ids filtered out before a decode (the special ones not kept), or None
        self._drop: frozenset[int] | None = None
        if skip_special_tokens and keep_special_ids:
            special: Collection[int] = tokenizer.all_special_ids  # type: ignore[attr-defined]
            self._drop = frozenset(special).difference(keep_special_ids)
            self._skip = False
        context = list(prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT) :])
        if self._decode(context).endswith(REPLACEMENT):
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pieces: list[str] = []

    @property
    def output_text(self) -> str:
        """All text emitted so far (the joined deltas; held-back bytes excluded)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (may be ``""``).

        Cost: a few decodes of ``ids[prefix_offset:]`` (the previous delta's ids plus the
        pending ones), independent of how long the output already is.
        """
        self._ids.extend(new_token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        end = len(self._ids)
        text = self._decode(self._ids[self._prefix_offset :])
        if text.endswith(REPLACEMENT):
            cut = self._clean_cut(prefix_text, text)
            if cut is None:
                return ""  # an incomplete character: wait for its remaining bytes
            end, text = cut
        if len(text) <= len(prefix_text):
            # The new ids add no text (skipped special tokens): drop them, so a long run
            # of them cannot grow the window. Safe for decoders that concatenate.
            del self._ids[self._read_offset :]
            return ""
        delta = text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._emit(delta)
        return delta

    def flush(self, drop_incomplete: bool = False) -> str:
        """Emit the held-back text at the end of a generation (may contain U+FFFD).

        With ``drop_incomplete`` (what the engine does when a request ends), trailing
        U+FFFD of the held-back text is dropped: a generation that stopped mid-way through
        a multi-byte character does not end in a broken one (the ids still hold every
        byte). A literal U+FFFD generated as the very last character goes with it.

        Idempotent: a second call returns ``""``.
        """
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        delta = text[len(prefix_text) :]
        if drop_incomplete:
            delta = delta.rstrip(REPLACEMENT)
        self._emit(delta)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if self._drop is not None:
            ids = [i for i in ids if i not in self._drop]
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _clean_cut(self, prefix_text: str, text: str) -> tuple[int, str] | None:
        """Latest id boundary ``j`` among the pending ids that ends on whole characters.

        ``j`` is clean when ``decode(ids[p:j]) + decode(ids[j:]) == decode(ids[p:])``: no
        character straddles it, so the text before it is final (any U+FFFD in it stands
        for invalid bytes and stays in the full decode too). Only the last
        ``_MAX_CHAR_TOKENS`` boundaries are tried: a character spans at most 4 byte
        tokens. This lets a multi-id :meth:`add` emit its complete part, and keeps the
        window short when a model emits invalid bytes.

        Returns:
            ``(j, decode(ids[p:j]))`` when that adds text beyond ``prefix_text``, else None.
        """
        end = len(self._ids)
        for j in range(end - 1, max(self._read_offset, end - _MAX_CHAR_TOKENS), -1):
            left = self._decode(self._ids[self._prefix_offset : j])
            if len(left) <= len(prefix_text):
                return None
            right = self._decode(self._ids[j:])
            # An empty right part proves nothing: bytes may still follow the ids that
            # decode to nothing (skipped special tokens) and complete left's last char.
            if right and left + right == text:
                return j, left
        return None

    def _emit(self, delta: str) -> None:
        if delta:
            self._pieces.append(delta)
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
