"""Fakes shared by the API tests: a scripted engine and a one-char-per-token tokenizer.

``FakeEngine`` implements the ``EngineClient`` and ``PdEngine`` protocols
(tokenserve/api/engine_client.py) without a model, so each API family's parsing,
formatting and disconnect handling can be tested over a real socket in milliseconds.
Like the real engine it hands out a ``RequestHandle`` per request and ends every request
with one final output, an aborted one included (``ABORT``, or ``ERROR`` carrying the
abort's error).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenserve.engine.info import EngineInfo, EngineStats
from tokenserve.engine.output_stream import RequestHandle
from tokenserve.messages import FinishReason, GenerateRequest, RequestOutput, TokenLogprob

VOCAB = 1000
MAX_MODEL_LEN = 64
TIMEOUT_MSG = "Engine callback timeout: client timeout"


class FakeTokenizer:
    """One token per character: id = ord(c) (text is ASCII in the tests)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)  # no special tokens here


def token_text(token_id: int) -> str:
    return chr(ord("a") + token_id % 26)


@dataclass
class FakeEngine:
    """Echoes the prompt ids back (cycled) one token per step.

    ``finish`` picks how a request ends: LENGTH after max_new_tokens, or after
    ``finish_after`` tokens with ``finish`` (EOS / TIMEOUT / ERROR).
    """

    model_name: str = "fake-model"
    vocab_size: int = VOCAB
    max_model_len: int = MAX_MODEL_LEN
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    delay: float = 0.001
    finish: FinishReason = FinishReason.LENGTH
    finish_after: int | None = None
    raise_on_generate: bool = False
    hang_after_final: bool = False  # a generator that never returns by itself
    healthy: bool = True
    requests: list[GenerateRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    closed_early: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    _producers: dict[str, tuple[RequestHandle, asyncio.Task[None]]] = field(
        default_factory=dict, repr=False)
    _produced: dict[str, int] = field(default_factory=dict, repr=False)

    #: PD: the KV cache a transfer engine would register (none here)
    kv_region: Any = None
    #: PD over tensor parallelism: the other ranks' share of the hand-off (one process here)
    rank_kv: Any = None

    def set_kv_puller(self, puller: Any) -> None:
        """PD decode: the engine's K/V puller (kept, never called here)."""
        self.kv_puller = puller

    def release(self, request_id: str) -> bool:
        """PD prefill: free a parked request (nothing is parked here)."""
        return False

    async def evict(self, request_id: str, timeout_s: float = 10.0) -> bool:
        """PD prefill: end a request still held under ``request_id`` (nothing is parked
        here)."""
        return False

    async def wait_aborted_early(self, timeout: float = 1.0) -> str:
        """Wait until the latest request is aborted with its stream closed before the end
        (a client disconnect); it must never complete. Returns its request_id."""
        rid = self.requests[-1].request_id
        await wait_for(lambda: rid in self.aborted and rid in self.closed_early, timeout)
        assert rid not in self.completed
        return rid

    @property
    def info(self) -> EngineInfo:
        """Built from the fields, and from ``cfg`` where a test sets one (read each time,
        so a test may change it)."""
        cfg = getattr(self, "cfg", None)
        extra = {k: getattr(cfg, k) for k in (
            "max_batch_size", "max_num_batched_tokens", "max_iter_times", "device", "dtype",
            "block_size", "kv_cache_bytes", "max_prefill_batch_size")
            if getattr(cfg, k, None) is not None}
        if getattr(cfg, "model", None):
            extra["model_path"] = str(cfg.model)
        return EngineInfo(self.model_name, self.vocab_size, self.max_model_len,
                          self.max_model_len - 1, **extra)

    def stats(self) -> EngineStats | None:
        return None  # no engine state: the metrics leave those series out

    def is_healthy(self) -> bool:
        return self.healthy

    async def compile_grammar(self, structured: Any) -> Any:
        """Structured output: refuses a constraint whose value contains ``INVALID`` (as
        the real compiler refuses a bad schema: ValueError); else a stand-in grammar."""
        if "INVALID" in structured.value:
            raise ValueError(f"invalid {structured.kind.value} constraint")
        return ("compiled", structured)

    def generate(self, request: GenerateRequest) -> RequestHandle:
        self.requests.append(request)
        if self.raise_on_generate:
            return _FailingHandle(request.request_id)
        handle = RequestHandle(request.request_id, self._abort)
        task = asyncio.get_running_loop().create_task(self._produce(request, handle))
        self._producers[request.request_id] = (handle, task)
        task.add_done_callback(lambda _: self._producers.pop(request.request_id, None))
        return handle

    def _abort(self, request_id: str, error: str | None) -> None:
        """The engine side of ``handle.abort()``: stop producing, send the final output."""
        self.aborted.append(request_id)
        entry = self._producers.get(request_id)
        if entry is None:
            return
        handle, task = entry
        task.cancel()  # the fake model's own task, not a consumer's
        request = next(r for r in reversed(self.requests) if r.request_id == request_id)
        handle.put(RequestOutput(request_id, (), "", True,
                                 FinishReason.ABORT if error is None else FinishReason.ERROR,
                                 len(request.prompt_token_ids),
                                 self._produced.pop(request_id, 0), error=error,
                                 seed=request.params.seed))

    async def _produce(self, request: GenerateRequest, handle: RequestHandle) -> None:
        async for out in self.outputs(request):
            self._produced[request.request_id] = out.num_output_tokens
            handle.put(out)

    async def outputs(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """The scripted outputs of ``request`` (subclasses transform them)."""
        n = request.params.max_new_tokens
        reason = FinishReason.LENGTH
        if self.finish_after is not None and self.finish_after < n:
            n, reason = self.finish_after, self.finish
        prompt = request.prompt_token_ids
        # prompt logprobs when asked: position i's is -i (the first None), no alternatives
        plp = ((None, *(TokenLogprob(t, -float(i), rank=i) for i, t in enumerate(prompt)
                        if i)) if request.params.prompt_logprobs is not None else None)
        done = False
        try:
            if n == 0:  # prompt only: one final output
                done = True
                self.completed.append(request.request_id)
                yield RequestOutput(request.request_id, (), "", True, FinishReason.LENGTH,
                                    len(prompt), 0, seed=request.params.seed,
                                    prompt_logprobs=plp)
            for i in range(n):
                await asyncio.sleep(self.delay)
                tok = prompt[i % len(prompt)]
                last = i == n - 1
                if last:  # the consumer may close us at this yield
                    done = True
                    self.completed.append(request.request_id)
                failed = last and reason in (FinishReason.TIMEOUT, FinishReason.ERROR)
                yield RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=() if failed else (tok,),
                    new_text="" if failed else token_text(tok),
                    finished=last,
                    finish_reason=reason if last else None,
                    num_prompt_tokens=len(prompt),
                    num_output_tokens=i if failed else i + 1,
                    prefill_time_ms=12.3 if i == 0 else None,
                    decode_time_ms=None if i == 0 else 4.6,
                    error=(TIMEOUT_MSG if reason is FinishReason.TIMEOUT else "boom")
                    if failed
                    else None,
                    seed=request.params.seed if last else None,
                    prompt_logprobs=plp if i == 0 else None,
                )
            while self.hang_after_final:
                await asyncio.sleep(3600)
        finally:
            if not done:
                self.closed_early.append(request.request_id)


class _FailingHandle(RequestHandle):
    """A request whose engine fails while it is awaited (``raise_on_generate``)."""

    def poll(self) -> RequestOutput | None:
        raise RuntimeError("executor exploded")

    async def get(self, until: Any = None) -> RequestOutput | None:
        return self.poll()


async def wait_for(cond: Any, timeout: float = 2.0) -> None:
    async def loop() -> None:
        while not cond():
            await asyncio.sleep(0.002)

    await asyncio.wait_for(loop(), timeout)


@contextlib.asynccontextmanager
async def serve_fake(engine: Any, max_body_bytes: int = 64 * 1024):
    """Serve ``engine`` through every API family on 127.0.0.1:<ephemeral>; yields
    ``(server, client)`` with an httpx client bound to it."""
    import httpx

    from tokenserve.server.app import build_router
    from tokenserve.transport.server import HttpServer

    server = HttpServer(build_router(engine), max_body_bytes=max_body_bytes)
    await server.start("127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.ports[0]}",
                                 timeout=5.0) as client:
        yield server, client
    await server.close(timeout=1.0)
