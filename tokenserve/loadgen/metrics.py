"""Serving metrics from per-request timelines (pure functions; no I/O, no clocks).

One request's timeline, as measured by a client (seconds since the request was sent)::

    sent            first token        token chunks ...                   last byte
     |-------- TTFT ---->|<- itl[0] ->|<- itl[1] ->| ... |<- itl[-1] ->|
     |<------------------------------- E2E ------------------------------------>|

- TTFT: send -> the first chunk carrying at least one output token.
- ITL: gaps between consecutive token-carrying chunks (one chunk may carry several
  tokens: a merged step, speculative decoding); the first token is not an ITL.
- TPOT: ``(E2E - TTFT) / (output_tokens - 1)``: the mean time per output token *after*
  the first, so prefill never inflates it; undefined for a one-token output.
- Goodput: completed requests per second of the run that meet every given SLO
  (TTFT <= ``slo_ttft_ms`` and TPOT <= ``slo_tpot_ms``; a one-token request meets any
  TPOT SLO); ``None`` when no SLO is given.

Percentiles use numpy's default (linear interpolation), as vLLM's benchmark does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What a client measured for one request.

    Attributes:
        index: the workload index of the request.
        input_len: prompt tokens sent (or reported by the server, when it reports them).
        target_output_len: output tokens asked for (``max_new_tokens``).
        ok: the request completed (HTTP 200 and a finished stream).
        start: send time, seconds on the runner's monotonic clock (``perf_counter``).
        ttft: seconds from send to the first token; None when no token came.
        e2e: seconds from send to the end of the response.
        itl: seconds between consecutive token-carrying chunks.
        output_tokens: output tokens counted from the response (ids, ``details`` or
            ``usage``; re-tokenised text only where the family returns nothing else).
        token_source: how ``output_tokens`` was counted (``token_ids``, ``details``,
            ``usage``, ``retokenized``, ``engine``, ``generate``).
        error: why the request failed, when ``ok`` is False.
    """

    index: int
    input_len: int
    target_output_len: int
    ok: bool = False
    start: float = 0.0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    token_source: str = ""
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def tpot(rec: RequestRecord) -> float | None:
    """Seconds per output token after the first; None for fewer than two tokens."""
    if rec.ttft is None or rec.output_tokens < 2:
        return None
    return (rec.e2e - rec.ttft) / (rec.output_tokens - 1)


def distribution(values: Iterable[float], scale: float = 1.0) -> dict[str, float | None]:
    """``mean``, ``p50``, ``p90``, ``p99`` (and ``n``) of ``values`` times ``scale``;
    every statistic None when there are no values."""
    arr = np.asarray(list(values), dtype=np.float64) * scale
    out: dict[str, float | None] = {"n": int(arr.size)}
    if arr.size == 0:
        out.update({"mean": None, **{f"p{p}": None for p in PERCENTILES}})
        return out
    out["mean"] = float(arr.mean())
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    return out


def meets_slo(rec: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """True when ``rec`` completed and meets every SLO that is set."""
    if not rec.ok:
        return False
    if slo_ttft_ms is not None and (rec.ttft is None or rec.ttft * 1e3 > slo_ttft_ms):
        return False
    t = tpot(rec)
    return slo_tpot_ms is None or t is None or t * 1e3 <= slo_tpot_ms


def summarize(records: Sequence[RequestRecord], duration_s: float, *,
              slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """The summary of one run: counts, throughputs and latency distributions (ms).

    ``duration_s`` is the wall time of the measured part of the run (first send to last
    completion); throughputs divide by it. Latency statistics cover completed requests.

    Raises:
        ValueError: ``duration_s`` is not positive while requests completed.
    """
    done = [r for r in records if r.ok]
    if done and duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.input_len for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in done)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if not r.ok and r.error})[:5],
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "target_output_tokens": sum(r.target_output_len for r in done),
        "token_sources": sorted({r.token_source for r in done}),
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + in_tokens),
        "ttft_ms": distribution((r.ttft for r in done if r.ttft is not None), 1e3),
        # prompt tokens per second of TTFT (send to first token: prefill, one sample and
        # the HTTP round trip); at concurrency 1 the prefill speed a client sees
        "prefill_tok_s": distribution(r.input_len / r.ttft for r in done
                                      if r.ttft is not None and r.ttft > 0),
        "tpot_ms": distribution((t for r in done if (t := tpot(r)) is not None), 1e3),
        "itl_ms": distribution((x for r in done for x in r.itl), 1e3),
        "e2e_ms": distribution((r.e2e for r in done), 1e3),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "goodput": per_s(good) if has_slo else None,
        "slo_attainment": (good / len(records) if records else None) if has_slo else None,
    }


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """``ours / theirs``, or None when either is missing or ``theirs`` is 0."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def compare(ours: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """Ratios ours/baseline of the headline numbers (throughputs: > 1 is better for us;
    latencies: < 1 is better for us)."""
    return {
        "output_throughput": ratio(ours["output_throughput"], base["output_throughput"]),
        "request_throughput": ratio(ours["request_throughput"], base["request_throughput"]),
        "ttft_mean": ratio(ours["ttft_ms"]["mean"], base["ttft_ms"]["mean"]),
        "ttft_p50": ratio(ours["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
        "tpot_mean": ratio(ours["tpot_ms"]["mean"], base["tpot_ms"]["mean"]),
        "e2e_mean": ratio(ours["e2e_ms"]["mean"], base["e2e_ms"]["mean"]),
    }
