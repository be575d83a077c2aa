"""The server's pure-ASGI middleware (no BaseHTTPMiddleware, so streaming and disconnect detection are untouched).

APIKeyMiddleware: with --api-key (or VLLM_API_KEY) every route needs `Authorization: Bearer KEY` except the probes
vLLM's newest security guidance leaves open (/health, /ping, /version, /metrics) and CORS preflights.
RequestIdMiddleware (--enable-request-id-headers): every response carries X-Request-Id, the client's or a new one.
BodySizeMiddleware: a declared Content-Length above the limit is answered 413 without a byte kept (a body without
a length is counted as it is read, in body.read_body). The body is read and dropped first, as far as body.drain
allows, so that the closing connection is not reset under the client before it reads the 413; a client that sent
`Expect: 100-continue` has sent nothing yet and gets the 413 at once.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from collections.abc import AsyncIterator, Iterable

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltaserve.api.body import MAX_DRAIN_BYTES, drain
from deltaserve.api.errors import APIError, error_response, request_too_large, unauthorized

# Probes a load balancer or scraper must reach without the key (vLLM's newest unauthenticated set).
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


def route_path(scope: Scope) -> str:
    """The path routing sees: behind --root-path a proxy may or may not have stripped the prefix."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    return path


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: Iterable[str]) -> None:
        self.app = app
        # Compared as digests, so the comparison time says nothing about the keys' lengths.
        self.digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    def is_authorized(self, headers: Headers) -> bool:
        scheme, _, token = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.strip().encode()).digest()
        is_match = False
        for expected in self.digests:
            is_match |= secrets.compare_digest(digest, expected)
        return is_match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and route_path(scope) not in OPEN_PATHS
            and not self.is_authorized(Headers(scope=scope))
        ):
            await error_response(unauthorized())(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodySizeMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            declared = Headers(scope=scope).get("content-length")
            if declared is not None:
                try:
                    size = int(declared)
                except ValueError:
                    size = -1
                error: APIError | None = None
                if size < 0:
                    error = APIError("Invalid Content-Length header.", status=400, err_type="Bad Request")
                elif size > self.max_body_bytes:
                    error = request_too_large(self.max_body_bytes)
                if error is not None:
                    headers = Headers(scope=scope)
                    if (
                        error.status == 413
                        and size <= MAX_DRAIN_BYTES
                        and "100-continue" not in headers.get("expect", "")
                    ):
                        await drain(_body_chunks(receive))
                    response = error_response(error)
                    # Whatever is left unread, the connection closes after this answer.
                    response.headers["Connection"] = "close"
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


async def _body_chunks(receive: Receive) -> AsyncIterator[bytes]:
    """The request body's chunks as the ASGI server delivers them (ends at the last one or a disconnect)."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return
