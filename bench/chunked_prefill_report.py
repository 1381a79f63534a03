"""Short vs long prompts' TTFT from `tokenserve bench` JSON files (per-request records).

    python bench/chunked_prefill_report.py [--short-max 256 512] a.json b.json

Prints one markdown table row per file and threshold: TTFT p50/p90/p99 of the requests
whose prompt has at most ``--short-max`` tokens, TTFT p99 of all requests, ITL p50/p99
and output throughput. Used for the chunked-prefill comparison in bench/README.md.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def rows(path: str, short_max: list[int]) -> list[str]:
    with open(path) as f:
        doc = json.load(f)
    level = doc["levels"][0]
    recs = [r for r in level["records"]["ours"] if r["ok"]]
    summary = level["ours"]
    args = doc["meta"]["command"]
    mode = "whole" if "no-enable-chunked-prefill" in args else "chunked"
    ttft_all = np.array([r["ttft"] * 1e3 for r in recs])
    itl = np.array([x * 1e3 for r in recs for x in r["itl"]])
    out = []
    for m in short_max:
        short = np.array([r["ttft"] * 1e3 for r in recs if r["input_len"] <= m])
        p50, p90, p99 = np.percentile(short, [50, 90, 99])
        out.append(
            f"| {path.rsplit('/', 1)[-1]} | {mode} | <= {m} (n={len(short)}) | "
            f"{p50:.0f} / {p90:.0f} / **{p99:.0f}** | {np.percentile(ttft_all, 99):.0f} | "
            f"{np.percentile(itl, 50):.0f} / {np.percentile(itl, 99):.0f} | "
            f"{summary['output_throughput']:.1f} | {summary['request_throughput']:.2f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--short-max", type=int, nargs="+", default=[256, 512],
                    help="prompt length (tokens) up to which a request counts as short")
    a = ap.parse_args()
    print("| run | prefill | short prompts | short TTFT p50 / p90 / p99 ms | all TTFT p99 ms "
          "| ITL p50 / p99 ms | output tok/s | req/s |")
    print("|---|---|---|---|---|---|---|---|")
    for p in a.files:
        print("\n".join(rows(p, a.short_max)))


if __name__ == "__main__":
    main()
