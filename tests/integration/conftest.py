"""A real server on a real socket with the real default model, shared by the session.

The engine runs in fp32 (greedy outputs comparable across batch compositions) with a
small block size, so tests exercise many blocks; the HTTP server listens on an
ephemeral loopback port in the test session's event loop, so tests can also look at
the engine directly (the leak invariant: idle engine => every KV block free).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
import pytest
import pytest_asyncio

from tokenserve.config.tree import EngineConfig
from tokenserve.engine.engine import AsyncEngine
from tokenserve.server.app import serve


@dataclass
class LiveServer:
    engine: AsyncEngine
    url: str

    def chat_ids(self, user: str) -> list[int]:
        """Token ids of a one-turn ChatML prompt ready for the assistant's answer."""
        tok = self.engine.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": user}],
                                       add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    async def disconnect_mid_stream(self, path: str, body: dict, sep: bytes = b"\n\n",
                                    after: int = 3) -> None:
        """Stream ``body`` to ``path``, hang up after ``after`` events (``sep``-framed),
        then assert the engine aborted exactly that request and holds no KV blocks."""
        aborted_before = self.engine.stats().finished_by_reason.get("abort", 0)
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as c, \
                c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            got = 0
            async for chunk in r.aiter_bytes():
                got += chunk.count(sep)
                if got >= after:
                    break
        # leaving the block closes the connection mid-stream
        await self.assert_idle_and_leak_free()
        assert self.engine.stats().finished_by_reason.get("abort", 0) == aborted_before + 1

    async def assert_idle_and_leak_free(self) -> None:
        await self.engine.wait_idle(timeout=30)
        st = self.engine.stats()
        assert st.num_running == 0 and st.num_waiting == 0
        assert st.num_free_blocks == st.num_blocks, "KV blocks leaked"
        assert self.engine.executor.runner.states == {}, "sampling state leaked"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def live():
    cfg = EngineConfig(dtype="float32", device="cpu", block_size=16,
                       kv_cache_bytes=256 << 20, max_batch_size=32,
                       max_num_batched_tokens=2048)
    engine = await asyncio.to_thread(AsyncEngine.build, cfg)
    await engine.start()
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(engine, "127.0.0.1", 0, started=started))
    server = await started
    yield LiveServer(engine, f"http://127.0.0.1:{server.ports[0]}")
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await engine.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def client(live):
    async with httpx.AsyncClient(base_url=live.url, timeout=120) as c:
        yield c


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def pd(tmp_path_factory):
    """Real PD processes (tests/integration/pd_cluster.py), shared by the PD tests: a
    prefill ``p``, decode ``d`` and ``d2``, a decode ``tiny`` whose KV cache holds 24
    blocks (long generations get evicted) and a ``mixed`` instance for reference outputs.
    Stopped at the end. (Coordinators are per module: a decode instance serves one
    ``/dresult`` consumer.)"""
    from tests.integration.pd_cluster import instance

    tmp = tmp_path_factory.mktemp("pd")
    procs = {
        "p": instance("p", tmp, "--role", "prefill"),
        "d": instance("d", tmp, "--role", "decode"),
        "d2": instance("d2", tmp, "--role", "decode"),
        "tiny": instance("tiny", tmp, "--role", "decode", kv_bytes=24 * 16 * 23040),
        "mixed": instance("mixed", tmp),
    }
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()
