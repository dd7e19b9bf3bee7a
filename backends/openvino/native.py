"""OpenVINO at the boundary: its version, and the one place its exceptions become contract errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import openvino as ov

from contract.errors import InsufficientMemory, Internal, InvalidArgument, ModeldError, ModelLoadFailed

from .prepare import ConversionError

__all__ = ["map_errors", "runtime_version", "type_name"]


def runtime_version() -> str:
    return str(ov.get_version())


def _ov_message(exc: BaseException) -> str:
    """OpenVINO's text without its "Exception from src/...cpp:N:" location lines."""
    lines = [ln.strip() for ln in str(exc).splitlines()]
    kept = [ln for ln in lines if ln and not ln.startswith("Exception from ")]
    text = " | ".join(kept) or type(exc).__name__
    return text if len(text) <= 600 else text[:600] + "…"


@contextlib.contextmanager
def map_errors(action: str, *, loading: bool = False) -> Iterator[None]:
    """Translate OpenVINO / GenAI / OS exceptions into modeld errors, most specific first.

    Typed errors pass through. While ``loading`` every failure is ModelLoadFailed
    with the cause; afterwards a template failure is the caller's input, an
    allocation failure is memory, and anything else is Internal.
    """
    try:
        yield
    except ModeldError:
        raise
    except MemoryError as exc:
        raise InsufficientMemory(f"{action}: out of memory") from exc
    except ConversionError as exc:
        raise ModelLoadFailed(f"{action}: {exc}") from exc
    except OSError as exc:
        msg = f"{action}: {type(exc).__name__}: {exc}"
        raise (ModelLoadFailed(msg) if loading else Internal(msg)) from exc
    except RuntimeError as exc:
        text = _ov_message(exc)
        msg = f"{action}: {text}"
        if loading:
            raise ModelLoadFailed(msg) from exc
        if "chat template" in text.lower() or "minja" in text.lower():
            raise InvalidArgument(f"{action}: the model's chat template failed: {text}") from exc
        if "bad_alloc" in text or "out of memory" in text.lower():
            raise InsufficientMemory(msg) from exc
        raise Internal(msg) from exc
    except (ValueError, TypeError) as exc:
        msg = f"{action}: {type(exc).__name__}: {exc}"
        raise (ModelLoadFailed(msg) if loading else InvalidArgument(msg)) from exc



def type_name(value: Any) -> str:
    return value.get_type_name() if isinstance(value, ov.Type) else str(value)
