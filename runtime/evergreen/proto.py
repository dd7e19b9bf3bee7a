"""The Evergreen messages and service stub, generated from ``evergreen.proto`` with ``grpc_tools.protoc``.

The generated modules are not kept in the source tree: they are built from the ``.proto`` beside this file the
first time they are asked for, into the user's cache (``$XDG_CACHE_HOME/modeld/evergreen-<digest>``, keyed by the
``.proto``'s and the protobuf library's versions, so an edit or an upgrade builds them again), and imported from
there. Needs the ``grpc`` extra (``grpcio``, ``grpcio-tools``).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

__all__ = ["PROTO", "load"]

PROTO = Path(__file__).with_name("evergreen.proto")
_lock = threading.Lock()
_loaded: tuple[ModuleType, ModuleType] | None = None


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "modeld"


def load() -> tuple[ModuleType, ModuleType]:
    """``(evergreen_pb2, evergreen_pb2_grpc)``, built on first use."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        from google.protobuf import __version__ as protobuf_version  # type: ignore[import-untyped]
        from grpc_tools import protoc  # type: ignore[import-untyped]

        source = PROTO.read_bytes()
        key = hashlib.sha256(source + protobuf_version.encode()).hexdigest()[:16]
        out = _cache_root() / f"evergreen-{key}"
        if not (out / "evergreen_pb2_grpc.py").exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            # built in a directory of its own, then renamed into place: two processes building at once each finish
            # their own, and the first rename wins
            build = Path(tempfile.mkdtemp(prefix="evergreen-", dir=out.parent))
            includes = Path(protoc.__file__).parent / "_proto"
            rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO.parent}", f"-I{includes}", f"--python_out={build}",
                              f"--grpc_python_out={build}", str(PROTO)])
            if rc != 0:
                raise RuntimeError(f"protoc could not build {PROTO} (exit {rc})")
            try:
                build.rename(out)
            except OSError:
                pass  # another process put its build there first
        if str(out) not in sys.path:
            sys.path.insert(0, str(out))
        _loaded = (importlib.import_module("evergreen_pb2"), importlib.import_module("evergreen_pb2_grpc"))
        return _loaded
