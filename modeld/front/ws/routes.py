"""``GET /v1/ws``: one connection, generation after generation, each steerable while it runs.

A generation is one ``Turn`` of the serving core, run with its session kept
(``Turn.events(keep=True)``): ``pause`` and ``modify`` stop the running decode
pass within a token (``Turn.cancel``) and keep the slot; ``resume`` and the
modified parameters go on with a new pass on the same session (``Turn.more``),
so the reply continues from the tokens already in the KV and a greedy reply
with a pause is the one without. The slot stays held while paused for at most
``--ws-pause-limit`` seconds. ``stop`` ends the generation (``completion`` with
finish_reason "cancelled"); ``regenerate`` ends it so and runs its ``config``
again, whose prompt is then all resident. A client that goes away cancels its
generation, and the slot is free as soon as the decode has stopped.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import APIRouter, WebSocket
from prometheus_client import Counter
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from contract.errors import ModeldError
from contract.types import DecodeConfig, ToolCall
from runtime.chat import ChatResult

from ..core import Route, Serving, Turn, TurnRequest, client_label, decode_options, given, turn_messages
from ..errors import ApiError, api_error
from ..images import ImageRef, take_images
from .feedback import FILE_NAME, FeedbackLog
from .protocol import (
    CLIENT_MESSAGE,
    Auth,
    Completion,
    Config,
    Control,
    ErrorMessage,
    Feedback,
    Init,
    ModelInfo,
    Status,
    Timing,
    Token,
    TokenTiming,
    Usage,
    error_message,
    schemas,
)

__all__ = ["CAPABILITIES", "PATH", "router"]

log = logging.getLogger("modeld.ws")

PATH = "/v1/ws"
#: what a generation here can do (``init.capabilities``)
CAPABILITIES = ["stream", "stop", "pause", "resume", "regenerate", "modify", "feedback", "logprobs", "token_ids",
                "tools", "prefill_progress"]
#: prefill progress goes out at most this often
PROGRESS_S = 0.5
#: a generation still waiting for the slot after this says so (and again every ``QUEUED_REPEAT_S``)
QUEUED_S = 0.5
QUEUED_REPEAT_S = 5.0
#: generations a connection remembers for ``feedback`` by ``request_id``
REMEMBERED = 64
#: the close code for a client that did not authenticate (RFC 6455: policy violation)
POLICY_VIOLATION = 1008


class _Gone(Exception):
    """The client went away (a send found the connection closed)."""


@dataclass
class _Tally:
    """Where a generation is: the next token's position, the tokens it produced, its timing so far."""

    started: float
    position: int
    last_token: float
    produced: int = 0
    timing: Timing = field(default_factory=Timing)


class _Generation:
    """One ``config``'s generation on a connection, and what the client asked of it while it runs."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.id = f"gen_{uuid.uuid4().hex[:16]}"
        #: the decode options now (``modify`` changes them)
        self.decode = config.parameters.decode()
        self.model = ""
        self.digest = ""
        self.turn: Turn | None = None
        #: decoding (not queued, not prefilling): a control stops the running pass at once
        self.decoding = False
        self.paused = False
        #: the control that ends the running pass: "pause", "modify", "stop" or "regenerate" (None: none)
        self.action: str | None = None
        #: the running pass was asked to stop
        self.cut = False
        #: what a paused generation waits for (``resume``, ``stop``, ``regenerate``)
        self.wake = anyio.Event()
        self.scope = anyio.CancelScope()
        #: how it ended, for its log line ("": the client went away first)
        self.outcome = ""


class _Connection:
    def __init__(self, socket: WebSocket, serving: Serving, feedback: FeedbackLog, ended: Counter) -> None:
        self.socket = socket
        self.serving = serving
        self.feedback = feedback
        self.ended = ended
        self.send_lock = anyio.Lock()
        self.gen: _Generation | None = None
        self.known: OrderedDict[str, _Generation] = OrderedDict()
        self.authed = not serving.settings.api_key
        self.tg: anyio.abc.TaskGroup | None = None

    # --- sending --------------------------------------------------------------------------------------------
    async def send(self, message: Init | Token | Completion | Status | ErrorMessage) -> None:
        body = message.model_dump(mode="json", exclude_none=True)
        async with self.send_lock:
            if self.socket.application_state != WebSocketState.CONNECTED:
                raise _Gone
            try:
                await self.socket.send_text(json.dumps(body, ensure_ascii=False))
            except (WebSocketDisconnect, RuntimeError, OSError) as exc:
                raise _Gone from exc

    def _ended(self, gen: _Generation) -> None:
        """``gen`` takes no more controls, and a new ``config`` is welcome (its turn may still be closing: a new
        one waits for the slot as any request does)."""
        if self.gen is gen:
            self.gen = None

    async def refuse(self, err: ApiError, request_id: str = "") -> None:
        await self.send(error_message(err, request_id))

    # --- the connection -------------------------------------------------------------------------------------
    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            self.tg = tg
            try:
                while True:
                    message = await self.socket.receive()
                    if message["type"] == "websocket.disconnect":
                        break
                    text = message.get("text")
                    if text is None:
                        raw = message.get("bytes") or b""
                        try:
                            text = raw.decode()
                        except UnicodeDecodeError:
                            text = ""
                    if not await self.handle(text):
                        break
            except (_Gone, WebSocketDisconnect):
                pass
            finally:
                # the client went away (or was refused): its generation stops, and the slot is free once it has
                tg.cancel_scope.cancel()

    async def handle(self, text: str) -> bool:
        """One client message; False: close the connection."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            if not self.authed:
                return await self._unauthorized()
            await self.refuse(ApiError(400, f"the message is not JSON: {exc}", code="invalid_json"))
            return True
        try:
            msg = CLIENT_MESSAGE.validate_python(raw)
        except ValidationError as exc:
            if not self.authed:
                return await self._unauthorized()
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            await self.refuse(ApiError(400, f"{where or 'message'}: {first.get('msg', 'invalid')}",
                                       code="invalid_message", param=where or None))
            return True
        if not self.authed:
            key = msg.api_key if isinstance(msg, (Auth, Config)) else None
            if key is None or not hmac.compare_digest(key.encode(), self.serving.settings.api_key.encode()):
                return await self._unauthorized()
            self.authed = True
        if isinstance(msg, Auth):
            await self.send(Status(operation="authenticated"))
        elif isinstance(msg, Config):
            await self._config(msg)
        elif isinstance(msg, Control):
            await self._control(msg)
        else:
            await self._feedback(msg)
        return True

    async def _unauthorized(self) -> bool:
        await self.refuse(ApiError(401, "missing or wrong API key: send it in the Authorization header or as the "
                                        "first message ({\"type\": \"auth\", \"api_key\": ...})",
                                   code="invalid_api_key"))
        with contextlib.suppress(Exception):
            await self.socket.close(POLICY_VIOLATION)
        return False

    async def _config(self, config: Config) -> None:
        if self.gen is not None:
            await self.refuse(ApiError(409, f"generation {self.gen.id} is still running: wait for its completion, "
                                            "or send a stop first", code="generation_running"), self.gen.id)
            return
        if (config.prompt is None) == (config.messages is None):
            await self.refuse(ApiError(400, "a config takes exactly one of prompt and messages",
                                       code="invalid_message", param="prompt"))
            return
        if config.options.echo_prompt and config.prompt is None:
            await self.refuse(ApiError(400, "echo_prompt needs a prompt (not messages)", code="invalid_message",
                                       param="options.echo_prompt"))
            return
        self._start(_Generation(config))

    def _start(self, gen: _Generation) -> None:
        assert self.tg is not None
        self.gen = gen
        self.known[gen.id] = gen
        while len(self.known) > REMEMBERED:
            self.known.popitem(last=False)
        self.tg.start_soon(self._generate, gen)

    async def _control(self, control: Control) -> None:
        gen = self.gen
        action = control.action
        if gen is None:
            last = next(reversed(self.known.values()), None)
            if action == "regenerate" and last is not None:
                self._start(_Generation(last.config))
                return
            await self.refuse(ApiError(400, f"no generation is running to {action}", code="no_generation"))
            return
        if action == "modify":
            if control.parameters is None or not control.parameters.model_fields_set:
                await self.refuse(ApiError(400, "modify needs the parameters to change", code="invalid_message",
                                           param="parameters"), gen.id)
                return
            gen.decode = decode_options(**given(gen.decode, control.parameters.decode()))
            if gen.paused:  # the next pass (resume) takes them
                await self.send(Status(request_id=gen.id, operation="modified", parameters=given(gen.decode),
                                       message="applied when the generation resumes"))
                return
        if action == "resume":
            if not gen.paused:
                await self.refuse(ApiError(400, "the generation is not paused", code="not_paused"), gen.id)
                return
            gen.action = "resume"
            gen.wake.set()
            return
        if action == "pause" and gen.paused:
            await self.send(Status(request_id=gen.id, operation="paused", message="already paused"))
            return
        if gen.action in ("stop", "regenerate"):
            return  # ending already
        gen.action = action
        if gen.paused:
            gen.wake.set()
        elif gen.turn is None and action in ("stop", "regenerate"):
            gen.scope.cancel()  # still waiting for the slot: it never runs
        elif gen.decoding or action in ("stop", "regenerate"):
            await self._cut(gen)
        # (a pause or modify during the prefill stops the first pass at its first token)

    async def _cut(self, gen: _Generation) -> None:
        if gen.turn is not None and not gen.cut:
            gen.cut = True
            await anyio.to_thread.run_sync(gen.turn.cancel)

    async def _feedback(self, fb: Feedback) -> None:
        gen = self.known.get(fb.request_id) if fb.request_id else next(reversed(self.known.values()), None)
        if gen is None:
            await self.refuse(ApiError(400, f"no generation {fb.request_id!r} on this connection" if fb.request_id
                                       else "no generation on this connection to rate", code="no_generation"))
            return
        entry = {"request_id": gen.id, "model": gen.model, "digest": gen.digest, "rating": fb.rating,
                 "text": fb.text, "position": fb.position}
        try:
            await anyio.to_thread.run_sync(self.feedback.add, entry)
        except OSError as exc:
            await self.refuse(ApiError(500, f"the feedback log could not be written: {exc}", code="feedback_failed"),
                              gen.id)
            return
        await self.send(Status(request_id=gen.id, operation="feedback", message="recorded"))

    # --- a generation ---------------------------------------------------------------------------------------
    async def _generate(self, gen: _Generation) -> None:
        again = False
        try:
            with gen.scope:
                await self._run(gen)
            if gen.turn is None and gen.action in ("stop", "regenerate"):  # stopped while it waited for the slot
                await self._complete(gen, "cancelled", [], None, [], Usage(prompt_tokens=0, completion_tokens=0,
                                                                            total_tokens=0), Timing())
            again = gen.action == "regenerate"
        except _Gone:
            pass
        except (ApiError, ModeldError) as exc:
            await self._failed(gen, exc if isinstance(exc, ApiError) else api_error(exc))
        except Exception as exc:  # a defect here must not end the connection without a word
            log.exception("WebSocket generation %s failed", gen.id)
            await self._failed(gen, ApiError(500, f"{type(exc).__name__}: {exc}", code="Internal"))
        finally:
            self._ended(gen)
            turn, gen.turn = gen.turn, None
            if turn is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(turn.close)
            if not gen.outcome:
                self.ended.labels("client_gone").inc()
            log.info("ws %s %s %s", gen.id, gen.model or "-", gen.outcome or "finish=cancelled error=client_gone")
        if again and self.gen is None:  # (unless the client sent a config of its own meanwhile)
            self._start(_Generation(gen.config))

    async def _failed(self, gen: _Generation, err: ApiError) -> None:
        self._ended(gen)
        self.ended.labels("error").inc()
        gen.outcome = f"error={err.code or err.status}"
        with contextlib.suppress(_Gone):
            await self.refuse(err, gen.id)

    def _request(self, config: Config) -> TurnRequest:
        decode = config.parameters.decode()
        decode.return_token_ids = True
        lp = config.options.include_logprobs
        if lp is not False:
            decode.logprobs = 0 if lp is True else int(lp)
        tools = list(config.tools)
        if config.prompt is not None:
            return TurnRequest(messages=[], prompt=config.prompt, decode=decode, model=config.model)
        images: list[ImageRef] = []
        messages = turn_messages(take_images(list(config.messages or []), images))
        return TurnRequest(messages=messages, tools=tools, decode=decode, model=config.model, images=images)

    async def _run(self, gen: _Generation) -> None:
        started = time.perf_counter()
        req = self._request(gen.config)
        route = await self._announce(gen)
        turn = await self._begin(gen, req, route)
        gen.turn = turn
        prompt = turn.count.prompt_tokens
        tally = _Tally(started=started, position=prompt, last_token=started)
        texts: list[str] = []
        thinking: list[str] = []
        calls: list[ToolCall] = []
        usage: Usage | None = None
        more: DecodeConfig | None = None
        finish = ""
        while True:
            result = await self._pass(gen, turn, more, tally)
            texts.append(result.message.content or "")
            thinking.append(result.message.reasoning or "")
            calls += result.message.tool_calls
            if usage is None:
                u = result.usage
                usage = Usage(prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt,
                              cached_tokens=u.reused_tokens, prefilled_tokens=u.prefilled_tokens)
                tally.timing.prefill_ms = result.timing.prefill_ms
            finish = result.finish_reason
            action, gen.action = gen.action, None
            if finish != "cancelled" or action in (None, "stop", "regenerate"):
                gen.action = action
                break
            if action == "pause":
                if not await self._pause(gen, tally.position):
                    finish = "cancelled"
                    break
            else:
                await self.send(Status(request_id=gen.id, operation="modified", position=tally.position,
                                       parameters=given(gen.decode)))
            more = decode_options(**given(gen.decode), return_token_ids=True)
            limit = gen.decode.max_tokens
            if limit is not None:
                if tally.produced >= limit:
                    finish = "length"
                    break
                more.max_tokens = limit - tally.produced
        assert usage is not None
        usage = usage.model_copy(update={"completion_tokens": tally.produced, "total_tokens": prompt + tally.produced})
        tally.timing.total_ms = (time.perf_counter() - started) * 1000
        await self._complete(gen, finish, texts, thinking, calls, usage, tally.timing)

    async def _announce(self, gen: _Generation) -> Route:
        """The model that serves ``gen`` (one status for the route and for the ``init`` message), and ``init``
        sent."""
        st = await anyio.to_thread.run_sync(self.serving.status)
        route = self.serving.route(gen.config.model, st)
        active = st.active
        gen.model = route.model
        info = ModelInfo()
        if active is not None and active.model_name == route.model:
            gen.digest = active.digest
            info = ModelInfo(context_window=active.effective_context, digest=active.digest, backend=active.type)
        await self.send(Init(request_id=gen.id, model=gen.model, model_info=info, capabilities=CAPABILITIES))
        return route

    async def _pass(self, gen: _Generation, turn: Turn, more: DecodeConfig | None, tally: _Tally) -> ChatResult:
        """One pass of the turn (the first, or one that goes on after a pause or a modify: ``more``): its tokens
        sent as they come, counted in ``tally``; its result."""
        gen.cut = False
        result: ChatResult | None = None
        progress = anyio.CancelScope()
        if more is None:
            self._spawn(self._progress, gen, turn, progress)
        try:
            async with contextlib.aclosing(turn.aevents(keep=True, more=more)) as events:
                async for event in events:
                    if event.result is not None:
                        result = event.result
                        continue
                    if not gen.decoding:
                        gen.decoding = True
                        progress.cancel()
                        if gen.action is not None:  # a pause or modify that came during the prefill
                            await self._cut(gen)
                    n = len(event.token_ids)
                    now = time.perf_counter()
                    if tally.timing.first_token_ms is None:
                        tally.timing.first_token_ms = (now - tally.started) * 1000
                    if gen.config.options.stream and (event.text or event.thinking or n):
                        await self.send(self._token(gen, event, tally.position, now - tally.last_token,
                                                    now - tally.started))
                    tally.last_token = now
                    tally.position += n
                    tally.produced += n
        finally:
            progress.cancel()
        if result is None:
            raise ApiError(500, "the generation ended without a result", code="Internal")
        return result

    async def _pause(self, gen: _Generation, position: int) -> bool:
        """A paused generation holds the slot until a resume (True: it goes on), a stop or a regenerate (False), or
        ``--ws-pause-limit`` (an ``ApiError``)."""
        gen.decoding = False
        gen.paused = True
        gen.wake = anyio.Event()
        await self.send(Status(request_id=gen.id, operation="paused", position=position,
                               message=f"the slot is held for at most {self._limit():g} s"))
        with anyio.move_on_after(self._limit()):
            await gen.wake.wait()
        gen.paused = False
        if not gen.wake.is_set():
            raise ApiError(408, f"the generation stayed paused past --ws-pause-limit ({self._limit():g} s): "
                                "it ended and the slot went on; regenerate to run it again",
                           code="pause_limit")
        if gen.action in ("stop", "regenerate"):
            return False
        gen.action = None
        await self.send(Status(request_id=gen.id, operation="resumed", position=position))
        return True

    def _limit(self) -> float:
        return float(self.serving.settings.ws_pause_limit)

    async def _complete(self, gen: _Generation, finish: str, texts: list[str], thinking: list[str] | None,
                        calls: list[ToolCall], usage: Usage, timing: Timing) -> None:
        self._ended(gen)  # (before the completion goes: a client may send its next config the moment it reads it)
        text = "".join(texts)
        if gen.config.options.echo_prompt and gen.config.prompt is not None:
            text = gen.config.prompt + text
        self.ended.labels(finish or "unknown").inc()
        gen.outcome = (f"finish={finish or 'unknown'} prompt_tokens={usage.prompt_tokens} "
                       f"cached_tokens={usage.cached_tokens} completion_tokens={usage.completion_tokens}")
        await self.send(Completion(request_id=gen.id, generated_text=text, thinking="".join(thinking or []),
                                   tool_calls=calls, finish_reason=finish or "stop", usage=usage,
                                   timing=timing if gen.config.options.include_timing else None))

    def _token(self, gen: _Generation, event: Any, position: int, step_s: float, total_s: float) -> Token:
        opts = gen.config.options
        ids = list(event.token_ids)
        return Token(
            request_id=gen.id, token=event.text, thinking=event.thinking, position=position,
            token_id=ids[0] if opts.include_token_ids and len(ids) == 1 else None,
            token_ids=ids if opts.include_token_ids else None,
            logprobs=list(event.logprobs) if opts.include_logprobs is not False else None,
            timing=TokenTiming(token_ms=step_s * 1000, total_ms=total_s * 1000) if opts.include_timing else None,
        )

    def _spawn(self, helper: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run ``helper`` beside the generation, on the connection's task group (a helper's end is its own: it
        returns when the client is gone, and the generation never waits for it)."""
        assert self.tg is not None

        async def run() -> None:
            with contextlib.suppress(_Gone):
                await helper(*args)

        self.tg.start_soon(run)

    async def _begin(self, gen: _Generation, req: TurnRequest, route: Route) -> Turn:
        """The slot for ``gen``: while it waits, its client hears it is queued (and how many wait)."""
        waiting = anyio.CancelScope()
        self._spawn(self._queued, gen, waiting)
        req.client = req.client or client_label(self.socket)
        try:
            return await self.serving.abegin(req, route=route)
        finally:
            waiting.cancel()

    async def _queued(self, gen: _Generation, scope: anyio.CancelScope) -> None:
        with scope:
            await anyio.sleep(QUEUED_S)
            while True:
                st = await anyio.to_thread.run_sync(self.serving.status)
                await self.send(Status(request_id=gen.id, operation="queued", waiting=st.waiting,
                                       message="waiting for the slot"))
                await anyio.sleep(QUEUED_REPEAT_S)

    async def _progress(self, gen: _Generation, turn: Turn, scope: anyio.CancelScope) -> None:
        """The prefill's progress, at most every ``PROGRESS_S``, while it runs."""
        last: dict[str, int] = {}
        with scope:
            while True:
                await anyio.sleep(PROGRESS_S)
                p = turn.progress()
                if p and p != last and not gen.decoding:
                    last = p
                    await self.send(Status(request_id=gen.id, operation="prefill", tokens_done=p["done"],
                                           tokens_total=p["total"],
                                           progress=int(100 * p["done"] / max(1, p["total"]))))


def _header_key(socket: WebSocket) -> str | None:
    bearer = socket.headers.get("authorization", "")
    if bearer[:7].lower() == "bearer ":
        return bearer[7:]
    return socket.headers.get("x-api-key")


def router(serving: Serving) -> APIRouter:
    r = APIRouter()
    feedback = FeedbackLog(serving.settings.data_home / FILE_NAME, serving.registry)
    ended = Counter("modeld_ws_generations", "WebSocket generations ended, by finish reason", ["finish"],
                    registry=serving.registry)

    @r.websocket(PATH)
    async def ws(socket: WebSocket) -> None:
        key = serving.settings.api_key
        given = _header_key(socket)
        if key and given is not None and not hmac.compare_digest(given.encode(), key.encode()):
            await socket.close(POLICY_VIOLATION)  # (before the handshake: the client reads a 403)
            return
        await socket.accept()
        conn = _Connection(socket, serving, feedback, ended)
        conn.authed = conn.authed or given is not None
        await conn.run()

    @r.get(PATH + "/schema")
    async def schema() -> dict[str, Any]:
        """The messages' JSON Schema: ``client`` (what a client sends) and ``server`` (what it is sent)."""
        return schemas()

    return r

