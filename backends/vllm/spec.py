"""The vLLM engine's spec (``SPEC``, listed by ``backends.registry``) and the options it takes: its server.

This module stays light: the factory imports the engine when it is called.
"""

from __future__ import annotations

from pydantic import Field

from contract.interfaces import Backend, StateCache
from contract.sizing import OverheadModel

from ..engine_spec import BackendSettings, EngineOptions, EngineSpec
from ..formats import GGUF

__all__ = ["SPEC", "VLLM_SESSIONS", "VLLMOptions"]


def _vllm_backend(cache: StateCache | None, settings: BackendSettings) -> Backend:
    from backends.vllm.backend import VLLMBackend

    return VLLMBackend(lanes=settings.sessions or VLLM_SESSIONS)


#: how many sessions the vLLM engine serves at once unless ``serve --sessions`` says
VLLM_SESSIONS = 4


class VLLMOptions(EngineOptions):
    """What the vLLM engine takes in ``Config.options``: its server."""

    engine_url: str | None = Field(
        None, description="the vLLM server's base URL (http://HOST:PORT), or a router's in front of several; required")
    served_model: str | None = Field(
        None, description="the model's name on the server (its --served-model-name); unset: the server's only model")
    api_key: str | None = Field(None, description="the server's API key (its --api-key); unset: none")
    timeout_s: float | None = Field(
        None, gt=0, description="how long one request to the server may wait for its answer; unset: 600")
    block_size: int | None = Field(
        None, ge=1, le=65536, description="the servers' prefix-cache block size (their --block-size); unset: read "
        "from the server's metrics, 16 where it publishes none (a router)")


SPEC = EngineSpec(
    name="vllm",
    title="vLLM",
    package="httpx",
    extra="vllm",
    modules=("httpx", "llama_cpp"),
    missing="the vLLM engine's client is not installed",
    # the weights and the KV are the server's: the daemon holds a vocabulary
    overhead=OverheadModel(name="vllm", fixed_bytes=0, logits_copies=0.0, compute_rows=0.0, kq_copies=0.0),
    backend=_vllm_backend,
    embedder=None,
    auto_rank=None,  # a server is named, never guessed
    formats=(GGUF,),
    # the KV is the server's: the daemon's workspace cache has nothing to save
    tape=False,
    notice="serving through a vLLM server: its weights and KV are its own (docs/scaling.md)",
    options=VLLMOptions,
)
