"""PD end to end on real processes (issue: coordinator + P + D with the real model): every
family, stream and non-stream, through the coordinator gives what a mixed instance gives
(ids, timings and random seeds aside); a seeded sampled request too; requests spread over
two decode instances, and killing one mid-stream loses and repeats nothing; a decode
instance too small for its requests sends ``retry:`` and the outputs stay identical; after
every scenario each instance's KV blocks are all free. The processes come from the
session fixture ``pd`` (tests/integration/conftest.py)."""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.pd_cluster import module_coordinators
from tokenserve.api.routes import ROUTES, Coord, path_of

CHAT = [{"role": "user", "content": "Name three colours."}]
#: fields that differ by timing or by the serving instance's state (``cached_tokens``: how
#: much of the prompt that instance's prefix cache held), not by the answer
VOLATILE = frozenset({"id", "created", "prefill_time", "decode_time", "seed",
                      "firstTokenCost", "decodeTime", "system_fingerprint", "request_id",
                      "cached_tokens"})

CASES = [  # (path, body) pairs; each runs as stream and non-stream where the family can
    ("/infer", {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 12,
                                                                      "details": True}}),
    ("/generate", {"inputs": "The capital of France is",
                   "parameters": {"max_new_tokens": 12, "details": True}}),
    ("/generate", {"prompt": "The capital of France is", "max_tokens": 12}),
    ("/v1/chat/completions", {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": CHAT,
                              "max_tokens": 16, "temperature": 0}),
    ("/v1/completions", {"model": "SmolLM2-135M-Instruct.Q4_1",
                         "prompt": "The capital of France is", "max_tokens": 12,
                         "temperature": 0}),
    ("/v2/models/SmolLM2-135M-Instruct.Q4_1/generate",
     {"text_input": "The capital of France is", "parameters": {"max_new_tokens": 12}}),
]


@pytest.fixture(scope="module")
def pd(pd, tmp_path_factory):
    """The session's PD processes plus this module's coordinators: ``coord`` (p; d, d2)
    and ``coord_tiny`` (p; tiny), stopped at the end of the module (each decode instance
    has one /dresult consumer)."""
    with module_coordinators(pd, tmp_path_factory.mktemp("coord"), "coord") as procs:
        yield procs


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def normalise(raw: bytes) -> list[Any]:
    """A response body as a list of JSON documents without the volatile fields: SSE
    events (``data: {...}``), vLLM's NUL-separated chunks, or one whole document."""
    text = raw.decode()
    if text.startswith("data:"):
        out = []
        for event in text.split("\n\n"):
            if event:
                payload = event.removeprefix("data:").strip()
                out.append(payload if payload == "[DONE]" else _clean(orjson.loads(payload)))
        return out
    return [_clean(orjson.loads(c)) for c in text.split("\0") if c]


def _stream_variant(path: str, body: dict) -> tuple[str, dict]:
    if path == "/generate" and "inputs" in body:
        return "/generate_stream", body
    if path.startswith("/v2/models/"):
        return path + "_stream", body
    return path, {**body, "stream": True}


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=180)


def _assert_all_free(pd) -> None:
    for name in ("p", "d", "d2", "tiny"):
        proc = pd[name]
        if proc.proc is not None and proc.proc.poll() is None:
            proc.assert_leak_free()


@pytest.mark.parametrize(("path", "body"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_coordinator_equals_mixed(pd, path, body, stream):
    if stream:
        path, body = _stream_variant(path, body)
    got = _post(pd["coord"].url, path, body)
    want = _post(pd["mixed"].url, path, body)
    assert got.status_code == want.status_code == 200, got.text
    assert normalise(got.content) == normalise(want.content)
    _assert_all_free(pd)


def test_triton_token_infer_and_tgi_root_equal_mixed(pd):
    """The routes the table above leaves out: Triton ``infer`` (token ids in and out, no
    stream) and TGI's ``POST /`` (stream chosen by the body)."""
    ids = [504, 3575, 282, 4649, 314]
    triton = {"id": "r1", "inputs": [{"name": "input0", "datatype": "UINT32",
                                      "shape": [1, len(ids)], "data": ids,
                                      "parameters": {"max_new_tokens": 8}}],
              "outputs": [{"name": "output0"}]}
    path = "/v2/models/SmolLM2-135M-Instruct.Q4_1/infer"
    tgi = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}
    for p, body in ((path, triton), ("/", tgi), ("/", {**tgi, "stream": True})):
        got, want = _post(pd["coord"].url, p, body), _post(pd["mixed"].url, p, body)
        assert got.status_code == want.status_code == 200, got.text
        assert normalise(got.content) == normalise(want.content)
    _assert_all_free(pd)


def test_seeded_sampled_request_equals_mixed(pd):
    body = {"inputs": "Tell me a story.", "stream": True,
            "parameters": {"max_new_tokens": 24, "do_sample": True, "temperature": 0.9,
                           "top_p": 0.9, "seed": 42}}
    got = _post(pd["coord"].url, "/infer", body)
    want = _post(pd["mixed"].url, "/infer", body)
    assert normalise(got.content) == normalise(want.content)
    _assert_all_free(pd)


@pytest.mark.parametrize("route", [r for r in ROUTES if r.coordinator is Coord.FORWARD
                                   and r.method == "GET"], ids=lambda r: r.name)
def test_forwarded_routes_answer_as_a_mixed_server(pd, route):
    """Every GET route the table tells the coordinator to forward answers as a mixed
    server does (status, content type, body; ``created``, a server's start time, aside;
    ``/metrics-json``: its metric names, the values are each server's own)."""
    path = path_of(route.name, model="SmolLM2-135M-Instruct.Q4_1", n="1") \
        if "{" in route.path else route.path
    got = httpx.get(pd["coord"].url + path, timeout=30)
    want = httpx.get(pd["mixed"].url + path, timeout=30)
    assert (got.status_code, got.headers.get("content-type")) == \
        (want.status_code, want.headers.get("content-type")), got.text
    if route.name == "server.metrics_json":
        def names(r: httpx.Response) -> list[str]:
            return [m["metric"][0]["__name__"] for m in r.json()["result"]]
        assert names(got) == names(want) and names(got)
    elif got.headers.get("content-type", "").startswith("application/json") and got.content:
        assert _clean(got.json()) == _clean(want.json())
    else:
        assert got.content == want.content


def test_info_and_slot_count_give_the_decode_instances_slots(pd):
    """issue 40: ``/info`` ``max_concurrent_requests`` and ``getSlotCount`` ``total_slots``
    are one number on the coordinator, the sum over its decode instances (``coord``: d and
    d2, 32 each; coordinator/capacity.py); the rest of ``/info`` is what a mixed server
    answers."""
    model = "SmolLM2-135M-Instruct.Q4_1"
    got = httpx.get(pd["coord"].url + "/info", timeout=30)
    want = httpx.get(pd["mixed"].url + "/info", timeout=30)
    assert got.status_code == want.status_code == 200
    assert got.headers["content-type"] == want.headers["content-type"]
    slots = httpx.get(pd["coord"].url + f"/v2/models/{model}/getSlotCount", timeout=30).json()
    assert got.json()["max_concurrent_requests"] == slots["total_slots"] == 32 + 32
    assert {**got.json(), "max_concurrent_requests": 32} == want.json()


def _counter(url: str, name: str) -> float:
    """The sum of ``name``'s samples in ``url``'s /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in
               re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def test_a_hand_off_is_a_success_on_p(pd):
    """P's /metrics counts a request it handed to D as a success, not a failure."""
    ok0, failed0 = (_counter(pd["p"].url, f"request_{k}_total") for k in ("success", "failed"))
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}
    assert _post(pd["coord"].url, "/infer", body).status_code == 200
    ok1, failed1 = (_counter(pd["p"].url, f"request_{k}_total") for k in ("success", "failed"))
    assert (ok1 - ok0, failed1 - failed0) == (1, 0)
    _assert_all_free(pd)


def test_bad_request_is_answered_by_p_in_its_family_shape(pd):
    bad = {"inputs": "x", "parameters": {"max_new_tokens": -3}}
    got, want = _post(pd["coord"].url, "/infer", bad), _post(pd["mixed"].url, "/infer", bad)
    assert got.status_code == want.status_code == 422
    assert got.json() == want.json()


def test_openai_client_through_the_coordinator(pd):
    import openai

    client = openai.OpenAI(base_url=pd["coord"].url + "/v1", api_key="x", max_retries=0)
    model = CASES[3][1]["model"]
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8,
                                       temperature=0)
    ref = openai.OpenAI(base_url=pd["mixed"].url + "/v1", api_key="x").chat.completions \
        .create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == ref.choices[0].message.content
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == ref.choices[0].message.content


def _stream_text(url: str, body: dict, started: threading.Event | None = None) -> str:
    """A vLLM ``/generate`` stream's text (NUL-framed incremental chunks); ``started`` is
    set after 3 chunks."""
    texts = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        buf = b""
        for chunk in r.iter_bytes():
            buf += chunk
            while b"\0" in buf:
                piece, buf = buf.split(b"\0", 1)
                texts.append(orjson.loads(piece)["text"][0])
                if len(texts) == 3 and started is not None:
                    started.set()
    return "".join(texts)


def _long(prompt: str, n: int) -> dict:
    return {"prompt": prompt, "stream": True, "max_tokens": n, "ignore_eos": True}


def test_small_decode_instance_recomputes_and_outputs_stay_identical(pd):
    """coord_tiny's only D holds 24 KV blocks: two 250-token generations do not fit, the
    later one is evicted (``retry:``), resubmitted to P with ``is-recompute``, and both
    streams still equal the mixed instance's."""
    bodies = [_long(p, 250)
              for p in ("The capital of France is", "Write a long story about a dragon.")]
    evicted_before = _metric(pd["tiny"], "num_preemptions")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda b: _stream_text(pd["coord_tiny"].url, b), bodies))
        want = list(pool.map(lambda b: _stream_text(pd["mixed"].url, b), bodies))
    assert got == want and all(len(t) > 500 for t in got)
    assert _metric(pd["tiny"], "num_preemptions") > evicted_before
    _assert_all_free(pd)


def _metric(proc, name: str) -> float:
    """A counter from the instance's Prometheus ``/metrics`` (0 when absent)."""
    text = httpx.get(proc.url + "/metrics", timeout=10).text
    m = re.search(rf"^\S*{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_client_disconnect_stops_the_request_on_p_and_d(pd):
    """A client that hangs up mid-stream: the coordinator stops the request on P and D
    (stopInfer) and D frees its KV blocks at once, long before the 400 tokens would end."""
    with httpx.stream("POST", pd["coord"].url + "/generate", json=_long("Tell me", 400),
                      timeout=60) as r:
        assert r.status_code == 200
        got = 0
        for chunk in r.iter_bytes():
            got += chunk.count(b"\0")
            if got >= 3:
                break
    for name in ("d", "d2", "p"):
        pd[name].assert_leak_free(timeout=3.0)


def test_requests_spread_and_a_dying_decode_instance_loses_nothing(pd):
    """Six long streams through coord spread over d and d2; d2 is killed once every stream
    is under way: its requests are recomputed on d and every stream's text still equals
    the mixed instance's. (Runs last: d2 stays dead.)"""
    prompts = [f"Write a story number {i} about a cat." for i in range(6)]
    bodies = [_long(p, 120) for p in prompts]
    running_before = {n: pd[n].status()["resource"]["totalNpuBlockNums"] for n in ("d", "d2")}
    assert all(running_before.values())
    events = [threading.Event() for _ in bodies]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_stream_text, pd["coord"].url, b, e)
                   for b, e in zip(bodies, events, strict=True)]
        for e in events:
            assert e.wait(120)
        used = {n: pd[n].status()["resource"]["runningRequestNum"] for n in ("d", "d2")}
        assert used["d"] > 0 and used["d2"] > 0, used  # spread over both
        pd["d2"].kill()
        got = [f.result(timeout=300) for f in futures]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        want = list(pool.map(lambda b: _stream_text(pd["mixed"].url, b), bodies))
    assert got == want
    time.sleep(0.5)
    _assert_all_free(pd)


def _evicted_later(pd, send) -> tuple[Any, Any, float]:
    """Run ``send(url)`` on coord_tiny while a 250-token generation already fills its D
    (so the later request is the one evicted and recomputed, issue 22), and on the mixed
    instance: (coordinator answer, mixed answer, recomputes counted by coord_tiny)."""
    before = _metric(pd["coord_tiny"], "coordinator_recomputes")
    started = threading.Event()
    filler = _long("Write a long story about a dragon.", 250)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fill = pool.submit(_stream_text, pd["coord_tiny"].url, filler, started)
        assert started.wait(120)
        got = send(pd["coord_tiny"].url)
        fill.result()
    want = send(pd["mixed"].url)
    return got, want, _metric(pd["coord_tiny"], "coordinator_recomputes") - before


def test_recomputed_non_stream_answer_keeps_every_logprob(pd):
    """A non-stream answer with logprobs whose request was evicted on D and recomputed
    on P lists every token's entry, equal to a mixed server's (greedy): D's retry body
    carries the logprobs of the tokens so far (``origin_logprobs``)."""
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "The capital of France is",
            "max_tokens": 250,
            "ignore_eos": True, "logprobs": 2, "temperature": 0}

    def send(url: str) -> httpx.Response:
        return _post(url, "/v1/completions", body)

    got, want, recomputes = _evicted_later(pd, send)
    assert got.status_code == want.status_code == 200, got.text
    assert recomputes >= 1
    g = got.json()["choices"][0]["logprobs"]
    assert len(g["tokens"]) == len(g["token_logprobs"]) == 250
    assert normalise(got.content) == normalise(want.content)
    _assert_all_free(pd)


def test_recomputed_triton_binary_infer_equals_mixed(pd, live):
    """Triton's binary tensors (Inference-Header-Content-Length) through an eviction and
    a recompute: the recompute body carries the bytes (``origin_binary``), the answer is
    a mixed server's, byte for byte but its id."""
    import numpy as np

    ids = live.chat_ids("Tell me a long story about a dragon.")  # a long answer
    head = orjson.dumps({"inputs": [{"name": "input0", "datatype": "UINT32",
                                     "shape": [1, len(ids)],
                                     "parameters": {"binary_data_size": 4 * len(ids),
                                                    "max_new_tokens": 250}}],
                         "outputs": [{"name": "output0",
                                      "parameters": {"binary_data": True}}]})
    raw = head + np.asarray(ids, dtype="<u4").tobytes()
    path = "/v2/models/SmolLM2-135M-Instruct.Q4_1/infer"

    def send(url: str) -> httpx.Response:
        return httpx.post(url + path, content=raw, timeout=180, headers={
            "content-type": "application/octet-stream",
            "inference-header-content-length": str(len(head))})

    got, want, recomputes = _evicted_later(pd, send)
    assert got.status_code == want.status_code == 200, got.text
    assert recomputes >= 1
    assert got.headers["content-type"] == want.headers["content-type"] \
        == "application/octet-stream"
    gn = int(got.headers["inference-header-content-length"])
    wn = int(want.headers["inference-header-content-length"])
    assert got.content[gn:] == want.content[wn:] and len(got.content[gn:]) > 0
    assert _clean(orjson.loads(got.content[:gn])) == _clean(orjson.loads(want.content[:wn]))
    _assert_all_free(pd)
