"""What each operation does: a typed request in, a typed reply (or a stream of chunks) out.

The IO thread (``modeld.server``) and the workers (``modeld.worker``) decode a message with the schema
``wire.SCHEMAS`` names for its operation, find the handler in one of three tables here, and encode what
it returns:

* ``IO_HANDLERS`` run on the IO thread: cheap, and never wait on the model (status, cancel, heartbeat,
  explain, metrics, the cache listing), so they are answered while a decode streams;
* ``HANDLERS`` run on a worker thread (the model's, or the embedding model's): one at a time against the
  ``SlotService``;
* ``STREAM_HANDLERS`` run on the model's worker and yield chunks, then exactly one final chunk.

The handlers also own the session table: which sessions are open and which peer (``wire.peer_key``)
opened each; only that peer may use or close it, and another peer's id is as unknown as a wrong one.
What the handlers need of the daemon itself (its own status fields, the cancel event of a request in
flight) comes in as two callables.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator
from typing import Any

from pydantic import BaseModel

from contract import wire
from contract.errors import Cancelled, Internal, InvalidArgument, SessionClosed, ShuttingDown
from contract.messages import (
    CacheClearReply,
    CacheClearRequest,
    CacheListReply,
    CacheListRequest,
    CancelReply,
    CancelRequest,
    CancelTurnReply,
    CancelTurnRequest,
    CloseReply,
    CountTokensRequest,
    DecodeRequest,
    DetokenizeReply,
    DetokenizeRequest,
    EmbedReply,
    EnsurePrefixRequest,
    ForkRequest,
    HeartbeatReply,
    HeartbeatRequest,
    MetricsReply,
    MetricsRequest,
    OpenReply,
    PrefillSuffixRequest,
    ReadRequest,
    RestoreRequest,
    SessionRef,
    SnapshotReply,
    SnapshotRequest,
    StatusRequest,
    TakeoverReply,
    TakeoverRequest,
    TokenizeReply,
    TokenizeRequest,
    UnloadReply,
    WhyReply,
    WhyRequest,
)
from contract.types import (
    ActiveModel,
    ContextReport,
    DaemonStatus,
    EmbedRequest,
    LoadModelRequest,
    ModelInfo,
    OpenSessionRequest,
    PrefixStatus,
    StreamChunk,
    SuffixStatus,
    TokenCount,
    UnloadModelRequest,
    Usage,
    owner_fingerprint,
)
from contract.wire import Op

from .blobs import BlobStore
from .metrics import Metrics
from .slot import SlotService
from .slot_session import SlotSession
from .workqueue import WorkQueue

__all__ = ["HANDLERS", "IO_HANDLERS", "STREAM_HANDLERS", "Handlers"]

# (the daemon's lines keep one logger name, whichever module writes them)
log = logging.getLogger("modeld.server")


class Handlers:
    """The operations, over the slot, the blob store, the metrics and the session table."""

    def __init__(
        self,
        slot: SlotService,
        blobs: BlobStore,
        metrics: Metrics,
        stopping: threading.Event,
        *,
        daemon_status: Callable[[DaemonStatus], DaemonStatus],
        work: WorkQueue,
    ) -> None:
        self.slot = slot
        self.blobs = blobs
        self.metrics = metrics
        self._stopping = stopping
        #: adds what only the daemon knows to the slot's status (uptime, the wedge watch, a queued preload)
        self._daemon_status = daemon_status
        #: the requests in flight (a cancel, a stream's reads, ending a turn)
        self._work = work
        self.sessions: dict[str, SlotSession] = {}
        #: session id -> the peer that opened it (``wire.peer_key``); only that peer may use it
        self.session_peers: dict[str, bytes] = {}
        #: the peer of the request a worker thread is running (the worker sets it; handlers take only the request)
        self.caller = threading.local()

    # --- the session table ---------------------------------------------------------------------
    def session(self, ref: SessionRef, identity: bytes | None = None) -> SlotSession:
        """The session ``ref`` names, if the calling peer opened it (another peer's id is as unknown as a wrong one)."""
        peer = wire.peer_key(identity) if identity is not None else getattr(self.caller, "peer", None)
        sess = self.sessions.get(ref.session_id)
        if sess is None or peer is None or self.session_peers.get(ref.session_id) != peer:
            raise SessionClosed("unknown or closed session", session_id=ref.session_id)
        return sess

    def sessions_of(self, peer: bytes) -> list[str]:
        return [sid for sid, p in list(self.session_peers.items()) if p == peer]

    def prune(self) -> None:
        """Forget sessions the slot no longer holds (a session a takeover ended stays, to answer LostOwner
        until closed)."""
        for sid in [s for s in self.sessions if not self.slot.holds(s) and not self.slot.lost(s)]:
            del self.sessions[sid]
            self.session_peers.pop(sid, None)

    # --- the IO thread: cheap, never waits on the model ------------------------------------------------
    def status(self, identity: bytes, req: StatusRequest) -> DaemonStatus:
        st = self.slot.status()
        st.blobs = self.blobs.stats()
        return self._daemon_status(st)

    def cancel(self, identity: bytes, req: CancelRequest) -> CancelReply:
        event = self._work.cancel_event(identity, req.request_id)
        if event is not None:
            if not event.is_set():
                log.debug("a client cancelled its request")
            event.set()
        return CancelReply(cancelled=event is not None)

    def read(self, identity: bytes, req: ReadRequest) -> None:
        """A stream's reader took frames (not answered: it sends one whenever it is about to wait for more)."""
        self._work.read(identity, req.request_id, req.frames)

    def cancel_turn(self, identity: bytes, req: CancelTurnRequest) -> CancelTurnReply:
        """End the turn that holds the slot (``modeld cancel``): its client's requests are cancelled (a prefill
        stops at its next chunk, keeping the chunks done; a decode within a step) and its session is released at
        once, as if its client had gone; the client's next call on it answers SessionClosed."""
        self.slot.check_owner(req.owner_instance_id)
        sid = req.session_id or self.slot.holder_id()
        peer = self.session_peers.get(sid)
        if not sid or peer is None or not self.slot.vanished(sid):
            return CancelTurnReply()
        client = self.slot.session_client(sid)
        self._work.cancel_peer(peer, "modeld cancel ended its turn")
        self._work.wake()  # the worker releases the session once its operation stopped
        log.info("modeld cancel: ended the turn of session %s%s", sid[:8], f" ({client})" if client else "")
        return CancelTurnReply(session_id=sid, client=client)

    def heartbeat(self, identity: bytes, req: HeartbeatRequest) -> HeartbeatReply:
        peer = wire.peer_key(identity)
        mine = [sid for sid in req.session_ids if self.session_peers.get(sid) == peer]
        return HeartbeatReply(alive=[sid for sid in mine if self.slot.touch(sid)])

    def explain(self, identity: bytes, req: SessionRef) -> ContextReport:
        return self.session(req, identity).explain_context()

    def metrics_text(self, identity: bytes, req: MetricsRequest) -> MetricsReply:
        return MetricsReply(text=self.metrics.text())

    def why(self, identity: bytes, req: WhyRequest) -> WhyReply:
        return WhyReply(requests=self.metrics.recent(req.last))

    def cache_list(self, identity: bytes, req: CacheListRequest) -> CacheListReply:
        return CacheListReply(entries=self.slot.cache_entries(), cache=self.slot.status().cache)

    # --- worker threads: a typed request in, a typed reply out -------------------------------------------
    def load(self, req: LoadModelRequest) -> ActiveModel:
        return self.slot.load_model(req)

    def unload(self, req: UnloadModelRequest) -> UnloadReply:
        self.slot.unload_model(req)
        return UnloadReply(generation=self.slot.generation)

    def describe(self, req: OpenSessionRequest) -> ModelInfo:
        return self.slot.describe(req)

    def embed(self, req: EmbedRequest) -> EmbedReply:
        reply = EmbedReply.of(self.slot.embed(req))
        if any(len(v) != reply.dims for v in reply.vectors):
            raise Internal("backend returned vectors of different sizes")
        return reply

    def open(self, req: OpenSessionRequest) -> OpenReply:
        sess = self.slot.open_session(req)
        self.session_peers[sess.session_id] = self.caller.peer
        self.sessions[sess.session_id] = sess
        return self._opened(sess)

    def _opened(self, sess: SlotSession) -> OpenReply:
        status = self.slot.status()
        return OpenReply(
            session_id=sess.session_id,
            generation=sess.generation,
            num_ctx=sess.num_ctx,
            manifest=self.slot.manifest_defaults().identity(),
            active=status.active,
            lease_s=self.slot.lease_s,
            sampling=self.slot.sampling_defaults(),
        )

    def ensure_prefix(self, req: EnsurePrefixRequest) -> PrefixStatus:
        return self.session(req).ensure_prefix(req.input)

    def prefill_suffix(self, req: PrefillSuffixRequest) -> SuffixStatus:
        return self.session(req).prefill_suffix(req.input)

    def count_tokens(self, req: CountTokensRequest) -> TokenCount:
        return self.session(req).count_tokens(req.prefix, req.suffix)

    def fork(self, req: ForkRequest) -> OpenReply:
        sess = self.session(req).fork(req.at_position)
        self.session_peers[sess.session_id] = self.caller.peer
        self.sessions[sess.session_id] = sess
        return self._opened(sess)

    def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        return TokenizeReply(tokens=self.session(req).tokenize(req.text, add_special=req.add_special))

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeReply:
        return DetokenizeReply(text=self.session(req).detokenize(req.tokens))

    def snapshot(self, req: SnapshotRequest) -> SnapshotReply:
        snap = self.session(req).snapshot()
        return SnapshotReply.of(snap, state_id=self.blobs.put(snap.state), include_state=req.include_state)

    def restore(self, req: RestoreRequest) -> ContextReport:
        sess = self.session(req)
        if req.state is not None:
            state = req.state
        elif req.snapshot.state_id:
            state = self.blobs.get(req.snapshot.state_id)
        else:
            raise InvalidArgument("restore needs the state bytes as a payload frame or a state_id")
        sess.restore(req.snapshot.model_copy(update={"state": state}))
        return sess.explain_context()

    def takeover(self, req: TakeoverRequest) -> TakeoverReply:
        ended = self.slot.takeover(req.owner_instance_id, req.epoch)
        return TakeoverReply(owner=owner_fingerprint(req.owner_instance_id), epoch=req.epoch, ended_session=ended)

    def cache_clear(self, req: CacheClearRequest) -> CacheClearReply:
        # on the worker: no restore reads an entry while it is deleted
        return CacheClearReply(cleared=self.slot.cache_clear(req.owner_instance_id))

    def close(self, req: SessionRef) -> CloseReply:
        if self.session_peers.get(req.session_id) != self.caller.peer:
            return CloseReply(closed=False)  # unknown, or another peer's: nothing is closed or revealed
        sess = self.sessions.pop(req.session_id, None)
        self.session_peers.pop(req.session_id, None)
        self.metrics.forget(req.session_id)
        self.slot.forget_lost(req.session_id)
        if sess is not None:
            sess.close()
        return CloseReply(closed=sess is not None)

    def decode(self, cancel: threading.Event, req: DecodeRequest) -> Generator[StreamChunk, None, None]:
        """The decode stream: its chunks, then exactly one final (``done``) chunk, or an error. A cancelled decode's
        final chunk counts the tokens it wrote: what the context gained (a closed stream keeps exactly those)."""
        sess = self.session(req)
        before = sess.explain_context().resident_tokens
        stream = sess.decode(req.input)
        final: StreamChunk | None = None
        try:
            for chunk in stream:
                if chunk.done:
                    final = chunk
                    break
                # a chunk the session handed out is sent even when the cancel came meanwhile: its token is in the
                # context now, and a client that goes on with the session (a paused reply resumed) must have seen it
                yield chunk
                if cancel.is_set():
                    break
        finally:
            # cancels the backend within one token when we stopped early; after the final chunk it settles the
            # reply's last token into the KV before the final goes out: ``explain`` is answered on the IO thread,
            # and a client that reads the context right after the end must find the whole reply in it
            stream.close()
        if final is None:
            if self._stopping.is_set():
                raise ShuttingDown("modeld is shutting down; the stream was ended")
            after = sess.explain_context().resident_tokens
            final = StreamChunk(done=True, finish_reason="cancelled",
                                usage=Usage(prompt_tokens=before, completion_tokens=max(0, after - before),
                                            resident_tokens=after))
            if not cancel.is_set():
                raise Cancelled("the stream ended without a final chunk")
        yield final


# Each handler's request type is the one wire.SCHEMAS names for its operation; the dispatch decodes with
# that schema, so the parameter types here hold at run time (``test_wire`` checks every op has one).
IO_HANDLERS: dict[Op, Callable[[Handlers, bytes, Any], BaseModel | None]] = {
    Op.STATUS: Handlers.status,
    Op.CANCEL: Handlers.cancel,
    Op.READ: Handlers.read,  # (None: not answered)
    Op.CANCEL_TURN: Handlers.cancel_turn,
    Op.HEARTBEAT: Handlers.heartbeat,
    Op.EXPLAIN: Handlers.explain,
    Op.CACHE_LIST: Handlers.cache_list,
    Op.METRICS: Handlers.metrics_text,
    Op.WHY: Handlers.why,
}

HANDLERS: dict[Op, Callable[[Handlers, Any], BaseModel]] = {
    Op.LOAD: Handlers.load,
    Op.UNLOAD: Handlers.unload,
    Op.DESCRIBE: Handlers.describe,
    Op.EMBED: Handlers.embed,
    Op.OPEN: Handlers.open,
    Op.ENSURE_PREFIX: Handlers.ensure_prefix,
    Op.PREFILL_SUFFIX: Handlers.prefill_suffix,
    Op.COUNT_TOKENS: Handlers.count_tokens,
    Op.FORK: Handlers.fork,
    Op.TOKENIZE: Handlers.tokenize,
    Op.DETOKENIZE: Handlers.detokenize,
    Op.SNAPSHOT: Handlers.snapshot,
    Op.RESTORE: Handlers.restore,
    Op.CLOSE: Handlers.close,
    Op.CACHE_CLEAR: Handlers.cache_clear,
    Op.TAKEOVER: Handlers.takeover,
}

STREAM_HANDLERS: dict[Op, Callable[[Handlers, threading.Event, Any], Generator[StreamChunk, None, None]]] = {
    Op.DECODE: Handlers.decode,
}
