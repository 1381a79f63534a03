"""Servers as child processes of the benchmark, on a free loopback port: ``tokenserve
serve`` (:class:`ServerProcess`) and llama.cpp's ``llama-server`` (:class:`LlamaServer`)."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from tokenserve.api.routes import path_of

log = logging.getLogger("bench")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_count() -> int:
    """CPUs this process may run on (``nproc``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


#: the CPU flags that decide the kernels' code paths (csrc/cpu_features.h)
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
              "amx_int8", "avx_ne_convert")


def parse_lscpu(text: str, flags: Sequence[str] = SIMD_FLAGS) -> dict[str, Any]:
    """Model name, CPU count and which of ``flags`` are present, from ``lscpu`` (or
    ``/proc/cpuinfo``) text: ``{"model", "cpus", "flags": {flag: bool}}``."""
    model = cpus = None
    present: set[str] = set()
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip().lower(), val.strip()
        if key == "model name" and model is None:
            model = val
        elif key == "cpu(s)" and cpus is None:
            cpus = val
        elif key in ("flags", "features"):
            present |= set(val.split())
    return {"model": model, "cpus": cpus, "flags": {f: f in present for f in flags}}


def lscpu_text() -> str:
    """``lscpu``'s output (``LC_ALL=C``), else ``/proc/cpuinfo``, else ``""``."""
    if shutil.which("lscpu"):
        try:
            return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                                  check=True, env={**os.environ, "LC_ALL": "C"}).stdout
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_summary() -> str:
    """The CPU model and the :data:`SIMD_FLAGS` it has, e.g. ``AMD EPYC, flags: avx2 fma
    avx512f avx512_bf16 avx512_vnni``."""
    info = parse_lscpu(lscpu_text())
    return (f"{info['model'] or platform.processor() or '?'}, flags: "
            f"{' '.join(f for f, on in info['flags'].items() if on)}")


class ChildServer:
    """A server command on a free loopback port, as a child process (own session, so a
    Ctrl-C of the bench reaches it only through :meth:`stop`); healthy when ``GET
    /health`` answers 200. Subclasses set :attr:`cmd` (after ``super().__init__``)."""

    name = "server"

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd: list[str] = []
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the server)
            prefix=f"tokenserve-bench-{self.name}-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> None:
        import httpx

        log.info("starting %s", shlex.join(self.cmd))
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + path_of("server.health"), timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.name} was not healthy within {timeout_s:.0f} s:\n"
                           f"{self.log_tail()}")

    def peak_rss_mib(self) -> float | None:
        """The server process's peak resident set (``VmHWM`` of ``/proc/PID/status``, MiB)
        so far; None when it is not running or not on Linux."""
        if self.proc is None:
            return None
        from tokenserve.ops.host_memory import process_rss

        rss = process_rss(self.proc.pid)
        return None if rss is None else rss[1] / 2**20

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        with open(self._log.name, "rb") as f:
            return f.read()[-n:].decode("utf-8", "replace")

    def stop(self) -> float | None:
        """SIGINT (graceful), then SIGTERM, then SIGKILL; only this child. Returns its
        :meth:`peak_rss_mib` just before the signal (None when it was not running)."""
        rss = self.peak_rss_mib()
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                proc.send_signal(sig)
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass
        return rss


class ServerProcess(ChildServer):
    """``tokenserve serve`` with the bench's ``--dtype``, ``--device``, ``--model`` and
    ``--server-args``."""

    name = "server"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.cmd = [sys.executable, "-m", "tokenserve.cli", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port), "--dtype", args.dtype, "--device", args.device,
                    "--log-level", "WARNING"]
        if args.model:
            self.cmd += ["--model", args.model]
        self.cmd += shlex.split(args.server_args)


def llama_server_ctx(slots: int, max_tokens: int) -> int:
    """``-c`` for ``slots`` parallel slots of at least ``max_tokens`` (prompt + output)
    each: llama-server splits ``-c`` evenly over ``-np`` slots (no ``--kv-unified``).
    Per slot: ``max_tokens`` + 16 spare, rounded up to a multiple of 64."""
    per_slot = -(-(max_tokens + 16) // 64) * 64
    return slots * per_slot


class LlamaServer(ChildServer):
    """llama.cpp's ``llama-server BINARY -m GGUF --host 127.0.0.1 --port P -t <nproc>
    -np <slots> -c <ctx>`` plus ``extra_args`` (given later, so they win)."""

    name = "llama-server"

    def __init__(self, binary: str, gguf: str, slots: int, ctx: int, extra_args: str = "",
                 threads: int | None = None) -> None:
        super().__init__()
        self.cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", str(threads or cpu_count()), "-np", str(slots), "-c", str(ctx)]
        self.cmd += shlex.split(extra_args)
