"""Tensor parallelism on the real path (issue 41): ``tokenserve serve --tensor-parallel-size 2``
(two processes, gloo) on the default model, against the one-process ``live`` server with the
same settings (fp32), through every API family; batch invariance at TP = 2; a rank killed;
two "hosts" (``--nnodes 2``) answering through one HTTP port."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import LIVE_FLAGS
from tokenserve.loadgen.server import ChildServer, free_port

TOOL = Path(__file__).parents[2] / "tools" / "invariance_check.py"
_spec = importlib.util.spec_from_file_location("invariance_check", TOOL)
ic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ic)

MAX_NEW = 24
#: the tests that ask the in-process `live` server run on its loop
on_live_loop = pytest.mark.asyncio(loop_scope="session")


class TpServer(ChildServer):
    name = "tp"

    def __init__(self, *args: str) -> None:
        super().__init__()
        self.cmd = [sys.executable, "-m", "tokenserve.cli", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port), *LIVE_FLAGS, *args]


@pytest.fixture(scope="module")
def tp2():
    server = TpServer("--tensor-parallel-size", "2")
    server.start()
    yield server
    server.stop()


def _children(pid: int) -> list[int]:
    """Child processes of ``pid``, whichever of its threads started them."""
    return sorted(int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                  for c in (t / "children").read_text().split())


async def _answers(url: str) -> dict:
    reqs = ic.target_requests(MAX_NEW)
    return await ic.run_alone(url, reqs)


@on_live_loop
async def test_greedy_and_seeded_answers_equal_one_process(tp2, live):
    """The invariance check's prompts (greedy and seeded, ``ignore_eos``): the same text as
    one process; each token's logprob within 1e-2 (the all-reduce adds two fp32 partial
    sums where one process's GEMM sums the whole row: fp32 rounding only)."""
    one = await _answers(live.url)
    two = await _answers(tp2.url)
    for label, (text, toks, lps) in one.items():
        t2, toks2, lps2 = two[label]
        assert (t2, toks2) == (text, toks), label
        assert max(abs(a - b) for a, b in zip(lps, lps2)) < 1e-2, label
    assert "2 ranks joined" in tp2.log_tail(200_000)


@on_live_loop
async def test_alone_equals_among_63_others_at_two_ranks(tp2):
    """The invariance check's short prompt, greedy and seeded, alone and while 63 random
    requests decode (smaller than the tool's crowd: 3-30 words, 8-40 new tokens each, so
    the test stays quick on 2 cores)."""
    reqs = [r for r in ic.target_requests(MAX_NEW) if r[0].startswith("short")]
    alone = await ic.run_alone(tp2.url, reqs)
    rng = random.Random(7)
    among = {}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=72)) as c:
        for label, body in reqs:
            crowd = [asyncio.create_task(ic.generate(
                c, tp2.url, {**ic.neighbour(rng), "max_tokens": rng.randint(8, 40),
                             "prompt": " ".join(rng.choices(ic.WORDS, k=rng.randint(3, 30)))}))
                for _ in range(63)]
            await asyncio.sleep(0.5)  # the crowd is admitted and decoding
            among[label] = await ic.generate(c, tp2.url, body)
            await asyncio.gather(*crowd)
    assert among == alone


@pytest.mark.parametrize("path,body,field", [
    ("/infer", {"inputs": "Name a colour.", "stream": False,
                "parameters": {"max_new_tokens": 8, "do_sample": False}}, "generated_text"),
    ("/generate", {"inputs": "Name a colour.",
                   "parameters": {"max_new_tokens": 8, "do_sample": False}}, "generated_text"),
    ("/generate", {"prompt": "Name a colour.", "max_tokens": 8, "temperature": 0}, "text"),
    ("/v2/models/{model}/generate", {"text_input": "Name a colour.",
                                     "parameters": {"max_new_tokens": 8}}, "text_output"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}],
                              "max_tokens": 8, "temperature": 0}, "choices"),
])
@on_live_loop
async def test_every_family_answers_as_one_process(tp2, live, path, body, field):
    async with httpx.AsyncClient(timeout=120) as c:
        model = (await c.get(live.url + "/v1/models")).json()["data"][0]["id"]
        path = path.format(model=model)
        if "messages" in body:
            body = {**body, "model": model}
        got = [await c.post(url + path, json=body) for url in (live.url, tp2.url)]
    assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
    one, two = (r.json() for r in got)
    if field == "choices":
        one, two = (x["choices"][0]["message"]["content"] for x in (one, two))
    elif isinstance(one, list):  # vLLM's text list / TGI's list form
        one, two = one[0][field], two[0][field]
    else:
        one, two = one[field], two[field]
    assert one == two and one


def test_a_dead_rank_takes_the_server_down():
    server = TpServer("--tensor-parallel-size", "2")
    server.start()
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        ranks = _children(server.proc.pid)
        assert len(ranks) == 1, ranks
        t0 = time.monotonic()
        subprocess.run(["kill", "-9", str(ranks[0])], check=True)
        status = server.proc.wait(10)
        assert status != 0 and time.monotonic() - t0 < 10
        assert "rank 1 is gone" in server.log_tail()
    finally:
        server.stop()


@on_live_loop
async def test_two_nodes_answer_through_one_port(live):
    """Node 0 serves HTTP and rank 0; node 1 (another ``serve``, no HTTP) runs rank 1; the
    rendezvous is node 0's ``--dist-init-addr``."""
    body = {"prompt": ic.SHORT, "max_tokens": 8, "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as c:
        model = (await c.get(live.url + "/v1/models")).json()["data"][0]["id"]
        want = (await c.post(live.url + "/v1/completions", json={**body, "model": model})
                ).json()["choices"][0]["text"]
    assert await asyncio.to_thread(_two_nodes, body | {"model": model}) == want


def _two_nodes(body: dict) -> str:
    """Node 1 then node 0 started, ``body`` answered through node 0; both stopped."""
    addr = f"127.0.0.1:{free_port()}"
    common = ("--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr", addr)
    cpus = sorted(os.sched_getaffinity(0))  # one "host" per CPU, as two hosts would be
    node1_log = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the process)
    node1 = subprocess.Popen([sys.executable, "-m", "tokenserve.cli", "serve", *LIVE_FLAGS,
                              *common, "--node-rank", "1", "--cpu-binding", str(cpus[-1])],
                             stdout=node1_log, stderr=subprocess.STDOUT)
    node0 = TpServer(*common, "--node-rank", "0", "--cpu-binding", str(cpus[0]))
    try:
        node0.start()
        assert _children(node0.proc.pid) == []  # rank 1 is node 1's
        return httpx.post(node0.url + "/v1/completions", json=body,
                          timeout=120).json()["choices"][0]["text"]
    finally:
        node0.stop()
        try:
            assert node1.wait(15) == 0  # rank 0 stopped it
        finally:
            if node1.poll() is None:
                node1.send_signal(signal.SIGKILL)
                node1.wait()
            node1_log.close()
