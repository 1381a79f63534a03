"""The PD wire protocol between coordinator, P and D (spec/pd_disaggregation.md §13 items
1-6), on real processes serving the real model: P's header gate and answers, ``/dresult``
framing, heartbeat and single consumer, exactly one ``lastData``, the recompute body of a
forced D-side eviction and its resubmission. The coordinator's side is in
test_pd_coordinator.py.
"""

from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest

from tests.integration.pd_cluster import Proc
from tokenserve.pd.wire import CLOSE_ID, DMessage, DresultParser

PROMPT = "The capital of France is"


@pytest.fixture
def cluster(pd):
    return pd


class DresultReader:
    """One ``GET /dresult`` consumer in a thread: every parsed message, in order."""

    def __init__(self, d: Proc) -> None:
        self.messages: list[DMessage] = []
        self.chunks: list[bytes] = []
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.ended = threading.Event()
        self._cond = threading.Condition()
        self._url = d.url + "/dresult"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while self.status is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.status is not None, "no /dresult answer"

    def _run(self) -> None:
        parser = DresultParser()
        try:
            with httpx.stream("GET", self._url, timeout=httpx.Timeout(60, read=30)) as r:
                self.status, self.headers = r.status_code, dict(r.headers)
                for chunk in r.iter_raw():
                    with self._cond:
                        self.chunks.append(chunk)
                        self.messages.extend(parser.feed(chunk))
                        self._cond.notify_all()
        except httpx.HTTPError:
            pass
        finally:
            self.ended.set()
            with self._cond:
                self._cond.notify_all()

    def of(self, req_id: str) -> list[DMessage]:
        return [m for m in self.messages if m.req_id == req_id]

    def wait_end(self, req_id: str, timeout: float = 60) -> list[DMessage]:
        """The messages of ``req_id`` up to its lastData / error / retry."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(m.kind in ("lastData", "error", "retry") for m in self.of(req_id)):
                left = deadline - time.monotonic()
                assert left > 0 and not self.ended.is_set(), f"no end for {req_id}"
                self._cond.wait(left)
            return self.of(req_id)


def pd_headers(d: Proc, req_id: str, **extra: str) -> dict[str, str]:
    return {"req-type": "prefill", "req-id": req_id, "d-target": f"127.0.0.1;{d.port}",
            **extra}


def post(proc: Proc, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(proc.url + path, json=body, headers=headers or {}, timeout=120)


# ------------------------------------------------------------------ item 1: header gate


@pytest.mark.parametrize(("headers", "message"), [
    ({}, "DMI request must have req-type, req-id, d-target headers"),
    ({"req-type": "prefill", "req-id": "12"}, "DMI request must have req-type"),
    ({"req-type": "prefill", "req-id": "12z", "d-target": "127.0.0.1"},
     "Invalid req-id, the character of req-id should be hex char [0-9, a-f, A-F], but got 12z"),
    ({"req-type": "prefill", "req-id": "a" * 1025, "d-target": "127.0.0.1"},
     "The length of req-id cannot exceed 1024"),
    ({"req-type": "decode", "req-id": "12", "d-target": "127.0.0.1"},
     "Parameter req-type must be prefill but got decode"),
    ({"req-type": "prefill", "req-id": "12", "d-target": "not-an-ip;1"},
     "Parameter d-target must be an IPv4 address"),
    ({"req-type": "prefill", "req-id": "12", "d-target": "127.0.0.1", "is-recompute": "yes"},
     "Parameter is-recompute is an optional parameter"),
])
def test_prefill_header_gate(cluster, headers, message):
    r = post(cluster["p"], "/infer", {"inputs": PROMPT}, headers)
    assert r.status_code == 400
    assert r.json()["error"].startswith(message) and r.json()["error_type"] == "Bad Request"


def test_inference_on_a_decode_instance_is_refused(cluster):
    r = post(cluster["d"], "/infer", {"inputs": PROMPT}, pd_headers(cluster["d"], "1"))
    assert r.status_code == 400 and "only to the prefill node" in r.json()["error"]


# ------------------------------------------------------------------ items 2-5


def test_stream_answer_shape_and_d_frames(cluster):
    p, d, mixed = cluster["p"], cluster["d"], cluster["mixed"]
    reader = DresultReader(d)
    assert reader.status == 200
    assert reader.headers["content-type"] == "text/event-stream"
    assert reader.headers.get("transfer-encoding") == "chunked"
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 12}}
    rid = "11528317054338029012"  # decimal ids are hex digits too (spec §3.3)
    r = post(p, "/infer", body, pd_headers(d, rid))
    assert r.status_code == 200
    assert list(r.json()) == ["reqId", "isStream", "isLastResp", "output"]
    ans = r.json()
    assert ans["reqId"] == rid and ans["isStream"] is True and ans["isLastResp"] is False
    assert ans["output"].startswith("data: {\"prefill_time\":")
    msgs = reader.wait_end(rid)
    kinds = [m.kind for m in msgs]
    assert kinds[0] == "ids" and kinds.count("lastData") == 1 and kinds[-1] == "lastData"
    assert "error" not in kinds and "retry" not in kinds
    for m in msgs:
        if m.kind == "data":
            assert m.body.startswith("data: ") and m.body.endswith("\n\n")
    # every message arrived whole in its chunk (spec §6.3: no field split across chunks)
    parser = DresultParser()
    for chunk in reader.chunks:
        assert chunk.endswith(b"\0")
        parser.feed(chunk)
    # the text equals a mixed instance's, event for event (timings aside)
    pd_events = [ans["output"]] + [m.body for m in msgs if m.kind in ("data", "lastData")]
    ref = httpx.post(mixed.url + "/infer", json=body, timeout=120).text
    strip = [orjson.loads(e[6:]) for e in "".join(pd_events).split("\n\n") if e]
    want = [orjson.loads(e[6:]) for e in ref.split("\n\n") if e]
    for ev in strip + want:
        ev.pop("prefill_time"), ev.pop("decode_time")
    assert strip == want
    # ids history: prompt then every token
    first = [int(x) for x in msgs[0].body.split(",")]
    ids = first[1 + first[0]:] + [int(x) for m in msgs[1:] if m.kind == "ids"
                                  for x in m.body.split(",")]
    assert len(ids) == 12
    p.assert_leak_free()
    d.assert_leak_free()


def test_non_stream_and_finished_on_p(cluster):
    p, d, mixed = cluster["p"], cluster["d"], cluster["mixed"]
    reader = DresultReader(d)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True}}
    r = post(p, "/generate", body, pd_headers(d, "abc1"))
    assert r.content == b'{"reqId":"abc1","isStream":false}'
    last = [m for m in reader.wait_end("abc1") if m.kind == "lastData"]
    assert len(last) == 1
    want = httpx.post(mixed.url + "/generate", json=body, timeout=120).json()
    got = orjson.loads(last[0].body)
    assert got["details"].pop("seed") != 0  # a greedy request's seed is drawn at random
    want["details"].pop("seed")
    assert got == want
    # finished on P: no D involved, the whole answer in output (spec §5.3)
    one = {"inputs": PROMPT, "parameters": {"max_new_tokens": 1}}
    r = post(p, "/generate", one, pd_headers(d, "abc2"))
    ans = r.json()
    assert list(ans) == ["reqId", "isStream", "isLastResp", "output"]
    assert ans["isLastResp"] is True
    assert orjson.loads(ans["output"]) == httpx.post(mixed.url + "/generate", json=one,
                                                     timeout=120).json()
    rs = post(p, "/generate_stream", one, pd_headers(d, "abc3")).json()
    assert rs["isStream"] is True and rs["isLastResp"] is True
    assert '"generated_text"' in rs["output"]
    time.sleep(0.5)
    assert reader.of("abc2") == [] and reader.of("abc3") == []
    p.assert_leak_free()
    d.assert_leak_free()


def test_dresult_refused_off_decode(cluster):
    r = httpx.get(cluster["mixed"].url + "/dresult", timeout=10)
    assert r.status_code == 400 and r.json()["error"] == "Non DMI does not support dresult request"
    r = httpx.get(cluster["p"].url + "/dresult", timeout=10)
    assert r.status_code == 400
    assert r.json()["error"] == "Only the Decode node supports dresult but you send to prefill"


def test_heartbeat_and_second_consumer(cluster):
    d = cluster["d"]
    first = DresultReader(d)
    time.sleep(5.6)
    assert b"ka:heartbeat\0" in b"".join(first.chunks)
    second = DresultReader(d)
    assert first.ended.wait(10)
    close = [m for m in first.messages if m.kind == "close"]
    assert len(close) == 1 and close[0].req_id == CLOSE_ID
    assert second.status == 200 and not second.ended.is_set()


# ------------------------------------------------------------------ item 6: recompute


def test_eviction_sends_retry_and_resubmission_continues(cluster):
    """A decode instance with a tiny KV cache (24 blocks) gets two long generations: one is
    evicted, and ``retry:`` carries its recompute body (prompt field ``L,p..,o..``, the
    original prompt in ``origin_inputs``). Resubmitted to P with ``is-recompute: true``
    (and another D) it continues; each stream's text, with nothing repeated, equals a mixed
    instance's (vLLM ``/generate``: NUL-framed incremental chunks)."""
    p, tiny, d, mixed = cluster["p"], cluster["tiny"], cluster["d"], cluster["mixed"]
    readers = {tiny.port: DresultReader(tiny), d.port: DresultReader(d)}
    prompts = {"e1": PROMPT, "e2": "Write a long story about a dragon."}
    bodies = {rid: {"prompt": text, "stream": True, "max_tokens": 300, "ignore_eos": True}
              for rid, text in prompts.items()}

    def events(raw: str) -> list[str]:
        raw = raw.replace("\n", "\0")  # /dresult bodies carry vLLM's NULs as newlines
        return [orjson.loads(c)["text"][0] for c in raw.split("\0") if c]

    texts = {rid: [] for rid in prompts}
    for rid, body in bodies.items():
        r = post(p, "/generate", body, pd_headers(tiny, rid))
        assert r.status_code == 200, r.text
        texts[rid] += events(r.json()["output"])
    retries = 0
    for rid, body in bodies.items():
        reader = readers[tiny.port]
        while True:
            msgs = reader.wait_end(rid, timeout=240)
            texts[rid] += [t for m in msgs if m.kind in ("data", "lastData")
                           for t in events(m.body)]
            end = msgs[-1]
            if end.kind == "lastData":
                break
            assert end.kind == "retry", end
            retries += 1
            rb = orjson.loads(end.body)
            nums = [int(x) for x in rb["prompt"].split(",")]
            assert rb["origin_inputs"] == prompts[rid] and 1 <= nums[0] < len(nums) - 1
            r = post(p, "/generate", rb, pd_headers(d, rid, **{"is-recompute": "true"}))
            assert r.status_code == 200, r.text
            texts[rid] += events(r.json()["output"])
            reader = readers[d.port]
    assert retries >= 1
    for rid, body in bodies.items():
        ref = httpx.post(mixed.url + "/generate", json=body, timeout=240).text
        assert "".join(texts[rid]) == "".join(events(ref)), rid
    for proc in (p, tiny, d):
        proc.assert_leak_free()
