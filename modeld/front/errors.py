"""Errors as the HTTP APIs spell them: one ``ApiError``, rendered in the shape of the API a route belongs to.

Every error the front can know before a reply starts is an HTTP status with
the API's own error object (for streamed requests too); an error after the
stream started ends it with the API's error event (the protocol modules).
Client errors are 4xx, which the official SDKs do not retry; a busy or
unavailable daemon is 503 with ``Retry-After``, which they do.
"""

from __future__ import annotations

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
                 headers: dict[str, str] | None = None, anthropic_message: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        #: the message in Anthropic's words where they differ from OpenAI's (None: ``message``)
        self.anthropic_message = anthropic_message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @property
    def openai_type(self) -> str:
        """OpenAI's ``error.type`` (each API's protocol builds its error object: ``openai.protocol.error_body``)."""
        return _OPENAI_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    @property
    def anthropic_type(self) -> str:
        """Anthropic's ``error.type``, one of its fixed set (``anthropic.protocol.error_body``)."""
        return _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")

    @property
    def websocket_kind(self) -> tuple[str, bool, str]:
        """The WebSocket protocol's (kind of error, whether the same message may succeed later, what the client
        should do) (``ws.protocol.error_message``)."""
        return _WS_BY_CODE.get(self.code or "") or (
            ("invalid_request", False, "fix_request") if self.status < 500
            else ("unavailable", True, "retry") if self.status == 503 else ("internal_error", False, "report"))


#: the WebSocket protocol's (kind, recoverable, recovery action) of the codes that say more than their status
_WS_BY_CODE: dict[str, tuple[str, bool, str]] = {
    "context_length_exceeded": ("context_length_exceeded", False, "reduce_prompt"),
    "request_too_large": ("invalid_request", False, "reduce_prompt"),
    "invalid_api_key": ("unauthorized", False, "authenticate"),
    "model_not_found": ("model_not_found", False, "load_model"),
    "model_not_loaded": ("model_not_found", False, "load_model"),
    "loading": ("model_loading_error", True, "retry"),
    "DaemonTimeout": ("timeout", True, "retry"),
    "ModelBusy": ("rate_limited", True, "retry"),
    "generation_running": ("invalid_request", True, "wait"),
    "no_generation": ("invalid_request", False, "send_config"),
    "pause_limit": ("timeout", True, "regenerate"),
    "vision_unsupported": ("invalid_request", False, "load_model"),
}


def _overflow(exc: ContextOverflow) -> ApiError:
    """A prompt past the context window, led by the words each API's clients look for: OpenAI's "This model's
    maximum context length is M tokens" (with code ``context_length_exceeded``), Anthropic's "prompt is too
    long: N tokens > M maximum" (the pattern Claude Code matches, reading how far over the prompt is), then the
    daemon's own message. The longest prompt a window takes is one token short of it: the reply needs one."""
    d = exc.details or {}
    window, prompt = d.get("num_ctx"), d.get("prompt_tokens")
    if prompt is None and isinstance(d.get("prefix_tokens"), int):
        prompt = d["prefix_tokens"] + int(d.get("requested_tokens") or 0)
    if not isinstance(window, int) or not isinstance(prompt, int):
        return ApiError(400, exc.message, code="context_length_exceeded", param="messages")
    return ApiError(
        400,
        f"This model's maximum context length is {window} tokens. However, your messages resulted in {prompt} "
        f"tokens: {exc.message}",
        code="context_length_exceeded",
        param="messages",
        anthropic_message=f"prompt is too long: {prompt} tokens > {window - 1} maximum: {exc.message}",
    )


def api_error(exc: ModeldError | ApiError) -> ApiError:
    """A daemon error as the HTTP status a client expects (an ``ApiError`` as it is: a stream that started before
    its turn took the slot meets the front's own refusals as its first event)."""
    if isinstance(exc, ApiError):
        return exc
    details = {k: v for k, v in exc.details.items() if isinstance(v, (str, int, float))} if exc.details else {}
    if isinstance(exc, ContextOverflow):
        return _overflow(exc)
    if isinstance(exc, (InvalidArgument, UnsupportedFeature)):
        param = details.get("field")
        return ApiError(400, exc.message, code=type(exc).__name__, param=str(param) if param else None)
    if isinstance(exc, (ModelNotActive, ModelNotFound)):
        return ApiError(404, exc.message, code="model_not_found", param="model")
    if isinstance(exc, (ModelBusy, DaemonTimeout, Unavailable, ShuttingDown, EngineUnresponsive)):
        return ApiError(503, exc.message, code=type(exc).__name__, headers={"Retry-After": "1"})
    return ApiError(500, f"{type(exc).__name__}: {exc.message}", code=type(exc).__name__)
