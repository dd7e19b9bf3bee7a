"""The framing of an engine's snapshot state bytes, and the checks before a restore may trust them.

Every engine's ``SessionSnapshot.state`` (state_kind "kv") is::

    MAGIC (16 bytes, names the engine and format) | header length (u32 LE) | header (JSON) | body

The header records what the body is only valid for (model digest, KV types,
runtime); ``header_diffs`` compares it with what the live model expects, so a
restore refuses foreign bytes before it touches the KV. No pickle, ever.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from contract.errors import SnapshotRejected
from contract.types import SessionSnapshot

MAGIC_BYTES = 16
_LEN = struct.Struct("<I")


def pack_state(magic: bytes, header: dict[str, Any], body_size: int = 0) -> tuple[bytearray, int]:
    """A buffer for ``magic | header | body``, the framing filled in; returns it and where the body starts."""
    if len(magic) != MAGIC_BYTES:
        raise ValueError(f"a state magic is {MAGIC_BYTES} bytes, got {len(magic)}")
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    start = MAGIC_BYTES + _LEN.size + len(head)
    out = bytearray(start + body_size)
    out[:start] = magic + _LEN.pack(len(head)) + head
    return out, start


def frame_state(magic: bytes, header: dict[str, Any], body: bytes) -> bytes:
    """``magic | header | body`` for a body that already exists."""
    out, start = pack_state(magic, header, len(body))
    out[start:] = body
    return bytes(out)


def unpack_state(magic: bytes, state: bytes, what: str) -> tuple[dict[str, Any], memoryview]:
    """The header and a view of the body; SnapshotRejected for anything that is not ``what``."""
    n0 = MAGIC_BYTES
    if state[:n0] != magic or len(state) < n0 + _LEN.size:
        raise SnapshotRejected(f"state bytes are not {what}")
    (hlen,) = _LEN.unpack(state[n0 : n0 + _LEN.size])
    raw = state[n0 + _LEN.size : n0 + _LEN.size + hlen]
    if len(raw) != hlen:
        raise SnapshotRejected("snapshot header is truncated")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise SnapshotRejected("snapshot header is not valid JSON") from exc
    if not isinstance(header, dict):
        raise SnapshotRejected("snapshot header is not a JSON object")
    return header, memoryview(state)[n0 + _LEN.size + hlen :]


def header_diffs(header: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Every expected header field the snapshot disagrees on, as readable lines."""
    return [f"{k}: snapshot {header.get(k)!r} != session {v!r}" for k, v in expected.items() if header.get(k) != v]


def refuse_diffs(header: dict[str, Any], expected: dict[str, Any], why: str) -> None:
    diffs = header_diffs(header, expected)
    if diffs:
        raise SnapshotRejected(f"{why}: " + "; ".join(diffs), problems=diffs)


def check_restorable(snap: SessionSnapshot, backend: str, vocab_size: int) -> None:
    """The engine-independent checks after ``Resident.validate_snapshot``: manifest backend and token ids."""
    if snap.manifest.backend and snap.manifest.backend != backend:
        raise SnapshotRejected(f"snapshot manifest names backend {snap.manifest.backend!r}")
    if any(not 0 <= t < vocab_size for t in snap.resident_token_ids):
        raise SnapshotRejected("snapshot token ids are outside this model's vocabulary")
