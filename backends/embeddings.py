"""Embedding engines: the models behind the daemon's embedding side slot.

A coding agent calls ``embed`` while its chat session holds the daemon's one
generation slot. ``Llama.embed`` wipes the KV of the instance it runs on, and an
OpenVINO LLM pipeline cannot embed at all, so embeddings get their own small
model in a *side slot* (``modeld.embedding_slot.EmbeddingSlot``: lifecycle,
memory budget, idle unload, status). This module holds what that slot loads,
through the ``EngineFactory`` / ``EmbeddingEngine`` seams of ``contract.interfaces``.

Two engines, one per backend library, each in its engine's package
(``backends.llama.embedder``, ``backends.openvino.embedder``); this module holds
what they share (the plan, the window rule, normalisation):

* ``LlamaEmbedder`` — ``llama_cpp.Llama(path, embedding=True)`` with the pooling
  the GGUF declares, ``n_ctx = n_batch = n_ubatch =`` the model's training window
  (an encoder must see a whole sequence in one micro-batch);
* ``OpenVINOEmbedder`` — ``openvino_genai.TextEmbeddingPipeline`` over an IR
  directory with the pooling its config declares, ``normalize=True`` and
  ``max_length =`` the model's window.

The default model (a request without ``path``) is the all-MiniLM-L6-v2 that
``make setup`` prepares for that backend (``backends.embed_prepare``).

Which models can embed (UnsupportedFeature otherwise):

* GGUF: the header must declare ``<arch>.pooling_type`` MEAN (1), CLS (2) or
  LAST (3) — what llama.cpp's converter writes for sentence-embedding models. A
  model without a pooling type is accepted only when it is a non-causal encoder
  (``<arch>.attention.causal = false``), pooled by MEAN. A chat/causal model that
  declares no pooling is refused: mean-pooled decoder states are not sentence
  embeddings, and silently serving them would look like it works. RANK (4,
  rerankers) and NONE (0, per-token outputs) are refused too.
* IR: the model must have an output named ``last_hidden_state`` (what
  TextEmbeddingPipeline pools); a text-generation IR (``logits`` output or
  ``beam_idx`` input) is refused. An encoder exported with more than one output
  is a ModelLoadFailed naming the fix (re-export with the single output).

Unreadable, missing or corrupt files are ModelLoadFailed. A plan carries the
model's digest; the side slot refuses a request whose ``digest`` does not match.

An engine cuts an input longer than the model's window to the window, keeping
the model's trailing special token (``[SEP]``), as sentence-transformers does;
whether a long input is refused or cut is the side slot's decision.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from contract.errors import (
    InvalidArgument,
)
from contract.interfaces import EmbeddingEngine, EngineFactory
from contract.types import Config

from .embed_prepare import EMBED_MODEL_NAME

__all__ = [
    "EmbeddingEngine",
    "EmbeddingPlan",
    "EngineFactory",
    "l2_normalize",
    "model_name_for",
    "plan_threads",
    "plan_window",
]

MIB = 1024 * 1024



# --- the engine seam -----------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbeddingPlan:
    """What a factory learnt about a model before loading it (headers and files only)."""

    backend: str
    path: Path
    model_name: str
    digest: str
    window: int  # max tokens per input, special tokens included
    pooling: str  # "mean" | "cls" | "last"
    resident_bytes: int  # estimate of the loaded model's memory: weights + buffers
    dims: int = 0  # 0 when only loading tells
    num_threads: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.backend, os.path.realpath(self.path), self.window, self.num_threads)


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (a zero row stays zero)."""
    v = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(v, axis=-1, keepdims=True)
    out: np.ndarray = np.divide(v, norms, out=np.zeros_like(v), where=norms > 0)
    return out


def plan_threads(config: Config) -> int:
    return int(config.num_threads or 0)


def plan_window(native: int, config: Config, path: Path) -> int:
    if native <= 0:
        native = 512
    if config.num_ctx and config.num_ctx > native:
        raise InvalidArgument(
            f"num_ctx {config.num_ctx} exceeds the embedding model's window of {native} tokens",
            num_ctx=config.num_ctx,
            window=native,
            path=str(path),
        )
    return int(config.num_ctx or native)


def model_name_for(path: Path) -> str:
    name = path.name
    for suffix in (".gguf", "-ov"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.endswith((".f16", ".f32")):
        name = name[:-4]
    return name or EMBED_MODEL_NAME
