"""Merging of outputs for a consumer slower than the engine."""

from __future__ import annotations

import asyncio

from tokenserve.engine.output_stream import RequestHandle, merge_outputs
from tokenserve.messages import FinishReason, RequestOutput, TokenLogprob


def out(ids, text, *, first=False, finished=False, lp=True):
    return RequestOutput("r", tuple(ids), text, finished,
                         FinishReason.LENGTH if finished else None, 3, 0,
                         prefill_time_ms=10.0 if first else None,
                         decode_time_ms=None if first else 2.0,
                         logprobs=tuple(TokenLogprob(i, -0.5) for i in ids) if lp else None,
                         queue_time_ms=1.0 if first else None)


def test_merge_concatenates_and_keeps_first_timing():
    m = merge_outputs([out([1], "a", first=True), out([2], "b"), out([3], "c", finished=True)])
    assert m.new_token_ids == (1, 2, 3) and m.new_text == "abc" and m.finished
    assert m.prefill_time_ms == 10.0 and m.decode_time_ms is None and m.queue_time_ms == 1.0
    assert [lp.token_id for lp in m.logprobs] == [1, 2, 3]


def test_merge_decode_times_add_up_and_tokenless_final_keeps_logprobs():
    m = merge_outputs([out([1], "a"), out([2], "b"), out([], "", finished=True, lp=False)])
    assert m.decode_time_ms == 6.0 and [lp.token_id for lp in m.logprobs] == [1, 2]


async def test_stream_merges_pending_outputs():
    s = RequestHandle()
    s.put(out([1], "a", first=True))
    s.put(out([2], "b"))
    got = await s.get()
    assert got.new_text == "ab"
    asyncio.get_running_loop().call_later(0.01, s.put, out([3], "c", finished=True))
    got = await s.get()
    assert got.new_text == "c" and got.finished
