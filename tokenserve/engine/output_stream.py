"""Per-request output slot between the scheduler actor and one HTTP handler.

The engine never waits for a client: it appends outputs here and moves on. A consumer
slower than the engine gets the pending outputs merged into one (token ids and text
concatenated, decode times added), so memory per request stays bounded by what the
client has not read yet and no step is ever blocked by a slow socket.
"""

from __future__ import annotations

import asyncio

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
    )


class RequestStream:
    """Single-producer (scheduler actor), single-consumer (HTTP handler) output slot."""

    def __init__(self) -> None:
        self._pending: list[RequestOutput] = []
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        """Called by the scheduler actor; never blocks."""
        self._pending.append(out)
        self._ready.set()

    async def get(self) -> RequestOutput:
        """Wait for output; returns everything pending, merged."""
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        outs, self._pending = self._pending, []
        return merge_outputs(outs)
