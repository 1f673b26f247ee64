"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

| status | when | type / code |
| --- | --- | --- |
| 400 | invalid parameter, malformed JSON, bad prompt | invalid_request_error |
| 401 | missing or wrong API key | invalid_request_error / invalid_api_key |
| 404 | unknown model or path | invalid_request_error / model_not_found |
| 400 | prompt longer than the context (the numbers in the message) | invalid_request_error / context_length_exceeded |
| 413 | request body over ``--max-request-bytes`` | invalid_request_error / request_too_large |
| 429 | waiting queue full (with Retry-After) | rate_limit_error / queue_full |
| 500 | the engine or the server failed on this request: "internal error" and an id the log has | server_error |
| 503 | the model is loading (or failed to load), or the engine was lost (a worker process died) | service_unavailable |
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashtree.engine.scheduler import PromptTooLongError, QueueFullError
from flashtree.errors import RequestError
from flashtree.server.protocol import ErrorInfo, ErrorResponse
from flashtree.server.stream import EngineUnavailable

log = logging.getLogger("flashtree.server")

RETRY_AFTER_SECONDS = 1
_TYPE_OF_STATUS = {401: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                   500: "server_error", 503: "service_unavailable"}


ANTHROPIC_PATHS = ("/v1/messages",)
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error"}


class APIError(Exception):
    """An error the client sees as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPE_OF_STATUS.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def anthropic_body(self) -> dict[str, Any]:
        """The error in the shape of Anthropic's API (``/v1/messages``)."""
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(self.status, "invalid_request_error"),
                                           "message": self.message}}

    def response(self, path: str = "") -> JSONResponse:
        """The JSON response; in Anthropic's shape for a ``path`` of its API."""
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PATHS) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def from_engine_error(err: Exception, prompt_field: str) -> APIError:
    """Map an exception from ``LLMEngine.add_request`` to the client's error."""
    if isinstance(err, QueueFullError):
        return APIError(429, f"the server is busy: {err}; retry later", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(err, PromptTooLongError):
        return APIError(400, str(err), param=prompt_field, code="context_length_exceeded")
    if isinstance(err, RequestError):
        return APIError(400, str(err), param=param_named_in(str(err), prompt_field))
    if isinstance(err, EngineUnavailable):
        return APIError(503, str(err), code="model_not_ready")
    return internal_error(err)


def internal_error(err: BaseException) -> APIError:
    """A 500 that shows the client an id and keeps the details in the log (under that id)."""
    incident = uuid.uuid4().hex[:12]
    log.error("internal error %s: %s: %s", incident, type(err).__name__, err, exc_info=err)
    return APIError(500, f"internal error (id {incident}); the server log has the details")


def param_named_in(message: str, prompt_field: str) -> str | None:
    """The request field an engine message is about (its messages start with the field's name)."""
    words = message.replace(",", " ").split()
    if not words:
        return None
    first = words[1] if words[0] == "the" and len(words) > 1 else words[0]
    return prompt_field if first in ("prompt", "messages") else first


def validation_error(errors: Iterable[dict[str, Any]]) -> APIError:
    """One 400 naming the first invalid field, from pydantic/FastAPI validation errors."""
    errors = list(errors)
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = errors[0].get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({detail})".replace(" ()", ""))
    if any(e.get("type") == "model_attributes_type" and tuple(e.get("loc", ())) == ("body",) for e in errors):
        return APIError(400, "the request body must be a JSON object (send it with Content-Type: application/json)")
    messages, params = [], []
    for e in errors:
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        param = _field_path(e.get("loc", ()))
        params.append(param or _leading_field(msg))
        messages.append(f"{param}: {msg}" if param else msg)
    return APIError(400, "; ".join(dict.fromkeys(messages)), param=params[0] if params else None)


def _leading_field(message: str) -> str | None:
    """The field a whole-request check names first (``"n: only one choice ..."`` -> ``"n"``)."""
    head, colon, _ = message.partition(": ")
    return head if colon and head.isidentifier() else None


def _field_path(loc: Iterable[Any]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``. Union branch names
    pydantic adds (``str``, ``list[...]``) are dropped."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_type_tag(str(part)):
            continue
        else:
            path += f".{part}" if path else str(part)
    return path or None


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "dict", "list", "none") or "[" in part or part.startswith(
        ("constrained-", "function-", "literal["))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return validation_error(err.errors()).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if err.status_code == 404 else None
        return APIError(err.status_code, str(err.detail), code=code).response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        return internal_error(err).response(request.url.path)
