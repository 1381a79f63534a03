"""Stop-string matching with hold-back, on hand-made text streams."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokenserve.engine.finish import StopStringMatcher


def run(pieces, stops, include=False):
    m = StopStringMatcher(tuple(stops), include)
    emitted = [m.feed(p) for p in pieces]
    emitted.append(m.flush())
    return emitted, m.hit


def test_match_across_pieces_is_cut_and_never_streamed():
    emitted, hit = run(["Hello wo", "rld. Bye", "!"], ["world."])
    assert hit == "world." and "".join(emitted) == "Hello "
    assert emitted[0] == "Hello "  # "wo" held back: it may start "world."


def test_match_inside_one_piece_and_include():
    emitted, hit = run(["abcSTOPdef"], ["STOP"], include=True)
    assert hit == "STOP" and "".join(emitted) == "abcSTOP"


def test_partial_prefix_released_when_ruled_out():
    emitted, hit = run(["a<", "b", "c"], ["<|end|>"])
    assert hit is None and emitted == ["a", "<b", "c", ""]


def test_unfinished_prefix_released_at_end():
    emitted, hit = run(["done <|en"], ["<|end|>"])
    assert hit is None and emitted == ["done ", "<|en"]


def test_flush_after_hit_is_empty():
    m = StopStringMatcher(("x",))
    assert m.feed("axb") == "a" and m.flush() == ""


def test_earliest_match_wins_among_several():
    emitted, hit = run(["xx B yy A"], ["A", "B"])
    assert hit == "B" and "".join(emitted) == "xx "


def test_nothing_after_hit():
    m = StopStringMatcher(("x",))
    assert m.feed("axb") == "a" and m.feed("more") == ""


@given(st.text(alphabet="ab.<|>你😀", max_size=40), st.lists(st.integers(1, 6), max_size=20),
       st.lists(st.text(alphabet="ab.<|>你😀", min_size=1, max_size=4), min_size=1, max_size=3))
def test_chunking_does_not_change_the_result(text, cuts, stops):
    pieces, i = [], 0
    for c in cuts:
        pieces.append(text[i:i + c])
        i += c
    pieces.append(text[i:])
    emitted, hit = run(pieces, stops)
    whole, whole_hit = run([text], stops)
    assert "".join(emitted) == "".join(whole) and hit == whole_hit
    # no emitted prefix of the text ever contains a stop string
    out = "".join(emitted)
    assert not any(s in out for s in stops)
    if hit is None:
        assert out == text
    else:
        first = min((text.find(s), len(s)) for s in stops if s in text)
        assert (first[0], len(hit)) == first and out == text[: first[0]]


def test_shorter_stop_at_same_place_wins_and_longer_earlier_partial_defers():
    assert run(["<", "<"], ["<", "<<"])[1] == "<"
    # "b" matches first in time, but "abc" starts earlier and may still complete
    emitted, hit = run(["a", "b", "c"], ["abc", "b"])
    assert hit == "abc" and "".join(emitted) == ""
    emitted, hit = run(["a", "b", "x"], ["abc", "b"])
    assert hit == "b" and "".join(emitted) == "a"
    # a deferred match is settled when the text ends
    emitted, hit = run(["xab"], ["abc", "b"])
    assert hit == "b" and "".join(emitted) == "xa"
