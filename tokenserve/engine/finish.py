"""When a request is finished: every rule that ends one, in one module (pure; no torch).

A request ends on exactly one of these, with these ``FinishReason`` values:

=====================  ==========  ===================================  ===================
rule                   reason      decided by                           ``stop_reason``
=====================  ==========  ===================================  ===================
EOS token              EOS         :func:`after_token` (scheduler)       None
stop token id          EOS         :func:`after_token` (scheduler)       the id
max_new_tokens,        LENGTH      :func:`after_token` (scheduler)       None
context / KV full
stop string            EOS         :func:`after_text` / :func:`at_end`   the string
                                   (scheduler actor, on the text)
timeout                TIMEOUT     :func:`expiry` (scheduler, each loop)  None
abort / stopInfer      ABORT       :func:`aborted` (a handle's abort)     None
abort with an error    ERROR       :func:`aborted`                        None
=====================  ==========  ===================================  ===================

(ERROR from a failed step and RECOMPUTE from a PD eviction are outcomes, not rules.)

Stop strings work on the detokenized text, not on ids: a stop string may span token
boundaries or sit inside one token. :class:`StopStringMatcher` holds back text that could
still become the start of a stop string until the next tokens either complete the match
(the text is cut there) or rule it out (the text is released). So a stop string, or a
prefix of one that may yet complete, is never streamed (vLLM's and TGI's behaviour).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenserve.messages import FinishReason
from tokenserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenserve.engine.request import Request


@dataclass(frozen=True, slots=True)
class Finish:
    """A decision that a request ends.

    Attributes:
        reason: why (each API family maps it to its own string).
        stop_reason: the stop string or stop token id that ended it (vLLM's
            ``stop_reason``); None for the other rules.
        error: MindIE's message on TIMEOUT / ERROR, e.g. ``"Engine callback timeout:
            client timeout"`` (spec §0.4 step 9).
    """

    reason: FinishReason
    stop_reason: str | int | None = None
    error: str | None = None


def after_token(params: SamplingParams, tok: int, *, num_output_tokens: int, num_tokens: int,
                max_seq_len: int, eos_token_ids: Collection[int],
                next_fits: bool) -> Finish | None:
    """Whether sampling ``tok`` ends the request.

    Args:
        params: the request's parameters (``stop_token_ids``, ``ignore_eos``,
            ``max_new_tokens``).
        tok: the token just sampled.
        num_output_tokens: generated tokens, ``tok`` included.
        num_tokens: prompt + generated tokens, ``tok`` included.
        max_seq_len: prompt + output cap (tokens).
        eos_token_ids: the model's EOS ids (ignored with ``ignore_eos``).
        next_fits: one more token would fit in an otherwise empty KV cache.

    Returns:
        EOS (``stop_reason`` = ``tok`` for a stop token id), LENGTH, or None.
    """
    if tok in params.stop_token_ids:
        return Finish(FinishReason.EOS, stop_reason=tok)
    if not params.ignore_eos and tok in eos_token_ids:
        return Finish(FinishReason.EOS)
    if num_output_tokens >= params.max_new_tokens or num_tokens >= max_seq_len or not next_fits:
        return Finish(FinishReason.LENGTH)
    return None


def after_text(stop: StopStringMatcher | None) -> Finish | None:
    """Whether the text fed to ``stop`` so far completed a stop string (EOS)."""
    if stop is None or stop.hit is None:
        return None
    return Finish(FinishReason.EOS, stop_reason=stop.hit)


def at_end(fin: Finish, stop: StopStringMatcher | None) -> Finish:
    """``fin`` once the held-back text was flushed through ``stop``: a stop string that
    this text completed turns an EOS or LENGTH end into a stop-string end."""
    hit = after_text(stop)
    if (hit is not None and fin.stop_reason is None
            and fin.reason in (FinishReason.EOS, FinishReason.LENGTH)):
        return hit
    return fin


def expiry(req: Request, now: float) -> Finish | None:
    """The timeout of ``req`` that has fired at ``now`` (monotonic s), if any: its own
    deadline (client ``timeout``, ``e2eTimeout``, PD park time) or ``tokenTimeout``
    since its last token."""
    if now >= req.deadline:
        why = req.deadline_reason
    else:
        since = req.last_token_time if req.last_token_time is not None else req.arrival_time
        if now - since < req.token_timeout_s:
            return None
        why = "server tokenTimeout"
    return Finish(FinishReason.TIMEOUT, error=f"Engine callback timeout: {why}")


def next_deadline(req: Request) -> float:
    """Earliest instant (monotonic s) at which :func:`expiry` may fire for ``req``."""
    since = req.last_token_time if req.last_token_time is not None else req.arrival_time
    return min(req.deadline, since + req.token_timeout_s)


def aborted(error: str | None = None) -> Finish:
    """A stop from outside (client gone, ``stopInfer``): ABORT, or ERROR carrying
    ``error`` (e.g. the drain time ran out)."""
    if error is None:
        return Finish(FinishReason.ABORT)
    return Finish(FinishReason.ERROR, error=error)


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
