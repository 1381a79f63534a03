"""Which files of ``tokenserve/`` one streamed chat request crosses on a mixed server.

Serves the default model in-process on a loopback port, sends one streamed
``POST /v1/chat/completions`` (warm-up first), and records, with ``sys.setprofile`` on the
event-loop thread, every ``tokenserve/`` file whose functions run while that request is in
flight. The forward pass runs on the executor's worker thread and is not traced: it is
listed apart (the model and its kernels compute every request's tokens at once).

    python tools/trace_request.py [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1] / "tokenserve"


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
            "messages": [{"role": "user", "content": "Say hello."}]}

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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=8)
    asyncio.run(main(ap.parse_args().max_tokens))
