"""Start and stop like a server (issue 11 item 3), with real processes and real streaming
clients.

The drain tests run ``serve_engine`` — the code behind ``tokenserve serve`` — in a child
process with the scripted engine of ``tests/fakes.py`` (no model to load, so they take
seconds); one test sends SIGTERM to a real ``tokenserve serve`` with the default model.
Start-up errors run the CLI itself: each must be one line, exit status 2, and come
before the model loads.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
STREAM = {"input_id": [1, 2, 3], "stream": True, "parameters": {"max_new_tokens": 40}}

#: serve_engine with the scripted engine: argv = port, drain seconds, seconds per token
FAKE_SERVER = """
import logging, sys
from tests.fakes import FakeEngine
from tokenserve.server.main import serve_engine
from tokenserve.transport.runtime import run
from tokenserve.config.tree import ServeConfig, ServerConfig as ServerOptions

class Engine(FakeEngine):
    async def start(self): pass
    async def stop(self): print("engine stopped", flush=True)

logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
port, drain, delay = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
cfg = ServeConfig(server=ServerOptions(port=port, drain_timeout_s=drain))
run(serve_engine(cfg, build=lambda: Engine(delay=delay)))
print("exited cleanly", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not become healthy")


def start_fake(drain_s: float, delay_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVER, str(port), str(drain_s),
                             str(delay_s)], cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, f"{url}/health", 30)
    return proc, url


class StreamReader(threading.Thread):
    """Reads one streamed response to its end in a thread; keeps what arrived and the
    error that ended it (an incomplete chunked body raises in httpx)."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.chunks: list[bytes] = []
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body,
                              timeout=30) as r:
                assert r.status_code == 200
                for chunk in r.iter_bytes():
                    self.chunks.append(chunk)
                    self.started.set()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
        finally:
            self.started.set()

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode()


def finish(proc: subprocess.Popen, timeout: float = 20) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def test_sigterm_drains_running_streams_then_exits_0():
    proc, url = start_fake(drain_s=10, delay_s=0.03)  # streams take ~1.2 s
    readers = [StreamReader(url, "/infer_token", STREAM),
               StreamReader(url, "/generate_stream",
                            {"inputs": "abc", "parameters": {"max_new_tokens": 40}})]
    for r in readers:
        assert r.started.wait(10)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(f"{url}/health", timeout=2)
    for r in readers:
        r.join(15)
    out = finish(proc)
    assert proc.returncode == 0, out
    assert "draining 2 requests (up to 10 s; signal again to stop now)" in out, out
    assert "exited cleanly" in out and "Traceback" not in out, out
    for r in readers:
        assert r.error is None, r.error
    assert '"generated_text"' in readers[0].text  # the native final event
    assert readers[1].text.rstrip().endswith("}")
    assert '"finish_reason":"length"' in readers[1].text or '"generated_text"' in readers[1].text


def test_drain_time_ends_streams_with_an_error_and_a_proper_end():
    proc, url = start_fake(drain_s=0.5, delay_s=0.25)  # streams would take 10 s
    readers = [StreamReader(url, "/infer_token", STREAM),
               StreamReader(url, "/v1/completions",
                            {"model": "fake-model", "prompt": "abc", "max_tokens": 40,
                             "stream": True})]
    for r in readers:
        assert r.started.wait(10)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    for r in readers:
        r.join(10)
    out = finish(proc)
    assert time.monotonic() - t0 < 6
    assert proc.returncode == 0, out
    for r in readers:
        # httpx raises on a chunked body cut mid-way: none here, the body ended properly
        assert r.error is None, r.error
        # the family's in-stream error event is the last one (no [DONE] after an error)
        last = [ln for ln in r.text.splitlines() if ln.startswith("data:")][-1]
        err = json.loads(last[len("data:"):])["error"]
        assert (err["message"] if isinstance(err, dict) else err) == \
            "The server is shutting down: the drain time of 0.5 s ended.", r.text
    assert "Traceback" not in out, out


def test_second_signal_stops_at_once_without_a_traceback():
    proc, url = start_fake(drain_s=30, delay_s=0.25)
    reader = StreamReader(url, "/infer_token", STREAM)
    assert reader.started.wait(10)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out = finish(proc, 10)
    assert time.monotonic() - t0 < 5
    reader.join(5)
    assert proc.returncode == 0, out
    assert "stopping now" in out and "Traceback" not in out, out
    assert "never retrieved" not in out, out


# --------------------------------------------------------------------------- start-up errors


def run_cli(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tokenserve.cli", "serve", *args], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "KV cache" not in proc.stdout + proc.stderr


def test_port_in_use_is_one_line_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc, _ = run_cli("--port", str(port))
    assert_one_line_error(proc, f"127.0.0.1:{port}: the port is already in use")
    assert "model" not in proc.stdout  # nothing was loaded


def test_bad_model_paths_are_one_line_errors(tmp_path):
    not_model = tmp_path / "notes"
    not_model.mkdir()
    (not_model / "config.json").write_text(json.dumps({"ServerConfig": {}}))
    empty = tmp_path / "empty_path.json"
    doc = json.loads((ROOT / "examples" / "config.json").read_text())
    doc["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = ""
    empty.write_text(json.dumps(doc))
    cases = [(("--model", str(tmp_path / "missing")), "does not exist"),
             (("--model", str(not_model)), "is not a model directory"),
             (("--config", str(empty)), "modelWeightPath")]
    procs = [subprocess.Popen([sys.executable, "-m", "tokenserve.cli", "serve", *args],
                              cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for args, _ in cases]
    for p, (_, needle) in zip(procs, cases):
        out, err = p.communicate(timeout=60)
        assert_one_line_error(subprocess.CompletedProcess(p.args, p.returncode, out, err),
                              needle)


# --------------------------------------------------------------------------- the real server


def test_real_server_sigterm_lets_a_stream_finish():
    """``tokenserve serve`` with the default model: SIGTERM while a stream runs."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenserve.cli", "serve", "--port",
                             str(port), "--kv-cache-bytes", str(32 << 20)], cwd=ROOT,
                            env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, f"{url}/health", 120)
        reader = StreamReader(url, "/infer", {"inputs": "Count to twenty:", "stream": True,
                                              "parameters": {"max_new_tokens": 24,
                                                             "ignore_eos": True}})
        assert reader.started.wait(30)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        out = finish(proc, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "draining 1 requests" in out and "Traceback" not in out, out
    assert reader.error is None and '"generated_text"' in reader.text, reader.text
