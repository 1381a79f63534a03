"""The one description of each API family (tokenserve/api/families.py, issue 40) and what
its readers take from it: the coordinator's prompt reading, framing, stream end, the error
shape of the routes no family defines."""

from __future__ import annotations

import orjson
import pytest

from tokenserve.api.families import FAMILIES, Several, answering, describe
from tokenserve.api.routes import INFERENCE, Family
from tokenserve.coordinator.ingress import classify


def test_every_api_family_is_described_once() -> None:
    assert set(FAMILIES) == {Family.MINDIE, Family.TGI, Family.VLLM, Family.OPENAI,
                             Family.TRITON}
    # vLLM's one inference route is /generate, shared with TGI (routes.generate_family)
    assert {r.family for r in INFERENCE} | {Family.VLLM} == set(FAMILIES) | {Family.GENERATE}
    for family, desc in FAMILIES.items():
        assert desc.family is family and describe(family.value) is desc


def test_only_vllm_frames_nul_delimited_and_only_openai_ends_with_done() -> None:
    assert [f.value for f, d in FAMILIES.items() if d.framing.nul_delimited] == ["vllm"]
    assert [f.value for f, d in FAMILIES.items() if d.stream_end] == ["openai"]
    assert describe("openai").stream_end == b"data: [DONE]\n\n"
    assert {d.several for d in FAMILIES.values()} == {None, Several.CHOICES, Several.TEXTS}


@pytest.mark.parametrize(("path", "body", "family", "prompt"), [
    ("/infer", {"inputs": "abc"}, "mindie", "abc"),
    ("/infer_token", {"input_id": [1, 2]}, "mindie", "[1,2]"),  # the alias
    ("/v1/chat/completions", {"prompt": "p"}, "openai", "p"),  # no messages: prompt
    ("/v1/completions", {"prompt": [3, 4]}, "openai", "[3,4]"),
    ("/v2/models/m/generate", {"text_input": "t"}, "triton", "t"),
    ("/v2/models/m/infer", {"inputs": [{"data": [5, 6]}]}, "triton", "[5,6]"),  # tensor
    ("/v2/models/m/generate", {"inputs": [{"data": [7]}]}, "triton", "[7]"),
    ("/generate", {"prompt": "v"}, "vllm", "v"),
    ("/generate", {"inputs": "g", "input_id": [1]}, "tgi", "g"),
    ("/generate_stream", {"input_id": [1]}, "tgi", ""),  # no alias for TGI
])
def test_the_coordinator_reads_the_prompt_by_the_description(path, body, family,
                                                             prompt) -> None:
    ingress = classify(path, orjson.dumps(body))
    assert ingress.family == family and ingress.prompt == prompt
    assert ingress.description is describe(family)


def test_routes_no_family_defines_answer_errors_in_mindie_shape() -> None:
    mindie = {"error": "x", "error_type": "Service Unavailable"}
    for family in (Family.SERVER, Family.COORDINATOR, Family.GENERATE, Family.TGI,
                   Family.TRITON):
        assert orjson.loads(answering(family).error_body(503, "x")) == mindie
    assert orjson.loads(answering(Family.OPENAI).error_body(503, "x"))["error"]["code"] == 503
    with pytest.raises(KeyError):
        describe(Family.SERVER)
