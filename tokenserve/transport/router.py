"""(method, path) -> handler dispatch (spec/interfaces.md §0.1).

Routes are either exact paths or patterns with ``{name}`` placeholders; a placeholder
matches ``[\\w\\-.]+`` (spec §0.1: ``{model}`` segments) and may sit inside a segment, e.g.
``/health/timed-{n}``. Exact routes are looked up in a dict; patterns are tried in
registration order. An unknown path answers 404 and a known path with the wrong method
405, both with the MindIE error wrapper (spec §0.3).

A :class:`Router` is itself a handler (``await router(request, response)``), so it can be
handed straight to :class:`tokenserve.transport.server.HttpServer`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from tokenserve.transport.errors import HttpError

if TYPE_CHECKING:
    from tokenserve.transport.cycle import HttpRequest, HttpResponse

Handler = Callable[["HttpRequest", "HttpResponse"], Awaitable[None]]

#: spec §0.1: what a ``{param}`` placeholder matches (ASCII, like MindIE's std::regex).
PARAM_PATTERN = r"[\w\-.]+"
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Compile a route such as ``/v2/models/{model}/infer`` into a full-match regex whose
    named groups are the placeholders."""
    if not pattern.startswith("/"):
        raise ValueError(f"route must start with '/': {pattern!r}")
    parts: list[str] = []
    pos = 0
    names: set[str] = set()
    for m in _PLACEHOLDER.finditer(pattern):
        name = m.group(1)
        if name in names:
            raise ValueError(f"duplicate placeholder {name!r} in {pattern!r}")
        names.add(name)
        parts.append(re.escape(pattern[pos : m.start()]))
        parts.append(f"(?P<{name}>{PARAM_PATTERN})")
        pos = m.end()
    parts.append(re.escape(pattern[pos:]))
    return re.compile("".join(parts), re.ASCII)


class Router:
    """Per-method routing table; exact routes plus ``{param}`` patterns (spec §0.1).

    Matched placeholders are stored in ``request.path_params`` before the handler runs.
    """

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Handler]] = {}
        self._patterns: list[tuple[re.Pattern[str], str, dict[str, Handler]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        """Register ``handler`` for ``method`` (e.g. ``"POST"``) on ``path``.

        Raises:
            ValueError: the (method, path) pair is already registered, or a bad pattern.
        """
        method = method.upper()
        if _PLACEHOLDER.search(path):
            table = None
            for _rx, src, methods in self._patterns:
                if src == path:
                    table = methods
                    break
            if table is None:
                table = {}
                self._patterns.append((compile_pattern(path), path, table))
        else:
            if not path.startswith("/"):
                raise ValueError(f"route must start with '/': {path!r}")
            table = self._exact.setdefault(path, {})
        if method in table:
            raise ValueError(f"route {method} {path} registered twice")
        table[method] = handler

    def get(self, path: str, handler: Handler) -> None:
        """Shorthand for ``add("GET", path, handler)``."""
        self.add("GET", path, handler)

    def post(self, path: str, handler: Handler) -> None:
        """Shorthand for ``add("POST", path, handler)``."""
        self.add("POST", path, handler)

    def routes(self) -> list[tuple[str, str]]:
        """Every registered (method, path), for logging and tests."""
        out = [(m, p) for p, t in self._exact.items() for m in t]
        out += [(m, src) for _rx, src, t in self._patterns for m in t]
        return out

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        """Find the handler for (method, path).

        Returns:
            (handler, path_params).

        Raises:
            HttpError: 404 when no route matches the path; 405 (with an ``Allow`` header)
                when the path matches but not the method.
        """
        allowed: list[str] = []
        table = self._exact.get(path)
        if table is not None:
            handler = table.get(method)
            if handler is not None:
                return handler, {}
            allowed.extend(table)
        for rx, _src, methods in self._patterns:
            m = rx.fullmatch(path)
            if m is None:
                continue
            handler = methods.get(method)
            if handler is not None:
                return handler, m.groupdict()
            allowed.extend(methods)
        if allowed:
            allow = ", ".join(sorted(set(allowed)))
            raise HttpError(
                405, f"Method {method} not allowed for {path}.", headers={"Allow": allow}
            )
        raise HttpError(404, f"Route {path} not found.")

    async def __call__(self, request: HttpRequest, response: HttpResponse) -> None:
        """Dispatch ``request``; 404/405 are raised as :class:`HttpError` (the server
        answers them with the MindIE wrapper)."""
        handler, params = self.resolve(request.method, request.path)
        if params:
            request.path_params = params
        await handler(request, response)
