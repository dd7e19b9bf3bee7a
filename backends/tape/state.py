"""The framing of an engine's snapshot state bytes, and the checks before a restore may trust them.

Every engine's ``SessionSnapshot.state`` (state_kind "kv") is::

    MAGIC (16 bytes, names the engine and format) | header length (u32 LE) | header (JSON) | body

The header records what the body is only valid for (model digest, KV types,
runtime); ``header_diffs`` compares it with what the live model expects, so a
restore refuses foreign bytes before it touches the KV. No pickle, ever.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import struct
from typing import Any

from contract.errors import SnapshotRejected
from contract.types import SessionSnapshot

MAGIC_BYTES = 16
_LEN = struct.Struct("<I")


def _framing(magic: bytes, header: dict[str, Any]) -> bytes:
    """``magic | header length | header``: what comes before the body."""
    if len(magic) != MAGIC_BYTES:
        raise ValueError(f"a state magic is {MAGIC_BYTES} bytes, got {len(magic)}")
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return magic + _LEN.pack(len(head)) + head


def pack_state(magic: bytes, header: dict[str, Any], body_size: int = 0) -> tuple[bytearray, int]:
    """A buffer for ``magic | header | body``, the framing filled in; returns it and where the body starts."""
    framing = _framing(magic, header)
    out = bytearray(len(framing) + body_size)
    out[: len(framing)] = framing
    return out, len(framing)


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]


#: transparent huge pages where the system has them (Linux): a 45-MB state then costs ~20 page faults, not
#: ~11,000 (a 2k-token save took 13 ms here instead of 37)
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)
_madvise: Any = None
if _MADV_HUGEPAGE is not None:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _huge_pages(address: int, size: int) -> None:
    """Ask for huge pages under the buffer's whole pages (a hint: refused, it is ordinary memory)."""
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (address + size) // mmap.PAGESIZE * mmap.PAGESIZE
    if _madvise is not None and end > start:
        _madvise(start, end - start, _MADV_HUGEPAGE)


def state_buffer(magic: bytes, header: dict[str, Any], body_size: int) -> tuple[bytes, int, int]:
    """A ``bytes`` for ``magic | header | body`` with the framing written and the body left for the engine to
    fill in place; returns it, where the body starts and the address of its first byte.

    A snapshot's state is ``bytes`` (what the cache, the wire and the disk tier take), and a 2k-token state is
    ~45 MB: filling a ``bytearray`` and copying it into ``bytes`` touched 90 MB of fresh pages, ~80 ms of a
    switch on a 2-core VM, where one buffer costs ~40 (~13 on huge pages). So the engine writes into the ``bytes``
    object itself, before anything else holds it (CPython's own C code builds ``bytes`` the same way: allocate,
    then fill).
    """
    framing = _framing(magic, header)
    start = len(framing)
    out: bytes = _new_bytes(None, start + body_size)  # uninitialised: every byte is written below or by the engine
    address = ctypes.cast(ctypes.c_char_p(out), ctypes.c_void_p).value
    assert address is not None  # (a bytes object always has its buffer)
    _huge_pages(address, start + body_size)
    ctypes.memmove(address, framing, start)
    return out, start, address


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
