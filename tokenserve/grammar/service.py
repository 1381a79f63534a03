"""The async shell of :class:`~tokenserve.grammar.compiler.GrammarCompiler`: compiles
off the event loop, in its own worker threads, with a time bound.

A compile that outlives ``limits.compile_timeout_s`` is answered at once as the
client's error; its thread finishes (or hits llguidance's fuel limits) on its own, and
never holds the event loop or the model thread. Cache hits answer without a thread hop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tokenserve.grammar.compiler import CompiledGrammar, GrammarCompiler, GrammarLimits
from tokenserve.sampling_params import StructuredOutput


class GrammarService:
    """Async compiles for one tokenizer.

    Args:
        make_compiler: builds the synchronous core (its cache and limits); called once,
            by the first compile, in a worker thread (building llguidance's tokenizer
            takes ~0.25 s for a 49k vocabulary).
        limits: the bounds (the compiler's own, once it is built; its time bound
            applies from the first compile, which also builds llguidance's tokenizer).
        workers: compile threads (a slow compile occupies one).
    """

    def __init__(self, make_compiler: Callable[[], GrammarCompiler],
                 limits: GrammarLimits | None = None, workers: int = 2) -> None:
        self._make = make_compiler
        self._limits = limits or GrammarLimits()
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        #: compiles in flight, so concurrent requests with one constraint compile it once
        self._inflight: dict[StructuredOutput, asyncio.Future[CompiledGrammar]] = {}

    @property
    def limits(self) -> GrammarLimits:
        return self._compiler.limits if self._compiler is not None else self._limits

    def compiler(self) -> GrammarCompiler:
        """The synchronous core (built on first use; blocking then)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make()
            return self._compiler

    def _compile(self, s: StructuredOutput) -> CompiledGrammar:
        return self.compiler().compile(s)

    async def compile(self, s: StructuredOutput) -> CompiledGrammar:
        """The compiled ``s`` (cached, or compiled in a worker thread).

        Raises:
            ValueError: invalid, too large, or not compiled within the time bound.
        """
        if self._compiler is not None:
            hit = self._compiler.cached(s)
            if hit is not None:
                return hit
        fut = self._inflight.get(s)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = asyncio.ensure_future(loop.run_in_executor(self._pool, self._compile, s))
            self._inflight[s] = fut
            fut.add_done_callback(lambda f: self._done(s, f))
        timeout = self.limits.compile_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise ValueError(f"the {s.kind.value} constraint did not compile within "
                             f"{timeout:g} s") from None

    def _done(self, s: StructuredOutput, fut: asyncio.Future[CompiledGrammar]) -> None:
        self._inflight.pop(s, None)
        if not fut.cancelled():
            fut.exception()  # retrieved: every waiter may have timed out already

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
