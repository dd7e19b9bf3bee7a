"""The contract's three interfaces, as structural Protocols.

Implementations (MemoryService, the backend services, the daemon's slot service
and the remote client) do not inherit from these; conformance is checked by mypy
and by the shared suite in ``tests/conformance.py``.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Protocol

from .manifest import ContextManifest
from .sizing import MemoryPool, ModelFacts
from .types import (
    ActiveModel,
    ContextReport,
    DaemonStatus,
    DecodeConfig,
    EmbedRequest,
    EmbedResult,
    LoadModelRequest,
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    SessionSnapshot,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
    UnloadModelRequest,
)


class Session(Protocol):
    """A persistent inference session; the hot loop is ensure_prefix → prefill_suffix → decode."""

    def ensure_prefix(self, prefix: PrefixInput) -> PrefixStatus:
        """Make the resident KV equal ``prefix``, reusing the longest matching resident prefix.

        Drops any previous suffix and generated tokens.
        """
        ...

    def prefill_suffix(self, suffix: SuffixInput) -> SuffixStatus:
        """Prefill the volatile suffix after the stable prefix; the stable KV stays untouched."""
        ...

    def decode(self, cfg: DecodeConfig) -> Generator[StreamChunk, None, None]:
        """Stream generated text; the last chunk has ``done=True``.

        Closing the iterator early cancels generation within one token.
        """
        ...

    def explain_context(self) -> ContextReport: ...

    def snapshot(self) -> SessionSnapshot:
        """Capture the resident state; the bookkeeping fields gate a later restore."""
        ...

    def restore(self, snap: SessionSnapshot) -> None:
        """Replace the resident state from a compatible snapshot (or raise SnapshotRejected)."""
        ...

    def close(self) -> None: ...


class Service(Protocol):
    """What modeld serves: sessions on the owned hardware, model facts, embeddings."""

    def open_session(self, req: OpenSessionRequest) -> Session: ...

    def describe(self, req: OpenSessionRequest) -> ModelInfo: ...

    def embed(self, req: EmbedRequest) -> EmbedResult: ...


class ModelController(Protocol):
    """Explicit single-slot control: the daemon lifecycle extension of Service."""

    def status(self) -> DaemonStatus: ...

    def load_model(self, req: LoadModelRequest) -> ActiveModel: ...

    def unload_model(self, req: UnloadModelRequest) -> None: ...


class ProgressFn(Protocol):
    def __call__(self, fraction: float) -> None: ...


class LoadedModel(Protocol):
    """A model resident in a backend, with its one persistent KV (what the slot holds)."""

    @property
    def digest(self) -> str: ...

    @property
    def num_ctx(self) -> int: ...

    def open_session(self) -> Session:
        """A session over the model's persistent KV; closing it keeps the KV resident."""
        ...

    def resident_bytes(self) -> int: ...

    def manifest_defaults(self) -> ContextManifest:
        """The runtime identity a client puts in its ContextManifest for this model (no content hashes)."""
        ...

    def close(self) -> None:
        """Release the model and its KV; sessions opened on it become closed."""
        ...


class Backend(Protocol):
    """What the daemon's slot service drives; one per daemon (llama, openvino, memory)."""

    @property
    def name(self) -> str: ...

    def runtime_version(self) -> str: ...

    def load(self, req: OpenSessionRequest, progress: ProgressFn) -> LoadedModel: ...

    def describe(self, req: OpenSessionRequest, credit_bytes: int = 0) -> ModelInfo:
        """ModelInfo for ``req``; ``credit_bytes`` is memory a switch would release. No side effects."""
        ...

    def model_facts(self, req: OpenSessionRequest) -> ModelFacts | None:
        """What the daemon's memory planner needs to size ``req`` (no weights loaded).

        None when the backend has no memory model of its own; then its ``describe`` answers alone.
        """
        ...

    def memory_pools(self) -> Sequence[MemoryPool]:
        """Device memory pools beside host RAM that the planner may place layers in (GPUs); () for none."""
        ...

    def embed(self, req: EmbedRequest) -> EmbedResult: ...

    def close(self) -> None: ...
