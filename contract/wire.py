"""The modeld wire protocol: versioned multipart ZeroMQ messages with msgpack bodies.

Client → daemon (a DEALER talking to the daemon's ROUTER)::

    [b"MDP1", op, request_id, body(msgpack map), *payload frames]

Daemon → client::

    [b"MDP1", kind, request_id, body(msgpack map), *payload frames]

``op`` and ``kind`` are tiny raw frames, so the daemon routes and rejects a
message without decoding its body. ``kind`` is one of:

* ``ok``    – the single reply of a unary request;
* ``data``  – one element of a stream (0..N of them);
* ``end``   – the successful end of a stream (exactly one, or an ``error``);
* ``error`` – the terminal error of a request or stream (body: code, name,
  message, recoverable, details);
* ``hb``    – a heartbeat while a long request runs, so the client can tell a
  slow daemon from a dead one; its body is empty, or carries the running
  request's progress (``types.Heartbeat``, read with ``heartbeat_progress``).

Large binary payloads (KV snapshot bytes, embedding vectors as little-endian
float32) travel as separate frames, never inside the msgpack map. msgpack
extension types are refused (no pickle, ever) and every decode is size-limited.

Two layers, both here: the envelope (``encode_request`` / ``decode_request``,
``encode_reply`` / ``decode_reply``: frames ↔ ``Message``) and the schemas
(``encode_body`` / ``decode_body``: a typed message ↔ its map and payload frames,
as ``contract.messages`` declares them; ``SCHEMAS`` says which schema each
operation takes and answers). The daemon and the client build and read every
body through them; neither packs a frame by hand.

Over ~400 lines on purpose: the frame layout, the codec and the table of operations and their
schemas change together (a new operation is a line here and a handler), and each needs the others.
"""

from __future__ import annotations

import enum
import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from .errors import (
    BadFrame,
    FrameTooLarge,
    InvalidArgument,
    ModeldError,
    UnknownOperation,
    UnsupportedProtocolVersion,
    from_wire,
)
from .messages import (
    BytesFrame,
    CacheClearReply,
    CacheClearRequest,
    CacheListReply,
    CacheListRequest,
    CancelReply,
    CancelRequest,
    CancelTurnReply,
    CancelTurnRequest,
    CloseReply,
    CountTokensRequest,
    DecodeRequest,
    DetokenizeReply,
    DetokenizeRequest,
    EmbedReply,
    EnsurePrefixRequest,
    F32MatrixFrame,
    ForkRequest,
    HeartbeatReply,
    HeartbeatRequest,
    MetricsReply,
    MetricsRequest,
    OpenReply,
    PrefillSuffixRequest,
    ReadReply,
    ReadRequest,
    RestoreRequest,
    SessionRef,
    SnapshotReply,
    SnapshotRequest,
    StatusRequest,
    TakeoverReply,
    TakeoverRequest,
    TokenizeReply,
    TokenizeRequest,
    UnloadReply,
    WhyReply,
    WhyRequest,
    payload_frame,
)
from .types import (
    ActiveModel,
    ContextReport,
    DaemonStatus,
    EmbedRequest,
    Heartbeat,
    LoadModelRequest,
    ModelInfo,
    OpenSessionRequest,
    PrefixStatus,
    Progress,
    StreamChunk,
    SuffixStatus,
    TokenCount,
    UnloadModelRequest,
)

PROTOCOL = b"MDP1"
PROTOCOL_VERSION = 1

MAX_REQUEST_ID_BYTES = 64
MAX_OP_BYTES = 32
MAX_BODY_BYTES = 64 * 1024 * 1024  # a 16 Mi-character prompt fits with room to spare
#: the body of an operation that carries no prompt text (status, load, open, close, …)
MAX_SMALL_BODY_BYTES = 1024 * 1024
MAX_PAYLOAD_BYTES = 2 * 1024 * 1024 * 1024 - 1  # snapshot state of a large context
MAX_PAYLOAD_FRAMES = 4
#: what the daemon's socket accepts for a whole message part (ZMQ_MAXMSGSIZE)
MAX_MESSAGE_PART_BYTES = MAX_PAYLOAD_BYTES

HEARTBEAT_INTERVAL_S = 1.0
#: a decode whose client reports its reads (``DecodeRequest.reads``) is cancelled by the daemon once its reader has
#: taken none of the frames waiting for it this long: nobody is reading it (the route that read it went away, and
#: its cancel with it); a slow reader that keeps taking frames is reading
UNREAD_STREAM_S = 2.0

#: A runtime Client names its sockets ``CLIENT_ID_PREFIX + <24 random hex> + b"/" + role``
#: (``/m`` requests, ``/h`` lease heartbeats). The daemon binds a session to the peer that
#: opened it (``peer_key``), so both sockets of that client may use it and nobody else.
CLIENT_ID_PREFIX = b"rt-"


def peer_key(identity: bytes) -> bytes:
    """The client a ROUTER identity belongs to: a runtime Client's sockets share one; any other peer is its own."""
    if identity.startswith(CLIENT_ID_PREFIX) and b"/" in identity:
        return identity.rsplit(b"/", 1)[0]
    return identity

_M = TypeVar("_M", bound=BaseModel)


class Op(str, enum.Enum):
    """Operations a client may send; the value is the raw op frame."""

    STATUS = "status"
    LOAD = "load"
    UNLOAD = "unload"
    DESCRIBE = "describe"
    EMBED = "embed"
    OPEN = "open"
    ENSURE_PREFIX = "ensure_prefix"
    PREFILL_SUFFIX = "prefill_suffix"
    DECODE = "decode"
    CANCEL = "cancel"
    EXPLAIN = "explain"
    SNAPSHOT = "snapshot"
    RESTORE = "restore"
    CLOSE = "close"
    HEARTBEAT = "heartbeat"
    CACHE_LIST = "cache_list"
    CACHE_CLEAR = "cache_clear"
    METRICS = "metrics"
    TAKEOVER = "takeover"
    COUNT_TOKENS = "count_tokens"
    WHY = "why"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    FORK = "fork"
    #: a stream's reader reports the frames it took (never answered: ``ReadRequest``)
    READ = "read"
    CANCEL_TURN = "cancel_turn"


class Kind(str, enum.Enum):
    """Kinds of reply; the value is the raw kind frame."""

    OK = "ok"  # the single reply of a unary request
    DATA = "data"  # one element of a stream
    END = "end"  # the successful end of a stream
    ERROR = "error"  # the terminal error of a request or stream
    HEARTBEAT = "hb"  # the daemon is still working on the request

    @property
    def terminal(self) -> bool:
        """Whether this reply is the last one of its request."""
        return self in (Kind.OK, Kind.END, Kind.ERROR)


_OPS = {op.value.encode(): op for op in Op}
_KINDS = {k.value.encode(): k for k in Kind}


@dataclass(frozen=True)
class OpSchema:
    """The typed bodies of one operation."""

    request: type[BaseModel]
    #: the body of the ``ok`` reply, or of every ``data``/``end`` element when ``stream``
    reply: type[BaseModel]
    stream: bool = False


#: operation -> the schema the daemon decodes its request with and answers it in
SCHEMAS: dict[Op, OpSchema] = {
    Op.STATUS: OpSchema(StatusRequest, DaemonStatus),
    Op.LOAD: OpSchema(LoadModelRequest, ActiveModel),
    Op.UNLOAD: OpSchema(UnloadModelRequest, UnloadReply),
    Op.DESCRIBE: OpSchema(OpenSessionRequest, ModelInfo),
    Op.EMBED: OpSchema(EmbedRequest, EmbedReply),
    Op.OPEN: OpSchema(OpenSessionRequest, OpenReply),
    Op.ENSURE_PREFIX: OpSchema(EnsurePrefixRequest, PrefixStatus),
    Op.PREFILL_SUFFIX: OpSchema(PrefillSuffixRequest, SuffixStatus),
    Op.DECODE: OpSchema(DecodeRequest, StreamChunk, stream=True),
    Op.CANCEL: OpSchema(CancelRequest, CancelReply),
    Op.EXPLAIN: OpSchema(SessionRef, ContextReport),
    Op.SNAPSHOT: OpSchema(SnapshotRequest, SnapshotReply),
    Op.RESTORE: OpSchema(RestoreRequest, ContextReport),
    Op.CLOSE: OpSchema(SessionRef, CloseReply),
    Op.HEARTBEAT: OpSchema(HeartbeatRequest, HeartbeatReply),
    Op.CACHE_LIST: OpSchema(CacheListRequest, CacheListReply),
    Op.CACHE_CLEAR: OpSchema(CacheClearRequest, CacheClearReply),
    Op.METRICS: OpSchema(MetricsRequest, MetricsReply),
    Op.TAKEOVER: OpSchema(TakeoverRequest, TakeoverReply),
    Op.COUNT_TOKENS: OpSchema(CountTokensRequest, TokenCount),
    Op.TOKENIZE: OpSchema(TokenizeRequest, TokenizeReply),
    Op.DETOKENIZE: OpSchema(DetokenizeRequest, DetokenizeReply),
    Op.WHY: OpSchema(WhyRequest, WhyReply),
    Op.FORK: OpSchema(ForkRequest, OpenReply),
    Op.READ: OpSchema(ReadRequest, ReadReply),
    Op.CANCEL_TURN: OpSchema(CancelTurnRequest, CancelTurnReply),
}


@dataclass
class Message:
    """A decoded request (``op`` set) or reply (``kind`` set)."""

    request_id: bytes
    body: dict[str, Any]
    payloads: list[bytes] = field(default_factory=list)
    op: Op | None = None
    kind: Kind | None = None


def _ext_refused(code: int, data: bytes) -> Any:
    raise BadFrame(f"msgpack extension type {code} is not accepted")


def pack(body: dict[str, Any]) -> bytes:
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_BODY_BYTES:
        raise FrameTooLarge(f"body of {len(data)} bytes exceeds {MAX_BODY_BYTES}", limit=MAX_BODY_BYTES)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_ext_refused,
            timestamp=0,
        )
    except ModeldError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise BadFrame(f"body is not valid msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise BadFrame(f"body must be a msgpack map, got {type(obj).__name__}")
    return obj


def _check_common(frames: list[bytes]) -> tuple[bytes, bytes]:
    if len(frames) < 4:
        raise BadFrame(f"expected at least 4 frames, got {len(frames)}")
    if frames[0] != PROTOCOL:
        raise UnsupportedProtocolVersion(
            f"protocol frame {frames[0][:16]!r} is not {PROTOCOL!r}",
            supported=PROTOCOL.decode(),
        )
    rid = frames[2]
    if len(rid) > MAX_REQUEST_ID_BYTES:
        raise BadFrame(f"request id of {len(rid)} bytes exceeds {MAX_REQUEST_ID_BYTES}")
    if len(frames) - 4 > MAX_PAYLOAD_FRAMES:
        raise BadFrame(f"{len(frames) - 4} payload frames exceed {MAX_PAYLOAD_FRAMES}")
    for p in frames[4:]:
        if len(p) > MAX_PAYLOAD_BYTES:
            raise FrameTooLarge(f"payload of {len(p)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    return frames[1], rid


def request_id_of(frames: list[bytes]) -> bytes:
    """Best-effort request id of a message that failed to decode (for the error reply)."""
    if len(frames) >= 3 and len(frames[2]) <= MAX_REQUEST_ID_BYTES:
        return bytes(frames[2])
    return b""


def encode_request(
    op: Op, request_id: bytes, body: BaseModel | dict[str, Any], payloads: list[bytes] | None = None
) -> list[bytes]:
    """A request's frames: a typed ``body`` with the payload frames it declares, or a raw map and ``payloads``."""
    if isinstance(body, BaseModel):
        body, own = encode_body(body)
        payloads = [*own, *(payloads or [])]
    return [PROTOCOL, op.value.encode(), request_id, pack(body), *(payloads or [])]


def decode_request(frames: list[bytes]) -> Message:
    """A request's frames as a Message; each operation's own limits are checked before its body is parsed.

    An operation that carries no prompt text takes a body of at most
    ``MAX_SMALL_BODY_BYTES``, and one that declares no payload frame takes none.
    """
    op_frame, rid = _check_common(frames)
    op = _OPS.get(bytes(op_frame)) if len(op_frame) <= MAX_OP_BYTES else None
    if op is None:
        raise UnknownOperation(f"unknown operation {bytes(op_frame[:MAX_OP_BYTES])!r}", known=sorted(o.value for o in Op))
    limit = body_limit(op)
    if len(frames[3]) > limit:
        raise FrameTooLarge(f"a {op.value} body of {len(frames[3])} bytes exceeds {limit}", limit=limit, op=op.value)
    allowed = 0 if payload_frame(SCHEMAS[op].request) is None else 1
    if len(frames) - 4 > allowed:
        raise BadFrame(f"{op.value} takes {allowed} payload frame(s), got {len(frames) - 4}", op=op.value)
    return Message(request_id=bytes(rid), body=unpack(frames[3]), payloads=[bytes(p) for p in frames[4:]], op=op)


#: operations whose body carries prompt text, tools, a grammar, texts to embed or token ids
_TEXT_OPS = frozenset({Op.ENSURE_PREFIX, Op.PREFILL_SUFFIX, Op.DECODE, Op.EMBED, Op.COUNT_TOKENS, Op.TOKENIZE,
                       Op.DETOKENIZE})


def body_limit(op: Op) -> int:
    """The largest body ``op`` accepts."""
    return MAX_BODY_BYTES if op in _TEXT_OPS else MAX_SMALL_BODY_BYTES


def _reply_frames(kind: Kind, request_id: bytes, body: dict[str, Any], payloads: list[bytes]) -> list[bytes]:
    return [PROTOCOL, kind.value.encode(), request_id, pack(body), *payloads]


def encode_reply(kind: Kind, request_id: bytes, body: BaseModel | None = None) -> list[bytes]:
    """A reply's frames: the typed ``body`` (none for a heartbeat) and the payload frames it declares."""
    if body is None:
        return _reply_frames(kind, request_id, {}, [])
    return _reply_frames(kind, request_id, *encode_body(body))


def encode_chunk(request_id: bytes, chunk: StreamChunk) -> list[bytes]:
    """A decode stream element: ``data`` while it runs, ``end`` for the final (``done``) chunk.

    Usage is only reported by the final chunk, so a ``data`` body leaves it out.
    """
    if chunk.done:
        return encode_reply(Kind.END, request_id, chunk)
    return _reply_frames(Kind.DATA, request_id, to_body(chunk, exclude={"usage"}), [])


def encode_error(request_id: bytes, err: ModeldError) -> list[bytes]:
    return _reply_frames(Kind.ERROR, request_id, err.to_wire(), [])


def error_of(msg: Message) -> ModeldError:
    """The exception an ``error`` reply carries: the same class the daemon raised."""
    return from_wire(msg.body)


def heartbeat_progress(msg: Message) -> Progress | None:
    """The progress a heartbeat carries; None for an empty body (older daemons send one) or one that does not parse.

    A heartbeat only keeps a request alive, so a body this client cannot read
    costs the caller its progress display, never the request.
    """
    if not msg.body:
        return None
    try:
        return Heartbeat.model_validate(msg.body).progress
    except ValidationError:
        return None


def reply_kind(frames: Sequence[bytes]) -> Kind | None:
    """The kind of an encoded reply, read from its kind frame without decoding the body."""
    return _KINDS.get(bytes(frames[1])) if len(frames) > 1 else None


def decode_reply(frames: list[bytes]) -> Message:
    kind_frame, rid = _check_common(frames)
    kind = _KINDS.get(bytes(kind_frame))
    if kind is None:
        raise BadFrame(f"unknown reply kind {bytes(kind_frame[:16])!r}")
    return Message(request_id=bytes(rid), body=unpack(frames[3]), payloads=[bytes(p) for p in frames[4:]], kind=kind)


@functools.cache
def _bytes_fields(cls: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, f in cls.model_fields.items() if f.annotation in (bytes, bytes | None))


def to_body(model: BaseModel, *, exclude: set[str] | None = None) -> dict[str, Any]:
    """A pydantic model as a msgpack-ready map: enums as values, top-level bytes fields as msgpack bin.

    JSON mode would turn bytes into text (and fail on bytes that are not UTF-8),
    so those fields are taken as they are.
    """
    skip = set(exclude or ())
    body: dict[str, Any] = model.model_dump(mode="json", exclude=skip | _bytes_fields(type(model)))
    for name in _bytes_fields(type(model)) - skip:
        body[name] = getattr(model, name)
    return body


def encode_body(msg: BaseModel) -> tuple[dict[str, Any], list[bytes]]:
    """A typed message as its map and payload frames (the field its class declares as a frame)."""
    spec = payload_frame(type(msg))
    if spec is None:
        return to_body(msg), []
    body = to_body(msg, exclude={spec.field})
    value = getattr(msg, spec.field)
    if isinstance(spec, F32MatrixFrame):
        frame = encode_f32_matrix(value)
        expected = _F32.size * body[spec.rows_field] * body[spec.cols_field]
    else:
        if spec.optional and not value:
            return body, []
        frame = encode_bytes_frame(value)
        expected = body[spec.size_field] if spec.size_field else len(frame)
    if len(frame) != expected:
        raise ValueError(f"{type(msg).__name__}: a {len(frame)}-byte {spec.field} frame does not match the body's {expected}")
    return body, [frame]


def decode_body(cls: type[_M], msg: Message) -> _M:
    """A message's map and payload frames as ``cls``.

    A bad field is an ``InvalidArgument`` naming it; payload frames that do not
    fit the schema (missing, extra, the wrong size, or the field sent inside
    the map) are a ``BadFrame``.
    """
    spec = payload_frame(cls)
    allowed = 0 if spec is None else 1
    if len(msg.payloads) > allowed:
        raise BadFrame(f"{cls.__name__} takes {allowed} payload frame(s), got {len(msg.payloads)}")
    if spec is None:
        return parse(cls, msg.body)
    if spec.field in msg.body:
        raise BadFrame(f"{cls.__name__}.{spec.field} travels as a payload frame, not in the body")
    header = parse(cls, msg.body)
    if not msg.payloads:
        if isinstance(spec, BytesFrame) and spec.optional:
            return header
        raise BadFrame(f"{cls.__name__} needs its {spec.field} payload frame")
    frame = msg.payloads[0]
    value: Any
    if isinstance(spec, F32MatrixFrame):
        value = decode_f32_matrix(frame, count=getattr(header, spec.rows_field), dims=getattr(header, spec.cols_field))
    else:
        value = decode_bytes_frame(frame, size=getattr(header, spec.size_field) if spec.size_field else None)
    return header.model_copy(update={spec.field: value})


# --- payload frames ------------------------------------------------------------------------------------
_F32 = struct.Struct("<f")


def encode_f32_matrix(rows: Sequence[Sequence[float]]) -> bytes:
    """``rows`` (all the same length) as little-endian float32, row after row."""
    dims = len(rows[0]) if rows else 0
    if any(len(r) != dims for r in rows):
        raise ValueError(f"a float32 matrix needs rows of one length, got {sorted({len(r) for r in rows})}")
    n = dims * len(rows)
    if n * _F32.size > MAX_PAYLOAD_BYTES:
        raise FrameTooLarge(f"{len(rows)}x{dims} float32 values exceed {MAX_PAYLOAD_BYTES} bytes", limit=MAX_PAYLOAD_BYTES)
    return struct.pack(f"<{n}f", *(x for r in rows for x in r))


def decode_f32_matrix(data: bytes, *, dims: int, count: int) -> list[list[float]]:
    """``count`` rows of ``dims`` float32 values from a frame; a frame of another size is a ``BadFrame``."""
    if dims < 0 or count < 0:
        raise BadFrame(f"a float32 matrix of {count}x{dims} is not a shape")
    if len(data) != _F32.size * dims * count:
        raise BadFrame(f"a float32 frame of {len(data)} bytes does not hold {count}x{dims} values")
    flat = struct.unpack(f"<{dims * count}f", data)
    return [list(flat[i * dims : (i + 1) * dims]) for i in range(count)]


def encode_bytes_frame(data: bytes) -> bytes:
    """Raw bytes as a payload frame (sent as they are, no copy)."""
    if len(data) > MAX_PAYLOAD_BYTES:
        raise FrameTooLarge(f"payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}", limit=MAX_PAYLOAD_BYTES)
    return data


def decode_bytes_frame(data: bytes, *, size: int | None = None) -> bytes:
    """A raw bytes frame; when ``size`` is given, a frame of another length is a ``BadFrame``."""
    if size is not None and len(data) != size:
        raise BadFrame(f"a payload frame of {len(data)} bytes where the body says {size}")
    return bytes(data)


def parse(model_cls: type[_M], body: dict[str, Any]) -> _M:
    """Validate a body into ``model_cls``; a bad field is an ``InvalidArgument`` naming it."""
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in e.get('loc', ())) or '<body>'}: {e.get('msg', '')}"
            for e in exc.errors(include_url=False, include_input=False)
        ]
        raise InvalidArgument(f"invalid {model_cls.__name__}: " + "; ".join(problems), problems=problems) from None
