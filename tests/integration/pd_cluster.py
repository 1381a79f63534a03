"""Real PD processes on 127.0.0.1 for the integration tests: ``tokenserve serve`` instances
(mixed, prefill, decode) and ``tokenserve coordinator``, each a child process on its own
ephemeral port, started on first use, stopped at the end of the session (or by the test
that kills one). Every instance serves the real default model in bf16 with a small block
size; they run one OpenMP thread each, so several fit on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BLOCK = 16
KV_BYTES = 64 << 20
#: bytes one token takes in the default model's default (int8) KV cache: K and V, 30 layers,
#: 3 kv heads, 64 int8 values and a 4-byte scale a row
KV_TOKEN_BYTES = 2 * 30 * 3 * (64 + 4)
START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """One child process serving HTTP on ``port``."""

    name: str
    args: list[str]
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Proc:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **self.extra_env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenserve.cli", *self.args], env=env,
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, path: str = "/health") -> Proc:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n"
                                   + self.log.read_text()[-3000:])
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.name} not ready after {START_TIMEOUT_S} s:\n"
                           + self.log.read_text()[-3000:])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def status(self) -> dict:
        return httpx.get(self.url + "/v1/status", timeout=10).json()

    def assert_leak_free(self, timeout: float = 30.0) -> None:
        """Every KV block free and no request left (waits for in-flight releases)."""
        deadline = time.monotonic() + timeout
        while True:
            res = self.status()["resource"]
            if (res["availBlockNum"] == res["totalNpuBlockNums"]
                    and res["runningRequestNum"] == 0 and res["waitingRequestNum"] == 0):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} leaks: {res}")
            time.sleep(0.2)


def serve_args(port: int, *extra: str, kv_bytes: int = KV_BYTES) -> list[str]:
    return ["serve", "--port", str(port), "--block-size", str(BLOCK),
            "--kv-cache-bytes", str(kv_bytes), "--max-batch-size", "32", *extra]


def instance(name: str, tmp: Path, *extra: str, kv_bytes: int = KV_BYTES) -> Proc:
    port = free_port()
    return Proc(name, serve_args(port, *extra, kv_bytes=kv_bytes), port,
                tmp / f"{name}.log")


def coordinator(tmp: Path, prefill: list[Proc], decode: list[Proc], *extra: str,
                name: str = "coordinator") -> Proc:
    port = free_port()
    args = ["coordinator", "--port", str(port),
            "--prefill", ",".join(p.addr for p in prefill),
            "--decode", ",".join(d.addr for d in decode), *extra]
    return Proc(name, args, port, tmp / f"{name}.log")


@contextlib.contextmanager
def module_coordinators(pd: dict, tmp: Path, prefix: str) -> Iterator[dict]:
    """The session's PD processes plus a module's own coordinators (a decode instance
    serves one /dresult consumer): ``coord`` (p; d, d2) and ``coord_tiny`` (p; tiny, with
    ``--max-retry 20``), named ``prefix`` and ``prefix_tiny``, stopped on exit."""
    coords = {
        "coord": coordinator(tmp, [pd["p"]], [pd["d"], pd["d2"]], name=prefix),
        "coord_tiny": coordinator(tmp, [pd["p"]], [pd["tiny"]], "--max-retry", "20",
                                  name=f"{prefix}_tiny"),
    }
    try:
        for c in coords.values():
            c.start()
        for c in coords.values():
            c.wait_ready("/v1/health")
        yield {**pd, **coords}
    finally:
        for c in coords.values():
            c.stop()
