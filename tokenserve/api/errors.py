"""Each family's error shape, for a whole answer and inside a started stream
(spec/interfaces.md §0.3, §0.4 step 9; spec/pd_disaggregation.md §3.2 rule [I]).

One module so a mixed server and the PD coordinator write an error the same way, byte for
byte: the coordinator makes its own errors (not ready, overload, timeouts, no P) with
:func:`error_json` / :func:`fail_stream`, the families raise :class:`HttpError` (answered
by the server or, for OpenAI, by its wrapper with :func:`openai_error`) and end a failed
stream with :func:`fail_stream`. The shapes are the families' descriptions'
(:mod:`tokenserve.api.families`: error object and framing):

========  =====================================  ==========================================
family    whole answer (``application/json``)    in a started stream (then the stream ends)
========  =====================================  ==========================================
openai    ``{"error": {message, type, param,     ``data: {that object}\\n\\n`` (no
          code}, "error_type"}``                 ``[DONE]``)
vllm      ``{"error", "error_type"}`` (§0.3)     ``{"error", "error_type"}\\0``
triton    ``{"error", "error_type"}``            ``data:{"error", "error_type"}\\n\\n``
tgi,      ``{"error", "error_type"}``            ``data: {"error", "error_type"}\\n\\n``
mindie
========  =====================================  ==========================================

[I] a stream that fails after its head ends with the family's own error event, which every
family's clients parse (the ``openai`` SDK and ``huggingface_hub`` raise on it), not with
MindIE's plain-text last chunk (spec §0.4 step 9 [V]): a drop-in for one server must not
leave a client with a silently truncated stream (issue 22).
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenserve.api.families import describe, openai_error
from tokenserve.api.routes import Family
from tokenserve.transport.cycle import HttpResponse

__all__ = ["ERROR_CONTENT_TYPE", "error_dict", "error_json", "error_message", "fail_stream",
           "openai_error", "stream_error"]

#: the content type of every whole error answer
ERROR_CONTENT_TYPE = "application/json"


def error_dict(family: Family | str, status: int, message: str) -> dict[str, Any]:
    """``family``'s error object for ``status`` / ``message`` (module table)."""
    return describe(family).error_object(status, message)


def error_json(family: Family | str, status: int, message: str) -> bytes:
    """A whole error answer's body in ``family``'s shape (:data:`ERROR_CONTENT_TYPE`)."""
    return describe(family).error_body(status, message)


def error_message(body: bytes | str) -> str:
    """The message of an error body in any family's shape (``{"error": {"message"}}``,
    ``{"error": "..."}``), else the body as text (invalid UTF-8 replaced): what PD carries
    on of an instance's error (D's ``error:`` text, the coordinator's failure)."""
    text = body if isinstance(body, str) else body.decode(errors="replace")
    try:
        err = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return text
    if isinstance(err, dict):
        err = err.get("message")
    return err if isinstance(err, str) else text


def stream_error(family: Family | str, message: str, status: int = 500) -> bytes:
    """The bytes that end ``family``'s stream on a failure (module table)."""
    return describe(family).error_event(message, status)


async def fail_stream(response: HttpResponse, family: Family | str, message: str,
                      status: int = 500) -> None:
    """End a started stream with ``family``'s error event (:func:`stream_error`), then
    close the connection."""
    await response.write(stream_error(family, message, status))
    await response.end(close_connection=True)
