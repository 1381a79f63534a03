"""The recompute body (spec/pd_disaggregation.md §7.2): built from the client's body and a
token history, parsed back to exactly that body and history, for every family."""

from __future__ import annotations

import pytest

from tokenserve.pd.messages import History
from tokenserve.pd.recompute import (
    build_recompute_body,
    parse_recompute_body,
)

CASES = [
    ("/infer", {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 9}},
     "inputs"),
    ("/infer_token", {"input_id": [1, 2, 3], "stream": False}, "inputs"),
    ("/generate", {"inputs": "Hi", "parameters": {"details": True}}, "inputs"),
    ("/generate", {"prompt": "Hi", "max_tokens": 5}, "prompt"),
    ("/generate_stream", {"inputs": "Hi"}, "inputs"),
    ("/", {"inputs": "Hi", "stream": True}, "inputs"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]},
     "messages"),
    ("/v1/completions", {"model": "m", "prompt": "Once"}, "prompt"),
    ("/v2/models/m/generate_stream", {"text_input": "Hi", "parameters": {}}, "text_input"),
]


@pytest.mark.parametrize(("path", "body", "field"), CASES)
def test_round_trip(path, body, field):
    history = [5, 6, 7, 100, 101]
    rb = build_recompute_body(path, body, history, 3)
    assert rb[field] == "3,5,6,7,100,101"
    assert "input_id" not in rb
    restored, prompt, outputs = parse_recompute_body(path, rb)
    assert restored == body and prompt == [5, 6, 7] and outputs == [100, 101]


def test_triton_infer_uses_the_uint32_list():
    body = {"id": "a", "inputs": [{"name": "input0", "datatype": "UINT32", "shape": [1, 2],
                                   "data": [8, 9], "parameters": {"max_new_tokens": 4}}]}
    rb = build_recompute_body("/v2/models/m/infer", body, [8, 9, 40], 2)
    assert rb["inputs"][0]["data"] == [2, 8, 9, 40] and rb["inputs"][0]["shape"] == [1, 4]
    assert body["inputs"][0]["data"] == [8, 9]  # the original is untouched
    restored, prompt, outputs = parse_recompute_body("/v2/models/m/infer", rb)
    assert restored == body and prompt == [8, 9] and outputs == [40]


def test_history_codec():
    assert History((1, 2), (3,)).encode() == "2,1,2,3"
    assert History.decode("2,1,2,3") == History((1, 2), (3,))
    assert History.decode("1,7") == History((7,))
    for bad in ("", "0,1", "3,1,2", "a,b", "2,1,-2", None, [1.5, 2]):
        with pytest.raises(ValueError):
            History.decode(bad)


def test_errors():
    with pytest.raises(ValueError):
        build_recompute_body("/v1/models", {}, [1], 1)
    with pytest.raises(ValueError):
        build_recompute_body("/infer", {"inputs": "x"}, [1, 2], 3)
    with pytest.raises(ValueError):
        parse_recompute_body("/infer", {"inputs": "1,2"})  # no origin_inputs
