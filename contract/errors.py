"""Typed errors that cross the modeld boundary.

Every error has a stable numeric wire ``code``. The daemon sends the code, the
message and a ``details`` map; the client looks the code up in ``REGISTRY`` and
re-raises the *same* class the daemon raised. Codes are never renumbered
(``tests/test_errors.py`` pins the table), and a retired code is never given to
another class: ``RETIRED`` keeps it.

Hierarchy::

    ModeldError
    ├── OwnerError                      owner epoch / fencing
    │   ├── (10 retired: NotOwner)
    │   ├── StaleFence            (11)
    │   └── LostOwner             (12)
    ├── SessionError                    a session handle or its state
    │   ├── SessionClosed         (20)
    │   ├── ContextOverflow       (21)
    │   ├── ManifestMismatch      (22)
    │   ├── SnapshotRejected      (23)
    │   └── OffsetDrift           (24)
    ├── SlotError                       the single model slot
    │   ├── ModelBusy             (30)
    │   ├── ModelNotActive        (31)
    │   ├── ModelSwitchRequired   (32)
    │   ├── ModelLoadFailed       (33)
    │   ├── InsufficientMemory    (34)
    │   ├── SlotGenerationStale   (35)
    │   ├── BackendMismatch       (36)
    │   └── ModelNotFound         (37)
    ├── UnsupportedFeature        (40)
    ├── InvalidArgument           (50)
    ├── WireError                       the frames themselves
    │   ├── BadFrame              (60)
    │   ├── UnsupportedProtocolVersion (61)
    │   ├── UnknownOperation      (62)
    │   └── FrameTooLarge         (63)
    ├── Cancelled                 (70)
    ├── Internal                  (80)
    └── Unavailable               (90)
        ├── DaemonTimeout         (91)
        ├── ShuttingDown          (92)
        └── EngineUnresponsive    (93)
"""

from __future__ import annotations

from typing import Any, ClassVar


class ModeldError(Exception):
    """Base of every error modeld raises across the boundary."""

    code: ClassVar[int] = 1
    #: Whether retrying the same request later may succeed without changes.
    recoverable: ClassVar[bool] = False

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message or self.default_message())
        self.message = message or self.default_message()
        self.details: dict[str, Any] = details

    @classmethod
    def default_message(cls) -> str:
        return (cls.__doc__ or cls.__name__).strip().splitlines()[0].rstrip(".")

    def to_wire(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "name": type(self).__name__,
            "message": self.message,
            "recoverable": self.recoverable,
            "details": self.details,
        }

    def __reduce__(self) -> tuple[Any, ...]:  # keep pickling by multiprocessing/pytest sane
        return (_rebuild, (self.code, self.message, self.details))


def _rebuild(code: int, message: str, details: dict[str, Any]) -> ModeldError:
    return from_wire({"code": code, "message": message, "details": details})


# --- owner fencing ---------------------------------------------------------
class OwnerError(ModeldError):
    """The caller does not speak for the daemon's current owner epoch."""


class StaleFence(OwnerError):
    """Stale owner fence token: the fence names another owner; reopen with the current one."""

    code = 11


class LostOwner(OwnerError):
    """A newer owner took the daemon over: this owner's sessions were ended and its fence no longer holds."""

    code = 12


# --- sessions ----------------------------------------------------------------
class SessionError(ModeldError):
    """A session handle or its resident state rejected the call."""


class SessionClosed(SessionError):
    """Session is closed: it was closed, expired, or invalidated by a switch; open a new one."""

    code = 20


class ContextOverflow(SessionError):
    """Exceeded the session context window; nothing was truncated; shorten the input."""

    code = 21


class ManifestMismatch(SessionError):
    """The input's context manifest is not compatible with the resident prefix; call ensure_prefix."""

    code = 22


class SnapshotRejected(SessionError):
    """The snapshot does not match this session (context size, counts, manifest or bytes)."""

    code = 23


class OffsetDrift(SessionError):
    """The offset an append gave is not the session's resident length (nor below it with truncating): the
    client's view of the session drifted; nothing changed. ``details`` has both lengths."""

    code = 24


# --- the slot ----------------------------------------------------------------
class SlotError(ModeldError):
    """The daemon's single model slot cannot serve the request as asked."""


class ModelBusy(SlotError):
    """Modeld active model slot is busy (another session holds it); retry later."""

    code = 30
    recoverable = True


class ModelNotActive(SlotError):
    """Requested model is not active in modeld."""

    code = 31


class ModelSwitchRequired(SlotError):
    """Modeld active model slot must be switched explicitly (load) to serve this model."""

    code = 32


class ModelLoadFailed(SlotError):
    """Modeld failed to load the model; the slot is Failed and can be loaded again."""

    code = 33


class InsufficientMemory(SlotError):
    """Insufficient memory for the requested model at the minimum hot context."""

    code = 34


class SlotGenerationStale(SlotError):
    """Stale modeld slot generation: the slot changed since the caller looked."""

    code = 35


class BackendMismatch(SlotError):
    """Model type not served by this modeld backend."""

    code = 36


class ModelNotFound(SlotError):
    """A model asked for by name that the daemon does not know (not in its store, not bundled); the list says what is."""

    code = 37


# --- features and arguments --------------------------------------------------
class UnsupportedFeature(ModeldError):
    """The backend is healthy but does not implement the requested feature for this model."""

    code = 40


class InvalidArgument(ModeldError):
    """A request field is missing, out of range or of the wrong type."""

    code = 50


# --- the wire ------------------------------------------------------------------
class WireError(ModeldError):
    """The frames of a message could not be accepted."""


class BadFrame(WireError):
    """A frame could not be decoded (malformed msgpack, wrong frame count or shape)."""

    code = 60


class UnsupportedProtocolVersion(WireError):
    """The message names a protocol version this daemon does not speak."""

    code = 61


class UnknownOperation(WireError):
    """The message names an operation this daemon does not know."""

    code = 62


class FrameTooLarge(WireError):
    """A frame exceeds the size limit for its kind."""

    code = 63


# --- lifecycle -----------------------------------------------------------------
class Cancelled(ModeldError):
    """The operation was cancelled by the caller or by shutdown."""

    code = 70


class Internal(ModeldError):
    """An unexpected failure inside the daemon; the daemon keeps serving."""

    code = 80


class Unavailable(ModeldError):
    """The daemon could not be reached or stopped answering; retry when it is back."""

    code = 90
    recoverable = True


class DaemonTimeout(Unavailable):
    """The daemon did not answer within the client's timeout."""

    code = 91


class ShuttingDown(Unavailable):
    """The daemon is shutting down and does not take new work."""

    code = 92


class EngineUnresponsive(Unavailable):
    """The daemon answers but its model worker has made no progress for too long (wedged); waiting is futile."""

    code = 93


def _all_subclasses(cls: type[ModeldError]) -> list[type[ModeldError]]:
    out: list[type[ModeldError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


#: codes no class carries any more, with the name that once did; reserved so an
#: old peer's code never reads as a different error.
RETIRED: dict[int, str] = {
    10: "NotOwner",  # never raised: a second owner takes the daemon over (LostOwner) or holds a stale fence
}

#: wire code -> class; category bases share their parent's code and are not listed.
REGISTRY: dict[int, type[ModeldError]] = {ModeldError.code: ModeldError}
for _cls in _all_subclasses(ModeldError):
    if "code" in _cls.__dict__:
        if _cls.code in REGISTRY or _cls.code in RETIRED:  # pragma: no cover - guarded by tests
            raise RuntimeError(f"duplicate or retired error code {_cls.code}")
        REGISTRY[_cls.code] = _cls


def from_wire(payload: dict[str, Any]) -> ModeldError:
    """Rebuild the exception the daemon raised; unknown and retired codes become ``ModeldError``."""
    code = payload.get("code")
    cls = REGISTRY.get(code, ModeldError) if isinstance(code, int) else ModeldError
    message = payload.get("message")
    details = payload.get("details")
    err = cls(message if isinstance(message, str) else "", **(details if isinstance(details, dict) else {}))
    return err
