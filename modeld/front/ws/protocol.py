"""The WebSocket protocol's messages (``GET /v1/ws``): JSON objects told apart by ``type``.

The client sends ``config`` (a generation: a raw ``prompt`` or chat ``messages``,
sampling ``parameters``, ``options``), ``control`` (``stop``, ``pause``, ``resume``,
``regenerate``, ``modify``), ``feedback``, and, where the API key is not in the
``Authorization`` header, ``auth`` first. The server sends ``init``, ``token``,
``completion``, ``status`` and ``error``. Their JSON Schema (``schemas``) is
published at ``/v1/ws/schema``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from contract.types import DecodeConfig, TokenLogprob, ToolCall

from ..core import PromptTool, decode_options
from ..errors import ApiError

__all__ = [
    "ACTIONS",
    "CLIENT_MESSAGE",
    "SERVER_MESSAGE",
    "Auth",
    "ClientMessage",
    "Completion",
    "Config",
    "Control",
    "ErrorMessage",
    "Feedback",
    "Init",
    "ModelInfo",
    "Options",
    "Parameters",
    "ServerMessage",
    "Status",
    "Timing",
    "Token",
    "TokenTiming",
    "Usage",
    "schemas",
]

#: what ``control`` can ask
ACTIONS = ("stop", "pause", "resume", "regenerate", "modify")


class _In(BaseModel):
    """A client message: unknown fields are refused (a misspelt option is an error, not a silent default)."""

    model_config = ConfigDict(extra="forbid")


def _decode_field(name: str) -> Any:
    """``DecodeConfig``'s field ``name``, its bounds and its default (None), for a parameter both name: one
    declaration of each bound."""
    return DecodeConfig.model_fields[name]


class Parameters(_In):
    """Sampling and limits; in ``control``/``modify`` only the ones to change."""

    max_tokens: int | None = _decode_field("max_tokens")
    temperature: float | None = _decode_field("temperature")
    top_p: float | None = _decode_field("top_p")
    top_k: int | None = _decode_field("top_k")
    min_p: float | None = _decode_field("min_p")
    #: the seed's name for llama.cpp's repeat penalty
    repetition_penalty: float | None = _decode_field("repeat_penalty")
    frequency_penalty: float | None = _decode_field("frequency_penalty")
    presence_penalty: float | None = _decode_field("presence_penalty")
    seed: int | None = _decode_field("seed")
    stop: list[str] | str | None = None

    def decode(self) -> DecodeConfig:
        """The ``DecodeConfig`` fields these set (``core.decode_options``)."""
        out = decode_options(**self.model_dump(exclude_none=True, exclude={"repetition_penalty", "stop"}))
        if self.repetition_penalty is not None:
            out.repeat_penalty = self.repetition_penalty
        if self.stop is not None:
            out.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return out


class Options(_In):
    """What the server sends beside the text."""

    #: token messages as the reply is written; false: only the ``completion``
    stream: bool = True
    #: ``completion.generated_text`` starts with the prompt (a raw ``prompt`` only)
    echo_prompt: bool = False
    include_token_ids: bool = False
    #: the sampled token's log probability (true) and this many alternatives (a number, up to 20)
    include_logprobs: bool | Annotated[int, Field(ge=0, le=20)] = False
    include_timing: bool = False


class Auth(_In):
    """The API key, as the first message, for a client that cannot set the ``Authorization`` header."""

    type: Literal["auth"]
    api_key: str


class Config(_In):
    """A generation: exactly one of ``prompt`` (raw text, continued without a template) and ``messages``
    (chat messages in OpenAI's shape, rendered with the model's template; ``tools`` as OpenAI's)."""

    type: Literal["config"]
    model: str = ""
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[PromptTool] = Field(default_factory=list)
    parameters: Parameters = Field(default_factory=Parameters)
    options: Options = Field(default_factory=Options)
    #: the key, when this first message carries it (instead of ``auth`` or the header)
    api_key: str | None = None


class Control(_In):
    """Steer the running generation: ``parameters`` with ``modify``."""

    type: Literal["control"]
    action: Literal["stop", "pause", "resume", "regenerate", "modify"]
    parameters: Parameters | None = None


class Feedback(_In):
    """A rating of a generation (the last one unless ``request_id`` names another)."""

    type: Literal["feedback"]
    rating: float = Field(ge=-1.0, le=1.0)
    text: str = Field("", max_length=10_000)
    position: int | None = Field(None, ge=0)
    request_id: str = ""


ClientMessage = Annotated[Auth | Config | Control | Feedback, Field(discriminator="type")]
CLIENT_MESSAGE: TypeAdapter[Auth | Config | Control | Feedback] = TypeAdapter(ClientMessage)


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelInfo(_Out):
    """The loaded model that serves the generation (empty when another model is to be loaded for it)."""

    context_window: int | None = None
    digest: str | None = None
    backend: str | None = None


class Init(_Out):
    """A generation was accepted: its id, the model, the context window, what the daemon can do."""

    type: Literal["init"] = "init"
    request_id: str
    model: str
    model_info: ModelInfo = Field(default_factory=ModelInfo)
    capabilities: list[str] = Field(default_factory=list)


class TokenTiming(_Out):
    """``include_timing``: since the token before, and since the generation was accepted."""

    token_ms: float
    total_ms: float


class Timing(_Out):
    """``include_timing``: a generation's times (``prefill_ms``: the daemon's own prefill)."""

    first_token_ms: float | None = None
    prefill_ms: float | None = None
    total_ms: float | None = None


class Token(_Out):
    """A piece of the reply: its text (``thinking``: reasoning text), the tokens it came from and where the first
    sits in the context."""

    type: Literal["token"] = "token"
    request_id: str
    token: str = ""
    thinking: str = ""
    position: int
    token_id: int | None = None
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None
    timing: TokenTiming | None = None
    finish_reason: None = None
    finished: Literal[False] = False


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    #: of the prompt: already resident or restored (``cached``: by the workspace cache), and computed
    cached_tokens: int = 0
    prefilled_tokens: int = 0


class Completion(_Out):
    """The generation ended: the whole text, why, tokens and times."""

    type: Literal["completion"] = "completion"
    request_id: str
    generated_text: str
    thinking: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    #: "stop", "length", "tool_calls", or "cancelled" (``stop``, ``regenerate``)
    finish_reason: str
    finished: Literal[True] = True
    usage: Usage
    timing: Timing | None = None


class Status(_Out):
    """Where a generation is: ``queued``, ``prefill`` (``progress`` in percent, tokens done of total),
    ``paused``, ``resumed``, ``modified`` (the parameters from ``position`` on), ``feedback`` (recorded)."""

    type: Literal["status"] = "status"
    request_id: str = ""
    operation: str
    message: str = ""
    progress: int | None = None
    tokens_done: int | None = None
    tokens_total: int | None = None
    position: int | None = None
    waiting: int | None = None
    parameters: dict[str, Any] | None = None


class ErrorMessage(_Out):
    """A refusal or a failure: ``error`` (the protocol's kind), modeld's ``code``, whether the same message may
    succeed later (``recoverable``) and what to do (``recovery_action``)."""

    type: Literal["error"] = "error"
    error: str
    code: str = ""
    message: str
    recoverable: bool
    recovery_action: str = ""
    retry_after_ms: int | None = None
    request_id: str = ""


def error_message(err: ApiError, request_id: str = "") -> ErrorMessage:
    """``err`` as the protocol's error message: its kind of error, whether the same message may succeed later, and
    what the client should do (``retry_after_ms`` with a retry)."""
    kind, recoverable, action = err.websocket_kind
    retry = err.headers.get("Retry-After")
    return ErrorMessage(error=kind, code=err.code or "", message=err.message, recoverable=recoverable,
                        recovery_action=action, request_id=request_id,
                        retry_after_ms=int(float(retry) * 1000) if recoverable and retry else None)


ServerMessage = Annotated[Init | Token | Completion | Status | ErrorMessage, Field(discriminator="type")]
SERVER_MESSAGE: TypeAdapter[Init | Token | Completion | Status | ErrorMessage] = TypeAdapter(ServerMessage)


def schemas() -> dict[str, Any]:
    """The messages' JSON Schema: what a client sends, what the server sends."""
    return {"client": CLIENT_MESSAGE.json_schema(), "server": SERVER_MESSAGE.json_schema()}
