"""One request builder and one stream parser per API family (spec/interfaces.md), and the
streaming senders that time each chunk.

=============  =========================================  ==============  =============
backend        route (streaming)                          prompt sent as  tokens from
=============  =========================================  ==============  =============
mindie         POST /infer_token  SSE ``data: {..}``      ``input_id``    ``token.id``
mindie-text    POST /infer        SSE                     ``inputs`` text ``token.id``
tgi            POST /generate_stream  SSE                 ``inputs`` text ``token.id``
vllm           POST /generate ``stream`` NUL-framed JSON  ``prompt`` text re-tokenised
openai         POST /v1/completions  SSE + ``[DONE]``     token-id list   ``usage``
openai-chat    POST /v1/chat/completions  SSE + [DONE]    user message    ``usage``
openai-tools   the same with ``tools`` (BENCH_TOOLS),     user message    ``usage``
               ``tool_choice: required``: tool calls
               generated under their grammar
triton         POST /v2/models/{m}/generate_stream        ``text_input``  ``details``
               ``data:{..}`` (no space)
llamacpp       POST /completion (llama.cpp llama-server)  token-id list   ``tokens_predicted``
               SSE, last event ``"stop": true``
=============  =========================================  ==============  =============

Every request is greedy. ``ignore_eos`` is sent where the family has it (vllm, openai,
openai-chat, llamacpp), so those produce exactly ``output_len`` tokens (openai-tools ends
where its calls end: the grammar allows only EOS after them); the others stop at ``max_new_tokens`` or
EOS, and the record holds what actually came back. A chunk is what one socket read
returns: its arrival time is a token time when any event in it carries a token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from tokenserve.api.routes import path_of
from tokenserve.loadgen.metrics import RequestRecord
from tokenserve.loadgen.structured import add_response_format, structured_output
from tokenserve.loadgen.workload import BenchRequest

BACKENDS = ("mindie", "mindie-text", "tgi", "vllm", "openai", "openai-chat", "openai-tools",
            "triton", "llamacpp")
#: the tool-call workload's tools (``--backend openai-tools``): four small functions, as
#: an agent's tool set; the user message is the workload's prompt text.
BENCH_TOOLS = tuple(
    {"type": "function", "function": {"name": name, "description": doc, "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}
    for name, doc, props in (
        ("get_weather", "Current weather of a city", {"city": {"type": "string"}}),
        ("search", "Search the web", {"query": {"type": "string"},
                                      "max_results": {"type": "integer"}}),
        ("add", "Add two numbers", {"a": {"type": "number"}, "b": {"type": "number"}}),
        ("send_email", "Send an email", {"to": {"type": "string"},
                                         "subject": {"type": "string"},
                                         "body": {"type": "string"}}),
    ))


@dataclass
class Event:
    """One parsed stream event.

    Attributes:
        tokens: output tokens it carries; None when the family sends text only.
        text: the new text it carries.
        total: the server's count of output tokens so far (``details``/``usage``), if any.
        prompt_tokens: the server's count of prompt tokens, if it reports one.
        final: the family's end-of-stream marker (last event, ``[DONE]``).
    """

    tokens: int | None = None
    text: str = ""
    total: int | None = None
    prompt_tokens: int | None = None
    final: bool = False


class StreamError(ValueError):
    """The response body is not a well-formed stream of this family."""


# --------------------------------------------------------------------------- framing


class Framer:
    """Splits a byte stream into frames: SSE events (``data:`` + JSON, blank-line
    separated) or NUL-terminated JSON (vLLM). Partial frames wait for more bytes. SSE
    comment events (``:`` lines, e.g. llama-server's keep-alive ``:\n\n`` ping) are
    skipped."""

    def __init__(self, sep: bytes, prefix: bytes | None) -> None:
        self._sep, self._prefix, self._buf = sep, prefix, b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data.replace(b"\r\n", b"\n") if self._prefix else data
        *frames, self._buf = self._buf.split(self._sep)
        out = []
        for f in frames:
            if self._prefix is not None:
                f = f.strip(b"\n")
                if not f or f.startswith(b":"):
                    continue
                if not f.startswith(self._prefix):
                    raise StreamError(f"not an SSE data event: {f[:120]!r}")
                f = f[len(self._prefix):].strip()
            out.append(f)
        return out

    def leftover(self) -> bytes:
        """Bytes after the last complete frame (an error text MindIE writes mid-stream)."""
        return self._buf.strip()


def _count(ids: Any) -> int:
    """``token.id``: an array (MindIE) or a scalar (upstream TGI)."""
    if isinstance(ids, list):
        return len(ids)
    return 0 if ids is None else 1


def _choice(obj: dict[str, Any]) -> dict[str, Any]:
    choices = obj.get("choices") or []
    return choices[0] if choices else {}


def _usage(obj: dict[str, Any], ev: Event) -> Event:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        ev.total = usage.get("completion_tokens")
        ev.prompt_tokens = usage.get("prompt_tokens")
    return ev


# --------------------------------------------------------------------------- event parsers


def parse_mindie(obj: dict[str, Any]) -> Event:
    """§2.1: ``{"token": {"id": [..], "text": ..}}``; the last event has ``generated_text``
    (its ``token.text`` is null) and ``details`` (``generated_tokens``) when asked."""
    tok = obj.get("token") or {}
    details = obj.get("details") or {}
    return Event(tokens=_count(tok.get("id")), text=tok.get("text") or "",
                 total=details.get("generated_tokens"), prompt_tokens=details.get("prompt_tokens"),
                 final="generated_text" in obj and obj["generated_text"] is not None)


def parse_vllm(obj: dict[str, Any]) -> Event:
    """§4.1: ``{"text": ["<delta of sequence 0>"]}`` per step, no end marker."""
    texts = obj.get("text") or [""]
    return Event(tokens=None, text=texts[0] or "")


def parse_openai(obj: dict[str, Any]) -> Event:
    """§5.2: ``choices[0].text`` per step; ``usage`` on the finishing chunk (MindIE) or on
    a trailing ``choices: []`` chunk (``stream_options.include_usage``)."""
    return _usage(obj, Event(tokens=None, text=_choice(obj).get("text") or ""))


def parse_openai_chat(obj: dict[str, Any]) -> Event:
    """§5.1: ``choices[0].delta.content``, and the name and arguments text of
    ``delta.tool_calls``; the role chunk carries ``content: ""``."""
    delta = _choice(obj).get("delta") or {}
    text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    for call in delta.get("tool_calls") or ():
        fn = call.get("function") or {} if isinstance(call, dict) else {}
        text += (fn.get("name") or "") + (fn.get("arguments") or "")
    return _usage(obj, Event(tokens=None, text=text))


class TritonParser:
    """§6.3: ``text_output`` = new text; with ``details`` each event carries
    ``details.generated_tokens`` so far, so a chunk's tokens are the difference."""

    def __init__(self) -> None:
        self._seen = 0

    def __call__(self, obj: dict[str, Any]) -> Event:
        details = obj.get("details") or {}
        total = details.get("generated_tokens")
        tokens = None
        if isinstance(total, int):
            tokens, self._seen = total - self._seen, total
        return Event(tokens=tokens, text=obj.get("text_output") or "", total=total,
                     final=details.get("finish_reason") is not None)


class LlamaCppParser:
    """llama.cpp ``llama-server`` ``POST /completion`` with ``stream`` (tools/server/
    server-task.cpp, ``to_json_non_oaicompat``): one ``data: {..}`` event per sampled
    token, ``{"content": <new text>, "tokens": [<id>], "stop": false,
    "tokens_predicted": <n so far>, "tokens_evaluated": <prompt tokens>, ..}``; then a
    last event with ``"stop": true``, empty ``content``/``tokens``, the final
    ``tokens_predicted``, ``stop_type`` and ``timings``; no ``[DONE]``. A token whose text
    ends inside a UTF-8 character sends no event: its text and count arrive with the next
    one, so a chunk's tokens are the growth of ``tokens_predicted``, not ``len(tokens)``.
    An error after the headers comes as ``data: {"error": {..}}``."""

    def __init__(self) -> None:
        self._seen = 0

    def __call__(self, obj: dict[str, Any]) -> Event:
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise StreamError(f"llama-server error: {msg}")
        total = obj.get("tokens_predicted")
        if isinstance(total, int):
            tokens, self._seen = max(0, total - self._seen), max(total, self._seen)
        else:
            toks = obj.get("tokens")
            tokens = len(toks) if isinstance(toks, list) else None
            total = None
        return Event(tokens=tokens, text=obj.get("content") or "", total=total,
                     prompt_tokens=obj.get("tokens_evaluated"),
                     final=obj.get("stop") is True)


# --------------------------------------------------------------------------- backends


@dataclass(frozen=True)
class Backend:
    """How one family sends a :class:`BenchRequest` and reads the stream back.

    ``build(req, model)`` returns ``(path, json body)``; ``new_parser()`` a callable JSON
    object -> :class:`Event` (stateful per request); ``final_marker``: the family marks
    its last event, so a stream without it is an error.
    """

    name: str
    build: Callable[[BenchRequest, str], tuple[str, dict[str, Any]]]
    new_parser: Callable[[], Callable[[dict[str, Any]], Event]]
    framing: tuple[bytes, bytes | None]  # (separator, SSE prefix or None)
    chunk_count: str | None  # how chunks carry token counts (token_ids, details) or None
    total_source: str  # what Event.total counts from
    ignore_eos: bool
    final_marker: bool


_SSE = (b"\n\n", b"data:")


def _native(req: BenchRequest, key: str, value: Any) -> dict[str, Any]:
    return {key: value, "stream": True,
            "parameters": {"max_new_tokens": req.output_len, "do_sample": False,
                           "details": True}}


def build_mindie(req: BenchRequest, model: str) -> tuple[str, dict[str, Any]]:
    return path_of("mindie.infer_token"), _native(req, "input_id", list(req.prompt_ids))


def build_mindie_text(req: BenchRequest, model: str) -> tuple[str, dict[str, Any]]:
    return path_of("mindie.infer"), _native(req, "inputs", req.prompt_text)


def build_tgi(req: BenchRequest, model: str) -> tuple[str, dict[str, Any]]:
    body = _native(req, "inputs", req.prompt_text)
    del body["stream"]  # /generate_stream always streams (§3.2)
    return path_of("tgi.generate_stream"), body


def build_vllm(req: BenchRequest, model: str) -> tuple[str, dict[str, Any]]:
    return path_of("generate"), {"prompt": req.prompt_text, "stream": True,
                         "max_tokens": req.output_len, "temperature": 0, "ignore_eos": True}


def _openai_common(req: BenchRequest, model: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def build_openai(req: BenchRequest, model: str) -> tuple[str, dict[str, Any]]:
    """``skip_special_tokens: false`` (vLLM's extension, spec/interfaces.md §5.2): a token
    whose text is skipped sends no chunk, so a stream whose first tokens are special tokens
    (a random-weight model's, or EOS repeated under ``ignore_eos``) would time its first
    token late, or never; spelled out, every token's chunk arrives when it is made."""
    return path_of("openai.completions"), {**_openai_common(req, model), "prompt": list(req.prompt_ids),
                                           "skip_special_tokens": False}


def build_openai_chat(req: BenchRequest, model: str) -> tuple[str, dict[str, Any]]:
    return path_of("openai.chat"), {**_openai_common(req, model),
                                    "messages": [{"role": "user", "content": req.prompt_text}]}


def build_openai_tools(req: BenchRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The tool-call workload: chat with :data:`BENCH_TOOLS` and ``tool_choice``
    ``required``; no ``ignore_eos`` (the grammar ends the answer after its calls)."""
    _, body = build_openai_chat(req, model)
    del body["ignore_eos"]
    return path_of("openai.chat"), {**body, "tools": list(BENCH_TOOLS),
                                    "tool_choice": "required"}


def build_triton(req: BenchRequest, model: str) -> tuple[str, dict[str, Any]]:
    return (path_of("triton.generate_stream", model=model),
            {"id": f"bench-{req.index & 0xFFFFFFFF}-{time.monotonic_ns()}",
             "text_input": req.prompt_text,
             "parameters": {"max_new_tokens": req.output_len, "do_sample": False,
                            "details": True}})


def build_llamacpp(req: BenchRequest, model: str) -> tuple[str, dict[str, Any]]:
    """llama-server's native route; ``cache_prompt`` off so no request reuses another's
    KV (ours gets disjoint prompts per level; within a level prompts share nothing unless
    ``--shared-prefix-len``, which llama.cpp then cannot exploit: noted in the README)."""
    return "/completion", {"prompt": list(req.prompt_ids), "n_predict": req.output_len,
                           "ignore_eos": True, "temperature": 0, "cache_prompt": False,
                           "stream": True}


def _stateless(fn: Callable[[dict[str, Any]], Event]) -> Callable[[], Callable]:
    return lambda: fn


BACKEND_TABLE: dict[str, Backend] = {
    "mindie": Backend("mindie", build_mindie, _stateless(parse_mindie), _SSE, "token_ids",
                      "details", False, True),
    "mindie-text": Backend("mindie-text", build_mindie_text, _stateless(parse_mindie), _SSE,
                           "token_ids", "details", False, True),
    "tgi": Backend("tgi", build_tgi, _stateless(parse_mindie), _SSE, "token_ids", "details",
                   False, True),
    "vllm": Backend("vllm", build_vllm, _stateless(parse_vllm), (b"\0", None), None,
                    "retokenized", True, False),
    "openai": Backend("openai", build_openai, _stateless(parse_openai), _SSE, None, "usage",
                      True, True),
    "openai-chat": Backend("openai-chat", build_openai_chat, _stateless(parse_openai_chat),
                           _SSE, None, "usage", True, True),
    "openai-tools": Backend("openai-tools", build_openai_tools, _stateless(parse_openai_chat),
                            _SSE, None, "usage", False, True),
    "triton": Backend("triton", build_triton, TritonParser, _SSE, "details", "details", False,
                      True),
    "llamacpp": Backend("llamacpp", build_llamacpp, LlamaCppParser, _SSE, None,
                        "tokens_predicted", True, True),
}


def get_backend(name: str) -> Backend:
    try:
        return BACKEND_TABLE[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; one of {BACKENDS}") from None


# --------------------------------------------------------------------------- stream reading


class StreamReader:
    """Turns the chunks of one response into a :class:`RequestRecord` (no I/O: feed it
    ``(seconds since send, bytes)`` and call :meth:`finish`; unit tests drive it by hand)."""

    def __init__(self, backend: Backend, req: BenchRequest) -> None:
        self.backend = backend
        self.rec = RequestRecord(req.index, req.input_len, req.output_len)
        self._framer = Framer(*backend.framing)
        self._parse = backend.new_parser()
        self._last_token_t: float | None = None
        self._ids = 0
        self._text: list[str] = []
        self._total: int | None = None
        self._final = False
        self._done_marker = False

    def feed(self, t: float, data: bytes) -> None:
        carried = False
        for frame in self._framer.feed(data):
            if frame == b"[DONE]":
                self._done_marker = True
                continue
            try:
                obj = orjson.loads(frame)
            except orjson.JSONDecodeError as exc:
                raise StreamError(f"bad JSON event {frame[:120]!r}: {exc}") from None
            if not isinstance(obj, dict):
                raise StreamError(f"event is not a JSON object: {frame[:120]!r}")
            ev = self._parse(obj)
            self._text.append(ev.text)
            if ev.tokens:
                self._ids += ev.tokens
            if ev.total is not None:
                self._total = ev.total
            if ev.prompt_tokens is not None:
                self.rec.input_len = ev.prompt_tokens
            self._final = self._final or ev.final
            carried = carried or (bool(ev.tokens) if ev.tokens is not None else bool(ev.text))
        if carried:
            if self._last_token_t is None:
                self.rec.ttft = t
            else:
                self.rec.itl.append(t - self._last_token_t)
            self._last_token_t = t

    @property
    def text(self) -> str:
        return "".join(self._text)

    def finish(self, t: float, count_text: Callable[[str], int] | None = None) -> RequestRecord:
        """Close the record at ``t`` (seconds since send): ok unless the stream ended
        without the family's final event or with trailing garbage (an error text)."""
        rec = self.rec
        rec.e2e = t
        left = self._framer.leftover()
        if left:
            rec.error = f"stream ended with {left[:160]!r}"
        elif self.backend.final_marker and not self._final and not self._done_marker:
            rec.error = "stream ended without the final event"
        if self.backend.chunk_count is not None:
            rec.output_tokens, rec.token_source = self._ids, self.backend.chunk_count
            if self._ids == 0 and self._total:
                rec.output_tokens, rec.token_source = self._total, self.backend.total_source
        elif self._total is not None:
            rec.output_tokens, rec.token_source = self._total, self.backend.total_source
        elif count_text is not None:
            rec.output_tokens, rec.token_source = count_text(self.text), "retokenized"
        rec.ok = rec.error is None
        return rec


async def send_http(http: Any, backend: Backend, req: BenchRequest, model: str,
                    count_text: Callable[[str], int] | None = None,
                    ignore_eos: bool | None = None,
                    response_format: str = "text") -> RequestRecord:
    """Send ``req`` over ``http`` (an ``aiohttp.ClientSession`` with ``base_url``) and time it.
    ``ignore_eos`` overrides the family's default where its body has the field;
    ``response_format`` ``json-schema`` constrains the output (:mod:`.structured`).

    aiohttp rather than httpx: the load generator shares the machine with the server, and
    streaming 64 responses through httpx took ~3.5x the client CPU (0.96-1.02 vs 0.28 s for
    8179 chunks; bench/README.md "The load generator's own CPU"), taken from the server's
    cores in proportion to its token rate."""
    import aiohttp

    path, body = backend.build(req, model)
    if ignore_eos is not None and "ignore_eos" in body:
        body["ignore_eos"] = ignore_eos
    if response_format != "text":
        add_response_format(backend.name, body)
    reader = StreamReader(backend, req)
    t0 = time.perf_counter()
    reader.rec.start = t0
    try:
        for attempt in (0, 1):
            try:
                async with http.post(path, data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"}) as resp:
                    if resp.status != 200:
                        text = (await resp.read())[:200]
                        reader.rec.e2e = time.perf_counter() - t0
                        reader.rec.error = f"HTTP {resp.status}: {text!r}"
                        return reader.rec
                    async for data in resp.content.iter_any():
                        reader.feed(time.perf_counter() - t0, data)
                break
            except aiohttp.ServerDisconnectedError:
                # a pooled keep-alive connection the server had already closed (llama-server
                # closes after some streams): nothing was sent back, so send once more, on a
                # new connection, with the clock still running from t0
                if attempt or reader.rec.output_tokens or reader.rec.ttft is not None:
                    raise
    except (aiohttp.ClientError, asyncio.TimeoutError, StreamError) as exc:
        reader.rec.e2e = time.perf_counter() - t0
        reader.rec.error = f"{type(exc).__name__}: {exc}"[:300]
        return reader.rec
    return reader.finish(time.perf_counter() - t0, count_text)


async def send_engine(engine: Any, req: BenchRequest, ignore_eos: bool,
                      response_format: str = "text") -> RequestRecord:
    """Send ``req`` straight to an :class:`~tokenserve.engine.engine.AsyncEngine` (no
    HTTP), greedy, and time each :class:`RequestOutput` that carries tokens (the compile
    of a ``json-schema`` constraint included, as a family handler would do it)."""
    import uuid

    from tokenserve.messages import FinishReason, GenerateRequest
    from tokenserve.sampling_params import SamplingParams

    rec = RequestRecord(req.index, req.input_len, req.output_len, token_source="engine")
    structured = structured_output(response_format)
    t0 = rec.start = time.perf_counter()
    last: float | None = None
    out = None
    try:
        grammar = (await engine.compile_grammar(structured)
                   if structured is not None else None)
        greq = GenerateRequest(uuid.uuid4().hex, req.prompt_ids,
                               SamplingParams(max_new_tokens=req.output_len, do_sample=False,
                                              ignore_eos=ignore_eos, structured=structured),
                               arrival_time=time.monotonic(), grammar=grammar)
        async for out in engine.generate(greq):
            t = time.perf_counter() - t0
            if out.new_token_ids:
                rec.output_tokens += len(out.new_token_ids)
                if last is None:
                    rec.ttft = t
                else:
                    rec.itl.append(t - last)
                last = t
    except (RuntimeError, ValueError) as exc:
        rec.error = str(exc)
    rec.e2e = time.perf_counter() - t0
    if out is not None and out.finish_reason in (FinishReason.ERROR, FinishReason.TIMEOUT,
                                                 FinishReason.ABORT):
        rec.error = out.error or f"finished with {out.finish_reason.value}"
    rec.ok = rec.error is None and out is not None and out.finished
    return rec
