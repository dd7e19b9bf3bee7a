"""The slot service in process, on the contract's memory backend: no sockets, no daemon.

Every test drives a ``RecordingSlot``, which logs each state change it makes;
the fixture checks at the end that every change was one ``TRANSITIONS`` allows,
and ``test_tour_takes_every_reachable_edge`` checks that the table holds no edge
the slot never takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends.memory import MAX_NUM_CTX, MemoryBackend, MemoryModel
from contract.errors import (
    BackendMismatch,
    ContextOverflow,
    InsufficientMemory,
    Internal,
    InvalidArgument,
    ModelBusy,
    ModelLoadFailed,
    ModelNotActive,
    ModelSwitchRequired,
    SessionClosed,
    ShuttingDown,
    SlotGenerationStale,
    StaleFence,
)
from contract.interfaces import Backend
from contract.types import (
    Config,
    DaemonStatus,
    DecodeConfig,
    EmbedRequest,
    LoadModelRequest,
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    SlotState,
    SuffixInput,
    UnloadModelRequest,
)
from modeld.embedding_slot import EmbeddingSlot
from modeld.lifecycle import TRANSITIONS, Lifecycle
from modeld.settings import ServeSettings
from modeld.slot import SlotService
from modeld.slot_session import SlotSession

S = SlotState
OWNER = "owner-1"
#: the serve settings a slot reads, without the environment or a config file
settings = ServeSettings.model_construct
Edge = tuple[SlotState, SlotState]


class Clock:
    """The slot's clock in a test: time passes when the test says (``advance``), not while it sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordingSlot(SlotService):
    """A SlotService that logs every state change it makes (its ``on_transition`` hook)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.taken: list[Edge] = []
        super().__init__(*args, on_transition=lambda frm, to: self.taken.append((frm, to)), **kw)


@pytest.fixture
def slot() -> Iterator[RecordingSlot]:
    s = RecordingSlot(MemoryBackend(), settings(owner=OWNER))
    yield s
    assert_in_table(s.taken)


def assert_in_table(taken: Sequence[Edge]) -> None:
    bad = [(a.value, b.value) for a, b in taken if b not in TRANSITIONS[a]]
    assert not bad, f"transitions outside the table: {bad}"


def load(name: str = "a", **kw: Any) -> LoadModelRequest:
    return LoadModelRequest(owner_instance_id=OWNER, model_name=name, type="memory", path=f"/models/{name}", **kw)


def open_req(name: str = "a") -> OpenSessionRequest:
    return OpenSessionRequest(owner_instance_id=OWNER, model_name=name, type="memory", path=f"/models/{name}")


def unload(**kw: Any) -> UnloadModelRequest:
    return UnloadModelRequest(owner_instance_id=OWNER, **kw)


def state(s: SlotService) -> SlotState:
    return s.status().state


def hot_loop(sess: SlotSession, text: str = "You are terse.") -> str:
    m = sess.manifest_defaults.model_copy(update={"profile": "test-slot"})
    sess.ensure_prefix(PrefixInput(text=text, manifest=m))
    sess.prefill_suffix(SuffixInput(text=" Hello.", manifest=m))
    return "".join(c.text for c in sess.decode(DecodeConfig(max_tokens=4, temperature=0.0)))


# --- the table ------------------------------------------------------------------------------------


def test_table_names_every_state_and_every_state_but_empty_is_reached() -> None:
    assert set(TRANSITIONS) == set(SlotState)
    assert all(nxt <= set(SlotState) for nxt in TRANSITIONS.values())
    # Every state is entered from somewhere: the slot starts Empty, and a state no transition
    # names would be one no code path can produce.
    assert set().union(*TRANSITIONS.values()) | {S.EMPTY} == set(SlotState)
    # Shutdown is reachable from everywhere and is terminal.
    assert all(S.SHUTTING_DOWN in nxt for nxt in TRANSITIONS.values())
    assert TRANSITIONS[S.SHUTTING_DOWN] == {S.SHUTTING_DOWN}


def test_an_invalid_transition_is_an_internal_error() -> None:
    told: list[Edge] = []
    life = Lifecycle(lambda frm, to: told.append((frm, to)))
    with pytest.raises(Internal) as exc:
        life.move(S.BUSY)
    assert "Empty -> Busy" in exc.value.message and "Loading" in exc.value.message
    assert exc.value.details == {"state": "Empty", "to": "Busy"}
    assert life.state is S.EMPTY and told == []
    life.move(S.LOADING)
    with pytest.raises(Internal):
        life.move(S.BUSY)
    assert (life.state, told) == (S.LOADING, [(S.EMPTY, S.LOADING)])
    with pytest.raises(AttributeError):
        life.state = S.READY  # type: ignore[misc]  # read-only: the table is the only way in
    # A load that raced the shutdown ends with ShuttingDown, not with a Ready slot.
    life.move(S.SHUTTING_DOWN)
    with pytest.raises(ShuttingDown):
        life.move(S.READY)


# --- load, switch, unload ------------------------------------------------------------------------


def test_load_switch_unload(slot: RecordingSlot) -> None:
    a = slot.load_model(load("a"))
    assert (a.generation, state(slot), slot.generation) == (1, S.READY, 1)
    assert slot.load_model(load("a")) == a  # the same model: nothing happens
    b = slot.load_model(load("b"))
    assert (b.model_name, b.generation, state(slot)) == ("b", 2, S.READY)
    slot.unload_model(unload())
    st = slot.status()
    assert (st.state, st.generation, st.active, st.busy_operation) == (S.EMPTY, 3, None, "")
    slot.unload_model(unload())  # idempotent on an empty slot
    assert slot.generation == 3
    assert slot.taken == [
        (S.EMPTY, S.LOADING),
        (S.LOADING, S.READY),
        (S.READY, S.SWITCHING),
        (S.SWITCHING, S.READY),
        (S.READY, S.UNLOADING),
        (S.UNLOADING, S.EMPTY),
    ]


def test_expected_generation_makes_load_and_unload_conditional(slot: RecordingSlot) -> None:
    slot.load_model(load("a"))
    with pytest.raises(SlotGenerationStale):
        slot.load_model(load("b", expected_generation=7))
    with pytest.raises(SlotGenerationStale):
        slot.unload_model(unload(expected_generation=7))
    active = slot.status().active
    assert state(slot) is S.READY and active is not None and active.model_name == "a"
    slot.load_model(load("b", expected_generation=1))
    slot.unload_model(unload(expected_generation=2))
    assert state(slot) is S.EMPTY


def test_fence_and_type_checks_change_nothing(slot: RecordingSlot) -> None:
    slot.load_model(load("a"))
    before = slot.taken[:]
    with pytest.raises(StaleFence):
        slot.load_model(load("b").model_copy(update={"owner_instance_id": "someone-else"}))
    with pytest.raises(StaleFence):
        slot.unload_model(UnloadModelRequest(owner_instance_id="someone-else"))
    with pytest.raises(StaleFence):
        slot.open_session(open_req("a").model_copy(update={"owner_instance_id": "someone-else"}))
    with pytest.raises(BackendMismatch):
        slot.load_model(load("b").model_copy(update={"type": "llama"}))
    with pytest.raises(InvalidArgument):
        slot.load_model(load("b").model_copy(update={"path": ""}))
    assert (state(slot), slot.generation, slot.taken) == (S.READY, 1, before)


class RefusingBackend(MemoryBackend):
    """The memory backend, refusing to load the paths in ``refuse`` (a file that went bad on disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse: set[str] = set()

    def load(self, req: OpenSessionRequest, progress: Any) -> Any:
        if req.path in self.refuse:
            raise ModelLoadFailed(f"{req.path} is not a model", path=req.path)
        return super().load(req, progress)


#: what each model ``HeavyBackend`` loads holds, and all the room there is: one model at a time
MODEL_BYTES = 1_000_000


class HeavyModel(MemoryModel):
    def resident_bytes(self) -> int:
        return MODEL_BYTES


class HeavyBackend(RefusingBackend):
    """``RefusingBackend`` whose models each hold ``MODEL_BYTES``."""

    def load(self, req: OpenSessionRequest, progress: Any) -> Any:
        super().load(req, progress)  # its checks and refusals
        return HeavyModel(req)


def room_for_one_model(resident: Callable[[], int]) -> Callable[[Backend, OpenSessionRequest, int], ModelInfo]:
    """A planner with room for ``MODEL_BYTES``: a load fits only where what stays resident is credited back (so a
    switch releases the old model first). It plans the context asked for, which the backend may then refuse."""

    def plan(backend: Backend, req: OpenSessionRequest, credit: int) -> ModelInfo:
        if resident() - credit + MODEL_BYTES > MODEL_BYTES:
            raise InsufficientMemory("room for one model only", required=MODEL_BYTES)
        info = backend.describe(req, credit)
        return info.model_copy(update={"effective_context": req.config.num_ctx or info.effective_context})

    return plan


def test_a_failed_load_is_recoverable(slot: RecordingSlot) -> None:
    too_big = Config(num_ctx=MAX_NUM_CTX + 1)  # the memory backend refuses it at load
    with pytest.raises(InvalidArgument):
        slot.load_model(load("a", config=too_big))
    st = slot.status()
    assert (st.state, st.generation, st.busy_operation) == (S.FAILED, 0, "")
    assert st.last_error.startswith("InvalidArgument:")
    slot.load_model(load("a"))  # a new load may be attempted
    st = slot.status()
    assert (st.state, st.generation, st.last_error) == (S.READY, 1, "")
    slot.unload_model(unload())
    assert state(slot) is S.EMPTY


def test_a_failed_switch_keeps_the_model_that_fits_alongside(slot: RecordingSlot) -> None:
    slot.load_model(load("a"))
    with pytest.raises(InvalidArgument):
        slot.load_model(load("b", config=Config(num_ctx=MAX_NUM_CTX + 1)))
    st = slot.status()
    assert st.active is not None and st.active.model_name == "a" and (st.state, st.generation) == (S.READY, 1)
    assert st.last_error.startswith("InvalidArgument:")
    assert hot_loop(slot.open_session(open_req("a")))  # still serving
    assert (S.SWITCHING, S.READY) in slot.taken


def one_at_a_time(room_for_both: bool = False) -> Any:
    """A planner for a machine with room for one model at a time (unless ``room_for_both``): with the old model's
    memory counted as free the new one gets a 64-token window, without it 32 (so they do not fit side by side)."""

    def planner(_b: Any, _req: OpenSessionRequest, credit: int) -> Any:
        from contract.types import ModelInfo

        return ModelInfo(effective_context=64 if credit or room_for_both else 32)

    return planner


def warm(slot: SlotService, name: str = "a") -> None:
    """A turn on the loaded model, so it holds memory (a switch then credits it to the new one)."""
    sess = slot.open_session(open_req(name))
    assert hot_loop(sess)
    sess.close()


def failed_switch(room_for_both: bool = False) -> tuple[RecordingSlot, RefusingBackend, DaemonStatus]:
    """Model "a" loaded and warm, then a switch to "b", whose file the backend refuses: the slot, the backend and
    the status after, with "a" serving again whichever way the switch went."""
    backend = RefusingBackend()
    slot = RecordingSlot(backend, settings(owner=OWNER), planner=one_at_a_time(room_for_both))
    slot.load_model(load("a"))
    warm(slot)
    backend.refuse.add("/models/b")
    with pytest.raises(ModelLoadFailed):
        slot.load_model(load("b"))
    st = slot.status()
    assert st.active is not None and st.active.model_name == "a" and st.state is S.READY
    return slot, backend, st


def test_a_failed_switch_that_released_the_old_model_loads_it_again() -> None:
    slot, backend, st = failed_switch()
    assert st.generation == 2  # loaded again: a new generation
    assert "ModelLoadFailed" in st.last_error and "previous model was loaded again" in st.last_error
    warm(slot)
    # and when the previous model cannot come back either: Failed, both reasons, one unload away
    backend.refuse.add("/models/a")
    with pytest.raises(ModelLoadFailed):
        slot.load_model(load("b"))
    st = slot.status()
    assert (st.state, st.active) == (S.FAILED, None)
    assert "reloading the previous model failed too" in st.last_error
    slot.unload_model(unload())
    assert state(slot) is S.EMPTY
    assert (S.SWITCHING, S.FAILED) in slot.taken and (S.FAILED, S.EMPTY) in slot.taken
    assert_in_table(slot.taken)


@pytest.mark.parametrize("room_for_both", [True, False])
def test_a_switch_keeps_the_old_model_loaded_only_when_the_planner_fits_both(room_for_both: bool) -> None:
    """Whether the two models fit side by side is the planner's answer without the old model's memory: when it
    gives the new model the same window, the old one stays loaded until the new one is in (a failed switch leaves
    it serving, the same generation); otherwise it is released first (and loaded again after the failure)."""
    _, _, st = failed_switch(room_for_both)
    assert st.generation == (1 if room_for_both else 2)
    assert ("loaded again" in st.last_error) is not room_for_both


# --- sessions ------------------------------------------------------------------------------------


def test_open_close_busy(slot: RecordingSlot) -> None:
    with pytest.raises(ModelNotActive):
        slot.open_session(OpenSessionRequest(owner_instance_id=OWNER))
    sess = slot.open_session(open_req("a"))  # auto-loads the empty slot
    assert (state(slot), sess.generation, slot.status().session_open) == (S.BUSY, 1, True)
    assert hot_loop(sess)
    with pytest.raises(ModelBusy):
        slot.open_session(open_req("a"))
    with pytest.raises(ModelBusy):
        slot.load_model(load("b"))
    with pytest.raises(ModelBusy):
        slot.unload_model(unload())
    with pytest.raises(ModelSwitchRequired):
        slot.open_session(open_req("b"))  # checked before busy: a switch is explicit
    sess.close()
    assert (state(slot), slot.status().session_open, slot.holder_id()) == (S.READY, False, "")
    with pytest.raises(SessionClosed):
        sess.ensure_prefix(PrefixInput(text="x"))
    again = slot.open_session(open_req("a"))  # the model stayed resident: no load
    assert (state(slot), again.generation) == (S.BUSY, 1)
    again.close()
    assert slot.taken.count((S.EMPTY, S.LOADING)) == 1
    assert slot.taken.count((S.READY, S.BUSY)) == 2 and slot.taken.count((S.BUSY, S.READY)) == 2


def test_busy_operation_is_reported_while_a_decode_streams(slot: RecordingSlot) -> None:
    sess = slot.open_session(open_req("a"))
    m = sess.manifest_defaults.model_copy(update={"profile": "test-slot"})
    sess.ensure_prefix(PrefixInput(text="You are terse.", manifest=m))
    stream = sess.decode(DecodeConfig(max_tokens=8, temperature=0.0))
    next(stream)
    assert (state(slot), slot.status().busy_operation) == (S.BUSY, "decode")
    stream.close()  # abandoning the stream cancels it
    assert slot.status().busy_operation == ""
    sess.close()


def test_a_switch_leaves_old_handles_closed(slot: RecordingSlot) -> None:
    sess = slot.open_session(open_req("a"))
    slot.release_session(sess.session_id)
    slot.load_model(load("b"))
    assert (sess.generation, slot.generation) == (1, 2)
    with pytest.raises(SessionClosed):
        sess.ensure_prefix(PrefixInput(text="x"))
    assert sess.explain_context().closed


def test_lease_reap_releases_a_silent_holder() -> None:
    clock = Clock()
    s = RecordingSlot(MemoryBackend(), settings(owner=OWNER, lease=0.25), clock=clock)  # (times exact in binary)
    sess = s.open_session(open_req("a"))
    assert s.reap() is False  # fresh
    assert s.touch(sess.session_id) and not s.touch("nobody")
    clock.advance(0.25)
    assert s.reap() is False  # at the lease, not past it
    clock.advance(0.125)
    assert s.reap() is True
    assert (state(s), s.holder_id()) == (S.READY, "")
    with pytest.raises(SessionClosed):
        sess.ensure_prefix(PrefixInput(text="x"))
    # An expired holder also gives way to the next caller without a reaper.
    other = s.open_session(open_req("a"))
    clock.advance(0.5)
    s.load_model(load("b"))
    assert state(s) is S.READY and not s.touch(other.session_id)
    assert_in_table(s.taken)


def test_shutdown_is_terminal(slot: RecordingSlot) -> None:
    sess = slot.open_session(open_req("a"))
    slot.shutdown()
    assert (state(slot), slot.status().active) == (S.SHUTTING_DOWN, None)
    with pytest.raises(ShuttingDown):
        slot.load_model(load("a"))
    with pytest.raises(ShuttingDown):
        slot.open_session(open_req("a"))
    with pytest.raises(SessionClosed):
        sess.ensure_prefix(PrefixInput(text="x"))
    slot.unload_model(unload())  # nothing resident: still a no-op
    slot.shutdown()  # again: changes nothing
    assert state(slot) is S.SHUTTING_DOWN


# --- the embedding side slot ---------------------------------------------------------------------


class _Plan:
    def __init__(self, path: Path, window: int) -> None:
        self.backend, self.path, self.model_name, self.digest = "memory", path, path.name, "sha256:" + "0" * 64
        self.window, self.pooling, self.resident_bytes, self.num_threads = window, "mean", 1000, 0

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.backend, str(self.path), self.window, self.num_threads)


class _Engine:
    """Words as tokens; vector i is (len(text), 1, 0): easy to check after normalisation."""

    dims = 3

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self.closed = False

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(t.split()) for t in texts]

    def embed(self, texts: Sequence[str], counts: Sequence[int]) -> np.ndarray:
        return np.array([[len(t), 1.0, 0.0] for t in texts], dtype=np.float32)

    def close(self) -> None:
        self.closed = True


class _Factory:
    backend = "memory"

    def __init__(self) -> None:
        self.engines: list[_Engine] = []

    def default_path(self) -> Path:
        return Path("/models/embed")

    def plan_for(self, path: Path, config: Config) -> _Plan:
        return _Plan(path, config.num_ctx or 4)

    def __call__(self, plan: _Plan) -> _Engine:
        self.engines.append(_Engine(plan))
        return self.engines[-1]


def test_embed_goes_to_the_side_slot_and_never_touches_the_generation_slot() -> None:
    now = [100.0]
    factory = _Factory()
    side = EmbeddingSlot(factory, idle_unload_s=10, budget_check=lambda n: None, clock=lambda: now[0])
    s = RecordingSlot(MemoryBackend(), settings(owner=OWNER), embedder=side)
    sess = s.open_session(open_req("a"))
    taken = s.taken[:]
    res = s.embed(EmbedRequest(owner_instance_id=OWNER, texts=["one two", "three"]))
    assert (res.dims, res.tokens, res.truncated, res.model_name) == (3, [2, 1], [], "embed")
    assert np.allclose(np.linalg.norm(res.vectors, axis=1), 1.0)
    with pytest.raises(ContextOverflow):
        s.embed(EmbedRequest(owner_instance_id=OWNER, text="a b c d e"))
    cut = s.embed(EmbedRequest(owner_instance_id=OWNER, texts=["a b c d e", "f"], truncate=True))
    assert (cut.tokens, cut.truncated) == ([5, 1], [0])
    st = s.status()
    assert (st.state, st.embedding["loaded"], st.embedding["loads"]) == (S.BUSY, True, 1)
    assert st.embedding["resident_bytes"] == 1000 and s.taken == taken
    now[0] += 11  # idle past idle_unload_s: the reaper unloads the side slot
    s.reap()
    assert s.status().embedding["loaded"] is False and factory.engines[0].closed
    assert state(s) is S.BUSY  # the session kept the generation slot
    sess.close()
    s.shutdown()
    with pytest.raises(ModelLoadFailed, match="closed"):
        side.embed(EmbedRequest(text="x"))
    assert_in_table(s.taken)


# --- the tour ------------------------------------------------------------------------------------

#: edges only a race reaches (a shutdown while a load, switch or unload runs on another thread)
_RACE_ONLY = {(S.LOADING, S.SHUTTING_DOWN), (S.SWITCHING, S.SHUTTING_DOWN), (S.UNLOADING, S.SHUTTING_DOWN)}


def test_tour_takes_every_reachable_edge() -> None:
    """One walk through the slot's life takes every edge of the table that is reachable in order."""
    taken: set[Edge] = set()
    too_big = Config(num_ctx=MAX_NUM_CTX + 1)

    def fresh() -> RecordingSlot:
        return RecordingSlot(MemoryBackend(), settings(owner=OWNER))

    backend = HeavyBackend()
    s = RecordingSlot(backend, settings(owner=OWNER), planner=room_for_one_model(lambda: s.generation_resident_bytes()))
    with pytest.raises(InvalidArgument):
        s.load_model(load("a", config=too_big))  # Empty -> Loading -> Failed
    s.load_model(load("a"))  # Failed -> Loading -> Ready
    s.load_model(load("b"))  # Ready -> Switching -> Ready
    s.open_session(open_req("b")).close()  # Ready -> Busy -> Ready
    backend.refuse.add("/models/b")
    with pytest.raises(InvalidArgument):
        s.load_model(load("c", config=too_big))  # Ready -> Switching -> Failed (b cannot come back)
    s.unload_model(unload())  # Failed -> Empty
    s.load_model(load("a"))
    s.unload_model(unload())  # Ready -> Unloading -> Empty
    taken |= set(s.taken)
    for prepare in (
        lambda x: None,  # Empty
        lambda x: x.load_model(load("a")),  # Ready
        lambda x: x.open_session(open_req("a")),  # Busy
        lambda x: pytest.raises(InvalidArgument, x.load_model, load("a", config=too_big)),  # Failed
    ):
        s = fresh()
        prepare(s)
        s.shutdown()
        s.shutdown()
        taken |= set(s.taken)

    assert_in_table(sorted(taken))
    table = {(a, b) for a, nxt in TRANSITIONS.items() for b in nxt}
    assert table - taken == _RACE_ONLY


# --- idle model, idle sessions ---------------------------------------------------------------------
def test_an_idle_model_is_unloaded_after_idle_unload_s() -> None:
    clock = Clock()
    s = RecordingSlot(MemoryBackend(), settings(owner=OWNER, idle_unload=0.25), clock=clock)  # (times exact in binary)
    s.load_model(load("a"))
    assert s.status().idle_s is not None and s.status().idle_unload_s == 0.25
    sess = s.open_session(open_req("a"))
    clock.advance(0.5)
    s.reap()
    assert state(s) is S.BUSY  # a session holds it: never idle
    sess.close()
    s.reap()
    assert state(s) is S.READY  # the idle clock starts at the close
    clock.advance(0.25)
    s.reap()
    assert state(s) is S.READY  # at the limit, not past it
    clock.advance(0.125)
    s.reap()
    st = s.status()
    assert (st.state, st.generation, st.active, st.idle_s) == (S.EMPTY, 2, None, None)
    assert_in_table(s.taken)
    s.open_session(open_req("a")).close()  # the next session loads it again
    assert state(s) is S.READY


def test_a_session_without_operations_is_released_after_its_ttl() -> None:
    clock = Clock()
    s = RecordingSlot(MemoryBackend(), settings(owner=OWNER, lease=60.0, session_ttl=0.3), clock=clock)
    sess = s.open_session(open_req("a"))
    for _ in range(3):  # the no-op refresh: explain_context, well inside the TTL
        clock.advance(0.15)
        assert s.touch(sess.session_id)  # a heartbeat renews the lease, not the TTL
        sess.explain_context()
        s.reap()
    assert state(s) is S.BUSY
    clock.advance(0.2)
    assert s.touch(sess.session_id)
    clock.advance(0.2)
    s.reap()
    assert state(s) is S.READY and s.status().session_ttl_s == 0.3
    with pytest.raises(SessionClosed):
        sess.ensure_prefix(PrefixInput(text="x", manifest=sess.manifest_defaults))


def test_a_takeover_fences_the_old_owner_and_keeps_the_model() -> None:
    from contract.errors import LostOwner

    s = RecordingSlot(MemoryBackend(), settings(owner=OWNER))
    sess = s.open_session(open_req("a"))
    assert hot_loop(sess)
    with pytest.raises(StaleFence, match="not newer"):
        s.takeover("owner-2", 0)
    assert s.takeover("owner-2", 1)  # the old owner's session is ended
    st = s.status()
    assert (st.state, st.generation, st.owner_epoch, st.session_open) == (S.READY, 1, 1, False)
    with pytest.raises(LostOwner):
        sess.ensure_prefix(PrefixInput(text="x", manifest=sess.manifest_defaults))
    with pytest.raises(StaleFence):
        s.open_session(open_req("a"))  # the old fence no longer holds
    new = s.open_session(open_req("a").model_copy(update={"owner_instance_id": "owner-2"}))
    assert new.generation == 1  # the same model, still loaded
    new.close()
    with pytest.raises(StaleFence):
        s.takeover("owner-3", 1)  # an epoch is used once
    assert not s.takeover("owner-3", 2)  # no session held: nothing ended
    assert_in_table(s.taken)


def test_a_fork_holds_the_slot_beside_its_source_and_goes_with_its_lease_or_a_takeover() -> None:
    """Forks (``Session.fork``) are the holder's: the slot stays busy while any of them is open, a fork outlives
    its source, each has its own lease, and a takeover ends them all."""
    from contract.errors import LostOwner

    clock = Clock()
    s = RecordingSlot(MemoryBackend(), settings(owner=OWNER, lease=1.0), clock=clock)
    sess = s.open_session(open_req("a"))
    assert hot_loop(sess)
    with pytest.raises(InvalidArgument):
        sess.fork(10**6)  # past the context
    fork = sess.fork(sess.explain_context().resident_tokens)
    assert s.holds(fork.session_id) and s.holds(sess.session_id)
    sess.close()
    assert (state(s), s.holds(fork.session_id)) == (S.BUSY, True)  # the fork holds the slot on its own
    with pytest.raises(ModelBusy):
        s.open_session(open_req("a"))
    assert hot_loop(fork)
    second = fork.fork(fork.explain_context().prefix_tokens)
    clock.advance(0.5)
    assert s.touch(second.session_id)
    clock.advance(0.75)
    assert s.reap() is True  # the first fork's lease ran out; the second was heard
    assert (state(s), s.holds(fork.session_id), s.holds(second.session_id)) == (S.BUSY, False, True)
    with pytest.raises(SessionClosed):
        hot_loop(fork)
    assert hot_loop(second)
    third = second.fork(second.explain_context().prefix_tokens)
    assert s.takeover("owner-2", 1)
    for ended in (second, third):
        with pytest.raises(LostOwner):
            ended.ensure_prefix(PrefixInput(text="x", manifest=ended.manifest_defaults))
    assert (state(s), s.status().session_open) == (S.READY, False)
    assert_in_table(s.taken)


def test_a_model_of_several_lanes_serves_a_session_a_lane_at_once() -> None:
    """A model of two lanes (``backends.lanes``; the memory backend's ``lanes``, as the vLLM engine's ``serve
    --sessions``): two sessions are open at once, each on a context of its own, and run their operations at the
    same time; a third is ModelBusy until one closes; a fork stays on its source's lane; a client's next session
    goes back to the lane it had while that lane is free; a switch still waits for every session to close."""
    import threading

    s = RecordingSlot(MemoryBackend(token_delay_s=0.01, lanes=2), settings(owner=OWNER))
    a = s.open_session(open_req("a").model_copy(update={"client": "agent-a"}))
    b = s.open_session(open_req("a").model_copy(update={"client": "agent-b"}))
    st = s.status()
    assert (st.state, st.session_open, st.sessions_open, st.session_lanes) == (S.BUSY, True, 2, 2)
    with pytest.raises(ModelBusy):
        s.open_session(open_req("a"))
    assert s.full() and not RecordingSlot(MemoryBackend(lanes=2), settings(owner=OWNER)).full()
    with pytest.raises(ModelBusy):
        s.load_model(load("b"))  # a switch needs every session closed

    # each lane holds its own conversation: b's prompt does not disturb a's context
    m = a.manifest_defaults.model_copy(update={"profile": "test-slot"})
    a.ensure_prefix(PrefixInput(text="You are terse.", manifest=m))
    b.ensure_prefix(PrefixInput(text="You are verbose and kind.", manifest=m))
    a_prefix = a.ensure_prefix(PrefixInput(text="You are terse.", manifest=m))
    assert a_prefix.reused_tokens == a_prefix.prefix_tokens > 0 and a_prefix.prefilled_tokens == 0
    a.prefill_suffix(SuffixInput(text=" Hello.", manifest=m))

    # a decode on each lane at once: a's stream is still running when b's has ended
    a_stream = a.decode(DecodeConfig(max_tokens=400, temperature=0.0))
    next(a_stream)
    b.prefill_suffix(SuffixInput(text=" Hi.", manifest=m))
    done = threading.Event()

    def b_decodes() -> None:
        assert "".join(c.text for c in b.decode(DecodeConfig(max_tokens=3, temperature=0.0)))
        done.set()

    t = threading.Thread(target=b_decodes)
    t.start()
    t.join(timeout=120)
    assert done.is_set()  # b decoded while a's decode (400 tokens) was open, not after it
    assert s.status().busy_operation == "decode"  # a's still runs
    a_stream.close()
    assert s.status().busy_operation == ""

    fork = a.fork(a.explain_context().prefix_tokens)  # on a's lane: no lane is free, and it needs none
    assert hot_loop(fork) and s.status().sessions_open == 3
    a.close()
    fork.close()
    again = s.open_session(open_req("a").model_copy(update={"client": "agent-a"}))
    again_prefix = again.ensure_prefix(PrefixInput(text="You are terse.", manifest=m))
    assert again_prefix.reused_tokens == again_prefix.prefix_tokens  # agent-a's lane again: its context is there
    b.close()
    again.close()
    assert (state(s), s.status().sessions_open) == (S.READY, 0)
    assert_in_table(s.taken)
