"""asyncio primitives shared by the engine and the transport (no other dependency)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class Signal(asyncio.Event):
    """A one-shot :class:`asyncio.Event` that also calls its subscribers when set, so one
    await can wait on it and on something else without a helper task (the HTTP server
    makes each request's ``disconnected`` one of these)."""

    def __init__(self) -> None:
        super().__init__()
        self._subscribers: list[Callable[[], None]] = []

    def subscribe(self, fn: Callable[[], None]) -> None:
        self._subscribers.append(fn)

    def unsubscribe(self, fn: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._subscribers.remove(fn)

    def set(self) -> None:
        if self.is_set():
            return
        super().set()
        for fn in list(self._subscribers):
            fn()
