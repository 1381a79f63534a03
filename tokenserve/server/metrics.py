"""Prometheus metrics of one server (spec/interfaces.md §7.7) and ``/metrics-json`` (§7.6).

One :class:`ServerMetrics` per server, with its own ``CollectorRegistry`` (no module-global
registry: tests and the PD coordinator run several servers in one process). Everything
is read at scrape time by one custom collector:

- per-request numbers, recorded by :class:`~tokenserve.api.engine_stream.EngineStream` (the
  one place every API family passes through) via :meth:`ServerMetrics.request_started` ->
  :class:`RequestTracker`: ``request_received_total`` when the request enters the engine,
  then at its end ``request_success_total`` or ``request_failed_total`` and the TTFT,
  TPOT, e2e and token-count histograms (on a PD prefill instance a request handed off
  to its decode instance is a success). A request of several engine requests (OpenAI
  ``n`` / ``best_of``, a list of prompts; vLLM ``n``) is ONE request: each engine request
  reports through a :class:`SequenceTracker` of the one tracker (issue 40, as the PD
  coordinator counts it);
- engine state, read from ``engine.stats()`` at scrape time: running / waiting / swapped
  gauges, KV cache usage, ``num_preemptions_total``, and the prefix cache:
  ``npu_prefix_cache_hit_rate`` = ``prefix_cache_hit_rate``, ``all_radix_match_num`` /
  ``npu_radix_match_hit_num`` = prompt tokens looked up / found (``prefix_query_tokens``
  / ``prefix_hit_tokens``; 0 when the stats have no such fields).

Every series carries ``model_name="<engine.info.model_name>"`` (spec §7.7).

[I] decisions:
- MindIE serves ``/metrics`` only when env ``MIES_SERVICE_MONITOR_MODE=1`` (else 500);
  we always serve it (vLLM/TGI users expect ``/metrics``); the variable is not read.
- every received request ends in exactly one of ``request_success_total`` (the engine's
  final output ended with EOS/stop or length; on a PD prefill instance, the hand-off) and
  ``request_failed_total`` (anything else: timeout, engine error, the client gone), so
  ``received == success + failed`` whenever no request is in flight (MindIE's sums,
  issue 40). ``request_disconnected_total`` (issue 22 c) counts, among the failures, the
  requests ended because their client went away (a disconnect, or stopInfer: how a
  disconnect reaches a PD decode instance) before the engine ended them; a request that
  timed out and whose client then left is one failure, not a disconnect. A tracker ends
  once (:meth:`SequenceTracker.finished` is idempotent), so nothing is counted twice.
  Requests rejected by validation (4xx) never reach the engine and are not counted.
- TPOT is observed once per request: the summed ``decode_time_ms`` of its outputs after
  the first, divided by the tokens those outputs carried (tokens merged into the first
  output have no decode time of their own).
- ``failed_request_perc`` = failed / (success + failed).
- KV usage goes to ``npu_cache_usage_perc`` when the KV cache lives on an accelerator
  (NPU or CUDA) and to ``cpu_cache_usage_perc`` when it lives in host memory; the other
  gauge is 0 (we have no swap space).
- throughput gauges: tokens per second over the interval since the previous scrape
  (at least 1 s; a faster scrape repeats the previous value).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenserve.api.prometheus import (
    CONTENT_TYPE,
    E2E_BUCKETS,
    TOKEN_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
    Outcomes,
    histogram_family,
    request_families,
)
from tokenserve.messages import FinishReason, GenerateRequest, RequestOutput

logger = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE", "E2E_BUCKETS", "RECENT_WINDOW", "TOKEN_BUCKETS", "TPOT_BUCKETS",
           "TTFT_BUCKETS", "Histogram", "RequestTracker", "SequenceTracker",
           "ServerMetrics"]

#: /metrics-json: TTFT/TBT are averages over this many recent requests (spec §7.6).
RECENT_WINDOW = 100
_OK = (FinishReason.EOS, FinishReason.LENGTH)


class RequestTracker:
    """One client request, from entering the engine to its end: counted received once,
    ended once, after the last of its sequences (issue 40: a request for ``n`` sequences,
    or a completions list of prompts, is one request, as the PD coordinator counts it).

    Each engine request of it reports through its own :class:`SequenceTracker`
    (:meth:`sequence`). The request is a success when every sequence succeeded; a failure
    counts as a disconnect only when every failed sequence ended by its client going
    away. TTFT is the first token of any sequence, e2e the end of the last; the token
    histograms count every sequence's output and each distinct prompt once.
    """

    __slots__ = ("_decode_ms", "_decode_tokens", "_done", "_failed_other", "_gone",
                 "_metrics", "_ok", "_open", "_prompt_tokens", "_prompts", "_start",
                 "_tokens", "_ttft_s")

    def __init__(self, metrics: ServerMetrics, arrival_s: float) -> None:
        self._metrics = metrics
        self._start = arrival_s
        self._prompts: list[Sequence[int]] = []  # the distinct prompts, not copied
        self._prompt_tokens = 0
        self._ttft_s: float | None = None
        self._decode_ms = 0.0
        self._decode_tokens = 0
        self._tokens = 0
        self._open = 0
        self._ok = True
        self._gone = False  # a sequence failed because its client went away
        self._failed_other = False  # a sequence failed otherwise
        self._done = False

    def sequence(self, request: GenerateRequest) -> SequenceTracker:
        """A tracker for one more engine request of this client request (all of them
        join before any of them ends)."""
        assert not self._done, "a sequence joined an ended request"
        prompt = request.prompt_token_ids  # n sequences share one: compared by identity
        if not any(p is prompt or p == prompt for p in self._prompts):
            self._prompts.append(prompt)
            self._prompt_tokens += len(prompt)
        self._open += 1
        return SequenceTracker(self)

    def _first_token(self, prefill_time_ms: float | None) -> None:
        if self._ttft_s is None:
            self._ttft_s = ((time.monotonic() - self._start) if prefill_time_ms is None
                            else prefill_time_ms / 1e3)
            self._metrics.live_prompt_tokens += self._prompt_tokens

    def _tokens_out(self, n: int, decode_time_ms: float | None) -> None:
        if decode_time_ms is not None:
            self._decode_ms += decode_time_ms
            self._decode_tokens += n

    def _sequence_end(self, ok: bool, disconnected: bool, tokens: int) -> None:
        self._tokens += tokens
        self._ok = self._ok and ok
        if not ok:
            if disconnected:
                self._gone = True
            else:
                self._failed_other = True
        self._open -= 1
        if self._open > 0:
            return
        self._done = True
        self._metrics.record_end(
            ok=self._ok, disconnected=self._gone and not self._failed_other,
            prompt_tokens=self._prompt_tokens, generation_tokens=self._tokens,
            ttft_s=self._ttft_s,
            tpot_s=self._decode_ms / self._decode_tokens / 1e3 if self._decode_tokens else None,
            e2e_s=time.monotonic() - self._start)


class SequenceTracker:
    """One engine request's outputs and end, reported to its :class:`RequestTracker`."""

    __slots__ = ("_done", "_request", "_started", "_tokens")

    def __init__(self, request: RequestTracker) -> None:
        self._request = request
        self._started = False
        self._tokens = 0
        self._done = False

    def sibling(self, request: GenerateRequest) -> SequenceTracker:
        """A tracker for another engine request of the same client request (another of
        its ``n`` sequences or prompts)."""
        return self._request.sequence(request)

    def output(self, out: RequestOutput) -> None:
        """Account one engine output (called for every output, in order)."""
        n = len(out.new_token_ids)
        if n == 0:
            return
        if not self._started:  # the first output: prefill, no decode time of its own
            self._started = True
            self._request._first_token(out.prefill_time_ms)
        else:
            self._request._tokens_out(n, out.decode_time_ms)
        self._tokens += n
        self._request._metrics.live_generation_tokens += n

    def finished(self, last: RequestOutput | None, handed_off: bool = False,
                 disconnected: bool = False) -> None:
        """The engine request is over (``last`` is its final output, or None when it
        never got one: disconnect, engine failure). ``handed_off``: it went on on a
        decode instance (PD), a success here; ``disconnected``: its client went away (or
        stopped it): a failure, also counted as a disconnect unless the engine had
        already ended the request otherwise (a timeout, an engine error). Idempotent:
        the first call counts, so a request is one success or one failure."""
        if self._done:
            return
        self._done = True
        ok = handed_off or (last is not None and last.finished and last.finish_reason in _OK)
        ended_first = (last is not None and last.finished
                       and last.finish_reason is not FinishReason.ABORT)
        tokens = max(self._tokens, last.num_output_tokens if last is not None else 0)
        self._request._sequence_end(ok, disconnected and not ended_first, tokens)


class ServerMetrics:
    """The metrics of one server (spec §7.7) over its own ``CollectorRegistry``.

    Args:
        engine: its ``info`` (model name, KV cache device) and, at scrape time,
            ``stats()`` (None or a failure leaves the engine-state series out).
        model_name: the ``model_name`` label (default ``engine.info.model_name``).
    """

    def __init__(self, engine: Any, model_name: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name or engine.info.model_name
        device = engine.info.device
        self.kv_device = device if device in ("npu", "cuda", "cpu") else "cpu"
        #: ``<managementIp>:<port>`` for ``/metrics-json`` (set by ``serve``).
        self.instance = ""
        #: received requests and how they ended (``request_*_total``)
        self.outcomes = Outcomes()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = Histogram(TOKEN_BUCKETS)
        self.generation_tokens = Histogram(TOKEN_BUCKETS)
        #: tokens as they are processed (the ``*_tokens_total`` counters, throughput)
        self.live_prompt_tokens = 0
        self.live_generation_tokens = 0
        self._recent_ttft_ms: collections.deque[float] = collections.deque(maxlen=RECENT_WINDOW)
        self._recent_tbt_ms: collections.deque[float] = collections.deque(maxlen=RECENT_WINDOW)
        self._rate_mark = (time.monotonic(), 0, 0)
        self._rates = (0.0, 0.0)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    @property
    def received(self) -> int:
        """``request_received_total``."""
        return self.outcomes.received

    @property
    def success(self) -> int:
        """``request_success_total``."""
        return self.outcomes.success

    @property
    def failed(self) -> int:
        """``request_failed_total``."""
        return self.outcomes.failed

    @property
    def disconnected(self) -> int:
        """``request_disconnected_total`` (failures whose client went away)."""
        return self.outcomes.disconnected

    # ------------------------------------------------------------------ recording

    def request_started(self, request: GenerateRequest) -> SequenceTracker:
        """``request_received_total`` += 1; the tracker records the rest (its
        :meth:`SequenceTracker.sibling` adds another sequence of the same request)."""
        self.outcomes.received += 1
        return RequestTracker(self, request.arrival_time or time.monotonic()).sequence(request)

    def record_end(self, *, ok: bool, prompt_tokens: int, generation_tokens: int,
                   ttft_s: float | None, tpot_s: float | None, e2e_s: float,
                   disconnected: bool = False) -> None:
        """Account one ended request: a success when ``ok``, else a failure (and, when
        ``disconnected``, also a disconnect); see the module docstring."""
        self.outcomes.end(ok, disconnected)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            self._recent_ttft_ms.append(ttft_s * 1e3)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
            self._recent_tbt_ms.append(tpot_s * 1e3)

    # ------------------------------------------------------------------ reading

    def render(self) -> bytes:
        """The Prometheus text exposition (spec §7.7)."""
        return generate_latest(self.registry)

    def stats(self) -> Any | None:
        """``engine.stats()``, or None when it has none or fails."""
        try:
            return self.engine.stats()
        except Exception:
            logger.exception("engine.stats() failed")
            return None

    def throughput(self) -> tuple[float, float]:
        """(prompt, generation) tokens/s since the previous call (>= 1 s apart)."""
        now = time.monotonic()
        t0, p0, g0 = self._rate_mark
        if now - t0 >= 1.0:
            dt = now - t0
            self._rates = ((self.live_prompt_tokens - p0) / dt,
                           (self.live_generation_tokens - g0) / dt)
            self._rate_mark = (now, self.live_prompt_tokens, self.live_generation_tokens)
        return self._rates

    def json_snapshot(self) -> dict[str, Any]:
        """``GET /metrics-json`` (spec §7.6): TTFT / TBT moving averages (ms) over the
        last requests, queue sizes and free KV blocks, values as strings."""
        st = self.stats()
        values = {
            "TTFT": _mean(self._recent_ttft_ms),
            "TBT": _mean(self._recent_tbt_ms),
            "waitingInferRequestNum": st.num_waiting if st is not None else 0,
            "processingInferRequestNum": st.num_running if st is not None else 0,
            "remainBlocks": st.num_free_blocks if st is not None else 0,
        }
        return {
            "resultType": "vector",
            "result": [
                {"metric": [{"__name__": name, "job": "node", "instance": self.instance}],
                 "value": _num(value)}
                for name, value in values.items()
            ],
        }

    async def prometheus(self, request: Any, response: Any) -> None:
        """``GET /metrics`` (spec §7.7): the Prometheus text exposition."""
        await response.send(200, self.render(), CONTENT_TYPE)

    async def json(self, request: Any, response: Any) -> None:
        """``GET /metrics-json`` (spec §7.6)."""
        await response.send_json(200, self.json_snapshot())


class _Collector(Collector):
    """Builds every family at scrape time from :class:`ServerMetrics` and the engine."""

    def __init__(self, m: ServerMetrics) -> None:
        self._m = m

    def collect(self) -> Iterator[Metric]:
        m = self._m
        lbl = ["model_name"]
        val = [m.model_name]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=lbl)
            c.add_metric(val, value)
            return c

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=lbl)
            g.add_metric(val, value)
            return g

        def hist(name: str, doc: str, h: Histogram) -> Metric:
            return histogram_family(name, doc, lbl, val, h)

        yield from request_families(lbl, val, m.outcomes)
        yield hist("time_to_first_token_seconds", "Time to first token", m.ttft)
        yield hist("time_per_output_token_seconds", "Time per output token", m.tpot)
        yield hist("e2e_request_latency_seconds", "End-to-end request latency", m.e2e)
        yield hist("request_prompt_tokens", "Prompt tokens per request", m.prompt_tokens)
        yield hist("request_generation_tokens", "Generated tokens per request",
                   m.generation_tokens)
        yield counter("prompt_tokens", "Prompt tokens processed", m.live_prompt_tokens)
        yield counter("generation_tokens", "Tokens generated", m.live_generation_tokens)
        prompt_rate, gen_rate = m.throughput()
        yield gauge("avg_prompt_throughput_toks_per_s", "Prompt throughput", prompt_rate)
        yield gauge("avg_generation_throughput_toks_per_s", "Generation throughput", gen_rate)
        weights = getattr(m.engine.info, "weights_bytes", 0)
        if weights:
            yield gauge("model_weights_bytes", "Bytes of model weights the kernels read "
                        "(quantised or packed copies, embedding table, norms)", weights)

        st = m.stats()
        if st is None:
            return
        yield gauge("num_requests_running", "Requests running", st.num_running)
        yield gauge("num_requests_waiting", "Requests waiting", st.num_waiting)
        yield gauge("num_requests_swapped", "Requests swapped out", st.num_swapped)
        usage = 1.0 - st.num_free_blocks / st.num_blocks if st.num_blocks else 0.0
        on_host = m.kv_device == "cpu"
        yield gauge("npu_cache_usage_perc", "Device KV cache usage (1 = 100%)",
                    0.0 if on_host else usage)
        yield gauge("cpu_cache_usage_perc", "Host KV cache usage (1 = 100%)",
                    usage if on_host else 0.0)
        queries, hits = st.prefix_query_tokens, st.prefix_hit_tokens
        rate = st.prefix_cache_hit_rate
        yield gauge("npu_prefix_cache_hit_rate", "Prefix cache hit rate (tokens)", rate)
        yield gauge("all_radix_match_num", "Prompt tokens looked up in the prefix cache",
                    queries)
        yield gauge("npu_radix_match_hit_num", "Prompt tokens found in the prefix cache", hits)
        yield counter("num_preemptions", "Preemptions", st.num_preemptions)
        yield counter("spec_decode_num_draft_tokens",
                      "Speculative decoding: draft tokens verified", st.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens",
                      "Speculative decoding: draft tokens accepted", st.num_accepted_tokens)
        yield counter("structured_output_mask_ms",
                      "Structured output: milliseconds spent on token masks (fill + apply)",
                      getattr(st, "mask_ms", 0.0))
        yield counter("structured_output_mask_steps",
                      "Structured output: engine steps with a constrained row",
                      getattr(st, "mask_steps", 0))


def _mean(values: collections.deque[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _num(value: float) -> str:
    """spec §7.6 values are strings; integers without a fraction."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.3f}"
