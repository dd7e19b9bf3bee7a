"""The embedding side slot: embeddings without touching the generation slot.

A coding agent calls ``embed`` while its chat session holds the daemon's one
generation slot. ``Llama.embed`` wipes the KV of the instance it runs on, and an
OpenVINO LLM pipeline cannot embed at all, so embeddings get their own small
model in their own *side slot*:

* it never evicts, reloads or decodes into the generation model, so the chat KV
  stays exactly as it was;
* its resident bytes are estimated *before* loading and offered to
  ``budget_check(bytes_needed)``, which raises ``InsufficientMemory`` (with the
  numbers) when the daemon's memory budget cannot hold both models — nothing is
  evicted silently;
* it shows in ``status()`` and is unloaded by ``maybe_unload_idle()`` after
  ``idle_unload_s`` without use.

The engines (how a model is planned, loaded and run) come in through an
``EngineFactory`` (``contract.interfaces``); the composition root
(``modeld.bootstrap``) passes the one for its backend (``backends.embeddings``).
A request without ``path`` gets the factory's default model.

Inputs longer than the model's window raise ContextOverflow (with the index,
token count and window) unless the request sets ``truncate``; then the engine
cuts each long input to the window and ``embed_with_info`` reports which inputs
were cut. A ``digest`` that does not match the model is a ModelLoadFailed.

Vectors are L2-normalised float lists; a ``texts`` request fills ``vectors`` (in
input order), a ``text`` request fills ``vector``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic

import numpy as np
from numpy.typing import NDArray

from contract.errors import (
    BackendMismatch,
    ContextOverflow,
    InsufficientMemory,
    Internal,
    InvalidArgument,
    ModeldError,
    ModelLoadFailed,
)
from contract.interfaces import EmbeddingEngine, EngineFactory, PlanT
from contract.types import EmbeddingStatus, EmbedInfo, EmbedRequest, EmbedResult

from .defaults import DEFAULT_EMBED_IDLE_S

__all__ = ["BudgetCheck", "EmbeddingSlot"]

log = logging.getLogger(__name__)

#: called with a model's estimated resident bytes before it loads; raises InsufficientMemory
#: (or returns False) to refuse it
BudgetCheck = Callable[[int], bool | None]


def _unit_rows(vectors: NDArray[np.float32]) -> NDArray[np.float64]:
    """Rows scaled to unit length (a zero row stays zero).

    The slot's own copy of ``backends.embeddings.l2_normalize``: unit vectors are
    the daemon's promise whatever the engine returns, and modeld imports no engine.
    """
    v = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(v, axis=-1, keepdims=True)
    out: NDArray[np.float64] = np.divide(v, norms, out=np.zeros_like(v), where=norms > 0)
    return out


def _resolve_default(factory: EngineFactory[PlanT]) -> Path:
    try:
        return Path(factory.default_path())
    except FileNotFoundError as exc:
        raise ModelLoadFailed(str(exc)) from exc


def _check_digest(path: Path, expected: str, actual: str) -> None:
    if expected and expected != actual:
        raise ModelLoadFailed(
            f"{path} has digest {actual}, the request expects {expected}",
            path=str(path),
            expected=expected,
            actual=actual,
        )


class EmbeddingSlot(Generic[PlanT]):
    """One embedding model, loaded on demand next to (never instead of) the generation model.

    ``engine_factory`` is an engine class (``backends.embeddings.LlamaEmbedder`` /
    ``OpenVINOEmbedder``) or anything with the same ``backend``, ``default_path()``,
    ``plan_for(path, config)`` and ``__call__(plan)`` (``EngineFactory``).
    ``budget_check(bytes_needed)`` is called before every load with the new model's
    estimated resident bytes (the previous embedding model, if any, has been
    released by then) and raises ``InsufficientMemory`` to refuse it.
    """

    def __init__(
        self,
        engine_factory: EngineFactory[PlanT],
        idle_unload_s: float = DEFAULT_EMBED_IDLE_S,
        budget_check: BudgetCheck | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory = engine_factory
        self.idle_unload_s = float(idle_unload_s)
        self._budget_check = budget_check
        self._clock = clock
        self._lock = threading.Lock()  # serialises loads, embeds and unloads
        self._state_lock = threading.Lock()  # guards the fields status() reads
        self._engine: EmbeddingEngine[PlanT] | None = None
        self._last_used_mono: float | None = None
        self._last_used_wall: float | None = None
        self._loads = 0
        self._embeds = 0
        self._last_error = ""
        self._closed = False

    @property
    def backend(self) -> str:
        return str(self._factory.backend)

    # --- embedding ---
    def embed(self, req: EmbedRequest) -> EmbedResult:
        return self.embed_with_info(req)[0]

    def embed_with_info(self, req: EmbedRequest) -> tuple[EmbedResult, EmbedInfo]:
        if req.type not in ("", self.backend):
            raise BackendMismatch(
                f"embedding model type {req.type!r} is not served by the {self.backend} backend", type=req.type
            )
        if req.texts and req.text:
            raise InvalidArgument("give either text or texts, not both")
        if not req.texts and not req.text:
            raise InvalidArgument("nothing to embed: text is empty and texts is empty")
        texts = req.inputs()
        t0 = time.perf_counter()
        with self._lock:
            if self._closed:
                raise ModelLoadFailed("the embedding slot is closed")
            engine, loaded_now = self._ensure(req)
            plan = engine.plan
            _check_digest(plan.path, req.digest, plan.digest)
            try:
                counts = engine.count_tokens(texts)
                over = [i for i, n in enumerate(counts) if n > plan.window]
                if over and not req.truncate:
                    first = over[0]
                    raise ContextOverflow(
                        f"input {first} has {counts[first]} tokens; the embedding model's window is "
                        f"{plan.window}; shorten it or set truncate to cut it to the window",
                        index=first,
                        tokens=counts[first],
                        window=plan.window,
                        over=over[:64],
                    )
                raw = engine.embed(texts, counts)
            except ModeldError:
                raise
            except Exception as exc:
                raise Internal(f"embedding failed: {type(exc).__name__}: {exc}") from exc
            finally:
                self._touch()
            if not np.all(np.isfinite(raw)):
                raise Internal("the embedding model produced non-finite values", model=plan.model_name)
            vectors = _unit_rows(raw)
            with self._state_lock:
                self._embeds += len(texts)
        if over:
            log.info("embed: truncated inputs %s to the %d-token window", over[:16], plan.window)
        dims = int(vectors.shape[1]) if vectors.ndim == 2 else 0
        result = EmbedResult(
            model_name=req.model_name or plan.model_name,
            digest=plan.digest,
            dims=dims,
        )
        if req.texts:
            result.vectors = vectors.tolist()
        else:
            result.vector = vectors[0].tolist()
        info = EmbedInfo(
            tokens=counts, truncated=over, window=plan.window, loaded_now=loaded_now, seconds=time.perf_counter() - t0
        )
        return result, info

    def _ensure(self, req: EmbedRequest) -> tuple[EmbeddingEngine[PlanT], bool]:
        path = Path(req.path) if req.path else _resolve_default(self._factory)
        current = self._engine
        if current is not None and os.path.realpath(path) == os.path.realpath(current.plan.path):
            # same model: reuse unless the request asks for another window or thread count
            if not req.config.num_ctx or req.config.num_ctx == current.plan.window:
                if not req.config.num_threads or req.config.num_threads == current.plan.num_threads:
                    return current, False
        plan = self._factory.plan_for(path, req.config)
        _check_digest(plan.path, req.digest, plan.digest)
        if current is not None and current.plan.key == plan.key:
            return current, False
        self._unload_locked()
        if self._budget_check is not None:
            verdict = self._budget_check(plan.resident_bytes)  # raises InsufficientMemory to refuse
            if verdict is False:
                raise InsufficientMemory(
                    f"the embedding model {plan.model_name} needs ~{plan.resident_bytes} bytes, "
                    "which the memory budget cannot hold next to the generation model",
                    needed_bytes=plan.resident_bytes,
                    model=plan.model_name,
                )
        try:
            engine = self._factory(plan)
        except ModeldError as exc:
            with self._state_lock:
                self._last_error = str(exc)
            raise
        except MemoryError as exc:
            raise InsufficientMemory(
                f"out of memory loading the embedding model {plan.path}", needed_bytes=plan.resident_bytes
            ) from exc
        except Exception as exc:
            with self._state_lock:
                self._last_error = str(exc)
            raise ModelLoadFailed(
                f"could not load the embedding model {plan.path}: {type(exc).__name__}: {exc}", path=str(plan.path)
            ) from exc
        with self._state_lock:
            self._engine = engine
            self._loads += 1
            self._last_error = ""
        self._touch()
        return engine, True

    def _touch(self) -> None:
        with self._state_lock:
            self._last_used_mono = self._clock()
            self._last_used_wall = time.time()

    # --- lifecycle ---
    def status(self) -> EmbeddingStatus:
        """A snapshot for the daemon's status; never waits for a running embed."""
        with self._state_lock:
            eng = self._engine
            plan = eng.plan if eng is not None else None
            idle = (self._clock() - self._last_used_mono) if (eng is not None and self._last_used_mono) else None
            return {
                "backend": self.backend,
                "loaded": eng is not None,
                "model_name": plan.model_name if plan else "",
                "path": str(plan.path) if plan else "",
                "digest": plan.digest if plan else "",
                "dims": int(eng.dims) if eng is not None else 0,
                "window": plan.window if plan else 0,
                "pooling": plan.pooling if plan else "",
                "resident_bytes": plan.resident_bytes if plan else 0,
                "last_used": self._last_used_wall,
                "idle_s": round(idle, 3) if idle is not None else None,
                "idle_unload_s": self.idle_unload_s,
                "loads": self._loads,
                "embedded_inputs": self._embeds,
                "last_error": self._last_error,
            }

    def resident_bytes(self) -> int:
        """Estimated bytes the loaded embedding model holds (0 when none): for the memory budget."""
        with self._state_lock:
            return self._engine.plan.resident_bytes if self._engine is not None else 0

    def maybe_unload_idle(self, now: float | None = None) -> bool:
        """Unload the model if unused for ``idle_unload_s``; True if it did. Never waits for a running embed."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            with self._state_lock:
                if self._engine is None or self._last_used_mono is None:
                    return False
                t = self._clock() if now is None else now
                if t - self._last_used_mono < self.idle_unload_s:
                    return False
            self._unload_locked()
            return True
        finally:
            self._lock.release()

    def unload(self) -> bool:
        with self._lock:
            return self._unload_locked()

    def _unload_locked(self) -> bool:
        with self._state_lock:
            eng, self._engine = self._engine, None
        if eng is None:
            return False
        try:
            eng.close()
        except Exception:  # noqa: BLE001 - releasing must not fail the caller
            log.exception("closing the embedding engine failed")
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._unload_locked()
