"""The engine as the HTTP layer sees it: a typed facade, nothing reached into.

Implemented by :class:`tokenserve.engine.engine.AsyncEngine` (and the tests' fakes)::

    engine.info          EngineInfo: model facts and limits (fixed)
    engine.tokenizer     encode / decode / chat template
    engine.stats()       EngineStats: a live snapshot (metrics, slot counts)
    engine.is_healthy()
    engine.compile_grammar(structured)  awaitable: the compiled constraint for
                         ``GenerateRequest.grammar`` (ValueError: the client's 400)
    engine.generate(req) RequestHandle: get(disconnected) / abort(error)
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from tokenserve.engine.info import EngineInfo, EngineStats
from tokenserve.engine.output_stream import RequestHandle
from tokenserve.messages import GenerateRequest
from tokenserve.sampling_params import StructuredOutput

__all__ = ["EngineClient", "EngineInfo", "EngineStats"]


class EngineClient(Protocol):
    """What every family, the metrics and the management routes use of the engine."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def tokenizer(self) -> Any: ...

    def stats(self) -> EngineStats: ...

    def is_healthy(self) -> bool: ...

    async def compile_grammar(self, structured: StructuredOutput) -> Any: ...

    def generate(self, request: GenerateRequest) -> RequestHandle: ...


def engine_healthy(engine: EngineClient) -> bool:
    """``engine.is_healthy()``, with a health check that raises counted (and logged) as
    unhealthy: a probe answers 503, never 500."""
    try:
        return bool(engine.is_healthy())
    except Exception:
        logging.getLogger(__name__).exception("engine health check failed")
        return False
