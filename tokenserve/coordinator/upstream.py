"""The coordinator's HTTP client to its P and D instances (httpx on its default transport).

One failure httpx does not translate: httpcore on anyio reads the peer name of the new
socket while setting up a connection, and when the peer closed it in that instant (a P
killed with requests in flight) the socket is already gone and the read fails with
``AttributeError`` (``'NoneType' object has no attribute 'getpeername'``) instead of an
``httpx.ConnectError``. Callers handle httpx errors only, so it surfaced as an unhandled
error and a 500 where the request should have gone to another P (seen in
tests/integration/test_pd_faults.py under load). Nothing was sent on such a connection:
:class:`UpstreamTransport` raises it as the ``httpx.ConnectError`` it is.
"""

from __future__ import annotations

import httpx


class UpstreamTransport(httpx.AsyncHTTPTransport):
    """``httpx.AsyncHTTPTransport`` whose connection-setup ``AttributeError`` is an
    ``httpx.ConnectError`` (module docstring)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except AttributeError as exc:
            raise httpx.ConnectError(f"connection broke while it was set up: {exc!r}",
                                     request=request) from exc


def upstream_client() -> httpx.AsyncClient:
    """The client for every call to a P or D: unbounded connections (a request holds one
    to its P for the prefill), 256 kept alive, no proxy settings from the environment."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return httpx.AsyncClient(transport=UpstreamTransport(limits=limits, trust_env=False),
                             trust_env=False)
