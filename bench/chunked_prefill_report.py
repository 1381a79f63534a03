"""Short vs long prompts' TTFT and ITL from `tokenserve bench` JSON files (per-request
records): ``python bench/chunked_prefill_report.py a.json b.json``. Used for the
chunked-prefill comparison in bench/README.md."""

import json, sys, numpy as np


def stats(path, short_max=128):
    recs = json.load(open(path))["levels"][0]["records"]["ours"]
    short = [r["ttft"]*1e3 for r in recs if r["ok"] and r["input_len"] <= short_max]
    long_ = [r["ttft"]*1e3 for r in recs if r["ok"] and r["input_len"] > short_max]
    itl = [x*1e3 for r in recs if r["ok"] for x in r["itl"]]
    return (len(short), np.percentile(short, 50), np.percentile(short, 99), np.percentile(long_, 99),
            np.percentile(itl, 50), np.percentile(itl, 99), max(r["input_len"] for r in recs))


for p in sys.argv[1:]:
    n, s50, s99, l99, i50, i99, mx = stats(p)
    print(f"{p}: short(<=128 tok) n={n} TTFT p50 {s50:.0f} p99 {s99:.0f} ms | long TTFT p99 {l99:.0f} | ITL p50 {i50:.0f} p99 {i99:.0f} ms | max prompt {mx}")
