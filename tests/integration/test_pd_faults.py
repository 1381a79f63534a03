"""PD cluster faults on real processes (issue 22): a resubmission P still parks replaces
P's copy; a prefill instance killed with requests in flight (each request completes on
the other P or gets a 503, and the P serves again once restarted, no coordinator
restart); a coordinator killed mid-stream leaves no KV block held on P or D. The session
fixture ``pd`` gives ``p`` and ``mixed``; this module adds a prefill ``p2`` and a decode
``d3`` whose orphan bound (``--dresult-orphan-timeout``) is short."""

from __future__ import annotations

import concurrent.futures
import http.server
import signal
import threading
import time

import httpx
import orjson
import pytest

from tests.integration.pd_cluster import coordinator, instance

ORPHAN_S = 3


@pytest.fixture(scope="module")
def cl(pd, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    procs = {"p2": instance("p2", tmp, "--role", "prefill"),
             "d3": instance("d3", tmp, "--role", "decode", "--dresult-orphan-timeout",
                            str(ORPHAN_S))}
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_ready()
        yield {**pd, **procs, "tmp": tmp}
    finally:
        for p in procs.values():
            p.stop()


class _AcceptingD(http.server.BaseHTTPRequestHandler):
    """A decode instance that accepts every hand-off and never pulls (as one that dies
    right after accepting)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.server.accepted += 1  # type: ignore[attr-defined]
        body = b'{"isValidDecodeParameters": true, "errorMessage": ""}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_resubmission_replaces_the_copy_p_still_parks(cl):
    """P parks a request for a D that never pulls it; the coordinator resubmits it under
    the same req-id (its D died): P frees the parked copy and serves the new one, no
    ``duplicate request_id`` 500 (issue 22 a)."""
    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AcceptingD)
    stub.accepted = 0  # type: ignore[attr-defined]
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    p = cl["p"]
    headers = {"req-type": "prefill", "req-id": "5151", "d-target":
               f"127.0.0.1;{stub.server_address[1]}"}
    body = {"prompt": "The capital of France is", "max_tokens": 20, "ignore_eos": True}
    try:
        for _ in range(2):
            r = httpx.post(p.url + "/generate", json=body, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
            assert orjson.loads(r.content)["reqId"] == "5151"
        assert stub.accepted == 2  # type: ignore[attr-defined]
        res = p.status()["resource"]
        assert res["availBlockNum"] < res["totalNpuBlockNums"]  # one copy parked
        httpx.post(p.url + "/v1/pd/release", json={"reqId": "5151"}, timeout=10)
        p.assert_leak_free()
    finally:
        stub.shutdown()


def _vllm_text(url: str, body: dict) -> tuple[int, str]:
    r = httpx.post(url + "/generate", json=body, timeout=300)
    return r.status_code, (r.json()["text"][0] if r.status_code == 200 else r.text)


def test_killed_p_requests_retry_or_503_and_the_restarted_p_serves_again(cl):
    """2 P + 1 D, kill -9 one P with requests in flight: each request completes with the
    mixed instance's greedy text (retried on the other P) or gets a 503 JSON error, none
    hangs; the P restarted on its address serves again, the coordinator untouched."""
    p2, d3 = cl["p2"], cl["d3"]
    coord = coordinator(cl["tmp"], [cl["p"], p2], [d3], name="coord_pkill").start()
    try:
        coord.wait_ready("/v1/readiness")
        # ~1,450 prompt tokens: the P holds it for its prefill (~1 s or more on 2 cores, on
        # every weight path), long enough for the poll below to see it
        story = " ".join(["Once upon a time a cat walked along the river bank."] * 120)
        bodies = [{"prompt": f"{story} Count from {i} to fifty: {i},", "max_tokens": 24,
                   "ignore_eos": True, "temperature": 0} for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_vllm_text, coord.url, b) for b in bodies]
            deadline = time.monotonic() + 120
            while _idle(p2.status()["resource"]):
                assert time.monotonic() < deadline, "p2 never got a request"
                time.sleep(0.02)
            p2.kill()
            got = [f.result(timeout=300) for f in futures]
            want = list(pool.map(lambda b: _vllm_text(cl["mixed"].url, b), bodies))
        for (status, text), (_, ref) in zip(got, want, strict=True):
            assert status in (200, 503), text
            if status == 200:
                assert text == ref
            else:
                assert orjson.loads(text)["error"]
        assert sum(s == 200 for s, _ in got) >= 1
        p2.start().wait_ready()
        served = 0
        deadline = time.monotonic() + 60
        while served == 0:  # the coordinator's status poll takes p2 back
            assert time.monotonic() < deadline, "the restarted p2 is never used"
            status, _ = _vllm_text(coord.url, bodies[0])
            assert status == 200
            served = _success(p2.url)
        for proc in (cl["p"], p2, d3):
            proc.assert_leak_free()
    finally:
        coord.stop()


def _idle(res: dict) -> bool:
    """No request queued, running or parked (a parked one holds KV blocks)."""
    return (res["runningRequestNum"] == 0 and res["waitingRequestNum"] == 0
            and res["availBlockNum"] == res["totalNpuBlockNums"])


def _success(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("request_success_total"))


def _stream_until_started(url: str, started: threading.Event) -> None:
    body = {"prompt": "Tell me a long story.", "stream": True, "max_tokens": 400,
            "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
            for chunk in r.iter_bytes():
                if b"\0" in chunk:
                    started.set()
    except httpx.HTTPError:
        pass  # the coordinator is killed under it


def test_killed_coordinator_leaves_no_block_held(cl):
    """kill -9 the coordinator with streams in flight: P frees what it held (its client
    is gone; parked copies by kv_trans_timeout), D aborts its requests once no /dresult
    consumer has come back for the orphan bound; a new coordinator then serves."""
    p, d3 = cl["p"], cl["d3"]
    first = coordinator(cl["tmp"], [p], [d3], name="coord_killed").start()
    try:
        first.wait_ready("/v1/readiness")
        events = [threading.Event() for _ in range(3)]
        threads = [threading.Thread(target=_stream_until_started, args=(first.url, e))
                   for e in events]
        for t in threads:
            t.start()
        for e in events:
            assert e.wait(120)
        assert d3.status()["resource"]["runningRequestNum"] > 0
        first.kill()
        for t in threads:
            t.join(60)
        d3.assert_leak_free(timeout=60)
        p.assert_leak_free(timeout=60)
    finally:
        first.kill()
    second = coordinator(cl["tmp"], [p], [d3], name="coord_new").start()
    try:
        second.wait_ready("/v1/readiness")
        status, text = _vllm_text(second.url, {"prompt": "Hi", "max_tokens": 4})
        assert status == 200, text
        d3.assert_leak_free()
    finally:
        second.stop()


def test_management_port_offline_p_and_add_d(cl):
    """Through the management port: a P taken offline finishes its in-flight stream and
    gets no new request; a D added at run time is linked and takes new requests."""
    from tests.integration.pd_cluster import free_port

    p, p2, d3, d = cl["p"], cl["p2"], cl["d3"], cl["d"]
    mport = free_port()
    coord = coordinator(cl["tmp"], [p, p2], [d3], "--management-port", str(mport),
                        name="coord_manage").start()
    mgmt = f"http://127.0.0.1:{mport}"
    try:
        coord.wait_ready("/v1/models")
        deadline = time.monotonic() + 60
        while httpx.get(mgmt + "/v1/readiness", timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        # ~1,450 prompt tokens: the P holds it for its prefill (~1 s or more on 2 cores, on
        # every weight path), long enough for the poll below to see it
        story = " ".join(["Once upon a time a cat walked along the river bank."] * 120)
        body = {"prompt": story, "stream": True, "max_tokens": 120, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_stream_chunks, coord.url, body)
            deadline = time.monotonic() + 120
            busy = None
            while busy is None:  # the P prefilling it
                assert time.monotonic() < deadline, "no P ever held the request"
                rows = httpx.get(mgmt + "/v1/instances", timeout=10).json()["instances"]
                busy = next((r["name"] for r in rows
                             if r["kind"] == "prefill" and r["outstanding"]), None)
            drained = p if p.addr == busy else p2
            other = p2 if drained is p else p
            r = httpx.post(mgmt + "/v1/instances/offline", json={"ids": [drained.addr]},
                           timeout=10)
            assert r.json() == {"result": "ok"}
            assert stream.result(timeout=300) >= 100  # the in-flight request ran to its end
        before = _success(drained.url), _success(other.url)
        for i in range(3):
            status, _ = _vllm_text(coord.url, {"prompt": f"Hi {i}", "max_tokens": 4})
            assert status == 200
        assert _success(drained.url) == before[0]
        assert _success(other.url) == before[1] + 3
        r = httpx.post(mgmt + "/v1/instances/add", json={"decode": [d.addr]}, timeout=10)
        assert r.json()["added"] == [f"decode {d.addr}"]
        deadline = time.monotonic() + 60
        while not any(row["name"] == d.addr and row["state"] == "ready" for row in
                      httpx.get(mgmt + "/v1/instances", timeout=10).json()["instances"]):
            assert time.monotonic() < deadline, "the added D never became ready"
            time.sleep(0.2)
        runs = _decoded(d.url)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda i: _vllm_text(
                coord.url, {"prompt": f"Count {i}", "max_tokens": 8}), range(4)))
        assert all(s == 200 for s, _ in got)
        assert _decoded(d.url) > runs  # the new D took some of them
        text = httpx.get(coord.url + "/metrics", timeout=30).text
        assert 'coordinator_requests_total{route="generate",status="200"}' in text
        assert f'instance="{p.addr}"' in text and f'instance="{d.addr}"' in text
        assert "instance_request_success_total{" in text  # the instances' own series
        assert "\nrequest_success_total{" in text  # the cluster's (issue 40)
        httpx.post(mgmt + "/v1/instances/remove", json={"decode": [d.addr]}, timeout=10)
        for proc in (p, p2, d3, d):
            proc.assert_leak_free()
    finally:
        coord.stop()


def _stream_chunks(url: str, body: dict) -> int:
    """A vLLM stream to its end: how many chunks it had."""
    n = 0
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        for chunk in r.iter_bytes():
            n += chunk.count(b"\0")
    return n


def _decoded(url: str) -> float:
    """Requests a decode instance finished (its request_success_total)."""
    return _success(url)


def test_a_stopped_d_finishes_its_streams_then_exits_without_waiting_on_dresult(cl):
    """SIGINT a decode instance while a stream runs through it: the stream still gets every
    token (its messages go out on the open /dresult), then D ends /dresult with the close
    message and exits 0 at once, instead of holding the coordinator's /dresult stream
    for its whole drain time (a new user saw a stopped D stay up with 'draining 1
    requests' and no request in flight)."""
    d = instance("d_stop", cl["tmp"], "--role", "decode", "--timeout-graceful-shutdown", "60").start()
    coord = coordinator(cl["tmp"], [cl["p"]], [d], name="coord_dstop").start()
    try:
        d.wait_ready()
        coord.wait_ready("/v1/readiness")
        body = {"prompt": "Count slowly.", "stream": True, "max_tokens": 48,
                "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stream = pool.submit(_stream_chunks, coord.url, body)
            deadline = time.monotonic() + 60
            while d.status()["resource"]["runningRequestNum"] == 0:
                assert time.monotonic() < deadline and not stream.done()
                time.sleep(0.05)
            assert d.proc is not None
            d.proc.send_signal(signal.SIGINT)
            assert stream.result(timeout=120) >= 48  # every token, then the end
        ended = time.monotonic()
        assert d.proc.wait(30) == 0
        assert time.monotonic() - ended < 15, "D waited on /dresult for its drain time"
        log = d.log.read_text()
        assert "draining" in log and "drain time ended" not in log
        cl["p"].assert_leak_free()
    finally:
        coord.stop()
        d.stop()
