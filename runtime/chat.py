"""The agent's loop as one call: ``Chat.send(messages)`` and its streaming twin ``Chat.stream``.

A coding agent keeps an OpenAI-shaped message list — system prompt and tools,
then user turns, the model's replies and tool calls, tool results — and sends
all of it every turn. ``Chat`` maps that onto the session contract:

* the leading system messages (and ``tools``) are the stable prefix
  (``ensure_prefix``); everything after them is the conversation
  (``prefill_suffix(messages=…)``), rendered by the daemon with the model's own
  template;
* each turn opens a session on the loaded model and closes it when the reply
  is done, so other agents (in this process or others) get the slot between
  turns; they wait for it in arrival order up to ``queue_timeout_s`` (ModelBusy
  only when that expires). The KV stays resident across sessions, so each turn
  prefills only what is new: the daemon reuses the token LCP of everything
  resident, the model's own earlier replies included;
* the reply comes back as an assistant message (content, tool calls, reasoning)
  with the finish reason, token usage (prompt, reused, prefilled, completion; cached: restored by the
  daemon's workspace cache)
  and timing (time to first token, prefill, decode rate).

Messages may be dicts in the OpenAI chat shape or ``contract.ChatMessage``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from contract import wire
from contract.errors import Cancelled, ContextOverflow, InvalidArgument, SessionClosed
from contract.types import (
    ChatMessage,
    DecodeConfig,
    Delta,
    FinishReason,
    OpenSessionRequest,
    PrefixInput,
    Progress,
    ReuseMiss,
    StreamChunk,
    SuffixInput,
    TokenCount,
    TokenLogprob,
    ToolCall,
    ToolCallFunction,
)

from .client import Client, RemoteSession

__all__ = ["Chat", "ChatEvent", "ChatResult", "ChatTiming", "ChatTurn", "ChatUsage", "chat_message", "chat_messages", "split_messages", "valid_message"]

#: DecodeConfig fields a chat call may set
_DECODE_FIELDS = frozenset(DecodeConfig.model_fields)


class ChatUsage(BaseModel):
    """Tokens of one turn: the whole prompt, how much of it was already resident, what was computed."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    completion_tokens: int = 0
    #: of ``reused_tokens``, those the daemon's workspace cache restored (the session had switched away)
    cached_tokens: int = 0
    #: speculative decoding: draft tokens checked, and those the answer kept
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: where the prompt's reuse stopped and why, when it lost something the daemon held (None: nothing was lost)
    miss: ReuseMiss | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ChatTiming(BaseModel):
    """Client-side time to first token; the daemon's prefill time, its decode start to the first token, decode rate; wall time."""

    ttft_ms: float = 0.0
    prefill_ms: float = 0.0
    first_token_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    total_ms: float = 0.0


class ChatResult(BaseModel):
    """The assistant's reply to one ``Chat.send``."""

    message: ChatMessage
    #: why the reply ended ("cancelled": ``ChatTurn.cancel`` cut it short; "" when the stream ended without saying)
    finish_reason: FinishReason = ""
    #: the stop string that ended the reply ("" when none did)
    stop_sequence: str = ""
    usage: ChatUsage = Field(default_factory=ChatUsage)
    timing: ChatTiming = Field(default_factory=ChatTiming)
    #: with ``logprobs`` asked: every sampled token's, in order
    logprobs: list[TokenLogprob] = Field(default_factory=list)
    #: a scored prompt's (``Chat.begin_prompt(score=…)``): one per prompt token, None for one with nothing before it
    prompt_logprobs: list[TokenLogprob | None] = Field(default_factory=list)
    #: with ``logprobs`` asked and the reply ended by the model: its end-of-generation token's (text empty; not in
    #: ``logprobs``, which are the reply's own tokens)
    end_logprob: TokenLogprob | None = None


class ChatEvent(Delta):
    """One step of ``Chat.stream``: a delta of text, thinking or tool calls (of a frame of several merged decode
    steps, each step's event carries its token's id and logprob where each step was one token; else the first
    event carries all of the frame's); the last one carries the result."""

    result: ChatResult | None = None

    @classmethod
    def steps(cls, chunk: StreamChunk) -> list[ChatEvent]:
        """A frame's events: one, or where the daemon merged several decode steps into the frame, one per step's
        reasoning and text (``text_pieces``, ``thinking_pieces``; its calls in one event after them), in their
        order: an HTTP API then sends a delta a step, as a server that sends a frame a token does."""
        if not (chunk.text_pieces or chunk.thinking_pieces):
            # (asked for ids, each token is a frame: one whose text is held back is an event with its id only)
            if chunk.text or chunk.thinking or chunk.tool_calls or chunk.tool_call_deltas or chunk.token_ids:
                return [cls(text=chunk.text, thinking=chunk.thinking, tool_calls=list(chunk.tool_calls),
                            tool_call_deltas=list(chunk.tool_call_deltas), logprobs=list(chunk.logprobs),
                            token_ids=list(chunk.token_ids))]
            return []
        # a merged frame's reasoning comes before its text, and its text before its calls (``modeld.coalesce``)
        out = [cls(thinking=p) for p in chunk.thinking_steps()]
        out += [cls(text=p) for p in chunk.text_steps()]
        steps = len(out)
        if chunk.tool_calls or chunk.tool_call_deltas:
            out.append(cls(tool_calls=list(chunk.tool_calls), tool_call_deltas=list(chunk.tool_call_deltas)))
        for name in ("logprobs", "token_ids"):
            values = list(getattr(chunk, name))
            if len(values) == steps and not (chunk.tool_calls or chunk.tool_call_deltas):
                for event, value in zip(out, values, strict=True):  # a token a step: each its own
                    setattr(event, name, [value])
            else:
                setattr(out[0], name, values)
        return out


def _content(value: Any) -> str | None:
    """OpenAI content: a string, None, or a list of parts whose text parts are joined."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind != "text":
                raise InvalidArgument(f"only text content parts are supported, got {kind!r}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidArgument(f"message content must be a string or a list of parts, got {type(value).__name__}")


def chat_message(raw: Mapping[str, Any] | ChatMessage) -> ChatMessage:
    """A message in OpenAI's chat shape (content parts, tool calls with object arguments, ``reasoning_content``)
    as the contract's ``ChatMessage``; InvalidArgument naming what is wrong."""
    if isinstance(raw, ChatMessage):
        return raw
    if not isinstance(raw, Mapping):
        raise InvalidArgument(f"a message is a mapping or a ChatMessage, got {type(raw).__name__}")
    calls = []
    for call in raw.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments", "")
        calls.append(
            ToolCall(
                id=str(call.get("id") or ""),
                type=str(call.get("type") or "function"),
                function=ToolCallFunction(name=str(fn.get("name", "")), arguments=args if isinstance(args, str) else _json(args)),
            )
        )
    return valid_message(
        role=raw.get("role"),
        content=_content(raw.get("content")),
        tool_calls=calls,
        tool_call_id=str(raw.get("tool_call_id") or ""),
        name=str(raw.get("name") or ""),
        reasoning=str(raw.get("reasoning_content") or raw.get("reasoning") or ""),
        images=raw.get("images") or [],
    )


def valid_message(**fields: Any) -> ChatMessage:
    """The ``ChatMessage`` of ``fields``; InvalidArgument naming each field no message can hold."""
    try:
        return ChatMessage(**fields)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False)]
        raise InvalidArgument("invalid message: " + "; ".join(problems), problems=problems) from None


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def chat_messages(messages: Iterable[Mapping[str, Any] | ChatMessage]) -> list[ChatMessage]:
    """Each of ``messages`` as ``chat_message`` makes it; InvalidArgument naming the message (``messages[i]``)."""
    items = []
    for i, m in enumerate(messages):
        try:
            items.append(chat_message(m))
        except InvalidArgument as exc:
            raise InvalidArgument(f"messages[{i}]: {exc.message}", index=i, **exc.details) from None
    return items


def split_messages(messages: Iterable[Mapping[str, Any] | ChatMessage]) -> tuple[str, list[ChatMessage]]:
    """The stable prefix (the leading system messages, joined by blank lines) and the conversation after it."""
    items = chat_messages(messages)
    systems: list[str] = []
    while items and items[0].role == "system":
        systems.append(items.pop(0).content or "")
    if not items:
        raise InvalidArgument("a chat needs at least one message after the system prompt")
    return "\n\n".join(systems), items


def _tools_json(tools: Sequence[Mapping[str, Any]] | str | None) -> str:
    if not tools:
        return ""
    return tools if isinstance(tools, str) else _json(list(tools))


#: how long a turn waits for the slot while another agent's turn holds it
DEFAULT_QUEUE_TIMEOUT_S = 120.0


class Chat:
    """An agent's conversation with the daemon's loaded model (see the module docstring).

    ``profile`` names the agent in the manifest; ``request`` picks the model (the
    loaded one by default). ``model_sampling``: a turn that sets no sampling
    parameter gets the model's recommended sampling (``OpenReply.sampling``);
    False leaves it greedy. Not thread-safe: one Chat per thread of an agent
    (``ChatTurn.cancel`` is the one call another thread may make).
    """

    def __init__(
        self,
        client: Client,
        *,
        profile: str = "chat",
        request: OpenSessionRequest | None = None,
        queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
        model_sampling: bool = True,
    ) -> None:
        self._client = client
        self._profile = profile
        self._request = (request or OpenSessionRequest()).model_copy(update={"queue_timeout_s": queue_timeout_s})
        self._model_sampling = model_sampling
        #: turns begun that may still hold the slot, for ``close``
        self._turns: list[ChatTurn] = []
        self._closed = False

    def close(self) -> None:
        """End the conversation: a turn still holding the slot gives it back (a reply left streaming is cancelled,
        a turn begun and not run never runs), and no turn starts after. Idempotent."""
        self._closed = True
        turns, self._turns = self._turns, []
        for turn in turns:
            turn.close()

    def __enter__(self) -> Chat:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(
        self,
        messages: Iterable[Mapping[str, Any] | ChatMessage],
        tools: Sequence[Mapping[str, Any]] | str | None = None,
        **decode: Any,
    ) -> ChatResult:
        """The assistant's reply to ``messages`` (decode options as in ``DecodeConfig``)."""
        for event in self.stream(messages, tools, **decode):
            if event.result is not None:
                return event.result
        raise SessionClosed("the reply stream ended without a result")

    def stream(
        self,
        messages: Iterable[Mapping[str, Any] | ChatMessage],
        tools: Sequence[Mapping[str, Any]] | str | None = None,
        **decode: Any,
    ) -> Generator[ChatEvent, None, None]:
        """Deltas of the reply as they are decoded; the last event carries the ``ChatResult``.

        Everything that can be refused is refused before this returns (``begin``);
        closing the generator early cancels the decode within one token.
        """
        return self.begin(messages, tools, **decode).events()

    def begin(
        self,
        messages: Iterable[Mapping[str, Any] | ChatMessage],
        tools: Sequence[Mapping[str, Any]] | str | None = None,
        *,
        check_fit: bool = True,
        enable_thinking: bool | None = None,
        conversation: str = "",
        **decode: Any,
    ) -> ChatTurn:
        """Take the slot for one turn and check the prompt fits; nothing is prefilled yet.

        Raises what a turn can be refused for before any work: a bad message or
        option (InvalidArgument), the slot staying busy (ModelBusy), and a prompt
        that leaves no room in the context window (ContextOverflow, with the
        prompt's real size; ``check_fit=False`` only counts, for a caller that
        asks what a prompt comes to). The returned turn holds the slot until its
        ``events()`` end or it is closed. ``enable_thinking`` is the template's
        reasoning switch (None: the template's default); ``conversation`` names
        whose conversation it is (``SuffixInput.conversation``).
        """
        system, turns = split_messages(messages)
        tools_json = _tools_json(tools)
        return self._begin(PrefixInput(text=system, tools=tools_json, conversation=conversation),
                           SuffixInput(messages=turns, enable_thinking=enable_thinking, conversation=conversation),
                           check_fit, decode)

    def begin_prompt(
        self, prompt: str | Sequence[int], *, check_fit: bool = True, conversation: str = "", score: int | None = None,
        **decode: Any,
    ) -> ChatTurn:
        """``begin`` for a raw completion: ``prompt`` (text, or token ids) is the whole context, with no template,
        and the reply continues it. Successive prompts that share a head (an editor's completions as the user
        types) reuse it by token LCP, as a conversation does. With ``score`` (0-20 alternatives), the prompt's
        own tokens are scored (``ChatResult.prompt_logprobs``): then it is prefilled again whole."""
        tokens = [] if isinstance(prompt, str) else list(prompt)
        suffix = SuffixInput(text=prompt if isinstance(prompt, str) else "", tokens=tokens, render=False,
                             conversation=conversation, logprobs=score)
        return self._begin(PrefixInput(render=False, conversation=conversation), suffix, check_fit, decode)

    def _begin(self, prefix: PrefixInput, suffix: SuffixInput, check_fit: bool, decode: dict[str, Any]) -> ChatTurn:
        if self._closed:
            raise SessionClosed("this chat is closed")
        unknown = sorted(set(decode) - _DECODE_FIELDS)
        if unknown:
            raise InvalidArgument(f"unknown decode options {unknown}", unknown=unknown)
        cfg = wire.parse(DecodeConfig, decode)  # a bad option is an InvalidArgument naming it, before anything runs
        started = time.perf_counter()
        sess = self._client.open_session(self._request)
        try:
            manifest = sess.manifest(profile=self._profile)
            prefix = prefix.model_copy(update={"manifest": manifest})
            suffix = suffix.model_copy(update={"manifest": manifest})
            count = sess.count_tokens(prefix, suffix)
            if check_fit and count.prompt_tokens >= count.num_ctx:
                raise ContextOverflow(
                    f"the prompt is {count.prompt_tokens} tokens but the model's context window is {count.num_ctx} "
                    "tokens (prompt and reply together); shorten the conversation or serve a larger context",
                    prompt_tokens=count.prompt_tokens,
                    num_ctx=count.num_ctx,
                )
            if self._model_sampling:
                cfg = sess.sampling.fill(cfg)
        except BaseException:
            sess.close()
            raise
        turn = ChatTurn(sess, prefix, suffix, cfg, count, started)
        self._turns = [t for t in self._turns if not t.finished] + [turn]
        return turn


class ChatTurn:
    """One turn that holds the slot: counted and checked (``Chat.begin``), prefilled and decoded by ``events``."""

    def __init__(
        self, sess: RemoteSession, prefix: PrefixInput, suffix: SuffixInput, cfg: DecodeConfig, count: TokenCount,
        started: float,
    ) -> None:
        self._sess = sess
        self._prefix = prefix
        self._suffix = suffix
        self.cfg = cfg
        #: the prompt's size on the model and the window (before any prefill)
        self.count = count
        self._started = started
        self._used = False
        self._cancelled = False
        self._events: Generator[ChatEvent, None, None] | None = None
        #: what the turn has done before its result: the prompt, and once prefilled what was reused (a turn cut
        #: short before its result, a client that went away, still did that much)
        self.so_far = ChatUsage(prompt_tokens=count.prompt_tokens)
        #: while the prefill runs: how far it has come (the daemon's heartbeats carry it, about once a second)
        self.progress: Progress | None = None
        #: the prefill is over (the decode runs, or the turn ended)
        self.prefilled = False
        #: a scored prompt's log probabilities, once prefilled (``ChatResult.prompt_logprobs``)
        self.prompt_logprobs: list[TokenLogprob | None] = []

    @property
    def model_name(self) -> str:
        """The loaded model that serves the turn."""
        active = self._sess.active
        return active.model_name if active is not None else ""

    @property
    def finished(self) -> bool:
        """Whether the turn gave the slot back (it ran to its end, failed, or was closed)."""
        return self._sess.closed

    def cancel(self) -> None:
        """Cut the turn short, from any thread, whatever it is doing: a prefill stops at its next chunk (the KV
        keeps the chunks it finished, for the next turn with the same head), a decode within a token, and a
        turn that has not started sends nothing more. ``events`` then ends with a result whose finish_reason is
        "cancelled" (or the reply's own, when it ended first)."""
        self._cancelled = True
        self._sess.cancel()

    def _progressed(self, progress: Progress) -> None:
        if progress.stage == "prefill":
            self.progress = progress

    def _sent(self) -> None:
        # an operation went out: a cancel that came while nothing was in flight stops it now
        if self._cancelled:
            self._sess.cancel()

    def close(self) -> None:
        """Give the slot back: before ``events`` ran, without running the turn; after, ``events`` ends here (its
        decode is cancelled). Call it from the thread that reads ``events``; another thread calls ``cancel``."""
        if self._used and self._events is not None:
            self._events.close()
        self._used = True
        self._sess.close()

    def events(self, *, keep: bool = False) -> Generator[ChatEvent, None, None]:
        """Prefill what is new, then the reply's deltas; the last event carries the ``ChatResult``.

        ``keep``: the session (and so the slot) stays open after the reply, so that a reply that was stopped
        (``cancel``) can go on with ``more``, with the same options or others; ``close`` gives it back. A prefill
        that was cancelled or failed gives it back whatever ``keep`` says."""
        if self._used:
            raise SessionClosed("this turn already ran")
        self._used = True
        sess = self._sess
        sess.on_sent = self._sent
        try:
            if self._cancelled:
                raise Cancelled("the turn was cancelled before its prefill")
            pre = sess.ensure_prefix(self._prefix, on_progress=self._progressed)
            self.so_far = self.so_far.model_copy(update={
                "reused_tokens": pre.reused_tokens, "prefilled_tokens": pre.prefilled_tokens,
                "cached_tokens": pre.cached_tokens, "miss": pre.miss})
            self.progress = None
            if self._cancelled:
                raise Cancelled("the turn was cancelled during its prefill")
            suf = sess.prefill_suffix(self._suffix, on_progress=self._progressed)
        except Cancelled:
            self.prefilled = True
            sess.close()
            if not self._cancelled:
                raise  # not this turn's own cancel (the daemon is stopping): a failure
            # the chunks the cancelled prefill finished stay in the KV (the next turn with the same head reuses
            # them): count them, as the daemon last reported its progress
            done = self.progress.done if self.progress is not None else 0
            self.so_far = self.so_far.model_copy(update={"prefilled_tokens": self.so_far.prefilled_tokens + done})
            self._events = _cancelled_events(self.so_far, self._started)
            return self._events
        except BaseException:
            self.prefilled = True
            sess.close()
            raise
        self.prefilled = True
        self.progress = None
        self.prompt_logprobs = suf.logprobs
        prompt = ChatUsage(
            reused_tokens=pre.reused_tokens + suf.reused_tokens,
            prefilled_tokens=pre.prefilled_tokens + suf.prefilled_tokens,
            cached_tokens=pre.cached_tokens + suf.cached_tokens,
            miss=pre.miss or suf.miss,  # the first place the prompt parted from what was held
        )
        self.so_far = prompt.model_copy(update={"prompt_tokens": self.count.prompt_tokens})
        self._events = _events(sess, self.cfg, prompt, pre.prefill_ms + suf.prefill_ms, self._started,
                               lambda: self._cancelled, suf.logprobs, keep=keep)
        return self._events

    def more(self, **decode: Any) -> Generator[ChatEvent, None, None]:
        """The reply goes on from where the last pass stopped (a turn run with ``events(keep=True)`` and then
        cancelled or cut at its ``max_tokens``), with ``decode`` over the turn's options (``max_tokens`` counts
        this pass's tokens). Greedy, the passes together write the tokens one pass would have. The result is
        this pass's: its usage counts its own tokens, its prompt the whole context before it. The session stays
        open; ``close`` ends it."""
        if not self.prefilled or self._sess.closed:
            raise SessionClosed("this turn holds no session to go on with (run events(keep=True) first)")
        unknown = sorted(set(decode) - _DECODE_FIELDS)
        if unknown:
            raise InvalidArgument(f"unknown decode options {unknown}", unknown=unknown)
        cfg = wire.parse(DecodeConfig, {**self.cfg.model_dump(), **decode})
        if self._events is not None:
            self._events.close()
        self._cancelled = False
        self._events = _events(self._sess, cfg, ChatUsage(), 0.0, time.perf_counter(), lambda: self._cancelled, [],
                               keep=True)
        return self._events


def _cancelled_events(usage: ChatUsage, started: float) -> Generator[ChatEvent, None, None]:
    """The end of a turn cancelled before its decode: no reply, finish_reason "cancelled"."""
    yield ChatEvent(result=ChatResult(
        message=ChatMessage(role="assistant", content=None), finish_reason="cancelled", usage=usage,
        timing=ChatTiming(total_ms=(time.perf_counter() - started) * 1000)))


def _events(
    sess: RemoteSession, cfg: DecodeConfig, prompt: ChatUsage, prefill_ms: float, started: float,
    cancelled: Callable[[], bool], prompt_logprobs: list[TokenLogprob | None], *, keep: bool = False,
) -> Generator[ChatEvent, None, None]:
    text: list[str] = []
    thinking: list[str] = []
    calls: list[ToolCall] = []
    logprobs: list[TokenLogprob] = []
    first = 0.0
    final: StreamChunk | None = None
    stream = sess.decode(cfg)
    if cancelled():  # cancelled before the decode was sent: it is now in flight, and stops at once
        sess.cancel()
    try:
        for chunk in stream:
            if chunk.done:
                final = chunk
                break
            if not first and (chunk.text or chunk.thinking or chunk.tool_calls or chunk.tool_call_deltas):
                first = time.perf_counter()
            text.append(chunk.text)
            thinking.append(chunk.thinking)
            calls += chunk.tool_calls
            logprobs += chunk.logprobs
            yield from ChatEvent.steps(chunk)
    finally:
        stream.close()
        if not keep:
            sess.close()  # the slot is free for the next agent; the KV stays resident
    usage = final.usage if final is not None else None
    content = "".join(text)
    result = ChatResult(
        message=ChatMessage(role="assistant", content=content or None, tool_calls=calls, reasoning="".join(thinking)),
        finish_reason=final.finish_reason if final is not None else "",
        stop_sequence=final.stop_sequence if final is not None else "",
        usage=prompt.model_copy(
            update={
                "prompt_tokens": usage.prompt_tokens if usage else 0,
                "completion_tokens": usage.completion_tokens if usage else 0,
                "drafted_tokens": usage.drafted_tokens if usage else 0,
                "accepted_tokens": usage.accepted_tokens if usage else 0,
            }
        ),
        timing=ChatTiming(
            ttft_ms=(first - started) * 1000 if first else 0.0,
            prefill_ms=prefill_ms,
            first_token_ms=usage.ttft_ms if usage else 0.0,
            decode_tokens_per_s=usage.tokens_per_second if usage else 0.0,
            total_ms=(time.perf_counter() - started) * 1000,
        ),
        logprobs=[*logprobs, *(final.logprobs if final is not None else [])],
        end_logprob=final.end_logprob if final is not None else None,
        prompt_logprobs=prompt_logprobs,
    )
    yield ChatEvent(result=result)
