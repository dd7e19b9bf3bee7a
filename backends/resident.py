"""Bookkeeping of a session's resident context, shared by every implementation.

A backend keeps one ``Resident`` next to its KV: the token tape that is in the
KV, how much of it is the stable prefix, and the manifest it was computed under.

``tokens`` is what the KV physically holds; ``live`` is the session's context.
They differ after an ensure_prefix that found its whole prefix resident: the
contract drops the previous suffix and reply, but their KV is kept (``live_len``
marks the end of the context) so the next suffix — a conversation resending that
history — reuses it by token LCP instead of prefilling it again.
Keeping this in one place makes every backend report PrefixStatus, SuffixStatus,
ContextReport and snapshot metadata the same way, and refuse the same bad
restores.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from contract.errors import (
    BackendMismatch,
    ContextOverflow,
    InvalidArgument,
    ManifestMismatch,
    OffsetDrift,
    SnapshotRejected,
)
from contract.manifest import ContextManifest, byte_hash, common_prefix_len, token_hash
from contract.types import ContextReport, PrefixStatus, SessionSnapshot, SuffixStatus

from .image_tokens import block_start, inside_block


def check_token_ids(tokens: Sequence[int], vocab_size: int) -> list[int]:
    """``tokens`` as a list when every id is one of the model's ``vocab_size``; InvalidArgument naming the first
    that is not."""
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"tokens[{i}] is {t}, not a token of this model (its ids are 0..{vocab_size - 1})",
                                  index=i, token=t, vocab_size=vocab_size)
    return list(tokens)


def check_model_type(model_type: str, backend: str) -> None:
    """Refuse a request whose model type names another backend ("" means any)."""
    if model_type not in ("", backend):
        raise BackendMismatch(f"model type {model_type!r} is not served by the {backend} backend", type=model_type)


def check_manifest_names(manifest: ContextManifest, backend: str, model_digest: str) -> None:
    """Refuse a manifest that names another backend or model than the one serving it."""
    if manifest.backend and manifest.backend != backend:
        raise ManifestMismatch(f"manifest names backend {manifest.backend!r}; this is {backend!r}")
    if manifest.model_digest and manifest.model_digest != model_digest:
        raise ManifestMismatch(
            "manifest names another model digest", manifest=manifest.model_digest, model=model_digest
        )


@dataclass
class PrefixPlan:
    """What ensure_prefix must do to the KV: keep ``keep`` tokens, prefill ``tail``."""

    keep: int
    tail: list[int]
    dropped: int


@dataclass
class Resident:
    num_ctx: int
    tokens: list[int] = field(default_factory=list)
    prefix_len: int = 0
    manifest: ContextManifest | None = None
    stable_text: str = ""
    tools: str = ""
    stable_token_hash: str = ""
    #: the context is ``tokens[:live_len]``; None: all of ``tokens``
    live_len: int | None = None
    #: the tape holds the head of a prefix whose prefill was cancelled under this manifest (no prefix is resident):
    #: a prefix planned under a compatible manifest reuses it
    partial: ContextManifest | None = None
    #: the conversation the tape holds after the prefix, a key per message (``backends.tape.miss.message_keys``);
    #: None when not known (restored from a snapshot or the workspace cache)
    messages: list[str] | None = None
    #: the tape from this token on is the model's reply, decoded after the last prefill (None: no reply)
    reply_from: int | None = None
    #: the conversation the tape holds past the prefix (``SuffixInput.conversation``; "" when none is named)
    conversation: str = ""
    #: the manifest a prefix's prefill computes the tape under, until the prefix is committed (an engine whose KV
    #: is a server's keys the server's cache by the manifest it is computed under)
    computing: ContextManifest | None = None

    @property
    def live(self) -> list[int]:
        """The session's context (a prefix of ``tokens``, the KV may hold more)."""
        return self.tokens if self.live_len is None else self.tokens[: self.live_len]

    # --- planning ---------------------------------------------------------------
    def plan_prefix(self, manifest: ContextManifest, prefix_tokens: list[int]) -> PrefixPlan:
        """Token-LCP reuse under a compatible manifest; everything else is recomputed."""
        if len(prefix_tokens) > self.num_ctx:
            raise ContextOverflow(
                f"prefix is {len(prefix_tokens)} tokens but the context window is {self.num_ctx}",
                prefix_tokens=len(prefix_tokens),
                num_ctx=self.num_ctx,
            )
        under = self.manifest or self.partial
        if under is None or not manifest.compatible_with(under):
            keep = 0
        else:
            keep = common_prefix_len(self.tokens, prefix_tokens)
        # keep runs over everything the KV holds; what is dropped is counted on the context
        return PrefixPlan(keep=keep, tail=prefix_tokens[keep:], dropped=max(0, len(self.live) - keep))

    def append_at(self, offset: int, truncating: bool, new: list[int]) -> tuple[list[int], int]:
        """The tape an append of ``new`` at ``offset`` makes (``SuffixInput.offset``), and how much of it stays the
        stable prefix: at the resident length it appends; below it, with ``truncating``, the context is cut to
        ``offset`` first; anything else is OffsetDrift naming both lengths (nothing has changed)."""
        live = self.live
        if offset < self.prefix_len <= len(live) and truncating:
            raise InvalidArgument(
                f"offset {offset} is inside the stable prefix ({self.prefix_len} tokens): a prefix is changed with "
                "ensure_prefix", offset=offset, prefix_tokens=self.prefix_len)
        if inside_block(live, offset) and offset < len(live):
            raise InvalidArgument(f"offset {offset} is inside an image's block of tokens (it starts at "
                                  f"{block_start(live, offset)}): cut before or after it", offset=offset)
        if offset == len(live) or (truncating and offset < len(live)):
            return live[:offset] + new, self.prefix_len
        if offset > len(live):
            why = "past the end of the session's context"
        else:
            why = "short of the session's context, and truncating is off"
        raise OffsetDrift(
            f"the append's offset {offset} is {why} ({len(live)} tokens resident): the client's view drifted",
            offset=offset,
            resident_tokens=len(live),
        )

    def check_suffix(self, manifest: ContextManifest, n_new: int) -> None:
        if self.manifest is None:
            raise ManifestMismatch("no prefix is resident: call ensure_prefix first")
        if not manifest.compatible_with(self.manifest):
            raise ManifestMismatch(
                "suffix manifest is not compatible with the resident prefix",
                resident=self.manifest.digest(),
                requested=manifest.digest(),
            )
        self.check_room(n_new, what="suffix")

    def check_room(self, n_new: int, *, what: str) -> None:
        if self.prefix_len + n_new > self.num_ctx:
            raise ContextOverflow(
                f"{what} of {n_new} tokens after a {self.prefix_len}-token prefix exceeds "
                f"the {self.num_ctx}-token context window",
                requested_tokens=n_new,
                prefix_tokens=self.prefix_len,
                num_ctx=self.num_ctx,
            )

    # --- commits ------------------------------------------------------------------
    def commit_prefix(
        self, manifest: ContextManifest, tokens: list[int], text: str, tools: str, *, keep_tail: bool = False
    ) -> None:
        """The prefix is now the context; ``keep_tail``: the KV still holds the old tail after it (see ``live``)."""
        self.computing = None
        if keep_tail and self.tokens[: len(tokens)] == tokens and len(self.tokens) > len(tokens):
            self.live_len = len(tokens)
        else:
            self.tokens = list(tokens)
            self.live_len = None
            self.messages = []
            self.reply_from = None
            self.conversation = ""
        self.prefix_len = len(tokens)
        self.manifest = manifest
        self.partial = None
        self.stable_text = text
        self.tools = tools
        self.stable_token_hash = token_hash(tokens)

    def fork(self, at: int) -> Resident:
        """The context of a fork at ``at`` (``Session.fork``): this one's first ``at`` tokens, its stable prefix and
        manifest; the conversation after the prefix is a new one. InvalidArgument inside the stable prefix (a prefix
        is changed with ensure_prefix) or past the context; ManifestMismatch with no prefix resident."""
        if self.manifest is None:
            raise ManifestMismatch("no prefix is resident: call ensure_prefix before forking")
        live = self.live
        if not self.prefix_len <= at <= len(live):
            where = "inside the stable prefix" if at < self.prefix_len else "past the end of the context"
            raise InvalidArgument(
                f"a fork at {at} is {where} (the prefix is {self.prefix_len} tokens, the context {len(live)}): "
                f"fork between {self.prefix_len} and {len(live)}",
                at_position=at, prefix_tokens=self.prefix_len, resident_tokens=len(live))
        if inside_block(live, at):
            raise InvalidArgument(f"a fork at {at} is inside an image's block of tokens (it starts at "
                                  f"{block_start(live, at)}): fork before or after it", at_position=at)
        view = replace(self, tokens=live[:at], live_len=None, partial=None, conversation="")
        view.messages = None  # which messages the first ``at`` tokens hold is not known any more
        if view.reply_from is not None and view.reply_from >= at:
            view.reply_from = None
        return view

    def take_view(self, view: Resident) -> None:
        """Become ``view``'s context; the KV must hold ``view.tokens`` (the caller made it so)."""
        for f in fields(self):
            setattr(self, f.name, copy.copy(getattr(view, f.name)))

    def keep_partial(self, manifest: ContextManifest) -> None:
        """A prefix's prefill under ``manifest`` was cancelled: the tape (what the KV completed) is the head of that
        prefix and nothing more; no prefix is resident until one is ensured."""
        tokens = self.tokens
        self.clear()
        self.tokens = tokens
        self.partial = manifest if tokens else None

    def clear(self) -> None:
        self.tokens = []
        self.live_len = None
        self.prefix_len = 0
        self.manifest = None
        self.partial = None
        self.messages = None
        self.reply_from = None
        self.conversation = ""
        self.computing = None
        self.stable_text = ""
        self.tools = ""
        self.stable_token_hash = ""

    # --- reports ------------------------------------------------------------------
    @property
    def available(self) -> int:
        return max(0, self.num_ctx - len(self.live))

    def manifest_digest(self) -> str:
        return self.manifest.digest() if self.manifest is not None else ""

    def prefix_status(self, plan: PrefixPlan, prefill_ms: float = 0.0, cached: int = 0) -> PrefixStatus:
        return PrefixStatus(
            cached_tokens=cached,
            reused_tokens=plan.keep,
            prefilled_tokens=len(plan.tail),
            dropped_tokens=plan.dropped,
            prefix_tokens=self.prefix_len,
            resident_tokens=len(self.live),
            available_tokens=self.available,
            stable_byte_hash=byte_hash(self.stable_text + self.tools),
            stable_token_hash=self.stable_token_hash,
            manifest_digest=self.manifest_digest(),
            prefill_ms=prefill_ms,
        )

    def suffix_status(
        self, suffix_tokens: int, reused: int = 0, prefill_ms: float = 0.0, cached: int = 0
    ) -> SuffixStatus:
        return SuffixStatus(
            cached_tokens=cached,
            suffix_tokens=suffix_tokens,
            prefix_tokens=self.prefix_len,
            resident_tokens=len(self.live),
            available_tokens=self.available,
            manifest_digest=self.manifest_digest(),
            reused_tokens=reused,
            prefilled_tokens=max(0, suffix_tokens - reused),
            prefill_ms=prefill_ms,
        )

    def report(self, closed: bool) -> ContextReport:
        return ContextReport(
            resident_tokens=len(self.live),
            prefix_tokens=self.prefix_len,
            num_ctx=self.num_ctx,
            available_tokens=self.available,
            stable_byte_hash=byte_hash(self.stable_text + self.tools) if self.manifest else "",
            stable_token_hash=self.stable_token_hash,
            manifest_digest=self.manifest_digest(),
            manifest=self.manifest or ContextManifest(),
            closed=closed,
        )

    # --- snapshots ----------------------------------------------------------------
    def snapshot(self, backend: str, state: bytes, state_kind: str) -> SessionSnapshot:
        """The session's context with its state bytes: what a client's ``snapshot`` returns."""
        return self._snapshot(backend, state, state_kind, self.live, "sha256:" + hashlib.sha256(state).hexdigest())

    def tape_snapshot(self, backend: str, state: bytes, state_kind: str) -> SessionSnapshot:
        """A snapshot of the whole tape (the KV kept past the context too): what the workspace cache keeps.

        Its ``state_digest`` is left empty: the cache fills it in when it writes the entry to
        disk (off the request's path), and a RAM entry never left the process.
        """
        return self._snapshot(backend, state, state_kind, self.tokens, "")

    def _snapshot(
        self, backend: str, state: bytes, state_kind: str, tokens: list[int], state_digest: str
    ) -> SessionSnapshot:
        return SessionSnapshot(
            state=state,
            state_kind=state_kind,
            state_digest=state_digest,
            backend=backend,
            resident_tokens=len(tokens),
            prefix_tokens=min(self.prefix_len, len(tokens)),
            num_ctx=self.num_ctx,
            resident_token_ids=list(tokens),
            stable_text=self.stable_text,
            prefix_text=self.stable_text,
            tools=self.tools,
            manifest=self.manifest or ContextManifest(),
        )

    def validate_snapshot(
        self, snap: SessionSnapshot, backend: str, model_digest: str, *, check_digest: bool = True
    ) -> None:
        """Refuse a snapshot that this session cannot trust; raises SnapshotRejected.

        ``check_digest=False`` skips hashing the state: for the workspace cache's own
        entries, whose bytes never left the process or were verified on the way in.
        """
        problems: list[str] = []
        if snap.backend != backend:
            problems.append(f"snapshot is from backend {snap.backend!r}, this is {backend!r}")
        if snap.num_ctx != self.num_ctx:
            problems.append(f"snapshot num_ctx {snap.num_ctx} != session num_ctx {self.num_ctx}")
        if snap.resident_tokens != len(snap.resident_token_ids):
            problems.append(
                f"resident_tokens {snap.resident_tokens} != {len(snap.resident_token_ids)} token ids"
            )
        if not 0 <= snap.prefix_tokens <= snap.resident_tokens:
            problems.append(f"prefix_tokens {snap.prefix_tokens} outside 0..{snap.resident_tokens}")
        if snap.resident_tokens > self.num_ctx:
            problems.append(f"{snap.resident_tokens} tokens do not fit num_ctx {self.num_ctx}")
        if snap.manifest.model_digest and model_digest and snap.manifest.model_digest != model_digest:
            problems.append("snapshot manifest names another model digest")
        if check_digest and snap.state_digest != "sha256:" + hashlib.sha256(snap.state).hexdigest():
            problems.append("state bytes do not match the snapshot's state_digest")
        if problems:
            raise SnapshotRejected("; ".join(problems), problems=problems)

    def adopt_snapshot(self, snap: SessionSnapshot) -> None:
        self.tokens = list(snap.resident_token_ids)
        self.live_len = None
        self.prefix_len = snap.prefix_tokens
        self.manifest = snap.manifest
        self.partial = None
        self.messages = None
        self.reply_from = None
        self.conversation = ""
        self.stable_text = snap.stable_text
        self.tools = snap.tools
        self.stable_token_hash = token_hash(self.tokens[: self.prefix_len])
