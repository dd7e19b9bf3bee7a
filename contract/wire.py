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
  slow daemon from a dead one.

Large binary payloads (KV snapshot bytes, embedding vectors as little-endian
float32) travel as separate frames, never inside the msgpack map. msgpack
extension types are refused (no pickle, ever) and every decode is size-limited.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from .errors import BadFrame, FrameTooLarge, InvalidArgument, ModeldError, UnknownOperation, UnsupportedProtocolVersion

PROTOCOL = b"MDP1"
PROTOCOL_VERSION = 1

MAX_REQUEST_ID_BYTES = 64
MAX_OP_BYTES = 32
MAX_BODY_BYTES = 64 * 1024 * 1024  # a 16 Mi-character prompt fits with room to spare
MAX_PAYLOAD_BYTES = 2 * 1024 * 1024 * 1024 - 1  # snapshot state of a large context
MAX_PAYLOAD_FRAMES = 4
#: what the daemon's socket accepts for a whole message part (ZMQ_MAXMSGSIZE)
MAX_MESSAGE_PART_BYTES = MAX_PAYLOAD_BYTES

HEARTBEAT_INTERVAL_S = 1.0

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


class Kind(str, enum.Enum):
    OK = "ok"
    DATA = "data"
    END = "end"
    ERROR = "error"
    HEARTBEAT = "hb"


_OPS = {op.value.encode(): op for op in Op}
_KINDS = {k.value.encode(): k for k in Kind}


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


def encode_request(op: Op, request_id: bytes, body: dict[str, Any], payloads: list[bytes] | None = None) -> list[bytes]:
    return [PROTOCOL, op.value.encode(), request_id, pack(body), *(payloads or [])]


def decode_request(frames: list[bytes]) -> Message:
    op_frame, rid = _check_common(frames)
    op = _OPS.get(bytes(op_frame)) if len(op_frame) <= MAX_OP_BYTES else None
    if op is None:
        raise UnknownOperation(f"unknown operation {bytes(op_frame[:MAX_OP_BYTES])!r}", known=sorted(o.value for o in Op))
    return Message(request_id=bytes(rid), body=unpack(frames[3]), payloads=[bytes(p) for p in frames[4:]], op=op)


def encode_reply(kind: Kind, request_id: bytes, body: dict[str, Any] | None = None, payloads: list[bytes] | None = None) -> list[bytes]:
    return [PROTOCOL, kind.value.encode(), request_id, pack(body or {}), *(payloads or [])]


def encode_error(request_id: bytes, err: ModeldError) -> list[bytes]:
    return encode_reply(Kind.ERROR, request_id, err.to_wire())


def decode_reply(frames: list[bytes]) -> Message:
    kind_frame, rid = _check_common(frames)
    kind = _KINDS.get(bytes(kind_frame))
    if kind is None:
        raise BadFrame(f"unknown reply kind {bytes(kind_frame[:16])!r}")
    return Message(request_id=bytes(rid), body=unpack(frames[3]), payloads=[bytes(p) for p in frames[4:]], kind=kind)


def to_body(model: Any, *, exclude: set[str] | None = None) -> dict[str, Any]:
    """A pydantic model as a msgpack-ready map (enums as values, bytes fields excluded by caller)."""
    return model.model_dump(mode="json", exclude=exclude)  # type: ignore[no-any-return]


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
