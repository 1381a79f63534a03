"""Prompt log-probabilities through the PD coordinator (real processes, the session's
``pd`` fixture): P computes them while it prefills and hands them to D with the request
(``DecodeParameters.promptLogprobs``), so every answer equals a mixed instance's, bit for
bit (ids and clocks aside); ``max_tokens: 0`` is answered by P alone (no hand-off)."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.pd_cluster import coordinator
from tests.integration.test_pd_cluster import normalise

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"

CASES = [  # (name, path, body); each runs whole and streamed where the family can
    ("echo-prompt-only", "/v1/completions",
     {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}),
    ("echo-and-generate", "/v1/completions",
     {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 6,
      "temperature": 0}),
    ("lm-eval-ids", "/v1/completions",
     {"model": MODEL, "prompt": [[504, 3575, 282, 4649, 314, 7042]], "echo": True,
      "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}),
    ("vllm-ext", "/v1/completions",
     {"model": MODEL, "prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 5,
      "temperature": 0}),
    ("vllm-generate", "/generate",
     {"prompt": PROMPT, "prompt_logprobs": 1, "max_tokens": 5, "temperature": 0}),
]


@pytest.fixture(scope="module")
def cluster(pd, tmp_path_factory):
    coord = coordinator(tmp_path_factory.mktemp("coord-plp"), [pd["p"]], [pd["d"]],
                        name="coord_plp")
    coord.start()
    try:
        coord.wait_ready("/v1/health")
        yield {**pd, "coord": coord}
    finally:
        coord.stop()


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=300)


def _leak_free(cluster) -> None:
    for name in ("p", "d", "mixed"):
        cluster[name].assert_leak_free()


@pytest.mark.parametrize(("name", "path", "body"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_prompt_logprobs_through_coordinator_equal_mixed(cluster, name, path, body, stream):
    if stream:
        body = {**body, "stream": True}
    got = _post(cluster["coord"].url, path, body)
    want = _post(cluster["mixed"].url, path, body)
    assert got.status_code == want.status_code == 200, got.text
    assert normalise(got.content) == normalise(want.content)
    assert b"logprob" in got.content
    _leak_free(cluster)


def test_tgi_decoder_input_details_through_coordinator_equals_mixed(cluster):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True,
                                             "decoder_input_details": True}}
    got = _post(cluster["coord"].url, "/generate", body)
    want = _post(cluster["mixed"].url, "/generate", body)
    assert got.status_code == want.status_code == 200, got.text
    assert normalise(got.content) == normalise(want.content)
    prefill = got.json()["details"]["prefill"]
    assert prefill[0]["logprob"] is None and all(t["logprob"] < 0 for t in prefill[1:])
    _leak_free(cluster)
