"""A real server on a real socket with the real default model, shared by the session.

The engine runs in fp32 (greedy outputs comparable across batch compositions) with a
small block size, so tests exercise many blocks; the HTTP server listens on an
ephemeral loopback port in the test session's event loop, so tests can also look at
the engine directly (the leak invariant: idle engine => every KV block free).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tokenserve.config.tree import EngineConfig
from tokenserve.engine.engine import AsyncEngine
from tokenserve.server.app import serve


async def hang_up_mid_stream(url: str, path: str, body: dict, sep: bytes, after: int) -> None:
    """Stream ``body`` to ``path`` (status 200) and close the connection once ``after``
    ``sep``-framed events have come."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c, \
            c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        got = 0
        async for chunk in r.aiter_bytes():
            got += chunk.count(sep)
            if got >= after:
                break  # leaving the block closes the connection mid-stream


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
        await hang_up_mid_stream(self.url, path, body, sep, after)
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


# ---------------------------------------------------------------------- {mixed, pd}

#: the ``live`` engine's settings as ``tokenserve serve`` flags: a P and a D serving with
#: them give the same greedy tokens (batch invariance, fp32) as the in-process server.
LIVE_FLAGS = ("--dtype", "float32", "--block-size", "16", "--kv-cache-bytes",
              str(256 << 20), "--max-batch-size", "32", "--max-num-batched-tokens", "2048")


@dataclass
class PdPair:
    """1 P + 1 D behind a coordinator, child processes (tests/integration/pd_cluster.py)."""

    p: Any
    d: Any
    coord: Any

    def assert_leak_free(self) -> None:
        self.p.assert_leak_free()
        self.d.assert_leak_free()

    def aborted(self) -> float:
        """Requests P and D ended because their client went away:
        ``request_disconnected_total`` (a disconnect, or the coordinator's stopInfer when
        its client left; a hand-off is a success on P)."""
        total = 0.0
        for inst in (self.p, self.d):
            text = httpx.get(inst.url + "/metrics", timeout=10).text
            total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("request_disconnected_total"))
        return total


@pytest.fixture(scope="session")
def pd_pair(tmp_path_factory):
    """A P and a D with :data:`LIVE_FLAGS` and a coordinator in front, for the ``[pd]``
    variant of every family test (started on first use, once per session)."""
    from tests.integration.pd_cluster import Proc, coordinator, free_port

    tmp = tmp_path_factory.mktemp("pd_pair")

    def inst(name: str, role: str) -> Proc:
        port = free_port()
        return Proc(name, ["serve", "--port", str(port), *LIVE_FLAGS, "--role", role], port,
                    tmp / f"{name}.log")

    p, d = inst("pair_p", "prefill"), inst("pair_d", "decode")
    coord = coordinator(tmp, [p], [d], name="pair_coord")
    procs = (p, d, coord)
    try:
        for proc in procs:
            proc.start()
        p.wait_ready()
        d.wait_ready()
        coord.wait_ready("/v1/health")
        yield PdPair(p, d, coord)
    finally:
        for proc in reversed(procs):
            proc.stop()


@dataclass
class Target:
    """The server a family test talks to: ``mixed`` (the in-process ``live`` server) or
    ``pd`` (:class:`PdPair`'s coordinator). Every test of a family runs against both and
    must pass both ways (issue 22: PD is a drop-in for one server).

    ``engine`` is the in-process engine in both cases, for what does not depend on which
    server answers (tokenizer, model name, configuration: the PD instances serve the same
    model with the same settings); engine *state* is read through the methods here."""

    kind: str
    url: str
    live: LiveServer
    pair: PdPair | None = None

    @property
    def engine(self) -> AsyncEngine:
        return self.live.engine

    def chat_ids(self, user: str) -> list[int]:
        return self.live.chat_ids(user)

    async def assert_idle_and_leak_free(self) -> None:
        """Nothing running and every KV block free (PD: on P and on D)."""
        if self.pair is None:
            await self.live.assert_idle_and_leak_free()
        else:
            await asyncio.to_thread(self.pair.assert_leak_free)

    async def aborted(self) -> float:
        """Requests ended by an abort so far (PD: P's and D's disconnected requests)."""
        if self.pair is None:
            return self.engine.stats().finished_by_reason.get("abort", 0)
        return await asyncio.to_thread(self.pair.aborted)

    async def aborted_at_least(self, n: float, timeout: float = 30.0) -> float:
        """:meth:`aborted`, once it reaches ``n`` (PD: the instances count a stopped
        request when its handler ends, after the coordinator's stopInfer) or after
        ``timeout`` seconds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (got := await self.aborted()) < n and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
        return got

    async def disconnect_mid_stream(self, path: str, body: dict, sep: bytes = b"\n\n",
                                    after: int = 3) -> None:
        """Stream ``body`` to ``path``, hang up after ``after`` events, then assert the
        request was aborted (exactly one) and no KV block is held."""
        if self.pair is None:
            await self.live.disconnect_mid_stream(path, body, sep, after)
            return
        before = await self.aborted()
        await hang_up_mid_stream(self.url, path, body, sep, after)
        await self.assert_idle_and_leak_free()
        assert await self.aborted_at_least(before + 1) == before + 1


def mixed_only(server: Target, reason: str) -> None:
    """Skip the ``[pd]`` variant of a test, saying why (shown by ``pytest -rs``)."""
    if server.kind == "pd":
        pytest.skip(f"mixed server only: {reason}")


@pytest.fixture(params=["mixed", "pd"])
def server(request, live):
    """Each family test once per kind of server: ``[mixed]`` and ``[pd]`` (:class:`Target`)."""
    if request.param == "mixed":
        return Target("mixed", live.url, live)
    pair = request.getfixturevalue("pd_pair")
    return Target("pd", pair.coord.url, live, pair)


@pytest_asyncio.fixture(loop_scope="session")
async def server_client(server):
    """An httpx client of :func:`server`."""
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
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
    from tests.integration.pd_cluster import KV_TOKEN_BYTES, instance

    tmp = tmp_path_factory.mktemp("pd")
    procs = {
        "p": instance("p", tmp, "--role", "prefill"),
        "d": instance("d", tmp, "--role", "decode"),
        "d2": instance("d2", tmp, "--role", "decode"),
        "tiny": instance("tiny", tmp, "--role", "decode", kv_bytes=24 * 16 * KV_TOKEN_BYTES),
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
