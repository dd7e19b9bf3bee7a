"""The work queue (modeld/workqueue.py) without sockets: one terminal answer per request, opens served in order."""

from __future__ import annotations

import threading
import time

import pytest

from contract import wire
from contract.errors import Cancelled, EngineUnresponsive, InvalidArgument, ModelBusy, ModeldError, ShuttingDown
from contract.messages import DecodeRequest
from contract.types import DecodeConfig, EmbedRequest, OpenSessionRequest
from contract.wire import Message, Op
from modeld.workqueue import Inflight, WorkQueue


class _Slot:
    holder: str | None = None


def _queue() -> tuple[WorkQueue, _Slot, threading.Event]:
    slot, stopping = _Slot(), threading.Event()
    return WorkQueue(lambda opening, _req: (slot.holder is not None) + opening >= 1, stopping), slot, stopping


def _open(rid: bytes, queue_timeout_s: float = 10.0) -> Message:
    return wire.decode_request(wire.encode_request(Op.OPEN, rid, OpenSessionRequest(queue_timeout_s=queue_timeout_s)))


def _embed(rid: bytes) -> Message:
    return wire.decode_request(wire.encode_request(Op.EMBED, rid, EmbedRequest(text="x")))


class _Sent:
    """The IO thread's send, recorded."""

    def __init__(self) -> None:
        self.replies: list[tuple[bytes, list[bytes]]] = []

    def __call__(self, identity: bytes, frames: list[bytes]) -> bool:
        self.replies.append((identity, frames))
        return True

    def errors(self) -> list[ModeldError]:
        return [wire.error_of(wire.decode_reply(frames)) for _identity, frames in self.replies]


def test_post_queues_for_the_right_worker_and_refuses_a_request_id_in_flight() -> None:
    work, _slot, _stopping = _queue()
    inf = work.post(b"c1", Op.OPEN, _open(b"r1"))
    assert inf.queue_deadline is not None and work.model.get_nowait() == (inf, _open(b"r1"))
    with pytest.raises(InvalidArgument):
        work.post(b"c1", Op.OPEN, _open(b"r1"))
    assert work.post(b"c2", Op.OPEN, _open(b"r1", queue_timeout_s=0)).queue_deadline is None  # another client's
    embed = _embed(b"e1")
    queued = work.post(b"c1", Op.EMBED, embed)
    assert work.embed.get_nowait() == (queued, embed) and work.model.qsize() == 1  # (c2's open)
    work.finished(b"c1", b"r1")
    work.post(b"c1", Op.OPEN, _open(b"r1"))  # its answer went out: the id is free again


def test_deferred_opens_wait_while_the_slot_is_held_and_run_in_arrival_order() -> None:
    work, slot, _stopping = _queue()
    first = work.post(b"c1", Op.OPEN, _open(b"r1"))
    assert not work.defer(first, _open(b"r1"))  # the slot is free and nobody waits: it runs now
    work.opened()  # (it ran, and holds the slot)
    slot.holder = "s1"
    waiting = [work.post(b"c" + str(i).encode(), Op.OPEN, _open(b"r")) for i in range(3)]
    assert all(work.defer(inf, _open(b"r")) for inf in waiting)
    no_wait = work.post(b"c9", Op.OPEN, _open(b"r", queue_timeout_s=0))
    assert not work.defer(no_wait, _open(b"r"))  # asks for no waiting: answered ModelBusy at once by the slot
    work.opened()
    assert work.waiting() == 5  # (status says so: first and no_wait are not taken by the worker yet)
    assert work.claim(first) and work.claim(no_wait)
    assert work.waiting() == 3 and work.pop_deferred() is None
    slot.holder = None
    served = []
    while (p := work.pop_deferred()) is not None:
        assert work.pop_deferred() is None  # one on its way in takes the one lane: the next waits for it
        served.append(p.inf)
        work.opened()  # (it ran, and closed again)
    assert served == waiting and all(inf.started for inf in served) and work.waiting() == 0


def test_on_a_slot_of_several_lanes_opens_run_at_once_up_to_the_lanes_and_never_race_for_the_last() -> None:
    """Two model workers and two lanes: two opens run at once, a third waits (the two on their way in count as
    taken before either holds its lane), and goes in when one of them is done with its lane."""
    stopping = threading.Event()
    held: list[str] = []
    work = WorkQueue(lambda opening, _req: len(held) + opening >= 2, stopping, workers=2)
    a, b, c = (work.post(identity, Op.OPEN, _open(b"r")) for identity in (b"c1", b"c2", b"c3"))
    assert not work.defer(a, _open(b"r")) and not work.defer(b, _open(b"r"))
    assert work.defer(c, _open(b"r")) and work.pop_deferred() is None
    work.opened()
    held.append("a")
    assert work.pop_deferred() is None  # b is on its way into the last lane
    work.opened()
    held.append("b")
    held.remove("a")
    p = work.pop_deferred()
    assert p is not None and p.inf is c and work.pop_deferred() is None
    work.stop_workers()
    assert [work.model.get_nowait() for _ in range(5)][-2:] == [None, None]  # (a, b and c, then a stop a worker)


def test_an_open_at_its_deadline_is_answered_once_and_never_run() -> None:
    work, slot, _stopping = _queue()
    slot.holder = "s1"
    inf = work.post(b"c1", Op.OPEN, _open(b"r1", queue_timeout_s=1.0))
    assert work.defer(inf, _open(b"r1"))
    assert inf.queue_deadline is not None
    sent = _Sent()
    work.expire_waits(sent, inf.queue_deadline - 0.01)
    assert not sent.replies
    work.expire_waits(sent, inf.queue_deadline)
    work.expire_waits(sent, inf.queue_deadline + 1)
    [err] = sent.errors()
    assert isinstance(err, ModelBusy) and err.details["waiting"] == 1 and work.waiting() == 0
    slot.holder = None
    assert work.pop_deferred() is None and not work.claim(inf)  # the worker must not run it now


def test_a_cancelled_wait_is_answered_by_the_worker_and_leaves_the_line() -> None:
    work, slot, _stopping = _queue()
    slot.holder = "s1"
    a, b = (work.post(identity, Op.OPEN, _open(b"r1")) for identity in (b"c1", b"c2"))
    assert work.defer(a, _open(b"r1")) and work.defer(b, _open(b"r1"))
    emitted: list[tuple[Inflight, list[bytes]]] = []
    work.cancel_peer(wire.peer_key(b"c2"), "a test")
    assert b.cancel.is_set() and not a.cancel.is_set()
    work.sweep_deferred(lambda inf, frames: emitted.append((inf, frames)))
    assert [inf for inf, _ in emitted] == [b]
    assert isinstance(wire.error_of(wire.decode_reply(emitted[0][1])), Cancelled)
    slot.holder = None
    p = work.pop_deferred()
    assert p is not None and p.inf is a and work.pop_deferred() is None


def test_a_wedged_worker_fails_its_own_requests_not_the_embeddings() -> None:
    work, _slot, _stopping = _queue()
    running = work.post(b"c1", Op.OPEN, _open(b"r1"))
    embed = work.post(b"c2", Op.EMBED, _embed(b"e1"))
    sent = _Sent()
    work.fail_model_work(sent, EngineUnresponsive("stuck", operation="open", stalled_s=1.0))
    [err] = sent.errors()
    assert [identity for identity, _ in sent.replies] == [b"c1"] and isinstance(err, EngineUnresponsive)
    assert running.cancel.is_set() and running.answered and not embed.cancel.is_set()
    assert work.clear() == [embed]


def test_shutdown_ends_every_wait() -> None:
    work, slot, stopping = _queue()
    slot.holder = "s1"
    inf = work.post(b"c1", Op.OPEN, _open(b"r1"))
    assert work.defer(inf, _open(b"r1"))
    slot.holder = None
    stopping.set()
    assert work.pop_deferred() is None  # the slot is free, but nothing starts now
    emitted: list[tuple[Inflight, list[bytes]]] = []
    work.sweep_deferred(lambda inf, frames: emitted.append((inf, frames)))
    assert [type(wire.error_of(wire.decode_reply(frames))) for _inf, frames in emitted] == [ShuttingDown]


def test_idle_work_starts_only_with_nothing_queued_and_any_model_request_stops_it() -> None:
    """``start_idle`` clears ``arrived`` and says whether the model worker may start idle work; every request for
    the model worker (not an embedding) and shutdown set it, which stops that work (``interrupt``)."""
    work, _slot, _stopping = _queue()
    assert work.start_idle() and not work.arrived.is_set()
    work.post(b"c1", Op.EMBED, _embed(b"e1"))  # the embedding worker's: the model worker's idle work goes on
    assert not work.arrived.is_set()
    work.wake()  # the IO thread's periodic wake-up (leases) neither stops it ...
    assert not work.arrived.is_set()
    assert not work.start_idle()  # ... nor lets it start while the wake-up is queued
    assert work.model.get_nowait() is None and work.start_idle()
    inf = work.post(b"c1", Op.OPEN, _open(b"r1"))
    assert work.arrived.is_set() and not work.start_idle() and not work.arrived.is_set()
    assert work.model.get_nowait() == (inf, _open(b"r1")) and work.start_idle()
    work.stop_workers()
    assert work.arrived.is_set()


def _decode(rid: bytes, *, reads: bool) -> Message:
    return wire.decode_request(wire.encode_request(Op.DECODE, rid, DecodeRequest.of("s1", DecodeConfig(), reads=reads)))


def test_a_stream_nobody_reads_is_cancelled_and_a_slow_reader_is_not() -> None:
    """A decode whose client reports its reads is cancelled once its reader took none of the frames waiting for it
    for ``UNREAD_STREAM_S`` (its route went away, and its cancel with it); a reader that keeps taking frames, however
    slowly, is reading; a raw client that reports nothing is never judged."""
    work, _slot, _stopping = _queue()
    reader = work.post(b"c1", Op.DECODE, _decode(b"d1", reads=True))
    raw = work.post(b"c1", Op.DECODE, _decode(b"d2", reads=False))
    assert reader.reads and not raw.reads
    t0 = time.monotonic()
    for _ in range(3):
        work.heard(b"c1", b"d1")
        work.heard(b"c1", b"d2")
    assert reader.sent == 3 and raw.sent == 3 and not raw.unread
    due = work.next_due()
    assert due is not None and due <= t0 + wire.UNREAD_STREAM_S + 0.5  # the IO thread wakes for it
    work.stop_unread(t0 + wire.UNREAD_STREAM_S / 2)
    assert not reader.cancel.is_set()
    work.read(b"c1", b"d1", 1)  # it took one frame: a slow reader, still reading
    taken = time.monotonic()
    work.stop_unread(taken + wire.UNREAD_STREAM_S / 2)
    assert not reader.cancel.is_set() and reader.read == 1 and len(reader.unread) == 2
    work.read(b"c1", b"d1", 1)  # the same report again takes nothing more
    assert reader.read == 1
    work.stop_unread(taken + wire.UNREAD_STREAM_S + 0.01)
    assert reader.cancel.is_set() and not raw.cancel.is_set()
    work.stop_unread(t0 + 3600)
    assert not raw.cancel.is_set()


def test_a_stream_read_to_its_end_is_never_judged() -> None:
    work, _slot, _stopping = _queue()
    reader = work.post(b"c1", Op.DECODE, _decode(b"d1", reads=True))
    for _ in range(4):
        work.heard(b"c1", b"d1")
    work.read(b"c1", b"d1", 99)  # (a report past what was sent counts what was sent)
    assert reader.read == 4 and not reader.unread and reader.unread_since() is None
    work.stop_unread(time.monotonic() + 3600)
    assert not reader.cancel.is_set()
