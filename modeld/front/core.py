"""The serving core every HTTP API shares: a request in one neutral form becomes one ``runtime.Chat`` turn.

Each protocol module (chat completions, Responses, Messages) parses its own
request into a ``TurnRequest`` (``front.turn_request``: the contract's messages,
function tools and the decode options it sets) and renders the ``Turn``'s events
in its own wire format. So a conversation renders to the same tokens whichever API
carried it, and switching clients keeps the KV warm.

``Serving.begin`` runs everything that can refuse a request before a byte
of the reply is sent: the model name, the slot (queued in arrival order up to
the queue timeout), and the prompt's size against the context window
(counted on the model, before any prefill). A route calls it in a worker
thread and answers an HTTP error for anything it raises; only then does a
reply (streamed or not) start, except a streamed one whose wait for the slot
outlasts a grace (``queued``: its stream starts and keeps the client alive while
it waits).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.websockets import WebSocket

from contract.errors import ModeldError, Unavailable, WireError
from contract.types import (
    ActiveModel,
    DaemonStatus,
    DecodeConfig,
    FinishReason,
    OpenSessionRequest,
    ReadoutInfo,
    SlotState,
    TokenCount,
    TokenLogprob,
    ToolCallDelta,
)
from runtime.chat import Chat, ChatEvent, ChatResult, ChatTurn, ChatUsage

from ..settings import HttpSettings
from .access import AccessRecord, record_of
from .errors import ApiError, api_error
from .images import Image, ImageLimits, ImageRef, place_images, read_images
from .pool import ClientPool
from .sealing import Sealer
from .turn_request import (
    Loose,
    PromptFunction,
    PromptTool,
    TurnRequest,
    decode_options,
    given,
    prompt_call,
    prompt_message,
    turn_messages,
)

__all__ = ["CONVERSATION_HEADERS", "declared", "FINISH_REASONS", "KEEPALIVE_S", "CallPieces", "Loose", "PromptFunction", "PromptTool", "Serving", "Shape", "Turn", "TurnRequest", "TurnStream", "client_label", "decode_options", "give_back_if_gone", "given", "prompt_call", "prompt_message", "stamp", "turn_messages"]

log = logging.getLogger("modeld.http")

T = TypeVar("T")

#: how often a request that is not streamed checks its client is still there
DISCONNECT_POLL_S = 0.5
#: a streamed reply sends something at least this often, from its first byte on: while a long prefill runs the
#: client reads life (SSE comments, Messages' ``ping``, Responses' ``response.in_progress``) and how far it came,
#: where an idle stream would be a dead one to it (docs/first-request.md: what each agent waits)
KEEPALIVE_S = 5.0
#: a stream whose client stops reading for this long is ended (its decode cancelled): a client that
#: gave up without closing the connection must not hold the slot until the context is full
STREAM_SEND_TIMEOUT_S = 60.0
#: the manifest profile of requests that came over HTTP (they share one warm context, whatever the API)
PROFILE = "http"
#: names a client may use for "whatever is loaded"
_ANY_MODEL = frozenset({"", "modeld", "default"})
#: a decode's finish reason as chat completions name it (context_full: the window's end, a length limit to a
#: client; cancelled: the API has no value for a reply a cancel cut short, and "length" is the one that says the
#: reply is incomplete, where "stop" would say the model ended it)
FINISH_REASONS: dict[FinishReason, str] = {
    "stop": "stop", "length": "length", "context_full": "length", "tool_calls": "tool_calls", "cancelled": "length",
}


class Shape(BaseModel):
    """A reply's declared shape, as ``/openapi.json`` publishes it and ``make fuzz`` checks every reply against it:
    the fields every reply carries; extension fields (``prefill``, ``usage.cache_miss``) are allowed beside them."""

    model_config = ConfigDict(extra="allow")


def declared(ok: type[BaseModel] | None, error: type[BaseModel], *, stream: bool = False) -> dict[int | str, Any]:
    """A route's ``responses=``: its reply (``ok``; ``stream``: or an SSE stream of events) and the statuses any
    route answers with ``error``'s shape: a malformed request (400), a wrong key (401), an unknown model or
    response (404), a switch refused (409), a body too large (413), the daemon's failure (500), a busy slot or a
    daemon gone (503)."""
    out: dict[int | str, Any] = {}
    if ok is not None:
        out[200] = {"model": ok, **({"content": {"text/event-stream": {}}} if stream else {})}
    for status, what in ((400, "a malformed request"), (401, "a missing or wrong API key"),
                         (404, "an unknown model or response"), (409, "a model switch refused"),
                         (413, "a body over --http-max-body"), (500, "the daemon failed"),
                         (503, "the slot stayed busy, or the daemon is gone")):
        out[status] = {"model": error, "description": what}
    return out


class Turn:
    """One request's turn, from ``Serving.begin``: it holds a pooled client and the slot until its events end."""

    def __init__(self, pool: ClientPool, client: Any, chat_turn: ChatTurn, model: str) -> None:
        self._pool = pool
        self._client = client
        self._turn = chat_turn
        self._done = False
        #: the loaded model that serves the turn (the name the reply carries)
        self.model = model

    def _finish(self, healthy: bool) -> None:
        if not self._done:
            self._done = True
            self._pool.give(self._client, healthy=healthy)

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None]:
        """A scored prompt's log probabilities, once its prefill ended (``TurnRequest.score``)."""
        return self._turn.prompt_logprobs

    @property
    def count(self) -> TokenCount:
        """The prompt counted on the model before any prefill."""
        return self._turn.count

    @property
    def queued(self) -> bool:
        """The turn still waits for the slot (``queued.QueuedTurn``: a stream that started while it waits)."""
        return False

    async def ready(self) -> Turn:
        """The turn, holding the slot (this one does: ``Serving.begin`` made it)."""
        return self

    @property
    def prefilling(self) -> bool:
        """The turn's prefill has not ended yet (its client has seen nothing of the reply)."""
        return not self._turn.prefilled

    def progress(self) -> dict[str, int]:
        """While the prefill runs, how far it has come: ``{"done": …, "total": …}`` tokens of the prefill the
        daemon runs now (the stable prefix, then the conversation); empty when it has not said or is over."""
        p = self._turn.progress
        if p is None or self._turn.prefilled:
            return {}
        return {"done": p.done, "total": p.total}

    def waiting(self) -> dict[str, Any]:
        """What a keep-alive chunk says the turn waits on, as extension fields the SDKs ignore: ``queued`` while
        it waits for the slot, ``prefill`` (``progress``) while its prefill runs."""
        if self.queued:
            return {"queued": True}
        progress = self.progress()
        return {"prefill": progress} if progress else {}

    def keepalive_comment(self) -> ServerSentEvent:
        """The SSE comment a stream sends while it has nothing else to send: the prefill's progress while it runs."""
        p = self.progress()
        return ServerSentEvent(comment=f"prefill {p['done']}/{p['total']}" if p else "ping")

    def keepalive_chunk(self, empty: dict[str, Any]) -> ServerSentEvent:
        """A stream's keep-alive for an API whose clients count chunks, not comments: while the prefill runs,
        ``empty`` (a chunk that adds nothing) with what it waits on (``waiting``: the slot, or how far the prefill
        came);
        after it, while the reply streams, a comment (a chunk made here could land between two of the reply's)."""
        if not self.prefilling:
            return self.keepalive_comment()
        return ServerSentEvent(data=json.dumps({**empty, **self.waiting()}))

    def cancel(self) -> None:
        """Cut the reply short from another request: its events end with finish_reason "cancelled" (the slot and
        the client go back when they end)."""
        self._turn.cancel()

    def close(self) -> None:
        """Give back the slot and the client without running the turn (or after it ran)."""
        try:
            self._turn.close()
        except ModeldError:
            self._finish(False)
            return
        self._finish(True)

    def events(self, *, keep: bool = False) -> Generator[ChatEvent, None, None]:
        """Prefill, then the reply's deltas; the last event carries the ``ChatResult``. Closing it cancels.

        ``keep``: a reply that ends well keeps the slot and the client (``ChatTurn.events``), for ``more``;
        ``close`` gives them back."""
        return self._run(lambda: self._turn.events(keep=keep), keep)

    def more(self, **decode: Any) -> Generator[ChatEvent, None, None]:
        """The reply goes on where its last pass stopped, with ``decode`` over its options (``ChatTurn.more``);
        the slot and the client stay held until ``close``."""
        return self._run(lambda: self._turn.more(**decode), True)

    def _run(self, start: Callable[[], Generator[ChatEvent, None, None]], keep: bool) -> Generator[ChatEvent, None, None]:
        # ``start`` runs at the first step, not now: it prefills, and the caller may be the event loop
        healthy = False
        try:
            yield from start()
            healthy = True
        except ModeldError as exc:
            healthy = reusable_after(exc)
            raise
        finally:
            if not (keep and healthy):
                self._finish(healthy)

    async def result(self, request: Request) -> ChatResult:
        """Run the turn to its end (a reply that is not streamed); a failure is an ``ApiError``.

        A client that goes away before the reply is ready cancels the decode (checked
        every ``DISCONNECT_POLL_S``): nobody would read it, and the slot is free sooner.
        """
        result: ChatResult | None = None
        failure: ModeldError | None = None
        gone = False
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal gone
                while not await request.is_disconnected():
                    await anyio.sleep(DISCONNECT_POLL_S)
                gone = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                async with contextlib.aclosing(self.aevents(record_of(request))) as events:
                    async for event in events:
                        if event.result is not None:
                            result = event.result
            except ModeldError as exc:
                failure = exc
            tg.cancel_scope.cancel()
        if gone:
            log.info("the client went away before its reply was ready; the decode was cancelled")
            raise ApiError(499, "the client closed the connection", code="client_gone")
        if failure is not None:
            raise api_error(failure) from None
        if result is None:
            raise ApiError(500, "the reply ended without a result", code="Internal")
        fill_record(record_of(request), result)
        return result

    async def aevents(
        self, record: AccessRecord | None = None, *, keep: bool = False, more: DecodeConfig | None = None
    ) -> AsyncGenerator[ChatEvent, None]:
        """``events`` for an async route: each step runs in a worker thread; cancelling closes the decode.

        Closed before its end (the client went away), it cancels the turn and leaves in ``record`` what the turn
        did: the prompt and what was reused, the chunks a cut-short prefill finished, the tokens a cut-short
        decode wrote and when the first came, error "client_gone". ``keep`` and ``more`` (the options of a pass
        that goes on with the reply) are ``events``' and ``more``'s."""
        events = self.events(keep=keep) if more is None else self.more(**given(more))
        ended = False
        try:
            while True:
                event = await next_event(events, self.cancel)
                if event is None:
                    ended = True
                    return
                yield event
        except Exception:  # a failure, not a client that went away (that is a cancel or a close)
            ended = True
            raise
        finally:
            with anyio.CancelScope(shield=True):
                if ended:
                    await anyio.to_thread.run_sync(events.close)
                else:
                    cut = await anyio.to_thread.run_sync(self._cut_short, events)
                    if record is not None and not record.finish_reason:
                        self._record_cut(record, cut)

    def _cut_short(self, events: Generator[ChatEvent, None, None]) -> ChatResult | None:
        """A turn nobody reads any more: cancelled, then read to its result, which says what it did (the prefill
        stops at its next chunk, the decode within a token); None when it failed instead."""
        self.cancel()
        try:
            for event in events:
                if event.result is not None:
                    return event.result
        except ModeldError:
            pass
        finally:
            events.close()
        return None

    def _record_cut(self, record: AccessRecord, result: ChatResult | None) -> None:
        if result is not None:
            fill_record(record, result)
            record.finish_reason = result.finish_reason or "cancelled"
        else:
            u = self._turn.so_far
            record.prompt_tokens, record.cached_tokens = u.prompt_tokens, u.reused_tokens
            record.miss = u.miss.brief() if u.miss is not None else ""
            # a prefill cut short: the chunks it finished (kept for the next turn with the same head)
            record.prefilled_tokens = u.prefilled_tokens
            record.finish_reason = "cancelled"
        record.error = record.error or "client_gone"


def stamp(req: TurnRequest, request: Request) -> None:
    """Whose conversation ``req`` continues and who sent it, from the HTTP request, where the route did not say."""
    req.conversation = req.conversation or conversation_of(request.headers)
    req.client = req.client or client_label(request)


async def give_back_if_gone(turn: Turn, request: Request) -> None:
    """A turn whose client went away while it waited for the slot goes back at once (a 499): left open, it would
    hold the slot, its lease renewed by a live client, until the session's TTL."""
    if await request.is_disconnected():
        await anyio.to_thread.run_sync(turn.close)
        log.info("the client went away while its request waited for the slot")
        raise ApiError(499, "the client closed the connection", code="client_gone")


async def next_event(events: Generator[ChatEvent, None, None], cancel: Callable[[], None]) -> ChatEvent | None:
    """A turn's next event, read in a worker thread. Cancelled while it waits (the client went away), it calls
    ``cancel`` (the turn's), so the prefill or decode that thread waits on stops at its next chunk or token, and
    returns once the thread has given the generator back (it must be closed after, never under, that thread).

    A plain ``anyio.to_thread.run_sync`` would hold the cancel until the thread returns: for the whole of a
    long prefill, or for ever while a decode streams text a parser holds back, with the slot held throughout.
    """
    idle = threading.Event()
    lock = threading.Lock()
    ran = abandoned = False

    def step() -> ChatEvent | None:
        nonlocal ran
        with lock:
            if abandoned:  # the route was cancelled before this thread took the step: nothing to do
                return None
            ran = True
        try:
            return next(events, None)
        finally:
            idle.set()

    try:
        return await anyio.to_thread.run_sync(step, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        with lock:
            abandoned = True
            running = ran
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(cancel)  # (it waits for the client's socket: not on the loop)
            if running:
                # A step cancelled before a worker thread took it never runs (anyio drops it), and waiting for
                # its end would hold the slot for ever: only a step that started is waited for.
                await anyio.to_thread.run_sync(idle.wait)
        raise


class TurnStream(EventSourceResponse):
    """A streamed reply that gives its turn back when the response ends, however it ends: a client that went away
    before the first event left a generator that never ran, and so never closed the turn it was to run."""

    def __init__(self, turn: Turn, content: Any, **kw: Any) -> None:
        super().__init__(content, **kw)
        self._turn = turn

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._turn.close)


async def close_events(events: AsyncGenerator[ChatEvent, None]) -> None:
    """Close a route's ``Turn.aevents`` before its response ends, even when the route was cancelled (the client
    went away): the decode stops and the access record says what the turn did before it is logged."""
    with anyio.CancelScope(shield=True):
        await events.aclose()


def created_at(active: ActiveModel) -> int:
    """A model's ``created`` (Unix seconds): when the daemon loaded it, else its file's modification time (a
    daemon that does not report the load time), else 0 (the file is not on this machine)."""
    if active.loaded_at:
        return int(active.loaded_at)
    try:
        return int(os.stat(active.path).st_mtime) if active.path else 0
    except OSError:
        return 0


#: request headers that name the conversation a request continues, the most specific first: Claude Code's
#: sub-agent id (a sub-agent's requests carry it; the main agent's carry none), then its session id, Codex's
#: thread id and OpenCode's session id (a sub-agent there is a session of its own)
CONVERSATION_HEADERS = ("x-claude-code-agent-id", "x-claude-code-session-id", "thread-id", "x-session-id")


def client_label(request: Request | WebSocket) -> str:
    """Who sent a request, as status shows the turn it runs: the route and the client's address."""
    peer = request.client
    where = f"{peer.host}:{peer.port}" if peer is not None else "?"
    method = request.scope.get("method") or "WS"
    return f"{method} {request.url.path} from {where}"


def conversation_of(headers: Mapping[str, str]) -> str:
    """The conversation a request's headers name (``CONVERSATION_HEADERS``), "" when none does: the workspace cache
    then tells conversations apart by their tokens."""
    for name in CONVERSATION_HEADERS:
        value = headers.get(name, "").strip()
        if value:
            return value[:256]
    return ""


def reusable_after(exc: ModeldError) -> bool:
    """Whether a client that raised ``exc`` may serve another request (not after a transport failure)."""
    return not isinstance(exc, (Unavailable, WireError))


def miss_field(u: ChatUsage) -> dict[str, Any]:
    """A usage's ``cache_miss`` (``ReuseMiss``: where the prompt's reuse stopped and why) when the prompt lost
    something the daemon held, as the extension field every API's SDK ignores; nothing otherwise."""
    return {"cache_miss": u.miss.model_dump(mode="json")} if u.miss is not None else {}


def dumped(reply: BaseModel) -> dict[str, Any]:
    """A reply model as the JSON object it is sent as: the fields it was built with (an optional field left out
    stays out; one set to None is sent as null), extension fields included, each under its wire name."""
    return reply.model_dump(mode="json", exclude_unset=True, by_alias=True)


def fill_record(record: AccessRecord, result: ChatResult) -> None:
    """The access-log fields of a finished turn."""
    u = result.usage
    record.prompt_tokens = u.prompt_tokens
    record.cached_tokens = u.reused_tokens
    record.miss = u.miss.brief() if u.miss is not None else ""
    record.completion_tokens = u.completion_tokens
    record.finish_reason = result.finish_reason  # the daemon's own: the log tells context_full and cancelled apart
    record.ttft_ms = result.timing.ttft_ms
    record.prefilled_tokens = u.prefilled_tokens
    record.prefill_ms = result.timing.prefill_ms


@dataclass(frozen=True)
class Route:
    """The model a request is served by, and whether its open asks the slot to switch to it (by name)."""

    model: str
    switch: bool = False


class CallPieces:
    """A streamed reply's tool calls as every API streams them: per call index, a first piece with the call's id
    and name, then its arguments as the model writes them (``ChatEvent.tool_call_deltas``). A finished call that
    no piece announced (a daemon that sends none) comes as one piece of its own. A call's pieces all come before
    the next call's first one."""

    def __init__(self) -> None:
        self._index: dict[str, int] = {}  # call id -> its index
        self._next = 0
        #: the ids of the calls the reply finished (a call cut short by the reply's end is not among them)
        self.finished: set[str] = set()

    def of(self, event: ChatEvent) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        for d in event.tool_call_deltas:
            if d.id:
                self._index[d.id] = d.index
                self._next = max(self._next, d.index + 1)
            if out and out[-1].index == d.index and not d.id:  # (frames merged on the way: one piece per call)
                out[-1] = out[-1].model_copy(update={"arguments": out[-1].arguments + d.arguments})
            else:
                out.append(d)
        for call in event.tool_calls:
            self.finished.add(call.id)
            if call.id and call.id in self._index:
                continue
            index = self._next
            self._next += 1
            if call.id:
                self._index[call.id] = index
            out.append(ToolCallDelta(index=index, id=call.id, name=call.function.name,
                                     arguments=call.function.arguments))
        return out


class HeldLogprobs:
    """A streamed reply's token log probabilities as every API hands them out: with the next delta that shows
    something. A token whose event showed nothing (text a parser or a stop string holds back) waits for the next
    delta; the result carries all of them, so the finish hands on those the events never carried."""

    def __init__(self) -> None:
        #: every token's the events and the result carried, in order
        self.all: list[TokenLogprob] = []
        self._held: list[TokenLogprob] = []  # of those, the ones not handed out yet

    def add(self, event: ChatEvent) -> None:
        """Take an event's tokens (or, for the event that carries the result, the result's the events did not)."""
        new = event.result.logprobs[len(self.all):] if event.result is not None else event.logprobs
        self.all += new
        self._held += new

    def add_end(self, result: ChatResult) -> None:
        """The end-of-generation token that ended the reply (``ChatResult.end_logprob``), for an API that lists it."""
        if result.end_logprob is not None:
            self._held.append(result.end_logprob)

    def take(self) -> list[TokenLogprob]:
        """The tokens not handed out yet, handed out now."""
        out, self._held = self._held, []
        return out


class Serving:
    """What every API route runs on: the daemon's clients, the model names it answers to, the queue timeout."""

    def __init__(self, pool: ClientPool, settings: HttpSettings, *, sealer: Sealer | None = None) -> None:
        self.pool = pool
        #: the front's settings (``HttpSettings``, passed whole): the queue's timeout, the model names it
        #: answers (aliases, strict names, switching on request), the billing header
        self.settings = settings
        self.aliases = settings.aliases
        #: signs what clients echo back (thinking signatures, reasoning blobs)
        self.sealer = sealer or Sealer.from_file(None)
        #: the front's own metrics (the WebSocket protocol's), served after the daemon's on ``/metrics``
        self.registry = CollectorRegistry()

    # --- model names ---------------------------------------------------------------------------
    def status(self) -> DaemonStatus:
        """The daemon's status (blocking: call it in a worker thread)."""
        with self.pool.client() as c:
            return c.status()

    def readouts(self) -> ReadoutInfo:
        """The readout manifest the daemon serves; 404 when it serves none (``serve --readouts``)."""
        info = self.status().readouts
        if info is None:
            raise ApiError(404, "this daemon serves no readout manifest: start it with --readouts FILE",
                           code="not_found")
        return info

    @staticmethod
    def _check_loaded(st: DaemonStatus) -> ActiveModel:
        """The loaded model; 503 while one loads, 404 when none is."""
        if st.active is None:
            if st.state in (SlotState.LOADING, SlotState.SWITCHING):
                raise ApiError(503, "the model is loading", code="loading", headers={"Retry-After": "1"})
            raise ApiError(404, "no model is loaded (modeld load …)", code="model_not_found", param="model")
        return st.active

    def active(self) -> ActiveModel:
        """The loaded model; 503 while one loads, 404 when none is."""
        return self._check_loaded(self.status())

    def route(self, requested: str, st: DaemonStatus | None = None) -> Route:
        """Which model serves a request for ``requested``, and whether the slot must switch to it (``st``: a
        status the caller already holds, so the daemon is not asked again).

        * a name the front's ``--alias`` maps, one that means "any" (``""``, ``modeld``, ``default``), or the
          loaded model's: the loaded model (a known model's name is sent with the open, so a switch that ran
          meanwhile cannot hand the request another model);
        * a model the daemon knows by name (its store, the bundled one, the preloaded one: ``status.models``):
          that model, switching the slot to it, unless ``switch_on_request`` is off (409, the names listed);
        * any other name: the loaded model (agents hard-code names), or 404 under ``strict_model_names``.
        """
        st = st or self.status()
        target = self.aliases.get(requested, requested)
        stored_aliases = dict(st.models["aliases"]) if st.models is not None else {}
        names = list(st.models["names"]) if st.models is not None else []
        by_lower = {n.lower(): n for n in names}  # the store's names are lower case, a preloaded file's may not be
        canonical = by_lower.get(stored_aliases.get(target.lower(), target.lower()), "")
        loaded = st.active.model_name if st.active is not None else ""
        if target in _ANY_MODEL or target == loaded:
            self._check_loaded(st)
            return Route(loaded, switch=target == loaded and loaded in names)
        if canonical:
            if canonical == loaded:
                return Route(loaded, switch=True)
            if not self.settings.switch_on_request:
                raise ApiError(409, f"model {requested!r} is not loaded, and this daemon does not switch models on "
                               f"request (--switch-on-request off); loaded: {loaded or 'none'}; it can load: "
                               f"{', '.join(names)} (modeld load NAME)", code="model_not_loaded", param="model")
            return Route(canonical, switch=True)
        self._check_loaded(st)
        if self.settings.strict_model_names:
            answered = sorted({loaded, *self.aliases})
            raise ApiError(404, f"model {requested!r} is not served here; this daemon serves {loaded!r} "
                           f"(names it answers to: {', '.join(answered)}; it can load: {', '.join(names) or 'none'})",
                           code="model_not_found", param="model")
        log.debug("a request for model %r is served by the loaded model %r", requested, loaded)
        return Route(loaded, switch=False)

    def models(self) -> tuple[list[tuple[str, list[str] | None]], int]:
        """What ``/v1/models`` lists: the loaded model's name first, the aliases that lead to it, then every
        other model the daemon can load by name (its store's, the bundled one), each with what it can be asked
        for where that is known (the loaded model's ``ActiveModel.capabilities``; None for the others), and
        when the loaded one was created there (``created_at``; now when none is loaded)."""
        st = self.status()
        loaded = st.active.model_name if st.active is not None else ""
        names = [*([loaded] if loaded else []),
                 *sorted(a for a, t in self.aliases.items() if t == loaded and a != loaded)]
        caps = list(st.active.capabilities) if st.active is not None else None
        listed: list[tuple[str, list[str] | None]] = [(n, caps) for n in names]
        stored = [*st.models["names"], *sorted(st.models["aliases"])] if st.models is not None else []
        listed += [(n, None) for n in dict.fromkeys(stored) if n not in names]
        if not listed:
            self._check_loaded(st)
        return listed, created_at(st.active) if st.active is not None else int(time.time())

    # --- turns ---------------------------------------------------------------------------------
    def begin(self, req: TurnRequest, *, check_fit: bool = True, route: Route | None = None) -> Turn:
        """Take the slot for ``req`` and check its prompt fits (blocking: call it in a worker thread); ``route``:
        the caller's own ``route(req.model)``, when it already took one.

        Raises ``ApiError`` or a ``ModeldError`` (``errors.api_error`` maps it) for
        anything that refuses the request; nothing has been prefilled then.
        """
        if req.images:
            st = self.status()  # one status for the route and the images' model
            route = route or self.route(req.model, st)
            req.messages = place_images(req.messages, self._check_images(req.images, route, st))
        route = route or self.route(req.model)
        model = route.model
        client = self.pool.take()
        try:
            request = OpenSessionRequest(model_name=route.model if route.switch else "", switch=route.switch,
                                         client=req.client)
            chat = Chat(client, profile=PROFILE, queue_timeout_s=self.settings.http_queue_timeout, request=request)
            if req.prompt is not None:
                chat_turn = chat.begin_prompt(req.prompt, check_fit=check_fit, conversation=req.conversation,
                                              score=req.score, **given(req.decode))
            else:
                chat_turn = chat.begin(req.messages, [t.model_dump(exclude_none=True) for t in req.tools] or None,
                                       check_fit=check_fit,
                                       enable_thinking=req.enable_thinking, conversation=req.conversation,
                                       **given(req.decode))
        except ModeldError as exc:
            self.pool.give(client, healthy=reusable_after(exc))
            raise
        except BaseException:
            self.pool.give(client)
            raise
        return Turn(self.pool, client, chat_turn, chat_turn.model_name or model)

    def _check_images(self, refs: list[ImageRef], route: Route, st: DaemonStatus) -> list[Image]:
        """The request's images read and checked (``images.read_images``), then the model that would serve them
        (``st``: the daemon's status): one without an image encoder refuses them with ``vision_unsupported``."""
        cfg = self.settings
        images = read_images(refs, ImageLimits(cfg.max_images, int(cfg.max_image_bytes), cfg.max_image_pixels,
                                               cfg.allow_image_urls))
        if st.active is not None and st.active.model_name == route.model:
            capabilities = st.active.capabilities
        else:  # a model the request switches to: what its file says, before it is loaded
            with self.pool.client() as c:
                capabilities = c.describe(OpenSessionRequest(model_name=route.model)).capabilities
        if "vision" not in capabilities:
            raise ApiError(400, f"{refs[0].where} is an image, and model {route.model!r} reads text only (its "
                           f"capabilities: {', '.join(capabilities)}); serve a model with an image encoder for images",
                           code="vision_unsupported", param=refs[0].where)
        return images

    async def abegin(self, req: TurnRequest, request: Request | None = None, *, route: Route | None = None) -> Turn:
        """``begin`` in a worker thread, its refusals as ``ApiError``.

        The slot a turn takes goes back at once when nobody will run the turn: the route was cancelled while
        ``begin`` waited (the thread runs on to its end, and its turn is closed), or ``request``'s client went
        away meanwhile (a 499): a turn left open would hold the slot, its lease renewed by a live client,
        until the session's TTL."""
        taken: list[Turn] = []
        if request is not None:
            stamp(req, request)

        def run() -> Turn:
            taken.append(self.begin(req, route=route))
            return taken[-1]

        try:
            turn = await anyio.to_thread.run_sync(run)
        except ModeldError as exc:
            raise api_error(exc) from None
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                for t in taken:
                    await anyio.to_thread.run_sync(t.close)
            raise
        if request is not None:
            await give_back_if_gone(turn, request)
        return turn

    def on_session(self, model: str, call: Callable[[Any], T]) -> T:
        """``call`` on a session of the model ``model`` routes to (``route``), the slot taken for the call only, in
        arrival order with the turns (blocking: call it in a worker thread)."""
        route = self.route(model)
        client = self.pool.take()
        healthy = True
        try:
            req = OpenSessionRequest(model_name=route.model if route.switch else "", switch=route.switch,
                                     queue_timeout_s=self.settings.http_queue_timeout)
            sess = client.open_session(req)
            try:
                return call(sess)
            finally:
                sess.close()
        except ModeldError as exc:
            healthy = reusable_after(exc)
            raise
        finally:
            self.pool.give(client, healthy=healthy)

    async def aon_session(self, model: str, call: Callable[[Any], T]) -> T:
        """``on_session`` in a worker thread, its refusals as ``ApiError``."""
        try:
            return await anyio.to_thread.run_sync(self.on_session, model, call)
        except ModeldError as exc:
            raise api_error(exc) from None

    async def acount(self, req: TurnRequest) -> TokenCount:
        """``count`` in a worker thread, its refusals as ``ApiError``."""
        try:
            return await anyio.to_thread.run_sync(self.count, req)
        except ModeldError as exc:
            raise api_error(exc) from None

    def count(self, req: TurnRequest) -> TokenCount:
        """What ``req``'s prompt comes to on the loaded model (the slot is taken for the count only)."""
        turn = self.begin(req, check_fit=False)
        turn.close()
        return turn.count
