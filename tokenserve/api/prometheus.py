"""MindIE's Prometheus vocabulary (spec/interfaces.md §7.7), shared by a server's
``/metrics`` (:mod:`tokenserve.server.metrics`) and the PD coordinator's cluster series
(:mod:`tokenserve.coordinator.metrics`), so both write the same names, buckets and
request-outcome arithmetic: the content type, the spec's buckets, a plain histogram, and
:func:`request_families` (received / success / failed / disconnected and
``failed_request_perc``).

Pure: no registry, no module-global mutable state (each server and coordinator owns its
``CollectorRegistry`` and counts).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

#: spec §7.7 content type ([I] with the text-format version, as prometheus_client 0.x).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: spec §7.7 buckets (seconds / tokens).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
TOKEN_BUCKETS = (10, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 16000, 20000, 32000,
                 50000, 64000, 128000)


class Histogram:
    """A plain histogram (observations on the event loop; read at scrape time)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Add one observation (in the histogram's unit: seconds or tokens)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs ending with ``+Inf``."""
        out, acc = [], 0
        for bound, n in zip(self.bounds, self.counts):
            acc += n
            out.append((repr(float(bound)), acc))
        out.append(("+Inf", self.count))
        return out


@dataclass
class Outcomes:
    """How many requests were received and how each ended (counts).

    Every received request ends in exactly one of ``success`` and ``failed`` (MindIE's
    ``request_received_total == request_success_total + request_failed_total`` once
    nothing is in flight); ``disconnected`` counts the failures whose client went away.
    """

    received: int = 0
    success: int = 0
    failed: int = 0
    disconnected: int = 0

    def end(self, ok: bool, disconnected: bool = False) -> None:
        """One received request ended: a success when ``ok``, else a failure (also a
        disconnect when ``disconnected``)."""
        if ok:
            self.success += 1
        else:
            self.failed += 1
            if disconnected:
                self.disconnected += 1


def request_families(labels: list[str], values: list[str], counts: Outcomes
                     ) -> Iterator[Metric]:
    """``request_received_total``, ``request_success_total``, ``request_failed_total``,
    ``request_disconnected_total`` and ``failed_request_perc`` (failed / ended, 1 = 100 %)
    of ``counts``, each one series labelled ``labels`` = ``values``."""

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=labels)
        c.add_metric(values, value)
        return c

    yield counter("request_received", "Requests received", counts.received)
    yield counter("request_success", "Requests completed", counts.success)
    yield counter("request_failed", "Requests failed", counts.failed)
    yield counter("request_disconnected",
                  "Failed requests whose client went away (disconnect or stopInfer)",
                  counts.disconnected)
    ended = counts.success + counts.failed
    g = GaugeMetricFamily("failed_request_perc", "Failed / finished requests (1 = 100%)",
                          labels=labels)
    g.add_metric(values, counts.failed / ended if ended else 0.0)
    yield g


def histogram_family(name: str, doc: str, labels: list[str], values: list[str],
                     h: Histogram) -> HistogramMetricFamily:
    """``h`` as the histogram family ``name`` with one series labelled ``labels``."""
    f = HistogramMetricFamily(name, doc, labels=labels)
    f.add_metric(values, h.buckets(), h.sum)
    return f
