"""OpenAI tool calls through the PD coordinator (issue 23): P prefills under the tools'
grammar, D goes on from P's token under the same grammar, and the answer, whole and
streamed, is what a mixed instance gives (ids and clocks aside). Real processes from the
session fixture ``pd`` (tests/integration/conftest.py), this module's own coordinator."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.integration.pd_cluster import coordinator
from tests.integration.test_pd_cluster import normalise

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
        "max_tokens": 60, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(pd, tmp_path_factory):
    coord = coordinator(tmp_path_factory.mktemp("coord_tools"), [pd["p"]], [pd["d"]],
                        name="coord_tools")
    try:
        coord.start()
        coord.wait_ready("/v1/health")
        yield {**pd, "coord": coord}
    finally:
        coord.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_call_through_the_coordinator_equals_mixed(cluster, stream):
    body = {**BODY, "stream": stream}
    got = httpx.post(cluster["coord"].url + "/v1/chat/completions", json=body, timeout=300)
    want = httpx.post(cluster["mixed"].url + "/v1/chat/completions", json=body, timeout=300)
    assert got.status_code == want.status_code == 200, got.text
    assert normalise(got.content) == normalise(want.content)
    if not stream:
        choice = got.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            WEATHER["function"]["parameters"])
    for name in ("p", "d"):
        cluster[name].assert_leak_free()
