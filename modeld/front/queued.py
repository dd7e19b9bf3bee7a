"""A streamed request that waits for the slot: its stream starts before its turn does.

A request that finds the slot busy waits for it in arrival order, up to the
queue timeout (``--http-queue-timeout``, 300 s). A reply that is not streamed
just waits. A streamed one used to send nothing at all meanwhile, not even its
response headers, and an agent gives up on a request whose headers do not come:
Qwen Code after 120 s, OpenCode after 300 s (docs/first-request.md). So a
streamed request waits for its turn up to a grace (``--http-stream-grace``,
15 s): begun by then, it is answered as before, a refusal as the route's HTTP
status. Past the grace, its stream starts at once and sends its API's
keep-alives while it waits on (sse-starlette's pings, made by each route from
``Turn.queued``), and a refusal that comes later (the queue timeout, a prompt
that does not fit the window) is the stream's error event, which the official
SDKs raise as they do any error event.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, Generator
from typing import Any

import anyio
from starlette.requests import Request

from contract.errors import ModeldError
from contract.types import DecodeConfig, TokenCount, TokenLogprob
from runtime.chat import ChatEvent, ChatResult

from .access import AccessRecord
from .core import Serving, Turn, TurnRequest, give_back_if_gone, stamp
from .errors import api_error

__all__ = ["QueuedTurn", "abegin_streamed"]

log = logging.getLogger("modeld.http")

#: the threads streamed requests wait for the slot in (each waits up to the queue timeout; threads are made as
#: they are needed, so the cap only bounds how many wait at once, far above what agents send)
_WAITERS = concurrent.futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="slot-wait")


async def abegin_streamed(serving: Serving, req: TurnRequest, request: Request) -> Turn:
    """``Serving.abegin`` for a streamed reply: its turn when ``begin`` ends within ``--http-stream-grace`` (a
    refusal then is an ``ApiError``, the route's status code); past the grace, a ``QueuedTurn`` whose stream
    starts now and whose refusal is the stream's error event."""
    stamp(req, request)
    route = await anyio.to_thread.run_sync(serving.route, req.model)  # an unknown model is a status code
    begun = _WAITERS.submit(functools.partial(serving.begin, req, route=route))
    try:
        turn = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(begun)), serving.settings.http_stream_grace)
    except TimeoutError:
        log.info("a streamed request waits for the slot: its stream starts, with keep-alives while it waits")
        return QueuedTurn(begun, route.model)
    except ModeldError as exc:
        raise api_error(exc) from None
    except asyncio.CancelledError:  # the route was cancelled: whatever ``begin`` takes goes back when it ends
        _close_when_begun(begun)
        raise
    await give_back_if_gone(turn, request)
    return turn


def _close_when_begun(begun: concurrent.futures.Future[Turn]) -> None:
    """Give back the turn ``begun`` takes, now or when it ends (in the thread that waited for it)."""

    def close(f: concurrent.futures.Future[Turn]) -> None:
        if not f.cancelled() and f.exception() is None:
            f.result().close()

    begun.add_done_callback(close)


class QueuedTurn(Turn):
    """A streamed request's turn that still waits for the slot: a ``Turn`` once ``ready`` returned.

    Until then it is ``queued`` (each route's keep-alive says so in its API's terms), ``prefilling`` with no
    progress, and a cancel is kept for the turn it becomes. Closing it gives the slot back as soon as the wait
    ends, if the wait takes it."""

    def __init__(self, begun: concurrent.futures.Future[Turn], model: str) -> None:  # noqa: D107
        # no ``Turn.__init__``: there is no client or turn yet, only the wait for them (``_inner`` once it ended)
        self._begun = begun
        self._inner: Turn | None = None
        self._cancelled = False
        #: the model the route names (the reply carries it while the turn waits)
        self.model = model

    async def ready(self) -> Turn:
        """The turn, once it holds the slot; its refusal (``ModeldError``, or an ``ApiError`` for the images)
        raised. Cancelled meanwhile, the turn it takes later goes back when its stream closes it."""
        if self._inner is None:
            turn = await asyncio.shield(asyncio.wrap_future(self._begun))
            self._inner = turn
            self.model = turn.model
            if self._cancelled:
                await anyio.to_thread.run_sync(turn.cancel)
        return self._inner

    def _turn_now(self) -> Turn:
        if self._inner is None:
            raise RuntimeError("the turn still waits for the slot (QueuedTurn.ready)")
        return self._inner

    @property
    def queued(self) -> bool:
        return self._inner is None

    @property
    def count(self) -> TokenCount:
        return self._turn_now().count

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None]:
        return self._turn_now().prompt_logprobs

    @property
    def prefilling(self) -> bool:
        return self._inner is None or self._inner.prefilling

    def progress(self) -> dict[str, int]:
        return {} if self._inner is None else self._inner.progress()

    def cancel(self) -> None:
        self._cancelled = True
        if self._inner is not None:
            self._inner.cancel()

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
        else:
            _close_when_begun(self._begun)

    def events(self, *, keep: bool = False) -> Generator[ChatEvent, None, None]:
        return self._turn_now().events(keep=keep)

    def more(self, **decode: Any) -> Generator[ChatEvent, None, None]:
        return self._turn_now().more(**decode)

    async def result(self, request: Request) -> ChatResult:
        return await (await self.ready()).result(request)

    async def aevents(
        self, record: AccessRecord | None = None, *, keep: bool = False, more: DecodeConfig | None = None
    ) -> AsyncGenerator[ChatEvent, None]:
        """The wait, then the turn's events: a refusal is raised from the first step, so each route's stream
        ends with its API's error event; a client gone while it waited leaves ``client_gone`` in ``record``."""
        try:
            turn = await self.ready()
        except asyncio.CancelledError:
            if record is not None:
                record.error, record.finish_reason = "client_gone", "cancelled"
            raise
        async with contextlib.aclosing(turn.aevents(record, keep=keep, more=more)) as events:
            async for event in events:
                yield event

