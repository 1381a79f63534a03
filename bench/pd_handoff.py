"""Hand-off cost of PD disaggregation, measured on running P and D instances
(spec/pd_disaggregation.md §5-§8): for prompts of several lengths, the time from sending
a request to P until P's answer (prefill, first token and the hand-off call to D), until
D's first ``data:`` message (D admitted it, pulled P's KV blocks over Mooncake, released
P and ran one decode step), and D's own KV-pull figures from its DEBUG log
(``tokenserve.pd.kv_transfer``: ms, MB/s).

    tokenserve serve --role prefill --port 19001 &
    tokenserve serve --role decode --port 19002 --log-level DEBUG > d.log 2>&1 &
    python bench/pd_handoff.py --prefill 127.0.0.1:19001 --decode 127.0.0.1:19002 --d-log d.log
"""

from __future__ import annotations

import argparse
import re
import statistics
import threading
import time
from pathlib import Path

import httpx

from tokenserve.pd.wire import DresultParser


def _reader(url: str, events: dict[str, float], stop: threading.Event) -> None:
    parser = DresultParser()
    with httpx.stream("GET", url + "/dresult", timeout=httpx.Timeout(60, read=None)) as r:
        for chunk in r.iter_raw():
            now = time.perf_counter()
            for m in parser.feed(chunk):
                if m.kind in ("data", "lastData") and m.req_id not in events:
                    events[m.req_id] = now
            if stop.is_set():
                return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="P's HOST:PORT")
    ap.add_argument("--decode", required=True, help="D's HOST:PORT")
    ap.add_argument("--d-log", type=Path, help="D's log (run with --log-level DEBUG)")
    ap.add_argument("--lengths", default="16,128,512,1024", help="prompt lengths, tokens")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    p, d = f"http://{args.prefill}", f"http://{args.decode}"
    d_host, _, d_port = args.decode.partition(":")
    events: dict[str, float] = {}
    stop = threading.Event()
    threading.Thread(target=_reader, args=(d, events, stop), daemon=True).start()
    time.sleep(0.5)
    n = 0
    print("| prompt tokens | P answer ms (p50) | first D token ms (p50) | hand-off ms |")
    print("|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        answer, first = [], []
        for i in range(args.repeat):
            n += 1
            rid = f"{n:x}"
            ids = [(7 * j + 13 * i + length) % 40000 + 100 for j in range(length)]
            body = {"input_id": ids, "stream": True, "parameters": {"max_new_tokens": 3}}
            t0 = time.perf_counter()
            r = httpx.post(p + "/infer_token", json=body, timeout=60, headers={
                "req-type": "prefill", "req-id": rid, "d-target": f"{d_host};{d_port}"})
            t1 = time.perf_counter()
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 30
            while rid not in events and time.monotonic() < deadline:
                time.sleep(0.001)
            answer.append((t1 - t0) * 1e3)
            first.append((events[rid] - t0) * 1e3)
        a, f = statistics.median(answer), statistics.median(first)
        print(f"| {length} | {a:.1f} | {f:.1f} | {f - a:.1f} |")
    stop.set()
    if args.d_log and args.d_log.exists():
        pulls = re.findall(r"KV pull (\d+) blocks (\d+) B (\d+) segments from \S+: ([\d.]+) ms, "
                           r"(\d+) MB/s", args.d_log.read_text())
        if pulls:
            print("\nD's KV pulls (Mooncake TCP): blocks, bytes, segments, ms, MB/s")
            for b, nbytes, segs, ms, mbs in pulls[-len(pulls):]:
                print(f"  {b:>4} {int(nbytes) / 2**20:8.2f} MiB {segs:>5} {ms:>8} {mbs:>6}")


if __name__ == "__main__":
    main()
