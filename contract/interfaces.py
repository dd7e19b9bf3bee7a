"""The contract's three interfaces, as structural Protocols.

Implementations (``backends.memory.MemoryService``, the backend services, the daemon's slot service
and the remote client) do not inherit from these; conformance is checked by mypy
and by the shared suite in ``tests/conformance.py``.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from .manifest import ContextManifest
from .sizing import MemoryPool, ModelFacts
from .types import (
    ActiveModel,
    CacheEntryInfo,
    CacheStatus,
    Config,
    ContextReport,
    DaemonStatus,
    DecodeConfig,
    EmbeddingStatus,
    EmbedInfo,
    EmbedRequest,
    EmbedResult,
    LoadModelRequest,
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    SamplingParams,
    SessionSnapshot,
    SpeculationStatus,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
    TokenCount,
    UnloadModelRequest,
)

if TYPE_CHECKING:  # numpy is an engine dependency, not the contract's: annotations only
    import numpy as np
    from numpy.typing import NDArray


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

    def count_tokens(self, prefix: PrefixInput, suffix: SuffixInput) -> TokenCount:
        """What ``prefix`` then ``suffix`` would leave resident, in tokens, with the window they must fit in.

        Nothing resident changes: a client checks a prompt fits before any prefill.
        """
        ...

    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        """``text`` as the model tokenizes it, special tokens parsed; ``add_special`` leads with the model's BOS
        where the model adds one. Nothing resident changes."""
        ...

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Token ids as text, special tokens as their text; InvalidArgument for an id outside the vocabulary."""
        ...

    def explain_context(self) -> ContextReport: ...

    def snapshot(self) -> SessionSnapshot:
        """Capture the resident state; the bookkeeping fields gate a later restore."""
        ...

    def restore(self, snap: SessionSnapshot) -> None:
        """Replace the resident state from a compatible snapshot (or raise SnapshotRejected)."""
        ...

    def fork(self, at_position: int) -> Session:
        """A new session whose context is this one's first ``at_position`` tokens (this one is untouched).

        The two share the model: the fork's first prefill computes only what it appends, and switching between
        them restores the other's KV instead of prefilling it again. InvalidArgument when ``at_position`` is
        inside the stable prefix or past the context."""
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


class StateCache(Protocol):
    """Where a tape engine keeps the KV states of token prefixes it may need again (the workspace cache).

    Entries are whole ``SessionSnapshot`` s filed under a ``key`` that names
    everything their state bytes are valid for (engine, model, runtime, the
    manifest's identity); within a key the token prefix decides what an entry
    covers. The daemon's implementation is ``modeld.state_cache.StateCacheStore``.
    """

    def lookup(
        self, key: str, tokens: Sequence[int], *, min_len: int, max_tokens: int, count_miss: bool = True
    ) -> tuple[SessionSnapshot, int] | None:
        """The entry under ``key`` sharing the longest token prefix with ``tokens`` (more than ``min_len``).

        Returns the snapshot (verified, state loaded) and that prefix length, or
        None. Entries longer than ``max_tokens`` are not considered. A hit is
        counted, and a miss when ``count_miss`` (a workspace switch that found
        nothing, not a conversation's new turn).
        """
        ...

    def covers(self, key: str, tokens: Sequence[int]) -> bool:
        """Whether an entry under ``key`` already holds ``tokens`` (as the whole or a prefix of its tape)."""
        ...

    def put(self, key: str, snap: SessionSnapshot, conversation: str = "") -> None:
        """Keep ``snap``; entries under ``key`` whose tokens are a prefix of its tokens are dropped (it covers them).

        ``conversation`` names whose state it is (``SuffixInput.conversation``): RAM gives up a conversation's
        older entries before any conversation's newest."""
        ...

    def reject(self, key: str, snap: SessionSnapshot, reason: str) -> None:
        """Drop an entry the engine refused to restore, and count it."""
        ...

    def note_restored(self, tokens: int) -> None:
        """Count tokens a restored entry saved from prefill."""
        ...


class ProgressFn(Protocol):
    def __call__(self, fraction: float) -> None: ...


class LoadedModel(Protocol):
    """A model resident in a backend, with its persistent KV (what the slot holds): one, or one per lane."""

    @property
    def digest(self) -> str: ...

    @property
    def num_ctx(self) -> int: ...

    @property
    def lanes(self) -> int:
        """How many sessions it serves at once, each on a KV of its own (``backends.lanes``): 1 for a local engine,
        whose one KV its sessions take turns in."""
        ...

    def open_session(self, lane: int = 0) -> Session:
        """A session over the KV of ``lane`` (0 .. ``lanes`` - 1); closing it keeps the KV resident. It retires
        the session opened on that lane before it."""
        ...

    def resident_bytes(self) -> int: ...

    #: where its chat template came from (``backends.tape.templates``; "" where prompts are raw text)
    template_origin: str
    #: the tool-call format in use and why (``backends.tape.toolformats``; "" where prompts are raw text)
    tool_format_origin: str
    #: what the model can be asked for (``contract.types.CAPABILITIES``), in that order
    capabilities: list[str]

    def manifest_defaults(self) -> ContextManifest:
        """The runtime identity a client puts in its ContextManifest for this model (no content hashes)."""
        ...

    def sampling_defaults(self) -> SamplingParams:
        """The sampling a request that sets none gets (the model's recommendation, else the documented defaults)."""
        ...

    def speculation(self) -> SpeculationStatus | None:
        """How the model drafts (its check costs, drafts kept so far); None: its engine does not draft."""
        ...

    def idle_pending(self) -> bool:
        """Whether the model has work for an idle slot (measuring its draft costs) that it can do now."""
        ...

    def idle_work(self) -> None:
        """Do that work. The daemon runs it on the model thread while no request waits, inside an
        ``interrupt.interruptible`` scope that the next request's arrival sets; it then stops at its next
        unit of work (``Cancelled``), leaving the model as it found it."""
        ...

    def close(self) -> None:
        """Release the model and its KV; sessions opened on it become closed."""
        ...


class CacheAdmin(Protocol):
    """The daemon's view of the workspace cache: reports, listing, clearing, memory hand-back."""

    def status(self) -> CacheStatus: ...

    def entries(self) -> list[CacheEntryInfo]: ...

    def clear(self) -> int:
        """Drop every entry (RAM and disk); returns how many."""
        ...

    def fit_ram(self, spare_bytes: int) -> None:
        """After a model load: an automatic RAM budget shrinks to what the planner says is spare."""
        ...

    def release_ram(self) -> None:
        """Before a switch or unload: hand RAM back (entries stay on disk when that tier is on)."""
        ...

    def close(self) -> None:
        """Finish pending disk writes (bounded) and stop."""
        ...


class Backend(Protocol):
    """What the daemon's slot service drives; one per daemon (llama, openvino, memory)."""

    @property
    def name(self) -> str: ...

    @property
    def lanes(self) -> int:
        """How many sessions a model it loads serves at once (``LoadedModel.lanes``): the daemon runs as many
        model workers. 1 for a local engine."""
        ...

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

    def close(self) -> None: ...


# --- the embedding side slot ----------------------------------------------------------------


class Embedder(Protocol):
    """The embedding side slot the daemon's slot service sends ``embed`` to (``modeld.embedding_slot``).

    It holds its own small model next to the generation model and never touches
    the generation model or its KV.
    """

    def embed_with_info(self, req: EmbedRequest) -> tuple[EmbedResult, EmbedInfo]: ...

    def status(self) -> EmbeddingStatus:
        """A snapshot for ``DaemonStatus.embedding``; never waits for a running embed."""
        ...

    def resident_bytes(self) -> int:
        """Estimated bytes the loaded embedding model holds (0 when none)."""
        ...

    def maybe_unload_idle(self) -> bool:
        """Unload the model when it has been idle long enough; True if it did."""
        ...

    def close(self) -> None: ...


class EmbeddingModelPlan(Protocol):
    """What the side slot reads of an engine's plan for one embedding model (headers and files only)."""

    @property
    def backend(self) -> str: ...

    @property
    def path(self) -> Path: ...

    @property
    def model_name(self) -> str: ...

    @property
    def digest(self) -> str: ...

    @property
    def window(self) -> int:
        """Max tokens per input, special tokens included."""
        ...

    @property
    def pooling(self) -> str:
        """How token states become one vector: "mean", "cls" or "last"."""
        ...

    @property
    def resident_bytes(self) -> int:
        """Estimate of the loaded model's memory (weights + buffers), offered to the budget check."""
        ...

    @property
    def num_threads(self) -> int: ...

    @property
    def key(self) -> tuple[str, str, int, int]:
        """Two plans with the same key load the same engine (backend, real path, window, threads)."""
        ...


PlanT = TypeVar("PlanT", bound=EmbeddingModelPlan)
PlanT_co = TypeVar("PlanT_co", bound=EmbeddingModelPlan, covariant=True)


class EmbeddingEngine(Protocol[PlanT_co]):
    """One loaded embedding model."""

    @property
    def plan(self) -> PlanT_co: ...

    @property
    def dims(self) -> int: ...

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens each input takes in the model, special tokens included, without truncation."""
        ...

    def embed(self, texts: Sequence[str], counts: Sequence[int]) -> NDArray[np.float32]:
        """Pooled vectors [len(texts), dims] in input order; inputs longer than the window are cut to it.

        ``counts`` is what ``count_tokens`` just returned for the same texts.
        """
        ...

    def close(self) -> None: ...


class EngineFactory(Protocol[PlanT]):
    """What the side slot needs of an engine class: plan a model without loading it, then load it."""

    @property
    def backend(self) -> str: ...

    def default_path(self) -> Path:
        """The model a request without ``path`` gets; FileNotFoundError naming the fix when it is missing."""
        ...

    def plan_for(self, path: Path, config: Config) -> PlanT: ...

    def __call__(self, plan: PlanT) -> EmbeddingEngine[PlanT]: ...
