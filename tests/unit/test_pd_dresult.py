"""The /dresult codec (spec/pd_disaggregation.md §6.3): encode, close, heartbeat and the
tolerant parser (fields split across chunks, several per chunk, NUL runs, ':' in bodies,
unicode, unknown kinds)."""

from __future__ import annotations

import pytest

from tokenserve.pd.wire import (
    CLOSE_ID,
    CLOSE_TEXT,
    HEARTBEAT,
    DMessage,
    DresultParser,
    close_message,
    encode,
)

SSE = 'data: {"token":{"id":[626],"text":"am"}}\n\n'


def parse_all(chunks: list[bytes]) -> list[DMessage]:
    parser = DresultParser()
    return [m for c in chunks for m in parser.feed(c)]


def test_encode_is_byte_exact() -> None:
    assert encode("123", "data", "data: x\n\n") == b"reqId:123\0data:data: x\n\n\0"
    assert encode("9", "lastData", "{}") == b"reqId:9\0lastData:{}\0"
    assert HEARTBEAT == b"ka:heartbeat\0"


@pytest.mark.parametrize("args", [("1", "bogus", "x"), ("", "data", "x"), ("1", "data", ""),
                                  ("1", "data", "a\0b"), ("1\0", "data", "x"),
                                  ("1", "ka", "heartbeat")])
def test_encode_refuses_what_the_parser_would_drop(args: tuple[str, str, str]) -> None:
    with pytest.raises(ValueError):
        encode(*args)


def test_close_message() -> None:
    assert close_message() == f"reqId:{CLOSE_ID}\0close:{CLOSE_TEXT}\0".encode()
    assert parse_all([close_message()]) == [DMessage(CLOSE_ID, "close", CLOSE_TEXT)]


def test_one_message_per_chunk() -> None:
    assert parse_all([encode("7", "data", SSE), encode("7", "lastData", "end")]) == [
        DMessage("7", "data", SSE), DMessage("7", "lastData", "end")]


def test_several_messages_and_heartbeat_in_one_chunk() -> None:
    chunk = (encode("1", "ids", "3,1,2,3,9") + encode("1", "data", SSE) + HEARTBEAT
             + encode("2", "error", "Pull kv failed irreversibly."))
    assert parse_all([chunk]) == [
        DMessage("1", "ids", "3,1,2,3,9"), DMessage("1", "data", SSE),
        DMessage(None, "ka", "heartbeat"),
        DMessage("2", "error", "Pull kv failed irreversibly.")]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 13])
def test_fields_split_across_chunks_are_reassembled(size: int) -> None:
    stream = (encode("11528317054338029012", "data", SSE) + HEARTBEAT
              + encode("11528317054338029012", "lastData", '{"generated_text":"é中🙂"}'))
    chunks = [stream[i:i + size] for i in range(0, len(stream), size)]
    assert parse_all(chunks) == [
        DMessage("11528317054338029012", "data", SSE), DMessage(None, "ka", "heartbeat"),
        DMessage("11528317054338029012", "lastData", '{"generated_text":"é中🙂"}')]


def test_body_keeps_every_colon_after_the_first() -> None:
    body = 'data: {"a":"b:c"}\n\n'
    assert parse_all([encode("5", "data", body)]) == [DMessage("5", "data", body)]
    assert parse_all([b"reqId:5\0retry:{\"k\":\"v:w\"}\0"]) == [
        DMessage("5", "retry", '{"k":"v:w"}')]


def test_nul_runs_empty_bodies_and_fields_without_colon_are_skipped() -> None:
    chunk = (b"\0\0\0reqId:4\0\0\0data:x\0\0" + b"reqId:4\0data:\0" + b"garbage\0"
             + b"reqId:\0" + b"reqId:4\0lastData:y\0")
    assert parse_all([chunk]) == [DMessage("4", "data", "x"), DMessage("4", "lastData", "y")]


def test_req_id_applies_to_the_next_kind_field_only() -> None:
    chunk = b"reqId:1\0data:a\0data:b\0reqId:2\0reqId:3\0data:c\0"
    assert parse_all([chunk]) == [DMessage("1", "data", "a"), DMessage(None, "data", "b"),
                                  DMessage("3", "data", "c")]


def test_unknown_kinds_are_dropped_with_their_id() -> None:
    chunk = b"reqId:1\0future:thing\0data:b\0reqId:2\0lastData:z\0"
    assert parse_all([chunk]) == [DMessage(None, "data", "b"), DMessage("2", "lastData", "z")]


def test_incomplete_trailing_field_waits_for_its_nul() -> None:
    parser = DresultParser()
    assert parser.feed(b"reqId:8\0data:par") == []
    assert parser.feed(b"tial") == []
    assert parser.feed(b"\0") == [DMessage("8", "data", "partial")]


def test_invalid_utf8_is_replaced_not_raised() -> None:
    assert parse_all([b"reqId:1\0data:\xff\xfe\0"]) == [DMessage("1", "data", "\ufffd\ufffd")]


def test_a_field_without_end_is_bounded() -> None:
    parser = DresultParser(max_field_bytes=16)
    parser.feed(b"reqId:1\0data:0123456789")
    with pytest.raises(ValueError):
        parser.feed(b"0123456789")


# ---------------------------------------------------------------------- whole answers


def test_whole_answer_round_trips_binary_bytes_without_nul_on_the_wire():
    from tokenserve.pd.wire import WholeAnswer, encode

    raw = b'{"id":"x"}' + bytes(range(256))
    w = WholeAnswer("application/octet-stream",
                    {"Inference-Header-Content-Length": "10"}, raw)
    text = w.encode()
    assert "\0" not in text
    encode("r1", "lastBytes", text)  # a valid /dresult message
    assert WholeAnswer.decode(text) == w


def test_whole_answer_needed_only_for_non_json_or_extra_headers():
    from tokenserve.pd.wire import WholeAnswer

    assert not WholeAnswer.needed("application/json", {})
    assert WholeAnswer.needed("application/octet-stream", {})
    assert WholeAnswer.needed("application/json", {"x": "1"})


@pytest.mark.parametrize("text", ["", "{}", "[1]", '{"contentType":"a","headers":{},"body":"@@"}'])
def test_whole_answer_rejects_malformed_text(text):
    from tokenserve.pd.wire import WholeAnswer

    with pytest.raises(ValueError):
        WholeAnswer.decode(text)


def test_decode_parameters_body_base64_and_json_length():
    import base64

    import orjson

    from tokenserve.pd.decode import json_length
    from tokenserve.pd.messages import DecodeParameters, WireError

    def params(**kw):
        obj = {"reqId": "1", "tokens": [1], "firstToken": [2], "path": "/v2/models/m/infer",
               "blockTable": [[0]], "pNodeAddr": "a;1", "numComputed": 1, **kw}
        return DecodeParameters.decode(orjson.dumps(obj))

    raw = b'{"a":1}' + b"\xff\x00\x01\x02"
    p = params(bodyB64=base64.b64encode(raw).decode(),
               headers={"inference-header-content-length": "7"})
    assert p.body == raw
    assert json_length(p) == 7
    assert params(body='{"a":1}').body == b'{"a":1}'
    assert json_length(params(bodyB64=base64.b64encode(raw).decode(), headers={})) == len(raw)
    assert json_length(params(bodyB64=base64.b64encode(raw).decode(),
                              headers={"inference-header-content-length": "99"})) == len(raw)
    with pytest.raises(WireError):
        params(bodyB64="@@")
