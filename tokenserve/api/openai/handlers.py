"""OpenAI-compatible routes (spec/interfaces.md §5; OpenAI API reference: Chat, Completions,
Models).

``POST /v1/chat/completions`` renders ``messages`` with the model's chat template
(``add_generation_prompt=True``) and tokenises the result without adding special tokens;
``POST /v1/completions`` takes a string, strings, token ids or id lists. Each prompt gets
``n`` choices (index ``prompt_index * n + i``, as OpenAI and vLLM number them); every choice
is its own engine request (``<id>-<index>``), all run concurrently, and a client
disconnect aborts every one of them (spec §0.4 step 10). With ``seed``, choice ``i`` of a
prompt samples with ``seed + i``: choices differ yet are reproducible.

Pipeline (spec §0.4): JSON / validation errors -> 422, template errors -> 422, a prompt
longer than the context -> 424, an unknown model -> 404, engine failures -> 500 (statuses as
MindIE's, spec §0.3). [I] Every error before the head is sent has the OpenAI shape plus
MindIE's ``error_type`` (:func:`openai_error`): each route is wrapped by
:func:`openai_errors`, which reformats any :class:`HttpError` (shared body parsing
included) and unexpected exception. Once a stream has started, a timeout or engine failure
is written as plain text and the connection closed (§0.4 step 9). Streams (SSE, spec §5.1/§5.2)::

    chat         one role chunk per choice {"delta": {"role": "assistant", "content": ""}}
                 content chunks (each delta repeats the role, as MindIE does); with tools,
                 delta.tool_calls items too (api/openai/toolparse.py)
                 one finishing chunk per choice (finish_reason)
    completions  text chunks (no role chunk), one finishing chunk per choice
    both         usage on the last finishing chunk, or with stream_options.include_usage
                 one extra chunk {"choices": [], "usage": ...} (spec §5.1 [I]);
                 then data: [DONE]
"""

from __future__ import annotations

import functools
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from tokenserve.api.context import ServeContext
from tokenserve.api.engine_stream import FanOut, handed_plan, response_id
from tokenserve.api.errors import fail_stream
from tokenserve.api.family_api import (
    DEFAULT_MAX_JSON_DEPTH,
    FAILED_FINISH,
    SERVER_NAME,
    EngineClient,
    FamilyApi,
    encode_text,
    failure_text,
    guard_stream,
    tokenizer_call,
)
from tokenserve.api.fields import choice_seed
from tokenserve.api.framing import EVENT_STREAM, SSE_DONE, sse
from tokenserve.api.openai.protocol import (
    OpenAIBody,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    completion_prompt_logprobs,
    join_logprobs,
    openai_error,
    openai_finish_reason,
    openai_usage,
    parse_chat_body,
    parse_completion_body,
)
from tokenserve.api.openai.tool_formats import detect_tool_format, special_marker_ids
from tokenserve.api.openai.toolparse import ToolStream, message_tool_calls, split_tools
from tokenserve.api.openai.tools import template_takes_tools, tool_constraint, tool_messages
from tokenserve.api.vllm.protocol import vllm_prompt_logprobs
from tokenserve.messages import GenerateRequest, RequestOutput, TokenLogprob
from tokenserve.sampling_params import MAX_SEED, SamplingParams
from tokenserve.transport.cycle import HandlerExit, HttpRequest, HttpResponse
from tokenserve.transport.errors import INTERNAL_ERROR_MESSAGE, HttpError
from tokenserve.transport.router import Handler

logger = logging.getLogger(__name__)

#: [I] ``model`` names accepted besides the served model: TGI ignores ``model`` on its
#: OpenAI routes (TGI docs "Messages API": any value, e.g. ``"tgi"``), and
#: ``huggingface_hub``'s ``InferenceClient(base_url=...).chat_completion()`` without
#: ``model=`` sends ``"tgi"`` (older releases) or ``"dummy"`` (e.g. 2.4).
CLIENT_PLACEHOLDER_MODELS = ("tgi", "dummy")


@dataclass
class Choice:
    """One choice = one engine request, and what it has produced so far."""

    index: int
    prompt_index: int
    request: GenerateRequest
    prefix: str = ""  # echoed prompt text (completions ``echo``)
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    offset: int = 0  # completions text_offset of the next token
    final: RequestOutput | None = None
    #: the engine's prompt log-probabilities (first entry None), once they came
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    #: streaming: the echoed prompt was written
    echoed: bool = False
    tools: ToolStream | None = None  # chat with tools: the stream's tool-call parser


@dataclass
class Plan:
    """A validated request fanned out into choices."""

    id: str
    chat: bool
    body: OpenAIBody
    created: int
    model: str
    prompt_lens: list[int]
    choices: list[Choice]

    def usage(self) -> dict[str, Any]:
        """Prompt tokens count once per prompt, completion tokens over every choice;
        ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache served
        (per prompt, from its first choice)."""
        prompt = list(self.prompt_lens)
        cached: dict[int, int] = {}
        for c in self.choices:
            if c.final is not None and c.final.num_prompt_tokens:
                prompt[c.prompt_index] = c.final.num_prompt_tokens
                cached.setdefault(c.prompt_index, c.final.num_cached_tokens)
        done = sum(c.final.num_output_tokens for c in self.choices if c.final is not None)
        return openai_usage(sum(prompt), done, sum(cached.values()))


def openai_errors(handler: Handler) -> Handler:
    """Answer ``handler``'s errors in the OpenAI shape (:func:`openai_error`).

    An :class:`HttpError` keeps its status, message, ``error_type`` and headers; any other
    exception is logged and answered 500 ``Server internal error`` (as the server would).
    Once the response has started the error is re-raised, so the server closes the
    connection as before; a disconnect is never answered.
    """

    @functools.wraps(handler)
    async def wrapped(request: HttpRequest, response: HttpResponse) -> None:
        try:
            await handler(request, response)
        except HandlerExit:
            raise
        except HttpError as exc:
            if response.started:
                raise
            body = openai_error(exc.status, exc.message, exc.error_type)
            await response.send_json(exc.status, body, exc.headers)
        except Exception:
            if response.started:
                raise
            logger.exception("unhandled error in handler for %s %s", request.method,
                             request.path)
            await response.send_json(500, openai_error(500, INTERNAL_ERROR_MESSAGE))

    return wrapped


class OpenAIApi(FamilyApi):
    """Handlers of the OpenAI family (spec §5).

    ``openai_support`` is MindIE's ``ServerConfig.openAiSupport``: ``"vllm"`` (default)
    or anything else for the "native OpenAI" ranges on chat (spec §5.1).
    """

    def __init__(
        self,
        engine: EngineClient,
        *,
        max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
        openai_support: str = "vllm",
        context: ServeContext | None = None,
    ) -> None:
        super().__init__(engine, max_json_depth=max_json_depth, context=context)
        self._native = openai_support != "vllm"
        self._started = int(time.time())
        self._texts = TokenTexts(engine.tokenizer)
        self._root = engine.info.model_path or engine.info.model_name
        template = getattr(engine.tokenizer, "chat_template", None)
        self._takes_tools = template_takes_tools(template)
        self._tool_format = detect_tool_format(template)  # the family's call text
        # its markers the tokenizer holds as special tokens: the grammar writes them as
        # those tokens, and the detokeniser keeps their text while tools are active
        self._tool_tokens = special_marker_ids(self._tool_format, engine.tokenizer)

    def wrap(self, handler: Handler) -> Handler:
        """Every §5 route answers its errors in the OpenAI shape (:func:`openai_errors`)."""
        return openai_errors(handler)

    # ------------------------------------------------------------------ models

    async def list_models(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /v1/models`` (spec §5.3): 4-space indented (hence stdlib json), base
        model's ``parent`` is the string ``"null"``; [I] ``created`` added."""
        card = {"id": self._info.model_name, "object": "model", "created": self._started,
                "root": self._root, "owned_by": SERVER_NAME, "parent": "null"}
        text = json.dumps({"object": "list", "data": [card]}, indent=4, ensure_ascii=False)
        await response.send(200, text.encode(), "application/json")

    async def get_model(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /v1/models/{model}`` (spec §5.4); unknown -> 404 ``Model <m> not found.``"""
        name = self._served_model(request)
        await response.send_json(200, {"id": name, "object": "model",
                                       "created": self._started, "owned_by": SERVER_NAME})

    # ------------------------------------------------------------------ requests

    async def chat_completions(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v1/chat/completions`` (spec §5.1): parse -> plan (or the plan handed
        over, PD decode) -> run and render."""
        try:
            body = parse_chat_body(self._json(request), self._native)
            self._check_model(body.model, "Got model {m}, but not found in server"
                              if self._native else "Model not found")
            given = handed_plan()
            ids = list(given.prompt_token_ids) if given else await self._chat_prompt(body)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        plan = self._plan("chatcmpl", True, body, [ids], [""], request.arrival_time, given)
        await self._run(request, response, plan)

    async def _chat_prompt(self, body: OpenAIBody) -> list[int]:
        """The chat plan's prompt: ``messages`` (tools folded in) through the chat
        template, tokenised; with active tools, their constraint goes into
        ``body.sampling``. Raises ValueError (422)."""
        assert body.messages is not None
        messages, extra = body.messages, {}
        if body.tool_choice is not None or any(
                m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages, extra = tool_messages(messages, body.tool_choice, self._takes_tools,
                                            self._tool_format)
        if body.tool_choice is not None and body.tool_choice.active:  # the model's format
            body.sampling["structured"] = tool_constraint(body.tool_choice, self._tool_format,
                                                          self._tool_tokens)
            body.sampling["keep_special_token_ids"] = tuple(sorted(self._tool_tokens.values()))
        try:
            text = self._engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, **body.template_kwargs, **extra)
        except Exception as exc:  # a template failure on client input is a 4xx
            raise ValueError(f"Failed to apply the chat template: {exc}") from None
        return await self._encode_chat(text)

    async def completions(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v1/completions`` (spec §5.2): parse -> plan (or the plan handed over,
        PD decode) -> run and render."""
        tok = self._engine.tokenizer
        try:
            body = parse_completion_body(self._json(request), self._info.vocab_size)
            self._check_model(body.model,
                              "Not found given model, please check modelName in config file.")
            assert body.prompts is not None
            skip = body.sampling["skip_special_tokens"]
            echoes = [("" if not body.echo else p.text if p.ids is None
                       else tok.decode(p.ids, skip_special_tokens=skip)) for p in body.prompts]
            given = handed_plan()
            prompts = ([list(given.prompt_token_ids)] * len(body.prompts) if given else
                       [p.ids if p.ids is not None else await encode_text(tok, p.text or "")
                        for p in body.prompts])
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        plan = self._plan("cmpl", False, body, prompts, echoes, request.arrival_time, given)
        await self._run(request, response, plan)

    def _check_model(self, model: str, message: str) -> None:
        """spec §5.1: ``model`` must name the served model, or [I] its path, or [I] one
        of :data:`CLIENT_PLACEHOLDER_MODELS` (TGI ignores ``model`` on these routes, and
        ``huggingface_hub``'s ``InferenceClient(base_url=...)`` sends a placeholder); the
        error keeps MindIE's message and [I] names the ids ``GET /v1/models`` lists.

        Raises:
            ValueError: any other name (the caller's 422).
        """
        if model not in (self._info.model_name, self._root, *CLIENT_PLACEHOLDER_MODELS):
            raise ValueError(f"{message.format(m=model[:256])} Available models: "
                             f"{self._info.model_name}.")

    async def _encode_chat(self, text: str) -> list[int]:
        """A rendered chat prompt already holds its special tokens: encode it without
        adding any (long texts in a worker thread)."""
        encode = functools.partial(self._engine.tokenizer.encode, text, add_special_tokens=False)
        ids = await tokenizer_call(text, encode)
        if not ids:
            raise ValueError("The chat template rendered an empty prompt.")
        return list(ids)

    def _plan(
        self, prefix: str, chat: bool, body: OpenAIBody, prompts: list[list[int]],
        echoes: list[str], arrival: float, given: GenerateRequest | None = None,
    ) -> Plan:
        """One engine request per (prompt, choice); 424 for a prompt that leaves no room
        (spec §0.4 step 8). ``max_tokens`` defaults to ``maxIterTimes`` and is capped by
        the context (spec §1.2). ``given``: the plan handed over (PD decode), whose
        parameters every choice takes as they are (a second choice is refused at
        admission)."""
        total = len(prompts) * body.n
        if total > self._info.max_batch_size:
            raise HttpError(422, f"The request asks for {total} sequences; at most "
                                 f"{self._info.max_batch_size} (maxBatchSize) are allowed.")
        rid = f"{prefix}-{response_id(uuid.uuid4().hex)}"
        choices: list[Choice] = []
        for p, ids in enumerate(prompts):
            params = given.params if given is not None else self._params(body, ids)
            for i in range(body.n):
                index = p * body.n + i
                if given is None and body.seed is not None:  # (P's plan has its seed)
                    params = replace(params, seed=choice_seed(body.seed, i))
                elif given is None and i:  # a fresh random seed per choice
                    params = replace(params, seed=random.randint(0, MAX_SEED))
                greq = GenerateRequest(f"{rid}-{index}", tuple(ids), params,
                                       arrival_time=arrival)
                tools = ToolStream(self._tool_format) if chat and body.tool_choice is not None \
                    and body.tool_choice.active else None
                choices.append(Choice(index, p, greq, prefix=echoes[p], offset=len(echoes[p]),
                                      tools=tools))
        return Plan(rid, chat, body, int(time.time()), self._info.model_name,
                    [len(ids) for ids in prompts], choices)

    def _params(self, body: OpenAIBody, ids: list[int]) -> SamplingParams:
        """A prompt's sampling parameters: 424 when it leaves no room, 422 when they
        are out of range."""
        self._check_fits(len(ids))
        room = self._info.max_model_len - len(ids)
        want = (body.max_tokens if body.max_tokens is not None
                else self._info.max_iter_times or room)
        try:
            return SamplingParams(max_new_tokens=min(want, room), **body.sampling)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None

    async def _run(self, request: HttpRequest, response: HttpResponse, plan: Plan) -> None:
        if plan.body.stream:
            await self._stream(request, response, plan)
        else:
            await self._complete(request, response, plan)

    # ------------------------------------------------------------------ non-stream

    async def _complete(self, request: HttpRequest, response: HttpResponse, plan: Plan) -> None:
        requests = [c.request for c in plan.choices]
        async with FanOut(self._engine, requests, request.disconnected, context=self._context) as fan:
            async for index, out in fan:
                choice = plan.choices[index]
                choice.texts.append(out.new_text)
                choice.logprobs.extend(out.logprobs or ())
                if out.prompt_logprobs is not None:
                    choice.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    choice.final = out
        for c in plan.choices:
            if c.final is not None and c.final.finish_reason in FAILED_FINISH:
                raise HttpError(500, failure_text(c.final))
        result = self._object_head(plan, "chat.completion" if plan.chat else "text_completion")
        result["choices"] = [self._final_choice(plan, c) for c in plan.choices]
        result["usage"] = plan.usage()
        if plan.chat and plan.body.prompt_logprobs is not None:  # vLLM: one, top level
            result["prompt_logprobs"] = self._vllm_prompt_logprobs(plan, plan.choices[0])
        await response.send_json(200, result)

    def _final_choice(self, plan: Plan, c: Choice) -> dict[str, Any]:
        assert c.final is not None
        text = "".join(c.texts)
        wants_lp = plan.body.sampling.get("logprobs") is not None
        reason = openai_finish_reason(c.final.finish_reason)
        if plan.chat:
            lp = chat_logprobs(c.logprobs, self._texts) if wants_lp else None
            message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": []}
            if c.tools is not None:  # the same reading as the stream's (toolparse)
                split = split_tools(text, True, self._tool_format)
                message["tool_calls"] = message_tool_calls(split)
                message["content"] = split.content or (None if split.calls else "")
                if split.calls and reason != "length":
                    reason = "tool_calls"
            return {"index": c.index, "message": message, "logprobs": lp,
                    "finish_reason": reason}
        lp = completion_logprobs(c.logprobs, self._texts, c.offset)[0] if wants_lp else None
        if wants_lp and plan.body.echo:
            lp = join_logprobs(self._echo_logprobs(plan, c), lp)
        item = {"index": c.index, "text": c.prefix + text, "logprobs": lp,
                "stop_reason": c.final.stop_reason, "finish_reason": reason}
        if plan.body.prompt_logprobs is not None:  # vLLM's extension, per choice
            item["prompt_logprobs"] = self._vllm_prompt_logprobs(plan, c)
        return item

    def _echo_logprobs(self, plan: Plan, c: Choice) -> dict[str, Any]:
        """The prompt's entries of an ``echo`` + ``logprobs`` choice."""
        k = plan.body.sampling["logprobs"]
        if c.prompt_logprobs is None:  # the engine ended it before the prompt was done
            raise HttpError(500, "the prompt's log-probabilities were not computed")
        return completion_prompt_logprobs(c.request.prompt_token_ids, c.prompt_logprobs,
                                          self._texts, k)

    def _vllm_prompt_logprobs(self, plan: Plan, c: Choice) -> list[Any]:
        if c.prompt_logprobs is None:
            raise HttpError(500, "the prompt's log-probabilities were not computed")
        assert plan.body.prompt_logprobs is not None
        return vllm_prompt_logprobs(c.prompt_logprobs, lambda t: self._texts.get(t)[0],
                                    plan.body.prompt_logprobs)

    # ------------------------------------------------------------------ stream

    async def _stream(self, request: HttpRequest, response: HttpResponse, plan: Plan) -> None:
        if await guard_stream(response, self._pump(request, response, plan), logger, plan.id,
                              "openai"):
            await response.end()

    async def _pump(self, request: HttpRequest, response: HttpResponse, plan: Plan) -> bool:
        """Every choice admitted first (a full queue is a 503 answer), then the head and
        the chunks; False when it closed the stream on a failed choice."""
        kind = "chat.completion.chunk" if plan.chat else "text_completion"
        open_choices = len(plan.choices)
        requests = [c.request for c in plan.choices]
        async with FanOut(self._engine, requests, request.disconnected, context=self._context) as fan:
            await response.start_stream(200, EVENT_STREAM)
            # echo + logprobs: the prompt's chunk waits for its log-probabilities
            late_echo = self._late_echo(plan)
            for c in plan.choices:  # role chunks (chat) / echoed prompts (completions)
                if plan.chat or (c.prefix and not late_echo):
                    await response.write(sse(self._chunk(plan, kind, c, None, c.prefix)))
            async for index, out in fan:
                choice = plan.choices[index]
                if out.finished and out.finish_reason in FAILED_FINISH:
                    # spec §0.4 step 9: the error text is the last event, then close (the
                    # other choices are aborted)
                    await fail_stream(response, "openai", failure_text(out))
                    return False
                if out.prompt_logprobs is not None:
                    choice.prompt_logprobs = out.prompt_logprobs
                if late_echo and not choice.echoed and choice.prompt_logprobs is not None:
                    choice.echoed = True
                    await response.write(sse(self._echo_chunk(plan, kind, choice)))
                text, calls = out.new_text, []
                if choice.tools is not None:  # chat with tools: content and call deltas
                    text, calls = choice.tools.feed(out.new_text)
                    if out.finished:
                        more, calls_end = choice.tools.finish()
                        text, calls = text + more, calls + calls_end
                if not (out.finished or text or calls or out.logprobs):
                    continue  # nothing to show (spec §5.1 item 2)
                chunk = self._chunk(plan, kind, choice, out, text, calls)
                if out.finished:
                    choice.final = out
                    open_choices -= 1
                    if open_choices == 0 and not plan.body.include_usage:
                        chunk["usage"] = plan.usage()
                await response.write(sse(chunk))
            if plan.body.include_usage:
                chunk = self._object_head(plan, kind)
                chunk["choices"] = []
                chunk["usage"] = plan.usage()
                await response.write(sse(chunk))
            await response.write(SSE_DONE)
        return True

    @staticmethod
    def _late_echo(plan: Plan) -> bool:
        """Whether the echoed prompt is streamed with its log-probabilities (sent when
        the engine has them: with the first token) instead of before the first token."""
        body = plan.body
        return not plan.chat and (body.prompt_logprobs is not None or (
            body.echo and body.sampling.get("logprobs") is not None))

    def _echo_chunk(self, plan: Plan, kind: str, c: Choice) -> dict[str, Any]:
        """The first chunk of a streamed completions choice that asked for prompt
        log-probabilities: the echoed prompt (``""`` without ``echo``), its ``logprobs``
        (OpenAI's object, with ``echo``) and ``prompt_logprobs`` (vLLM's list, when asked)."""
        lp = (self._echo_logprobs(plan, c)
              if plan.body.echo and plan.body.sampling.get("logprobs") is not None else None)
        item: dict[str, Any] = {"index": c.index, "text": c.prefix, "logprobs": lp,
                                "finish_reason": None, "stop_reason": None}
        if plan.body.prompt_logprobs is not None:
            item["prompt_logprobs"] = self._vllm_prompt_logprobs(plan, c)
        chunk = self._object_head(plan, kind)
        chunk["choices"] = [item]
        return chunk

    def _chunk(
        self, plan: Plan, kind: str, c: Choice, out: RequestOutput | None, text: str,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One choice's chunk; ``out`` None is the chat role chunk or the echo chunk.
        ``tool_calls``: the chat delta's tool-call items (toolparse.ToolStream)."""
        entries = list(out.logprobs or ()) if out is not None else []
        wants_lp = plan.body.sampling.get("logprobs") is not None and out is not None
        reason = openai_finish_reason(out.finish_reason) if out is not None and out.finished else None
        if plan.chat:
            lp = chat_logprobs(entries, self._texts) if wants_lp else None
            delta: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            if reason == "stop" and c.tools is not None and c.tools.called:
                reason = "tool_calls"
            item: dict[str, Any] = {"index": c.index, "delta": delta,
                                    "logprobs": lp, "finish_reason": reason}
        else:
            lp = None
            if wants_lp:
                lp, c.offset = completion_logprobs(entries, self._texts, c.offset)
            stop = out.stop_reason if out is not None and out.finished else None
            item = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": reason,
                    "stop_reason": stop}
        chunk = self._object_head(plan, kind)
        chunk["choices"] = [item]
        return chunk

    @staticmethod
    def _object_head(plan: Plan, kind: str) -> dict[str, Any]:
        return {"id": plan.id, "object": kind, "created": plan.created, "model": plan.model}
