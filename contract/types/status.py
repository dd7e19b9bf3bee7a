"""What the daemon reports of itself: the slot, the active model, the running turn, caches, progress."""

from __future__ import annotations

import enum
import hashlib

from pydantic import Field

# pydantic validates a TypedDict from typing_extensions on Python < 3.12 (pydantic itself depends on it)
from typing_extensions import TypedDict

from ._base import _Report
from .decode import SamplingParams
from .load import Config, DeviceInfo

__all__ = ["ActiveModel", "BlobStatus", "CacheEntryInfo", "CacheStatus", "DaemonStatus", "EmbeddingStatus", "Heartbeat", "ModelsStatus", "Progress", "RunningTurn", "SlotState", "SpeculationStatus", "owner_fingerprint"]


class SlotState(str, enum.Enum):
    """Lifecycle of the daemon's single model slot."""

    EMPTY = "Empty"  # no model resident
    LOADING = "Loading"  # a load is in progress
    READY = "Ready"  # a model is resident and no session holds it
    BUSY = "Busy"  # a session holds the slot
    SWITCHING = "Switching"  # the resident model is being replaced by another
    UNLOADING = "Unloading"  # the resident model is being released
    FAILED = "Failed"  # the last load failed; a new load may be attempted
    SHUTTING_DOWN = "ShuttingDown"  # the daemon is stopping


class EmbeddingStatus(TypedDict):
    """The embedding side slot in ``DaemonStatus.embedding`` (a plain map on the wire)."""

    backend: str
    loaded: bool
    model_name: str
    path: str
    digest: str
    dims: int
    window: int
    pooling: str
    resident_bytes: int
    #: wall-clock time of the last use (seconds since the epoch), None before the first
    last_used: float | None
    idle_s: float | None
    idle_unload_s: float
    loads: int
    embedded_inputs: int
    last_error: str


class BlobStatus(TypedDict):
    """The snapshot blob store in ``DaemonStatus.blobs`` (a plain map on the wire)."""

    blobs: int
    bytes: int
    max_bytes: int
    max_age_s: float
    #: blobs pruned (over the budget or the age limit) since the daemon started
    pruned: int


class ModelsStatus(TypedDict):
    """The model store in ``DaemonStatus.models`` (a plain map on the wire)."""

    #: the store's directory, its models and their bytes
    dir: str
    models: int
    bytes: int
    #: every name a request may give (stored models, the bundled one, the preloaded one, aliases)
    names: list[str]
    #: alias → the stored model it names
    aliases: dict[str, str]


class ActiveModel(_Report):
    model_name: str = ""
    type: str = ""
    digest: str = ""
    path: str = ""
    config: Config = Field(default_factory=Config)
    generation: int = 0
    effective_context: int = 0
    resident_bytes: int = 0
    #: where the chat template came from ("the model's own", "built-in chatml", "file …", "ChatML (…has none)")
    chat_template: str = ""
    #: the tool-call format in use and why ("hermes (detected from the template)", "mistral (asked for)")
    tool_format: str = ""
    #: when the load finished, Unix time in seconds (0: the daemon did not say)
    loaded_at: float = 0.0
    #: what the model can be asked for (``CAPABILITIES``), read from the model and its template at its load
    capabilities: list[str] = Field(default_factory=lambda: ["text"])
    #: layers on the GPU, of ``n_layer``, and why (``modeld.capacity.GPU_REASONS``; "" when nothing planned them)
    gpu_layers: int = 0
    n_layer: int = 0
    gpu_layers_reason: str = ""


class SpeculationStatus(_Report):
    """How the loaded model speculates (``DaemonStatus.speculation``; docs/speculation.md)."""

    #: greedy decodes draft unless a request says otherwise (``modeld serve --speculative``)
    enabled: bool = False
    #: the check costs were measured on this machine (kept from an earlier load, or timed while the slot was
    #: idle after this one; until then drafts are priced by a prior)
    measured: bool = False
    #: no table is kept for this model and machine yet: the model worker times the checks while the slot is
    #: idle with nothing resident, and a request that arrives stops it (no busy operation: it waits for none)
    pending: bool = False
    #: what a check of 2, 4, 8 and 16 rows costs after a short context, in one-token steps (keys: rows,
    #: as text, a map key msgpack and JSON both take)
    check_costs: dict[str, float] = Field(default_factory=dict)
    #: the steps a 16-row check adds per 1,000 tokens of context
    check_growth_per_1k: float = 0.0
    #: draft tokens checked, and those the sampled output kept, since the model loaded
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: the engine computes a token's row the same alone, in a check or in a prefill (sampled passes then
    #: draft by default too), and what the load measured of it ("" where nothing was probed: OpenVINO's
    #: exact decode pads steps to a prefill's kernels; llama.cpp probes the layout that can be exact)
    rows_exact: bool = False
    rows_probe: str = ""


class CacheStatus(TypedDict):
    """The workspace cache in ``DaemonStatus.cache`` (a plain map on the wire)."""

    #: the RAM tier: entries, bytes held, budget (0 = off)
    ram_entries: int
    ram_bytes: int
    ram_budget_bytes: int
    #: the disk tier: entries, bytes on disk, budget (0 = off), directory
    disk_entries: int
    disk_bytes: int
    disk_budget_bytes: int
    disk_dir: str
    #: bytes written to the disk tier since the daemon started
    disk_written_bytes: int
    #: requests whose resident tape fell short and that asked the cache: restored / not
    hits: int
    misses: int
    hit_rate: float | None
    #: tokens restored instead of prefilled, since start
    restored_tokens: int
    saves: int
    evictions: int
    #: entries refused on load (corrupt, foreign or refused by the engine) and dropped
    rejected: int
    last_rejection: str


class CacheEntryInfo(_Report):
    """One workspace cache entry, as ``modeld cache ls`` lists it."""

    id: str = ""
    model_digest: str = ""
    backend: str = ""
    tokens: int = 0
    prefix_tokens: int = 0
    bytes: int = 0
    #: "ram", "disk" or "ram+disk"
    where: str = ""
    #: wall-clock time of the last use (seconds since the epoch)
    last_used: float = 0.0
    #: the conversation whose state it is (``SuffixInput.conversation``; "" when not named, or a stable prefix)
    conversation: str = ""


def owner_fingerprint(owner: str) -> str:
    """What status shows of an owner id: a short hash a client can compare with its own, never the id itself."""
    if not owner:
        return ""
    return "fp:" + hashlib.sha256(owner.encode()).hexdigest()[:16]


class ReadoutInfo(_Report):
    """The readout manifest the daemon serves (``serve --readouts FILE``; ``backends.readouts``)."""

    concepts: list[str] = Field(default_factory=list)
    #: the layers whose outputs are read, ascending (0 = the first)
    layers: list[int] = Field(default_factory=list)
    hidden_size: int = 0
    #: sha256 of the manifest file
    digest: str = ""


class RunningTurn(_Report):
    """The turn that holds the slot (``DaemonStatus.turn``): whose it is, how old, and how far it came, so a person
    can see what holds the slot (``modeld cancel`` ends it)."""

    session_id: str = ""
    #: who opened it (``OpenSessionRequest.client``): the API and the client's address; "" when it did not say
    client: str = ""
    #: seconds since its session opened
    age_s: float = 0.0
    #: "prefill" (its prompt is being computed), "decode" (its reply is being written), "idle" (it holds the slot
    #: between operations: its client runs none)
    phase: str = ""
    #: the operation running ("" while idle), and seconds since it started
    operation: str = ""
    operation_s: float = 0.0
    #: a prefill: the context's tokens it holds now, of the ``total`` the prompt needs (it held ``reused`` when the
    #: prefill began: those were resident already); a decode: the reply's tokens so far
    done: int = 0
    total: int = 0
    reused: int = 0


class DaemonStatus(_Report):
    #: the owner's fingerprint (``owner_fingerprint``), "" when the daemon has no owner
    owner_instance_id: str = ""
    #: the owner epoch: a ``takeover`` needs a higher one
    owner_epoch: int = 0
    backend: str = ""
    #: why this backend serves ("auto: ..." when the daemon picked it)
    backend_reason: str = ""
    backend_version: str = ""
    protocol_version: int = 0
    state: SlotState = SlotState.EMPTY
    active: ActiveModel | None = None
    generation: int = 0
    busy_operation: str = ""
    #: the turn that holds the slot (None: none does)
    turn: RunningTurn | None = None
    #: on a model of several lanes (``session_lanes`` > 1): every open session's turn, ``turn`` first
    turns: list[RunningTurn] = Field(default_factory=list)
    last_error: str = ""
    load_progress: float | None = None
    session_open: bool = False
    #: sessions open now: the one that holds the slot, its forks, and on a model of several lanes the sessions on
    #: the other lanes
    sessions_open: int = 0
    #: how many sessions the loaded model serves at once (``serve --sessions`` on an engine that batches; 1 for a
    #: local engine, whose sessions take turns in one KV)
    session_lanes: int = 1
    #: sessions waiting for the slot (opens queued behind the one that holds it)
    waiting: int = 0
    #: the daemon's process id, and seconds since it started
    pid: int = 0
    uptime_s: float = 0.0
    endpoint: str = ""
    #: the embedding side slot; None when the daemon has none
    embedding: EmbeddingStatus | None = None
    #: the workspace cache; None when it is off
    cache: CacheStatus | None = None
    #: the readout manifest the daemon serves (None: ``--readouts`` not given)
    readouts: ReadoutInfo | None = None
    #: the snapshot blob store
    blobs: BlobStatus | None = None
    #: the model store (``modeld pull``); None when the daemon has none
    models: ModelsStatus | None = None
    #: seconds the loaded model has had no session and no operation (None: no model, or a session holds it)
    idle_s: float | None = None
    #: the model is unloaded after this long idle (0 = never)
    idle_unload_s: float = 0.0
    #: a session with no operation (heartbeats aside) for this long is released (0 = never)
    session_ttl_s: float = 0.0
    #: seconds the model worker has been on one request without progress (None: under a second, or idle)
    worker_stalled_s: float | None = None
    #: the worker passed the daemon's wedge time: waiting requests get EngineUnresponsive
    wedged: bool = False
    #: how the loaded model speculates; None: no model, or its engine does not draft
    speculation: SpeculationStatus | None = None
    #: what a request that sets no sampling parameter gets on the loaded model (None: no model)
    sampling: SamplingParams | None = None
    #: the GPUs this machine has (the device inventory; empty: none found), with memory free now
    devices: list[DeviceInfo] = Field(default_factory=list)
    #: the engine can offload layers to them (its build has a GPU backend)
    gpu_offload: bool = False
    #: what the engine was built with (llama.cpp's system info: CPU features, CUDA/Metal/Vulkan)
    build: str = ""


class Progress(_Report):
    """How far the request the daemon is running has come (a heartbeat carries it)."""

    #: "load" (the model is loading) or "prefill" (prompt tokens are being computed)
    stage: str = ""
    #: the share done, 0..1
    fraction: float = Field(0.0, ge=0.0, le=1.0)
    #: prefill only: tokens computed so far, and how many the request needs (0 for a load)
    done: int = Field(0, ge=0)
    total: int = Field(0, ge=0)


class Heartbeat(_Report):
    """The body of a heartbeat (``hb``) reply: empty, or the running request's progress."""

    progress: Progress | None = None
