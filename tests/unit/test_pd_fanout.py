"""The coordinator's split of a request for several sequences (tokenserve/coordinator/
fanout.py: which requests, the parts' bodies, the driver) and the merge of the parts'
answers (tokenserve/coordinator/merge.py), without instances: the driver runs against a
fake relay that answers each part as a P/D pair would."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from tokenserve.aio import Signal
from tokenserve.api.fields import MAX_N
from tokenserve.api.framing import SSE_DONE, nul_chunk, sse
from tokenserve.api.routes import path_of
from tokenserve.config.tree import InstanceAddr
from tokenserve.coordinator.fanout import FanOut, max_sequences, plan_fan_out
from tokenserve.coordinator.ingress import Ingress, classify
from tokenserve.coordinator.merge import StreamMerge, merge_whole, merged_usage
from tokenserve.coordinator.pool import P_ROLES, Instance
from tokenserve.sampling_params import MAX_SEED
from tokenserve.transport.cycle import ClientDisconnected, HttpRequest, HttpResponse

CHAT = path_of("openai.chat")
CMPL = path_of("openai.completions")
GEN = path_of("generate")


def plan(path: str, body: dict[str, Any], limit: int | None = 32):
    return plan_fan_out(path, classify(path, orjson.dumps(body)), limit)


def bodies(p) -> list[dict[str, Any]]:
    return [orjson.loads(part.body) for part in p.parts]


# --------------------------------------------------------------------------- the plan


def test_openai_n_is_split_into_one_part_per_choice_with_the_mixed_seeds() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 3,
            "temperature": 0.8, "seed": 41, "stream": True}
    p = plan(CHAT, body)
    assert p is not None and p.family == "openai" and p.stream
    assert [(x.index, x.prompt_index) for x in p.parts] == [(0, 0), (1, 0), (2, 0)]
    subs = bodies(p)
    assert [s["seed"] for s in subs] == [41, 42, 43]  # choice_seed: seed + i
    assert all(s["n"] == 1 and s["messages"] == body["messages"] for s in subs)
    # no seed: each part's P draws one (as the mixed server does per choice)
    subs = bodies(plan(CHAT, {**body, "seed": None}))
    assert all(s["seed"] is None for s in subs)
    wrap = bodies(plan(CHAT, {**body, "seed": MAX_SEED}))
    assert [s["seed"] for s in wrap] == [MAX_SEED, 0, 1]


def test_completions_prompts_and_best_of_are_split_too() -> None:
    body = {"model": "m", "prompt": ["Hello", "Bye"], "n": 2, "seed": 5}
    p = plan(CMPL, body)
    assert [(x.index, x.prompt_index) for x in p.parts] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    subs = bodies(p)
    assert [s["prompt"] for s in subs] == ["Hello", "Hello", "Bye", "Bye"]
    assert [s["seed"] for s in subs] == [5, 6, 5, 6]
    ids = plan(CMPL, {"model": "m", "prompt": [[1, 2], [3]]})
    assert [s["prompt"] for s in bodies(ids)] == [[1, 2], [3]]
    # a list P judges (the mixed server refuses it as the parts' P does): kept whole
    odd = bodies(plan(CMPL, {"model": "m", "prompt": ["a", 1], "n": 2}))
    assert [s["prompt"] for s in odd] == [["a", 1], ["a", 1]]
    best = bodies(plan(CMPL, {"model": "m", "prompt": "x", "n": 1, "best_of": 3}))
    assert len(best) == 3 and all("best_of" not in s and s["n"] == 1 for s in best)


def test_vllm_n_is_split_and_prompt_logprobs_asked_once() -> None:
    body = {"prompt": "hi", "n": 2, "temperature": 0.9, "seed": 7, "prompt_logprobs": 1}
    p = plan(GEN, body)
    assert p is not None and p.family == "vllm" and not p.stream
    subs = bodies(p)
    assert [s["seed"] for s in subs] == [7, 8]
    assert subs[0]["prompt_logprobs"] == 1 and "prompt_logprobs" not in subs[1]


@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": [], "model": "m"}),  # one sequence
    (CHAT, {"messages": [], "model": "m", "n": 1}),
    (CMPL, {"prompt": [1, 2, 3], "model": "m"}),  # one prompt of ids
    (CMPL, {"prompt": ["only"], "model": "m"}),
    # what the mixed server refuses: P answers it whole, with the mixed server's 422
    (CHAT, {"messages": [], "model": "m", "n": 2, "temperature": 0}),  # greedy
    (CHAT, {"messages": [], "model": "m", "n": 2, "temperature": "hot"}),
    (CHAT, {"messages": [], "model": "m", "n": 0}),
    (CHAT, {"messages": [], "model": "m", "n": True}),
    (CHAT, {"messages": [], "model": "m", "n": 2.0}),
    (CHAT, {"messages": [], "model": "m", "n": MAX_N + 1}),
    (CHAT, {"messages": [], "model": "m", "n": 3, "best_of": 2}),
    (CMPL, {"prompt": "x", "model": "m", "best_of": 2, "stream": True}),  # n not given
    (CMPL, {"prompt": "x", "model": "m", "n": 2, "best_of": 3, "stream": True}),
    (CMPL, {"prompt": "x", "model": "m", "n": 33}),  # over maxBatchSize (32)
    (CMPL, {"prompt": ["a"] * 17, "model": "m", "n": 2}),
    (GEN, {"prompt": "x", "n": 2}),  # vLLM: greedy unless a temperature is given
    (GEN, {"prompt": "x", "n": 2, "temperature": 0}),
    (GEN, {"prompt": "x", "n": 2, "best_of": 1, "temperature": 1}),
    (GEN, {"inputs": "x", "parameters": {"n": 2}}),  # TGI: one sequence
    (path_of("mindie.infer"), {"inputs": "x", "n": 2}),
])
def test_what_is_not_split(path: str, body: dict[str, Any]) -> None:
    assert plan(path, body) is None


def test_nothing_is_split_while_no_p_reports_its_batch_size() -> None:
    body = {"model": "m", "prompt": "x", "n": 2}
    assert plan(CMPL, body, limit=None) is None
    assert plan(CMPL, body, limit=2) is not None and plan(CMPL, body, limit=1) is None


def test_max_sequences_is_the_least_batch_size_of_the_usable_ps() -> None:
    def p(slots: Any, running: Any, role: str = "prefill") -> Instance:
        inst = Instance(InstanceAddr("127.0.0.1", 1), P_ROLES)
        inst.status = {"service": {"currentRole": role}, "resource": {
            "availSlotsNum": slots, "runningRequestNum": running}}
        return inst

    assert max_sequences([p(30, 2), p(10, 6)]) == 16
    assert max_sequences([p(30, 2), p(1, 1, role="decode")]) == 32  # not usable
    assert max_sequences([p(None, 2)]) is None and max_sequences([]) is None


# --------------------------------------------------------------------------- merging


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def test_usage_counts_each_prompt_once_and_sums_completions() -> None:
    got = merged_usage([usage(10, 3, 4), usage(10, 5, 9), usage(7, 1, 0)], [0, 0, 1])
    assert got == usage(17, 9, 4)
    assert merged_usage([None, None], [0, 0]) is None


def test_whole_openai_and_vllm_answers_merge_in_index_order() -> None:
    def chat(text: str, u: dict[str, Any], rid: str) -> bytes:
        return orjson.dumps({"id": rid, "object": "chat.completion", "created": 1,
                             "model": "m", "choices": [{
                                 "index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": "stop"}], "usage": u})

    out = orjson.loads(merge_whole("openai", [chat("a", usage(5, 2), "x"),
                                              chat("b", usage(5, 3), "y")], [0, 1], [0, 0]))
    assert out["id"] == "x" and list(out) == ["id", "object", "created", "model", "choices",
                                              "usage"]
    assert [(c["index"], c["message"]["content"]) for c in out["choices"]] == [(0, "a"), (1, "b")]
    assert out["usage"] == usage(5, 5)
    v = orjson.loads(merge_whole("vllm", [orjson.dumps({"text": ["p a"], "prompt_logprobs": [None]}),
                                          orjson.dumps({"text": ["p b"]})], [0, 1], [0, 0]))
    assert v == {"text": ["p a", "p b"], "prompt_logprobs": [None]}
    with pytest.raises(ValueError):
        merge_whole("vllm", [b"{}", b"[]"], [0, 1], [0, 0])


def chunk(rid: str, index: int, text: str, finish: str | None = None,
          u: dict[str, Any] | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"id": rid, "object": "text_completion", "created": 7, "model": "m",
                         "choices": [{"index": index, "text": text, "logprobs": None,
                                      "finish_reason": finish, "stop_reason": None}]}
    if u is not None:
        c["usage"] = u
    return c


def test_openai_stream_merge_reindexes_and_puts_usage_on_the_last_finish() -> None:
    m = StreamMerge("openai", [0, 1], [0, 0], 2)
    a = sse(chunk("A", 0, "x")) + sse(chunk("A", 0, "y", "stop", usage(4, 2))) + SSE_DONE
    b1, b2 = sse(chunk("B", 0, "z")), sse(chunk("B", 0, "w", "length", usage(4, 3))) + SSE_DONE
    out1, failed = m.feed(1, b1[:10])  # an event split anywhere
    assert out1 == b"" and not failed
    out2, _ = m.feed(1, b1[10:])
    out3, _ = m.feed(0, a)
    out4, _ = m.feed(1, b2)
    assert m.end(0) == b"" and m.end(1) == b""
    events = [orjson.loads(e[6:]) for e in (out2 + out3 + out4).split(b"\n\n") if e]
    assert [e["choices"][0]["index"] for e in events] == [1, 0, 0, 1]
    assert {e["id"] for e in events} == {"B"}  # one id: the first one seen
    assert ["usage" in e for e in events] == [False, False, False, True]
    assert events[-1]["usage"] == usage(4, 5)
    assert m.tail() == SSE_DONE


def test_openai_stream_merge_one_include_usage_chunk() -> None:
    m = StreamMerge("openai", [0, 1], [0, 0], 2)
    for k in (0, 1):
        head = {k_: v for k_, v in chunk("A", 0, "").items() if k_ != "choices"}
        part = sse(chunk("A", 0, "t", "stop")) + sse({**head, "choices": [],
                                                      "usage": usage(3, k + 1)}) + SSE_DONE
        out, _ = m.feed(k, part)
        assert b"usage" not in out and b"[DONE]" not in out
    tail = m.tail()
    assert tail.endswith(SSE_DONE)
    last = orjson.loads(tail[: -len(SSE_DONE)][6:])
    assert last["choices"] == [] and last["usage"] == usage(3, 3)


def test_stream_merge_stops_at_a_part_error_event() -> None:
    m = StreamMerge("openai", [0, 1], [0, 0], 2)
    err = sse({"error": {"message": "boom"}, "error_type": "x"})
    out, failed = m.feed(1, sse(chunk("A", 0, "a")) + err + sse(chunk("A", 0, "b")))
    assert failed and out.endswith(err) and b'"b"' not in out
    v = StreamMerge("vllm", [0, 1, 2], [0, 0, 0], 3)
    out, failed = v.feed(2, nul_chunk({"text": ["hi"]}) + nul_chunk({"error": "x"}))
    assert failed and out.startswith(nul_chunk({"text": ["", "", "hi"]}))


# --------------------------------------------------------------------------- the driver


class Capture:
    """The client's side: an HttpResponse writing into a list."""

    shutting_down = False
    close_whole_responses = False

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def drain(self) -> None:
        return

    def send_events(self, events: list[Any]) -> None:
        self.events.extend(events)

    def body(self) -> bytes:
        return b"".join(bytes(e.data) for e in self.events if hasattr(e, "data"))


def request(path: str, body: dict[str, Any]) -> HttpRequest:
    return HttpRequest("POST", path, "", {}, orjson.dumps(body), Signal())


async def drive(path: str, body: dict[str, Any], answer) -> tuple[HttpResponse, Capture,
                                                                  list[dict[str, Any]]]:
    """Run the split of ``body`` with ``answer(k, sub_body, response)`` as each part's
    relay; the parts' bodies in the order they ran."""
    req = request(path, body)
    seen: list[dict[str, Any]] = []
    counted: list[bool] = []

    async def relay(sub: HttpRequest, resp: HttpResponse, ingress: Ingress,
                    count: bool) -> None:
        assert sub.disconnected is not req.disconnected
        obj = orjson.loads(sub.body)
        seen.append(obj)
        counted.append(count)
        try:
            await answer(len(seen) - 1, obj, resp, sub)
        except ClientDisconnected:
            pass

    cap = Capture()
    response = HttpResponse(cap)
    p = plan_fan_out(path, classify(path, req.body), 32)
    assert p is not None
    await asyncio.wait_for(FanOut(p, req, response, relay, 4.0).run(), 5)
    assert sorted(counted) == [False] * (len(counted) - 1) + [True]  # counted once
    return response, cap, seen


async def test_driver_merges_whole_answers() -> None:
    async def answer(k, obj, resp, sub):
        await asyncio.sleep(0.01 * (2 - k))  # part 1 answers first
        await resp.send(200, orjson.dumps({"text": [f"hi {obj['seed']}"]}))

    resp, cap, _ = await drive(GEN, {"prompt": "hi", "n": 2, "temperature": 1, "seed": 3},
                               answer)
    assert resp.status == 200 and orjson.loads(cap.body()) == {"text": ["hi 3", "hi 4"]}


async def test_driver_answers_a_part_refusal_and_stops_the_others() -> None:
    stopped = []

    async def answer(k, obj, resp, sub):
        if obj["seed"] == 2:
            await resp.send(503, b'{"error":"busy"}')
            return
        await sub.disconnected.wait()  # a part still running: stopped
        stopped.append(k)

    resp, cap, _ = await drive(CHAT, {"model": "m", "messages": [], "n": 3, "seed": 1},
                               answer)
    assert resp.status == 503 and cap.body() == b'{"error":"busy"}'
    assert len(stopped) == 2


async def test_driver_stream_waits_for_every_head_then_merges() -> None:
    async def answer(k, obj, resp, sub):
        i = obj["seed"] - 10
        await asyncio.sleep(0.02 * i)
        await resp.start_stream(200, "text/event-stream")
        await resp.write(sse(chunk(f"id{i}", 0, f"t{i}")))
        await resp.write(sse(chunk(f"id{i}", 0, "", "stop", usage(2, 1))) + SSE_DONE)
        await resp.end()

    _, cap, _ = await drive(CMPL, {"model": "m", "prompt": "x", "n": 2, "seed": 10,
                                   "stream": True}, answer)
    raw = cap.body()
    assert raw.endswith(SSE_DONE) and raw.count(b"[DONE]") == 1
    events = [orjson.loads(e[6:]) for e in raw[: -len(SSE_DONE)].split(b"\n\n") if e]
    assert sorted(e["choices"][0]["index"] for e in events) == [0, 0, 1, 1]
    assert len({e["id"] for e in events}) == 1
    assert [e.get("usage") for e in events if "usage" in e] == [usage(2, 2)]


async def test_driver_stream_part_failure_ends_the_stream_with_its_event() -> None:
    err = sse({"error": {"message": "D failed"}})

    async def answer(k, obj, resp, sub):
        await resp.start_stream(200, "text/event-stream")
        await resp.write(sse(chunk("a", 0, "x")))
        if obj["seed"] == 1:
            await resp.write(err)
            await resp.end(close_connection=True)
            return
        await sub.disconnected.wait()

    resp, cap, _ = await drive(CMPL, {"model": "m", "prompt": "x", "n": 2, "seed": 0,
                                      "stream": True}, answer)
    assert cap.body().endswith(err) and resp.close_connection and resp.finished


async def test_driver_client_gone_stops_every_part() -> None:
    req = request(CMPL, {"model": "m", "prompt": "x", "n": 2, "stream": True})
    stopped = []

    async def relay(sub, resp, ingress, count):
        await sub.disconnected.wait()
        stopped.append(count)

    p = plan_fan_out(CMPL, classify(CMPL, req.body), 32)
    task = asyncio.create_task(FanOut(p, req, HttpResponse(Capture()), relay, 4.0).run())
    await asyncio.sleep(0.05)
    req.disconnected.set()
    await asyncio.wait_for(task, 5)
    assert sorted(stopped) == [False, True]


def test_the_greedy_bound_is_the_openai_familys() -> None:
    """The coordinator keeps its own copy (it does not load the OpenAI family's module,
    which loads jinja2 and jsonschema): the two must agree."""
    from tokenserve.api.openai.protocol import GREEDY_EPS
    from tokenserve.coordinator import fanout

    assert fanout._GREEDY_EPS == GREEDY_EPS
