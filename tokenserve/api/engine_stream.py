"""Consuming the engine for one HTTP request (spec/interfaces.md §0.4 step 10, §2.3, §7.7).

:class:`EngineStream` is what every family iterates: the outputs of one engine
:class:`~tokenserve.engine.output_stream.RequestHandle`, ended by the client's disconnect
(the handle is aborted and :class:`ClientDisconnected` raised from the wait), with the
request registered for ``stopInfer`` (spec §2.3) and recorded in the server metrics
(spec §7.7). Nothing here cancels a task: a stop is ``handle.abort()``, and the engine
answers it with the request's final output.

:class:`FanOut` runs several of them at once (OpenAI ``n`` / several prompts, vLLM
``n`` / ``best_of``), admitting every engine request before the handler answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import replace
from types import TracebackType
from typing import Any, Protocol, Self

from tokenserve.aio import Signal
from tokenserve.api.context import ServeContext
from tokenserve.api.engine_client import EngineClient
from tokenserve.engine.output_stream import RequestHandle
from tokenserve.messages import EngineOverloadedError, GenerateRequest, RequestOutput
from tokenserve.transport.cycle import ClientDisconnected
from tokenserve.transport.errors import HttpError

logger = logging.getLogger(__name__)

#: What a stream that ended without a final output is answered with.
NO_FINAL_OUTPUT = "Engine stream ended without a final output."


class StreamObserver(Protocol):
    """PD: watches the engine side of one HTTP request (installed with :func:`observed`
    around the family handler) so the handler runs unchanged on a prefill or decode
    instance. A family handler runs in stages, parse -> plan -> run -> render; the
    observer plugs in between them: it may hand the handler a plan made elsewhere
    (:meth:`handed_plan`, the decode side: P's), it sees the engine request admitted
    (:meth:`admit`) and each output before it is rendered (:meth:`on_output`), and it may
    end the handler there (:meth:`before_wait`, the prefill side's hand-off)."""

    def handed_plan(self) -> GenerateRequest | None:
        """The engine request planned for this HTTP request elsewhere (its prompt ids,
        sampling and stopping parameters, priority and timeout): the family submits it
        instead of planning its own, so it neither templates nor tokenizes the prompt
        (:func:`handed_plan`). None: the family plans as usual."""

    def admit(self, request: GenerateRequest) -> GenerateRequest:
        """The engine request to submit instead of ``request`` (id, prompt, PD fields);
        raises HttpError to refuse (e.g. a second request of a fan-out)."""

    async def before_wait(self) -> None:
        """Called before the handler waits for the next output; may raise an exception
        that :meth:`hands_off` (the prefill side's hand-off)."""

    def hands_off(self, exc: BaseException | None) -> bool:
        """Whether ``exc``, leaving the handler, hands its engine request on to another
        instance (PD prefill -> decode): the request is then NOT aborted (its KV blocks
        wait for the decode instance) and the metrics count it as handed off."""

    def on_output(self, out: RequestOutput) -> None:
        """Called with every output, before the handler renders it."""

    def response_id(self, fresh: str) -> str:
        """The id the handler's answer carries instead of ``fresh`` (:func:`response_id`):
        the same on P and D, and on every resubmission, for one request."""


#: the observer of the family handler running in this task (:func:`observed`); None
#: outside PD. A context variable, so the family handlers keep their (request, response)
#: signature and a handler can never see another request's observer.
_OBSERVER: ContextVar[StreamObserver | None] = ContextVar("stream_observer", default=None)


@contextlib.contextmanager
def observed(observer: StreamObserver) -> Iterator[None]:
    """Run a family handler inside this block with ``observer`` watching every
    :class:`EngineStream` / :class:`FanOut` it opens (PD prefill and decode sides)."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def handed_plan() -> GenerateRequest | None:
    """The family's plan stage asks this first: under a PD decode observer, the engine
    request P planned (:meth:`StreamObserver.handed_plan`), which the family runs as it
    is (no chat template, no tokenizer); None: plan from the body."""
    observer = _OBSERVER.get()
    return None if observer is None else observer.handed_plan()


def response_id(fresh: str) -> str:
    """The id a family writes into its answer (OpenAI's ``chatcmpl-<hex>``, Triton's
    default ``id``): ``fresh`` (a new ``uuid4().hex``) on a mixed server; under a PD
    observer the observer's, so every chunk of one response carries one id although P and
    D each run the handler (issue 22: one id per response, as on a mixed server)."""
    observer = _OBSERVER.get()
    return fresh if observer is None else observer.response_id(fresh)


class EngineStream:
    """Consume one engine request for one HTTP request (spec §0.4 step 10).

    Use as ``async with EngineStream(engine, req, http_request.disconnected, context=ctx)
    as s:`` then ``async for out in s:``; put the response writes inside the block too.
    Each wait is for the next output or the client's disconnect; on a disconnect the
    request is aborted and :class:`ClientDisconnected` raised. On any exit before the
    final output (disconnect, error, ``break``) the request is aborted, so its KV blocks
    are freed at once.

    ``context`` (the server's :class:`ServeContext`) gets the request registered for
    ``stopInfer`` under its ``request_id`` and ``aliases`` (e.g. the client's Triton
    ``id``) while the block runs, and its metrics record the request. :meth:`stop` (what
    ``stopInfer`` and the drain call) aborts the request; the engine then sends its final
    output, ``ABORT`` (``stopped`` is then True), or ``ERROR`` carrying the given error.
    ``sibling_of``: the first stream of the same client request (one of several
    sequences or prompts), whose metrics tracker this one joins, so the request is
    counted once.
    """

    def __init__(
        self,
        engine: EngineClient,
        request: GenerateRequest,
        disconnected: Signal,
        *,
        context: ServeContext | None = None,
        aliases: Iterable[str] = (),
        sibling_of: EngineStream | None = None,
    ) -> None:
        self._sibling_of = sibling_of
        self._observer: StreamObserver | None = _OBSERVER.get()
        if self._observer is not None:
            request = self._observer.admit(request)
        self._engine = engine
        self._request = request
        self._disconnected = disconnected
        self._context = context
        self._ids = (request.request_id, *aliases)
        self._tracker: Any = None
        self._handle: RequestHandle | None = None
        self.finished = False
        self.stopped = False
        self.last: RequestOutput | None = None

    @property
    def request_id(self) -> str:
        """The engine's id of this request."""
        return self._request.request_id

    async def __aenter__(self) -> Self:
        if self._disconnected.is_set():
            raise ClientDisconnected()
        structured = self._request.params.structured
        if structured is not None and self._request.grammar is None:
            try:  # off the event loop; cached; a bad constraint is the client's 400
                grammar = await self._engine.compile_grammar(structured)
            except ValueError as exc:
                raise HttpError(400, str(exc)) from None
            self._request = replace(self._request, grammar=grammar)
            if self._disconnected.is_set():
                raise ClientDisconnected()
        try:
            self._handle = self._engine.generate(self._request)
        except EngineOverloadedError as exc:  # bounded waiting queue full: refuse at once
            raise HttpError(503, str(exc)) from exc
        ctx = self._context
        if ctx is not None:
            ctx.registry.add(self, self._ids)
            if ctx.metrics is not None:
                try:
                    first = self._sibling_of
                    self._tracker = (
                        first._tracker.sibling(self._request)
                        if first is not None and first._tracker is not None
                        else ctx.metrics.request_started(self._request))
                except Exception:
                    logger.exception("metrics: request_started failed")
        return self

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._handle is None or self.finished:
            raise StopAsyncIteration
        if self._observer is not None:
            await self._observer.before_wait()
        out = await self._handle.get(self._disconnected)
        if out is None:
            self._handle.abort()
            raise ClientDisconnected()
        self._record(out)
        return out

    def _record(self, out: RequestOutput) -> None:
        if self._observer is not None:
            self._observer.on_output(out)
        self.last = out
        if out.finished:
            self.finished = True
        if self._tracker is not None:
            try:
                self._tracker.output(out)
            except Exception:
                logger.exception("metrics: output failed")

    def poll(self) -> RequestOutput | None:
        """The output ready now (merged), without waiting; None when there is none."""
        if self._handle is None or self.finished:
            return None
        out = self._handle.poll()
        if out is not None:
            self._record(out)
        return out

    def listen(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` whenever the engine puts an output for this request."""
        assert self._handle is not None, "listen() after entering the block"
        self._handle.listen(fn)

    async def stop(self, error: str | None = None) -> bool:
        """Stop the request (spec §2.3 stopInfer): the engine ends it with a final
        ``ABORT`` output. With ``error`` (the server's drain time ended) the final output
        is an ``ERROR`` carrying it instead, so the family answers it as it answers an
        engine failure (spec §0.4 step 9). False when it had already ended."""
        if self._handle is None or not self._handle.abort(error):
            return False
        self.stopped = error is None
        return True

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        handed_off = self._observer is not None and self._observer.hands_off(exc)
        if self._handle is not None and not self.finished and not handed_off:
            self._handle.abort()
        ctx = self._context
        if ctx is not None:
            ctx.registry.remove(self, self._ids)
            if self._tracker is not None:
                try:
                    self._tracker.finished(
                        self.last if self.finished else None,
                        handed_off=handed_off,
                        disconnected=isinstance(exc, ClientDisconnected) or self.stopped)
                except Exception:
                    logger.exception("metrics: finished failed")
        return False


#: What :meth:`FanOut.batch` gives for one engine request: an output (every request
#: ends with a final one; a disconnect is raised, not handed out).
FanOutItem = RequestOutput | BaseException | None


class FanOut:
    """Consume several engine requests at once, each an :class:`EngineStream` (so each
    one can be stopped), their outputs tagged with the request's index. No task per
    request: every handle wakes one shared signal when it has output.

    Entering the block admits every request before the handler writes anything: a
    refusal (503 for a full queue) or any other admission error is raised from ``async
    with``, after the requests already admitted have been aborted (their KV blocks freed).
    Leaving the block aborts what has not finished.

    Two ways to read it: ``async for index, out in fan`` (outputs in arrival order until
    every request gave its final output), or :meth:`batch` (every output ready now, after
    waiting for one). A client disconnect is raised as :class:`ClientDisconnected`.
    """

    def __init__(
        self,
        engine: EngineClient,
        requests: list[GenerateRequest],
        disconnected: Signal,
        *,
        context: ServeContext | None = None,
    ) -> None:
        self._disconnected = disconnected
        self._observer: StreamObserver | None = _OBSERVER.get()
        assert requests, "a fan-out of no request"
        first = EngineStream(engine, requests[0], disconnected, context=context)
        # one client request: the metrics count it once (issue 40)
        self._streams = [first, *(EngineStream(engine, r, disconnected, context=context,
                                               sibling_of=first) for r in requests[1:])]
        self._entered: list[EngineStream] = []
        self._wake = asyncio.Event()

    async def __aenter__(self) -> Self:
        try:
            for stream in self._streams:
                await stream.__aenter__()
                self._entered.append(stream)
                stream.listen(self._wake.set)
        except BaseException as exc:
            await self._exit(type(exc), exc, exc.__traceback__)
            raise
        self._disconnected.subscribe(self._wake.set)
        return self

    async def _exit(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._disconnected.unsubscribe(self._wake.set)
        for stream in self._entered:
            await stream.__aexit__(exc_type, exc, tb)
        self._entered = []

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._exit(exc_type, exc, tb)

    def _ready(self) -> list[tuple[int, RequestOutput]]:
        items = []
        for i, stream in enumerate(self._streams):
            if not stream.finished:
                out = stream.poll()
                if out is not None:
                    items.append((i, out))
        return items

    async def batch(self) -> list[tuple[int, FanOutItem]]:
        """Wait for one output, then take every output already there (one engine step
        of several requests arrives together).

        Raises:
            ClientDisconnected: the client went away first (the requests are aborted
                when the block exits).
            RuntimeError: every request has already given its final output.
        """
        if all(s.finished for s in self._streams):
            raise RuntimeError("every request has finished")
        while True:
            items = self._ready()
            if items:
                return list(items)
            if self._disconnected.is_set():
                raise ClientDisconnected()
            if self._observer is not None:
                await self._observer.before_wait()
            self._wake.clear()
            await self._wake.wait()

    def __aiter__(self) -> Self:
        self._backlog: list[tuple[int, RequestOutput]] = []
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._backlog:
            if all(s.finished for s in self._streams):
                raise StopAsyncIteration
            self._backlog = [(i, out) for i, out in await self.batch()
                             if isinstance(out, RequestOutput)]
        return self._backlog.pop(0)
