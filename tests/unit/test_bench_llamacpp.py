"""``bench``: the llama.cpp (``llama-server`` ``POST /completion``) family: request body,
stream parsing on hand-made bodies in llama-server's exact format, the same over a socket
through a fake llama-server, the second-baseline report, and the bench flags around it
(no model, no llama-server binary)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys

import aiohttp
import httpx
import orjson
import pytest

from tokenserve.loadgen import report
from tokenserve.loadgen.clients import StreamReader, get_backend, send_http
from tokenserve.loadgen.metrics import RequestRecord
from tokenserve.loadgen.server import LlamaServer, llama_server_ctx
from tokenserve.loadgen.serving import (
    LevelResult,
    assemble,
    build_parser,
    check_args,
    engine_config,
    run_http,
    run_llamacpp,
)
from tokenserve.loadgen.workload import BenchRequest

REQ = BenchRequest(0, (5, 6, 7), " a b c", 4)


def partial(text: str, tok: int, n: int, n_prompt: int = 3) -> bytes:
    """One streamed llama-server event as ``to_json_non_oaicompat`` writes it
    (tools/server/server-task.cpp) and ``format_oai_sse`` frames it."""
    obj = {"index": 0, "content": text, "tokens": [tok], "stop": False, "id_slot": 0,
           "tokens_predicted": n, "tokens_evaluated": n_prompt}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def final(n: int, n_prompt: int = 3) -> bytes:
    """The last event of a stream: ``stop`` true, content and tokens already sent."""
    obj = {"index": 0, "content": "", "tokens": [], "id_slot": 0, "stop": True,
           "model": "gpt-3.5-turbo", "tokens_predicted": n, "tokens_evaluated": n_prompt,
           "generation_settings": {"n_predict": n, "ignore_eos": True}, "prompt": "",
           "has_new_line": False, "truncated": False, "stop_type": "limit",
           "stopping_word": "", "tokens_cached": n_prompt + n,
           "timings": {"prompt_n": n_prompt, "predicted_n": n, "predicted_ms": 12.5}}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


# --------------------------------------------------------------------------- request body


def test_body_is_llama_server_native_greedy_exact_length():
    path, body = get_backend("llamacpp").build(REQ, "ignored")
    assert path == "/completion"
    assert body == {"prompt": [5, 6, 7], "n_predict": 4, "ignore_eos": True,
                    "temperature": 0, "cache_prompt": False, "stream": True}


# --------------------------------------------------------------------------- stream parsing


def test_stream_times_tokens_and_counts_tokens_predicted():
    r = StreamReader(get_backend("llamacpp"), REQ)
    r.feed(0.10, b":\n\n")  # SSE keep-alive ping (--sse-ping-interval): not a token
    r.feed(0.20, partial(" x", 11, 1))
    r.feed(0.25, partial(" y", 12, 2)[:17])  # an event split over two reads
    r.feed(0.30, partial(" y", 12, 2)[17:])
    # two events in one read, the last one with the final event: one chunk, one ITL
    r.feed(0.45, partial(" z", 13, 3) + partial(" w", 14, 4) + final(4))
    out = r.finish(0.46)
    assert out.ok and out.error is None
    assert out.output_tokens == 4 and out.token_source == "tokens_predicted"
    assert out.input_len == 3  # tokens_evaluated
    assert out.ttft == pytest.approx(0.20)
    assert out.itl == pytest.approx([0.10, 0.15])
    assert out.e2e == pytest.approx(0.46)
    assert r.text == " x y z w"


def test_a_token_ending_mid_utf8_arrives_with_the_next_one():
    # llama-server sends no event for a token whose text ends inside a UTF-8 character:
    # the next event has both tokens' text, one id in `tokens`, tokens_predicted + 2
    r = StreamReader(get_backend("llamacpp"), REQ)
    r.feed(0.1, partial("a", 11, 1))
    r.feed(0.3, partial("\u00e9", 13, 3))
    r.feed(0.4, partial("b", 14, 4) + final(4))
    out = r.finish(0.4)
    assert out.ok and out.output_tokens == 4
    assert out.itl == pytest.approx([0.2, 0.1])


def test_stream_without_the_stop_event_fails():
    r = StreamReader(get_backend("llamacpp"), REQ)
    r.feed(0.1, partial("a", 11, 1))
    out = r.finish(0.2)
    assert not out.ok and "final event" in out.error


def test_error_event_fails_the_request():
    r = StreamReader(get_backend("llamacpp"), REQ)
    r.feed(0.1, partial("a", 11, 1))
    with pytest.raises(ValueError, match="llama-server error: slot unavailable"):
        r.feed(0.2, b'data: {"error":{"code":500,"message":"slot unavailable",'
                    b'"type":"server_error"}}\n\n')


def test_ping_comments_are_skipped_by_every_sse_family():
    r = StreamReader(get_backend("openai"), REQ)
    r.feed(0.1, b": keep-alive\n\n")
    r.feed(0.2, b'data: {"choices":[{"text":"a"}]}\n\n')
    r.feed(0.3, b'data: {"choices":[],"usage":{"completion_tokens":1,"prompt_tokens":3}}\n\n'
                b"data: [DONE]\n\n")
    out = r.finish(0.3)
    assert out.ok and out.ttft == pytest.approx(0.2) and out.output_tokens == 1


# --------------------------------------------------------------------------- over a socket


class FakeLlamaServer:
    """``POST /completion`` answered the way llama-server streams it (HTTP/1.1, SSE, one
    event per token, a ping first, a missing event for token 2 as for a split UTF-8
    character, the stop event last); records the bodies it got."""

    def __init__(self, delay: float = 0.003, drop_first: int = 0) -> None:
        self.delay = delay
        #: connections to close after reading the request, with no response (as a server
        #: does to a keep-alive connection it has already given up on)
        self.drop_first = drop_first
        self.bodies: list[dict] = []
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = orjson.loads(await reader.readexactly(length))
            self.bodies.append(body)
            assert head.startswith(b"POST /completion ")
            if self.drop_first:
                self.drop_first -= 1
                return
            n, prompt = body["n_predict"], body["prompt"]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Connection: close\r\n\r\n")
            writer.write(b":\n\n")
            for i in range(1, n + 1):
                await asyncio.sleep(self.delay)
                if i == 2 and n > 2:
                    continue  # token 2 ends mid-character: it comes with token 3
                writer.write(partial(f" t{i}", 100 + i, i, len(prompt)))
                await writer.drain()
            await asyncio.sleep(self.delay)
            writer.write(final(n, len(prompt)))
            await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def __aenter__(self) -> FakeLlamaServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        await self._server.wait_closed()


async def test_send_http_against_a_fake_llama_server():
    async with FakeLlamaServer() as fake, \
            aiohttp.ClientSession(base_url=f"http://127.0.0.1:{fake.port}") as http:
        req = BenchRequest(3, (9, 8, 7, 6, 5), " a b c d e", 6)
        out = await send_http(http, get_backend("llamacpp"), req, "m")
        off = await send_http(http, get_backend("llamacpp"), req, "m", ignore_eos=False)
    assert out.ok, out.error
    assert out.output_tokens == 6 and out.token_source == "tokens_predicted"
    assert out.input_len == 5 and out.ttft is not None and 0 < out.ttft <= out.e2e
    assert 1 <= len(out.itl) <= 4  # 5 token events (one merged), socket reads may merge more
    assert fake.bodies[0] == {"prompt": [9, 8, 7, 6, 5], "n_predict": 6, "ignore_eos": True,
                              "temperature": 0, "cache_prompt": False, "stream": True}
    assert off.ok and fake.bodies[1]["ignore_eos"] is False


async def test_send_http_resends_once_when_the_server_drops_the_connection_unanswered():
    req = BenchRequest(3, (9, 8, 7, 6, 5), " a b c d e", 6)
    async with FakeLlamaServer(drop_first=1) as fake, \
            aiohttp.ClientSession(base_url=f"http://127.0.0.1:{fake.port}") as http:
        out = await send_http(http, get_backend("llamacpp"), req, "m")
    assert out.ok, out.error
    assert out.output_tokens == 6 and len(fake.bodies) == 2
    async with FakeLlamaServer(drop_first=2) as fake, \
            aiohttp.ClientSession(base_url=f"http://127.0.0.1:{fake.port}") as http:
        out = await send_http(http, get_backend("llamacpp"), req, "m")
    assert not out.ok and "ServerDisconnectedError" in out.error  # once only
    assert len(fake.bodies) == 2


async def test_a_sweep_through_run_http():
    args = argparse.Namespace(backend="openai", concurrency=[1, 2], max_duration_s=30.0,
                              request_rate=math.inf, seed=0, no_progress=True,
                              ignore_eos=None, response_format=None)
    slices = [[BenchRequest(i, (1, 2, 3), " a b c", 4)] for i in range(2)]
    warm = [BenchRequest(-1, (4,), " d", 2)]
    async with FakeLlamaServer() as fake:
        levels = await run_http(args, f"http://127.0.0.1:{fake.port}", "llamacpp", None,
                                slices, warm, backend_name="llamacpp")
    assert [lv.concurrency for lv in levels] == [1, 2]
    for lv in levels:
        (r,) = lv.records
        assert r.ok and r.output_tokens == 4 and r.index >= 0
    assert len(fake.bodies) == 4  # warm-up + measured per level
    assert all(b["ignore_eos"] is True for b in fake.bodies)


# --------------------------------------------------------------------------- report


def _recs(n: int, out: int, target: int, e2e: float) -> list[RequestRecord]:
    return [RequestRecord(i, 21, target, ok=True, ttft=e2e / 4, e2e=e2e, itl=[0.01] * (out - 1),
                          output_tokens=out, token_source="usage") for i in range(n)]


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(slo_ttft_ms=None, slo_tpot_ms=None, **kw)


META = {"mode": "http", "backend": "openai", "model": "smol", "dtype": "bfloat16",
        "dataset": "fixed", "input_len": 21, "output_len": 8, "request_rate": "inf",
        "cpus": 2, "date": "today", "system": "ours", "ignore_eos": True,
        "llamacpp": {"command": "llama-server -m x.gguf -np 2", "build_info": "b1-abc",
                     "total_slots": 2, "n_ctx_per_slot": 64}}


def test_three_way_report_has_a_llamacpp_row_and_ratio():
    ours = [LevelResult(2, _recs(2, 8, 8, 1.0), 1.0)]
    hf = [LevelResult(2, _recs(2, 8, 8, 2.0), 2.0)]
    llama = [LevelResult(2, _recs(2, 7, 8, 0.5), 0.5)]  # one token short each
    doc = assemble(_args(), META, ours, hf, llama)
    (lv,) = doc["levels"]
    assert set(lv) == {"concurrency", "num_prompts", "ours", "baseline", "ratio", "records",
                       "llamacpp", "ratio_llamacpp"}
    assert set(lv["records"]) == {"ours", "baseline", "llamacpp"}
    assert lv["ratio"]["output_throughput"] == pytest.approx(2.0)
    assert lv["ratio_llamacpp"]["output_throughput"] == pytest.approx(16 / 28)
    table = report.format_table(doc)
    rows = {line.split()[1]: line for line in table.splitlines() if line.split()[:1] == ["2"]}
    assert set(rows) == {"ours", "hf", "llamacpp", "ours/hf", "ours/llamacpp"}
    assert "x2.00" in rows["ours/hf"] and "x0.57" in rows["ours/llamacpp"]
    assert "llama.cpp: llama-server -m x.gguf -np 2; build b1-abc, weights ?, 2 slots x 64" in table
    assert "c=2 llamacpp: 2 of 2 requests returned another output length" in table
    assert "c=2 ours:" not in table and "c=2 hf:" not in table
    assert "ignore_eos sent" in table


def test_without_llamacpp_the_document_keeps_its_shape():
    ours = [LevelResult(2, _recs(2, 8, 8, 1.0), 1.0)]
    doc = assemble(_args(), {**META, "llamacpp": None}, ours, None)
    (lv,) = doc["levels"]
    assert set(lv) == {"concurrency", "num_prompts", "ours", "baseline", "ratio", "records"}
    table = report.format_table(doc)
    assert "llamacpp" not in table and "ours/hf" not in table


def test_llamacpp_as_the_target_is_named_so():
    doc = assemble(_args(), {**META, "backend": "llamacpp", "system": "llamacpp"},
                   [LevelResult(1, _recs(1, 8, 8, 1.0), 1.0)],
                   [LevelResult(1, _recs(1, 8, 8, 2.0), 2.0)])
    names = [line.split()[1] for line in report.format_table(doc).splitlines()
             if line.split()[:1] == ["1"]]
    assert names == ["llamacpp", "hf", "llamacpp/hf"]


def test_plots_include_llamacpp(tmp_path):
    pytest.importorskip("matplotlib")
    doc = assemble(_args(), META, [LevelResult(c, _recs(2, 8, 8, 1.0), 1.0) for c in (1, 2)],
                   [LevelResult(c, _recs(2, 8, 8, 2.0), 2.0) for c in (1, 2)],
                   [LevelResult(c, _recs(2, 8, 8, 0.5), 0.5) for c in (1, 2)])
    paths = report.plot(doc, tmp_path)
    assert {p.name for p in paths} == {"latency_cdf.png", "throughput_vs_concurrency.png",
                                       "ttft_vs_concurrency.png"}


# --------------------------------------------------------------------------- flags, server


def _parse(*argv: str) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(list(argv))
    check_args(p, args)
    return args


@pytest.mark.parametrize("argv, msg", [
    (["--backend", "llamacpp"], "needs --url"),
    (["--backend", "llamacpp", "--engine-only"], "not the engine"),
    (["--backend", "llamacpp", "--llamacpp-url", "http://x:1"], "as --url"),
    (["--backend", "mindie", "--ignore-eos"], "has no ignore_eos"),
    (["--llama-server", "/nonexistent/llama-server"], "not an executable"),
    (["--llama-server", sys.executable, "--llamacpp-url", "http://x:1"], "exclude"),
])
def test_bad_flag_combinations(argv, msg, capsys):
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert msg in capsys.readouterr().err


def test_headline_workload_is_expressible():
    args = _parse("--backend", "openai", "--input-len", "21", "--output-len", "128",
                  "--concurrency", "1,16,64", "--num-prompts", "8,32,64", "--baseline", "hf",
                  "--llama-server", sys.executable)
    assert args.ignore_eos is None and get_backend("openai").ignore_eos
    assert math.isinf(args.request_rate)  # closed loop at each concurrency
    args = _parse("--backend", "llamacpp", "--url", "http://127.0.0.1:8081",
                  "--output-len", "128", "--no-ignore-eos")
    assert args.ignore_eos is False
    assert _parse("--engine-only", "--ignore-eos").ignore_eos is True


def test_llama_server_command_and_context():
    assert llama_server_ctx(64, 21 + 128) == 64 * 192  # each slot holds the longest request
    assert llama_server_ctx(1, 48) == 64
    s = LlamaServer("/bin/llama-server", "/m/x.gguf", 16, 1024, "-fa on -t 1", threads=2)
    assert s.cmd == ["/bin/llama-server", "-m", "/m/x.gguf", "--host", "127.0.0.1", "--port",
                     str(s.port), "-t", "2", "-np", "16", "-c", "1024", "-fa", "on", "-t", "1"]
    assert s.url == f"http://127.0.0.1:{s.port}"
    s.stop()  # never started: only removes its log file


FAKE_BINARY = r"""import asyncio, json, sys
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
slots, ctx = int(argv[argv.index("-np") + 1]), int(argv[argv.index("-c") + 1])
with open(sys.argv[0] + ".argv", "w") as f:
    json.dump(argv, f)


async def handle(r, w):
    head = await r.readuntil(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n"):
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            n = int(v)
    body = await r.readexactly(n) if n else b""
    first = head.split(b"\r\n")[0].decode()
    if first.startswith("GET"):
        data = json.dumps({"status": "ok"} if "/health" in first else {
            "build_info": "b0-fake", "total_slots": slots, "model_ftype": "Q4_1",
            "default_generation_settings": {"n_ctx": ctx // slots}}).encode()
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(data) + data)
    else:
        b = json.loads(body)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Connection: close\r\n\r\n")
        for i in range(1, b["n_predict"] + 1):
            await asyncio.sleep(0.002)
            w.write(b"data: " + json.dumps({"content": " x", "tokens": [7], "stop": False,
                    "tokens_predicted": i, "tokens_evaluated": len(b["prompt"])}).encode()
                    + b"\n\n")
        w.write(b"data: " + json.dumps({"content": "", "tokens": [], "stop": True,
                "tokens_predicted": b["n_predict"], "tokens_evaluated": len(b["prompt"])
                }).encode() + b"\n\n")
    await w.drain()
    w.close()


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()

try:
    asyncio.run(main())
except KeyboardInterrupt:
    pass
"""


def test_run_llamacpp_starts_and_stops_a_llama_server(tmp_path):
    """The second-baseline path: start the binary with the right flags on a free port,
    read /props, sweep, stop it (a fake binary: a Python script)."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n" + FAKE_BINARY)
    binary.chmod(0o755)
    args = argparse.Namespace(
        backend="openai", concurrency=[1, 3], max_duration_s=30.0, request_rate=math.inf,
        seed=0, no_progress=True, ignore_eos=None, response_format=None,
        llama_server=str(binary),
        llamacpp_url=None, llamacpp_model=str(tmp_path / "m.gguf"), model=None,
        llama_server_args="--no-webui")
    slices = [[BenchRequest(i, (1, 2, 3), " a b c", 5)] for i in range(2)]
    levels, meta = run_llamacpp(args, slices, [], 3 + 5, None)
    assert [r.output_tokens for lv in levels for r in lv.records] == [5, 5]
    assert all(r.ok for lv in levels for r in lv.records)
    argv = orjson.loads((tmp_path / "llama-server.argv").read_text())
    assert argv[:2] == ["-m", str(tmp_path / "m.gguf")]
    assert argv[argv.index("-np") + 1] == "3" and argv[argv.index("-c") + 1] == str(3 * 64)
    assert argv[-1] == "--no-webui"
    assert meta["command"].startswith(str(binary)) and meta["build_info"] == "b0-fake"
    assert meta["total_slots"] == 3 and meta["n_ctx_per_slot"] == 64
    with pytest.raises(httpx.ConnectError):  # stopped
        httpx.get(meta["url"] + "/health", timeout=2.0)


def test_engine_only_builds_the_served_engine():
    """--engine-only takes the serve flags a started server would get (--server-args
    included), so an engine-only run measures the same engine as the HTTP one."""
    args = _parse("--engine-only", "--dtype", "float32",
                  "--server-args", "--quantization gguf --max-batch-size 8")
    cfg = engine_config(args)
    assert (cfg.quantization, cfg.max_batch_size, cfg.dtype) == ("gguf", 8, "float32")
    assert engine_config(_parse("--engine-only")).quantization == "auto"
