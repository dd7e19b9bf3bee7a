"""A session's context: the stable prefix, the suffix, what was reused and why not, snapshots."""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ..errors import InvalidArgument
from ..manifest import ContextManifest
from ._base import MAX_SUFFIX_IMAGES, MAX_TEXT_CHARS, MAX_TOP_LOGPROBS, TokenId, _Report, _Request
from .chat import ChatMessage, ImageInput, check_conversation, check_images
from .decode import TokenLogprob

__all__ = ["ContextReport", "PositionRange", "PrefixInput", "PrefixStatus", "SessionSnapshot", "SuffixInput", "SuffixStatus", "TokenCount"]


class PrefixInput(_Request):
    """Stable prefix text plus the manifest that makes reuse valid."""

    text: str = Field("", max_length=MAX_TEXT_CHARS)
    manifest: ContextManifest = Field(default_factory=ContextManifest)
    #: JSON array of tool definitions rendered by the model's own template; "" = none
    tools: str = ""
    #: False: the text is the prompt as it is, with no template (a raw completion; BOS by the manifest's policy);
    #: the suffixes after it are raw too (``SuffixInput.render`` False, or token ids)
    render: bool = True
    #: whose conversation the suffix after it will be (``SuffixInput.conversation``), where the caller knows: an
    #: engine whose KV sits behind a router sends the prefix's prefill where the conversation's will go. The
    #: prefix itself stays nobody's conversation
    conversation: str = Field("", max_length=256)

    @model_validator(mode="after")
    def _raw_has_no_tools(self) -> PrefixInput:
        if not self.render and self.tools:
            raise InvalidArgument("tools are rendered by the model's template: a raw prefix (render=False) has none")
        return self


class PositionRange(_Request):
    """Positions ``start`` (inclusive) to ``end`` (exclusive) of a session's context: which of a suffix's tokens a
    prefill scores or reads out (``SuffixInput.logprobs_ranges``, ``readout_ranges``; salience's ``PositionRange``)."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> PositionRange:
        if self.end <= self.start:
            raise InvalidArgument(f"a position range ends after it starts: got [{self.start}, {self.end})",
                                  start=self.start, end=self.end)
        return self


#: the most position ranges one suffix names for its scores or its readouts
MAX_POSITION_RANGES = 64


def positions_covered(ranges: list[PositionRange], start: int, end: int) -> list[bool]:
    """Which of the positions ``start`` to ``end`` (a suffix's) the ranges cover: every one when there are none.
    A range outside them is InvalidArgument naming both: the ranges name suffix tokens."""
    if not ranges:
        return [True] * (end - start)
    wanted = [False] * (end - start)
    for r in ranges:
        if r.start < start or r.end > end:
            raise InvalidArgument(
                f"position range [{r.start}, {r.end}) is not within the suffix, positions [{start}, {end})",
                start=r.start, end=r.end, suffix_start=start, context_tokens=end)
        wanted[r.start - start : r.end - start] = [True] * (r.end - r.start)
    return wanted


def first_covered(wanted: list[bool]) -> int:
    """The offset of the first position ``positions_covered`` marked (their count when it marked none)."""
    return wanted.index(True) if True in wanted else len(wanted)


class SuffixInput(_Request):
    """The volatile part after the stable prefix, under the same manifest.

    Either one turn (``text``, with ``role``), or the whole conversation after the
    leading system messages (``messages``): user turns, the assistant's own
    replies and tool calls, tool results. The daemon renders it with the model's
    template and reuses the token LCP of everything already resident, so a
    request that resends the history plus one new message prefills only that.
    """

    text: str = Field("", max_length=MAX_TEXT_CHARS)
    manifest: ContextManifest = Field(default_factory=ContextManifest)
    enable_thinking: bool | None = None
    #: chat role of the volatile turn ("user" or "tool")
    role: Literal["user", "tool"] = "user"
    #: False: append the raw text with no template rendering (continuation)
    render: bool = True
    #: the conversation after the stable prefix, oldest first (instead of ``text``)
    messages: list[ChatMessage] = Field(default_factory=list, max_length=100_000)
    #: who holds this conversation: an agent's id for it (the HTTP front takes Claude Code's agent and session
    #: ids, Codex's thread id, OpenCode's session id). The workspace cache keeps each conversation's newest state
    #: in RAM before its older ones; "" leaves conversations to their tokens (an entry that extends another
    #: replaces it)
    conversation: str = Field("", max_length=256)
    #: token ids instead of text: appended as they are (no template, no tokenizer); each checked against the
    #: model's vocabulary (an unknown id is InvalidArgument, and nothing is appended)
    tokens: list[TokenId] = Field(default_factory=list, max_length=MAX_TEXT_CHARS // 4)
    #: None: the suffix goes after the stable prefix, reusing whatever of the tape matches (token LCP). A number:
    #: the client's view of the session's resident length (``resident_tokens`` of the last status), and the suffix
    #: (``tokens``, or ``text`` with render=False) is appended there: at the resident length it appends, below it
    #: with ``truncating`` the context is cut to ``offset`` first (the KV up to it kept); anything else is
    #: OffsetDrift naming both lengths, and the session is unchanged
    offset: int | None = Field(None, ge=0)
    truncating: bool = False
    #: score the suffix (prefill-only scoring): each suffix token's log probability given everything before it,
    #: with this many likeliest alternatives (0: its own only), in ``SuffixStatus.logprobs``. A position's scores
    #: come from its own computation, so the scored tokens (and the one before the first) are prefilled again,
    #: never reused
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    #: with ``logprobs``: score only the suffix tokens at these positions of the context (absolute, each range
    #: within the suffix; empty: every suffix token). Only what the first range starts at is prefilled again: the
    #: tokens before it are reused like any prompt's
    logprobs_ranges: list[PositionRange] = Field(default_factory=list, max_length=MAX_POSITION_RANGES)
    #: concept readouts of every suffix token (``serve --readouts FILE``; ``DaemonStatus.readouts`` names the
    #: concepts and layers), in ``SuffixStatus.readouts``. Like scores they come from the prefill's own
    #: computation, so the tokens read out are prefilled again, never reused
    readouts: bool = False
    #: with ``readouts``: read out only the suffix tokens at these positions (as ``logprobs_ranges``)
    readout_ranges: list[PositionRange] = Field(default_factory=list, max_length=MAX_POSITION_RANGES)
    #: images in a raw append (``offset``, ``text`` with render=False), each at its offset in ``text``; the
    #: status's ``image_tokens`` says how many positions they took. A rendered conversation's images are its
    #: messages' (``ChatMessage.images``)
    images: list[ImageInput] = Field(default_factory=list, max_length=MAX_SUFFIX_IMAGES)

    @model_validator(mode="after")
    def _one_form(self) -> SuffixInput:
        if self.messages:
            if self.text:
                raise InvalidArgument("give the suffix as text or as messages, not both")
            if not self.render:
                raise InvalidArgument("messages are rendered by the model's template; render=False takes text")
            check_conversation(self.messages)
        if self.tokens and (self.text or self.messages):
            raise InvalidArgument("give the suffix as token ids, text or messages, one of them")
        if self.offset is None:
            if self.truncating:
                raise InvalidArgument("truncating cuts the context at an offset: give the offset")
        elif self.messages or (self.text and self.render):
            raise InvalidArgument("an append at an offset is raw: give token ids, or text with render=False")
        if self.logprobs_ranges and self.logprobs is None:
            raise InvalidArgument("logprobs_ranges name which suffix tokens to score: give logprobs too")
        if self.readout_ranges and not self.readouts:
            raise InvalidArgument("readout_ranges name which suffix tokens to read out: give readouts too")
        if self.images:
            if self.offset is None or self.tokens:
                raise InvalidArgument("images in a suffix go in a raw append (offset, with text or nothing); a "
                                      "conversation's images are its messages'")
            check_images(self.images, self.text, "suffix")
        return self


class MissCause(str, enum.Enum):
    """Why part of a prompt was prefilled that the daemon had computed before, or had never seen (``ReuseMiss``)."""

    FIRST_SIGHT = "first_sight"  # nothing held shares the prompt from here: a new agent, or a new conversation
    SYSTEM_CHANGED = "system_changed"  # the system prompt differs from the resident one at this point
    TOOLS_CHANGED = "tools_changed"  # the same system prompt with other tool definitions
    HISTORY_REWRITTEN = "history_rewritten"  # an earlier message (or the model's own reply) came back changed
    EVICTED = "evicted"  # this prompt was computed before, but neither the KV nor the workspace cache holds it now
    MANIFEST_CHANGED = "manifest_changed"  # another model, template, runtime setting or BOS policy: nothing is reusable


class ReuseMiss(_Report):
    """Where a prompt's reuse stopped and why (``PrefixStatus.miss``, ``SuffixStatus.miss``).

    None on a status means everything the daemon held that this prompt could use was used: what was
    prefilled is new text after it.
    """

    cause: MissCause = MissCause.FIRST_SIGHT
    #: the token index of the first difference: the prompt was prefilled from here
    index: int = 0
    #: how long the prompt the daemon compared with was (for ``evicted``: how much of this prompt it had computed)
    held_tokens: int = 0
    #: the conversation's message (0 = the first after the system prompt) where it differs; -1 when not known
    message: int = -1
    #: a few words of what the daemon held from ``index`` on, and of what the prompt has there
    held_text: str = ""
    new_text: str = ""
    #: a short sentence for a log line (which manifest field changed, which message)
    detail: str = ""

    def brief(self) -> str:
        """``cause@index`` (with the message when known): the access log's field."""
        at = f"{self.cause.value}@{self.index}"
        return f"{at}/m{self.message}" if self.message >= 0 else at


class ReuseRecord(_Report):
    """One request's prompt as the daemon served it (``modeld why``): how much was reused, and why not more."""

    #: when its prefill ended (seconds since the epoch)
    at: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    #: of ``reused_tokens``, restored by the workspace cache
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    prefill_ms: float = 0.0
    #: of ``prefill_ms``: rendering the prompt through the template, and tokenizing it
    render_ms: float = 0.0
    tokenize_ms: float = 0.0
    miss: ReuseMiss | None = None
    #: a digest of the prompt's tokens (``SuffixStatus.context_token_hash``): the same digest, the same tokens
    prompt_token_hash: str = ""


class PrefixStatus(_Report):
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    dropped_tokens: int = 0
    prefix_tokens: int = 0
    resident_tokens: int = 0
    available_tokens: int = 0
    stable_byte_hash: str = ""
    stable_token_hash: str = ""
    manifest_digest: str = ""
    prefill_ms: float = 0.0
    #: of ``prefill_ms``: rendering the prefix through the template, and tokenizing it
    render_ms: float = 0.0
    tokenize_ms: float = 0.0
    #: of ``reused_tokens``, how many the workspace cache restored (not resident before the call)
    cached_tokens: int = 0
    #: why the prefix was not all reused (None: it was, or what was prefilled is new)
    miss: ReuseMiss | None = None


class SuffixStatus(_Report):
    suffix_tokens: int = 0
    prefix_tokens: int = 0
    resident_tokens: int = 0
    available_tokens: int = 0
    manifest_digest: str = ""
    #: suffix tokens already resident (the LCP with the tape, earlier replies included)
    reused_tokens: int = 0
    #: suffix tokens computed now (suffix_tokens - reused_tokens)
    prefilled_tokens: int = 0
    prefill_ms: float = 0.0
    #: of ``prefill_ms``: rendering the conversation through the template, and tokenizing it
    render_ms: float = 0.0
    tokenize_ms: float = 0.0
    #: of ``reused_tokens``, how many the workspace cache restored (not resident before the call)
    cached_tokens: int = 0
    #: why the suffix was not all reused (None: it was, or what was prefilled is new)
    miss: ReuseMiss | None = None
    #: with ``SuffixInput.logprobs``: one per suffix token, in order (None for a token with nothing before it, and
    #: for one outside ``logprobs_ranges``)
    logprobs: list[TokenLogprob | None] = Field(default_factory=list)
    #: of ``suffix_tokens``, the positions its images' blocks of image tokens take (each image once per place)
    image_tokens: int = 0
    #: a digest of the context's tokens after the suffix (``contract.manifest.token_hash``): two requests with the
    #: same digest sent the model the same tokens, whatever the slot held before each
    context_token_hash: str = ""
    #: with ``SuffixInput.readouts``: one per suffix token, in order: ``[n_layers][n_concepts]``, the residual stream
    #: after each manifest layer (ascending) dotted with each concept's direction (the manifest's order); ``[]`` for
    #: a token outside ``readout_ranges``
    readouts: list[list[list[float]]] = Field(default_factory=list)


class TokenCount(_Report):
    """What a prompt (a prefix and a suffix) comes to on the loaded model, computed without touching the KV."""

    #: the whole prompt: what ``ensure_prefix`` + ``prefill_suffix`` would leave resident
    prompt_tokens: int = 0
    prefix_tokens: int = 0
    num_ctx: int = 0
    #: of ``prompt_tokens``, how many are resident now under a compatible manifest (a warm turn's reuse)
    resident_tokens: int = 0

    @property
    def room(self) -> int:
        """Tokens left for the reply."""
        return self.num_ctx - self.prompt_tokens


class SessionSnapshot(_Report):
    """Backend state plus the bookkeeping that gates a restore."""

    state: bytes = b""
    state_id: str = ""
    state_kind: str = ""  # "kv" (real state bytes) | "replay" (token tape, restore re-prefills)
    #: sha256 of ``state`` taken at snapshot time; a restore verifies it
    state_digest: str = ""
    backend: str = ""
    resident_tokens: int = 0
    prefix_tokens: int = 0
    num_ctx: int = 0
    resident_token_ids: list[int] = Field(default_factory=list)
    stable_text: str = ""
    prefix_text: str = ""
    tools: str = ""
    manifest: ContextManifest = Field(default_factory=ContextManifest)

    @field_validator("state", mode="before")
    @classmethod
    def _bytes(cls, v: Any) -> Any:
        if isinstance(v, (bytearray, memoryview)):
            return bytes(v)
        return v


class ContextReport(_Report):
    resident_tokens: int = 0
    prefix_tokens: int = 0
    num_ctx: int = 0
    available_tokens: int = 0
    stable_byte_hash: str = ""
    stable_token_hash: str = ""
    manifest_digest: str = ""
    manifest: ContextManifest = Field(default_factory=ContextManifest)
    closed: bool = False
