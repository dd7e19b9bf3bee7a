"""The contract's value types, as pydantic models, by concern: what a load takes (``load``), a conversation's
parts (``chat``), a decode and its stream (``decode``), a session's context (``session``), what the daemon reports
(``status``), and what they share (``_base``). Import them from here.

Names are snake_case; on the wire (msgpack) every field uses its name. Request types forbid unknown fields so
a misspelt option is an ``InvalidArgument`` rather than silently ignored; report
types ignore unknown fields so an older client can read a newer daemon.
"""

from __future__ import annotations

from ..manifest import ContextManifest
from ._base import CAPABILITIES, MAX_IMAGE_BYTES, MAX_SUFFIX_IMAGES, MAX_TEXT_CHARS, MAX_TOP_LOGPROBS, TokenId
from .chat import ChatMessage, ImageInput, ToolCall, ToolCallDelta, ToolCallFunction, check_conversation, check_images
from .decode import (
    DEFAULT_SAMPLING,
    DecodeConfig,
    Delta,
    ErrorInfo,
    FinishReason,
    SamplingParams,
    StreamChunk,
    StructuredOutputConfig,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from .load import (
    GPU_LAYERS_ALL,
    GPU_LAYERS_AUTO,
    KV_CACHE_TYPES,
    MAX_ENGINE_OPTIONS,
    QUANTIZED_KV_CACHE_TYPES,
    Config,
    DeviceInfo,
    EmbedInfo,
    EmbedRequest,
    EmbedResult,
    EngineOption,
    EngineOptionName,
    EngineOptionValue,
    Fence,
    KVCacheType,
    LoadModelRequest,
    ModelInfo,
    OpenSessionRequest,
    UnloadModelRequest,
    format_gpu_layers,
    parse_gpu_layers,
)
from .session import (
    MAX_POSITION_RANGES,
    ContextReport,
    MissCause,
    PositionRange,
    PrefixInput,
    PrefixStatus,
    ReuseMiss,
    ReuseRecord,
    SessionSnapshot,
    SuffixInput,
    SuffixStatus,
    TokenCount,
    first_covered,
    positions_covered,
)
from .status import (
    ActiveModel,
    BlobStatus,
    CacheEntryInfo,
    CacheStatus,
    DaemonStatus,
    EmbeddingStatus,
    Heartbeat,
    ModelsStatus,
    Progress,
    ReadoutInfo,
    RunningTurn,
    SlotState,
    SpeculationStatus,
    owner_fingerprint,
)

__all__ = ["ActiveModel", "BlobStatus", "CacheEntryInfo", "CacheStatus", "CAPABILITIES", "ChatMessage", "check_conversation", "check_images", "Config", "ContextManifest", "ContextReport", "DaemonStatus", "DecodeConfig", "DEFAULT_SAMPLING", "Delta", "DeviceInfo", "EmbeddingStatus", "EmbedInfo", "EmbedRequest", "EmbedResult", "EngineOption", "EngineOptionName", "EngineOptionValue", "ErrorInfo", "Fence", "FinishReason", "first_covered", "format_gpu_layers", "GPU_LAYERS_ALL", "GPU_LAYERS_AUTO", "Heartbeat", "ImageInput", "KV_CACHE_TYPES", "KVCacheType", "LoadModelRequest", "MAX_ENGINE_OPTIONS", "MAX_IMAGE_BYTES", "MAX_POSITION_RANGES", "MAX_SUFFIX_IMAGES", "MAX_TEXT_CHARS", "MAX_TOP_LOGPROBS", "MissCause", "ModelInfo", "ModelsStatus", "OpenSessionRequest", "owner_fingerprint", "parse_gpu_layers", "PositionRange", "positions_covered", "PrefixInput", "PrefixStatus", "Progress", "QUANTIZED_KV_CACHE_TYPES", "ReadoutInfo", "ReuseMiss", "ReuseRecord", "RunningTurn", "SamplingParams", "SessionSnapshot", "SlotState", "SpeculationStatus", "StreamChunk", "StructuredOutputConfig", "SuffixInput", "SuffixStatus", "TokenCount", "TokenId", "TokenLogprob", "ToolCall", "ToolCallDelta", "ToolCallFunction", "TopLogprob", "UnloadModelRequest", "Usage"]
