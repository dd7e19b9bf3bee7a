"""The engine-independent part of a Session, shared by every backend whose KV follows a token tape.

Both real backends keep the invariant ``Resident.tokens == what the KV holds`` and
differ only in how they render, tokenize, compute and sample. ``TapeSession``
holds the one implementation of ensure_prefix and prefill_suffix (manifest gate,
token LCP, rollback on a failed prefill) and of the decode loop (pending-token
evaluation, cancel on close, epochs, finish reasons, usage); a backend's session
supplies the hooks and a ``DecodeSteps`` per pass.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from typing import Any, Protocol

from contract.errors import InvalidArgument, ManifestMismatch, SessionClosed
from contract.manifest import ContextManifest, common_prefix_len
from contract.resident import PrefixPlan, Resident, check_manifest_names
from contract.types import (
    ContextReport,
    DecodeConfig,
    PrefixInput,
    PrefixStatus,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
)

from .chat import OutputPipeline, ends_inside_thinking, resolve_protocols

#: ContextManifest.bos_policy values: the model's default, always add, never add
BOS_POLICIES = ("", "add", "none")
#: how many trailing resident tokens are decoded to see whether the prompt opened <think>
_PROMPT_TAIL_TOKENS = 8

#: a chat template: render(messages, tools, generation=..., **template_variables) -> text
Render = Callable[..., str]


class TapeModel(Protocol):
    """What TapeSession needs of a loaded model."""

    res: Resident

    def tokenize(self, text: str, *, bos_policy: str | None = None) -> list[int]: ...

    def set_kv(self, tokens: list[int], keep: int) -> int:
        """Make the KV hold ``tokens``, keeping the first ``keep``; returns how many were kept."""
        ...

    def clear_kv(self) -> None: ...

    def reusable(self, n: int) -> int:
        """How many of ``n`` matching tokens the engine can keep exactly (<= n)."""
        ...


class DecodeSteps(Protocol):
    """How one decode pass samples and steps its engine (the rest of the loop is shared)."""

    def start(self) -> None:
        """Make the distribution after the last resident token available."""
        ...

    def sample(self) -> int:
        """The next token from the current distribution (constraints applied)."""
        ...

    def feed(self, token: int) -> None:
        """Evaluate a sampled token into the KV and append it to the tape."""
        ...

    def is_end(self, token: int) -> bool:
        """Whether the token ends generation (EOS/EOT); it is not evaluated."""
        ...

    def piece(self, token: int) -> bytes:
        """What the token adds to the output text (control tokens add nothing)."""
        ...

    def settle(self, token: int) -> None:
        """On close: evaluate a token already handed out, so the tape equals the KV; never raises."""
        ...

    def close(self) -> None:
        """Release per-pass resources."""
        ...


def resolve_num_ctx(requested: int, model_max: int, default: int) -> int:
    """The context size to allocate: the request, else the default capped by the model; never above the model."""
    # Never 0: llama-cpp-python treats n_ctx=0 as the whole training context.
    num_ctx = requested or (min(model_max, default) if model_max > 0 else default)
    if model_max > 0 and num_ctx > model_max:
        raise InvalidArgument(
            f"num_ctx {num_ctx} exceeds the model's training context {model_max}",
            num_ctx=num_ctx,
            model_max_context=model_max,
        )
    return num_ctx


def wants_bos(policy: str, *, disabled: bool, model_default: bool) -> bool:
    """Whether a BOS token leads the prompt under a ContextManifest.bos_policy."""
    if disabled:
        return False
    if policy == "add":
        return True
    if policy == "none":
        return False
    return model_default


def with_bos(tokens: list[int], bos_id: int, wanted: bool) -> list[int]:
    """``tokens`` led by BOS when wanted, never doubled (the template may have rendered it)."""
    if wanted and bos_id >= 0 and (not tokens or tokens[0] != bos_id):
        tokens.insert(0, bos_id)
    return tokens


def parse_tools(tools: str) -> list[Any] | None:
    """The PrefixInput.tools JSON array, or None for no tools."""
    if not tools:
        return None
    try:
        parsed = json.loads(tools)
    except ValueError as exc:
        raise InvalidArgument(f"tools is not valid JSON: {exc}") from exc
    if not isinstance(parsed, list):
        raise InvalidArgument("tools must be a JSON array of tool definitions")
    return parsed or None


class TapeSession:
    """ensure_prefix, prefill_suffix and the session plumbing over a TapeModel.

    Subclasses set ``backend_name`` and supply the hooks. A session is bound to the
    model's session generation: opening a newer session on the model retires it.
    """

    backend_name = ""

    def __init__(self, model: Any, generation: int) -> None:
        self._m = model
        self._gen = generation
        self._closed = False

    def _live(self) -> Any:
        m = self._m
        if self._closed or m.closed:
            raise SessionClosed()
        if m._session_gen != self._gen:
            raise SessionClosed("a newer session was opened on this model")
        return m

    def _check_manifest(self, m: Any, manifest: ContextManifest) -> None:
        check_manifest_names(manifest, self.backend_name, m.digest)
        if manifest.bos_policy not in BOS_POLICIES:
            raise InvalidArgument(f"bos_policy {manifest.bos_policy!r} is not one of {BOS_POLICIES}")

    def explain_context(self) -> ContextReport:
        closed = self._closed or self._m.closed or self._m._session_gen != self._gen
        report: ContextReport = self._m.res.report(closed)
        return report

    def close(self) -> None:
        self._closed = True

    # --- hooks -------------------------------------------------------------------------------
    def _errors(self, action: str) -> AbstractContextManager[None]:
        """The backend's single translation of foreign exceptions into contract errors."""
        raise NotImplementedError

    def _render_prefix(self, m: Any, text: str, tools: list[Any] | None) -> str:
        raise NotImplementedError

    def _renderer(self, m: Any) -> Render | None:
        """The model's chat template, or None when it has none."""
        raise NotImplementedError

    def _prompt_text(self, m: Any, tokens: list[int]) -> str:
        """Resident tokens as text, special tokens included."""
        raise NotImplementedError

    # --- shared steps ------------------------------------------------------------------------
    def _suffix_target(self, m: Any, suffix: SuffixInput) -> tuple[list[int], int]:
        """The token list the KV must hold after the suffix, and its stable-prefix length."""
        res = m.res
        stable = res.tokens[: res.prefix_len]
        render = self._renderer(m)
        if not suffix.render or render is None:
            return stable + m.tokenize(suffix.text), res.prefix_len
        tools = parse_tools(res.tools)
        system = {"role": "system", "content": res.stable_text}
        extra: dict[str, Any] = {}
        if suffix.enable_thinking is not None:
            extra["enable_thinking"] = suffix.enable_thinking
        prefix_text = render([system], tools, generation=False)
        full = render([system, {"role": suffix.role, "content": suffix.text}], tools, generation=True, **extra)
        if full.startswith(prefix_text):
            return stable + m.tokenize(full[len(prefix_text) :]), res.prefix_len
        # Not prefix-stable: the stable part renders differently once a turn follows.
        # Reconcile by tokens: whatever of the old prefix still matches stays resident.
        bos_policy = res.manifest.bos_policy if res.manifest is not None else ""
        target = m.tokenize(full, bos_policy=bos_policy)
        return target, min(res.prefix_len, common_prefix_len(stable, target))

    def _output_pipeline(self, m: Any, cfg: DecodeConfig) -> OutputPipeline:
        """Stops, thinking split and tool parsing for one decode pass (call inside ``_errors``)."""
        if not m.res.tokens:
            raise InvalidArgument("nothing is resident: call ensure_prefix first")
        split, tools = resolve_protocols(
            cfg.parser_protocols,
            cfg.reasoning_format or m.config.reasoning_format,
            has_tools=bool(m.res.tools),
        )
        return OutputPipeline(
            stops=cfg.stop,
            split_thinking=split,
            start_in_thinking=split and ends_inside_thinking(self._prompt_text(m, m.res.tokens[-_PROMPT_TAIL_TOKENS:])),
            parse_tools=tools,
        )

    # --- Session ---------------------------------------------------------------------------------
    def ensure_prefix(self, prefix: PrefixInput) -> PrefixStatus:
        m: TapeModel = self._live()
        self._check_manifest(m, prefix.manifest)
        t0 = time.perf_counter()
        with self._errors("ensure_prefix"):
            rendered = self._render_prefix(m, prefix.text, parse_tools(prefix.tools))
            tokens = m.tokenize(rendered, bos_policy=prefix.manifest.bos_policy)
            plan = m.res.plan_prefix(prefix.manifest, tokens)  # ContextOverflow before any change
        try:
            with self._errors("ensure_prefix: prefill"):
                kept = m.set_kv(tokens, m.reusable(plan.keep))
        except BaseException:
            m.clear_kv()  # a half-computed prefix is not trusted
            raise
        m.res.commit_prefix(prefix.manifest, tokens, prefix.text, prefix.tools)
        if kept != plan.keep:
            plan = PrefixPlan(keep=kept, tail=tokens[kept:], dropped=plan.dropped + plan.keep - kept)
        return m.res.prefix_status(plan, (time.perf_counter() - t0) * 1000)

    def prefill_suffix(self, suffix: SuffixInput) -> SuffixStatus:
        m: TapeModel = self._live()
        res = m.res
        t0 = time.perf_counter()
        if res.manifest is None:
            raise ManifestMismatch("no prefix is resident: call ensure_prefix first")
        with self._errors("prefill_suffix"):
            target, prefix_len = self._suffix_target(m, suffix)
            res.check_suffix(suffix.manifest, len(target) - res.prefix_len)
        keep = m.reusable(common_prefix_len(res.tokens, target))
        try:
            with self._errors("prefill_suffix: prefill"):
                kept = m.set_kv(target, keep)
        except BaseException:
            # Back to the stable prefix when it survived (the tape equals what the KV
            # completed); a damaged prefix is dropped so the next turn re-ensures it.
            if len(res.tokens) >= prefix_len:
                try:
                    m.set_kv(res.tokens[:prefix_len], prefix_len)
                    res.prefix_len = prefix_len
                except Exception:
                    m.clear_kv()
            else:
                m.clear_kv()
            raise
        # On success the KV holds all of ``target``, so its stable part is intact even
        # when the engine could not keep a tail and everything was recomputed.
        res.prefix_len = prefix_len
        reused = max(0, kept - prefix_len)
        return res.suffix_status(len(target) - prefix_len, reused, (time.perf_counter() - t0) * 1000)

    def _stream(
        self, m: Any, cfg: DecodeConfig, steps: DecodeSteps, pipeline: OutputPipeline, epoch: int
    ) -> Generator[StreamChunk, None, None]:
        """The decode loop both engines share; closing the generator cancels within one token.

        A sampled token is yielded first and evaluated when the stream resumes, so a
        chunk reaches the client one engine step earlier; on close ``settle``
        evaluates it, keeping the tape equal to the KV. Any operation that changes
        the KV bumps ``m.epoch``; a stream that sees another epoch stops touching it.
        """
        start = time.perf_counter()
        res = m.res
        prompt_tokens = len(res.tokens)
        produced = 0
        first_ms = 0.0
        finish = ""
        pending: int | None = None

        def still_ours() -> bool:
            return bool(m.epoch == epoch and not m.closed and not self._closed)

        try:
            if not still_ours():
                return  # the KV changed between decode() and the first chunk
            with self._errors("decode"):
                steps.start()
            epoch = m.epoch  # start() may have recomputed the last token
            while True:
                if not still_ours():
                    pending = None
                    return  # another operation took the KV; this stream is over
                if pending is not None:
                    tok, pending = pending, None
                    with self._errors("decode"):
                        steps.feed(tok)
                if finish:
                    break
                if produced >= cfg.max_tokens:
                    finish = "length"
                    break
                if len(res.tokens) >= m.num_ctx:
                    finish = "context_full"  # the next token could not be evaluated
                    break
                with self._errors("decode"):
                    token = steps.sample()
                if not first_ms:
                    first_ms = (time.perf_counter() - start) * 1000
                if steps.is_end(token):
                    finish = "stop"
                    break
                produced += 1
                pending = token
                delta = pipeline.feed_bytes(steps.piece(token))
                if delta.stopped:
                    finish = "stop"
                if delta or cfg.return_token_ids:
                    yield delta.chunk([token] if cfg.return_token_ids else None)
            tail = pipeline.finish()
            if tail:
                yield tail.chunk()
            if pipeline.tool_call_count and finish == "stop":
                finish = "tool_calls"
            yield StreamChunk.final(finish, prompt_tokens, produced, first_ms, start)
        finally:
            if pending is not None and still_ours():
                steps.settle(pending)
            steps.close()
