"""AsyncEngine: wires tokenizer, model, KV cache, scheduler and executor actors.

Public surface used by the HTTP layer (``EngineClient`` in the API modules)::

    engine = AsyncEngine.build(EngineConfig(...))     # loads the model (blocking)
    await engine.start()
    async for out in engine.generate(GenerateRequest(...)):   # RequestOutput stream
        ...
    await engine.abort(request_id)
    await engine.stop()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tokenserve.config import EngineConfig, select_device
from tokenserve.engine.block_pool import BlockPool
from tokenserve.engine.executor import ExecutorActor
from tokenserve.engine.model_runner import ModelRunner
from tokenserve.engine.output_stream import RequestStream
from tokenserve.engine.scheduler import Scheduler, SchedulerConfig
from tokenserve.engine.scheduler_actor import SchedulerActor
from tokenserve.messages import (
    AbortRequest,
    EngineOverloadedError,
    FinishReason,
    GenerateRequest,
    RequestOutput,
)
from tokenserve.models.llama import LlamaForCausalLM
from tokenserve.models.loader import ModelConfig, load_weights, resolve_model
from tokenserve.models.tokenizer import Tokenizer

log = logging.getLogger("tokenserve.engine")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics and tests."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_preemptions: int
    finished_by_reason: dict[str, int]
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_cached_blocks: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens looked up, in [0, 1]."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks


class _Outputs:
    """The async iterator :meth:`AsyncEngine.generate` returns.

    Unlike an async generator, closing it before the first ``__anext__`` still aborts
    the request, so a consumer that fails between submitting and reading cannot leak
    KV blocks. ``aclose()`` (or garbage collection) on an unfinished request aborts it.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, stream: RequestStream) -> None:
        self._engine, self._rid, self._stream = engine, request_id, stream
        self._done = False
        self._closed = False

    def __aiter__(self) -> _Outputs:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done or self._closed:
            raise StopAsyncIteration
        try:
            out = await self._stream.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            await self.aclose()
            raise
        if out.finished:
            self._done = True
            self._engine._release_stream(self._rid, finished=True)
        return out

    def close(self) -> None:
        """Release the request (aborting it if unfinished); idempotent."""
        if not self._closed:
            self._closed = True
            self._engine._release_stream(self._rid, finished=self._done)

    async def aclose(self) -> None:
        self.close()

    __del__ = close


class AsyncEngine:
    """The serving engine behind every API family."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, tokenizer: Tokenizer,
                 runner: ModelRunner, model_name: str) -> None:
        self.cfg = cfg
        self.model_config = model_cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = model_cfg.vocab_size
        self.max_model_len = min(cfg.max_seq_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings)
        #: longest accepted prompt, tokens (spec config.md ``maxInputTokenLen``)
        self.max_input_len = min(cfg.max_input_len or self.max_model_len - 1,
                                 self.max_model_len - 1)
        eos = frozenset(model_cfg.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
        self.eos_token_ids = eos
        self.pool = BlockPool(runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_batch_size, cfg.max_num_batched_tokens, self.max_model_len,
                            cfg.max_prefill_batch_size, cfg.enable_chunked_prefill,
                            cfg.long_prefill_token_threshold, cfg.max_long_partial_prefills,
                            eos_token_ids=eos), self.pool)
        self.executor = ExecutorActor(runner)
        self._streams: dict[str, RequestStream] = {}
        self.actor = SchedulerActor(
            self.scheduler, self.executor, tokenizer, self._streams,
            max_iter_times=cfg.max_iter_times, token_timeout_s=cfg.token_timeout_s,
            e2e_timeout_s=cfg.e2e_timeout_s)
        self._task: asyncio.Task | None = None
        self._failure: str | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(cls, cfg: EngineConfig) -> AsyncEngine:
        """Load the model and size the KV cache (blocking; seconds).

        Raises:
            ValueError: bad model path, unsupported architecture, or a KV budget too
                small for one block.
        """
        model_dir = resolve_model(cfg.model)
        model_cfg = ModelConfig.from_dir(model_dir)
        tokenizer = Tokenizer(model_dir)
        device = select_device(cfg.device)
        t0 = time.perf_counter()
        model = LlamaForCausalLM.from_state_dict(
            model_cfg, load_weights(model_dir, cfg.torch_dtype), cfg.torch_dtype, device)
        per_block = model.kv_bytes_per_token() * cfg.block_size
        num_blocks = cfg.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={cfg.kv_cache_bytes} is less than one KV block "
                             f"({per_block} bytes)")
        runner = ModelRunner(model, num_blocks, cfg.block_size)
        log.info("model %s (%s) loaded on %s as %s in %.1f s", model_cfg.name, model_dir,
                 device, cfg.dtype, time.perf_counter() - t0)
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes/token)",
                 num_blocks, cfg.block_size, num_blocks * cfg.block_size,
                 num_blocks * per_block / 2**20, model.kv_bytes_per_token())
        return cls(cfg, model_cfg, tokenizer, runner, cfg.served_model_name or model_cfg.name)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        assert self._task is None, "engine already started"
        self._task = asyncio.create_task(self.actor.run(), name="tokenserve-scheduler")
        self._task.add_done_callback(self._on_actor_exit)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self.executor.close()

    def _on_actor_exit(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        self._failure = f"scheduler actor died: {exc!r}"
        log.error(self._failure, exc_info=exc)
        for rid, stream in list(self._streams.items()):
            stream.put(RequestOutput(rid, (), "", True, FinishReason.ERROR, 0, 0,
                                     error=self._failure))

    def is_healthy(self) -> bool:
        return self._task is not None and not self._task.done() and self._failure is None

    # ------------------------------------------------------------------ requests

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Submit ``request``; returns an async iterator of its outputs, the last one
        with ``finished`` set.

        Leaving early (``aclose()``, cancellation, client disconnect) aborts the request,
        which frees its KV blocks before the next step.

        Raises (at once, before anything is queued):
            RuntimeError: the engine is not running.
            ValueError: a duplicate request_id.
            EngineOverloadedError: the waiting queue is full.
        """
        if not self.is_healthy():
            raise RuntimeError(self._failure or "engine is not running")
        if request.request_id in self._streams:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        if len(self._streams) >= self.cfg.max_batch_size + self.cfg.max_queue_size:
            raise EngineOverloadedError(
                f"too many requests: {len(self._streams)} in the engine, limit "
                f"{self.cfg.max_batch_size} running + {self.cfg.max_queue_size} waiting")
        stream = RequestStream()
        self._streams[request.request_id] = stream
        self.actor.inbox.put_nowait(request)
        return _Outputs(self, request.request_id, stream)

    def _release_stream(self, request_id: str, finished: bool) -> None:
        """The consumer is done with a request: forget its stream; abort if unfinished."""
        if self._streams.pop(request_id, None) is not None and not finished:
            self.actor.inbox.put_nowait(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its KV blocks are freed before the next step."""
        self.actor.inbox.put_nowait(AbortRequest(request_id))

    # ------------------------------------------------------------------ introspection

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), self.pool.num_blocks,
                           self.pool.num_free, s.num_preemptions,
                           {r.value: n for r, n in self.actor.finished_by_reason.items()},
                           s.prefix_query_tokens, s.prefix_hit_tokens, self.pool.num_cached)

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is queued or running (tests: the leak invariant)."""
        async def _idle() -> None:
            while True:
                await self.actor.idle.wait()
                await asyncio.sleep(0)
                if self.actor.idle.is_set() and self.actor.inbox.empty() \
                        and not self.scheduler.has_work():
                    return
                await asyncio.sleep(0.01)
        await asyncio.wait_for(_idle(), timeout)
