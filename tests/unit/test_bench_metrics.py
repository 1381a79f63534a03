"""``bench``: metric arithmetic on hand-made timelines, stream parsing per family on
hand-made bodies, workload shapes and the runner's bounds (no model, no sockets)."""

from __future__ import annotations

import asyncio
import math

import pytest

from tokenserve.loadgen.clients import StreamReader, get_backend
from tokenserve.loadgen.metrics import (
    RequestRecord,
    compare,
    distribution,
    meets_slo,
    summarize,
    tpot,
)
from tokenserve.loadgen.serving import run_level
from tokenserve.loadgen.workload import (
    BenchRequest,
    WorkloadConfig,
    arrival_offsets,
    build_workload,
    sample_lengths,
)

# --------------------------------------------------------------------------- metrics


def rec(ttft: float | None, e2e: float, out: int, *, ok: bool = True, itl=(), index: int = 0,
        input_len: int = 10) -> RequestRecord:
    return RequestRecord(index, input_len, out, ok=ok, ttft=ttft, e2e=e2e, itl=list(itl),
                         output_tokens=out, token_source="token_ids")


def test_percentiles_of_a_hand_made_list():
    d = distribution([0.010, 0.020, 0.030, 0.040], scale=1e3)
    assert d["n"] == 4
    assert d["mean"] == pytest.approx(25.0)
    # linear interpolation between order statistics (numpy default, as vLLM)
    assert d["p50"] == pytest.approx(25.0)
    assert d["p90"] == pytest.approx(37.0)
    assert d["p99"] == pytest.approx(39.7)


def test_percentiles_of_nothing_are_none():
    assert distribution([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_excludes_the_first_token():
    # 1.0 s to the first token, then 9 more tokens in 0.9 s -> 100 ms per token
    r = rec(ttft=1.0, e2e=1.9, out=10)
    assert tpot(r) == pytest.approx(0.1)
    assert tpot(r) != pytest.approx(r.e2e / r.output_tokens)  # not prefill-inflated


def test_tpot_undefined_for_one_token_or_none():
    assert tpot(rec(ttft=0.5, e2e=0.5, out=1)) is None
    assert tpot(rec(ttft=None, e2e=0.5, out=0)) is None


def test_summary_of_hand_made_timelines():
    records = [
        rec(0.100, 0.500, 5, itl=[0.1, 0.1, 0.1, 0.1], index=0),  # tpot 100 ms
        rec(0.300, 0.900, 4, itl=[0.2, 0.2, 0.2], index=1),  # tpot 200 ms
        rec(None, 0.050, 0, ok=False, index=2),  # failed: out of every statistic
    ]
    records[2].error = "HTTP 500"
    s = summarize(records, duration_s=2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == ["HTTP 500"]
    assert s["total_output_tokens"] == 9 and s["total_input_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(14.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(150.0)
    assert s["itl_ms"]["n"] == 7
    assert s["itl_ms"]["mean"] == pytest.approx((0.4 + 0.6) / 7 * 1e3)
    assert s["e2e_ms"]["mean"] == pytest.approx(700.0)
    assert s["goodput"] is None and s["slo_attainment"] is None


def test_goodput_counts_requests_meeting_both_slos():
    records = [
        rec(0.100, 0.100 + 9 * 0.040, 10),  # ttft 100, tpot 40: good
        rec(0.200, 0.200 + 9 * 0.040, 10),  # ttft 200 > 150: bad
        rec(0.100, 0.100 + 9 * 0.060, 10),  # tpot 60 > 50: bad
        rec(0.120, 0.120, 1),  # one token: any TPOT SLO is met; good
        rec(None, 0.01, 0, ok=False),  # failed: never good
    ]
    s = summarize(records, duration_s=4.0, slo_ttft_ms=150, slo_tpot_ms=50)
    assert s["goodput"] == pytest.approx(2 / 4.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    # one SLO alone
    assert summarize(records, 4.0, slo_ttft_ms=150)["goodput"] == pytest.approx(3 / 4.0)
    assert summarize(records, 4.0, slo_tpot_ms=50)["goodput"] == pytest.approx(3 / 4.0)
    assert meets_slo(records[0], 100.0, 40.0)  # boundaries are inclusive


def test_compare_is_ours_over_baseline():
    ours = summarize([rec(0.1, 1.0, 10)], 1.0)
    base = summarize([rec(0.4, 4.0, 10)], 4.0)
    r = compare(ours, base)
    assert r["output_throughput"] == pytest.approx(4.0)
    assert r["ttft_mean"] == pytest.approx(0.25)
    assert r["tpot_mean"] == pytest.approx(0.25)


def test_summary_rejects_zero_duration_with_completions():
    with pytest.raises(ValueError):
        summarize([rec(0.1, 0.2, 2)], duration_s=0.0)


# --------------------------------------------------------------------------- stream parsing

REQ = BenchRequest(0, (5, 6, 7), " a b c", 3)


def test_mindie_stream_counts_ids_and_times_chunks():
    r = StreamReader(get_backend("mindie"), REQ)
    r.feed(0.10, b'data: {"prefill_time":5,"decode_time":null,"token":{"id":[11],"text":"x"}}\n\n')
    # one event split over two reads: the token time is when it is complete
    r.feed(0.15, b'data: {"prefill_time":null,"decode_time":4,')
    r.feed(0.20, b'"token":{"id":[12],"text":"y"}}\n\n')
    # two events in one read: one chunk, one ITL; the final event's ids count too
    r.feed(0.35, b'data: {"prefill_time":null,"decode_time":4,"token":{"id":[13,14],"text":"zw"}}'
                 b'\n\ndata: {"prefill_time":null,"decode_time":1,"generated_text":"xyzwv",'
                 b'"details":{"finish_reason":"length","generated_tokens":5,"seed":1},'
                 b'"token":{"id":[15],"text":null}}\n\n')
    out = r.finish(0.40)
    assert out.ok and out.error is None
    assert out.output_tokens == 5 and out.token_source == "token_ids"
    assert out.ttft == pytest.approx(0.10)
    assert out.itl == pytest.approx([0.10, 0.15])
    assert out.e2e == pytest.approx(0.40)


def test_mindie_stream_error_text_fails_the_request():
    r = StreamReader(get_backend("mindie-text"), REQ)
    r.feed(0.1, b'data: {"prefill_time":5,"decode_time":null,"token":{"id":[11],"text":"x"}}\n\n')
    r.feed(0.2, b"Engine callback timeout: client timeout")
    out = r.finish(0.2)
    assert not out.ok and "timeout" in out.error
    assert out.output_tokens == 1


def test_mindie_stream_without_final_event_fails():
    r = StreamReader(get_backend("mindie"), REQ)
    r.feed(0.1, b'data: {"prefill_time":5,"decode_time":null,"token":{"id":[11],"text":"x"}}\n\n')
    assert not r.finish(0.2).ok


def test_tgi_stream():
    r = StreamReader(get_backend("tgi"), REQ)
    r.feed(0.1, b'data: {"token":{"id":[1],"text":"a","logprob":null,"special":null},'
                b'"generated_text":null,"details":null}\n\n')
    r.feed(0.3, b'data: {"token":{"id":[2],"text":"b","logprob":null,"special":null},'
                b'"generated_text":"ab","details":{"prompt_tokens":3,"finish_reason":"length",'
                b'"generated_tokens":2,"seed":1}}\n\n')
    out = r.finish(0.3)
    assert out.ok and out.output_tokens == 2 and out.itl == pytest.approx([0.2])


def test_vllm_nul_framed_stream_is_retokenized():
    r = StreamReader(get_backend("vllm"), REQ)
    r.feed(0.1, b'{"text":["one"]}\0{"text":[" two"]}')
    r.feed(0.2, b'\0{"text":[" three"]}\0')
    out = r.finish(0.2, count_text=lambda t: len(t.split()))
    assert out.ok and r.text == "one two three"
    assert out.output_tokens == 3 and out.token_source == "retokenized"
    assert out.ttft == pytest.approx(0.1) and out.itl == pytest.approx([0.1])


def test_openai_completions_usage_and_done():
    r = StreamReader(get_backend("openai"), REQ)
    r.feed(0.1, b'data: {"id":"1","object":"text_completion","choices":[{"index":0,"text":"a",'
                b'"finish_reason":null}]}\n\n')
    r.feed(0.2, b'data: {"id":"1","object":"text_completion","choices":[{"index":0,"text":"b",'
                b'"finish_reason":"length"}]}\n\n')
    r.feed(0.25, b'data: {"id":"1","choices":[],"usage":{"prompt_tokens":3,'
                 b'"completion_tokens":2,"total_tokens":5}}\n\ndata: [DONE]\n\n')
    out = r.finish(0.3)
    assert out.ok and out.output_tokens == 2 and out.token_source == "usage"
    assert out.input_len == 3
    assert out.itl == pytest.approx([0.1])  # the usage chunk carries no token


def test_openai_chat_role_chunk_is_not_the_first_token():
    r = StreamReader(get_backend("openai-chat"), REQ)
    r.feed(0.05, b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                 b'"finish_reason":null}]}\n\n')
    r.feed(0.15, b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},'
                 b'"finish_reason":"length"}],"usage":{"prompt_tokens":20,'
                 b'"completion_tokens":1,"total_tokens":21}}\n\n')
    r.feed(0.16, b"data: [DONE]\n\n")
    out = r.finish(0.2)
    assert out.ok and out.ttft == pytest.approx(0.15)
    assert out.output_tokens == 1 and out.input_len == 20


def test_openai_stream_without_done_fails():
    r = StreamReader(get_backend("openai"), REQ)
    r.feed(0.1, b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n')
    assert not r.finish(0.2).ok


def test_triton_stream_counts_from_cumulative_details():
    r = StreamReader(get_backend("triton"), REQ)
    r.feed(0.1, b'data:{"id":"x","model_name":"m","model_version":null,"text_output":"a",'
                b'"details":{"generated_tokens":1}}\n\n')
    r.feed(0.2, b'data:{"id":"x","model_name":"m","model_version":null,"text_output":"bc",'
                b'"details":{"generated_tokens":3,"finish_reason":"length"}}\n\n')
    out = r.finish(0.2)
    assert out.ok and out.output_tokens == 3 and out.token_source == "details"
    assert out.itl == pytest.approx([0.1])


def test_request_builders_carry_exact_prompt_and_length():
    path, body = get_backend("mindie").build(REQ, "m")
    assert path == "/infer_token" and body["input_id"] == [5, 6, 7]
    assert body["parameters"]["max_new_tokens"] == 3 and body["stream"] is True
    path, body = get_backend("openai").build(REQ, "m")
    assert path == "/v1/completions" and body["prompt"] == [5, 6, 7]
    assert body["ignore_eos"] is True and body["max_tokens"] == 3 and body["model"] == "m"
    assert body["skip_special_tokens"] is False  # a special token's chunk still times it
    path, body = get_backend("triton").build(REQ, "smol")
    assert path == "/v2/models/smol/generate_stream" and body["text_input"] == " a b c"
    path, body = get_backend("tgi").build(REQ, "m")
    assert path == "/generate_stream" and "stream" not in body


# --------------------------------------------------------------------------- workload


class WordTokenizer:
    """A toy tokenizer: token i is the word ``w<i>`` (with its leading space)."""

    vocab_size = 300

    def convert_ids_to_tokens(self, ids):
        return [f"Ġw{'abcdefghij'[i // 100]}{'abcdefghij'[i // 10 % 10]}"
                f"{'abcdefghij'[i % 10]}" for i in ids]

    def _word(self, i):
        return self.convert_ids_to_tokens([i])[0][1:]

    def encode(self, text, add_special_tokens=True):
        table = {self._word(i): i for i in range(self.vocab_size)}
        return [table[w] for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(" " + self._word(i) for i in ids)


def test_fixed_workload_has_exact_lengths_and_a_shared_prefix():
    tok = WordTokenizer()
    reqs = build_workload(tok, WorkloadConfig(5, input_len=12, output_len=7, shared_prefix_len=4,
                                              seed=3))
    assert [r.input_len for r in reqs] == [12] * 5 and [r.output_len for r in reqs] == [7] * 5
    assert len({r.prompt_ids[:4] for r in reqs}) == 1
    assert len({r.prompt_ids for r in reqs}) == 5
    assert all(tok.encode(r.prompt_text) == list(r.prompt_ids) for r in reqs)
    again = build_workload(tok, WorkloadConfig(5, 12, 7, shared_prefix_len=4, seed=3))
    assert again == reqs  # deterministic in the seed


def test_length_distributions():
    import numpy as np

    rng = np.random.default_rng(0)
    uni = sample_lengths(rng, 2000, 100, "uniform")
    assert min(uni) >= 50 and max(uni) <= 150
    chat = sample_lengths(rng, 4000, 100, "chat")
    assert min(chat) >= 4 and max(chat) <= 400
    assert 80 < sum(chat) / len(chat) < 120
    assert np.median(chat) < np.mean(chat)  # long tail to the right


def test_mixed_workload_has_two_populations():
    tok = WordTokenizer()
    cfg = WorkloadConfig(400, input_len=20, output_len=6, dataset="mixed", long_input_len=200,
                         long_fraction=0.25, seed=1)
    lens = [r.input_len for r in build_workload(tok, cfg)]
    short = [n for n in lens if n <= 30]
    long_ = [n for n in lens if n >= 100]
    assert len(short) + len(long_) == 400  # nothing in between
    assert min(short) >= 10 and max(long_) <= 300
    assert 0.18 < len(long_) / 400 < 0.32
    with pytest.raises(ValueError, match="long_fraction"):
        WorkloadConfig(4, dataset="mixed", long_fraction=1.5)


def test_arrivals():
    assert arrival_offsets(4, math.inf, 0) == [0.0] * 4
    t = arrival_offsets(2000, 50.0, 0)
    assert t == sorted(t) and t[0] == 0.0
    assert t[-1] / len(t) == pytest.approx(1 / 50, rel=0.1)


# --------------------------------------------------------------------------- runner bounds


async def test_run_level_bounds_in_flight_and_duration():
    in_flight = peak = 0
    reqs = [BenchRequest(i, (1,), " a", 1) for i in range(12)]

    async def send(req):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01 if req.index < 6 else 30)  # the last six hang
        in_flight -= 1
        return rec(0.005, 0.01, 1, index=req.index)

    res = await run_level(send, reqs, 3, max_duration_s=0.5)
    assert peak == 3
    assert len(res.records) == 12 and [r.index for r in res.records] == list(range(12))
    assert sum(r.ok for r in res.records) == 6
    assert all("max-duration" in r.error for r in res.records[6:])
    assert res.duration_s == pytest.approx(0.5)
