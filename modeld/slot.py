"""The single model slot: one backend, one resident model, one session holder at a time.

``SlotService`` implements the contract's Service and ModelController on top of
one ``Backend``. It adds what a daemon needs and a backend should not know:

* the SlotState machine (``modeld.lifecycle``: every state change is checked
  against its table) and a generation counter bumped on every load, switch and unload, with
  ``expected_generation`` making load/unload conditional;
* owner fencing (StaleFence) and backend type checks (BackendMismatch);
* one session holder at a time (ModelBusy), or one a lane on a model that serves
  several at once (``LoadedModel.lanes``); open_session auto-loads an empty
  slot, a different model needs an explicit load (ModelSwitchRequired);
* session handles (``modeld.slot_session``) bound to the owner and generation,
  so a switch invalidates them, and a lease so a vanished client does not hold the slot forever;
* closing a session releases the slot but keeps the model's KV resident, so
  the next session on the same model starts warm.

Threading: on a model of one lane, model operations are expected to run on one
worker thread (the daemon guarantees it; ``_op_lock`` makes in-process use safe
too). On a model of several, the daemon runs a model worker a lane: an operation
holds its lane's lock (``Holders.lock``), never ``_op_lock``, so operations on
different lanes run at once while loads, switches and unloads (refused while a
session is open) still exclude each other. ``status()`` only takes the short
``_state_lock`` so it answers while a decode runs.

The sessions holding the slot and the lanes they are on are ``modeld.holders``'.
The model's half is ``modeld.slot_model``'s ``SlotModel``: the loaded model and
its generation, the load, switch and unload with their memory plan, the idle
unload. The service owns one and calls it with ``_op_lock`` held, once it has
checked the fence, the backend type and that no session stands in the way; what
stays here is the sessions' half (opening, forking and closing sessions, their
lanes, leases and operations, the owner's takeover) and status.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from typing import Protocol, TypeVar

from contract import interrupt
from contract.errors import (
    BackendMismatch,
    LostOwner,
    ModelBusy,
    ModeldError,
    ModelNotActive,
    ModelNotFound,
    ModelSwitchRequired,
    SessionClosed,
    ShuttingDown,
    SlotGenerationStale,
    StaleFence,
    UnsupportedFeature,
)
from contract.interfaces import Backend, CacheAdmin, Embedder, Session
from contract.manifest import ContextManifest
from contract.sizing import MemoryPool
from contract.types import (
    DEFAULT_SAMPLING,
    ActiveModel,
    CacheEntryInfo,
    DaemonStatus,
    EmbedRequest,
    EmbedResult,
    LoadModelRequest,
    ModelInfo,
    OpenSessionRequest,
    ReadoutInfo,
    RunningTurn,
    SamplingParams,
    SlotState,
    StreamChunk,
    UnloadModelRequest,
    owner_fingerprint,
)
from contract.wire import PROTOCOL_VERSION

from .holders import Holder, Holders
from .lifecycle import Lifecycle, TransitionHook
from .settings import ServeSettings
from .slot_model import Planner, SlotModel
from .slot_session import SlotSession
from .store.catalog import Catalog

__all__ = ["PREFILL_OPS", "STATUS_REUSE_S", "Planner", "SlotService", "SlotSettings"]

log = logging.getLogger("modeld")

#: the operations that prefill (a session's turn is in its "prefill" phase while one runs)
PREFILL_OPS = frozenset({"ensure_prefix", "prefill_suffix"})

#: a status built this recently is answered again while nothing discrete changed (``SlotService.status``)
STATUS_REUSE_S = 0.05

_T = TypeVar("_T")


class SlotSettings(Protocol):
    """What the slot reads of the serve settings (``modeld.settings.ServeSettings`` is one; a test builds one with
    ``ServeSettings.model_construct(lease=...)``)."""

    @property
    def owner(self) -> str: ...  # the owner fence's id ("" = none); a takeover replaces it while serving

    @property
    def lease(self) -> float: ...  # seconds a silent client keeps its session

    @property
    def idle_unload(self) -> float: ...  # unload after this long without a session or an operation (0 = never)

    @property
    def session_ttl(self) -> float: ...  # release a session with no operation for this long (0 = never)

    @property
    def temperature(self) -> float | None: ...  # of requests that set none (None: the model's)

    @property
    def max_tokens(self) -> int | None: ...  # the reply length of requests that set none (None: no limit)


class SlotService:
    """Service + ModelController over one Backend; see the module docstring."""

    def __init__(
        self,
        backend: Backend,
        settings: SlotSettings | None = None,
        *,
        planner: Planner | None = None,
        endpoint: str = "",
        embedder: Embedder | None = None,
        cache: CacheAdmin | None = None,
        backend_reason: str = "",
        catalog: Catalog | None = None,
        devices: Callable[[], Sequence[MemoryPool]] = lambda: (),
        build: str = "",
        gpu_offload: bool = False,
        clock: Callable[[], float] = time.monotonic,
        on_transition: TransitionHook | None = None,
        readouts: ReadoutInfo | None = None,
    ) -> None:
        """``settings``: the serve settings' defaults when None. ``clock``: seconds from any fixed point, what
        leases, the session TTL and the idle unload are measured on (a test advances its own instead of sleeping);
        ``on_transition``: told each state change."""
        self.backend = backend
        #: the readout manifest the backend serves (``serve --readouts``), for status
        self.readouts = readouts
        settings = settings if settings is not None else ServeSettings.model_construct()
        self._clock = clock
        #: the models loadable by name (``modeld load NAME``, a request naming another model); None: by path only
        self.catalog = catalog
        #: the machine's GPUs now (``backends.devices.read_gpus``, wired by the composition root), for status
        self.devices = devices
        #: what the engine was built with, and whether that build offloads to a GPU (status says both)
        self.build = build
        self.gpu_offload = gpu_offload
        #: ``modeld serve --temperature``: the temperature of requests that set none (None: the model's)
        self.default_temperature = settings.temperature
        #: ``modeld serve --max-tokens``: the reply length of requests that set none (None: no limit)
        self.default_max_tokens = settings.max_tokens
        #: the workspace cache the backend's models save to (status, listing, memory hand-back)
        self.cache = cache
        #: why this backend serves (``--backend auto`` says), shown in status
        self.backend_reason = backend_reason
        #: unload the model after this long without a session or an operation (0 = never)
        self.idle_unload_s = settings.idle_unload
        #: release a session with no operation for this long, heartbeats or not (0 = never)
        self.session_ttl_s = settings.session_ttl
        #: the owner epoch (``takeover`` needs a higher one) and the sessions a takeover ended
        self.owner_epoch = 0
        self._lost: set[str] = set()
        self.owner = settings.owner
        self.lease_s = settings.lease
        self.endpoint = endpoint
        self._embedder = embedder
        self._state_lock = threading.Lock()
        self._op_lock = threading.RLock()
        self._life = Lifecycle(on_transition)
        #: the sessions that hold the slot, and the loaded model's lanes they are on
        self._sessions = Holders()
        #: the model's half: the loaded model, its generation, its loads, switches and unloads
        self._model = SlotModel(backend, state_lock=self._state_lock, life=self._life, holders=self._sessions,
                                clock=clock, busy=self._show_busy, planner=planner, cache=cache, catalog=catalog)
        #: operations running now (on a model of several lanes, several at once)
        self._running_ops = 0
        self._busy_op = ""
        #: when the busy operation started (the slot's clock), and how many starts and ends there were
        self._busy_since = self._clock()
        self._ops = 0
        #: the last status built: (``_status_key`` then, when, the status)
        self._kept_status: tuple[tuple[object, ...], float, DaemonStatus] | None = None
        self._shutting_down = False
        self._backend_version = backend.runtime_version()

    # --- status (any thread) ---------------------------------------------------------
    def status(self) -> DaemonStatus:
        """The slot's status. While nothing discrete changed (no operation started or ended, no move of state,
        holder, model or progress) a status built less than ``STATUS_REUSE_S`` ago is answered again: a client
        polling during a decode gets it without the IO thread building it anew (the engine's figures, the store
        on disk, the devices), and what it shows of the running turn is at most that old."""
        key = self._status_key()
        now = time.monotonic()
        kept = self._kept_status
        if kept is not None and kept[0] == key and now - kept[1] < STATUS_REUSE_S:
            return kept[2].model_copy()
        st = self._status()
        if self.catalog is not None:  # read from disk, outside the state lock
            st = st.model_copy(update={"models": self.catalog.status()})
        self._kept_status = (key, now, st)
        return st.model_copy()

    def _status_key(self) -> tuple[object, ...]:
        """What changes with every discrete change of the slot (``status`` answers a kept status while it holds)."""
        holder = self._sessions.first
        embeds = self._embedder.status() if self._embedder is not None else None  # (a few fields under its lock)
        model = self._model
        return (self._ops, self._life.state, model.generation, self._busy_op, holder.session_id if holder else "",
                holder.vanished if holder else False, self._sessions.beside(), model.progress, model.last_error,
                self.owner, self.owner_epoch, self._shutting_down,
                (embeds["loads"], embeds["embedded_inputs"], embeds["loaded"], embeds["last_error"])
                if embeds is not None else None)

    def _status(self) -> DaemonStatus:
        gpus = [d.device_info() for d in self.devices()]  # NVML, outside the lock: it never waits on the slot
        model = self._model
        with self._state_lock:
            active, loaded = model.active, model.loaded
            if active is not None and loaded is not None:
                active = active.model_copy(update={"resident_bytes": loaded.resident_bytes()})
            speculation = loaded.speculation() if loaded is not None else None
            return DaemonStatus(
                owner_instance_id=owner_fingerprint(self.owner),
                owner_epoch=self.owner_epoch,
                backend=self.backend.name,
                backend_reason=self.backend_reason,
                backend_version=self._backend_version,
                protocol_version=PROTOCOL_VERSION,
                state=self._life.state,
                active=active,
                generation=model.generation,
                busy_operation=self._busy_op,
                turn=self._running_turn(),
                turns=[self._lane_turn(h) for h in self._holders()] if self._sessions.concurrent else [],
                last_error=model.last_error,
                load_progress=model.progress,
                session_open=self._sessions.first is not None,
                sessions_open=len(self._holders()),
                session_lanes=self._sessions.lanes,
                pid=os.getpid(),
                endpoint=self.endpoint,
                embedding=self._embedder.status() if self._embedder is not None else None,
                cache=dict(self.cache.status()) if self.cache is not None else None,
                readouts=self.readouts,
                idle_s=None if loaded is None or self._sessions.first is not None else round(self._clock() - model.last_active, 1),
                idle_unload_s=self.idle_unload_s,
                session_ttl_s=self.session_ttl_s,
                speculation=speculation,
                sampling=self.sampling_defaults() if loaded is not None else None,
                devices=gpus,
                gpu_offload=self.gpu_offload,
                build=self.build,
            )

    @property
    def generation(self) -> int:
        return self._model.generation

    # --- checks ----------------------------------------------------------------------
    def _check_fence(self, owner: str) -> None:
        if self.owner and owner != self.owner:
            # the owner id is not repeated back: it would hand the fence to whoever asked
            raise StaleFence(f"fence {owner!r} does not match the daemon owner", got=owner)

    def _check_type(self, type_: str) -> None:
        if type_ not in ("", self.backend.name):
            raise BackendMismatch(
                f"model type {type_!r} is not served by this modeld backend ({self.backend.name!r})",
                type=type_,
                backend=self.backend.name,
            )

    def _check_live(self) -> None:
        if self._shutting_down:
            raise ShuttingDown("modeld is shutting down")

    def _transition(self, to: SlotState) -> None:
        """``Lifecycle.move``; the caller holds ``_state_lock`` (fields that change with it change together)."""
        self._life.move(to)

    def _set_busy(self, op: str, holder: Holder | None = None) -> None:
        """An operation ``op`` of ``holder``'s starts ("": one ends). Status shows the latest to start while any
        runs, and each session's own on a model of several lanes."""
        with self._state_lock:
            self._running_ops = self._running_ops + 1 if op else max(0, self._running_ops - 1)
            if op or not self._running_ops:
                self._busy_op = op
                self._busy_since = self._clock()
            if holder is not None:
                holder.op, holder.op_since = op, self._clock()
            self._ops += 1
        if op == "decode":
            interrupt.decoded(0)

    def _show_busy(self, op: str) -> None:
        """The model's half runs ``op`` ("load", "unload"; "" once it ended): status shows it as the busy
        operation. The caller holds ``_state_lock``."""
        self._busy_op = op

    def _running_turn(self) -> RunningTurn | None:
        """The turn that holds the slot, for status (the caller holds ``_state_lock``)."""
        h = self._sessions.first
        if h is None:
            return None
        if self._sessions.concurrent:
            return self._lane_turn(h)
        return self._progress_of(self._turn_of(h, self._busy_op, self._busy_since), self._busy_op)

    def _turn_of(self, h: Holder, op: str, since: float) -> RunningTurn:
        """``h``'s turn running ``op`` (since ``since``, the slot's clock; "" between operations)."""
        now = self._clock()
        return RunningTurn(session_id=h.session_id, client=h.client, age_s=round(now - h.opened, 1),
                           operation=op, operation_s=round(now - since, 1) if op else 0.0)

    def _lane_turn(self, h: Holder) -> RunningTurn:
        """A session's turn on a model of several lanes, from its own operation; how far it came only while it
        runs the one operation running (the engine reports one prefill's and one decode's progress at a time)."""
        turn = self._turn_of(h, h.op, h.op_since)
        if h.op and self._running_ops == 1:
            return self._progress_of(turn, h.op)
        turn.phase = "decode" if h.op == "decode" else "prefill" if h.op in PREFILL_OPS else h.op or "idle"
        return turn

    @staticmethod
    def _progress_of(turn: RunningTurn, op: str) -> RunningTurn:
        span = interrupt.prefill_span()
        if op == "decode":
            turn.phase, turn.done = "decode", interrupt.decode_progress()
        elif span is not None:
            turn.phase, (turn.reused, turn.total, turn.done) = "prefill", span
        else:
            turn.phase = op or "idle"
        return turn

    def session_client(self, session_id: str) -> str:
        """Who opened ``session_id`` (``OpenSessionRequest.client``), "" when it holds nothing or did not say."""
        with self._state_lock:
            h = self._held(session_id)
            return h.client if h is not None else ""

    def check_owner(self, owner: str) -> None:
        """StaleFence unless ``owner`` is the daemon's owner (any caller, when the daemon has none)."""
        self._check_fence(owner)

    # --- ModelController (the model's half: ``modeld.slot_model``) -------------------------
    def load_model(self, req: LoadModelRequest) -> ActiveModel:
        with self._op_lock:
            self._check_live()
            self._check_fence(req.owner_instance_id)
            self._check_type(req.type)
            self._model.check_generation(req.expected_generation)
            open_req = self._model.load_request(req)
            kept = self._model.kept(open_req)
            if kept is not None:
                return kept
            self._reap_locked()
            if self._sessions.first is not None:
                raise ModelBusy("a session holds the slot; close it before switching models")
            return self._model.load_locked(open_req)

    @property
    def load_progress(self) -> float | None:
        """The running load's share done, 0..1 (None when no load runs); any thread may read it."""
        return self._model.progress

    def unload_model(self, req: UnloadModelRequest) -> None:
        with self._op_lock:
            self._check_fence(req.owner_instance_id)
            self._model.check_generation(req.expected_generation)
            if self._model.loaded is None:
                if self._life.state is SlotState.FAILED:
                    with self._state_lock:
                        self._transition(SlotState.EMPTY)
                return  # idempotent on an empty slot
            self._reap_locked()
            if self._sessions.first is not None:
                raise ModelBusy("a session holds the slot; close it before unloading")
            self._model.unload_locked()

    # --- Service ---------------------------------------------------------------------
    def open_session(self, req: OpenSessionRequest) -> SlotSession:
        with self._op_lock:
            self._check_live()
            self._check_fence(req.owner_instance_id)
            self._check_type(req.type)
            self._reap_locked()
            model = self._model
            if req.switch:
                req = model.by_name(req)
            switch = model.loaded is not None and not model.matches(req)
            if switch and not req.switch:
                # Checked before busy: the caller must switch explicitly either way.
                assert model.active is not None
                raise ModelSwitchRequired(
                    f"slot holds {model.active.model_name!r}; load the requested model explicitly to switch",
                    active=model.active.model_name,
                    requested=req.model_name or req.path,
                )
            if self._sessions.first is not None and (switch or self._free_lane(req.client) is None):
                raise ModelBusy("another session holds the slot")  # whose is nobody else's business
            if model.loaded is None or switch:
                if not req.path:
                    if req.model_name and self.catalog is not None:
                        raise ModelNotFound(f"no model {req.model_name!r} is known here; the daemon can load: "
                                            + ", ".join(self.catalog.names()), requested=req.model_name)
                    raise ModelNotActive("no model is loaded and the request names no path")
                model.load_locked(req)  # a switch keeps the working model when the new one fails
            assert model.loaded is not None
            lane = self._free_lane(req.client)
            assert lane is not None  # (no session is open, or the check above found a lane free)
            now = self._clock()
            holder = Holder(
                session_id=uuid.uuid4().hex,
                generation=model.generation,
                owner=req.owner_instance_id,
                inner=model.loaded.open_session(lane),
                last_seen=now,
                last_op=now,
                client=req.client,
                opened=now,
                lane=lane,
            )
            self._sessions.opened_on(lane, req.client)
            try:
                with self._state_lock:
                    if self._sessions.first is None:
                        self._transition(SlotState.BUSY)
                    self._sessions.add(holder)
            except ModeldError:
                holder.inner.close()
                raise
            return SlotSession(self, holder)

    def _free_lane(self, client: str) -> int | None:
        """A lane of the loaded model no open session is on (0 while none is loaded), None when every one is taken."""
        return self._sessions.free_lane(client)

    def full(self, opening: int = 0, req: OpenSessionRequest | None = None) -> bool:
        """Whether the open ``req`` would find no room now, with ``opening`` others on their way in before it: every
        lane of the loaded model taken (one session holds a model of one lane), or, for an open that switches to
        another model, any session open (a switch needs the slot free of them)."""
        with self._state_lock:
            taken = self._sessions.lanes_taken() + opening
        if req is not None and req.switch and taken and not self._model.matches(self._model.by_name(req)):
            return True
        return taken >= self._sessions.lanes

    def describe(self, req: OpenSessionRequest) -> ModelInfo:
        self._check_fence(req.owner_instance_id)
        self._check_type(req.type)
        return self._model.describe(req, self._op_lock)

    def embed(self, req: EmbedRequest) -> EmbedResult:
        """Embeddings from the side slot: never touches the generation model or its KV.

        Deliberately outside ``_op_lock``, so an embed runs while a decode streams.
        """
        self._check_live()
        self._check_fence(req.owner_instance_id)
        self._check_type(req.type)
        if self._embedder is None:
            # the generation model never embeds: Llama.embed on it would wipe the resident KV
            raise UnsupportedFeature("no embedding model is configured for this daemon")
        result, info = self._embedder.embed_with_info(req)
        return result.model_copy(update={"tokens": list(info.tokens), "truncated": list(info.truncated)})

    def generation_resident_bytes(self) -> int:
        loaded = self._model.loaded
        return loaded.resident_bytes() if loaded is not None else 0

    def sampling_defaults(self) -> SamplingParams:
        """What a request that sets no sampling parameter gets: the loaded model's recommendation, else the
        documented defaults; ``--temperature`` overrides the temperature (0: greedy), and ``--max-tokens`` gives
        the reply length."""
        loaded = self._model.loaded
        found = loaded.sampling_defaults() if loaded is not None else DEFAULT_SAMPLING
        if self.default_temperature is not None:
            found = found.model_copy(update={"temperature": self.default_temperature, "source": "settings"})
        if self.default_max_tokens is not None:
            found = found.model_copy(update={"max_tokens": self.default_max_tokens})
        return found

    def manifest_defaults(self) -> ContextManifest:
        """The loaded model's runtime identity (an empty manifest when the slot is empty)."""
        loaded = self._model.loaded
        return loaded.manifest_defaults() if loaded is not None else ContextManifest()

    # --- leases and holders ------------------------------------------------------------
    def _holder_for(self, holder: Holder) -> Session:
        if holder.session_id in self._lost:
            raise LostOwner("a newer owner took the daemon over; this session was ended", session_id=holder.session_id)
        if holder.closed:
            raise SessionClosed("session is closed", session_id=holder.session_id)
        if holder.generation != self._model.generation:
            raise SlotGenerationStale(
                "the slot was switched or unloaded since this session was opened",
                session_generation=holder.generation,
                current=self._model.generation,
            )
        if not self._sessions.holds(holder):
            raise SessionClosed("session was released (lease expired or closed)", session_id=holder.session_id)
        if self.owner and holder.owner != self.owner:
            raise StaleFence("the daemon's owner changed since this session was opened")
        holder.last_seen = self._clock()
        return holder.inner

    def _holders(self) -> list[Holder]:
        """The sessions holding the slot: the first, its forks, the sessions on the other lanes."""
        return self._sessions.all()

    def _held(self, session_id: str) -> Holder | None:
        return self._sessions.held(session_id)

    def holds(self, session_id: str) -> bool:
        """Whether ``session_id`` holds the slot (the holder or one of its forks)."""
        return self._held(session_id) is not None

    def fork_session(self, holder: Holder, at_position: int) -> SlotSession:
        """A session forked from ``holder``'s at ``at_position`` (``Session.fork``): the caller's, on the same
        model and generation; it holds the slot beside the holder until closed or its lease runs out."""
        with self._op_lock:
            inner = self._holder_for(holder)
            now = self._clock()
            with self._lane(holder):
                forked = inner.fork(at_position)
            fork = Holder(session_id=uuid.uuid4().hex, generation=holder.generation, owner=holder.owner,
                           inner=forked, last_seen=now, last_op=now, client=holder.client, opened=now, lane=holder.lane)
            with self._state_lock:
                self._sessions.add(fork)
            return SlotSession(self, fork)

    def touch(self, session_id: str) -> bool:
        with self._state_lock:
            h = self._held(session_id)
            if h is not None and not h.closed:
                h.last_seen = self._clock()
                return True
            return False

    def vanished(self, session_id: str) -> bool:
        """The client of ``session_id`` is gone (its connections closed): the next reap releases the session
        whatever its lease says. False when it does not hold the slot."""
        with self._state_lock:
            h = self._held(session_id)
            if h is None or h.closed:
                return False
            h.vanished = True
            return True

    def expired_holder(self) -> str:
        """The session id of a holder whose lease has run out, even mid-operation ("" when none)."""
        with self._state_lock:
            for h in self._holders():
                if not h.closed and self._clock() - h.last_seen > self.lease_s:
                    return h.session_id
            return ""

    def reap(self) -> bool:
        """Release a holder whose lease or TTL expired, unload an idle model; True when a holder went."""
        if self._embedder is not None:
            self._embedder.maybe_unload_idle()
        with self._op_lock:
            gone = self._reap_locked()
            self._model.unload_if_idle_locked(self.idle_unload_s, shutting_down=self._shutting_down)
            return gone

    def _reap_locked(self) -> bool:
        gone = False
        now = self._clock()
        for h in self._holders():
            if h.in_operation:
                continue
            lease_out = now - h.last_seen > self.lease_s
            ttl_out = self.session_ttl_s > 0 and now - h.last_op > self.session_ttl_s
            if lease_out or ttl_out or h.vanished:
                why = ("its client is gone, or modeld cancel ended its turn" if h.vanished else
                       "its lease ran out" if lease_out else "it ran no operation for its TTL")
                log.info("released session %s%s: %s", h.session_id[:8], f" ({h.client})" if h.client else "", why)
                self._release_holder(h)
                gone = True
        return gone

    def _release_holder(self, holder: Holder) -> None:
        if holder.closed:
            return
        holder.closed = True
        self._model.last_active = self._clock()  # the idle clock starts when the last session goes
        try:
            holder.inner.close()
        finally:
            with self._state_lock:
                # a fork, or a session on another lane, goes on holding the slot; the last one out frees it
                if self._sessions.remove(holder) and self._life.state is SlotState.BUSY:
                    self._transition(SlotState.READY)

    def release_session(self, session_id: str) -> None:
        with self._op_lock:
            h = self._held(session_id)
            if h is not None:
                self._release_holder(h)

    def holder_id(self) -> str:
        h = self._sessions.first
        return h.session_id if h is not None else ""

    def run_op(self, holder: Holder, name: str, fn: Callable[[Session], _T]) -> _T:
        with self._op_lock:
            inner = self._holder_for(holder)
            holder.in_operation += 1
            self._set_busy(name, holder)
            if not self._sessions.concurrent:  # one lane: the operation runs under the op lock, as everything else
                try:
                    return fn(inner)
                finally:
                    self._op_ended(holder)
        try:  # several lanes: under its lane's lock only, beside the other lanes' operations
            with self._lane(holder):
                return fn(inner)
        finally:
            with self._op_lock:
                self._op_ended(holder)

    def _op_ended(self, holder: Holder) -> None:
        holder.in_operation -= 1
        holder.last_seen = holder.last_op = self._model.last_active = self._clock()
        self._set_busy("", holder)

    def _lane(self, holder: Holder) -> threading.RLock | contextlib.nullcontext[None]:
        return self._sessions.lock(holder)

    def stream_op(self, holder: Holder, it: Generator[StreamChunk, None, None]) -> Generator[StreamChunk, None, None]:
        """``it`` (a decode's stream, begun by ``run_op``) as an operation of ``holder``'s until it ends or is closed.

        The op lock is not held across yields: the daemon's single worker thread serialises model work, and a
        suspended generator must not pin a lock. On a model of several lanes the stream holds its lane's lock
        (another session on that lane, a fork, waits for the stream's end), which the worker driving the stream
        releases by running it to its end or closing it. The chunks do not renew the lease: only the client's own
        messages (its heartbeats) do, so a client that stopped reading loses the slot."""
        holder.in_operation += 1
        self._set_busy("decode", holder)
        try:
            with self._lane(holder):
                yield from it
        finally:
            it.close()  # cancels the backend within one token
            holder.in_operation -= 1
            holder.last_op = self._clock()
            self._set_busy("", holder)

    def now(self) -> float:
        """The slot's clock (leases, the session TTL and the idle unload are measured on it)."""
        return self._clock()

    # --- idle work (the model worker) -------------------------------------------------
    def idle_pending(self) -> bool:
        """Whether the loaded model has work for the idle slot (``LoadedModel.idle_work``) it can do now."""
        with self._state_lock:
            loaded = self._model.loaded if self._life.state is SlotState.READY and self._sessions.first is None else None
        return loaded is not None and loaded.idle_pending()

    def idle_work(self) -> None:
        """Run the loaded model's idle work; the worker's interrupt scope stops it when a request arrives. Status
        shows no busy operation meanwhile: a request does not wait for it (``speculation.pending`` says it runs)."""
        with self._op_lock:
            loaded = self._model.loaded
            if loaded is not None and self.idle_pending():
                loaded.idle_work()

    # --- shutdown ----------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._state_lock:
            self._shutting_down = True
            self._transition(SlotState.SHUTTING_DOWN)
        if self._embedder is not None:
            self._embedder.close()
        with self._op_lock:
            for h in self._holders():
                self._release_holder(h)
            self._model.release_locked()
            self.backend.close()
        if self.cache is not None:
            self.cache.close()  # the tape saved by the release above reaches the disk

    # --- ownership ----------------------------------------------------------------------
    def lost(self, session_id: str) -> bool:
        """Whether a takeover ended this session (it answers LostOwner until closed)."""
        return session_id in self._lost

    def forget_lost(self, session_id: str) -> None:
        self._lost.discard(session_id)

    def takeover(self, owner: str, epoch: int) -> bool:
        """A new owner with a higher epoch fences the old one: its session (if it holds the slot) is
        ended and answers LostOwner from then on; its fence is refused (StaleFence). Returns whether a
        session was ended. The model, its KV and the workspace cache stay: the new owner starts warm."""
        with self._op_lock:
            if epoch <= self.owner_epoch:
                raise StaleFence(f"takeover epoch {epoch} is not newer than the daemon's ({self.owner_epoch})",
                                 epoch=epoch, current=self.owner_epoch)
            ending = [h for h in self._holders() if h.owner != owner]
            ended = bool(ending)
            for h in ending:
                self._lost.add(h.session_id)
                self._release_holder(h)
            with self._state_lock:
                self.owner = owner
                self.owner_epoch = epoch
            log.warning("owner taken over at epoch %d%s", epoch, "; the old owner's session was ended" if ended else "")
            return ended

    # --- workspace cache ---------------------------------------------------------------
    def cache_entries(self) -> list[CacheEntryInfo]:
        return self.cache.entries() if self.cache is not None else []

    def cache_clear(self, owner: str) -> int:
        """Drop every workspace cache entry; only the owner may (the fence is checked)."""
        with self._op_lock:
            self._check_fence(owner)
            return self.cache.clear() if self.cache is not None else 0
