"""The contract's value types, as pydantic models.

Names are snake_case; on the wire (msgpack) every field uses its name. Request types forbid unknown fields so
a misspelt option is an ``InvalidArgument`` rather than silently ignored; report
types ignore unknown fields so an older client can read a newer daemon.

Over the house's ~400 lines on purpose: this is the contract's whole vocabulary, every value a
client and the daemon exchange. Split by topic, the parts would import each other's field types back,
and the wire's schema table and the exports test read it as one list.
"""

from __future__ import annotations

import base64
import enum
import functools
import hashlib
import time
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBytes,
    StringConstraints,
    field_serializer,
    field_validator,
    model_validator,
)

# pydantic validates a TypedDict from typing_extensions on Python < 3.12 (pydantic itself depends on it)
from typing_extensions import TypedDict

from .errors import InvalidArgument
from .manifest import ContextManifest

__all__ = [
    "CAPABILITIES",
    "ActiveModel",
    "BlobStatus",
    "CacheEntryInfo",
    "CacheStatus",
    "ChatMessage",
    "Config",
    "ContextManifest",
    "ContextReport",
    "DaemonStatus",
    "DecodeConfig",
    "Delta",
    "DeviceInfo",
    "EmbedRequest",
    "EmbedInfo",
    "EmbedResult",
    "EmbeddingStatus",
    "EngineOption",
    "EngineOptionValue",
    "DEFAULT_SAMPLING",
    "ErrorInfo",
    "GPU_LAYERS_ALL",
    "GPU_LAYERS_AUTO",
    "Fence",
    "LoadModelRequest",
    "Heartbeat",
    "ImageInput",
    "ModelInfo",
    "ModelsStatus",
    "OpenSessionRequest",
    "PositionRange",
    "PrefixInput",
    "PrefixStatus",
    "Progress",
    "RunningTurn",
    "SamplingParams",
    "SessionSnapshot",
    "SlotState",
    "SpeculationStatus",
    "StreamChunk",
    "StructuredOutputConfig",
    "SuffixInput",
    "SuffixStatus",
    "TokenCount",
    "ToolCall",
    "ToolCallDelta",
    "TokenId",
    "TokenLogprob",
    "TopLogprob",
    "ToolCallFunction",
    "UnloadModelRequest",
    "Usage",
    "format_gpu_layers",
    "owner_fingerprint",
    "parse_gpu_layers",
]

KVCacheType = Literal["", "f16", "f32", "q8_0", "q4_0"]
#: the types a flag or setting can name ("" is the backend's default, given by leaving it unset)
KV_CACHE_TYPES: tuple[str, ...] = tuple(t for t in get_args(KVCacheType) if t)
#: the quantized ones: llama.cpp needs flash attention for them, and the OpenVINO backend does not offer them
QUANTIZED_KV_CACHE_TYPES = ("q8_0", "q4_0")
MAX_TEXT_CHARS = 16 * 1024 * 1024
#: ``DecodeConfig.logprobs``: the most alternatives a step reports (OpenAI's ``top_logprobs`` limit)
MAX_TOP_LOGPROBS = 20
#: the largest image a message or an append carries, encoded (the HTTP front's ``--max-image-bytes`` is lower)
MAX_IMAGE_BYTES = 64 * 1024 * 1024
#: the most images one suffix carries
MAX_SUFFIX_IMAGES = 256
#: a token id a client sends: the engines' ids are 32-bit (one past a model's vocabulary is refused by the model,
#: naming it; one past this is refused at the edge, before it reaches an encoder that cannot hold it)
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
#: ``Config.options``: an engine option's value (the engine's options model checks and converts it)
EngineOptionValue = str | int | float | bool
#: ``Config.options``: at most this many
MAX_ENGINE_OPTIONS = 32
#: ``Config.options``: an option's name, letters, digits and "_", at most 64 of them
EngineOptionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_]{1,64}$")]

#: ``Config.num_gpu_layers``: every layer on the GPU, refused when they do not all fit
GPU_LAYERS_ALL = -1
#: ``Config.num_gpu_layers``: as many layers as fit on the GPU (all when they do), the rest on the host
GPU_LAYERS_AUTO = -2
_GPU_LAYER_WORDS = {"auto": GPU_LAYERS_AUTO, "all": GPU_LAYERS_ALL}


def parse_gpu_layers(value: str | int) -> int:
    """``--gpu-layers``: "auto" (as many as fit), "all" (every layer, or refuse), or a count >= 0 (0: CPU only).

    A count beyond the model's layers is clamped to them, as llama-server does with ``-ngl 999``.
    An int (from Python, or a TOML number) may also be ``Config.num_gpu_layers``' -2 (auto) or -1 (all);
    text is a word or digits only, so a flag's "-3" or "abc" is refused. Raises ValueError, quoting the value, on anything else (a negative count, a word it does not know).
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid GPU layer count {value!r}: expected auto, all or a whole number >= 0")
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _GPU_LAYER_WORDS:
            return _GPU_LAYER_WORDS[word]
        if not (word.isascii() and word.isdigit()):  # "-3", "abc", "1.5", "": no sign, point or blank
            raise ValueError(f"invalid GPU layer count {value!r}: expected auto, all or a whole number >= 0")
        return int(word)
    if isinstance(value, int) and value >= GPU_LAYERS_AUTO:  # from Python or TOML: Config's encoding (-2, -1, N)
        return value
    raise ValueError(f"invalid GPU layer count {value!r}: expected auto, all or a whole number >= 0")


def format_gpu_layers(n: int) -> str:
    """``parse_gpu_layers`` backwards: "auto", "all" or the count."""
    return {GPU_LAYERS_AUTO: "auto", GPU_LAYERS_ALL: "all"}.get(n, str(n))


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Report(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


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


class Config(_Request):
    """Explicit hardware/runtime configuration for a session; every knob is tested."""

    num_ctx: int = Field(0, ge=0, description="context window in tokens; 0 = daemon decides")
    num_batch: int = Field(0, ge=0, description="prefill batch size; 0 = backend default")
    num_threads: int = Field(0, ge=0, description="CPU threads; 0 = the CPUs this process may run on (its affinity mask)")
    num_gpu_layers: int = Field(
        0,
        ge=GPU_LAYERS_AUTO,
        description="layers offloaded to the GPU; 0 = none, -1 = all (refused when they do not fit), "
        "-2 = as many as fit (a count beyond the model's layers is clamped to them)",
    )
    tensor_split: list[float] = Field(default_factory=list)
    flash_attn: bool = False
    kv_cache_type: KVCacheType = ""
    prompt_format: str = ""
    prompt_template_digest: str = ""
    #: the chat template to serve with: a built-in name ("chatml", "llama3", …), a Jinja file on the daemon's
    #: machine, or "" for the model's own (when its file has none: by its vocabulary's turn tokens, else ChatML)
    chat_template: str = ""
    #: the tool-call format replies are parsed and calls forced in ("hermes", "llama3_json", "mistral", …);
    #: "" detects it from the chat template (Hermes for a template that does not render tools itself)
    tool_format: str = ""
    disable_bos: bool = False
    reasoning_format: str = ""
    #: recompute tokens the model decoded before reusing them in a later prompt, so a
    #: warm turn answers bit for bit like a cold one (default: reuse them, as every
    #: serving engine does; decode-step KV differs slightly from a batched prefill's)
    exact_reuse: bool = False
    #: compute every decoded token as a prefill computes it, so a token's logits are the same
    #: alone, in a draft's check or in any prefill: drafts (sampled ones too) and reused replies
    #: never change an answer. OpenVINO pads each decode step to a prefill's kernels (a step
    #: costs more as the context grows) and computes in f32 over an f32 cache unless the load names
    #: a cache type or precision; llama.cpp can be exact with flash_attn over a q8_0/q4_0
    #: cache, refuses the setting without that layout, and refuses a model whose load probe finds
    #: its rows apart on this CPU (some quantizations' batch kernels round apart from one-row ones)
    exact_decode: bool = False
    #: what only the loading engine offers, by name (an extension): its registry entry declares the
    #: options it takes (``describe`` lists them), and a load with one it does not take is refused
    options: dict[EngineOptionName, EngineOptionValue] = Field(default_factory=dict, max_length=MAX_ENGINE_OPTIONS)


class Fence(_Request):
    """The owner identity a client expects to be serving it (a freshness check)."""

    owner_instance_id: str = ""


class _ModelHandle(_Request):
    owner_instance_id: str = ""
    model_name: str = ""
    type: str = Field("", description="backend type the model targets: one of the daemon's backends (status's backend)")
    digest: str = ""
    path: str = ""
    config: Config = Field(default_factory=Config)

    @property
    def fence(self) -> Fence:
        return Fence(owner_instance_id=self.owner_instance_id)


class OpenSessionRequest(_ModelHandle):
    """Ask the owner to open a session for a model (ModelName+Type+Digest is identity)."""

    #: while another session holds the slot, wait up to this long for it, in arrival
    #: order with other waiting opens, before answering ModelBusy (0: answer at once)
    queue_timeout_s: float = Field(0.0, ge=0.0, le=3600.0)
    #: when the slot holds another model: load this one in its place (after the holder's session ends, like
    #: any open), instead of answering ModelSwitchRequired; a name without a path is looked up in the daemon's
    #: store. A failed load keeps the working model.
    switch: bool = False
    #: who opens it, as ``status`` shows the turn that holds the slot (``RunningTurn.client``): the API and the
    #: address it came from (the HTTP front names both); "" says nothing
    client: str = Field("", max_length=256)


class EmbedRequest(_ModelHandle):
    """A one-shot embedding of ``text`` (or of each of ``texts``, an extension)."""

    text: str = Field("", max_length=MAX_TEXT_CHARS)
    texts: list[str] = Field(default_factory=list)
    truncate: bool = False

    def inputs(self) -> list[str]:
        return list(self.texts) if self.texts else [self.text]


class EmbedResult(_Report):
    vector: list[float] = Field(default_factory=list)
    #: one vector per input when the request used ``texts``
    vectors: list[list[float]] = Field(default_factory=list)
    dims: int = 0
    model_name: str = ""
    digest: str = ""
    #: tokens per input (special tokens included)
    tokens: list[int] = Field(default_factory=list)
    #: indices of inputs cut to the model window (only when the request asked to truncate)
    truncated: list[int] = Field(default_factory=list)


class EmbedInfo(_Report):
    """What the embedding side slot knows about one embed beyond the ``EmbedResult`` (not on the wire)."""

    #: tokens per input (special tokens included, before any truncation)
    tokens: list[int] = Field(default_factory=list)
    #: indices of inputs cut to the window
    truncated: list[int] = Field(default_factory=list)
    window: int = 0
    #: this call loaded the embedding model
    loaded_now: bool = False
    seconds: float = 0.0


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


class LoadModelRequest(_ModelHandle):
    """Explicitly activate the single slot; conditional when expected_generation != 0."""

    expected_generation: int = Field(0, ge=0)


class UnloadModelRequest(_Request):
    """Explicitly release the slot; idempotent on an empty slot unless the generation is stale."""

    owner_instance_id: str = ""
    expected_generation: int = Field(0, ge=0)


#: what a model can be asked for (``ActiveModel.capabilities``, ``ModelInfo.capabilities``), read from its weights
#: and its chat template (``backends.tape.model.model_capabilities``): text; images (an image encoder); tools (its
#: template renders a tool list); reasoning (its template renders thinking)
CAPABILITIES = ("text", "vision", "tools", "reasoning")


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
    last_error: str = ""
    load_progress: float | None = None
    session_open: bool = False
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


class DeviceInfo(_Report):
    kind: str = ""
    id: str = ""
    name: str = ""
    total_bytes: int = 0
    free_bytes: int = 0


class EngineOption(_Report):
    """One option an engine takes in ``Config.options``, as ``describe`` lists it."""

    name: str = ""
    #: "boolean", "string", "integer" or "number" (the JSON Schema type)
    type: str = ""
    #: the values it takes when they are few (empty: any of its type)
    choices: list[str] = Field(default_factory=list)
    #: what an unset option means
    default: str = ""
    description: str = ""


class ModelInfo(_Report):
    """What the daemon reports about a model: from its metadata and the device's memory."""

    model_max_context: int = 0
    effective_context: int = 0
    kv_bytes_per_token: int = 0
    free_bytes: int = 0
    weights_bytes: int = 0
    overhead_bytes: int = 0
    reserved_bytes: int = 0
    user_limit_bytes: int = 0
    min_free_bytes: int = 0
    usable_bytes: int = 0
    required_bytes: int = 0
    clamped: bool = False
    reason: str = ""
    device_kind: str = ""
    device_id: str = ""
    device_total_bytes: int = 0
    requested_gpu_layers: int = 0
    resolved_gpu_layers: int = 0
    runtime_name: str = ""
    runtime_digest: str = ""
    runtime_system_info: str = ""
    #: the chat template a load would serve with and where it comes from, as ``ActiveModel.chat_template``
    chat_template: str = ""
    #: the tool-call format a load would use and why, as ``ActiveModel.tool_format``
    tool_format: str = ""
    #: what the model can be asked for, as ``ActiveModel.capabilities``
    capabilities: list[str] = Field(default_factory=lambda: ["text"])
    supports_gpu_offload: bool = False
    #: the options the loading engine takes in ``Config.options``
    engine_options: list[EngineOption] = Field(default_factory=list)
    devices: list[DeviceInfo] = Field(default_factory=list)
    #: why ``resolved_gpu_layers`` (``modeld.capacity.GPU_REASONS``: "all", "gpu memory", "no gpu", …)
    gpu_layers_reason: str = ""
    #: of ``required_bytes`` / ``usable_bytes``, the GPU's part (0 without offload): the host's is the rest
    gpu_required_bytes: int = 0
    gpu_usable_bytes: int = 0
    #: the workspace cache: RAM it holds now and its budget (handed back before a model load)
    cache_ram_bytes: int = 0
    cache_ram_budget_bytes: int = 0
    # extensions: what the metadata said
    n_layer: int = 0
    n_head_kv: int = 0
    head_dim: int = 0
    digest: str = ""


class PrefixInput(_Request):
    """Stable prefix text plus the manifest that makes reuse valid."""

    text: str = Field("", max_length=MAX_TEXT_CHARS)
    manifest: ContextManifest = Field(default_factory=ContextManifest)
    #: JSON array of tool definitions rendered by the model's own template; "" = none
    tools: str = ""
    #: False: the text is the prompt as it is, with no template (a raw completion; BOS by the manifest's policy);
    #: the suffixes after it are raw too (``SuffixInput.render`` False, or token ids)
    render: bool = True

    @model_validator(mode="after")
    def _raw_has_no_tools(self) -> PrefixInput:
        if not self.render and self.tools:
            raise InvalidArgument("tools are rendered by the model's template: a raw prefix (render=False) has none")
        return self


class PositionRange(_Request):
    """Positions ``start`` (inclusive) to ``end`` (exclusive) of a session's context: which of a suffix's tokens a
    prefill scores or reads out (``SuffixInput.logprobs_ranges``, ``readout_ranges``; salience's ``PositionRange``)."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> PositionRange:
        if self.end <= self.start:
            raise InvalidArgument(f"a position range ends after it starts: got [{self.start}, {self.end})",
                                  start=self.start, end=self.end)
        return self


#: the most position ranges one suffix names for its scores or its readouts
MAX_POSITION_RANGES = 64


def positions_covered(ranges: list[PositionRange], start: int, end: int) -> list[bool]:
    """Which of the positions ``start`` to ``end`` (a suffix's) the ranges cover: every one when there are none.
    A range outside them is InvalidArgument naming both: the ranges name suffix tokens."""
    if not ranges:
        return [True] * (end - start)
    wanted = [False] * (end - start)
    for r in ranges:
        if r.start < start or r.end > end:
            raise InvalidArgument(
                f"position range [{r.start}, {r.end}) is not within the suffix, positions [{start}, {end})",
                start=r.start, end=r.end, suffix_start=start, context_tokens=end)
        wanted[r.start - start : r.end - start] = [True] * (r.end - r.start)
    return wanted


def first_covered(wanted: list[bool]) -> int:
    """The offset of the first position ``positions_covered`` marked (their count when it marked none)."""
    return wanted.index(True) if True in wanted else len(wanted)


class TopLogprob(_Report):
    """One token and its log probability (natural log) at one step of a decode."""

    token_id: int = 0
    #: the token's text (its bytes decoded, an incomplete UTF-8 sequence replaced; a control token: empty)
    token: str = ""
    #: the token's bytes: the pieces of a multi-byte character split across tokens join here exactly
    bytes: list[int] = Field(default_factory=list)
    logprob: float = 0.0


class TokenLogprob(TopLogprob):
    """A sampled token's log probability, and the likeliest tokens at its step (``DecodeConfig.logprobs``)."""

    #: the k likeliest tokens, likeliest first (the sampled one among them when it is one of them)
    top: list[TopLogprob] = Field(default_factory=list)


class SuffixInput(_Request):
    """The volatile part after the stable prefix, under the same manifest.

    Either one turn (``text``, with ``role``), or the whole conversation after the
    leading system messages (``messages``): user turns, the assistant's own
    replies and tool calls, tool results. The daemon renders it with the model's
    template and reuses the token LCP of everything already resident, so a
    request that resends the history plus one new message prefills only that.
    """

    text: str = Field("", max_length=MAX_TEXT_CHARS)
    manifest: ContextManifest = Field(default_factory=ContextManifest)
    enable_thinking: bool | None = None
    #: chat role of the volatile turn ("user" or "tool")
    role: Literal["user", "tool"] = "user"
    #: False: append the raw text with no template rendering (continuation)
    render: bool = True
    #: the conversation after the stable prefix, oldest first (instead of ``text``)
    messages: list[ChatMessage] = Field(default_factory=list, max_length=100_000)
    #: who holds this conversation: an agent's id for it (the HTTP front takes Claude Code's agent and session
    #: ids, Codex's thread id, OpenCode's session id). The workspace cache keeps each conversation's newest state
    #: in RAM before its older ones; "" leaves conversations to their tokens (an entry that extends another
    #: replaces it)
    conversation: str = Field("", max_length=256)
    #: token ids instead of text: appended as they are (no template, no tokenizer); each checked against the
    #: model's vocabulary (an unknown id is InvalidArgument, and nothing is appended)
    tokens: list[TokenId] = Field(default_factory=list, max_length=MAX_TEXT_CHARS // 4)
    #: None: the suffix goes after the stable prefix, reusing whatever of the tape matches (token LCP). A number:
    #: the client's view of the session's resident length (``resident_tokens`` of the last status), and the suffix
    #: (``tokens``, or ``text`` with render=False) is appended there: at the resident length it appends, below it
    #: with ``truncating`` the context is cut to ``offset`` first (the KV up to it kept); anything else is
    #: OffsetDrift naming both lengths, and the session is unchanged
    offset: int | None = Field(None, ge=0)
    truncating: bool = False
    #: score the suffix (prefill-only scoring): each suffix token's log probability given everything before it,
    #: with this many likeliest alternatives (0: its own only), in ``SuffixStatus.logprobs``. A position's scores
    #: come from its own computation, so the scored tokens (and the one before the first) are prefilled again,
    #: never reused
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    #: with ``logprobs``: score only the suffix tokens at these positions of the context (absolute, each range
    #: within the suffix; empty: every suffix token). Only what the first range starts at is prefilled again: the
    #: tokens before it are reused like any prompt's
    logprobs_ranges: list[PositionRange] = Field(default_factory=list, max_length=MAX_POSITION_RANGES)
    #: concept readouts of every suffix token (``serve --readouts FILE``; ``DaemonStatus.readouts`` names the
    #: concepts and layers), in ``SuffixStatus.readouts``. Like scores they come from the prefill's own
    #: computation, so the tokens read out are prefilled again, never reused
    readouts: bool = False
    #: with ``readouts``: read out only the suffix tokens at these positions (as ``logprobs_ranges``)
    readout_ranges: list[PositionRange] = Field(default_factory=list, max_length=MAX_POSITION_RANGES)
    #: images in a raw append (``offset``, ``text`` with render=False), each at its offset in ``text``; the
    #: status's ``image_tokens`` says how many positions they took. A rendered conversation's images are its
    #: messages' (``ChatMessage.images``)
    images: list[ImageInput] = Field(default_factory=list, max_length=MAX_SUFFIX_IMAGES)

    @model_validator(mode="after")
    def _one_form(self) -> SuffixInput:
        if self.messages:
            if self.text:
                raise InvalidArgument("give the suffix as text or as messages, not both")
            if not self.render:
                raise InvalidArgument("messages are rendered by the model's template; render=False takes text")
            check_conversation(self.messages)
        if self.tokens and (self.text or self.messages):
            raise InvalidArgument("give the suffix as token ids, text or messages, one of them")
        if self.offset is None:
            if self.truncating:
                raise InvalidArgument("truncating cuts the context at an offset: give the offset")
        elif self.messages or (self.text and self.render):
            raise InvalidArgument("an append at an offset is raw: give token ids, or text with render=False")
        if self.logprobs_ranges and self.logprobs is None:
            raise InvalidArgument("logprobs_ranges name which suffix tokens to score: give logprobs too")
        if self.readout_ranges and not self.readouts:
            raise InvalidArgument("readout_ranges name which suffix tokens to read out: give readouts too")
        if self.images:
            if self.offset is None or self.tokens:
                raise InvalidArgument("images in a suffix go in a raw append (offset, with text or nothing); a "
                                      "conversation's images are its messages'")
            check_images(self.images, self.text, "suffix")
        return self


class MissCause(str, enum.Enum):
    """Why part of a prompt was prefilled that the daemon had computed before, or had never seen (``ReuseMiss``)."""

    FIRST_SIGHT = "first_sight"  # nothing held shares the prompt from here: a new agent, or a new conversation
    SYSTEM_CHANGED = "system_changed"  # the system prompt differs from the resident one at this point
    TOOLS_CHANGED = "tools_changed"  # the same system prompt with other tool definitions
    HISTORY_REWRITTEN = "history_rewritten"  # an earlier message (or the model's own reply) came back changed
    EVICTED = "evicted"  # this prompt was computed before, but neither the KV nor the workspace cache holds it now
    MANIFEST_CHANGED = "manifest_changed"  # another model, template, runtime setting or BOS policy: nothing is reusable


class ReuseMiss(_Report):
    """Where a prompt's reuse stopped and why (``PrefixStatus.miss``, ``SuffixStatus.miss``).

    None on a status means everything the daemon held that this prompt could use was used: what was
    prefilled is new text after it.
    """

    cause: MissCause = MissCause.FIRST_SIGHT
    #: the token index of the first difference: the prompt was prefilled from here
    index: int = 0
    #: how long the prompt the daemon compared with was (for ``evicted``: how much of this prompt it had computed)
    held_tokens: int = 0
    #: the conversation's message (0 = the first after the system prompt) where it differs; -1 when not known
    message: int = -1
    #: a few words of what the daemon held from ``index`` on, and of what the prompt has there
    held_text: str = ""
    new_text: str = ""
    #: a short sentence for a log line (which manifest field changed, which message)
    detail: str = ""

    def brief(self) -> str:
        """``cause@index`` (with the message when known): the access log's field."""
        at = f"{self.cause.value}@{self.index}"
        return f"{at}/m{self.message}" if self.message >= 0 else at


class ReuseRecord(_Report):
    """One request's prompt as the daemon served it (``modeld why``): how much was reused, and why not more."""

    #: when its prefill ended (seconds since the epoch)
    at: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    #: of ``reused_tokens``, restored by the workspace cache
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    prefill_ms: float = 0.0
    #: of ``prefill_ms``: rendering the prompt through the template, and tokenizing it
    render_ms: float = 0.0
    tokenize_ms: float = 0.0
    miss: ReuseMiss | None = None
    #: a digest of the prompt's tokens (``SuffixStatus.context_token_hash``): the same digest, the same tokens
    prompt_token_hash: str = ""


class PrefixStatus(_Report):
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    dropped_tokens: int = 0
    prefix_tokens: int = 0
    resident_tokens: int = 0
    available_tokens: int = 0
    stable_byte_hash: str = ""
    stable_token_hash: str = ""
    manifest_digest: str = ""
    prefill_ms: float = 0.0
    #: of ``prefill_ms``: rendering the prefix through the template, and tokenizing it
    render_ms: float = 0.0
    tokenize_ms: float = 0.0
    #: of ``reused_tokens``, how many the workspace cache restored (not resident before the call)
    cached_tokens: int = 0
    #: why the prefix was not all reused (None: it was, or what was prefilled is new)
    miss: ReuseMiss | None = None


class SuffixStatus(_Report):
    suffix_tokens: int = 0
    prefix_tokens: int = 0
    resident_tokens: int = 0
    available_tokens: int = 0
    manifest_digest: str = ""
    #: suffix tokens already resident (the LCP with the tape, earlier replies included)
    reused_tokens: int = 0
    #: suffix tokens computed now (suffix_tokens - reused_tokens)
    prefilled_tokens: int = 0
    prefill_ms: float = 0.0
    #: of ``prefill_ms``: rendering the conversation through the template, and tokenizing it
    render_ms: float = 0.0
    tokenize_ms: float = 0.0
    #: of ``reused_tokens``, how many the workspace cache restored (not resident before the call)
    cached_tokens: int = 0
    #: why the suffix was not all reused (None: it was, or what was prefilled is new)
    miss: ReuseMiss | None = None
    #: with ``SuffixInput.logprobs``: one per suffix token, in order (None for a token with nothing before it, and
    #: for one outside ``logprobs_ranges``)
    logprobs: list[TokenLogprob | None] = Field(default_factory=list)
    #: of ``suffix_tokens``, the positions its images' blocks of image tokens take (each image once per place)
    image_tokens: int = 0
    #: a digest of the context's tokens after the suffix (``contract.manifest.token_hash``): two requests with the
    #: same digest sent the model the same tokens, whatever the slot held before each
    context_token_hash: str = ""
    #: with ``SuffixInput.readouts``: one per suffix token, in order: ``[n_layers][n_concepts]``, the residual stream
    #: after each manifest layer (ascending) dotted with each concept's direction (the manifest's order); ``[]`` for
    #: a token outside ``readout_ranges``
    readouts: list[list[list[float]]] = Field(default_factory=list)


class TokenCount(_Report):
    """What a prompt (a prefix and a suffix) comes to on the loaded model, computed without touching the KV."""

    #: the whole prompt: what ``ensure_prefix`` + ``prefill_suffix`` would leave resident
    prompt_tokens: int = 0
    prefix_tokens: int = 0
    num_ctx: int = 0
    #: of ``prompt_tokens``, how many are resident now under a compatible manifest (a warm turn's reuse)
    resident_tokens: int = 0

    @property
    def room(self) -> int:
        """Tokens left for the reply."""
        return self.num_ctx - self.prompt_tokens


class StructuredOutputConfig(_Request):
    """A backend-typed constraint on generation: exactly one of the fields."""

    json_schema: str = ""
    grammar: str = ""
    regex: str = ""
    #: a forced tool call: each tool's name and the JSON schema of its arguments ("": any JSON object);
    #: the reply is exactly one call to one of them, in the form the model's template renders calls back in
    #: (its tool-call format, e.g. Hermes's ``<tool_call>\n{"name": …, "arguments": …}\n</tool_call>``),
    #: its arguments held to the schema as far as the engine's grammar can hold them
    tool_call: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputConfig:
        given = [name for name in ("json_schema", "grammar", "regex", "tool_call") if getattr(self, name)]
        if len(given) > 1:
            raise ValueError(f"structured_output takes exactly one of json_schema/grammar/regex/tool_call, got {given}")
        return self

    def is_set(self) -> bool:
        return bool(self.json_schema or self.grammar or self.regex or self.tool_call)


class SamplingParams(_Report):
    """Sampling settings: what a model recommends, or what a client fills unset fields of a request with.

    None leaves a field to the next source; ``source`` says where the values came
    from ("model": the GGUF's ``general.sampling.*`` keys, "default": the daemon's
    documented defaults, "settings": ``modeld serve --temperature``).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    source: str = ""
    #: the reply length of a request that sets none (``modeld serve --max-tokens``; None: until the end of
    #: generation or the context's end)
    max_tokens: int | None = Field(None, ge=1)

    def fill(self, cfg: DecodeConfig) -> DecodeConfig:
        """``cfg`` with its unset sampling fields and reply length taken from these (a greedy ``cfg`` is left
        greedy)."""
        names = ["max_tokens"]
        if cfg.temperature != 0.0:
            names += ["temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n"]
        update = {name: getattr(self, name) for name in names
                  if getattr(cfg, name) is None and getattr(self, name) is not None}
        return cfg.model_copy(update=update) if update else cfg


#: what a request that sets no sampling parameter gets when the model recommends none: sampled, not
#: greedy (llama-server's and Ollama's temperature, top-k, top-p and min-p, and Ollama's repeat penalty
#: over the last 64 tokens, which keeps a small model from looping until the context's end)
DEFAULT_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1,
                                  repeat_last_n=64, source="default")


class DecodeConfig(_Request):
    #: None: until the end of generation or the context's end (a limit past the context's end is a
    #: cap: the pass stops there with finish reason "length")
    max_tokens: int | None = Field(None, ge=0, le=100_000_000)
    #: None or 0: greedy (the session contract is deterministic unless asked otherwise; ``runtime.Chat``
    #: fills unset fields from the model's recommended sampling, ``OpenReply.sampling``)
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    #: None or 0: no top-k cut
    top_k: int | None = Field(None, ge=0)
    #: None or 0: no min-p cut (tokens below min_p times the top token's probability are dropped)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    #: penalties over the last ``repeat_last_n`` tokens (the prompt's tail, then the reply; None: 64),
    #: applied before the cuts, as llama.cpp does: a repeated token's logit divided by
    #: ``repeat_penalty`` (multiplied where negative; None or 1: none), less ``frequency_penalty``
    #: times its count and ``presence_penalty`` once (OpenAI's; None or 0: none)
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0)
    repeat_last_n: int | None = Field(None, ge=0, le=1_000_000)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    #: any 64-bit value (the engines fold it to the width their generators take)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: list[str] = Field(default_factory=list)
    #: the parsers a decode runs: "think" and at most one tool-call format ("hermes", "mistral", "harmony", …;
    #: ``backends.tape.toolformats``); empty: the model's own (reasoning split, calls parsed when tools were given)
    parser_protocols: list[str] = Field(default_factory=list)
    reasoning_format: str = ""
    structured_output: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)
    #: extension: also stream the sampled token ids (for parity checks)
    return_token_ids: bool = False
    #: None: no log probabilities; k (0-20): each sampled token streams with its log probability under the
    #: model's distribution (before penalties and cuts: what the sampler started from) and the k likeliest
    #: tokens there
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    #: concept readouts of the decoded tokens (``serve --readouts FILE``), in the final chunk's ``readouts``: once
    #: the pass ends its tokens are computed again in one batch with the manifest's layers read
    readouts: bool = False
    #: extension: prompt-lookup speculative decoding (drafts copied from the context, verified in
    #: one batch; the output is what plain decoding gives); None = the daemon's default, for greedy
    #: decoding only (a seeded sampled pass then repeats exactly)
    speculative: bool | None = None

    def penalties(self) -> tuple[int, float, float, float] | None:
        """(last n, repeat, frequency, presence) when any penalty applies, else None."""
        last_n = 64 if self.repeat_last_n is None else self.repeat_last_n
        repeat, freq, present = self.repeat_penalty or 1.0, self.frequency_penalty or 0.0, self.presence_penalty or 0.0
        if last_n == 0 or (repeat == 1.0 and freq == 0.0 and present == 0.0):
            return None
        return last_n, repeat, freq, present


class ToolCallFunction(_Report):
    name: str = ""
    arguments: str = ""


class ToolCall(_Report):
    id: str = ""
    type: str = "function"
    function: ToolCallFunction = Field(default_factory=ToolCallFunction)


class ToolCallDelta(_Report):
    """A piece of a tool call as the model writes it, keyed by the call's ``index`` in the reply: the first piece
    of a call carries its ``id`` and ``name``; the ``arguments`` of all its pieces, joined, are the finished
    call's ``function.arguments`` exactly."""

    index: int = 0
    id: str = ""
    name: str = ""
    arguments: str = ""


class ImageInput(_Request):
    """An image in a message's text, or in a raw append: its encoded bytes (PNG, JPEG, WebP or GIF) and where it
    sits. The daemon turns it into its model's block of image tokens (a client never writes them), keyed by the
    bytes' digest: a later turn that sends the same image again reuses its KV like any other prefix."""

    #: the bytes (in JSON, as base64 text: a stored conversation keeps its images so)
    data: StrictBytes = Field(..., min_length=1, max_length=MAX_IMAGE_BYTES)
    #: the character offset in the text the image goes before (0: before all of it; the text's length: after it)
    at: int = Field(0, ge=0)

    @field_validator("data", mode="before")
    @classmethod
    def _from_base64(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except ValueError:
                raise ValueError("image data given as text must be base64") from None
        return value

    @field_serializer("data", when_used="json")
    def _to_base64(self, value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")

    @functools.cached_property
    def digest(self) -> str:
        """The sha256 of the bytes, hex: what the image's KV is reused by."""
        return hashlib.sha256(self.data).hexdigest()


def check_images(images: list[ImageInput], text: str, where: str) -> None:
    """Each image's offset within ``text`` and in order; InvalidArgument naming the first that is not."""
    last = 0
    for i, image in enumerate(images):
        if image.at > len(text) or image.at < last:
            raise InvalidArgument(f"{where}.images[{i}] sits at {image.at}: images go in order, at offsets within "
                                  f"the text's {len(text)} characters", index=i, at=image.at)
        last = image.at


class ChatMessage(_Request):
    """One message of the conversation after the stable prefix (OpenAI's chat shape)."""

    #: "system" after the first turn is a mid-conversation instruction (the leading
    #: system messages are the stable prefix, not part of the conversation)
    role: Literal["user", "assistant", "tool", "system"]
    content: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    #: the assistant's tool calls
    tool_calls: list[ToolCall] = Field(default_factory=list)
    #: a tool result: the id of the call it answers, and the tool's name
    tool_call_id: str = ""
    name: str = ""
    #: the assistant's reasoning (``<think>``), when the template renders it
    reasoning: str = ""
    #: images in a user or tool message, each at its offset in ``content`` (a model with an image encoder only:
    #: ``capabilities`` has "vision")
    images: list[ImageInput] = Field(default_factory=list, max_length=MAX_SUFFIX_IMAGES)


def check_conversation(messages: list[ChatMessage]) -> None:
    """Refuse a conversation no template could render faithfully; InvalidArgument naming the message."""
    open_calls: set[str] = set()
    for i, msg in enumerate(messages):
        where = f"messages[{i}] ({msg.role})"
        if msg.role == "assistant":
            if not msg.content and not msg.tool_calls and not msg.reasoning:
                raise InvalidArgument(f"{where} has neither content nor tool calls", index=i)
            for call in msg.tool_calls:
                if not call.function.name:
                    raise InvalidArgument(f"{where} has a tool call without a function name", index=i)
                if call.id:
                    open_calls.add(call.id)
        else:
            if msg.tool_calls:
                raise InvalidArgument(f"{where}: only assistant messages carry tool calls", index=i)
            if msg.content is None:
                raise InvalidArgument(f"{where} has no content", index=i)
        if msg.role == "tool":
            if not msg.tool_call_id:
                raise InvalidArgument(f"{where} names no tool_call_id", index=i)
            if msg.tool_call_id not in open_calls:
                raise InvalidArgument(
                    f"{where} answers tool call {msg.tool_call_id!r}, which no earlier assistant message made",
                    index=i,
                    tool_call_id=msg.tool_call_id,
                )
        elif msg.tool_call_id:
            raise InvalidArgument(f"{where}: only tool messages carry a tool_call_id", index=i)
        if msg.images:
            if msg.role not in ("user", "tool"):
                raise InvalidArgument(f"{where}: only user and tool messages carry images", index=i)
            check_images(msg.images, msg.content or "", f"messages[{i}]")


class ErrorInfo(_Report):
    code: int = 0
    name: str = ""
    message: str = ""
    recoverable: bool = False
    details: dict[str, Any] = Field(default_factory=dict)


class Usage(_Report):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: from the start of decode to the first sampled token (the prompt is already prefilled)
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    tokens_per_second: float = 0.0
    #: speculative decoding: draft tokens evaluated, and those the sampled output kept
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: the session's resident length once the decode ended (the prompt and the reply's tokens): where a client's
    #: next append goes (``SuffixInput.offset``)
    resident_tokens: int = 0


#: why a decode ended: the ``finish_reason`` of its final chunk ("" on every other chunk)
FinishReason = Literal[
    "",
    "stop",  # the model ended its reply: end of generation, or a stop string (``stop_sequence``)
    "tool_calls",  # the model ended its reply with tool calls
    "length",  # max_tokens were decoded
    "context_full",  # the context window is full: the next token could not be evaluated
    "cancelled",  # the caller cancelled the decode before the model ended it (the reply is cut short)
]


class Delta(_Report):
    """What a step of a reply adds: its text, its reasoning, its tool calls, and the tokens they came from. A decode
    frame (``StreamChunk``) and an event of a chat turn (``runtime.ChatEvent``) are both one."""

    text: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    #: the same calls as they are written, piece by piece: per call index its id and name first, then its arguments
    #: (a call's pieces come before or with the call itself)
    tool_call_deltas: list[ToolCallDelta] = Field(default_factory=list)
    #: with ``DecodeConfig.return_token_ids``: the ids of the tokens this delta came from (a token whose text was
    #: held back comes with the delta that sends it)
    token_ids: list[int] = Field(default_factory=list)
    #: with ``DecodeConfig.logprobs``: the sampled tokens this delta's output came from, in order (a token whose
    #: output was held back, a possible stop string or a tool call, comes with the delta that sends it on; tokens
    #: that sent nothing come with the final chunk)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class StreamChunk(Delta):
    """A decode frame: a delta (several merged decode steps' with ``text_pieces``), or the terminal chunk."""

    #: with ``DecodeConfig.readouts``, on the final chunk: one per decoded token the context holds (an end of
    #: generation token is not one), in order, ``[n_layers][n_concepts]`` as ``SuffixStatus.readouts``
    readouts: list[list[list[float]]] = Field(default_factory=list)
    #: with ``DecodeConfig.logprobs``, on the final chunk of a pass the model ended: the end-of-generation token it
    #: sampled (its ``token`` text empty: it writes none), which ``logprobs`` does not count among the reply's tokens
    end_logprob: TokenLogprob | None = None
    #: when a frame carries several decode steps merged (``modeld serve --stream-interval-ms``): ``text`` and
    #: ``thinking`` in the pieces the steps produced, so a reader can hand them on one by one, as a server that
    #: sends a frame a token does (empty: the field is one piece)
    text_pieces: list[str] = Field(default_factory=list)
    thinking_pieces: list[str] = Field(default_factory=list)
    error: ErrorInfo | None = None
    done: bool = False
    finish_reason: FinishReason = ""
    #: the final chunk of a pass a stop string ended: that string
    stop_sequence: str = ""
    usage: Usage | None = None

    def thinking_steps(self) -> list[str]:
        """``thinking`` in the pieces it was decoded in (none when empty)."""
        return list(self.thinking_pieces) if self.thinking_pieces else [self.thinking] if self.thinking else []

    def text_steps(self) -> list[str]:
        """``text`` in the pieces it was decoded in (none when empty)."""
        return list(self.text_pieces) if self.text_pieces else [self.text] if self.text else []

    @classmethod
    def final(
        cls,
        finish_reason: FinishReason,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_ms: float,
        started: float,
        *,
        drafted: int = 0,
        accepted: int = 0,
    ) -> StreamChunk:
        """The terminal chunk of a decode that began at ``started`` (a perf_counter reading)."""
        elapsed_ms = (time.perf_counter() - started) * 1000
        return cls(
            done=True,
            finish_reason=finish_reason,
            usage=Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                ttft_ms=ttft_ms,
                decode_ms=elapsed_ms,
                tokens_per_second=completion_tokens / (elapsed_ms / 1000) if elapsed_ms > 0 else 0.0,
                drafted_tokens=drafted,
                accepted_tokens=accepted,
                resident_tokens=prompt_tokens + completion_tokens,
            ),
        )


class SessionSnapshot(_Report):
    """Backend state plus the bookkeeping that gates a restore."""

    state: bytes = b""
    state_id: str = ""
    state_kind: str = ""  # "kv" (real state bytes) | "replay" (token tape, restore re-prefills)
    #: sha256 of ``state`` taken at snapshot time; a restore verifies it
    state_digest: str = ""
    backend: str = ""
    resident_tokens: int = 0
    prefix_tokens: int = 0
    num_ctx: int = 0
    resident_token_ids: list[int] = Field(default_factory=list)
    stable_text: str = ""
    prefix_text: str = ""
    tools: str = ""
    manifest: ContextManifest = Field(default_factory=ContextManifest)

    @field_validator("state", mode="before")
    @classmethod
    def _bytes(cls, v: Any) -> Any:
        if isinstance(v, (bytearray, memoryview)):
            return bytes(v)
        return v


class ContextReport(_Report):
    resident_tokens: int = 0
    prefix_tokens: int = 0
    num_ctx: int = 0
    available_tokens: int = 0
    stable_byte_hash: str = ""
    stable_token_hash: str = ""
    manifest_digest: str = ""
    manifest: ContextManifest = Field(default_factory=ContextManifest)
    closed: bool = False


SuffixInput.model_rebuild()  # ChatMessage is defined after it
