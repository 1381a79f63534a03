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

    The hit is the match that *starts* first in the output text; among stop strings
    matching at the same place, the shortest (the one a stream sees complete first).
    A match is only final once no earlier-starting partial match can still complete,
    so the result does not depend on how the text was cut into deltas.

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
        return self._scan(self._pending + delta, final=False)

    def flush(self) -> str:
        """The text ended: settle a deferred match or release held-back text."""
        if self.hit is not None:
            return ""
        return self._scan(self._pending, final=True)

    def _scan(self, buf: str, final: bool) -> str:
        best: tuple[int, int, str] | None = None  # (start, length, stop)
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i, len(s)) < best[:2]):
                best = (i, len(s), s)
        partial = len(buf) if final else self._partial_start(buf)
        if best is not None and best[0] <= partial:
            i, n, s = best
            self.hit, self._pending = s, ""
            return buf[: i + n] if self.include else buf[:i]
        self._pending = buf[partial:]
        return buf[:partial]

    def _partial_start(self, buf: str) -> int:
        """Start of the longest suffix of ``buf`` that is a proper prefix of a stop
        (``len(buf)`` when there is none)."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return len(buf) - best
