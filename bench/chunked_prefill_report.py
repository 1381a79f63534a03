"""Short vs long prompts' TTFT from `tokenserve bench` JSON files (per-request records).

    python bench/chunked_prefill_report.py a.json b.json [--short-max 128 256] [--long-min 512]

Prints one markdown table row per file and short threshold: TTFT p50/p90/p99 of the
requests whose prompt has at most ``--short-max`` tokens, TTFT p50/p99 of those with
more than ``--long-min``, ITL p50/p99 and output throughput. The "prefill" column
(whole or chunked) is read from the command stored in each file, so the files may come
in any order. Used for the chunked-prefill comparison in bench/README.md.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def rows(path: str, short_max: list[int], long_min: int) -> list[str]:
    with open(path) as f:
        doc = json.load(f)
    level = doc["levels"][0]
    recs = [r for r in level["records"]["ours"] if r["ok"]]
    mode = "whole" if "no-enable-chunked-prefill" in doc["meta"]["command"] else "chunked"
    long_ = np.array([r["ttft"] * 1e3 for r in recs if r["input_len"] > long_min])
    long_cell = (f"{np.percentile(long_, 50):.0f} / {np.percentile(long_, 99):.0f} "
                 f"(n={len(long_)})" if len(long_) else "- (n=0)")
    itl = np.array([x * 1e3 for r in recs for x in r["itl"]])
    out = []
    for m in short_max:
        short = np.array([r["ttft"] * 1e3 for r in recs if r["input_len"] <= m])
        p50, p90, p99 = np.percentile(short, [50, 90, 99])
        out.append(
            f"| {path.rsplit('/', 1)[-1]} | {mode} | <= {m} (n={len(short)}) | "
            f"{p50:.0f} / {p90:.0f} / **{p99:.0f}** | {long_cell} | "
            f"{np.percentile(itl, 50):.0f} / {np.percentile(itl, 99):.0f} | "
            f"{level['ours']['output_throughput']:.1f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--short-max", type=int, nargs="+", default=[128],
                    help="prompt length (tokens) up to which a request counts as short; "
                         "several values give one row each (default 128)")
    ap.add_argument("--long-min", type=int, default=512,
                    help="prompt length (tokens) above which a request counts as long")
    a = ap.parse_args()
    print(f"| run | prefill | short prompts | short TTFT p50 / p90 / p99 ms "
          f"| long (> {a.long_min}) TTFT p50 / p99 ms | ITL p50 / p99 ms | output tok/s |")
    print("|---|---|---|---|---|---|---|")
    for p in a.files:
        print("\n".join(rows(p, a.short_max, a.long_min)))


if __name__ == "__main__":
    main()
