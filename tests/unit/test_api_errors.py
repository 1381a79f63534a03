"""Each family's error shape, whole and in a started stream (tokenserve/api/errors.py): the
one writer the mixed server and the PD coordinator share (PD spec §3.2 rule [I])."""

from __future__ import annotations

import orjson
import pytest

from tokenserve.api.errors import error_json, stream_error

MINDIE = {"error": "boom", "error_type": "Incomplete Generation"}
OPENAI = {"error": {"message": "boom", "type": "Incomplete Generation", "param": None,
                    "code": 500}, "error_type": "Incomplete Generation"}


@pytest.mark.parametrize(("family", "whole"), [
    ("mindie", MINDIE), ("tgi", MINDIE), ("vllm", MINDIE), ("triton", MINDIE),
    ("openai", OPENAI)])
def test_whole_answer(family: str, whole: dict) -> None:
    assert orjson.loads(error_json(family, 500, "boom")) == whole


@pytest.mark.parametrize(("family", "raw"), [
    ("mindie", b"data: " + orjson.dumps(MINDIE) + b"\n\n"),
    ("tgi", b"data: " + orjson.dumps(MINDIE) + b"\n\n"),
    ("triton", b"data:" + orjson.dumps(MINDIE) + b"\n\n"),  # no space (spec §6.3)
    ("vllm", orjson.dumps(MINDIE) + b"\0"),
    ("openai", b"data: " + orjson.dumps(OPENAI) + b"\n\n"),  # and no [DONE]
])
def test_stream_event(family: str, raw: bytes) -> None:
    assert stream_error(family, "boom") == raw


def test_status_picks_the_error_type() -> None:
    assert orjson.loads(error_json("tgi", 503, "x")) == {
        "error": "x", "error_type": "Service Unavailable"}
    assert orjson.loads(error_json("openai", 429, "x"))["error"]["code"] == 429
