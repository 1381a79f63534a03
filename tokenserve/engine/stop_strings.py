"""Stop strings over streamed text, with hold-back.

A stop string may span token boundaries or sit inside one token, so matching works on
the detokenized text, not on ids. Text that could still become the start of a stop
string is held back from the client until the next tokens either complete the match
(the text is cut there) or rule it out (the text is released). So a stop string, or a
prefix of one that may yet complete, is never streamed (vLLM's and TGI's behaviour).
"""

from __future__ import annotations


class StopStringMatcher:
    """Feed text deltas in order; get back what is safe to emit and the stop hit.

    Args:
        stops: non-empty stop strings.
        include_in_output: keep the matched stop string in the emitted text.
    """

    def __init__(self, stops: tuple[str, ...], include_in_output: bool = False) -> None:
        assert stops and all(stops), "need non-empty stop strings"
        self.stops = stops
        self.include = include_in_output
        self._pending = ""
        self.hit: str | None = None

    def feed(self, delta: str) -> str:
        """Add ``delta``; returns the text now safe to emit. After a hit (``self.hit``
        set), the text from the match on is cut and later calls return ``""``."""
        if self.hit is not None:
            return ""
        buf = self._pending + delta
        best = None  # (index, -len) of the earliest, then longest, match
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i, -len(s)) < best[0]):
                best = ((i, -len(s)), s)
        if best is not None:
            (i, _), s = best
            self.hit, self._pending = s, ""
            return buf[: i + len(s)] if self.include else buf[:i]
        keep = self._partial_suffix(buf)
        self._pending = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The request ended without completing a match: release held-back text."""
        out, self._pending = self._pending, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
