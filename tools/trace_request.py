"""Which files of ``tokenserve/`` one streamed chat request crosses: on a mixed server, or
through a PD cluster (a coordinator, a P and a D), each process recording its own.

Mixed (the default): serves the default model in-process on a loopback port, sends one
streamed ``POST /v1/chat/completions`` (warm-up first), and records, with
``sys.setprofile`` on the event-loop thread, every ``tokenserve/`` file whose functions run
while that request is in flight. The forward pass runs on the executor's worker thread and
is not traced: it is listed apart (the model and its kernels compute every request's
tokens at once).

``--pd``: starts ``tokenserve serve --role prefill``, ``--role decode`` and ``tokenserve
coordinator`` as child processes on loopback ports (one OpenMP thread each), each under
this script's ``--child`` wrapper: it records, the same way, on that process's event-loop
thread, from when the parent arms it (a ``<name>.start`` file) to when it stops it
(``<name>.stop``), and writes the files it ran to ``<name>.json``. The parent sends one
streamed chat request to the coordinator after a warm-up, arms every process before the
request and stops them after its last byte (plus ``--settle-s``, D's release of P's copy
runs after the last token); the idle window of the same length just before it is
recorded too, so a file the processes also ran with no request (the coordinator's status
polls, each instance's ``/v1/status`` answer) is marked ``idle too``.

    PYTHONPATH=. python tools/trace_request.py [--max-tokens 8]
    PYTHONPATH=. python tools/trace_request.py --pd [--max-tokens 8] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tokenserve.loadgen.server import ChildServer

ROOT = Path(__file__).resolve().parents[1] / "tokenserve"
PROMPT = [{"role": "user", "content": "Say hello."}]


async def main(max_tokens: int) -> None:
    from tokenserve.config.tree import EngineConfig
    from tokenserve.engine.engine import AsyncEngine
    from tokenserve.server.app import serve

    engine = await asyncio.to_thread(AsyncEngine.build, EngineConfig())
    await engine.start()
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(engine, port=0, stop=stop, started=started))
    server = await started
    url = f"http://127.0.0.1:{server.ports[0]}/v1/chat/completions"
    body = {"model": engine.info.model_name, "stream": True, "max_tokens": max_tokens,
            "messages": PROMPT}

    def send() -> None:
        with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body) as r:
            for _ in r.iter_bytes():
                pass

    await asyncio.to_thread(send)  # warm-up: imports and first-call paths
    seen: dict[str, int] = {}
    me = threading.get_ident()

    def profile(frame, event, arg):
        if event == "call" and threading.get_ident() == me:
            name = frame.f_code.co_filename
            if name.startswith(str(ROOT)):
                seen[name] = seen.get(name, 0) + 1

    sys.setprofile(profile)
    try:
        await asyncio.to_thread(send)
    finally:
        sys.setprofile(None)
    stop.set()
    await task
    await engine.stop()
    files = sorted(str(Path(f).relative_to(ROOT.parent)) for f in seen)
    print(f"{len(files)} files on the event-loop thread:")
    for f in files:
        print(f"  {f}  ({seen[str(ROOT.parent / f)]} calls)")


# ---------------------------------------------------------------------- --pd

def child(prefix: Path, argv: list[str]) -> int:
    """Run ``tokenserve <argv>`` in this process, recording the ``tokenserve/`` files its
    event-loop thread runs between ``<prefix>.start`` and ``<prefix>.stop`` (twice: the
    idle window, then the request's) into ``<prefix>.json``."""
    import asyncio.events

    loops: list[asyncio.AbstractEventLoop] = []

    def remember(make):
        def new_loop():
            loop = make()
            loops.append(loop)
            return loop
        return new_loop

    try:  # tokenserve.transport.runtime.run makes its loop with uvloop when installed
        import uvloop

        uvloop.new_event_loop = remember(uvloop.new_event_loop)
    except ImportError:
        asyncio.events.new_event_loop = remember(asyncio.events.new_event_loop)
    windows: list[dict[str, int]] = []
    root = str(ROOT)

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(root):
                seen = windows[-1]
                seen[name] = seen.get(name, 0) + 1

    def arm(flag: Path) -> None:  # on the loop thread: setprofile is per thread
        windows.append({})
        sys.setprofile(profile)
        flag.touch()

    def disarm(flag: Path) -> None:
        sys.setprofile(None)
        flag.touch()

    def control() -> None:
        for window in ("idle", "request"):
            for step, then, fn in (("start", "on", arm), ("stop", "off", disarm)):
                trigger = prefix.with_name(f"{prefix.name}.{window}.{step}")
                while not trigger.exists():
                    time.sleep(0.005)
                loops[-1].call_soon_threadsafe(
                    fn, prefix.with_name(f"{prefix.name}.{window}.{then}"))
        while not prefix.with_name(f"{prefix.name}.request.off").exists():
            time.sleep(0.005)
        out = [{str(Path(f).relative_to(ROOT.parent)): n for f, n in w.items()}
               for w in windows]
        prefix.with_suffix(".json").write_text(json.dumps(
            {"idle": out[0], "request": out[1]}, indent=1))

    threading.Thread(target=control, daemon=True).start()
    from tokenserve.cli import main as cli_main

    return cli_main(argv)


def _traced(name: str, prefix: Path, args: Callable[[int], list[str]]) -> ChildServer:
    """``tokenserve <args(port)>`` on a free loopback port under :func:`child`."""

    class Traced(ChildServer):
        def __init__(self) -> None:
            self.name = name
            super().__init__()
            self.cmd = [sys.executable, __file__, "--child", str(prefix), "--",
                        *args(self.port)]

    return Traced()


def _window(tmp: Path, names: list[str], window: str, step: str, then: str) -> None:
    for n in names:
        (tmp / f"{n}.{window}.{step}").touch()
    deadline = time.monotonic() + 30
    while not all((tmp / f"{n}.{window}.{then}").exists() for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"a process did not {step} its {window} window")
        time.sleep(0.005)


def trace_pd(max_tokens: int, settle_s: float, out: Path | None) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="trace_pd_"))
    # the children inherit this environment: one OpenMP thread each, this checkout first
    os.environ.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT.parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    p = _traced("p", tmp / "p", lambda port: ["serve", "--port", str(port), "--role", "prefill"])
    d = _traced("d", tmp / "d", lambda port: ["serve", "--port", str(port), "--role", "decode"])
    coord = _traced("coordinator", tmp / "coordinator", lambda port: [
        "coordinator", "--port", str(port), "--prefill", f"127.0.0.1:{p.port}",
        "--decode", f"127.0.0.1:{d.port}"])
    procs = [p, d, coord]
    try:
        for proc in procs:  # healthy: GET /health answers 200 (the coordinator's: P and D)
            proc.start()
        base = coord.url
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "stream": True, "max_tokens": max_tokens,
                "messages": PROMPT}

        def send() -> bytes:
            with httpx.Client(timeout=120) as client, client.stream(
                    "POST", base + "/v1/chat/completions", json=body) as r:
                return b"".join(r.iter_bytes())

        send()  # warm-up: imports and first-call paths, on every process
        t0 = time.monotonic()
        send()
        took = time.monotonic() - t0 + settle_s
        time.sleep(2.0)
        names = [proc.name for proc in procs]
        _window(tmp, names, "idle", "start", "on")
        time.sleep(took)
        _window(tmp, names, "idle", "stop", "off")
        _window(tmp, names, "request", "start", "on")
        answer = send()
        time.sleep(settle_s)
        _window(tmp, names, "request", "stop", "off")
        deadline = time.monotonic() + 30
        while not all((tmp / f"{n}.json").exists() for n in names):
            if time.monotonic() > deadline:
                raise TimeoutError("a process wrote no trace")
            time.sleep(0.01)
        result = {n: json.loads((tmp / f"{n}.json").read_text()) for n in names}
    finally:
        for proc in procs:
            proc.stop()
    assert answer.rstrip().endswith(b"data: [DONE]"), answer[-200:]
    print(f"one streamed POST /v1/chat/completions through a coordinator + P + D "
          f"(max_tokens {max_tokens}, window {took:.2f} s):")
    for n in names:
        req, idle = result[n]["request"], result[n]["idle"]
        only = [f for f in req if f not in idle]
        print(f"{n}: {len(req)} files on the event-loop thread, {len(only)} of them not "
              f"in the idle window")
        for f in sorted(req):
            print(f"  {f}  ({req[f]} calls{', idle too' if f in idle else ''})")
    if out is not None:
        out.write_text(json.dumps({"max_tokens": max_tokens, "window_s": took,
                                   "processes": result}, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if sys.argv[1:2] == ["--child"]:  # a --pd child: --child PREFIX -- <tokenserve argv>
        sys.exit(child(Path(sys.argv[2]), sys.argv[4:]))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--pd", action="store_true",
                    help="trace through a coordinator + P + D, one file set per process")
    ap.add_argument("--settle-s", type=float, default=0.3,
                    help="--pd: seconds recorded after the answer's last byte")
    ap.add_argument("--json", type=Path, default=None, help="--pd: write the file sets here")
    a = ap.parse_args()
    if a.pd:
        trace_pd(a.max_tokens, a.settle_s, a.json)
    else:
        asyncio.run(main(a.max_tokens))
