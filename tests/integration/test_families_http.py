"""Every served family over HTTP: a tiny random model of the family (tests/families.py),
served by a real engine on a real socket at fp32, answers ``/infer_token`` with the greedy
token ids transformers' own ``generate`` gives, for four prompts sent at once (so each
request shares its steps with the others: batch invariance on the real path), and leaves
every KV block free; at the default bfloat16 (int8 KV cache) a request's tokens are the same
alone and batched.

The feature-level negative controls are in tests/unit/test_families.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import httpx
import pytest
import torch

from tests.families import FAMILIES, build, hf_greedy
from tokenserve.config.tree import EngineConfig
from tokenserve.engine.engine import AsyncEngine
from tokenserve.server.app import serve

pytestmark = pytest.mark.asyncio(loop_scope="session")

NEW = 12
EOS = 2


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (5, 9, 14, 17)]


@contextlib.asynccontextmanager
async def _served(model_dir, dtype: str):
    """(engine, client) of a server on a loopback port; on exit, asserts the leak invariant
    (idle engine: every KV block free) and stops it."""
    cfg = EngineConfig(model=str(model_dir), dtype=dtype, device="cpu", block_size=4,
                       kv_cache_bytes=8 << 20, max_batch_size=8, max_num_batched_tokens=64)
    engine = await asyncio.to_thread(AsyncEngine.build, cfg)
    await engine.start()
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(engine, "127.0.0.1", 0, started=started))
    server = await started
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.ports[0]}",
                                     timeout=120) as client:
            yield engine, client
        await engine.wait_idle(timeout=30)
        st = engine.stats()
        assert st.num_free_blocks == st.num_blocks, "KV blocks leaked"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await engine.stop()


async def _greedy(client: httpx.AsyncClient, ids: list[int]) -> list[int]:
    r = await client.post("/infer_token", json={
        "input_id": ids, "parameters": {"max_new_tokens": NEW, "do_sample": False,
                                        "details": True}})
    assert r.status_code == 200, r.text
    return r.json()["details"]["generated_token_ids"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_greedy_over_http_equals_transformers(family, tmp_path):
    hf = build(family, tmp_path)
    prompts = _prompts()
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    async with _served(tmp_path, "float32") as (_, client):
        got = await asyncio.gather(*(_greedy(client, p) for p in prompts))
    for ours, ref in zip(got, expected):
        # ours stops at EOS (transformers was told not to): compare up to it
        assert ours == ref[:len(ours)], family
        assert len(ours) == NEW or ours[-1] == EOS, family


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_moe", "phi3", "mistral", "olmo2"])
async def test_bf16_tokens_do_not_depend_on_the_batch(family, tmp_path):
    """At the default bfloat16 with the int8 KV cache, each request's greedy tokens are the
    same alone and among others (batch invariance through windows, partial rotary, q/k
    norms, post-norms and experts; the batched requests choose overlapping experts)."""
    build(family, tmp_path)
    prompts = _prompts()
    async with _served(tmp_path, "bfloat16") as (engine, client):
        assert engine.executor.runner.kv_dtype == torch.int8
        alone = [await _greedy(client, p) for p in prompts]
        together = await asyncio.gather(*(_greedy(client, p) for p in prompts))
    assert list(together) == alone, family


async def test_sliding_window_model_holds_window_sized_kv_on_a_long_generation(tmp_path):
    """Mistral (a window on every layer): over a 160-token generation the request holds
    about a window's worth of KV blocks (blocks out of every future window go back to the
    pool and are reused by a request that starts while it decodes), and both requests'
    tokens are still transformers'."""
    from tests.families import WINDOW

    hf = build("mistral", tmp_path)
    prompt, other = _prompts()[1], _prompts()[3]
    n = 160
    expected = hf_greedy(hf, prompt, n)
    bound = math.ceil(WINDOW / 4) + 2  # block_size 4: the window, misaligned, + the next token
    async with _served(tmp_path, "float32") as (engine, client):
        peak = 0

        async def watch():
            nonlocal peak
            while True:
                st = engine.stats()
                peak = max(peak, st.num_blocks - st.num_free_blocks)
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())

        async def later_short():  # runs while the long one decodes, on blocks it gave back
            await asyncio.sleep(0.3)
            return await _greedy(client, other)

        r, got_other = await asyncio.gather(client.post("/infer_token", json={
            "input_id": prompt, "parameters": {"max_new_tokens": n, "do_sample": False,
                                               "details": True}}), later_short())
        watcher.cancel()
        ours = r.json()["details"]["generated_token_ids"]
    assert ours == expected[:len(ours)] and (len(ours) == n or ours[-1] == EOS)
    assert got_other == hf_greedy(hf, other, NEW)[:len(got_other)]
    assert 0 < peak <= 2 * bound, (peak, bound)  # both requests, each window-sized
