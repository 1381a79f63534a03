"""The per-request handle between the scheduler actor and one consumer (an HTTP handler).

The engine never waits for a client: the actor appends outputs to the handle and moves
on. A consumer slower than the engine gets the pending outputs merged into one (token ids
and text concatenated, decode times added), so memory per request stays bounded by what
the client has not read yet and no step is ever blocked by a slow socket.

Every request ends with exactly one final output (``finished`` set), whatever ended it:
EOS, length, a stop string or id, a timeout, an engine error, or :meth:`RequestHandle.abort`
(finish reason ``ABORT``, or ``ERROR`` when the abort carries an error). Stopping a request
never cancels a task::

    consumer                         handle                        scheduler actor
    out = await h.get(disconnected)  <- put(out) ................. each step
          (None: disconnected first)
    h.abort()  ------------------->  AbortRequest -> inbox ------> frees KV blocks,
                                                                   put(final ABORT output)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from tokenserve.aio import Signal
from tokenserve.messages import RequestOutput


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Fold consecutive outputs of one request into one."""
    assert outs, "nothing to merge"
    if len(outs) == 1:
        return outs[0]
    first, last = outs[0], outs[-1]
    decode = [o.decode_time_ms for o in outs if o.decode_time_ms is not None]
    return RequestOutput(
        request_id=last.request_id,
        new_token_ids=tuple(t for o in outs for t in o.new_token_ids),
        new_text="".join(o.new_text for o in outs),
        finished=last.finished,
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        prefill_time_ms=first.prefill_time_ms,
        decode_time_ms=(sum(decode) if decode and first.prefill_time_ms is None else None),
        error=last.error,
        seed=last.seed,
        logprobs=(tuple(lp for o in outs for lp in (o.logprobs or ()))
                  if any(o.logprobs is not None for o in outs) else None),
        stop_reason=last.stop_reason,
        queue_time_ms=first.queue_time_ms,
        num_cached_tokens=last.num_cached_tokens,
        replay=first.replay,
        handoff=next((o.handoff for o in outs if o.handoff is not None), None),
        prompt_logprobs=next((o.prompt_logprobs for o in outs
                              if o.prompt_logprobs is not None), None),
    )


#: ``abort(request_id, error)``: how a handle asks its engine to stop the request.
AbortFn = Callable[[str, "str | None"], None]


class RequestHandle:
    """One request in the engine: single producer (the scheduler actor calls :meth:`put`),
    single consumer (:meth:`get`, or ``async for``).

    Leaving early (``aclose()``, a cancelled ``async for``, garbage collection of an
    unfinished handle) aborts the request, so a consumer that fails between submitting
    and reading cannot leak KV blocks.
    """

    def __init__(self, request_id: str = "", abort: AbortFn | None = None) -> None:
        self.request_id = request_id
        self._abort_fn = abort
        self._pending: list[RequestOutput] = []
        self._ready = asyncio.Event()
        self._ended = False  # the final output was put
        self._aborted = False
        self._listener: Callable[[], None] | None = None
        #: the consumer has received the final output
        self.finished = False

    # ------------------------------------------------------------------ producer side

    def put(self, out: RequestOutput) -> None:
        """Called by the scheduler actor; never blocks. Nothing is put after a final."""
        if self._ended:
            return
        self._ended = out.finished
        self._pending.append(out)
        self._ready.set()
        if self._listener is not None:
            self._listener()

    @property
    def ended(self) -> bool:
        """The engine has put the final output (read or not)."""
        return self._ended

    # ------------------------------------------------------------------ consumer side

    def listen(self, fn: Callable[[], None] | None) -> None:
        """Call ``fn`` after every :meth:`put` (one consumer waiting on many handles)."""
        self._listener = fn

    def poll(self) -> RequestOutput | None:
        """Everything pending, merged, without waiting; None when nothing is."""
        if not self._pending:
            return None
        # a replay (tokens generated elsewhere, rendered but not sent) is never merged
        # with fresh outputs: the consumer must see where it ends
        n = 1
        while n < len(self._pending) and self._pending[n].replay == self._pending[0].replay:
            n += 1
        outs, self._pending = self._pending[:n], self._pending[n:]
        out = merge_outputs(outs)
        self.finished = out.finished
        return out

    async def get(self, until: Signal | None = None) -> RequestOutput | None:
        """Wait for output; returns everything pending, merged. Returns None when
        ``until`` (the client's disconnect) is set first; the request keeps running
        until :meth:`abort`.

        Raises:
            RuntimeError: the final output was already returned.
        """
        if self.finished:
            raise RuntimeError(f"request {self.request_id!r} already returned its final output")
        while not self._pending:
            if until is not None and until.is_set():
                return None
            self._ready.clear()
            if until is None:
                await self._ready.wait()
                continue
            until.subscribe(self._ready.set)
            try:
                await self._ready.wait()
            finally:
                until.unsubscribe(self._ready.set)
        return self.poll()

    def abort(self, error: str | None = None) -> bool:
        """Stop the request: the engine frees its KV blocks before its next step and ends
        it with a final output, ``ABORT`` (``ERROR`` carrying ``error`` when given).
        Idempotent; False when the request had already ended or was aborted."""
        if self._ended or self._aborted:
            return False
        self._aborted = True
        if self._abort_fn is not None:
            self._abort_fn(self.request_id, error)
        return True

    # ------------------------------------------------------------------ iteration

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self.abort()
            raise
        assert out is not None
        return out

    async def aclose(self) -> None:
        """Abort the request unless it has ended; idempotent."""
        self.abort()

    def __del__(self) -> None:
        if not self._ended and not self._aborted and self._abort_fn is not None:
            with contextlib.suppress(Exception):  # the loop may be gone at exit
                self.abort()
