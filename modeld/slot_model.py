"""The slot's model: the one model it holds, and the load, switch and unload that change it.

``SlotModel`` holds what the slot loaded (the ``LoadedModel``, its ``ActiveModel``, the request that asked for it and
the request planned from it), the generation every load, switch and unload moves on, the running load's progress,
the last failure's reason and the idle clock. It plans a load's memory (``Planner``), keeps the working model
through a failed switch, and unloads a model left idle. ``SlotService`` owns one and keeps the sessions' half: it
checks the fence and the backend type, refuses a load, switch or unload while a session is open, and calls the
methods named ``..._locked`` here with its op lock held. A load, switch or unload changes the model's fields under
the slot's state lock, in the same blocks as the lifecycle's state, the holders' lanes and the busy operation, so
status reads them together.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from contract.errors import InvalidArgument, ModeldError, ModelLoadFailed, ModelNotActive, SlotGenerationStale
from contract.interfaces import Backend, CacheAdmin, LoadedModel
from contract.types import ActiveModel, LoadModelRequest, ModelInfo, OpenSessionRequest, SlotState

from .holders import Holders
from .lifecycle import Lifecycle
from .store.catalog import Catalog

__all__ = ["Planner", "SlotModel"]

log = logging.getLogger("modeld")

#: plans the memory-fitted request for a load (``modeld.capacity.make_planner``);
#: without one the request is loaded as asked and the backend's describe answers
Planner = Callable[[Backend, OpenSessionRequest, int], ModelInfo]


class SlotModel:
    """The slot's model half; see the module docstring."""

    def __init__(
        self,
        backend: Backend,
        *,
        state_lock: threading.Lock,
        life: Lifecycle,
        holders: Holders,
        clock: Callable[[], float],
        busy: Callable[[str], None],
        planner: Planner | None = None,
        cache: CacheAdmin | None = None,
        catalog: Catalog | None = None,
    ) -> None:
        """The slot's own ``state_lock``, ``life``, ``holders`` (the loaded model's lanes are set on them) and
        ``clock``; ``busy``: sets the operation status shows ("load", "unload", "" when it ends), under the state
        lock."""
        self._backend = backend
        self._lock = state_lock
        self._life = life
        self._holders = holders
        self._clock = clock
        self._busy = busy
        self._planner = planner
        self._cache = cache
        self._catalog = catalog
        #: when the slot last had a session or an operation (its clock; a load, a session's close, an operation's
        #: end set it): the idle unload counts from here
        self.last_active = clock()
        #: moves on with every load, switch and unload (a session of an older one is stale)
        self.generation = 0
        self.loaded: LoadedModel | None = None
        self.active: ActiveModel | None = None
        #: what the load was asked for (a request matches the loaded model against it)
        self.request: OpenSessionRequest | None = None
        #: what was actually loaded (the planned context), to load it again after a failed switch
        self.planned: OpenSessionRequest | None = None
        #: why the last load or switch failed ("" since the last one that succeeded)
        self.last_error = ""
        #: the running load's share done, 0..1 (None when no load runs)
        self.progress: float | None = None

    # --- checks ----------------------------------------------------------------------
    def check_generation(self, expected: int) -> None:
        """SlotGenerationStale unless ``expected`` is the slot's generation (0: any)."""
        if expected and expected != self.generation:
            raise SlotGenerationStale(
                f"expected generation {expected}, slot is at {self.generation}",
                expected=expected,
                current=self.generation,
            )

    def by_name(self, req: OpenSessionRequest) -> OpenSessionRequest:
        """``req`` with the path of the model its name names (``catalog``), when it gives no path; its name
        made the catalog's own (an alias leads to the model's name)."""
        if req.path or not req.model_name or self._catalog is None:
            return req
        known = self._catalog.resolve(req.model_name)
        if known is None:
            return req
        return req.model_copy(update={"model_name": known.name, "path": known.path})

    def matches(self, req: OpenSessionRequest) -> bool:
        cur = self.request
        if cur is None or self.active is None:
            return False
        if req.path and os.path.realpath(req.path) != os.path.realpath(cur.path):
            return False
        if req.digest and req.digest != self.active.digest:
            return False
        if req.model_name and req.model_name != cur.model_name:
            return False
        # A default config means "whatever is loaded"; an explicit one must match.
        if req.config != type(req.config)() and req.config != cur.config:
            return False
        return True

    def load_request(self, req: LoadModelRequest) -> OpenSessionRequest:
        """What ``load_model`` loads: ``req`` as an open's request, with the path of the model it names."""
        open_req = self.by_name(OpenSessionRequest.model_validate(req.model_dump(exclude={"expected_generation"})))
        if not open_req.path:
            raise InvalidArgument("load needs a model path, or the name of a model the daemon knows"
                                  + (f" ({', '.join(self._catalog.names())})" if self._catalog is not None else ""))
        return open_req

    def kept(self, req: OpenSessionRequest) -> ActiveModel | None:
        """The loaded model when it is the one ``req`` asks for, config and all (loading it again changes nothing)."""
        if self.loaded is not None and self.matches(req) and req.config == self.request.config:  # type: ignore[union-attr]
            assert self.active is not None
            return self.active
        return None

    # --- load and switch ---------------------------------------------------------------
    def describe(self, req: OpenSessionRequest, op_lock: threading.RLock) -> ModelInfo:
        """What a load of ``req`` would get: the planner's fit (the backend's describe without one), crediting the
        memory a switch would release. The planner runs under ``op_lock`` (the slot's): never beside a load."""
        req = self.by_name(req)
        if not req.path:
            if self.request is None:
                raise ModelNotActive("no model is loaded and the request names no path")
            req = req.model_copy(update={"path": self.request.path})
        resident = self.loaded
        credit = 0
        if resident is not None and not self.matches(req):
            credit = resident.resident_bytes()  # a switch would release it
        with op_lock:
            info = self._planner(self._backend, req, credit) if self._planner is not None else self._backend.describe(req, credit)
        if self._cache is not None:
            c = self._cache.status()
            info = info.model_copy(update={"cache_ram_bytes": c["ram_bytes"], "cache_ram_budget_bytes": c["ram_budget_bytes"]})
        return info

    def load_locked(self, req: OpenSessionRequest) -> ActiveModel:
        """Load ``req``; a switch never leaves the slot without the working model when the new one fails.

        When the planner says the new model fits next to the old one (the same
        plan as with the old one's memory credited), the new one loads first and
        the old one is released only after it succeeded. Otherwise the old one is
        released first, and a failed load brings it back. Only when that fails too
        is the slot ``Failed`` (``last_error`` names both).
        """
        switching = self.loaded is not None
        credit = self.loaded.resident_bytes() if self.loaded is not None else 0
        if self._cache is not None:
            credit += self._cache.status()["ram_bytes"]  # handed back before the load (release_ram)
        info: ModelInfo | None = None
        asked = req  # identity for later matching: what the caller asked, not what was planned
        if self._planner is not None:
            # Memory fit first, before anything is released or allocated.
            try:
                info = self._planner(self._backend, req, credit)
            except ModeldError as exc:
                with self._lock:
                    self.last_error = f"{type(exc).__name__}: {exc.message}"  # nothing changed but the reason
                raise
            planned = {"num_ctx": info.effective_context}
            if req.config.num_gpu_layers != 0:
                # the layers the plan gave the GPU ("auto" resolved, a count clamped or cut to what fits): the
                # load must not offload more than the memory that was planned for
                planned["num_gpu_layers"] = info.resolved_gpu_layers
            req = req.model_copy(update={"config": req.config.model_copy(update=planned)})
        alongside = switching and self._fits_alongside(asked, info)
        with self._lock:
            self._life.move(SlotState.SWITCHING if switching else SlotState.LOADING)
            self._busy("load")
            self.progress = 0.0
        previous = (self.planned, self.request) if switching else None
        try:
            if self.loaded is not None and not alongside:
                self.release_locked()
            if self._cache is not None:
                self._cache.release_ram()  # the cache never holds RAM a model load needs
            loaded = self._backend.load(req, self._on_progress)
        except Exception as exc:
            err = exc if isinstance(exc, ModeldError) else ModelLoadFailed(f"{type(exc).__name__}: {exc}", path=req.path)
            if previous is not None and self.loaded is None:
                self._restore_previous_locked(previous, err)
            else:
                self._fail_locked(err)  # the old model never left: Ready, with the reason in last_error
            if err is exc:
                raise
            raise err from exc
        if alongside:
            self.release_locked()  # the new model is ready: now the old one goes
        return self._install_locked(loaded, req, asked, info)

    def _fits_alongside(self, asked: OpenSessionRequest, with_credit: ModelInfo | None) -> bool:
        """Whether the planner gives the same plan without the old model's memory (then both fit at once).

        Without a planner nothing says they do not (in-process use on the memory backend).
        """
        if self._planner is None or with_credit is None:
            return True
        try:
            alone = self._planner(self._backend, asked, 0)
        except ModeldError:
            return False
        return alone.effective_context == with_credit.effective_context

    def _install_locked(
        self, loaded: LoadedModel, req: OpenSessionRequest, asked: OpenSessionRequest, info: ModelInfo | None
    ) -> ActiveModel:
        active = ActiveModel(
            model_name=req.model_name or os.path.basename(req.path),
            type=self._backend.name,
            digest=loaded.digest,
            path=req.path,
            config=req.config.model_copy(update={"num_ctx": loaded.num_ctx}),
            generation=self.generation + 1,
            effective_context=loaded.num_ctx,
            chat_template=loaded.template_origin,
            tool_format=loaded.tool_format_origin,
            capabilities=list(loaded.capabilities),
            loaded_at=time.time(),
            gpu_layers=req.config.num_gpu_layers if info is not None else 0,
            n_layer=info.n_layer if info is not None else 0,
            gpu_layers_reason=info.gpu_layers_reason if info is not None else "",
        )
        try:
            with self._lock:
                self._life.move(SlotState.READY)
                self.loaded = loaded
                self._holders.set_lanes(loaded.lanes)
                self.request = asked
                self.planned = req
                self.active = active
                self.generation += 1
                self._busy("")
                self.progress = None
                self.last_error = ""
                self.last_active = self._clock()
        except ModeldError:
            loaded.close()  # refused (a shutdown raced the load): nothing may stay resident unowned
            raise
        if self._cache is not None and info is not None:
            # RAM the model leaves spare: host memory only (what it holds on a GPU is no RAM the cache could use)
            host_usable = info.usable_bytes - info.gpu_usable_bytes
            host_required = info.required_bytes - info.gpu_required_bytes
            self._cache.fit_ram(max(0, host_usable - host_required))
        return active

    def _restore_previous_locked(
        self, previous: tuple[OpenSessionRequest | None, OpenSessionRequest | None], err: ModeldError
    ) -> None:
        """After a failed switch that had released the old model: load the old one again (a new generation)."""
        planned, asked = previous
        if planned is None or asked is None:
            self._fail_locked(err)
            return
        try:
            loaded = self._backend.load(planned, self._on_progress)
        except Exception as again:
            self._fail_locked(err)
            with self._lock:
                self.last_error += f"; reloading the previous model failed too: {type(again).__name__}: {again}"
            return
        self._install_locked(loaded, planned, asked, None)
        with self._lock:
            self.last_error = f"{type(err).__name__}: {err.message} (the previous model was loaded again)"

    def _on_progress(self, fraction: float) -> None:
        done = max(0.0, min(1.0, float(fraction)))
        with self._lock:
            before = self.progress
            self.progress = done
        # a log line per tenth: what `modeld serve` shows while it preloads (engines report often)
        if before is not None and int(done * 10) > int(before * 10):
            log.info("loading the model: %d%%", int(done * 10) * 10)

    def _fail_locked(self, exc: ModeldError) -> None:
        with self._lock:
            self._life.move(SlotState.FAILED if self.loaded is None else SlotState.READY)
            self._busy("")
            self.progress = None
            self.last_error = f"{type(exc).__name__}: {exc.message}"

    # --- release and unload ------------------------------------------------------------
    def release_locked(self) -> None:
        """The model goes and its fields with it; the state is the caller's to move (an unload, a switch, the
        slot's shutdown)."""
        loaded = self.loaded
        with self._lock:
            self.loaded = None
            self._holders.set_lanes(1)
            self.active = None
            self.request = None
            self.planned = None
        if loaded is not None:
            loaded.close()  # a tape engine saves its tape to the workspace cache first

    def unload_locked(self) -> None:
        """Ready -> Unloading -> Empty: the model goes (its tape to the workspace cache), the generation moves on."""
        with self._lock:
            self._life.move(SlotState.UNLOADING)
            self._busy("unload")
        self.release_locked()
        if self._cache is not None:
            self._cache.release_ram()
        with self._lock:
            self._life.move(SlotState.EMPTY)
            self.generation += 1
            self._busy("")

    def unload_if_idle_locked(self, idle_unload_s: float, *, shutting_down: bool) -> None:
        """Unload the model when no session and no operation came for ``idle_unload_s`` (0: never)."""
        if not idle_unload_s or self.loaded is None or self._holders.first is not None or shutting_down:
            return
        if self._clock() - self.last_active <= idle_unload_s or self._life.state is not SlotState.READY:
            return
        log.info("unloading the model: idle for %.0f s", self._clock() - self.last_active)
        self.unload_locked()
