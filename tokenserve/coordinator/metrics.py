"""The coordinator's ``GET /metrics`` (issue 22, issue 40; spec/pd_disaggregation.md §9.4
``external_port``, spec/interfaces.md §7.7): the cluster as a client sees it under
MindIE's names, the coordinator's own series, then every instance's under ``instance_``
names.

Three kinds of series, whose names never collide, so a sum over any one name counts each
request once ([I] issue 40: before, P's and D's ``request_received_total`` were exposed
under that same name and every PD request was counted twice):

1. The cluster, MindIE's names (spec §7.7) and ``model_name`` label, measured here, each
   request counted once (:class:`ClusterRequest`)::

       request_received_total, request_success_total, request_failed_total,
       request_disconnected_total, failed_request_perc
       time_to_first_token_seconds   arrival here -> P's first answer (P has produced the
                                     first token; a stream's first bytes go out then)
       e2e_request_latency_seconds   arrival here -> the request's end

   ``received == success + failed`` once nothing is in flight. Success: the client got
   the whole 200 answer. Failure: anything else (a coordinator error: 408, 500, 503
   after admission; an error from P or D; the client gone, also counted in
   ``request_disconnected_total``). Not counted at all, as a mixed server does not count
   what never reaches its engine: the coordinator's admission refusals (429, 503 not
   ready) and a P answer relayed unchanged that refused the request before its engine
   (a 4xx: validation, prompt too long, unknown model; or 503: its queue full). A
   request is counted as received when P first answers it 200, or when it ends
   otherwise. TPOT and the token counts are the instances' (below): the coordinator
   relays text, it does not count tokens.

2. The coordinator's own, prefix ``coordinator_`` (one ``CollectorRegistry`` per
   coordinator, no module-global state)::

       coordinator_requests_total{route,status}   every ended request, refused ones too,
                                                  by route name and the status the client
                                                  got (a stream: 200)
       coordinator_requests_in_flight             admitted, not ended
       coordinator_retries_total                  resubmissions (retry:, lost D, P errors)
       coordinator_recomputes_total               resubmissions with the recompute body
       coordinator_failovers_total{kind}          a lost P or D (its requests moved)
       coordinator_instance_outstanding{instance,kind}   requests on each instance
       coordinator_instance_up{instance,kind}     1 while it takes new requests

3. The instances', prefix ``instance_`` (:data:`INSTANCE_PREFIX`): each instance's own
   ``/metrics`` (its metrics plane, reached at its management address), fetched at most
   every ``reuse_s`` seconds (MindIE-MS ``reuse_time``), every family renamed
   ``instance_<name>`` (``instance_request_received_total``,
   ``instance_time_per_output_token_seconds_bucket``, ...) and every sample labelled
   ``instance`` (``host:port``) and ``kind`` (``prefill`` / ``decode``); an instance
   that does not answer is left out of that scrape. A PD request appears on its P
   (a hand-off is a success there) and on its D.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from tokenserve.api.prometheus import (
    E2E_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    Outcomes,
    histogram_family,
    request_families,
)
from tokenserve.api.routes import path_of
from tokenserve.coordinator.pool import Instance, InstancePool

#: [I] seconds an instance scrape is reused (MindIE-MS reuse_time)
REUSE_S = 2.0
#: what every instance family's name is prefixed with on the coordinator
INSTANCE_PREFIX = "instance_"


def refused_before_engine(status: int) -> bool:
    """A P answer (relayed unchanged) that refused the request before its engine: a
    4xx (validation, prompt too long, unknown model) or 503 (its queue full, not
    ready). A mixed server counts such a request in none of its ``request_*`` series."""
    return 400 <= status < 500 or status == 503


class ClusterRequest:
    """One request in the cluster series (module docstring, 1): received at most once,
    ended at most once, TTFT observed at most once. Times are ``loop.time()`` seconds."""

    __slots__ = ("_arrival", "_ended", "_metrics", "_received", "_ttft_seen")

    def __init__(self, metrics: CoordinatorMetrics, arrival_s: float) -> None:
        self._metrics = metrics
        self._arrival = arrival_s
        self._received = False
        self._ttft_seen = False
        self._ended = False

    def received(self) -> None:
        """``request_received_total`` += 1, the first time only."""
        if not self._received:
            self._received = True
            self._metrics.outcomes.received += 1

    def first_token(self, now_s: float) -> None:
        """P answered 200 (its first token exists): received, and TTFT observed once."""
        self.received()
        if not self._ttft_seen:
            self._ttft_seen = True
            self._metrics.ttft.observe(now_s - self._arrival)

    def ended(self, now_s: float, *, ok: bool, disconnected: bool = False,
              refused: bool = False) -> None:
        """The request is over: ``ok`` (the client got the whole 200 answer), else a
        failure (``disconnected``: the client went away). ``refused``: P refused it
        before its engine and nothing was counted yet: it stays uncounted. Idempotent."""
        if self._ended:
            return
        self._ended = True
        if refused and not self._received:
            return
        self.received()
        self._metrics.outcomes.end(ok, disconnected)
        self._metrics.e2e.observe(now_s - self._arrival)


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
        Gauge("coordinator_requests_in_flight", "Admitted, not ended",
              registry=reg).set_function(lambda: in_flight())
        #: the cluster's requests (module docstring, 1)
        self.outcomes = Outcomes()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        #: the cluster series' ``model_name`` label: the instances' (from their scrapes)
        self.model_name = ""
        self._pool = pool
        self._reuse_s = reuse_s
        self._scraped = 0.0
        self._instances: dict[tuple[str, str], list[Metric]] = {}
        reg.register(_Collector(self))

    def request(self, arrival_s: float) -> ClusterRequest:
        """The cluster-series record of a request admitted at ``arrival_s``."""
        return ClusterRequest(self, arrival_s)

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
            self.model_name = _model_name(self._instances.values()) or self.model_name
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


def _model_name(scrapes: Iterable[list[Metric]]) -> str:
    """The first ``model_name`` label in the instances' samples ('' when none)."""
    for fams in scrapes:
        for fam in fams:
            for s in fam.samples:
                name = s.labels.get("model_name")
                if name:
                    return str(name)
    return ""


class _Collector:
    """Scrape-time series: the cluster's, per-instance gauges, the instances' families."""

    def __init__(self, m: CoordinatorMetrics) -> None:
        self._m = m

    def collect(self) -> Iterator[Metric]:
        m = self._m
        lbl, val = ["model_name"], [m.model_name]
        yield from request_families(lbl, val, m.outcomes)
        yield histogram_family("time_to_first_token_seconds",
                               "Time to first token (cluster, measured at the coordinator)",
                               lbl, val, m.ttft)
        yield histogram_family("e2e_request_latency_seconds",
                               "End-to-end request latency (cluster, measured at the "
                               "coordinator)", lbl, val, m.e2e)
        pool = m._pool()
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
        for (name, kind), fams in m._instances.items():
            for fam in fams:
                renamed = INSTANCE_PREFIX + fam.name
                into = merged.get(renamed)
                if into is None:
                    into = merged[renamed] = Metric(renamed, f"{fam.documentation} "
                                                    "(each instance's own)", fam.type,
                                                    fam.unit)
                for s in fam.samples:
                    into.add_sample(INSTANCE_PREFIX + s.name,
                                    {**s.labels, "instance": name, "kind": kind},
                                    s.value, s.timestamp, s.exemplar)
        yield from merged.values()
