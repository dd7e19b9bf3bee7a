"""The request and reply schemas of the wire protocol, one pair per operation.

The contract's own types are the bodies wherever they fit (``load`` takes a
``LoadModelRequest`` and answers an ``ActiveModel``; ``ensure_prefix`` answers a
``PrefixStatus``; a decode streams ``StreamChunk`` s). This module adds only what
the wire needs around them: which session a call is for, the small
acknowledgements, and which field of a message travels as a binary frame after
the msgpack map instead of inside it (``PayloadFrame``).

Types only: nothing here encodes a frame or touches a socket; ``contract.wire``
is the codec that reads these declarations. The table of which schema belongs to
which operation is ``contract.wire.SCHEMAS``.

Requests forbid unknown fields (a misspelt option is an ``InvalidArgument``);
replies ignore them, so an older client can read a newer daemon. This is the
policy of ``contract.types``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    StrictBool,
    StrictBytes,
    StrictStr,
    field_serializer,
    field_validator,
)

from .types import (
    MAX_TEXT_CHARS,
    ActiveModel,
    CacheEntryInfo,
    CacheStatus,
    DecodeConfig,
    EmbedResult,
    PrefixInput,
    ReuseRecord,
    SamplingParams,
    SessionSnapshot,
    SuffixInput,
    TokenId,
)

__all__ = [
    "MAX_DETOKENIZE_TOKENS",
    "BytesFrame",
    "CacheClearReply",
    "CacheClearRequest",
    "CacheListReply",
    "CacheListRequest",
    "CancelReply",
    "CancelRequest",
    "CancelTurnReply",
    "CancelTurnRequest",
    "CloseReply",
    "CountTokensRequest",
    "DecodeRequest",
    "DetokenizeReply",
    "DetokenizeRequest",
    "EmbedReply",
    "EnsurePrefixRequest",
    "F32MatrixFrame",
    "HeartbeatReply",
    "HeartbeatRequest",
    "MetricsReply",
    "MetricsRequest",
    "OpenReply",
    "PayloadFrame",
    "PrefillSuffixRequest",
    "ReadReply",
    "ReadRequest",
    "RestoreRequest",
    "SessionId",
    "SessionRef",
    "SnapshotReply",
    "SnapshotRequest",
    "StatusRequest",
    "TakeoverReply",
    "TakeoverRequest",
    "TokenizeReply",
    "TokenizeRequest",
    "UnloadReply",
    "WHY_KEPT",
    "WhyReply",
    "WhyRequest",
    "payload_frame",
]

_M = TypeVar("_M", bound=BaseModel)

#: how many requests' reuse the daemon keeps for ``why``
WHY_KEPT = 256

#: a session handle as the daemon issued it
SessionId = Annotated[StrictStr, Field(min_length=1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# --- payload frames ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BytesFrame:
    """``field`` (bytes, as they are) travels as the payload frame; ``size_field``, if named, is its length."""

    field: str
    size_field: str = ""
    #: no frame when the field is empty; a missing frame leaves the field at its default
    optional: bool = False


@dataclass(frozen=True)
class F32MatrixFrame:
    """``field`` (list[list[float]]) travels as the payload frame: little-endian float32, row after row,
    ``rows_field`` × ``cols_field`` (fields of the body) in shape. The frame is always sent."""

    field: str
    rows_field: str
    cols_field: str


PayloadFrame = BytesFrame | F32MatrixFrame


def payload_frame(cls: type[BaseModel]) -> PayloadFrame | None:
    """The payload frame a message class declares (its ``payload_frame`` class attribute), if any."""
    spec = getattr(cls, "payload_frame", None)
    return spec if isinstance(spec, BytesFrame | F32MatrixFrame) else None


def _narrow(cls: type[_M], model: BaseModel) -> _M:
    """The ``cls`` part of ``model`` (an instance of a subclass of ``cls``) as a plain ``cls``.

    The values were validated by the very same field definitions, so they are
    taken as they are rather than validated a second time (a prefix may be a
    16 Mi-character text).
    """
    names = cls.model_fields.keys()
    return cls.model_construct(
        _fields_set=model.model_fields_set & names,
        **{name: getattr(model, name) for name in names},
    )


def _scoped(cls: type[_M], session_id: str, inner: BaseModel) -> _M:
    """``inner`` (already validated) with ``session_id`` added, as the session-scoped request ``cls``."""
    return cls.model_construct(
        _fields_set={"session_id", *inner.model_fields_set},
        session_id=session_id,
        **{name: getattr(inner, name) for name in type(inner).model_fields},
    )


# --- requests and replies, in the order of ``wire.Op`` --------------------------------------------
class StatusRequest(_Request):
    """``status`` takes no fields."""


class UnloadReply(_Reply):
    """``unload``: the slot generation after the unload."""

    generation: int = 0


class EmbedReply(EmbedResult):
    """``embed``: the result's header in the body, its vectors as one float32 frame (``count`` × ``dims``)."""

    payload_frame: ClassVar[PayloadFrame] = F32MatrixFrame("vectors", rows_field="count", cols_field="dims")

    count: int = 0
    #: not sent: the client fills it from ``vectors`` for a single-text request
    vector: list[float] = Field(default_factory=list, exclude=True)

    @classmethod
    def of(cls, result: EmbedResult) -> EmbedReply:
        """The reply for a backend's result: one row per input (``vector`` alone is a single row)."""
        vectors = result.vectors or ([result.vector] if result.vector else [])
        return cls(
            vectors=vectors,
            dims=len(vectors[0]) if vectors else 0,
            count=len(vectors),
            model_name=result.model_name,
            digest=result.digest,
            tokens=result.tokens,
            truncated=result.truncated,
        )

    def result(self, *, single: bool) -> EmbedResult:
        """The ``EmbedResult`` a caller sees; ``single``: the request used ``text``, not ``texts``."""
        out = _narrow(EmbedResult, self)
        if single and self.vectors:
            out = out.model_copy(update={"vector": self.vectors[0]})
        return out


class OpenReply(_Reply):
    """``open``: the session handle and what the daemon reports about the model serving it."""

    session_id: str
    generation: int = 0
    num_ctx: int = 0
    #: the model's ``ContextManifest`` identity defaults (field name → value)
    manifest: dict[str, str] = Field(default_factory=dict)
    active: ActiveModel | None = None
    #: the session's lease: a client that sends no heartbeat or request for this long loses it
    lease_s: float = 0.0
    #: what a request that sets no sampling parameter should get on this model (``runtime.Chat`` fills
    #: unset fields from it; the session contract itself decodes greedily when none is set)
    sampling: SamplingParams = Field(default_factory=SamplingParams)


class SessionRef(_Request):
    """``explain``, ``close``: the session a call is for (also the base of every session-scoped request)."""

    session_id: SessionId


class EnsurePrefixRequest(SessionRef, PrefixInput):
    """``ensure_prefix``: a ``PrefixInput`` and the session it is for, flat in one map."""

    @classmethod
    def of(cls, session_id: str, prefix: PrefixInput) -> EnsurePrefixRequest:
        return _scoped(cls, session_id, prefix)

    @property
    def input(self) -> PrefixInput:
        return _narrow(PrefixInput, self)


class PrefillSuffixRequest(SessionRef, SuffixInput):
    """``prefill_suffix``: a ``SuffixInput`` and the session it is for, flat in one map."""

    @classmethod
    def of(cls, session_id: str, suffix: SuffixInput) -> PrefillSuffixRequest:
        return _scoped(cls, session_id, suffix)

    @property
    def input(self) -> SuffixInput:
        return _narrow(SuffixInput, self)


class CountTokensRequest(SessionRef):
    """``count_tokens``: what a prefix and a suffix come to on the session's model; the KV is not touched."""

    prefix: PrefixInput
    suffix: SuffixInput


#: the most token ids one ``detokenize`` takes (a text of the largest size a request carries, at 4 bytes a token)
MAX_DETOKENIZE_TOKENS = MAX_TEXT_CHARS // 4


class ForkRequest(SessionRef):
    """``fork``: a new session whose context is the first ``at_position`` tokens of this one's (which is untouched);
    the reply is the new session's handle, as ``open`` answers."""

    at_position: int = Field(ge=0)


class TokenizeRequest(SessionRef):
    """``tokenize``: ``text`` as the session's model tokenizes it (special tokens such as ``<|im_start|>`` parsed);
    the KV is not touched."""

    text: StrictStr = Field("", max_length=MAX_TEXT_CHARS)
    #: lead with the model's BOS token where the model adds one (llama-server's ``add_special``)
    add_special: StrictBool = False


class TokenizeReply(_Reply):
    """``tokenize``: the token ids."""

    tokens: list[int] = Field(default_factory=list)


class DetokenizeRequest(SessionRef):
    """``detokenize``: token ids as the text they spell, special tokens as their text; an id outside the model's
    vocabulary is an ``InvalidArgument`` naming it."""

    tokens: list[TokenId] = Field(default_factory=list, max_length=MAX_DETOKENIZE_TOKENS)


class DetokenizeReply(_Reply):
    """``detokenize``: the text (bytes that do not end a UTF-8 character become U+FFFD)."""

    text: str = ""


class DecodeRequest(SessionRef, DecodeConfig):
    """``decode``: a ``DecodeConfig`` and the session it is for, flat in one map."""

    #: the client says which frames of the stream its reader took (``read``): the daemon then cancels the decode
    #: once the reader took none of the frames waiting for it for ``wire.UNREAD_STREAM_S``, for a reader that
    #: stopped reading is one that went away, whether or not its cancel reached the daemon (False: a raw client
    #: that reports nothing)
    reads: StrictBool = False

    @classmethod
    def of(cls, session_id: str, cfg: DecodeConfig, *, reads: bool = False) -> DecodeRequest:
        req = _scoped(cls, session_id, cfg)
        if reads:
            req.reads = True
            req.model_fields_set.add("reads")
        return req

    @property
    def input(self) -> DecodeConfig:
        return _narrow(DecodeConfig, self)


class CancelRequest(_Request):
    """``cancel``: the id of a running request of the same client."""

    request_id: StrictBytes


class CancelReply(_Reply):
    """``cancel``: whether a running request was found (it then ends with ``Cancelled``)."""

    cancelled: bool = False


class ReadRequest(_Request):
    """``read``: the reader of stream ``request_id`` (a decode of the same client sent with ``reads``) has taken its
    first ``frames`` data frames. The daemon does not answer it: a reader sends one whenever it took frames and is
    about to wait for more."""

    request_id: StrictBytes
    frames: int = Field(ge=0)


class ReadReply(_Reply):
    """``read``: never sent (the schema table names a reply for every operation)."""


class CancelTurnRequest(_Request):
    """``cancel_turn``: end the turn that holds the slot (``modeld cancel``): its running operation is cancelled
    and its session released. ``session_id``: that session's turn instead ("": the holder's). Fenced by the
    owner, as load and unload are."""

    owner_instance_id: str = ""
    session_id: StrictStr = ""


class CancelTurnReply(_Reply):
    """``cancel_turn``: the session whose turn was ended ("" when no session held the slot) and who ran it."""

    session_id: str = ""
    client: str = ""


class SnapshotRequest(SessionRef):
    """``snapshot``; ``include_state``: also send the state bytes (a frame), not only their ``state_id``."""

    include_state: StrictBool = False


class SnapshotReply(SessionSnapshot):
    """``snapshot``: the snapshot's bookkeeping, the ``state_id`` of its blob in the daemon's store and
    ``state_bytes``; the state itself follows as a frame only when the request asked for it."""

    payload_frame: ClassVar[PayloadFrame] = BytesFrame("state", size_field="state_bytes", optional=True)

    state_bytes: int = Field(0, ge=0)

    @classmethod
    def of(cls, snap: SessionSnapshot, *, state_id: str, include_state: bool) -> SnapshotReply:
        fields = {name: getattr(snap, name) for name in SessionSnapshot.model_fields}
        fields.update(state_id=state_id, state_bytes=len(snap.state), state=snap.state if include_state else b"")
        return cls.model_construct(_fields_set=set(fields), **fields)

    def snapshot(self) -> SessionSnapshot:
        """The ``SessionSnapshot`` a caller sees (``state`` empty unless it was sent)."""
        return _narrow(SessionSnapshot, self)


class RestoreRequest(SessionRef):
    """``restore``: a snapshot without its state; the state follows as a frame, or the daemon reads
    the blob ``snapshot.state_id`` names."""

    payload_frame: ClassVar[PayloadFrame] = BytesFrame("state", optional=True)

    snapshot: SessionSnapshot
    #: the state bytes (the frame); None: restore from ``snapshot.state_id``
    state: bytes | None = None

    @classmethod
    def of(cls, session_id: str, snap: SessionSnapshot) -> RestoreRequest:
        return cls(session_id=session_id, snapshot=snap.model_copy(update={"state": b""}), state=snap.state or None)

    @field_validator("snapshot", mode="before")
    @classmethod
    def _state_is_a_frame(cls, v: Any) -> Any:
        # state bytes inside the map are never read: they come as the frame or from the blob store
        if isinstance(v, dict):
            return {k: x for k, x in v.items() if k not in ("state", "state_bytes")}
        return v

    @field_serializer("snapshot")
    def _without_state(self, snap: SessionSnapshot, info: SerializationInfo) -> dict[str, Any]:
        return snap.model_dump(mode=info.mode, exclude={"state"})


class CloseReply(_Reply):
    """``close``: whether the session was open (closing is idempotent)."""

    closed: bool = False


class HeartbeatRequest(_Request):
    """``heartbeat``: renew the leases of these sessions."""

    session_ids: list[StrictStr] = Field(default_factory=list)


class HeartbeatReply(_Reply):
    """``heartbeat``: the sessions whose lease was renewed (the others are gone)."""

    alive: list[str] = Field(default_factory=list)


class WhyRequest(_Request):
    """``why``: the last ``last`` requests' reuse (the daemon keeps ``WHY_KEPT``)."""

    last: int = Field(default=20, ge=1, le=WHY_KEPT)


class WhyReply(_Reply):
    """``why``: the last requests' prompts, oldest first: how much was reused, and where and why it stopped."""

    requests: list[ReuseRecord] = Field(default_factory=list)


class CacheListRequest(_Request):
    """``cache_list`` takes no fields."""


class CacheListReply(_Reply):
    """``cache_list``: the workspace cache's entries, most recently used first, and its status (None: off)."""

    entries: list[CacheEntryInfo] = Field(default_factory=list)
    cache: CacheStatus | None = None


class CacheClearRequest(_Request):
    """``cache_clear``: drop every workspace cache entry (RAM and disk); fenced like load/unload."""

    owner_instance_id: str = ""


class CacheClearReply(_Reply):
    """``cache_clear``: how many entries were dropped."""

    cleared: int = 0


class MetricsRequest(_Request):
    """``metrics`` takes no fields."""


class MetricsReply(_Reply):
    """``metrics``: the daemon's metrics in the Prometheus text format."""

    text: str = ""


class TakeoverRequest(_Request):
    """``takeover``: become the daemon's owner; ``epoch`` must be higher than the current owner's."""

    owner_instance_id: str = Field(min_length=1)
    epoch: int = Field(ge=1)


class TakeoverReply(_Reply):
    """``takeover``: the new owner's fingerprint and epoch, and whether a session of the old owner was ended."""

    owner: str = ""
    epoch: int = 0
    ended_session: bool = False
