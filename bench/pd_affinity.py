"""Prefix-cache hit rate on P and TTFT with 2 P + 1 D, DIGS load balance vs prefix
affinity (issue 22), in one run on real processes (the default model).

    PYTHONPATH=. python bench/pd_affinity.py [--groups 4] [--per-group 12] [--conc 4]

Workload: ``groups`` shared system prompts (~700 characters each), ``per-group`` chat
requests under each, with a short distinct question, streamed, ``max_tokens`` 8,
``conc`` at a time in a shuffled order. Each policy gets its own coordinator (a D serves
one ``/dresult`` consumer) and its own system prompts (P's prefix cache would otherwise
carry one phase's prompts into the next). Reported per policy: the prompt tokens P looked
up in its prefix cache and found (``all_radix_match_num`` / ``npu_radix_match_hit_num``
deltas over the phase, both Ps together), and client-side TTFT p50 / p90 / mean.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.pd_cluster import coordinator, instance

WORDS = ["river", "mountain", "lantern", "harbour", "copper", "meadow", "signal", "archive", "velvet", "compass", "orchard", "granite", "whisper", "beacon", "tundra", "ember"]


def system_prompt(rng: random.Random) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(110))
    return f"You are a careful assistant. Rules and context follow. {body}."


def counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=30).text

    def one(name: str) -> float:
        m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    return one("all_radix_match_num"), one("npu_radix_match_hit_num")


def ttft(url: str, model: str, system: str, question: str) -> float:
    body = {"model": model, "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        first = None
        for chunk in r.iter_bytes():
            if first is None and b"content" in chunk:
                first = time.perf_counter() - t0
    return first if first is not None else float("nan")


def phase(policy: str, ps, d, tmp: Path, args, seed: int) -> dict:
    rng = random.Random(seed)
    systems = [system_prompt(rng) for _ in range(args.groups)]
    jobs = [(s, f"Question {i}: name one word from the context.")
            for s in systems for i in range(args.per_group)]
    rng.shuffle(jobs)
    coord = coordinator(tmp, ps, [d], "--p-policy", policy, name=f"coord_{policy}").start()
    try:
        coord.wait_ready("/v1/readiness")
        model = httpx.get(coord.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        before = [counters(p.url) for p in ps]
        with concurrent.futures.ThreadPoolExecutor(args.conc) as pool:
            times = list(pool.map(lambda j: ttft(coord.url, model, *j), jobs))
        after = [counters(p.url) for p in ps]
    finally:
        coord.stop()
    looked = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hit = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    times.sort()
    return {"policy": policy, "requests": len(jobs), "hit_rate": hit / looked if looked else 0,
            "looked_up": looked, "hit": hit,
            "ttft_p50_ms": 1e3 * times[len(times) // 2],
            "ttft_p90_ms": 1e3 * times[int(len(times) * 0.9)],
            "ttft_mean_ms": 1e3 * statistics.fmean(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=12)
    ap.add_argument("--conc", type=int, default=4)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pd_affinity_"))
    kv = 256 << 20
    ps = [instance(f"p{i}", tmp, "--role", "prefill", kv_bytes=kv) for i in range(2)]
    d = instance("d", tmp, "--role", "decode", kv_bytes=kv)
    procs = [*ps, d]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        rows = [phase("load", ps, d, tmp, args, 1), phase("affinity", ps, d, tmp, args, 2)]
    finally:
        for p in procs:
            p.stop()
    print(f"{'policy':9} {'reqs':>4} {'hit rate':>8} {'looked up':>9} {'hit':>7} "
          f"{'TTFT p50':>9} {'p90':>8} {'mean':>8}")
    for r in rows:
        print(f"{r['policy']:9} {r['requests']:4d} {r['hit_rate']:8.1%} {r['looked_up']:9.0f} "
              f"{r['hit']:7.0f} {r['ttft_p50_ms']:7.0f}ms {r['ttft_p90_ms']:6.0f}ms "
              f"{r['ttft_mean_ms']:6.0f}ms")
    print(f"logs: {tmp}")


if __name__ == "__main__":
    main()
