"""MindIE native extras: ``POST /v1/tokenizer`` (spec/interfaces.md §2.2) and
``POST /v2/models/{model}/stopInfer`` (spec §2.3), both on the business plane.

``stopInfer`` finds live requests in the server's :class:`RequestRegistry` (filled by
``EngineStream`` for every family) by the client's Triton ``id`` or the server request
id, and stops each: the engine aborts it (KV blocks freed) and the request's own
handler answers its client normally with ``finish_reason`` ``stop_sequence`` (§1.4).
"""

from __future__ import annotations

from tokenserve.api.family_api import FamilyApi, tokenizer_call
from tokenserve.api.fields import MAX_TOKENS_NUM, check_id
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError

#: spec §2.2 messages.
JSON_FAIL = "Req body converts to json fail."
INPUTS_INVALID = "Inputs in request body is invalid."
TOKENIZER_FAIL = "TikToken process fail."
#: [I] most characters ``/v1/tokenizer`` accepts (config.md ``maxRequestLength`` 40 Mi
#: UTF-16 units; the body limit is the same number of bytes, so this rarely bites).
MAX_TEXT_CHARS = 40 * 2**20


class MindIEExtraApi(FamilyApi):
    """``/v1/tokenizer`` and ``stopInfer``.

    Args:
        engine: the engine (its ``tokenizer`` and ``info``).
        context: the server's shared state (without one, stopInfer finds nothing: 404).
    """

    async def tokenizer(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v1/tokenizer`` (spec §2.2): ``{"inputs": str, "do_decode": bool=true}``
        -> ``{"token_number": n, "tokens": [...]}``. ``tokens`` are the decoded pieces
        (one per token) with ``do_decode``, else [I] the token ids."""
        obj = self._body(request, JSON_FAIL)
        text = obj.get("inputs")
        if not isinstance(text, str) or not text:
            raise HttpError(422, INPUTS_INVALID)
        if len(text) > MAX_TEXT_CHARS:
            raise HttpError(422, f"{INPUTS_INVALID} Text longer than {MAX_TEXT_CHARS} characters.")
        do_decode = obj.get("do_decode", True)
        if do_decode is None:
            do_decode = True
        if not isinstance(do_decode, bool):
            raise HttpError(422, "Parameter do_decode must be a boolean.")
        tok = self._engine.tokenizer

        def work() -> tuple[list[int], list[str] | None]:
            ids = list(tok.encode(text))
            pieces = [tok.decode([i]) for i in ids] if do_decode else None
            return ids, pieces

        try:
            ids, pieces = await tokenizer_call(text, work)
        except Exception:
            raise HttpError(422, TOKENIZER_FAIL) from None
        if len(ids) > MAX_TOKENS_NUM:
            raise HttpError(422, f"{INPUTS_INVALID} More than {MAX_TOKENS_NUM} tokens.")
        await response.send_json(200, {"token_number": len(ids),
                                       "tokens": pieces if pieces is not None else ids})

    async def stop_infer(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /v2/models/{m}/stopInfer`` (spec §2.3): body ``{"id": ...}``; 200 echoes
        the body; 404 for an unknown model or id; 422 for a bad body or id."""
        self._served_model(request)
        obj = self._body(request)
        try:
            rid = check_id(obj.get("id"))
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        streams = self._context.registry.find(rid) if self._context is not None else []
        if not streams:
            raise HttpError(404, f"RequestId is {rid} not found.")
        try:
            for stream in streams:
                await stream.stop()
        except Exception:
            raise HttpError(500, "Stop request failed, internal failed.") from None
        await response.send(200, request.body, "application/json")
