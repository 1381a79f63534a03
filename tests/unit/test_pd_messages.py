"""The typed PD wire (tokenserve/pd/messages.py): every message round-trips, a malformed
one is refused with a WireError naming the key, unknown keys are ignored."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import replace

import orjson
import pytest

from tokenserve.messages import TokenLogprob
from tokenserve.pd.messages import (
    HOP_BY_HOP,
    PD_HEADERS,
    SAMPLING_FIELDS,
    DecodeParameters,
    DecodeVerdict,
    History,
    PrefillAnswer,
    PrefillHeaders,
    Release,
    RequestPlan,
    WireError,
    decode_ids,
    decode_logprobs,
    encode_ids,
    encode_logprobs,
    forward_headers,
)
from tokenserve.pd.recompute import RecomputeBody
from tokenserve.pd.wire import WholeAnswer
from tokenserve.sampling_params import ConstraintKind, SamplingParams, StructuredOutput

LP = TokenLogprob(7, -0.125, ((7, -0.125), (9, -2.5)), 1)
LP2 = TokenLogprob(9, -1e-30, (), 3)
#: every sampling field off its default (the test below checks that it is)
PARAMS = SamplingParams(
    max_new_tokens=7, temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.1,
    do_sample=True, seed=42, ignore_eos=True, stop_token_ids=(3, 4),
    skip_special_tokens=False, stop=("\n\n", "END"), include_stop_str_in_output=True,
    presence_penalty=0.5, frequency_penalty=-0.25, logprobs=2, min_p=0.05,
    speculative=False, structured=StructuredOutput(ConstraintKind.REGEX, "[a-z]+"),
    prompt_logprobs=1, keep_special_token_ids=(9,))


REGION = {"session_id": "h:1", "base_addr": 1, "num_layers": 2, "num_blocks": 3,
          "block_bytes": 4}


def full_parameters(**kw) -> DecodeParameters:
    full = DecodeParameters(
        req_id="123", tokens=(1, 2, 3), first_token=(4, 5), path="/v1/completions",
        block_table=((10, 11),), p_node_addr="127.0.0.1;1121", num_computed=4,
        body=b'{"prompt":"hi"}', method="POST", query="a=1",
        headers={"content-type": "application/json"}, generator_state=b"\x00\xffstate",
        seed=42, prefix_cached_tokens=2,
        kv=(REGION,),
        post_single_text="text", prefill_token_num=1, pre_output_token_num=1,
        e2e_start_time_us=1_700_000_000_000_000, prompt_logprobs=(None, LP),
        first_token_logprobs=(LP, LP2), plan=RequestPlan(PARAMS, 2, 1.5))
    return replace(full, **kw)


# ---------------------------------------------------------------------- round trips


def test_decode_parameters_round_trip_every_field() -> None:
    p = full_parameters()
    assert DecodeParameters.decode(p.encode()) == p


def test_decode_parameters_wire_keys_are_today_s() -> None:
    """The camelCase keys P has always sent (spec §5.2 names where one exists)."""
    obj = orjson.loads(full_parameters().encode())
    assert list(obj) == [
        "reqId", "tokens", "firstToken", "method", "path", "query", "headers", "body",
        "generatorState", "numComputed", "seed", "prefixCachedTokenNums", "blockTable",
        "pNodeAddr", "kv", "postsingletext", "prefillTokenNum", "preOutputTokenNum",
        "e2eStartTime", "promptLogprobs", "firstTokenLogprobs", "plan"]
    assert obj["promptLogprobs"] == [None, [7, -0.125, 1, [[7, -0.125], [9, -2.5]]]]


def test_one_kv_region_is_the_object_several_a_list_in_rank_order() -> None:
    """Issue 41: P's KV regions, one per tensor-parallel rank. One (worldSize 1) keeps
    the format from before tensor parallelism, the object itself, so a P and a D of
    different releases still agree; several are a list in rank order (their count is
    P's worldSize)."""
    one = orjson.loads(full_parameters().encode())
    assert one["kv"] == REGION
    rank1 = {**REGION, "session_id": "h:2", "block_bytes": 8}
    two = full_parameters(kv=(REGION, rank1))
    assert orjson.loads(two.encode())["kv"] == [REGION, rank1]
    assert DecodeParameters.decode(two.encode()).kv == (REGION, rank1)
    # an old P's single object decodes to a one-region tuple
    assert DecodeParameters.decode(orjson.dumps(one)).kv == (REGION,)


def test_plan_carries_every_sampling_field_but_the_seed() -> None:
    """Issue 40: D runs P's plan as it is, so every field of the engine request's
    parameters crosses (a new SamplingParams field fails here until it does); the seed
    is ``seed``, one key."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(SAMPLING_FIELDS) == names - {"seed"}
    default = SamplingParams(seed=42)
    assert all(getattr(PARAMS, n) != getattr(default, n) for n in SAMPLING_FIELDS)
    obj = orjson.loads(full_parameters().encode())
    assert obj["plan"]["priority"] == 2 and obj["plan"]["timeoutS"] == 1.5
    assert obj["plan"]["sampling"]["structured"] == {"kind": "regex", "value": "[a-z]+"}
    assert "seed" not in obj["plan"]["sampling"] and obj["seed"] == 42
    assert DecodeParameters.decode(orjson.dumps(obj)).plan == RequestPlan(PARAMS, 2, 1.5)


def test_plan_absent_or_sparse() -> None:
    """No ``plan`` (a P from before it): None, D plans itself; absent or null sampling
    fields take their defaults."""
    obj = orjson.loads(full_parameters().encode())
    del obj["plan"]
    assert DecodeParameters.decode(orjson.dumps(obj)).plan is None
    obj["plan"] = {"sampling": {"max_new_tokens": 3, "logprobs": None}}
    assert DecodeParameters.decode(orjson.dumps(obj)).plan == RequestPlan(
        SamplingParams(max_new_tokens=3, seed=42))


def test_decode_parameters_binary_body_travels_as_base64() -> None:
    raw = b'{"a":1}' + bytes(range(256))
    p = full_parameters(body=raw)
    obj = orjson.loads(p.encode())
    assert "body" not in obj and "bodyB64" in obj
    assert DecodeParameters.decode(p.encode()).body == raw


def test_decode_parameters_defaults_for_optional_keys_and_nulls() -> None:
    minimal = {"reqId": "1", "tokens": [1], "firstToken": [2], "path": "/infer",
               "blockTable": [[0]], "pNodeAddr": "a;1", "numComputed": 1, "body": "{}",
               "seed": None, "prefixCachedTokenNums": None, "kv": None}
    p = DecodeParameters.decode(orjson.dumps(minimal))
    assert p == DecodeParameters("1", (1,), (2,), "/infer", ((0,),), "a;1", 1, b"{}")
    assert (p.method, p.query, p.headers, p.seed, p.prefix_cached_tokens) == (
        "POST", "", {}, None, 0)


def test_unknown_keys_are_ignored() -> None:
    """Decision [I]: a newer peer may add fields; an older one reads what it knows."""
    p = full_parameters()
    extra = {**orjson.loads(p.encode()), "someFutureField": {"x": 1}}
    assert DecodeParameters.decode(orjson.dumps(extra)) == p
    assert PrefillAnswer.decode(b'{"reqId":"1","isStream":false,"new":1}') == \
        PrefillAnswer("1", False)
    assert Release.decode(b'{"reqId":"1","x":2}') == Release("1")
    assert DecodeVerdict.decode(
        b'{"isValidDecodeParameters":true,"errorMessage":"","x":0}') == DecodeVerdict(True)


def test_verdict_and_release_round_trip() -> None:
    for v in (DecodeVerdict(True), DecodeVerdict(False, "no")):
        assert DecodeVerdict.decode(v.encode()) == v
    assert DecodeVerdict(True).encode() == \
        b'{"isValidDecodeParameters":true,"errorMessage":""}'
    assert Release.decode(Release("ab12").encode()) == Release("ab12")
    assert Release("ab12").encode() == b'{"reqId":"ab12"}'


@pytest.mark.parametrize(("answer", "wire"), [
    (PrefillAnswer.of("1", True, "data: x\n\n", last=False),
     b'{"reqId":"1","isStream":true,"isLastResp":false,"output":"data: x\\n\\n"}'),
    (PrefillAnswer.of("1", True, "", last=True),
     b'{"reqId":"1","isStream":true,"isLastResp":true,"output":""}'),
    (PrefillAnswer.of("1", False, "ignored", last=False), b'{"reqId":"1","isStream":false}'),
    (PrefillAnswer.of("1", False, '{"a":1}', last=True),
     b'{"reqId":"1","isStream":false,"isLastResp":true,"output":"{\\"a\\":1}"}'),
])
def test_prefill_answer_is_spec_5_3_byte_for_byte(answer, wire) -> None:
    assert answer.encode() == wire
    assert PrefillAnswer.decode(wire) == answer


def test_prefill_answer_carries_a_whole_answer() -> None:
    whole = WholeAnswer("application/octet-stream", {"Inference-Header-Content-Length": "2"},
                        b"{}\x00\x01")
    a = PrefillAnswer.of("9", False, "", last=True, whole=whole)
    assert list(orjson.loads(a.encode())) == [
        "reqId", "isStream", "isLastResp", "output", "outputBytes"]
    assert PrefillAnswer.decode(a.encode()) == a
    assert PrefillAnswer.of("9", True, "", last=True, whole=whole).output_bytes is None


def test_prefill_headers_round_trip_and_spec_order_of_checks() -> None:
    h = PrefillHeaders("abc123", "10.0.0.2;1121", "1025", recompute=True)
    assert h.encode() == {"req-type": "prefill", "req-id": "abc123",
                          "d-target": "10.0.0.2;1121", "d-port": "1025",
                          "is-recompute": "true"}
    assert PrefillHeaders.decode(h.encode()) == h
    plain = PrefillHeaders("1", "::1")
    assert "is-recompute" not in plain.encode()
    assert PrefillHeaders.decode({**plain.encode(), "is-recompute": "false"}) == plain
    ok = {"req-type": "prefill", "req-id": "12", "d-target": "127.0.0.1"}
    for bad, text in [
        ({"req-type": "prefill", "req-id": "12"}, "DMI request must have req-type"),
        ({**ok, "req-id": "12z"}, "should be hex char [0-9, a-f, A-F], but got 12z"),
        ({**ok, "req-id": "a" * 1025}, "cannot exceed 1024"),
        ({**ok, "req-type": "decode"}, "must be prefill but got decode"),
        ({**ok, "d-target": "nohost;1"}, "d-target must be an IPv4 address"),
        ({**ok, "is-recompute": "yes"}, "is-recompute is an optional parameter"),
        # the spec's order: the hex check before the length, the type after both
        ({**ok, "req-id": "z" * 2000, "req-type": "x"}, "should be hex char"),
    ]:
        with pytest.raises(WireError, match=re.escape(text)):
            PrefillHeaders.decode(bad)


def test_forward_headers_drop_hop_by_hop_pd_and_connection_named() -> None:
    headers = {"content-type": "application/json", "connection": "x-secret",
               "x-secret": "1", "host": "h", "req-id": "1",
               "Inference-Header-Content-Length": "3", "authorization": "Bearer t"}
    assert forward_headers(headers) == {
        "content-type": "application/json", "Inference-Header-Content-Length": "3",
        "authorization": "Bearer t"}
    assert PD_HEADERS <= {"req-type", "req-id", "d-target", "d-port", "is-recompute"}
    assert {"content-length", "transfer-encoding", "host"} <= HOP_BY_HOP


def test_logprobs_round_trip_exact_floats() -> None:
    entries = (None, LP, LP2, TokenLogprob(0, -123.456789012345678, ((0, -0.1),), 0))
    assert decode_logprobs(encode_logprobs(entries), "k") == entries
    assert encode_logprobs(None) is None and decode_logprobs(None, "k") is None
    wire = orjson.loads(orjson.dumps(encode_logprobs(entries)))
    assert decode_logprobs(wire, "k") == entries


def test_history_round_trip_both_forms() -> None:
    h = History((1, 2), (3,))
    assert h.encode() == "2,1,2,3" and h.numbers() == [2, 1, 2, 3]
    assert History.decode("2,1,2,3") == h == History.decode([2, 1, 2, 3])
    assert History.decode("1,7") == History((7,))
    assert encode_ids([4, 5]) == "4,5" and decode_ids("4,5") == (4, 5)
    with pytest.raises(ValueError):
        History(())


@pytest.mark.parametrize(("path", "original", "field"), [
    ("/generate", {"prompt": "Hi", "max_tokens": 5}, "prompt"),
    ("/infer_token", {"input_id": [1, 2, 3]}, "inputs"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True}, "messages"),
])
def test_recompute_body_round_trip_with_extras(path, original, field) -> None:
    rb = RecomputeBody(original, History((5, 6), (7, 9)), b"\x00\xfftail", (LP, LP2))
    raw = rb.encode(path)
    obj = orjson.loads(raw)
    assert obj[field] == "2,5,6,7,9"
    assert set(obj) >= {"origin_inputs", "origin_binary", "origin_logprobs"}
    assert RecomputeBody.decode(path, obj) == rb
    plain = RecomputeBody(original, History((5,)))
    assert "origin_binary" not in orjson.loads(plain.encode(path))
    assert RecomputeBody.decode(path, orjson.loads(plain.encode(path))) == plain


def test_recompute_body_triton_infer_round_trip() -> None:
    body = {"inputs": [{"name": "input0", "datatype": "UINT32", "shape": [1, 2],
                        "data": [8, 9]}]}
    rb = RecomputeBody(body, History((8, 9), (40,)), b"\x01\x02")
    obj = orjson.loads(rb.encode("/v2/models/m/infer"))
    assert obj["inputs"][0]["data"] == [2, 8, 9, 40]
    assert RecomputeBody.decode("/v2/models/m/infer", obj) == rb


@pytest.mark.parametrize(("change", "text"), [
    ({"origin_binary": "@@"}, "bad origin_binary"),
    ({"origin_binary": 5}, "origin_binary must be a base64 string"),
    ({"origin_logprobs": [[7, -0.1, 1, []]]}, "one entry per output token"),
    ({"origin_logprobs": [None, None]}, "bad origin_logprobs: a null entry"),
    ({"origin_logprobs": "x"}, "bad origin_logprobs"),
    ({"prompt": "2,1"}, "L,p1"),
])
def test_malformed_recompute_bodies_are_refused(change, text) -> None:
    obj = {**orjson.loads(RecomputeBody({"prompt": "Hi"}, History((1,), (2, 3))
                                        ).encode("/generate")), **change}
    with pytest.raises(ValueError, match=re.escape(text)):
        RecomputeBody.decode("/generate", obj)
    obj.pop("origin_inputs")
    with pytest.raises(ValueError, match="origin_inputs"):
        RecomputeBody.decode("/generate", obj)


# ---------------------------------------------------------------------- malformed input


@pytest.mark.parametrize(("change", "key"), [
    ({"reqId": None}, "reqId is missing"),
    ({"reqId": 5}, "reqId must be a string, got int"),
    ({"tokens": [1, "2"]}, "tokens must be a list of non-negative integers"),
    ({"tokens": [1, -2]}, "tokens must be a list"),
    ({"firstToken": "4,5"}, "firstToken must be a list"),
    ({"blockTable": []}, "blockTable must hold at least one list"),
    ({"blockTable": [[1, True]]}, "blockTable must be a list"),
    ({"numComputed": "4"}, "numComputed must be an integer, got str"),
    ({"numComputed": True}, "numComputed must be an integer, got bool"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"headers": {"a": 1}}, "headers must map names to strings"),
    ({"body": None}, "body is missing"),
    ({"bodyB64": "@@"}, "bad bodyB64"),
    ({"generatorState": "@@"}, "bad generatorState"),
    ({"kv": [1]}, "kv must be an object or a non-empty list of objects"),
    ({"kv": []}, "kv must be an object or a non-empty list of objects"),
    ({"kv": "h:1"}, "kv must be an object or a non-empty list"),
    ({"promptLogprobs": [[1, "x", 1, []]]}, "bad promptLogprobs"),
    ({"promptLogprobs": 3}, "bad promptLogprobs"),
    ({"firstTokenLogprobs": [None, None]}, "bad firstTokenLogprobs: a null entry"),
    ({"plan": []}, "plan must be an object"),
    ({"plan": {}}, "sampling is missing"),
    ({"plan": {"sampling": {"top_k": 1.5}}}, "plan.sampling.top_k must be int"),
    ({"plan": {"sampling": {"do_sample": 1}}}, "plan.sampling.do_sample must be bool"),
    ({"plan": {"sampling": {"stop": ["a", 1]}}}, "plan.sampling.stop must be strs"),
    ({"plan": {"sampling": {"stop_token_ids": [-1]}}}, "plan.sampling.stop_token_ids"),
    ({"plan": {"sampling": {"structured": {"kind": "x", "value": ""}}}},
     "plan.sampling.structured must be structured"),
    ({"plan": {"sampling": {"top_p": 2.0}}}, "plan.sampling: top_p must be in (0, 1]"),
    ({"plan": {"sampling": {}, "priority": "1"}}, "priority must be an integer"),
    ({"plan": {"sampling": {}, "timeoutS": "1"}}, "timeoutS must be a number"),
])
def test_malformed_decode_parameters_are_refused_naming_the_key(change, key) -> None:
    obj = {**orjson.loads(full_parameters().encode()), **change}
    if change.get("body", 0) is None:
        obj.pop("bodyB64", None)
    with pytest.raises(WireError, match=re.escape(key)):
        DecodeParameters.decode(orjson.dumps(obj))


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1]", b'"x"', b"null"])
def test_a_body_that_is_not_a_json_object_is_refused(raw) -> None:
    for message in (DecodeParameters, DecodeVerdict, Release, PrefillAnswer):
        with pytest.raises(WireError):
            message.decode(raw)


@pytest.mark.parametrize("raw", [
    b'{"isStream":true}',  # no reqId
    b'{"reqId":"1"}',  # no isStream
    b'{"reqId":"1","isStream":"true"}',
    b'{"reqId":"1","isStream":true,"isLastResp":1}',
    b'{"reqId":"1","isStream":true,"output":5}',
    b'{"reqId":"1","isStream":false,"isLastResp":true,"output":"","outputBytes":"x"}',
])
def test_malformed_prefill_answers_are_refused(raw) -> None:
    with pytest.raises(WireError):
        PrefillAnswer.decode(raw)


def test_malformed_verdict_release_and_history() -> None:
    with pytest.raises(WireError, match="isValidDecodeParameters"):
        DecodeVerdict.decode(b'{"isValidDecodeParameters":"yes"}')
    with pytest.raises(WireError, match="reqId must be a string"):
        Release.decode(b'{"reqId":1}')
    for bad in ["", "x", "0,1", "3,1,2", "1,-1", [1], [1, "2"], ["1", 2], None, 5]:
        with pytest.raises(WireError, match="L,p1"):
            History.decode(bad)
    with pytest.raises(WireError):
        decode_ids("1,,2")
    with pytest.raises(WireError):
        decode_ids("1,-2")
