"""Errors as the HTTP APIs spell them: one ``ApiError``, rendered in the shape of the API a route belongs to.

Every error the front can know before a reply starts is an HTTP status with
the API's own error object (for streamed requests too); an error after the
stream started ends it with the API's error event (the protocol modules).
Client errors are 4xx, which the official SDKs do not retry; a busy or
unavailable daemon is 503 with ``Retry-After``, which they do.
"""

from __future__ import annotations

from typing import Any

from contract.errors import (
    ContextOverflow,
    DaemonTimeout,
    EngineUnresponsive,
    InvalidArgument,
    ModelBusy,
    ModeldError,
    ModelNotActive,
    ModelNotFound,
    ShuttingDown,
    Unavailable,
    UnsupportedFeature,
)

__all__ = ["ApiError", "api_error"]

#: OpenAI's ``error.type`` by status (Anthropic's names are mapped in ``ApiError.anthropic``)
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


class ApiError(Exception):
    """A request the front answers with an HTTP error: status, message, machine code, the field at fault."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def openai(self) -> dict[str, Any]:
        """OpenAI's error object."""
        kind = _OPENAI_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic(self) -> dict[str, Any]:
        """Anthropic's error object."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def api_error(exc: ModeldError) -> ApiError:
    """A daemon error as the HTTP status a client expects."""
    details = {k: v for k, v in exc.details.items() if isinstance(v, (str, int, float))} if exc.details else {}
    if isinstance(exc, ContextOverflow):
        return ApiError(400, exc.message, code="context_length_exceeded", param="messages")
    if isinstance(exc, (InvalidArgument, UnsupportedFeature)):
        param = details.get("field")
        return ApiError(400, exc.message, code=type(exc).__name__, param=str(param) if param else None)
    if isinstance(exc, (ModelNotActive, ModelNotFound)):
        return ApiError(404, exc.message, code="model_not_found", param="model")
    if isinstance(exc, (ModelBusy, DaemonTimeout, Unavailable, ShuttingDown, EngineUnresponsive)):
        return ApiError(503, exc.message, code=type(exc).__name__, headers={"Retry-After": "1"})
    return ApiError(500, f"{type(exc).__name__}: {exc.message}", code=type(exc).__name__)
