"""Consuming the engine for one HTTP request (spec/interfaces.md §0.4 step 10, §2.3, §7.7).

:class:`EngineStream` is what every family iterates: the engine's outputs for one
``GenerateRequest``, with a client disconnect turned into an engine abort, the request
registered for ``stopInfer`` (spec §2.3) and recorded in the server metrics (spec §7.7).
Re-exported by :mod:`tokenserve.http.api.common`, its former home.

:class:`FanOut` runs several of them at once (OpenAI ``n`` / several prompts, vLLM
``n`` / ``best_of``), admitting every engine request before the handler answers.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tokenserve.http.context import ServeContext, context_of
from tokenserve.http.cycle import ClientDisconnected
from tokenserve.http.errors import HttpError
from tokenserve.messages import EngineOverloadedError, FinishReason, GenerateRequest, RequestOutput

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from typing import Self
    else:
        from typing_extensions import Self

    from tokenserve.http.api.common import EngineClient

logger = logging.getLogger(__name__)


class EngineStream:
    """Consume ``engine.generate(request)`` for one HTTP request (spec §0.4 step 10).

    Use as ``async with EngineStream(engine, req, http_request.disconnected) as s:``
    then ``async for out in s:``; put the response writes inside the block too. When the
    client disconnects, the task running the block is cancelled at its current await
    (engine wait or write) and the block exits with :class:`ClientDisconnected`. On any
    exit before the final output (disconnect, error, ``break``), the engine generator is
    closed and ``engine.abort(request_id)`` is awaited, so KV blocks are freed at once.
    After the final output the generator is closed too (``aclose()`` at its last yield),
    without waiting for it to return by itself.

    Shared server state (``tokenserve.http.context``): ``context`` (default: the one
    ``build_router`` attaches to the engine it hands the families) gets the request
    registered for ``stopInfer`` (spec §2.3) under its ``request_id`` and ``aliases``
    (e.g. the client's Triton ``id``) while the block runs, and its metrics record the
    request (spec §7.7). :meth:`stop` (what ``stopInfer`` calls) aborts the request in
    the engine and ends the iteration with a synthesized final output whose
    ``finish_reason`` is ``ABORT`` (``stopped`` is then True), so the family can still
    answer normally.
    """

    def __init__(
        self,
        engine: EngineClient,
        request: GenerateRequest,
        disconnected: asyncio.Event,
        *,
        context: ServeContext | None = None,
        aliases: tuple[str, ...] = (),
    ) -> None:
        self._engine = engine
        self._request = request
        self._disconnected = disconnected
        self._context = context if context is not None else context_of(engine)
        self._ids = (request.request_id, *aliases)
        self._tracker: Any = None
        self._gen: AsyncIterator[RequestOutput] | None = None
        self._owner: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._active = False
        self._fired = False
        self._exhausted = False
        self._waiting = False  # the owner is awaiting the engine inside __anext__
        self._stop_requested = False
        self._stop_error: str | None = None
        self._stop_cancels = 0  # our stop() cancellations not yet consumed
        self._num_tokens = 0
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
        self._owner = asyncio.current_task()
        try:
            self._gen = self._engine.generate(self._request)
        except EngineOverloadedError as exc:  # bounded waiting queue full: refuse at once
            raise HttpError(503, str(exc)) from exc
        self._active = True
        ctx = self._context
        if ctx is not None:
            ctx.registry.add(self, self._ids)
            if ctx.metrics is not None:
                try:
                    self._tracker = ctx.metrics.request_started(self._request)
                except Exception:
                    logger.exception("metrics: request_started failed")
        self._watcher = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def _watch(self) -> None:
        await self._disconnected.wait()
        # The owner is suspended inside the block whenever this runs with _active set, so
        # the CancelledError surfaces inside the block and __aexit__ sees it.
        if self._active and self._owner is not None:
            self._fired = True
            self._owner.cancel()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._gen is None or self._exhausted:
            raise StopAsyncIteration
        if self.finished:
            # Never wait for more after the final output (an engine generator may not
            # return on its own); __aexit__ closes it.
            raise StopAsyncIteration
        if self._stop_requested:
            return self._stopped_output()
        self._waiting = True
        try:
            out = await self._gen.__anext__()
        except StopAsyncIteration:
            self._exhausted = True
            raise
        except asyncio.CancelledError:
            if self._stop_cancels and not self._fired and self._owner is not None:
                self._stop_cancels -= 1
                uncancel = getattr(self._owner, "uncancel", None)
                if uncancel is None or uncancel() == 0:
                    self._exhausted = True  # the generator ended with the cancellation
                    return self._stopped_output()
            raise
        finally:
            self._waiting = False
        self.last = out
        self._num_tokens += len(out.new_token_ids)
        if out.finished:
            self.finished = True
        if self._tracker is not None:
            try:
                self._tracker.output(out)
            except Exception:
                logger.exception("metrics: output failed")
        return out

    def _stopped_output(self) -> RequestOutput:
        """The final output of a request ended by :meth:`stop` (``ERROR`` with the
        error given to it, else ``ABORT``)."""
        req = self._request
        out = RequestOutput(
            request_id=req.request_id,
            new_token_ids=(),
            new_text="",
            finished=True,
            finish_reason=FinishReason.ERROR if self._stop_error else FinishReason.ABORT,
            error=self._stop_error,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_output_tokens=self._num_tokens,
            seed=req.params.seed,
        )
        self.last = out
        self.finished = True
        self.stopped = True
        return out

    async def stop(self, error: str | None = None) -> bool:
        """Stop the request (spec §2.3 stopInfer): abort it in the engine and end the
        iteration with a final ``ABORT`` output. With ``error`` (the server's drain time
        ended) the final output is an ``ERROR`` carrying it instead, so the family answers
        it as it answers an engine failure (spec §0.4 step 9). False when it had already
        finished."""
        if self.finished or not self._active or self._stop_requested:
            return False
        self._stop_requested = True
        self._stop_error = error
        if self._waiting and self._owner is not None:
            self._stop_cancels += 1
            self._owner.cancel()
        try:
            await self._engine.abort(self._request.request_id)
        except Exception:
            logger.exception("aborting %s failed", self._request.request_id)
        return True

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._active = False
        if self._watcher is not None:
            self._watcher.cancel()
        uncancel = getattr(self._owner, "uncancel", None)
        while self._stop_cancels and uncancel is not None:
            self._stop_cancels -= 1  # a stop() cancel that never surfaced as ours
            uncancel()
        disconnected = False
        if self._fired:
            assert self._owner is not None
            # our cancellation is consumed; any other pending cancel keeps propagating
            # (Python 3.10 has no cancel counting: treat it as ours)
            disconnected = uncancel is None or uncancel() == 0
        try:
            await self._stop_engine()
        finally:
            self._unregister()
        if disconnected:
            raise ClientDisconnected() from exc
        return False

    def _unregister(self) -> None:
        ctx = self._context
        if ctx is None:
            return
        ctx.registry.remove(self, self._ids)
        if self._tracker is not None:
            try:
                self._tracker.finished(self.last if self.finished else None)
            except Exception:
                logger.exception("metrics: finished failed")

    async def _stop_engine(self) -> None:
        """Close the engine generator (it is suspended at its last yield, or mid-way) and
        abort the request unless its final output arrived."""
        aclose = getattr(self._gen, "aclose", None)
        if aclose is not None and not self._exhausted:
            try:
                await aclose()
            except Exception:
                logger.exception("closing the engine stream of %s failed", self._request.request_id)
        if not self.finished:
            try:
                await self._engine.abort(self._request.request_id)
            except Exception:
                logger.exception("aborting %s failed", self._request.request_id)


#: What :class:`FanOut` queues for one engine request: an output, then at its end
#: ``None`` (it ended; after its final output unless it ended early) or the exception
#: it ended with (a :class:`ClientDisconnected` included).
FanOutItem = RequestOutput | BaseException | None
NO_FINAL_OUTPUT = "Engine stream ended without a final output."


class FanOut:
    """Consume several engine requests concurrently, each an :class:`EngineStream` in its
    own task (so each one aborts on disconnect and can be stopped), their outputs tagged
    with the request's index on one queue.

    Entering the block admits every request (``engine.generate`` via
    :meth:`EngineStream.__aenter__`) before the handler writes anything: a refusal (503
    for a full queue) or any other admission error is raised from ``async with``, after
    the requests already admitted have been aborted (their KV blocks freed). Leaving the
    block cancels what still runs, which aborts those engine requests.

    Two ways to read it: ``async for index, out in fan`` (outputs in arrival order until
    every request gave its final output; an engine failure, a disconnect or a stream that
    ends without a final output is raised), or :meth:`batch` (the raw
    :data:`FanOutItem` items, each request's end marker included).
    """

    def __init__(
        self, engine: EngineClient, requests: list[GenerateRequest], disconnected: asyncio.Event
    ) -> None:
        self._engine = engine
        self._requests = requests
        self._disconnected = disconnected
        # room for one output and one end marker per request, so one step fits
        self._queue: asyncio.Queue[tuple[int, FanOutItem]] = asyncio.Queue(
            maxsize=2 * len(requests) + 2)
        self._tasks: list[asyncio.Task[None]] = []
        self._finished: set[int] = set()

    async def __aenter__(self) -> Self:
        loop = asyncio.get_running_loop()
        admitted: list[asyncio.Future[BaseException | None]] = [
            loop.create_future() for _ in self._requests]
        self._tasks = [loop.create_task(self._pump(i, r, admitted[i]))
                       for i, r in enumerate(self._requests)]
        try:
            refusals = [e for e in await asyncio.gather(*admitted) if e is not None]
        except BaseException:
            await self._cancel()
            raise
        if refusals:
            await self._cancel()  # abort the requests already admitted
            raise refusals[0]
        return self

    async def _pump(
        self, index: int, request: GenerateRequest, admitted: asyncio.Future[BaseException | None]
    ) -> None:
        end: BaseException | None = None
        try:
            async with EngineStream(self._engine, request, self._disconnected) as stream:
                admitted.set_result(None)
                async for out in stream:
                    await self._queue.put((index, out))
        except Exception as exc:  # noqa: BLE001 - ClientDisconnected included; handed on
            if not admitted.done():  # refused (or failed) at admission
                admitted.set_result(exc)
                return
            end = exc
        finally:
            if not admitted.done():  # cancelled before admission
                admitted.cancel()
        await self._queue.put((index, end))

    async def _cancel(self) -> None:
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._cancel()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while len(self._finished) < len(self._requests):
            index, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                if index not in self._finished:
                    raise RuntimeError(NO_FINAL_OUTPUT)
                continue
            if item.finished:
                self._finished.add(index)
            return index, item
        raise StopAsyncIteration

    async def batch(self) -> list[tuple[int, FanOutItem]]:
        """Wait for one item, then take every item already queued (one engine step of
        several requests arrives together)."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items
