"""One bad request never harms another (issue: production hardening, item 2).

A fault is injected into one request's rows through the runner's test hook while three
greedy streams run beside it on the real model: the bad request fails alone with an error
in its family's shape, the three streams finish with exactly the text they give alone, and
no KV block leaks. The sampling edge cases that used to poison a whole step (temperature
1e-300, penalties 1e-300 and 1e300) run beside healthy requests too.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.sse import read_sse

pytestmark = pytest.mark.asyncio(loop_scope="session")

HEALTHY = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
BAD = "Poisoned prompt: the fault hook fails this request"


async def _stream_text(client, prompt: str) -> str:
    events = await read_sse(client, "/generate_stream",
                            {"inputs": prompt, "parameters": {"max_new_tokens": 24}})
    assert "error" not in events[-1], events[-1]
    return events[-1]["generated_text"]


async def test_fault_in_one_request_fails_it_alone(live, client):
    alone = [await _stream_text(client, p) for p in HEALTHY]
    bad_ids = live.engine.tokenizer.encode(BAD, add_special_tokens=False)
    runner = live.engine.executor.runner

    def hook(seqs):  # the poisoned prompt's prefill
        if any(s.num_computed == 0 and list(s.token_ids[:len(bad_ids)]) == bad_ids
               for s in seqs):
            raise RuntimeError("injected fault")

    runner.fault_hook = hook
    try:
        async def bad():
            await asyncio.sleep(0.3)  # the healthy streams are decoding by now
            return await client.post("/generate", json={
                "inputs": BAD, "parameters": {"max_new_tokens": 8}})

        *texts, resp = await asyncio.gather(*(_stream_text(client, p) for p in HEALTHY), bad())
    finally:
        runner.fault_hook = None
    assert texts == alone
    assert resp.status_code >= 400
    body = resp.json()
    assert "injected fault" in body["error"], body
    await live.assert_idle_and_leak_free()


@pytest.mark.parametrize("path,body", [
    ("/generate", {"inputs": "Hello", "parameters": {"do_sample": True, "temperature": 1e-300,
                                                      "max_new_tokens": 6}}),
    ("/v1/completions", {"model": None, "prompt": "Hello", "max_tokens": 6,
                         "repetition_penalty": 1e-300}),
    ("/v1/completions", {"model": None, "prompt": "Hello", "max_tokens": 6,
                         "repetition_penalty": 1e300, "temperature": 0.7, "seed": 3}),
])
async def test_extreme_sampling_parameters_beside_healthy_streams(live, client, path, body):
    if "model" in body:
        body = {**body, "model": live.engine.model_name}
    alone = await _stream_text(client, HEALTHY[0])
    healthy, resp = await asyncio.gather(_stream_text(client, HEALTHY[0]),
                                         client.post(path, json=body))
    assert healthy == alone
    assert resp.status_code < 500, resp.text  # a clean answer or a clean 4xx, never a 500
    if resp.status_code == 200:
        data = resp.json()
        ids = data.get("details", {}).get("generated_tokens") if path == "/generate" else None
        assert ids is None or ids <= 6
    await live.assert_idle_and_leak_free()
