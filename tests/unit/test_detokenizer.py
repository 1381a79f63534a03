"""Tests for tokenserve.engine.detokenizer with a tiny byte-level BPE trained in-test."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenserve.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world! It's 12:30.",
    "我们今天去公园散步，天气很好。中文分词测试，汉字和标点符号。",
    "Emoji time 😀🎉👍🏽 party 🎉🎉 ok 😀 👩‍👩‍👧 flags 🇫🇷🇯🇵",
    "Mixed: café naïve Ελληνικά русский 日本語のテキスト 한국어",
]


class WrappedTokenizer:
    """The duck-typed interface the detokenizer expects, over ``tokenizers.Tokenizer``;
    records the length of every decode call."""

    def __init__(self, tk: Tokenizer) -> None:
        self.tk = tk
        self.decoded_lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(ids))
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.tk.id_to_token(i) for i in ids]

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text).ids

    def special(self, name: str) -> int:
        return self.tk.token_to_id(name)


@functools.lru_cache(maxsize=1)
def _trained() -> Tokenizer:
    """Byte-level BPE small enough that CJK characters and emoji span several tokens."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tk.train_from_iterator(CORPUS * 20, trainer)
    return tk


def _tokenizer() -> WrappedTokenizer:
    return WrappedTokenizer(_trained())


def _stream(tok, ids, chunks=None, prompt=(), skip=True) -> tuple[list[str], str]:
    """Feed ``ids`` in ``chunks`` (sizes; default one at a time); return (deltas, flush)."""
    detok = IncrementalDetokenizer(tok, list(prompt), skip)
    deltas, i = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.add(ids[i : i + size]))
        i += size
    if i < len(ids):
        deltas.append(detok.add(ids[i:]))
    tail = detok.flush()
    assert detok.output_text == "".join(deltas) + tail
    assert detok.flush() == ""
    return deltas, tail


def test_multibyte_characters_really_span_tokens():
    tok = _tokenizer()
    ids = tok.encode("中文 😀🎉")
    pieces = [tok.decode([i]) for i in ids]
    assert any(REPLACEMENT in p for p in pieces), pieces  # otherwise the tests prove little


TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from(list("中文分词我们天气😀🎉👍🏽🇫🇷日本語한국어é ")),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(text=TEXT, data=st.data())
def test_deltas_join_to_the_full_decode(text, data):
    tok = _tokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    chunks = data.draw(st.lists(st.integers(1, 5), max_size=len(ids)), label="chunks")
    for sizes in (None, chunks):
        deltas, tail = _stream(tok, ids, sizes)
        assert "".join(deltas) + tail == text
        # valid text leaves nothing held back (a literal trailing U+FFFD waits for flush)
        assert tail == "" or text.endswith(REPLACEMENT)
        assert not any(REPLACEMENT in d for d in deltas if REPLACEMENT not in text)


@settings(max_examples=100, deadline=None)
@given(prompt=TEXT, text=TEXT)
def test_prompt_context_does_not_change_the_output_text(prompt, text):
    tok = _tokenizer()
    ids = tok.encode(text)
    deltas, tail = _stream(tok, ids, prompt=tok.encode(prompt))
    assert "".join(deltas) + tail == text


def test_each_character_comes_out_whole():
    tok = _tokenizer()
    text = "ab 中文分词 😀🎉 ok"
    deltas, _ = _stream(tok, tok.encode(text))
    assert "".join(deltas) == text
    assert all(REPLACEMENT not in d for d in deltas)
    assert "😀" in deltas or any("😀" in d for d in deltas)


def test_generation_ending_mid_character_flushes_the_rest():
    tok = _tokenizer()
    full = tok.encode("hi 中😀")
    for cut in range(1, len(full)):
        ids = full[:cut]
        expect = tok.decode(ids)
        deltas, tail = _stream(tok, ids)
        assert "".join(deltas) + tail == expect
        assert all(REPLACEMENT not in d for d in deltas)
        assert tail.count(REPLACEMENT) == expect.count(REPLACEMENT)


def test_prompt_ending_mid_character():
    tok = _tokenizer()
    ids = tok.encode("x中文")
    for cut in range(1, len(ids)):
        prompt, out = ids[:cut], ids[cut:]
        deltas, tail = _stream(tok, out, prompt=prompt)
        assert "".join(deltas) + tail == tok.decode(out)


def test_invalid_bytes_are_emitted_not_held_forever():
    tok = _tokenizer()
    lead = tok.tk.token_to_id("ä")  # byte 0xE4 in the byte-level alphabet: a lead byte
    cont = tok.tk.token_to_id("Ģ")  # byte 0x80: a continuation byte
    assert lead is not None and cont is not None
    ids = [lead] * 30 + [cont] * 30 + tok.encode("ok")
    expect = tok.decode(ids)
    tok.decoded_lengths.clear()
    deltas, tail = _stream(tok, ids)
    assert max(tok.decoded_lengths) <= 8  # the window stays short
    assert "".join(deltas) + tail == expect
    assert sum(len(d) for d in deltas[:50]) > 0  # garbage did not stall the stream


def test_legit_replacement_character_passes_through():
    tok = _tokenizer()
    text = f"a{REPLACEMENT}b{REPLACEMENT}"
    deltas, tail = _stream(tok, tok.encode(text))
    assert "".join(deltas) + tail == text


def test_special_tokens_skipped_or_kept():
    tok = _tokenizer()
    end, start = tok.special("<|im_end|>"), tok.special("<|im_start|>")
    ids = tok.encode("Hello 世界") + [end] + [start] * 40 + tok.encode(" 😀 bye") + [end]
    for skip in (True, False):
        expect = tok.decode(ids, skip_special_tokens=skip)
        tok.decoded_lengths.clear()
        deltas, tail = _stream(tok, ids, skip=skip)
        assert max(tok.decoded_lengths) <= 12  # a run of skipped tokens does not pile up
        assert "".join(deltas) + tail == expect
    kept = "".join(_stream(tok, ids, skip=False)[0])
    assert "<|im_end|>" in kept and "<|im_end|>" not in "".join(_stream(tok, ids)[0])


def test_special_token_between_the_bytes_of_a_character():
    tok = _tokenizer()
    char = tok.encode("😀")
    assert len(char) > 1
    ids = char[:1] + [tok.special("<|im_end|>")] * 3 + char[1:] + tok.encode("!")
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == "😀!"
    assert all(REPLACEMENT not in d for d in deltas)


def test_per_call_cost_does_not_grow_with_the_output():
    tok = _tokenizer()
    ids = tok.encode(" ".join(CORPUS)) * 40
    expect = tok.decode(ids)
    tok.decoded_lengths.clear()
    deltas, tail = _stream(tok, ids, prompt=tok.encode("prompt " * 50))
    assert len(ids) > 2000 and max(tok.decoded_lengths) <= 12
    assert "".join(deltas) + tail == expect


def test_chat_prompt_context_and_empty_adds():
    tok = _tokenizer()
    prompt = [tok.special("<|im_start|>")] + tok.encode("user\nhi") + [tok.special("<|im_end|>")]
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.add([]) == "" and detok.output_text == ""
    assert detok.add(tok.encode("Hello")) == "Hello"
    assert detok.output_text == "Hello"


def test_engine_flush_drops_an_incomplete_trailing_character():
    tok = _tokenizer()
    full = tok.encode("hi 中😀")
    for cut in range(1, len(full)):
        ids = full[:cut]
        detok = IncrementalDetokenizer(tok, [])
        text = "".join(detok.add([i]) for i in ids) + detok.flush(drop_incomplete=True)
        assert not text.endswith(REPLACEMENT), (cut, text)
        assert tok.decode(ids).startswith(text)
