"""The contract's reference backend's spec (``SPEC``, listed by ``backends.registry``): ``--backend memory``, no
inference, an entry ``auto`` never picks.

This module stays light: the factory imports the backend (``backends.memory``) when it is called.
"""

from __future__ import annotations

from contract.interfaces import Backend, StateCache
from contract.sizing import OverheadModel

from .engine_spec import BackendSettings, EngineSpec

__all__ = ["SPEC"]


def _memory_backend(cache: StateCache | None, settings: BackendSettings) -> Backend:
    from backends.memory import MemoryBackend

    return MemoryBackend(token_delay_s=settings.memory_token_delay_ms / 1000.0, lanes=settings.sessions or 1)


SPEC = EngineSpec(
    name="memory",
    title="the memory reference backend",
    package="backends",
    extra="server",
    modules=(),
    missing="",
    # no weights and no KV: byte-length token proxies
    overhead=OverheadModel(name="memory", fixed_bytes=0, logits_copies=0.0, compute_rows=0.0, kq_copies=0.0),
    backend=_memory_backend,
    embedder=None,
    auto_rank=None,
    serves_files=False,
    tape=False,
    notice="serving the memory reference backend: no inference, byte-length token proxies",
)
