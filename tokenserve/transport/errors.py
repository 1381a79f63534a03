"""MindIE's error body and the status -> ``error_type`` table (spec/interfaces.md §0.3).

Nearly every error MindIE Server produces is ``{"error": <message>, "error_type": <class>}``
with ``error_type`` chosen from the HTTP status. Handlers raise :class:`HttpError`; the
HTTP server turns it into that body (before a response has started) so a family module
never has to format errors by hand.
"""

from __future__ import annotations

from http import HTTPStatus

import orjson

#: spec §0.3: HTTP status -> ``error_type``.
ERROR_TYPES: dict[int, str] = {
    400: "Bad Request",
    404: "NotFoundError",
    422: "Input Validation Error",
    424: "Generation Error",
    500: "Incomplete Generation",
    503: "Service Unavailable",
}

#: spec §0.2: the body of an uncaught handler exception ([I] wrapped as JSON).
INTERNAL_ERROR_MESSAGE = "Server internal error"


def body_too_large_message(max_body_bytes: int) -> str:
    """spec §0.2's 413 message (body ``{"message": ...}``); the limit is given in MiB."""
    mib = max_body_bytes / 2**20
    n = str(int(mib)) if mib == int(mib) else f"{mib:g}"
    return f"Request body too large. Maximum allowed size is {n}MB."


def error_type_for(status: int) -> str:
    """``error_type`` for ``status`` (spec §0.3); statuses outside the table use the
    standard reason phrase (e.g. 405 -> ``Method Not Allowed``) [I]."""
    try:
        return ERROR_TYPES[status]
    except KeyError:
        try:
            return HTTPStatus(status).phrase
        except ValueError:
            return "Error"


def error_obj(status: int, message: str, error_type: str | None = None) -> dict[str, str]:
    """The MindIE error wrapper as a dict (spec §0.3)."""
    return {"error": message, "error_type": error_type or error_type_for(status)}


def error_body(status: int, message: str, error_type: str | None = None) -> bytes:
    """The MindIE error wrapper serialised with orjson (spec §0.3)."""
    return orjson.dumps(error_obj(status, message, error_type))


class HttpError(Exception):
    """An error that becomes an HTTP response with the MindIE wrapper (spec §0.3).

    Raise it from a handler before the response has started; the server answers
    ``status`` with ``{"error": message, "error_type": ...}`` and keeps serving.

    Attributes:
        status: HTTP status code.
        message: the ``error`` text.
        error_type: overrides the table (e.g. the role endpoints' lower-case variant).
        headers: extra response headers (e.g. ``Allow`` on 405).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.headers = headers

    def body(self) -> bytes:
        """The serialised wrapper."""
        return error_body(self.status, self.message, self.error_type)
