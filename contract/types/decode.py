"""A decode: its options and sampling, the stream's chunks, usage and log probabilities."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, model_validator

from ._base import MAX_TOP_LOGPROBS, _Report, _Request
from .chat import ToolCall, ToolCallDelta

__all__ = ["DecodeConfig", "Delta", "DEFAULT_SAMPLING", "ErrorInfo", "SamplingParams", "StreamChunk", "StructuredOutputConfig", "TokenLogprob", "TopLogprob", "Usage"]


class TopLogprob(_Report):
    """One token and its log probability (natural log) at one step of a decode."""

    token_id: int = 0
    #: the token's text (its bytes decoded, an incomplete UTF-8 sequence replaced; a control token: empty)
    token: str = ""
    #: the token's bytes: the pieces of a multi-byte character split across tokens join here exactly
    bytes: list[int] = Field(default_factory=list)
    logprob: float = 0.0


class TokenLogprob(TopLogprob):
    """A sampled token's log probability, and the likeliest tokens at its step (``DecodeConfig.logprobs``)."""

    #: the k likeliest tokens, likeliest first (the sampled one among them when it is one of them)
    top: list[TopLogprob] = Field(default_factory=list)


class StructuredOutputConfig(_Request):
    """A backend-typed constraint on generation: exactly one of the fields."""

    json_schema: str = ""
    grammar: str = ""
    regex: str = ""
    #: a forced tool call: each tool's name and the JSON schema of its arguments ("": any JSON object);
    #: the reply is exactly one call to one of them, in the form the model's template renders calls back in
    #: (its tool-call format, e.g. Hermes's ``<tool_call>\n{"name": …, "arguments": …}\n</tool_call>``),
    #: its arguments held to the schema as far as the engine's grammar can hold them
    tool_call: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_kind(self) -> StructuredOutputConfig:
        given = [name for name in ("json_schema", "grammar", "regex", "tool_call") if getattr(self, name)]
        if len(given) > 1:
            raise ValueError(f"structured_output takes exactly one of json_schema/grammar/regex/tool_call, got {given}")
        return self

    def is_set(self) -> bool:
        return bool(self.json_schema or self.grammar or self.regex or self.tool_call)


class SamplingParams(_Report):
    """Sampling settings: what a model recommends, or what a client fills unset fields of a request with.

    None leaves a field to the next source; ``source`` says where the values came
    from ("model": the GGUF's ``general.sampling.*`` keys, "default": the daemon's
    documented defaults, "settings": ``modeld serve --temperature``).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    source: str = ""
    #: the reply length of a request that sets none (``modeld serve --max-tokens``; None: until the end of
    #: generation or the context's end)
    max_tokens: int | None = Field(None, ge=1)

    def fill(self, cfg: DecodeConfig) -> DecodeConfig:
        """``cfg`` with its unset sampling fields and reply length taken from these (a greedy ``cfg`` is left
        greedy)."""
        names = ["max_tokens"]
        if cfg.temperature != 0.0:
            names += ["temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n"]
        update = {name: getattr(self, name) for name in names
                  if getattr(cfg, name) is None and getattr(self, name) is not None}
        return cfg.model_copy(update=update) if update else cfg


#: what a request that sets no sampling parameter gets when the model recommends none: sampled, not
#: greedy (llama-server's and Ollama's temperature, top-k, top-p and min-p, and Ollama's repeat penalty
#: over the last 64 tokens, which keeps a small model from looping until the context's end)
DEFAULT_SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1,
                                  repeat_last_n=64, source="default")


class DecodeConfig(_Request):
    #: None: until the end of generation or the context's end (a limit past the context's end is a
    #: cap: the pass stops there with finish reason "length")
    max_tokens: int | None = Field(None, ge=0, le=100_000_000)
    #: None or 0: greedy (the session contract is deterministic unless asked otherwise; ``runtime.Chat``
    #: fills unset fields from the model's recommended sampling, ``OpenReply.sampling``)
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    #: None or 0: no top-k cut
    top_k: int | None = Field(None, ge=0)
    #: None or 0: no min-p cut (tokens below min_p times the top token's probability are dropped)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    #: penalties over the last ``repeat_last_n`` tokens (the prompt's tail, then the reply; None: 64),
    #: applied before the cuts, as llama.cpp does: a repeated token's logit divided by
    #: ``repeat_penalty`` (multiplied where negative; None or 1: none), less ``frequency_penalty``
    #: times its count and ``presence_penalty`` once (OpenAI's; None or 0: none)
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0)
    repeat_last_n: int | None = Field(None, ge=0, le=1_000_000)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    #: any 64-bit value (the engines fold it to the width their generators take)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: list[str] = Field(default_factory=list)
    #: the parsers a decode runs: "think" and at most one tool-call format ("hermes", "mistral", "harmony", …;
    #: ``backends.tape.toolformats``); empty: the model's own (reasoning split, calls parsed when tools were given)
    parser_protocols: list[str] = Field(default_factory=list)
    reasoning_format: str = ""
    structured_output: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)
    #: extension: also stream the sampled token ids (for parity checks)
    return_token_ids: bool = False
    #: None: no log probabilities; k (0-20): each sampled token streams with its log probability under the
    #: model's distribution (before penalties and cuts: what the sampler started from) and the k likeliest
    #: tokens there
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    #: concept readouts of the decoded tokens (``serve --readouts FILE``), in the final chunk's ``readouts``: once
    #: the pass ends its tokens are computed again in one batch with the manifest's layers read
    readouts: bool = False
    #: extension: prompt-lookup speculative decoding (drafts copied from the context, verified in
    #: one batch; the output is what plain decoding gives); None = the daemon's default, for greedy
    #: decoding only (a seeded sampled pass then repeats exactly)
    speculative: bool | None = None

    def penalties(self) -> tuple[int, float, float, float] | None:
        """(last n, repeat, frequency, presence) when any penalty applies, else None."""
        last_n = 64 if self.repeat_last_n is None else self.repeat_last_n
        repeat, freq, present = self.repeat_penalty or 1.0, self.frequency_penalty or 0.0, self.presence_penalty or 0.0
        if last_n == 0 or (repeat == 1.0 and freq == 0.0 and present == 0.0):
            return None
        return last_n, repeat, freq, present


class ErrorInfo(_Report):
    code: int = 0
    name: str = ""
    message: str = ""
    recoverable: bool = False
    details: dict[str, Any] = Field(default_factory=dict)


class Usage(_Report):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: from the start of decode to the first sampled token (the prompt is already prefilled)
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    tokens_per_second: float = 0.0
    #: speculative decoding: draft tokens evaluated, and those the sampled output kept
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: the session's resident length once the decode ended (the prompt and the reply's tokens): where a client's
    #: next append goes (``SuffixInput.offset``)
    resident_tokens: int = 0


#: why a decode ended: the ``finish_reason`` of its final chunk ("" on every other chunk)
FinishReason = Literal[
    "",
    "stop",  # the model ended its reply: end of generation, or a stop string (``stop_sequence``)
    "tool_calls",  # the model ended its reply with tool calls
    "length",  # max_tokens were decoded
    "context_full",  # the context window is full: the next token could not be evaluated
    "cancelled",  # the caller cancelled the decode before the model ended it (the reply is cut short)
]


class Delta(_Report):
    """What a step of a reply adds: its text, its reasoning, its tool calls, and the tokens they came from. A decode
    frame (``StreamChunk``) and an event of a chat turn (``runtime.ChatEvent``) are both one."""

    text: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    #: the same calls as they are written, piece by piece: per call index its id and name first, then its arguments
    #: (a call's pieces come before or with the call itself)
    tool_call_deltas: list[ToolCallDelta] = Field(default_factory=list)
    #: with ``DecodeConfig.return_token_ids``: the ids of the tokens this delta came from (a token whose text was
    #: held back comes with the delta that sends it)
    token_ids: list[int] = Field(default_factory=list)
    #: with ``DecodeConfig.logprobs``: the sampled tokens this delta's output came from, in order (a token whose
    #: output was held back, a possible stop string or a tool call, comes with the delta that sends it on; tokens
    #: that sent nothing come with the final chunk)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class StreamChunk(Delta):
    """A decode frame: a delta (several merged decode steps' with ``text_pieces``), or the terminal chunk."""

    #: with ``DecodeConfig.readouts``, on the final chunk: one per decoded token the context holds (an end of
    #: generation token is not one), in order, ``[n_layers][n_concepts]`` as ``SuffixStatus.readouts``
    readouts: list[list[list[float]]] = Field(default_factory=list)
    #: with ``DecodeConfig.logprobs``, on the final chunk of a pass the model ended: the end-of-generation token it
    #: sampled (its ``token`` text empty: it writes none), which ``logprobs`` does not count among the reply's tokens
    end_logprob: TokenLogprob | None = None
    #: when a frame carries several decode steps merged (``modeld serve --stream-interval-ms``): ``text`` and
    #: ``thinking`` in the pieces the steps produced, so a reader can hand them on one by one, as a server that
    #: sends a frame a token does (empty: the field is one piece)
    text_pieces: list[str] = Field(default_factory=list)
    thinking_pieces: list[str] = Field(default_factory=list)
    error: ErrorInfo | None = None
    done: bool = False
    finish_reason: FinishReason = ""
    #: the final chunk of a pass a stop string ended: that string
    stop_sequence: str = ""
    usage: Usage | None = None

    def thinking_steps(self) -> list[str]:
        """``thinking`` in the pieces it was decoded in (none when empty)."""
        return list(self.thinking_pieces) if self.thinking_pieces else [self.thinking] if self.thinking else []

    def text_steps(self) -> list[str]:
        """``text`` in the pieces it was decoded in (none when empty)."""
        return list(self.text_pieces) if self.text_pieces else [self.text] if self.text else []

    @classmethod
    def final(
        cls,
        finish_reason: FinishReason,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_ms: float,
        started: float,
        *,
        drafted: int = 0,
        accepted: int = 0,
    ) -> StreamChunk:
        """The terminal chunk of a decode that began at ``started`` (a perf_counter reading)."""
        elapsed_ms = (time.perf_counter() - started) * 1000
        return cls(
            done=True,
            finish_reason=finish_reason,
            usage=Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                ttft_ms=ttft_ms,
                decode_ms=elapsed_ms,
                tokens_per_second=completion_tokens / (elapsed_ms / 1000) if elapsed_ms > 0 else 0.0,
                drafted_tokens=drafted,
                accepted_tokens=accepted,
                resident_tokens=prompt_tokens + completion_tokens,
            ),
        )
