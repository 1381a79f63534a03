"""The engine as the HTTP layer sees it: a typed facade, nothing reached into.

Implemented by :class:`tokenserve.engine.engine.AsyncEngine` (and the tests' fakes)::

    engine.info          EngineInfo: model facts and limits (fixed)
    engine.tokenizer     encode / decode / chat template
    engine.stats()       EngineStats: a live snapshot (metrics, slot counts)
    engine.is_healthy()
    engine.compile_grammar(structured)  awaitable: the compiled constraint for
                         ``GenerateRequest.grammar`` (ValueError: the client's 400)
    engine.generate(req) RequestHandle: get(disconnected) / abort(error)

What the PD instance side (``tokenserve.pd``) needs on top is :class:`PdEngine`: the KV
region to register (and, under tensor parallelism, the other ranks' share), the puller to
install on D, and P's release / evict of a parked request.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

from tokenserve.engine.info import EngineInfo, EngineStats
from tokenserve.engine.output_stream import RequestHandle
from tokenserve.engine.scheduler_actor import KvPuller
from tokenserve.messages import GenerateRequest
from tokenserve.sampling_params import StructuredOutput

__all__ = ["EngineClient", "EngineInfo", "EngineStats", "KvPuller", "PdEngine"]

@runtime_checkable
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


@runtime_checkable
class PdEngine(EngineClient, Protocol):
    """What PD's instance side (pd/node.py, pd/prefill.py, pd/decode.py, and the server
    wiring them) uses of the engine beyond :class:`EngineClient`
    (spec/pd_disaggregation.md)."""

    @property
    def kv_region(self) -> Any:
        """The KV cache as one contiguous tensor, for the KV transfer engine to register
        (``pd/kv_transfer.py`` ``KvTransfer``)."""
        ...

    @property
    def rank_kv(self) -> Any:
        """Tensor parallelism: the other ranks' share of the KV hand-off
        (``engine/tp_kv.py`` ``RankKv``: each rank's own transfer engine on its own KV
        shard, pulls rank to rank); None on one process."""
        ...

    def set_kv_puller(self, puller: KvPuller) -> None:
        """D: install the function that pulls an adopted request's K/V from P."""
        ...

    def release(self, request_id: str) -> bool:
        """P: D has the request's K/V: free its parked blocks. False when it is not in
        the engine."""
        ...

    async def evict(self, request_id: str, timeout_s: float = 10.0) -> bool:
        """P: end ``request_id`` if the engine holds it and wait until it has left, its
        KV blocks freed. False when it does not hold it.

        Raises:
            TimeoutError: it is still there after ``timeout_s`` seconds.
        """
        ...


def engine_healthy(engine: EngineClient) -> bool:
    """``engine.is_healthy()``, with a health check that raises counted (and logged) as
    unhealthy: a probe answers 503, never 500."""
    try:
        return bool(engine.is_healthy())
    except Exception:
        logging.getLogger(__name__).exception("engine health check failed")
        return False
