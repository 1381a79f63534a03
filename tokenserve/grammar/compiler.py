"""Compile a :class:`~tokenserve.sampling_params.StructuredOutput` for one tokenizer.

Pure and synchronous (the async shell is :mod:`tokenserve.grammar.service`). The grammar
engine is llguidance (https://github.com/guidance-ai/llguidance): a Rust Earley parser
with a lazily built lexer, its Lark dialect (``docs/syntax.md``), JSON Schema
(``docs/json_schema.md``) and regex front ends. Each kind maps onto one llguidance
grammar:

=============  ==============================================================
JSON_SCHEMA    ``LLMatcher.grammar_from_json_schema(value)`` (whitespace: JSON_OPTIONS)
JSON_OBJECT    the schema ``{"type": "object"}`` (OpenAI ``json_object``)
REGEX          ``LLMatcher.grammar_from_regex(value)`` (the whole output matches)
CHOICE         ``start: "a" | "b"`` in Lark (``value``: a JSON array of strings)
GRAMMAR        ``value`` in llguidance's Lark dialect (``%json{...}`` embeds a schema)
=============  ==============================================================

Bounds (a breach is the client's error, ``ValueError``): the constraint's text length
(:attr:`GrammarLimits.max_text_bytes`), llguidance's parser limits (grammar size, lexer
fuel for the initial build and per step, Earley items per step), and the wall time of
the compile itself (checked here after the fact; the service also stops waiting at the
bound). The compiled result is cached by ``(kind, value)`` in an LRU: one compiler per
tokenizer, so the key is (grammar, tokenizer).
"""

from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass

from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from tokenserve.sampling_params import ConstraintKind, StructuredOutput

#: JSON under a schema or ``json_object`` has bounded whitespace: at most one space
#: between the structure's tokens (spec interfaces.md §5.5: a grammar that lets a small
#: model emit newline after newline ends answers unfinished at ``max_tokens``). Overrides
#: win over a schema's own ``x-guidance`` options.
JSON_OPTIONS = {"whitespace_pattern": " ?"}


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on one constraint (a breach is a ``ValueError``: HTTP 400).

    Attributes:
        max_text_bytes: the constraint's text (schema, regex, grammar), UTF-8 bytes.
        compile_timeout_s: wall seconds one compile may take (the service stops waiting
            then; the compile below checks it too).
        max_grammar_size: llguidance ``max_grammar_size`` (symbols in productions).
        initial_lexer_fuel: llguidance fuel for building the lexer (~50k per ms).
        step_lexer_fuel: llguidance fuel for one token's mask (~14k per ms): bounds the
            per-step mask cost (``maxLength`` on long strings and the like); a step past
            it fails that request alone.
        step_max_items: llguidance Earley items per step (~20k per ms).
        cache_size: compiled constraints kept (LRU).
    """

    max_text_bytes: int = 1 << 20
    compile_timeout_s: float = 10.0
    max_grammar_size: int = 500_000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    cache_size: int = 256

    def parser_limits(self) -> LLParserLimits:
        return LLParserLimits(
            max_grammar_size=self.max_grammar_size, initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
            verbose_errors=False)


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A constraint compiled for one tokenizer: ``matcher()`` starts a request's matcher.

    Attributes:
        structured: what was compiled.
        compile_ms: wall milliseconds the compile took (the first; cached reuses it).
    """

    structured: StructuredOutput
    compile_ms: float
    _template: LLMatcher

    def matcher(self) -> LLMatcher:
        """A fresh llguidance matcher at the grammar's start (a copy of the template:
        the lexer built at compile time is shared)."""
        return self._template.deep_copy()


def llguidance_grammar(s: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) of ``s``.

    Raises:
        ValueError: ``value`` is not what the kind needs (JSON text for JSON_SCHEMA, a JSON
            array of strings for CHOICE).
    """
    kind, value = s.kind, s.value
    if kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object or a boolean")
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if kind is ConstraintKind.JSON_OBJECT:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind is ConstraintKind.REGEX:
        return LLMatcher.grammar_from_regex(value)
    if kind is ConstraintKind.CHOICE:
        try:
            choices = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"choice must be a JSON array of strings: {exc}") from None
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) for c in choices)):
            raise ValueError("choice must be a non-empty array of strings")
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    if kind is ConstraintKind.GRAMMAR:
        return LLMatcher.grammar_from_lark(value)
    raise ValueError(f"unknown constraint kind {kind!r}")


def make_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> LLTokenizer:
    """llguidance's view of a ``tokenizers`` tokenizer (~0.25 s for a 49k vocabulary).

    Args:
        tokenizer_json: ``tokenizers.Tokenizer.to_str()`` of the model's tokenizer.
        vocab_size: the logits' width (ids ``>=`` the tokenizer's own are never allowed).
        eos_ids: the ids that end generation; allowed only where the grammar accepts.
    """
    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))


class GrammarCompiler:
    """Compiles constraints for one tokenizer, with an LRU cache of the results.

    Thread-safe (the cache has a lock; compiles of different constraints may run at
    once). ``compile`` is blocking: call it from a worker thread
    (:class:`tokenserve.grammar.service.GrammarService`).
    """

    def __init__(self, tokenizer: LLTokenizer, limits: GrammarLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits or GrammarLimits()
        self._parser_limits = self.limits.parser_limits()
        self._cache: collections.OrderedDict[StructuredOutput, CompiledGrammar] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def cached(self, s: StructuredOutput) -> CompiledGrammar | None:
        """The cached compile of ``s`` (marked recently used), or None."""
        with self._lock:
            hit = self._cache.get(s)
            if hit is not None:
                self._cache.move_to_end(s)
            return hit

    def compile(self, s: StructuredOutput) -> CompiledGrammar:
        """Compile ``s`` (or return the cached result).

        Raises:
            ValueError: the constraint is malformed, invalid (llguidance's message), too
                large, or took longer than ``limits.compile_timeout_s``.
        """
        hit = self.cached(s)
        if hit is not None:
            return hit
        if len(s.value.encode()) > self.limits.max_text_bytes:
            raise ValueError(f"the {s.kind.value} constraint is larger than "
                             f"{self.limits.max_text_bytes} bytes")
        t0 = time.perf_counter()
        grammar = llguidance_grammar(s)
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._parser_limits)
        if not matcher.is_error():
            # the first mask builds the lexer's start states: done here, off the model
            # thread, so a grammar too costly for one step fails now (400), not mid-request
            matcher.compute_bitmask()
        if matcher.is_error():
            raise ValueError(f"invalid {s.kind.value} constraint: {_short(matcher.get_error())}")
        elapsed = time.perf_counter() - t0
        if elapsed > self.limits.compile_timeout_s:
            raise ValueError(f"the {s.kind.value} constraint took {elapsed:.1f} s to compile "
                             f"(limit {self.limits.compile_timeout_s:g} s)")
        out = CompiledGrammar(s, elapsed * 1e3, matcher)
        with self._lock:
            self._cache[s] = out
            self._cache.move_to_end(s)
            while len(self._cache) > self.limits.cache_size:
                self._cache.popitem(last=False)
        return out


def _short(msg: str, limit: int = 500) -> str:
    return msg if len(msg) <= limit else msg[:limit] + "..."


__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarLimits",
           "llguidance_grammar", "make_tokenizer"]
