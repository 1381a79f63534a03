"""``tokenserve serve`` as a child process of the benchmark, on a free loopback port."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

log = logging.getLogger("bench")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``tokenserve serve`` on a free loopback port, as a child process (own session, so
    a Ctrl-C of the bench reaches it only through :meth:`stop`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "tokenserve.cli", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port), "--dtype", args.dtype, "--device", args.device,
                    "--log-level", "WARNING"]
        if args.model:
            self.cmd += ["--model", args.model]
        self.cmd += shlex.split(args.server_args)
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the server)
            prefix="tokenserve-bench-server-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> None:
        import httpx

        log.info("starting %s", shlex.join(self.cmd))
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server was not healthy within {timeout_s:.0f} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        with open(self._log.name, "rb") as f:
            return f.read()[-n:].decode("utf-8", "replace")

    def stop(self) -> None:
        """SIGINT (graceful), then SIGTERM, then SIGKILL; only this child."""
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
