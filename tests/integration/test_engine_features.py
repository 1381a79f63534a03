"""Engine features with the real model through the AsyncEngine API: stop strings with
hold-back, stop token ids, logprobs, penalties, timeouts, priorities in the queue."""

from __future__ import annotations

import itertools

import pytest

from tokenserve.messages import FinishReason, GenerateRequest
from tokenserve.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")
_ids = itertools.count()


async def run(live, prompt_ids, **params):
    g = GenerateRequest(f"feat-{next(_ids)}", tuple(prompt_ids),
                        SamplingParams(**{"max_new_tokens": 24, "seed": 0, **params}))
    return [o async for o in live.engine.generate(g)]


def text_of(outs):
    return "".join(o.new_text for o in outs)


async def test_stop_string_cut_and_never_streamed(live):
    ids = live.chat_ids("What is the capital of France?")
    plain = text_of(await run(live, ids))
    assert " Paris" in plain
    outs = await run(live, ids, stop=(" Paris",))
    assert text_of(outs) == plain[: plain.index(" Paris")]
    assert not any("Par" in o.new_text for o in outs)
    last = outs[-1]
    assert last.finished and last.finish_reason is FinishReason.EOS
    assert last.stop_reason == " Paris"
    outs = await run(live, ids, stop=(" Paris",), include_stop_str_in_output=True)
    assert text_of(outs) == plain[: plain.index(" Paris") + len(" Paris")]
    await live.assert_idle_and_leak_free()


async def test_stop_string_inside_a_token(live):
    ids = live.chat_ids("What is the capital of France?")
    plain = text_of(await run(live, ids))
    outs = await run(live, ids, stop=("api",))  # inside the token " capital"
    assert text_of(outs) == plain[: plain.index("api")]
    assert outs[-1].stop_reason == "api"


async def test_stop_token_ids(live):
    ids = live.chat_ids("What is the capital of France?")
    first = (await run(live, ids, max_new_tokens=3))
    tok = first[1].new_token_ids[0]
    outs = await run(live, ids, stop_token_ids=(tok,))
    assert outs[-1].finish_reason is FinishReason.EOS and outs[-1].stop_reason == tok
    assert outs[-1].num_output_tokens == 2


async def test_logprobs_greedy(live):
    ids = live.chat_ids("What is the capital of France?")
    outs = await run(live, ids, logprobs=3, max_new_tokens=6)
    for o in outs:
        (lp,) = o.logprobs
        assert lp.token_id == o.new_token_ids[0] and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy = most likely
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


async def test_frequency_penalty_changes_repetitive_output(live):
    ids = live.engine.tokenizer.encode("1, 1, 1, 1, 1, 1, 1,", add_special_tokens=False)
    plain = await run(live, ids, max_new_tokens=12)
    pen = await run(live, ids, max_new_tokens=12, frequency_penalty=2.0, presence_penalty=2.0)
    a = [t for o in plain for t in o.new_token_ids]
    b = [t for o in pen for t in o.new_token_ids]
    assert a != b
    assert len(set(b)) > len(set(a))  # penalised output repeats itself less
