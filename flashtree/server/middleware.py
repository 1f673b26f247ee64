"""ASGI middleware in front of the API (pure ASGI: streaming and disconnects pass straight through).

- :class:`Gate`: on ``/v1/*``, a missing or wrong API key is 401 and a loading engine is 503,
  before the body is read (so a bad key never learns whether its JSON was valid).
- :class:`BodyLimit`: a request body over the limit is 413, refused from its Content-Length before
  a byte of it is read, or as soon as a body sent in chunks passes the limit.
- :class:`ResponseCounter`: counts generation responses by endpoint and HTTP status.
"""

from __future__ import annotations

import secrets
from typing import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashtree.server.errors import APIError
from flashtree.server.metrics import ServerMetrics

API_PREFIX = "/v1/"
TOKENIZER_PATHS = ("/tokenize", "/detokenize")  # gated like /v1/*
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


class Gate:
    def __init__(self, app: ASGIApp, api_key: str | None, not_ready_reason: Callable[[], str | None]):
        self.app = app
        self.api_key = api_key
        self.not_ready_reason = not_ready_reason  # None when ready

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith(API_PREFIX) or scope["path"] in TOKENIZER_PATHS):
            error = self._refusal(scope)
            if error is not None:
                await error.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        if self.api_key is not None and not self._key_matches(scope):
            return APIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>' "
                                 "(or 'x-api-key: <key>')", code="invalid_api_key")
        reason = self.not_ready_reason()
        if reason is not None:
            return APIError(503, reason, code="model_not_ready", headers={"Retry-After": "5"})
        return None

    def _key_matches(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or ())
        value = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else headers.get(b"x-api-key", b"").decode("latin-1").strip()
        return bool(key) and secrets.compare_digest(key.encode(), self.api_key.encode())


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(int(declared)).response(scope["path"])(scope, receive, send)
            return
        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # (the endpoint's body parsing passes HTTP errors on)
                    raise HTTPException(413, self._too_large(seen).message)
            return message

        await self.app(scope, counted_receive, send)

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"the request body has {size} bytes (at least), over the server's limit of "
                             f"{self.max_bytes} (--max-request-bytes)", code="request_too_large")


class ResponseCounter:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint=path, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
