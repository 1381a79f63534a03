"""tools/compare_servers.py (the mixed vs coordinator parity check, issues 22 and 40): an
``n`` = 2 answer is compared choice by choice whatever the stream's interleaving, and the
``/metrics`` request counters' deltas are compared on the un-prefixed series. The servers
it talks to are the real path (run by hand, bench/README.md); this covers the parts that
decide its verdict, against fake servers (httpx.MockTransport)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import httpx
import orjson

TOOL = Path(__file__).resolve().parents[2] / "tools" / "compare_servers.py"
spec = importlib.util.spec_from_file_location("compare_servers", TOOL)
cs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cs)


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + \
        b"data: [DONE]\n\n"


def chunk(rid: str, *choices: tuple[int, str, str | None], usage: dict | None = None
          ) -> dict:
    return {"id": rid, "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                        for i, t, f in choices], "usage": usage}


USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def several(body: bytes, path: str = "/v1/completions") -> object:
    return cs._several(path, cs._normalise(body))


def test_n2_stream_compared_choice_by_choice_not_by_interleaving() -> None:
    # a mixed server: one chunk a step, both choices in it
    mixed = sse(chunk("a", (0, " red", None), (1, " red", None)),
                chunk("a", (0, " and", "length"), (1, " and", "length")),
                {**chunk("a"), "usage": USAGE})
    # the coordinator: one choice a chunk, the text split elsewhere, another id
    coord = sse(chunk("b", (1, " re", None)), chunk("b", (0, " red", None)),
                chunk("b", (1, "d and", "length")), chunk("b", (0, " and", "length")),
                {**chunk("b"), "usage": USAGE})
    assert several(mixed) == several(coord)
    # a different token in one choice, a doubled finish, usage early, no [DONE]: differ
    other = sse(chunk("a", (0, " red", None), (1, " blue", None)),
                chunk("a", (0, " and", "length"), (1, " and", "length")),
                {**chunk("a"), "usage": USAGE})
    doubled = sse(chunk("a", (0, " red", "length"), (1, " red", None)),
                  chunk("a", (0, " and", "length"), (1, " and", "length")),
                  {**chunk("a"), "usage": USAGE})
    early = sse(chunk("a", (0, " red", None), (1, " red", None), usage=USAGE),
                chunk("a", (0, " and", "length"), (1, " and", "length")),
                {**chunk("a"), "usage": USAGE})
    for bad in (other, doubled, early, mixed[:-len(b"data: [DONE]\n\n")]):
        assert several(bad) != several(mixed)


def test_n2_chat_deltas_and_a_null_field_are_kept() -> None:
    def c(i: int, **delta) -> dict:
        return {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{"index": i, "delta": delta, "logprobs": None,
                             "finish_reason": None}]}
    a = sse(c(0, role="assistant", content=""), c(1, role="assistant", content=""),
            c(0, content="Apple"), c(1, content="Apple"))
    b = sse(c(1, role="assistant", content=""), c(1, content="App"), c(1, content="le"),
            c(0, role="assistant", content=""), c(0, content="Apple"))
    assert several(a) == several(b)
    no_role = sse(c(0, content="Apple"), c(1, role="assistant", content="Apple"))
    assert several(no_role) != several(a)
    without_logprobs = a.replace(b',"logprobs":null', b"")
    assert several(without_logprobs) != several(a)


def test_vllm_n2_sequences_compared_as_sorted_lists() -> None:
    assert several(b'{"text":["p b","p a"]}', "/generate") == \
        several(b'{"text":["p a","p b"]}', "/generate")
    assert several(b'{"text":["p a","p a"]}', "/generate") != \
        several(b'{"text":["p a","p b"]}', "/generate")
    mixed = b'{"text":[" b"," a"]}\0{"text":["1","2"]}\0'
    coord = b'{"text":[" a2"," b1"]}\0'
    assert several(mixed, "/generate") == several(coord, "/generate")
    assert several(mixed, "/generate") != several(b'{"text":[" a1"," b2"]}\0', "/generate")


def test_n2_requests_cover_each_route_whole_and_streamed() -> None:
    reqs = [(p, b) for _, p, b in cs.requests("m") if isinstance(b, dict) and
            b.get("n") == 2]
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        streams = {bool(b.get("stream")) for p, b in reqs if p == path}
        assert streams == {False, True}, path
    sampled = [b for _, b in reqs if b.get("temperature", 1) > 0]
    assert all("seed" in b for b in sampled)  # pinned or seeded: reproducible on both
    assert any(b.get("temperature") == 0 for _, b in reqs)  # refused by both (422)


def metrics_text(received: float, instance: float = 0.0) -> str:
    mn = 'model_name="m"'
    inst = 'instance="127.0.0.1:1",kind="prefill"'
    return (
        "# HELP request_received_total Requests received\n"
        "# TYPE request_received_total counter\n"
        f"request_received_total{{{mn}}} {received}\n"
        "# HELP request_success_total Requests that succeeded\n"
        "# TYPE request_success_total counter\n"
        f"request_success_total{{{mn}}} {received}\n"
        "# HELP e2e_request_latency_seconds e2e\n"
        "# TYPE e2e_request_latency_seconds histogram\n"
        f'e2e_request_latency_seconds_bucket{{{mn},le="+Inf"}} {received}\n'
        f"e2e_request_latency_seconds_count{{{mn}}} {received}\n"
        f"e2e_request_latency_seconds_sum{{{mn}}} 0.5\n"
        "# HELP instance_request_received_total Requests received\n"
        "# TYPE instance_request_received_total counter\n"
        f"instance_request_received_total{{{mn},{inst}}} {instance}\n")


def test_counters_reads_only_the_unprefixed_series() -> None:
    got = cs.counters(metrics_text(3, instance=99))
    assert got["request_received_total"] == 3 and got["request_success_total"] == 3
    assert got["e2e_request_latency_seconds_count"] == 3
    assert got["request_failed_total"] == 0  # absent: 0


class Fake:
    """A server that answers every request alike and counts each POST ``per_post`` times
    in its ``/metrics``."""

    def __init__(self, per_post: int = 1) -> None:
        self.per_post = per_post
        self.received = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics_text(self.received, instance=7 * self.received),
                                  headers={"content-type": "text/plain; version=0.0.4"})
        if request.method == "POST":
            self.received += self.per_post
        return httpx.Response(200, json={"id": str(id(self)), "path": request.url.path})


def run(a: Fake, b: Fake) -> tuple[int, int, str]:
    def route(request: httpx.Request) -> httpx.Response:
        return (a if request.url.host == "a" else b)(request)

    out = io.StringIO()
    with httpx.Client(transport=httpx.MockTransport(route)) as client:
        differ, total = cs.compare(client, "http://a", "http://b", "m", out=out)
    return differ, total, out.getvalue()


def test_compare_equal_servers_and_equal_deltas_per_request_set() -> None:
    differ, total, out = run(Fake(), Fake())
    sets = cs.request_sets("m")
    assert differ == 0 and total == len(cs.requests("m")) + len(sets) * len(cs.COUNTERS)
    for label, reqs in sets:
        posts = sum(m == "POST" for m, _, _ in reqs)
        assert f"same    delta request_received_total ({label}) {posts}" in out


def test_compare_reports_a_request_counted_twice() -> None:
    differ, _, out = run(Fake(), Fake(per_post=2))
    assert differ == 3 * len(cs.request_sets("m"))  # received, success, e2e count
    assert "DIFFERS delta request_received_total (n = 2)" in out
    assert "same    delta request_failed_total (n = 1) 0" in out
