"""PD over tensor parallelism on real processes (issue 41): a P and a D each served with
``--tensor-parallel-size 2`` behind ``tokenserve coordinator`` hand the KV off rank to rank
over Mooncake, and every API family's greedy answer (and a streamed one) through them is
the bytes a mixed ``-tp 2`` server sends (ids and timings aside: the same reduction order
gives the same bits); both instances are leak-free afterwards. A P of two ranks and a D of
one are never paired: the coordinator says so in one line and no request gets through.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from tests.integration.pd_cluster import Proc, coordinator, instance
from tests.integration.test_pd_cluster import normalise

KV_BYTES = 16 << 20
TP2 = ("--tensor-parallel-size", "2")
MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]
#: (path, body, stream) of each family: non-stream answers of all, one streamed
CASES = [
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 8,
                              "temperature": 0}),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                         "temperature": 0}),
    ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}}),  # TGI
    ("/infer", {"inputs": PROMPT, "stream": False, "parameters": {"max_new_tokens": 8}}),
    ("/generate", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}),  # vLLM
    (f"/v2/models/{MODEL}/generate", {"text_input": PROMPT,
                                      "parameters": {"max_new_tokens": 8}}),  # Triton
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 8,
                              "temperature": 0, "stream": True}),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """mixed -tp 2; P -tp 2, D -tp 2 behind ``coord``; D -tp 1 with the same P behind
    ``coord_mismatch`` (which then never becomes ready). Started together (they load
    concurrently), stopped at the end."""
    tmp = tmp_path_factory.mktemp("pd_tp")
    serve = {"mixed": instance("tp_mixed", tmp, *TP2, kv_bytes=KV_BYTES),
             "p": instance("tp_p", tmp, *TP2, "--role", "prefill", kv_bytes=KV_BYTES),
             "d": instance("tp_d", tmp, *TP2, "--role", "decode", kv_bytes=KV_BYTES),
             "d1": instance("tp1_d", tmp, "--role", "decode", kv_bytes=KV_BYTES)}
    coords = {"coord": coordinator(tmp, [serve["p"]], [serve["d"]], name="tp_coord"),
              "coord_mismatch": coordinator(tmp, [serve["p"]], [serve["d1"]],
                                            "--schedule-timeout", "3",
                                            name="tp_coord_mismatch")}
    procs: dict[str, Proc] = {**serve, **coords}
    try:
        for p in procs.values():
            p.start()
        for p in serve.values():
            p.wait_ready()
        coords["coord"].wait_ready("/v1/health")
        yield procs
    finally:  # coordinators first: a D drains its open /dresult stream otherwise
        for p in reversed(procs.values()):
            p.stop()


def _answer(url: str, path: str, body: dict) -> tuple[int, list]:
    r = httpx.post(url + path, json=body, timeout=120)
    return r.status_code, normalise(r.content) if r.status_code == 200 else [r.text]


def test_every_family_through_tp2_p_and_d_equals_a_tp2_mixed_server(cluster) -> None:
    mixed, coord = cluster["mixed"], cluster["coord"]
    for path, body in CASES:
        want = _answer(mixed.url, path, body)
        got = _answer(coord.url, path, body)
        assert want[0] == 200, (path, want)
        assert got == want, (path, body)
    assert len(want[1]) > 3  # the streamed case: several events, [DONE] last
    # the hand-off went rank to rank: D's ranks pulled (its log: no failure), and each
    # instance registered one region per rank
    for name in ("p", "d"):
        log = cluster[name].log.read_text()
        assert log.count("KV transfer: Mooncake tcp engine") == 2, name
        assert "KV pull" not in log, name  # no pull failed, on any rank
    cluster["p"].assert_leak_free()
    cluster["d"].assert_leak_free()
    assert cluster["d"].status()["resource"]["worldSize"] == 2


def test_concurrent_hand_offs_pull_while_other_requests_decode(cluster) -> None:
    """Eight requests at once: D's ranks pull new requests' shards on their own
    threads while their step loops decode the others; every answer is still the mixed
    server's (greedy tokens are batch-invariant), and nothing leaks."""
    bodies = [{"model": MODEL, "prompt": f"{i} + {i} equals", "max_tokens": 12,
               "temperature": 0, "ignore_eos": True} for i in range(8)]
    want = [_answer(cluster["mixed"].url, "/v1/completions", b) for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        got = list(pool.map(lambda b: _answer(cluster["coord"].url, "/v1/completions", b),
                            bodies))
    assert got == want
    cluster["p"].assert_leak_free()
    cluster["d"].assert_leak_free()


def test_a_p_and_a_d_of_different_world_sizes_are_never_paired(cluster) -> None:
    coord: Proc = cluster["coord_mismatch"]
    line = (f"P {cluster['p'].addr} (worldSize 2) and D {cluster['d1'].addr} (worldSize 1) "
            "cannot be linked: the KV hand-off is rank to rank")
    deadline = time.monotonic() + 60
    while line not in coord.log.read_text():
        assert time.monotonic() < deadline, coord.log.read_text()[-2000:]
        time.sleep(0.3)
    status, _ = _answer(coord.url, *CASES[1])
    assert status == 503  # the coordinator is not ready: no P has a D of its worldSize
    assert coord.log.read_text().count("cannot be linked") == 1  # once, not per poll
    cluster["d1"].assert_leak_free()
