"""A request for several sequences through the PD cluster (issue 40): OpenAI ``n`` /
``best_of`` and a completions list of prompts, vLLM ``/generate``'s ``n`` / ``best_of``.

P and D serve one sequence per request (spec interfaces.md §4.1, §5.1: 422, as MindIE),
so the coordinator splits such a request into single-sequence *parts*, relays each as its
own request (:class:`tokenserve.coordinator.relay.Flow`: its own req-id, P and D,
retries) and merges their answers into the one a mixed server gives
(:mod:`tokenserve.coordinator.merge`)::

    client --n=2--> FanOut --part 0 (n=1, seed s)  --> Flow --> P/D
                      |    --part 1 (n=1, seed s+1) --> Flow --> P/D
                      +<-- each part's answer captured (PartConnection), merged

Part ``prompt_index * n + i`` is that choice of the mixed server (``choice_seed``: seed
``s + i`` when the client gave ``s``; else each part's P draws one, as the mixed server
draws one per choice), so seeded answers match a mixed server's choice by choice. vLLM:
only part 0 asks for ``prompt_logprobs`` (the mixed server computes them once).

[I] Metrics: part 0 stands for the request (its status, first token and end are what
the coordinator records); the other parts' retries and failovers are not counted.

When a part is refused or fails, the client gets that answer (before the stream: the
part's whole error answer; after: its error event, then the stream closes), and the other
parts are stopped. The client gone stops every part.

Validation stays P's (§3.2 rule [I] (b)): a request is split only when its ``n`` /
``best_of`` fields pass the rules a mixed server applies to them (ranges, ``best_of >=
n``, streaming ``best_of == n``, not greedy, at most ``maxBatchSize`` sequences, read from
P's status); any other request goes to P whole, and P's parser answers it as a mixed
server would. [I] vLLM's non-stream answer lists the sequences in seed order (a mixed
server: best first by cumulative log-probability, which single-sequence answers do not
carry).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import h11
import orjson

from tokenserve.aio import Signal
from tokenserve.api.errors import ERROR_CONTENT_TYPE, error_json
from tokenserve.api.families import Several
from tokenserve.api.fields import MAX_BEST_OF, MAX_N, choice_seed
from tokenserve.api.routes import match
from tokenserve.coordinator import ingress as msg
from tokenserve.coordinator.ingress import Ingress, classify
from tokenserve.coordinator.merge import StreamMerge, merge_whole
from tokenserve.coordinator.pool import Instance
from tokenserve.sampling_params import MAX_SEED
from tokenserve.transport.cycle import ClientDisconnected, HttpRequest, HttpResponse

logger = logging.getLogger(__name__)

#: the routes whose bodies may ask for several sequences (route table names)
_OPENAI_ROUTES = ("openai.chat", "openai.completions")
_VLLM_ROUTE = "generate"
#: OpenAI: a temperature below this is greedy (api/openai/protocol.py GREEDY_EPS; a
#: copy: that module loads jinja2 and jsonschema, the coordinator needs neither)
_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class Part:
    """One single-sequence request of a split one.

    Attributes:
        index: its choice's index in the merged answer (``prompt_index * n + i``).
        prompt_index: which prompt of the request it answers.
        body: its JSON body (the client's, with ``n`` 1, no ``best_of``, its own seed
            and prompt).
    """

    index: int
    prompt_index: int
    body: bytes


@dataclass(frozen=True)
class FanOutPlan:
    """A request split into :attr:`parts` (in index order)."""

    family: str
    stream: bool
    parts: tuple[Part, ...]


def max_sequences(prefill: Iterable[Instance]) -> int | None:
    """The most sequences one request may ask for: the least ``maxBatchSize`` of the
    usable Ps (``availSlotsNum + runningRequestNum`` of their last ``/v1/status``, spec
    §9.1); None when no usable P reports it."""
    sizes = []
    for p in prefill:
        if not p.usable():
            continue
        res = (p.status or {}).get("resource") or {}
        slots, running = res.get("availSlotsNum"), res.get("runningRequestNum")
        if _is_int(slots) and _is_int(running):
            sizes.append(slots + running)
    return min(sizes) if sizes else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count_field(body: dict[str, Any], key: str, hi: int) -> int | None | bool:
    """``body[key]`` when absent/null (None) or an integer in [1, ``hi``]; False when
    it is anything else (P refuses it)."""
    value = body.get(key)
    if value is None:
        return None
    if _is_int(value) and 1 <= value <= hi:
        return value
    return False


def _openai_count(body: dict[str, Any], stream: bool, completions: bool) -> int | None:
    """Sequences per prompt of a valid OpenAI body (api/openai/protocol.py's rules on
    ``n`` / ``best_of``); None when those rules refuse it."""
    n, best_of = _count_field(body, "n", MAX_N), _count_field(body, "best_of", MAX_BEST_OF)
    if n is False or best_of is False:
        return None
    if stream and best_of is not None:
        if completions and n is None:
            return None
        if best_of != (n or 1):
            return None
    if best_of is not None and n is not None and best_of < n:
        return None
    count = max(n or 1, best_of or 1)
    temperature = body.get("temperature")
    if count > 1 and temperature is not None and not (
            isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and temperature >= _GREEDY_EPS):
        return None  # greedy (or not a number): P answers 422
    return count


def _vllm_count(body: dict[str, Any]) -> int | None:
    """Sequences of a valid vLLM body (api/vllm/protocol.py's rules); None when refused."""
    n, best_of = _count_field(body, "n", MAX_N), _count_field(body, "best_of", MAX_BEST_OF)
    if n is False or best_of is False:
        return None
    n = n or 1
    if best_of is not None and best_of < n:
        return None
    count = best_of if best_of is not None else n
    temperature = body.get("temperature")
    if count > 1 and not (isinstance(temperature, (int, float))
                          and not isinstance(temperature, bool) and temperature > 0):
        return None  # greedy (or not a number): P answers 422
    return count


def _prompts(body: dict[str, Any]) -> list[Any] | None:
    """A completions body's prompts when it lists several (strings, or id lists), else
    None (one prompt, or a shape P decides about)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt) or all(
            isinstance(p, list) and p for p in prompt):
        return prompt
    return None


def plan_fan_out(path: str, ingress: Ingress, limit: int | None) -> FanOutPlan | None:
    """How to split the request ``ingress`` on ``path`` into single-sequence parts; None
    when it asks for one sequence, or is not to be split (module docstring: P answers
    it). ``limit``: the most sequences a request may ask for (:func:`max_sequences`)."""
    route = match("POST", path)
    if route is None:
        return None
    body = ingress.body
    several = ingress.description.several
    prompts: list[Any] | None = None
    if several is Several.CHOICES and route.name in _OPENAI_ROUTES:
        completions = route.name == "openai.completions"
        count = _openai_count(body, ingress.stream, completions)
        if completions:
            prompts = _prompts(body)
    elif several is Several.TEXTS and route.name == _VLLM_ROUTE:
        count = _vllm_count(body)
        if count is not None and count > MAX_N:
            return None
    else:
        return None
    total = (len(prompts) if prompts is not None else 1) * (count or 0)
    if count is None or total < 2 or limit is None or total > limit:
        return None
    seed = body.get("seed")
    seeded = _is_int(seed) and 0 <= seed <= MAX_SEED
    parts = []
    for p, prompt in enumerate(prompts if prompts is not None else [None]):
        for i in range(count):
            sub = {k: v for k, v in body.items() if k != "best_of"}
            sub["n"] = 1
            if prompts is not None:
                sub["prompt"] = prompt
            if seeded:
                sub["seed"] = choice_seed(seed, i)
            if i > 0:
                for key in ingress.description.first_sequence_only:
                    sub.pop(key, None)  # e.g. prompt_logprobs: computed once
            parts.append(Part(p * count + i, p, orjson.dumps(sub)))
    return FanOutPlan(ingress.family, ingress.stream, tuple(parts))


# ---------------------------------------------------------------------- relaying


@dataclass(frozen=True)
class _Event:
    """What a part's response did: ``head`` (status, content type), ``data``, ``end``,
    or ``done`` (its relay returned)."""

    kind: str
    part: int
    status: int = 0
    content_type: str = ""
    data: bytes = b""


class PartConnection:
    """The connection a part's :class:`HttpResponse` writes to: its h11 events become
    :class:`_Event` s on the fan-out's queue; once ``stopped`` is set, writes raise
    :class:`ClientDisconnected` (the part's relay then stops its P and D)."""

    shutting_down = False
    close_whole_responses = False

    def __init__(self, part: int, queue: asyncio.Queue[_Event], stopped: Signal) -> None:
        self._part, self._queue, self._stopped = part, queue, stopped

    async def drain(self) -> None:
        if self._stopped.is_set():
            raise ClientDisconnected()

    def send_events(self, events: list[Any]) -> None:
        for ev in events:
            if isinstance(ev, h11.Response):
                ctype = dict(ev.headers).get(b"content-type", b"application/json")
                self._queue.put_nowait(_Event("head", self._part, ev.status_code,
                                              ctype.decode("latin-1")))
            elif isinstance(ev, h11.Data):
                self._queue.put_nowait(_Event("data", self._part, data=bytes(ev.data)))
            elif isinstance(ev, h11.EndOfMessage):
                self._queue.put_nowait(_Event("end", self._part))


#: relays one request through a P and a D (the coordinator's, a :class:`Flow` per call);
#: the last argument: whether it is recorded in the metrics
RelayOne = Callable[[HttpRequest, HttpResponse, Ingress, bool], Awaitable[None]]


class FanOut:
    """Serve ``plan`` (a split request) to ``response``: every part relayed at once by
    ``relay``, their answers merged (module docstring). :meth:`run` never raises but for
    cancellation."""

    def __init__(self, plan: FanOutPlan, request: HttpRequest, response: HttpResponse,
                 relay: RelayOne, chars_per_token: float) -> None:
        self._plan, self._request, self._response = plan, request, response
        self._relay, self._chars_per_token = relay, chars_per_token
        self._queue: asyncio.Queue[_Event] = asyncio.Queue()
        #: set when the client is gone or the answer is decided: every part stops
        self._stopped = Signal()
        n = len(plan.parts)
        self._heads: list[_Event | None] = [None] * n
        self._bodies = [b""] * n
        self._ended = [False] * n
        self._done = 0
        self._pending: list[_Event] = []  # stream data that came before every head
        self._merge = StreamMerge(plan.family, [p.index for p in plan.parts],
                                  [p.prompt_index for p in plan.parts], n)

    async def run(self) -> None:
        gone = self._request.disconnected
        gone.subscribe(self._stopped.set)
        if gone.is_set():
            self._stopped.set()
        tasks = [asyncio.create_task(self._part(k)) for k in range(len(self._plan.parts))]
        try:
            await self._serve()
        except ClientDisconnected:
            logger.info("a request of %d parts: client gone", len(tasks))
        finally:
            self._stopped.set()  # parts still running are stopped (their P and D too)
            await asyncio.gather(*tasks, return_exceptions=True)
            gone.unsubscribe(self._stopped.set)

    async def _part(self, k: int) -> None:
        part = self._plan.parts[k]
        req = self._request
        sub = replace(req, body=part.body, disconnected=self._stopped)
        sub_response = HttpResponse(PartConnection(k, self._queue, self._stopped))
        try:
            ingress = classify(req.path, part.body, self._chars_per_token)
            await self._relay(sub, sub_response, ingress, k == 0)
        finally:
            self._queue.put_nowait(_Event("done", k))

    async def _serve(self) -> None:
        n = len(self._plan.parts)
        while self._done < n:
            ev = await self._queue.get()
            if ev.kind == "done":
                self._done += 1
                continue
            if self._response.finished:
                continue  # decided: the other parts are being stopped
            if self._plan.stream:
                await self._stream_event(ev)
            else:
                await self._whole_event(ev)
        if not self._response.started and not self._request.disconnected.is_set():
            # a part ended without answering (it cannot, but never leave a client)
            await self._response.send(500, error_json(self._plan.family, 500, msg.P_ERROR),
                                      ERROR_CONTENT_TYPE)

    # ------------------------------------------------------------------ whole answers

    async def _whole_event(self, ev: _Event) -> None:
        k = ev.part
        if ev.kind == "head":
            self._heads[k] = ev
        elif ev.kind == "data":
            self._bodies[k] += ev.data
        elif ev.kind == "end":
            self._ended[k] = True
            head = self._heads[k]
            assert head is not None
            if head.status != 200:  # a part refused or failed: that is the answer
                await self._decide(head.status, self._bodies[k], head.content_type)
            elif all(self._ended):
                await self._send_merged()

    async def _send_merged(self) -> None:
        parts = self._plan.parts
        try:
            body = merge_whole(self._plan.family, self._bodies, [p.index for p in parts],
                               [p.prompt_index for p in parts])
        except ValueError as exc:
            logger.warning("a request of %d parts: %s", len(parts), exc)
            await self._decide(500, error_json(self._plan.family, 500, msg.P_ERROR),
                               ERROR_CONTENT_TYPE)
            return
        await self._response.send(200, body, "application/json")

    async def _decide(self, status: int, body: bytes, content_type: str) -> None:
        """Answer ``status`` / ``body`` now and stop every part."""
        self._stopped.set()
        await self._response.send(status, body, content_type)

    # ------------------------------------------------------------------ streams

    async def _stream_event(self, ev: _Event) -> None:
        k = ev.part
        if ev.kind == "head":
            self._heads[k] = ev
            if ev.status != 200 or "event-stream" not in ev.content_type:
                return  # a whole answer instead of a stream: its end decides
            if all(h is not None and h.status == 200 for h in self._heads):
                await self._response.start_stream(200, ev.content_type)
                pending, self._pending = self._pending, []
                for e in pending:
                    await self._stream_event(e)
            return
        head = self._heads[k]
        assert head is not None
        if not self._response.started:
            if head.status == 200 and "event-stream" in head.content_type:
                self._pending.append(ev)  # other parts have not answered yet
            elif ev.kind == "data":
                self._bodies[k] += ev.data
            else:  # a part's whole answer (an error): the request's answer
                await self._decide(head.status, self._bodies[k], head.content_type)
            return
        if ev.kind == "data":
            out, failed = self._merge.feed(k, ev.data)
            if out:
                await self._response.write(out)
            if failed:
                self._stopped.set()
                await self._response.end(close_connection=True)
            return
        self._ended[k] = True  # end
        rest = self._merge.end(k)
        if rest:
            await self._response.write(rest)
        if all(self._ended):
            await self._response.write(self._merge.tail())
            await self._response.end()


__all__ = ["FanOut", "FanOutPlan", "Part", "PartConnection", "max_sequences",
           "plan_fan_out"]

