"""The server's own inference-side routes: ``GET /health`` (spec §3.6) and the shared
``POST /generate`` (spec §3.1), which the body sends to vLLM or TGI
(:func:`tokenserve.api.routes.generate_family`)."""

from __future__ import annotations

import orjson

from tokenserve.api.engine_client import engine_healthy
from tokenserve.api.family_api import (
    DEFAULT_MAX_JSON_DEPTH,
    EngineClient,
    check_json_content_type,
    parse_json_object,
)
from tokenserve.api.routes import Family, generate_family
from tokenserve.api.tgi.handlers import TgiApi
from tokenserve.api.vllm.handlers import VllmApi
from tokenserve.transport.cycle import HttpRequest, HttpResponse
from tokenserve.transport.errors import HttpError

#: spec §3.1: the ``error`` of a ``/generate`` body with neither ``prompt`` nor ``inputs``
#: is itself a JSON document.
GENERATE_ROUTING_ERROR = orjson.dumps(
    {
        "Error": "`inputs` or `prompt` must be necessary and data type must be string. "
        "Additionally, the request body must be valid json",
        "error_type": "validation",
    }
).decode()


class ServerApi:
    """Handlers of the routes no single family owns."""

    def __init__(self, engine: EngineClient, vllm: VllmApi, tgi: TgiApi, *,
                 max_json_depth: int = DEFAULT_MAX_JSON_DEPTH) -> None:
        self._engine = engine
        self._vllm = vllm
        self._tgi = tgi
        self._max_json_depth = max_json_depth

    async def health(self, request: HttpRequest, response: HttpResponse) -> None:
        """``GET /health`` (spec §3.6): 200 with an empty body when the engine is healthy,
        otherwise 503 with an empty body."""
        healthy = engine_healthy(self._engine)
        await response.send(200 if healthy else 503, b"", "application/json")

    async def generate(self, request: HttpRequest, response: HttpResponse) -> None:
        """``POST /generate`` (spec §3.1): the body is parsed once here; a non-null
        ``prompt`` goes to the vLLM family (it wins over ``inputs``), else a non-null
        ``inputs`` to TGI, else 422 with the nested-JSON message. An unparseable body is
        422 as everywhere (spec §0.4 step 3)."""
        try:
            check_json_content_type(request.headers)
            obj = parse_json_object(request.body, self._max_json_depth)
        except ValueError as exc:
            raise HttpError(422, str(exc)) from None
        try:
            family = generate_family(obj)
        except ValueError:
            raise HttpError(422, GENERATE_ROUTING_ERROR) from None
        if family is Family.VLLM:
            await self._vllm.generate(request, response, body=obj)
        else:
            await self._tgi.generate(request, response, body=obj)
