"""Soak a PD cluster through the coordinator (issue 22): streamed requests of every
family, a share of clients that hang up early, one decode instance killed (-9) and
restarted in the middle; then every KV block must be free and RSS flat.

    PYTHONPATH=. python tools/pd_soak.py [--requests 400] [--conc 8] [--disconnect 0.3]
                                         [--tokens 32]

Measured 2026-12-02 (``--requests 420 --tokens 48``, 2 shared cores): 302 complete, 118
hung up early (1-3 chunks), 0 hangs, 0 5xx, 0 ERROR lines, 3 requests recomputed after the
kill, every block free on P, d1 and d2, RSS after warm-up -> end: P 1033 -> 1033 MB, d1
1031 -> 1033 MB, coordinator 46 -> 46 MB; 164 s.

Cluster: 1 P + 2 D + the coordinator, real processes on 127.0.0.1 (the default model).
After ``requests // 2`` requests have been sent, D ``d2`` is killed; it is restarted on
the same port 3 s later, and the coordinator re-links it by itself. Reported: outcomes
by status, hangs (no answer within ``--timeout``), 5xx answers, streams ended by an error
chunk, RSS of every process after the warm-up and at the end, the leak check.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.pd_cluster import coordinator, instance

MODEL = "m"


def families(model: str, n: int) -> list[tuple[str, str, dict]]:
    """One streamed request per family (name, path, body), ``n`` new tokens."""
    chat = [{"role": "user", "content": "Tell me about rivers."}]
    return [
        ("mindie", "/infer", {"inputs": "Rivers are", "stream": True,
                              "parameters": {"max_new_tokens": n}}),
        ("tgi", "/generate_stream", {"inputs": "Rivers are",
                                     "parameters": {"max_new_tokens": n}}),
        ("vllm", "/generate", {"prompt": "Rivers are", "stream": True, "max_tokens": n}),
        ("openai-chat", "/v1/chat/completions", {"model": model, "messages": chat,
                                                 "stream": True, "max_tokens": n}),
        ("openai-completions", "/v1/completions", {"model": model, "prompt": "Rivers are",
                                                   "stream": True, "max_tokens": n}),
        ("triton", f"/v2/models/{model}/generate_stream",
         {"text_input": "Rivers are", "parameters": {"max_new_tokens": n}}),
    ]


def one(url: str, path: str, body: dict, hang_up_after: int | None, timeout: float
        ) -> str:
    """Run one request; its outcome: ``200``, ``200-error`` (a stream that ended with an
    error chunk), ``<status>``, ``disconnected``, ``hang`` or ``transport``."""
    try:
        with httpx.stream("POST", url + path, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                return str(r.status_code)
            tail = b""
            for chunks, chunk in enumerate(r.iter_bytes(), 1):
                tail = (tail + chunk)[-400:]
                if hang_up_after is not None and chunks >= hang_up_after:
                    return "disconnected"
            return "200-error" if b'"error"' in tail else "200"
    except httpx.TimeoutException:
        return "hang"
    except httpx.HTTPError:
        return "transport"


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--conc", type=int, default=8)
    ap.add_argument("--disconnect", type=float, default=0.3)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="pd_soak_"))
    p = instance("p", tmp, "--role", "prefill")
    d1 = instance("d1", tmp, "--role", "decode")
    d2 = instance("d2", tmp, "--role", "decode")
    coord = coordinator(tmp, [p], [d1, d2], "--max-retry", "8")
    procs = [p, d1, d2, coord]
    out: dict = {}
    try:
        for x in procs:
            x.start()
        for x in (p, d1, d2):
            x.wait_ready()
        coord.wait_ready("/v1/readiness")
        model = httpx.get(coord.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        fams = families(model, args.tokens)
        plan = [(fams[i % len(fams)],
                 rng.randint(1, 3) if rng.random() < args.disconnect else None)
                for i in range(args.requests)]
        warm = [one(coord.url, *fams[i % len(fams)][1:], None, args.timeout)
                for i in range(12)]
        rss0 = {x.name: rss_kb(x.proc.pid) for x in procs}
        sent = threading.Semaphore(0)
        outcomes: Counter[str] = Counter()
        by_family: dict[str, Counter[str]] = {}
        t0 = time.monotonic()

        def killer() -> None:
            for _ in range(args.requests // 2):
                sent.acquire()
            d2.kill()
            out["d2_killed_at_s"] = round(time.monotonic() - t0, 1)
            time.sleep(3)
            d2.start().wait_ready()
            out["d2_back_at_s"] = round(time.monotonic() - t0, 1)

        def run(item) -> tuple[str, str]:
            (family, path, body), hang = item
            sent.release()
            return family, one(coord.url, path, body, hang, args.timeout)

        kt = threading.Thread(target=killer)
        kt.start()
        with concurrent.futures.ThreadPoolExecutor(args.conc) as pool:
            for family, res in pool.map(run, plan):
                outcomes[res] += 1
                by_family.setdefault(family, Counter())[res] += 1
        kt.join()
        out["wall_s"] = round(time.monotonic() - t0, 1)
        leaks = {}
        for x in (p, d1, d2):
            try:
                x.assert_leak_free(timeout=60)
                leaks[x.name] = "all free"
            except AssertionError as exc:
                leaks[x.name] = str(exc)
        rss1 = {x.name: rss_kb(x.proc.pid) for x in procs}
        log = (tmp / "coordinator.log").read_text()
        out["coordinator_recomputes_after_d_loss"] = log.count("lost, resubmitting")
        out["coordinator_errors_logged"] = log.count(" ERROR ")
        out.update({"requests": args.requests, "warmup": Counter(warm),
                    "outcomes": dict(outcomes), "by_family": {k: dict(v) for k, v in
                                                             by_family.items()},
                    "hangs": outcomes["hang"],
                    "5xx": sum(n for k, n in outcomes.items() if k.startswith("5")),
                    "leaks": leaks,
                    "rss_mb_after_warmup": {k: round(v / 1024) for k, v in rss0.items()},
                    "rss_mb_end": {k: round(v / 1024) for k, v in rss1.items()},
                    "note": "d2's RSS restarts from zero at the kill",
                    "logs": str(tmp)})
    finally:
        for x in procs:
            x.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
