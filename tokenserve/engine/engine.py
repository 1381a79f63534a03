"""AsyncEngine: wires tokenizer, model, KV cache, scheduler and executor actors.

Public surface used by the HTTP layer (``EngineClient`` in ``api/engine_client.py``)::

    engine = AsyncEngine.build(EngineConfig(...))     # loads the model (blocking)
    await engine.start()
    engine.info, engine.tokenizer, engine.stats(), engine.is_healthy()
    grammar = await engine.compile_grammar(structured)  # structured output (ValueError: 400)
    handle = engine.generate(GenerateRequest(...))    # a RequestHandle
    out = await handle.get(disconnected)              # next output (None: disconnected)
    handle.abort()                                    # the engine answers a final ABORT
    await engine.stop()

Every request ends with one final output, whatever ended it (aborts included).

PD adds ``kv_region``, ``rank_kv`` (tensor parallelism), ``set_kv_puller``, ``release``
and ``evict`` (``PdEngine`` in ``api/engine_client.py``). ``evict`` and ``wait_idle`` wait
on the scheduler actor's reply (a future carried by their message), not on a polling loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tokenserve.config.tree import EngineConfig
from tokenserve.engine.block_pool import BlockPool
from tokenserve.engine.finish import aborted
from tokenserve.engine.info import EngineInfo, EngineStats
from tokenserve.engine.loading import load_model, resolve
from tokenserve.engine.model_runner import ExecutorActor, ModelRunner
from tokenserve.engine.output_stream import RequestHandle
from tokenserve.engine.scheduler import Scheduler, SchedulerConfig
from tokenserve.engine.scheduler_actor import KvPuller, SchedulerActor
from tokenserve.engine.tensor_parallel import TpModel, start_rank0
from tokenserve.grammar.compiler import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarLimits,
    make_tokenizer,
)
from tokenserve.grammar.service import GrammarService
from tokenserve.messages import (
    AbortRequest,
    EngineOverloadedError,
    FinishReason,
    GenerateRequest,
    RequestOutput,
    WaitIdle,
)
from tokenserve.models.config import ModelConfig, kv_window, max_exact_positions
from tokenserve.models.tokenizer import Tokenizer
from tokenserve.ops.host_memory import process_rss
from tokenserve.ops.linear import describe_gemms
from tokenserve.sampling_params import StructuredOutput

log = logging.getLogger("tokenserve.engine")

__all__ = ["AsyncEngine", "EngineInfo", "EngineStats"]


class AsyncEngine:
    """The serving engine behind every API family."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, tokenizer: Tokenizer,
                 runner: ModelRunner, model_name: str, device: str | None = None,
                 executor: ExecutorActor | None = None) -> None:
        self.cfg = cfg
        self.model_config = model_cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = model_cfg.vocab_size
        exact = max_exact_positions(model_cfg)
        self.max_model_len = min(cfg.max_seq_len or exact, exact)
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
                            eos_token_ids=eos, spec=cfg.speculative_config,
                            kv_window=kv_window(model_cfg)), self.pool)
        self.scheduler.parking.timeout_s = cfg.kv_trans_timeout_s
        #: longest prompt the KV cache can hold, leaving room for one token
        kv_tokens = runner.num_blocks * cfg.block_size - 1
        self.info = EngineInfo(
            model_name=model_name, vocab_size=model_cfg.vocab_size,
            max_model_len=self.max_model_len,
            max_input_len=min(self.max_input_len, kv_tokens),
            max_batch_size=cfg.max_batch_size,
            max_prefill_batch_size=cfg.max_prefill_batch_size,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_iter_times=cfg.max_iter_times, block_size=cfg.block_size,
            num_blocks=runner.num_blocks, kv_cache_bytes=cfg.kv_cache_bytes,
            model_path=str(cfg.model or ""),
            device=device or (cfg.device if cfg.device != "auto" else "cpu"),
            dtype=cfg.dtype, world_size=cfg.parallel.tensor_parallel_size,
            weights_bytes=getattr(getattr(runner, "model", None), "weight_bytes", 0),
            gemm=(describe_gemms(runner.model.linears())
                  if hasattr(getattr(runner, "model", None), "linears") else ""))
        self.executor = executor if executor is not None else ExecutorActor(runner)
        self._runner = runner
        self._streams: dict[str, RequestHandle] = {}
        self.actor = SchedulerActor(
            self.scheduler, self.executor, tokenizer, self._streams,
            max_iter_times=cfg.max_iter_times, token_timeout_s=cfg.token_timeout_s,
            e2e_timeout_s=cfg.e2e_timeout_s)
        self._task: asyncio.Task | None = None
        self._failure: str | None = None
        #: structured output: compiles for this tokenizer (llguidance's view of it is
        #: built by the first compile, in the compile thread: ~0.25 s)
        limits = GrammarLimits(max_text_bytes=cfg.grammar_max_bytes,
                               compile_timeout_s=cfg.grammar_compile_timeout_s,
                               cache_size=cfg.grammar_cache_size)
        self.grammars = GrammarService(lambda: GrammarCompiler(make_tokenizer(
            tokenizer.to_json_str(), model_cfg.vocab_size, tuple(sorted(eos))), limits),
            limits)

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(cls, cfg: EngineConfig) -> AsyncEngine:
        """Load the model and size the KV cache (blocking; seconds).

        Raises:
            ValueError: bad model path, unsupported architecture, or a KV budget too
                small for one block.
        """
        resolved = resolve(cfg)
        cfg, model_cfg, model_dir, device = (resolved.cfg, resolved.model_cfg,
                                             resolved.model_dir, resolved.device)
        asked = resolved.asked_dtype
        tokenizer = Tokenizer(model_dir)
        t0 = time.perf_counter()

        def load() -> ModelRunner:
            if cfg.parallel.tensor_parallel_size > 1:  # rank 0 of several (issue 41)
                model = start_rank0(resolved)
            else:
                model = load_model(resolved)
            kv_dtype = model.kv_cache_dtype(cfg.kv_cache_dtype)
            per_block = model.kv_bytes_per_token(kv_dtype) * cfg.block_size
            num_blocks = cfg.kv_cache_bytes // per_block
            if num_blocks < 1:
                model.close()
                raise ValueError(f"kv_cache_bytes={cfg.kv_cache_bytes} is less than one KV "
                                 f"block ({per_block} bytes)")
            return ModelRunner(model, num_blocks, cfg.block_size, kv_dtype)

        # the model thread loads the model too: it stays the process's only OpenMP master
        # (see model_runner.py)
        executor = ExecutorActor.start(load)
        runner = executor.runner
        model = runner.model
        per_token = model.kv_bytes_per_token(runner.kv_dtype)
        per_block = per_token * cfg.block_size
        num_blocks = runner.num_blocks
        engine = cls(cfg, model_cfg, tokenizer, runner, cfg.served_model_name or model_cfg.name,
                     device=device.type, executor=executor)
        log.info("model %s (%s) loaded on %s as %s%s in %.1f s", model_cfg.name, model_dir,
                 device, cfg.dtype, " (--dtype auto: the GGUF's own precision)"
                 if asked == "auto" and cfg.dtype != "bfloat16" else "",
                 time.perf_counter() - t0)
        log.info("kernels: %s; GEMM: %s", model.kernels.describe(), engine.info.gemm)
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %d bytes/token, %s)",
                 num_blocks, cfg.block_size, num_blocks * cfg.block_size,
                 num_blocks * per_block / 2**20, per_token,
                 str(runner.kv_dtype).removeprefix("torch."))
        rss = process_rss()
        if rss is not None:  # where the resident bytes are (issue 42)
            # this process's own region (under tensor parallelism, its KV heads' share)
            kv = runner.kv_region.numel() * runner.kv_region.element_size()
            log.info("memory: resident %.0f MiB (peak so far %.0f) = weights %.0f (%s) + KV cache "
                     "%.0f + the rest %.0f (Python, torch, tokenizer, buffers)",
                     rss[0] / 2**20, rss[1] / 2**20, model.weight_bytes / 2**20,
                     model.weight_formats, kv / 2**20,
                     (rss[0] - model.weight_bytes - kv) / 2**20)
        return engine

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        assert self._task is None, "engine already started"
        self._task = asyncio.create_task(self.actor.run(), name="tokenserve-scheduler")
        self._task.add_done_callback(self._on_actor_exit)

    async def stop(self) -> None:
        """Stop the actors; requests still in the engine end with an ERROR output."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._fail_all(self._failure or "engine stopped")
        self.executor.close()
        self.grammars.close()

    def _on_actor_exit(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        self._failure = f"scheduler actor died: {exc!r}"
        log.error(self._failure, exc_info=exc)
        self._fail_all(self._failure)

    def _fail_all(self, error: str) -> None:
        """End every request still in the engine with an ERROR final output (the actor is
        gone, so nobody else will)."""
        for rid, handle in list(self._streams.items()):
            self._streams.pop(rid, None)
            handle.put(RequestOutput(rid, (), "", True, FinishReason.ERROR, 0, 0, error=error))

    def is_healthy(self) -> bool:
        return self._task is not None and not self._task.done() and self._failure is None

    # ------------------------------------------------------------------ requests

    async def compile_grammar(self, structured: StructuredOutput) -> CompiledGrammar:
        """``structured`` compiled for this engine's tokenizer, for
        ``GenerateRequest.grammar``: in a worker thread, off the event loop and the model
        thread; cached (LRU by ``(kind, value)``); bounded in size and time
        (:class:`~tokenserve.grammar.compiler.GrammarLimits`).

        Raises:
            ValueError: the constraint is invalid, too large or too slow to compile (the
                family answers 400 before any compute).
        """
        return await self.grammars.compile(structured)

    def generate(self, request: GenerateRequest) -> RequestHandle:
        """Submit ``request``; returns its :class:`RequestHandle`, whose outputs end with
        one that has ``finished`` set.

        This is the engine's one admission check (the HTTP layer answers 4xx before it
        gets here, from the same :attr:`info` limits); the scheduler only asserts it held.
        An adopted request (PD) whose prompt plus adopted tokens do not fit gets a handle
        that has already ended, with an ERROR output.

        Raises (at once, before anything is queued):
            RuntimeError: the engine is not running.
            ValueError: a duplicate request_id, a prompt longer than
                ``info.max_input_len``, or ``params.structured`` without ``grammar``.
            EngineOverloadedError: the waiting queue is full.
        """
        if not self.is_healthy():
            raise RuntimeError(self._failure or "engine is not running")
        if request.request_id in self._streams:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        if (request.params.structured is None) != (request.grammar is None):
            raise ValueError("a structured-output request needs its compiled grammar "
                             "(compile_grammar) and only it carries one")
        if len(request.prompt_token_ids) > self.info.max_input_len:
            raise ValueError(f"prompt has {len(request.prompt_token_ids)} tokens; the limit "
                             f"is {self.info.max_input_len}")
        if len(self._streams) >= self.cfg.max_batch_size + self.cfg.max_queue_size:
            raise EngineOverloadedError(
                f"too many requests: {len(self._streams)} in the engine, limit "
                f"{self.cfg.max_batch_size} running + {self.cfg.max_queue_size} waiting")
        handle = RequestHandle(request.request_id, self._abort)
        too_long = self._adoption_too_long(request)
        if too_long is not None:  # the handle ends at once, as the stream of a PD decode
            handle.put(RequestOutput(request.request_id, (), "", True, FinishReason.ERROR,
                                     len(request.prompt_token_ids),
                                     len(request.adopt.output_token_ids), error=too_long))
            return handle
        self._streams[request.request_id] = handle
        self.actor.inbox.put_nowait(request)
        return handle

    def _adoption_too_long(self, request: GenerateRequest) -> str | None:
        """Why the tokens of an adopted request (prompt + those generated elsewhere) do not
        fit ``max_model_len`` or the whole KV cache with room for one more; None if they
        do (always, for a request that adopts nothing: ``max_input_len`` is tighter)."""
        if request.adopt is None:
            return None
        n = len(request.prompt_token_ids) + len(request.adopt.output_token_ids)
        if n >= self.max_model_len:
            return f"prompt has {n} tokens; max_seq_len is {self.max_model_len}"
        if self.pool.blocks_for(n + 1) > self.pool.num_blocks:
            return f"prompt of {n} tokens exceeds the whole KV cache"
        return None

    def _abort(self, request_id: str, error: str | None) -> None:
        """A handle's ``abort()``: the actor ends the request with a final output; with
        no actor running, it is ended here."""
        if not self.is_healthy():
            handle = self._streams.pop(request_id, None)
            if handle is not None:
                handle.put(RequestOutput(request_id, (), "", True, FinishReason.ERROR, 0, 0,
                                         error=error or self._failure or "engine stopped"))
            return
        fin = aborted(error)
        self.actor.inbox.put_nowait(AbortRequest(request_id, fin.reason, fin.error))

    # ------------------------------------------------------------------ PD

    @property
    def kv_region(self):
        """The KV cache: one contiguous tensor ``[layers, 2, num_blocks, Hkv, block_size,
        head_dim]`` (model dtype) for a KV transfer engine to register (PD)."""
        return self._runner.kv_region

    @property
    def rank_kv(self):
        """Tensor parallelism: the other ranks' share of the PD KV hand-off
        (:class:`tokenserve.engine.tp_kv.RankKv`: open their transfer engines, pull rank
        to rank); None on one process."""
        model = self._runner.model
        return model.rank_kv if isinstance(model, TpModel) else None

    def set_kv_puller(self, puller: KvPuller) -> None:
        """PD decode: ``puller(source, dst_blocks, num_tokens)`` fills this instance's
        ``dst_blocks`` with the K/V of positions ``[0, num_tokens)`` from ``source`` (a
        ``KvAdoption.source``); blocking, run in a worker thread; raises on failure."""
        self.actor.kv_puller = puller

    def release(self, request_id: str) -> bool:
        """PD prefill: the decode instance has the request's K/V: free its parked blocks
        (spec §8.1 ``ReleaseKVCacheChannel``). False when it is not in the engine."""
        handle = self._streams.get(request_id)
        if handle is None:
            return False
        self._abort(request_id, None)
        return True

    async def evict(self, request_id: str, timeout_s: float = 10.0) -> bool:
        """PD prefill: end ``request_id`` if the engine still holds it (a copy parked for
        a decode instance that died before pulling it) and wait until it has left the
        engine, its KV blocks freed, so a recompute under the same id can take its place
        (spec pd_disaggregation.md §7.3-§7.4; [I] replace, not reuse). False when the
        engine does not hold it. The abort carries a future the actor resolves right
        after ending the request: this wakes as soon as the actor has handled it.

        Raises:
            TimeoutError: it is still there after ``timeout_s`` seconds.
        """
        if request_id not in self._streams:
            return False
        if not self.is_healthy():
            self._abort(request_id, None)  # no actor: ended here, at once
            return True
        fin = aborted(None)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # the actor replies once it has ended the request (its blocks freed)
        self.actor.inbox.put_nowait(AbortRequest(request_id, fin.reason, fin.error, done))
        if not await self._reply(done, timeout_s):
            raise TimeoutError(f"request {request_id!r} did not leave the engine")
        return True

    async def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its KV blocks are freed before the next step."""
        handle = self._streams.get(request_id)
        if handle is not None:
            handle.abort()

    # ------------------------------------------------------------------ introspection

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), self.pool.num_blocks,
                           self.pool.num_free, s.num_preemptions,
                           {r.value: n for r, n in self.actor.finished_by_reason.items()},
                           s.prefix_query_tokens, s.prefix_hit_tokens, self.pool.num_cached,
                           num_draft_tokens=s.num_draft_tokens,
                           num_accepted_tokens=s.num_accepted_tokens,
                           mask_ms=self.actor.mask_ms, mask_steps=self.actor.mask_steps)

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is queued, running, parked or pulling and the actor's
        inbox is empty (tests: the leak invariant). The actor answers a
        :class:`~tokenserve.messages.WaitIdle` when it next blocks for a message idle.

        Raises:
            TimeoutError: still busy after ``timeout`` seconds, or the actor is not
                running while work is left (it never will be idle).
        """
        if not self.is_healthy():
            if self.scheduler.has_work() or not self.actor.inbox.empty():
                raise TimeoutError("the engine is not running and has work left")
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.actor.inbox.put_nowait(WaitIdle(done))
        if not await self._reply(done, timeout) or not done.done():
            raise TimeoutError(f"the engine is not idle after {timeout} s")

    async def _reply(self, done: asyncio.Future[None], timeout_s: float) -> bool:
        """Wait for the actor to resolve ``done``, or for the actor to end (it will not
        answer then; its requests are failed by :meth:`_on_actor_exit` / :meth:`stop`).
        False after ``timeout_s`` seconds with neither (``done`` is cancelled)."""
        assert self._task is not None
        finished, _ = await asyncio.wait({done, self._task}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        if not finished:
            done.cancel()
        return bool(finished)
