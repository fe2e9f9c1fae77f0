"""What every request passes before its endpoint (pure ASGI, so a client's disconnect and the body stream
reach the endpoints untouched): its metrics, the API key, the body-size limit."""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from transformer.serving.errors import error_response
from transformer.serving.metrics import Metrics

__all__ = ["ENDPOINTS", "BodyLimit", "KeyCheck", "RequestMetrics", "needs_key"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# the paths metrics are labelled with (any other path: "other", so that scans cannot grow the labels)
ENDPOINTS = (
    "/",
    "/health",
    "/ready",
    "/metrics",
    "/v1/models",
    "/v1/translate",
    "/v1/classify",
    "/docs",
    "/openapi.json",
)


def needs_key(path: str) -> bool:
    """The API and the metrics need the key; /health, /ready, the page and the OpenAPI page do not."""
    return path.startswith("/v1/") or path == "/metrics"


class RequestMetrics:
    """Counts every answer by endpoint and status and times it (rejections by the gates below included)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        status = {"code": 500}

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        in_flight = self.metrics.in_flight.labels(endpoint)
        in_flight.inc()
        try:
            await self.app(scope, receive, recording_send)
        finally:
            in_flight.dec()
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)


class KeyCheck:
    """`Authorization: Bearer <api_key>` on the paths of `needs_key` (401 + `WWW-Authenticate: Bearer`)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and needs_key(scope["path"]) and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "a valid API key is required: send the header Authorization: Bearer <key>"
                if given:
                    message = "the API key is wrong (Authorization: Bearer <key>)"
                response = error_response(401, message, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for a body over `limit` bytes: by its Content-Length at once, or as a chunked stream grows."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(413, self._message())(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # FastAPI re-raises an HTTPException from reading the body
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"the request body is larger than {self.limit} bytes (batching.max_chars bounds it)"
