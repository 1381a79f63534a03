"""The coordinator's ``GET /metrics`` (issue 22; spec/pd_disaggregation.md §9.4
``external_port``): its own series, then every instance's, aggregated.

Own series (one ``CollectorRegistry`` per coordinator, no module-global state)::

    coordinator_requests_total{route,status}   ended requests by route name and the
                                               status the client got (a stream: 200)
    coordinator_requests_in_flight             admitted, not ended
    coordinator_retries_total                  resubmissions (retry:, lost D, P errors)
    coordinator_recomputes_total               resubmissions with the recompute body
    coordinator_failovers_total{kind}          a lost P or D (its requests moved)
    coordinator_instance_outstanding{instance,kind}   requests on each instance
    coordinator_instance_up{instance,kind}     1 while it takes new requests
    coordinator_ttft_seconds                   arrival -> first byte to the client
    coordinator_e2e_seconds                    arrival -> end

Instance series: each instance's own ``/metrics`` (its metrics plane, reached at its
management address), fetched at most every ``reuse_s`` seconds (MindIE-MS
``reuse_time``), every sample labelled ``instance`` and ``kind``; an instance that does
not answer is left out of that scrape.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from tokenserve.api.routes import path_of
from tokenserve.coordinator.pool import Instance, InstancePool

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
#: [I] seconds an instance scrape is reused (MindIE-MS reuse_time)
REUSE_S = 2.0


class CoordinatorMetrics:
    """The counters the request path records into, and the scrape (module docstring)."""

    def __init__(self, pool: Callable[[], InstancePool], in_flight: Callable[[], int],
                 reuse_s: float = REUSE_S) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.requests = Counter("coordinator_requests", "Ended requests by route and status",
                                ["route", "status"], registry=reg)
        self.retries = Counter("coordinator_retries", "Resubmissions of a request",
                               registry=reg)
        self.recomputes = Counter("coordinator_recomputes",
                                  "Resubmissions with the recompute body", registry=reg)
        self.failovers = Counter("coordinator_failovers", "Instances lost under requests",
                                 ["kind"], registry=reg)
        self.ttft = Histogram("coordinator_ttft_seconds", "Arrival to first byte sent",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.e2e = Histogram("coordinator_e2e_seconds", "Arrival to end",
                             buckets=E2E_BUCKETS, registry=reg)
        Gauge("coordinator_requests_in_flight", "Admitted, not ended",
              registry=reg).set_function(lambda: in_flight())
        self._pool = pool
        self._reuse_s = reuse_s
        self._scraped = 0.0
        self._instances: dict[tuple[str, str], list[Metric]] = {}
        reg.register(_Collector(self))

    async def render(self, client: httpx.AsyncClient, timeout_s: float) -> bytes:
        """The exposition text (instance scrapes refreshed when older than reuse_s)."""
        now = time.monotonic()
        if now - self._scraped >= self._reuse_s:
            self._scraped = now
            insts = self._pool().prefill + self._pool().decode
            got = await asyncio.gather(*(_scrape(client, i, timeout_s) for i in insts))
            self._instances = {(i.name, i.kind): fams for i, fams in zip(insts, got,
                                                                          strict=True)
                               if fams is not None}
        return generate_latest(self.registry)


async def _scrape(client: httpx.AsyncClient, inst: Instance, timeout_s: float
                  ) -> list[Metric] | None:
    try:
        resp = await client.get(inst.addr.mgmt_url + path_of("server.metrics"),
                                timeout=timeout_s)
        if resp.status_code != 200:
            return None
        return list(text_string_to_metric_families(resp.text))
    except (httpx.HTTPError, ValueError):
        return None


class _Collector:
    """Scrape-time series: per-instance gauges and the instances' own families."""

    def __init__(self, m: CoordinatorMetrics) -> None:
        self._m = m

    def collect(self) -> Iterator[Metric]:
        pool = self._m._pool()
        insts = pool.prefill + pool.decode
        out = GaugeMetricFamily("coordinator_instance_outstanding",
                                "Requests on each instance", labels=["instance", "kind"])
        up = GaugeMetricFamily("coordinator_instance_up", "1 while it takes new requests",
                               labels=["instance", "kind"])
        for i in insts:
            out.add_metric([i.name, i.kind], i.outstanding)
            up.add_metric([i.name, i.kind], 1.0 if i.usable() else 0.0)
        yield out
        yield up
        merged: dict[str, Metric] = {}
        for (name, kind), fams in self._m._instances.items():
            for fam in fams:
                into = merged.get(fam.name)
                if into is None:
                    into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                     fam.unit)
                for s in fam.samples:
                    into.add_sample(s.name, {**s.labels, "instance": name, "kind": kind},
                                    s.value, s.timestamp, s.exemplar)
        yield from merged.values()
