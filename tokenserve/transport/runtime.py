"""Running a server process: the event loop (uvloop when installed) and the stop signals
(SIGTERM / SIGINT: the first drains, the second closes at once). Shared by ``tokenserve
serve`` and ``tokenserve coordinator``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a uvloop event loop when uvloop is installed,
    else on the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    loop = uvloop.new_event_loop()  # pragma: no cover - Python 3.10
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()


class Signals:
    """SIGTERM and SIGINT on the running loop (systemd, Docker and Kubernetes send
    SIGTERM; a terminal SIGINT): the first sets ``stop`` (drain), the second ``now``
    (close at once). A second signal before the model has loaded exits at once."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.now = asyncio.Event()
        self.serving = False
        self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        name = signal.Signals(sig).name
        if not self.stop.is_set():
            logger.warning("%s received: stopping%s", name,
                           "" if self.serving else " once the model has loaded "
                           "(signal again to stop now)")
            self.stop.set()
        elif not self.serving:
            logger.warning("%s received again: stopping now", name)
            os._exit(0)  # the model load runs in a thread that cannot be interrupted
        else:
            logger.warning("%s received again: stopping now", name)
            self.now.set()

    def close(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.remove_signal_handler(sig)
