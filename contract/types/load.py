"""What a load takes: the model handle, the runtime config and the engine options; embeddings; what a model file says."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BeforeValidator, Field, StringConstraints

from ..flags import LOAD_GROUP, Flag
from ._base import MAX_TEXT_CHARS, _Report, _Request

__all__ = ["Config", "DeviceInfo", "EmbedRequest", "EmbedInfo", "EmbedResult", "EngineOption", "EngineOptionValue", "GPU_LAYERS_ALL", "GPU_LAYERS_AUTO", "Fence", "LoadModelRequest", "ModelInfo", "OpenSessionRequest", "UnloadModelRequest", "format_gpu_layers", "parse_gpu_layers"]


KVCacheType = Literal["", "f16", "f32", "q8_0", "q4_0"]


#: the types a flag or setting can name ("" is the backend's default, given by leaving it unset)
KV_CACHE_TYPES: tuple[str, ...] = tuple(t for t in get_args(KVCacheType) if t)


#: the quantized ones: llama.cpp needs flash attention for them, and the OpenVINO backend does not offer them
QUANTIZED_KV_CACHE_TYPES = ("q8_0", "q4_0")


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


class Config(_Request):
    """Explicit hardware/runtime configuration for a session; every knob is tested.

    It is the one declaration of what a load takes: a field with a ``Flag`` is also a setting of ``modeld serve``
    (its preloaded model: flag, ``MODELD_<SETTING>`` variable, config file key) and a flag of the client commands
    that name a model (``modeld load``, ``describe``, ``run``, ``embed``); an engine's own options are its options
    model's fields (``backends.engine.EngineOptions``), each a setting and a flag too, carried in ``options``.
    """

    num_ctx: Annotated[int, Flag(None, LOAD_GROUP)] = Field(
        0, ge=0, description="context window in tokens (0 = the memory planner fits it)")
    num_batch: Annotated[int, Flag("N", LOAD_GROUP)] = Field(
        0, ge=0, description="prompt tokens per prefill chunk (0 = the engine's default, 512): a cancel stops a "
        "prefill between chunks and keeps the chunks done; smaller chunks stop sooner and cost a little speed")
    num_threads: Annotated[int, Flag("N", LOAD_GROUP)] = Field(
        0, ge=0, description="CPU threads the engine computes on (0 = llama.cpp: one per CPU this process may run on, "
        "its affinity mask; OpenVINO: its own default)")
    num_gpu_layers: Annotated[
        int,
        BeforeValidator(lambda v: parse_gpu_layers(v) if isinstance(v, str) else v),
        Flag("N|auto|all", LOAD_GROUP, setting="gpu_layers", default=GPU_LAYERS_AUTO,
             commands=("load", "describe"), unset={"load": "auto", "describe": "auto"}),
    ] = Field(
        0,
        ge=GPU_LAYERS_AUTO,
        description="llama.cpp: layers on the GPU: auto = as many as fit (all when they do), all = every layer or "
        "refuse, 0 = CPU only, N = that many (clamped to the model's layers, as llama-server clamps -ngl 999); the "
        "host holds the rest; a CPU build or no NVIDIA GPU: the CPU",
    )
    tensor_split: list[float] = Field(default_factory=list)
    flash_attn: Annotated[bool, Flag(None, LOAD_GROUP)] = Field(
        False, description="llama.cpp: flash attention (a quantized KV cache needs it)")
    kv_cache_type: Annotated[KVCacheType, Flag(None, LOAD_GROUP)] = Field(
        "", description="llama.cpp: KV cache type, f16 when unset; with --flash-attn, q8_0 makes a token's logits "
        "the same alone or in a batch, so speculation and reuse never change an answer")
    prompt_format: str = ""
    prompt_template_digest: str = ""
    #: the chat template to serve with: a built-in name ("chatml", "llama3", …), a Jinja file on the daemon's
    #: machine, or "" for the model's own (when its file has none: by its vocabulary's turn tokens, else ChatML)
    chat_template: Annotated[str, Flag("NAME|FILE", LOAD_GROUP)] = Field(
        "", description="the chat template: a built-in name (chatml, qwen2_5, qwen3_coder, llama3, mistral, "
        "mistral_args, gpt_oss, deepseek_v3_1, gemma3) or a Jinja file on the daemon's machine; default: the "
        "model's own, else the one its vocabulary's turn tokens select, else ChatML (status says which)")
    #: the tool-call format replies are parsed and calls forced in ("hermes", "llama3_json", "mistral", …);
    #: "" detects it from the chat template (Hermes for a template that does not render tools itself)
    tool_format: Annotated[str, Flag("NAME", LOAD_GROUP)] = Field(
        "", description="the tool-call format replies are parsed and calls forced in (hermes, qwen3_coder, "
        "llama3_json, mistral, mistral_args, harmony, deepseek_v3, deepseek_v3_1); default: detected from the chat "
        "template")
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
    exact_decode: Annotated[bool, Flag(None, LOAD_GROUP)] = Field(
        False, description="compute every decoded token as a prefill computes it, so drafts (sampled ones too) and "
        "reused replies never change an answer; OpenVINO: a decode step then costs more, the more so the longer "
        "the context (docs/speculation.md); llama.cpp: needs --flash-attn --kv-cache-type q8_0 (or q4_0)")
    #: what only the loading engine offers, by name (an extension): its registry entry declares the
    #: options it takes (``describe`` lists them), and a load with one it does not take is refused
    options: Annotated[
        dict[EngineOptionName, EngineOptionValue], Flag("NAME=VALUE", LOAD_GROUP, setting="engine_option"),
    ] = Field(
        default_factory=dict, max_length=MAX_ENGINE_OPTIONS,
        description="an option only the loading engine offers (repeatable; each is also a flag of its own): "
        "`modeld describe` lists the engine's, docs/engines.md every engine's; with --backend auto, an option only "
        "one engine takes picks it")


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


class LoadModelRequest(_ModelHandle):
    """Explicitly activate the single slot; conditional when expected_generation != 0."""

    expected_generation: int = Field(0, ge=0)


class UnloadModelRequest(_Request):
    """Explicitly release the slot; idempotent on an empty slot unless the generation is stale."""

    owner_instance_id: str = ""
    expected_generation: int = Field(0, ge=0)


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
