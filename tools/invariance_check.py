"""Batch invariance of a served model over HTTP (issue 20's equality checks, on the server a
user runs): the generated tokens, text and logprobs of a request, greedy and seeded
sampled, must be identical

* alone vs among 63 other concurrent requests (random prompts, lengths, sampling),
* with whole-prompt prefill vs chunked prefill (a second server with a small token budget
  per step, so a long prompt takes several steps),
* on a prefix-cache miss vs a hit (the same prompt sent again to a prefix-caching server,
  and the same prompt on a server with the prefix cache off).

It starts the servers itself (``tokenserve serve`` on free loopback ports, one at a time,
each with the same ``--server-args``, e.g. the default or ``--quantization none``) and asks
OpenAI's ``POST /v1/completions`` with ``ignore_eos`` (every answer has all its tokens) and
``logprobs``, comparing the tokens, the text and each token's logprob (the fp32 logits, as
printed):

    python tools/invariance_check.py [--server-args "..."] [--max-new-tokens 64]

Prints one line per comparison and the log line naming what each layer kind ran on; exit
status 1 when any comparison differs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
from typing import Any

import httpx

from tokenserve.loadgen.server import ChildServer, cpu_summary

LONG = ("You are a careful assistant. Read the following notes and then answer. The lighthouse "
        "on the northern cape was built in 1871 from granite quarried on the island itself. Its "
        "keeper kept a log of every ship, every storm and every visitor, and the log survives in "
        "the town museum, where the pages from the winter of 1903 describe a fog that lasted "
        "eleven days. Question: write a long story about the keeper and that fog, with dialogue.")
SHORT = "Name three colours of the sea at dawn."
WORDS = ("river", "stone", "lamp", "harbour", "winter", "bread", "music", "engine", "garden",
         "letter", "window", "mountain", "copper", "signal", "orchard", "lantern", "cipher", "meadow")


class Served(ChildServer):
    """``tokenserve serve`` with ``args`` on a free port."""

    name = "invariance"

    def __init__(self, args: list[str]) -> None:
        super().__init__()
        self.cmd = [sys.executable, "-m", "tokenserve.cli", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port), "--log-level", "INFO", *args]

    def gemm_line(self) -> str:
        lines = [ln for ln in self.log_tail(200_000).splitlines() if "GEMM" in ln]
        return lines[-1].split("GEMM", 1)[1].strip(" :") if lines else "(no GEMM line in the log)"


def target_requests(max_new: int) -> list[tuple[str, dict[str, Any]]]:
    """(label, OpenAI completions body without ``model``) of the requests compared."""
    out = []
    for name, text in (("long", LONG), ("short", SHORT)):
        base = {"prompt": text, "max_tokens": max_new, "ignore_eos": True, "logprobs": 1}
        out.append((f"{name}/greedy", {**base, "temperature": 0}))
        out.append((f"{name}/seeded", {**base, "temperature": 0.9, "top_p": 0.95, "seed": 1234}))
    return out


def neighbour(rng: random.Random) -> dict[str, Any]:
    """A random other request: prompt of 3-120 words, 16-160 new tokens, greedy or sampled."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))
    body: dict[str, Any] = {"prompt": text, "max_tokens": rng.randint(16, 160), "ignore_eos": True,
                            "temperature": 0}
    if rng.random() < 0.5:
        body.update(temperature=rng.uniform(0.5, 1.2), seed=rng.randint(0, 2**31))
    return body


Answer = tuple[str, list[str], list[float]]


async def generate(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Answer:
    """(text, tokens, token logprobs) of one completion."""
    model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
    r = await client.post(url + "/v1/completions", json={"model": model, **body}, timeout=600)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    lp = choice.get("logprobs") or {}
    return choice["text"], lp.get("tokens") or [], lp.get("token_logprobs") or []


async def run_alone(url: str, reqs) -> dict[str, Answer]:
    async with httpx.AsyncClient() as c:
        return {label: await generate(c, url, body) for label, body in reqs}


async def run_among(url: str, reqs, others: int, seed: int) -> dict[str, Answer]:
    """Each target request sent while ``others`` random requests are in flight."""
    rng = random.Random(seed)
    got: dict[str, Answer] = {}
    limits = httpx.Limits(max_connections=others + 8)
    async with httpx.AsyncClient(limits=limits) as c:
        for label, body in reqs:
            crowd = [asyncio.create_task(generate(c, url, neighbour(rng))) for _ in range(others)]
            await asyncio.sleep(0.5)  # the crowd is admitted and decoding
            got[label] = await generate(c, url, body)
            await asyncio.gather(*crowd)
    return got


def compare(name: str, ref: dict[str, Answer], other: dict[str, Answer]) -> bool:
    ok = True
    for label, (text, toks, lps) in ref.items():
        o_text, o_toks, o_lps = other[label]
        same = (text, toks, lps) == (o_text, o_toks, o_lps)
        ok &= same
        first = next((i for i, (a, b) in enumerate(zip(toks, o_toks, strict=False)) if a != b), None)
        print(f"  {'same' if same else 'DIFFERENT'}  {name:<44} {label:<14} {len(toks)} tokens"
              + ("" if same else f" (first token difference at {first}; logprobs "
                 f"{'equal' if lps == o_lps else 'differ'})"), flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-args", default="", help="extra `tokenserve serve` arguments")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--others", type=int, default=63, help="concurrent neighbours")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    base = shlex.split(args.server_args)
    reqs = target_requests(args.max_new_tokens)
    print(cpu_summary(), flush=True)

    def with_server(extra: list[str], fn):
        srv = Served(base + extra)
        srv.start()
        try:
            return fn(srv.url), srv.gemm_line()
        finally:
            srv.stop()

    ok = True
    # 1. the server as given: alone (prefix-cache miss), again (hit), among 63 others
    def default_runs(url: str):
        alone = asyncio.run(run_alone(url, reqs))
        again = asyncio.run(run_alone(url, reqs))
        among = asyncio.run(run_among(url, reqs, args.others, args.seed))
        return alone, again, among
    (alone, again, among), gemm = with_server([], default_runs)
    print(f"server {shlex.join(base) or '(defaults)'}: GEMM {gemm}")
    ok &= compare("alone vs prefix-cache hit (sent again)", alone, again)
    ok &= compare(f"alone vs among {args.others} others", alone, among)
    # 2. no prefix cache, no chunking: the plain reference
    plain, gemm = with_server(["--no-enable-prefix-caching", "--no-enable-chunked-prefill"],
                              lambda url: asyncio.run(run_alone(url, reqs)))
    print(f"server + --no-enable-prefix-caching --no-enable-chunked-prefill: GEMM {gemm}")
    ok &= compare("alone vs no prefix cache, whole prefill", alone, plain)
    # 3. chunked prefill: at most 16 prompt tokens per step
    chunked, gemm = with_server(["--no-enable-prefix-caching", "--enable-chunked-prefill",
                                 "--max-num-batched-tokens", "16"],
                                lambda url: asyncio.run(run_alone(url, reqs)))
    print(f"server + chunked prefill, 16 tokens per step: GEMM {gemm}")
    ok &= compare("whole prefill vs chunked (16 tokens a step)", plain, chunked)
    print("ALL SAME" if ok else "SOME DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
