"""The HTTP server under the app: aiohttp's, with what it answers itself (a request it cannot parse, a connection
past --limit-concurrency) in OpenAI's error shape, and the checks made before it listens (the port, open files)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import socket
from typing import Any

from aiohttp import web, web_protocol

from kiln.engine.serving.api_errors import APIError

logger = logging.getLogger("kiln")


def error_response(error: APIError, status: int | None = None, body: dict[str, Any] | None = None) -> web.Response:
    """`error` as an OpenAI error object, or as `status` and `body` when given (another API's shape of it)."""
    status, body = status or error.status, body or error.body()
    response = web.json_response(body, status=status, headers=getattr(error, "headers", None))
    if error.status == 408:  # the rest of a body that came too slowly is not waited for
        response.force_close()
    return response


class _JsonErrors(web_protocol.RequestHandler):
    """aiohttp's connection handler, answering what it refuses before any route sees the request (a header past
    its limit, a malformed request line or chunked body) with an OpenAI error object instead of text/plain."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None):
        super().handle_error(request, status, exc, message)  # (its log; it raises once a response has begun)
        if status >= 500:
            error = APIError(status, "internal server error", type_="internal_error")
        else:
            reason = getattr(exc, "message", None) or message or "a malformed HTTP request"
            error = APIError(status, f"the HTTP request is malformed: {str(reason)[:200]}")
        response = error_response(error)
        response.force_close()
        return response


class _Busy(asyncio.Protocol):
    """A connection past --limit-concurrency: a 503 and closed, before it costs a handler."""

    BODY = json.dumps(
        APIError(503, "too many open connections; retry later", type_="service_unavailable").body()
    ).encode()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        head = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n" + (
            f"Content-Length: {len(self.BODY)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
        )
        transport.write(head.encode() + self.BODY)
        transport.close()


class _Server(web.Server):
    """aiohttp's server, handling connections with `_JsonErrors` and at most `limit` of them at once."""

    limit: int = 1024

    def __call__(self) -> asyncio.Protocol:
        if len(self.connections) >= self.limit:
            return _Busy()
        return _JsonErrors(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """The app's runner, with `_Server` in front (`limit`: open connections at most)."""

    def __init__(self, app: web.Application, limit: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limit = limit

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        server = _Server(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )
        server.limit = self.limit
        return server


def raise_open_files_limit(connections: int) -> None:
    """Room for `connections` sockets and the process's own files (a soft limit of 1,024 is common): raised to what
    the hard limit allows, with a warning where that is too little."""
    wanted = connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft != resource.RLIM_INFINITY and soft < wanted:
        logger.warning(
            "open files are limited to %d: fewer than --limit-concurrency %d connections fit", soft, connections
        )


def check_port_free(host: str, port: int) -> None:
    """Raise ValueError (a line at start-up) unless `host:port` can be listened on."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own socket will be
            probe.bind(address)
    except OSError as e:
        reason = e.strerror or str(e)
        raise ValueError(f"cannot listen on {host}:{port} ({reason}); another server there? choose --port") from None
