"""tokenserve/grammar: the compiler (kinds, bounds, LRU cache), the async service (time
bound, never blocking other compiles), the per-request matcher and the batch masks, with
the default model's tokenizer (its files only; no model)."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
import torch
from llguidance import LLExecutor

from tokenserve.grammar.compiler import GrammarCompiler, GrammarLimits, make_tokenizer
from tokenserve.grammar.matcher import (
    GrammarMatcher,
    apply_masks,
    blocked_tokens,
    fill_masks,
    mask_words,
)
from tokenserve.grammar.service import GrammarService
from tokenserve.models.loader import resolve_model
from tokenserve.models.tokenizer import Tokenizer
from tokenserve.sampling_params import ConstraintKind as K
from tokenserve.sampling_params import StructuredOutput as S


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def lltok(tok):
    return make_tokenizer(tok.to_json_str(), tok.vocab_size, tok.eos_token_ids)


def allowed(tok, matchers) -> list[set[int]]:
    """Each matcher's allowed token ids, through fill -> unpack -> apply on logits."""
    bm = torch.empty(len(matchers), mask_words(tok.vocab_size), dtype=torch.int32)
    fill_masks(LLExecutor(1), matchers, bm)
    logits = torch.zeros(len(matchers) + 1, tok.vocab_size)
    apply_masks(logits, list(range(1, len(matchers) + 1)), blocked_tokens(bm, tok.vocab_size))
    assert torch.isfinite(logits[0]).all()  # a row not named is untouched
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits[1:]]


def test_eos_only_where_the_grammar_accepts(tok, lltok) -> None:
    c = GrammarCompiler(lltok)
    cg = c.compile(S(K.CHOICE, '["yes", "no"]'))
    m = GrammarMatcher(cg)
    first = allowed(tok, [m])[0]
    eos = tok.eos_token_ids[0]
    assert eos not in first and first  # nothing generated yet: EOS is not an answer
    assert {tok.decode([t]) for t in first} <= {"y", "ye", "yes", "n", "no"}
    for t in tok.encode("yes", add_special_tokens=False):
        assert m.advance(t) is None
    assert allowed(tok, [m])[0] == {eos}  # complete: only EOS
    assert m.advance(tok.encode("no", add_special_tokens=False)[0]) is not None


def test_matcher_rebuilt_from_tokens_so_far(tok, lltok) -> None:
    """PD decode / recompute: a matcher built from the generated tokens allows exactly
    what the one that followed them allows."""
    cg = GrammarCompiler(lltok).compile(S(K.JSON_SCHEMA, json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})))
    toks = tok.encode('{"a": 12', add_special_tokens=False)
    stepped = GrammarMatcher(cg)
    for t in toks:
        assert stepped.advance(t) is None
    rebuilt = GrammarMatcher(cg, toks)
    a, b = allowed(tok, [stepped, rebuilt])
    assert a == b and a
    with pytest.raises(ValueError, match="do not follow"):
        GrammarMatcher(cg, tok.encode("hello", add_special_tokens=False))


def test_cache_lru_and_size_bound(lltok) -> None:
    c = GrammarCompiler(lltok, GrammarLimits(cache_size=2, max_text_bytes=64))
    a, b, d = (S(K.REGEX, r) for r in ("a+", "b+", "d+"))
    ca = c.compile(a)
    assert c.compile(a) is ca  # cached
    c.compile(b)
    c.compile(a)  # a is now the most recent
    c.compile(d)  # evicts b
    assert c.cached(a) is ca and c.cached(b) is None and c.cached(d) is not None
    with pytest.raises(ValueError, match="larger than 64 bytes"):
        c.compile(S(K.REGEX, "x" * 65))


def test_pathological_schemas_bounded(tok, lltok) -> None:
    """Known failure modes of other servers: each compiles and keeps every step's mask
    within llguidance's per-step fuel, or is refused (ValueError -> 400)."""
    c = GrammarCompiler(lltok)
    deep = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    with pytest.raises(ValueError, match="recursion"):
        c.compile(S(K.JSON_SCHEMA, json.dumps(deep)))
    ok = {
        "long maxLength": {"type": "object", "required": ["s"], "properties": {
            "s": {"type": "string", "minLength": 2000, "maxLength": 100_000}}},
        "many maxItems": {"type": "array", "minItems": 200, "maxItems": 10_000,
                          "items": {"type": "string", "maxLength": 1000}},
        "recursive": {"$defs": {"n": {"type": "object", "required": ["v", "kids"],
                                      "properties": {"v": {"type": "integer"}, "kids": {
                                          "type": "array", "items": {"$ref": "#/$defs/n"}}}}},
                      "$ref": "#/$defs/n"},
        "regex blow-up": {"type": "string", "pattern": "^([a-z]{1,300}[0-9]{1,300}){1,300}$"},
    }
    gen = torch.Generator().manual_seed(0)
    eos = tok.eos_token_ids[0]
    for name, schema in ok.items():
        m = GrammarMatcher(c.compile(S(K.JSON_SCHEMA, json.dumps(schema))))
        for _ in range(80):  # random allowed non-EOS tokens: the mask never errors
            bits = np.unpackbits(np.frombuffer(m.matcher.compute_bitmask(), np.uint8),
                                 count=tok.vocab_size, bitorder="little")
            choices = [t for t in np.flatnonzero(bits).tolist() if t != eos]
            assert choices, name
            assert m.advance(choices[int(torch.randint(len(choices), (1,), generator=gen))]) \
                is None, name
            assert m.error is None, name


def test_service_time_bound_never_blocks_other_compiles(lltok) -> None:
    """A compile that does not end is answered as the client's error at the time bound,
    while other constraints still compile."""
    release = threading.Event()

    class Stuck(GrammarCompiler):
        def compile(self, s):
            if s.value == "stuck":
                release.wait(30)
            return super().compile(s)

    svc = GrammarService(lambda: Stuck(lltok, GrammarLimits(compile_timeout_s=0.2)))

    async def main() -> None:
        stuck = asyncio.ensure_future(svc.compile(S(K.REGEX, "stuck")))
        assert (await svc.compile(S(K.REGEX, "[0-9]+"))).structured.value == "[0-9]+"
        with pytest.raises(ValueError, match="did not compile within"):
            await stuck
        release.set()

    try:
        asyncio.run(main())
    finally:
        release.set()
        svc.close()


def test_blocked_tokens_bit_order() -> None:
    bm = torch.zeros(1, 2, dtype=torch.int32)
    bm[0, 0] = 1 << 3
    bm[0, 1] = 1 << 1  # token 33
    blocked = blocked_tokens(bm, 40)
    assert np.flatnonzero(~blocked[0]).tolist() == [3, 33]


def test_json_whitespace_is_bounded(tok, lltok) -> None:
    """spec interfaces.md §5.5: at most one space between JSON tokens (a newline run, the
    way a small model fills max_tokens, is refused), even if the schema asks otherwise."""
    c = GrammarCompiler(lltok)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "x-guidance": {"whitespace_flexible": True}}
    for s in (S(K.JSON_SCHEMA, json.dumps(schema)), S(K.JSON_OBJECT)):
        cg = c.compile(s)
        assert GrammarMatcher(cg, tok.encode('{"a": 1}', add_special_tokens=False))
        with pytest.raises(ValueError):
            GrammarMatcher(cg, tok.encode('{\n\n  "a": 1}', add_special_tokens=False))


def test_strict_response_format_grammar_rejects_extra_keys(lltok) -> None:
    """``response_format`` json_schema with ``strict: true`` and a schema that does not
    say ``additionalProperties`` (a pydantic model's plain ``model_json_schema()``): the
    compiled grammar accepts the declared keys only, at every nesting level; without
    ``strict`` an extra key is allowed (JSON Schema's default)."""
    from tokenserve.api.structured import parse_response_format

    schema = {"$defs": {"Tag": {"properties": {"label": {"type": "string"}},
                                "required": ["label"], "type": "object"}},
              "properties": {"name": {"type": "string"},
                             "tags": {"items": {"$ref": "#/$defs/Tag"}, "type": "array"}},
              "required": ["name"], "type": "object"}
    c = GrammarCompiler(lltok)

    def accepts(strict: bool, text: str) -> bool:
        fmt = {"type": "json_schema",
               "json_schema": {"name": "x", "schema": schema, "strict": strict}}
        m = c.compile(parse_response_format(fmt)).matcher()
        return m.consume_tokens(lltok.tokenize_str(text)) and m.is_accepting()

    good = '{"name": "a", "tags": [{"label": "b"}]}'
    extra = '{"name": "a", "extra": 1}'
    nested_extra = '{"name": "a", "tags": [{"label": "b", "color": "red"}]}'
    assert accepts(True, good) and accepts(False, good)
    assert not accepts(True, extra) and accepts(False, extra)
    assert not accepts(True, nested_extra) and accepts(False, nested_extra)
