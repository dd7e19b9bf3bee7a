"""MemoryService: the contract's executable reference, with no inference.

It models the warm-reuse contract so the runtime and the daemon can be built and
tested against the boundary. Token counts are byte-length proxies: one UTF-8
byte of the rendered text is one "token". Reuse is keyed on the manifest: a
changed stable segment OR a changed profile/template/runtime digest invalidates
the resident prefix (the reference does no partial reuse; real backends keep the
token longest-common-prefix). Decode emits a deterministic word stream derived
from the resident bytes, so the same resident context always decodes the same
text (greedy) and a seed makes sampled output repeatable.

``MemoryBackend`` is the same model behind the daemon's ``Backend`` seam
(``modeld serve --backend memory``).
"""

from __future__ import annotations

import copy
import hashlib
import random
import threading
import time
from collections.abc import Callable, Generator, Sequence

from contract import interrupt
from contract.errors import (
    ContextOverflow,
    InvalidArgument,
    SessionClosed,
    SnapshotRejected,
    StaleFence,
    UnsupportedFeature,
)
from contract.interfaces import LoadedModel
from contract.manifest import ContextManifest, byte_hash, canonical_digest, common_prefix_len
from contract.sizing import MemoryPool, ModelFacts
from contract.types import (
    DEFAULT_SAMPLING,
    ChatMessage,
    ContextReport,
    DecodeConfig,
    EmbedRequest,
    EmbedResult,
    FinishReason,
    ModelInfo,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    SamplingParams,
    SessionSnapshot,
    SpeculationStatus,
    StreamChunk,
    SuffixInput,
    SuffixStatus,
    TokenCount,
    TokenLogprob,
    TopLogprob,
    check_conversation,
    first_covered,
    positions_covered,
)

from .engine_spec import check_options
from .lanes import Lanes, check_lane
from .memory_spec import SPEC
from .resident import PrefixPlan, Resident, check_manifest_names, check_model_type, check_token_ids

BACKEND_NAME = "memory"
DEFAULT_NUM_CTX = 4096
MAX_NUM_CTX = 1 << 20
_WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta", "zeta", "tau")


def _tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _suffix_tokens(suffix: SuffixInput) -> list[int]:
    """A suffix's tokens: its ids (bytes: each below 256), or its text's, or its conversation's."""
    if suffix.tokens:
        return check_token_ids(suffix.tokens, 256)
    return _tokens(_conversation_text(suffix.messages) if suffix.messages else suffix.text)


def _target(res: Resident, stable: list[int], suffix: SuffixInput) -> list[int]:
    """The tape after ``suffix``: ``stable`` and its tokens, or the tape with them appended at ``suffix.offset``."""
    if suffix.offset is not None:
        return res.append_at(suffix.offset, suffix.truncating, _suffix_tokens(suffix))[0]
    return stable + _suffix_tokens(suffix)


def _conversation_text(messages: list[ChatMessage]) -> str:
    """The reference's template: one labelled line per message, then the assistant's turn.

    A reply the reference decoded is the bytes of its text, so a conversation that
    resends it renders to the same tokens and is reused, as with a real template.
    """
    lines = []
    for msg in messages:
        if msg.role == "assistant":
            calls = "".join(f" call {c.function.name}({c.function.arguments})" for c in msg.tool_calls)
            lines.append(f"assistant: {msg.content or ''}{calls}\n")
        elif msg.role == "tool":
            lines.append(f"tool {msg.name} {msg.tool_call_id}: {msg.content}\n")
        else:
            lines.append(f"{msg.role}: {msg.content}\n")
    return "".join(lines) + "assistant: "


class MemoryModel:
    """A 'loaded' model: its identity and one persistent resident context."""

    def __init__(self, req: OpenSessionRequest, token_delay_s: float = 0.0) -> None:
        self.token_delay_s = token_delay_s
        num_ctx = req.config.num_ctx or DEFAULT_NUM_CTX
        if num_ctx > MAX_NUM_CTX:
            raise InvalidArgument(f"num_ctx {num_ctx} exceeds the memory backend's {MAX_NUM_CTX}")
        self.req = req
        self._digest = req.digest or byte_hash(f"{req.model_name}\0{req.path}")
        self.resident = Resident(num_ctx=num_ctx)
        self.closed = False
        self.lock = threading.Lock()
        self.template_origin = ""  # prompts are raw text: no chat template
        self.tool_format_origin = ""  # and no tool calls
        self.capabilities = ["text"]
        #: the session whose context ``resident`` is (a fork switched to parks the other's: ``MemorySession.fork``)
        self.active: MemorySession | None = None

    @property
    def digest(self) -> str:
        return self._digest

    @property
    def num_ctx(self) -> int:
        return self.resident.num_ctx

    @property
    def lanes(self) -> int:
        """One: the model's one context (``MemoryBackend(lanes=N)`` puts several side by side)."""
        return 1

    def open_session(self, lane: int = 0) -> MemorySession:
        check_lane(lane, 1)
        if self.closed:
            raise SessionClosed("model was unloaded")
        self.active = MemorySession(self)
        return self.active

    def resident_bytes(self) -> int:
        return len(self.resident.tokens)

    def speculation(self) -> SpeculationStatus | None:
        """None: the reference model computes no logits to check a draft with."""
        return None

    def idle_pending(self) -> bool:
        """False: the reference model has nothing to measure."""
        return False

    def idle_work(self) -> None:
        return None

    def sampling_defaults(self) -> SamplingParams:
        """The documented defaults (the reference model has no metadata recommending others)."""
        return DEFAULT_SAMPLING

    def manifest_defaults(self) -> ContextManifest:
        """The identity a client puts in its ContextManifest for this model."""
        return ContextManifest(
            backend=BACKEND_NAME,
            backend_version="reference",
            model_digest=self._digest,
            prompt_format="raw",
            template_digest="",
            runtime_digest=canonical_digest({"num_ctx": self.num_ctx}),
            bos_policy="none",
        )

    def close(self) -> None:
        self.closed = True
        self.resident.clear()


class MemorySession:
    """A Session over a MemoryModel's resident context."""

    def __init__(self, model: MemoryModel, parked: Resident | None = None) -> None:
        self._model = model
        self._closed = False
        #: this session's context while another's is resident (a fork, or a session a fork displaced)
        self._parked = parked

    # --- helpers -----------------------------------------------------------------
    def _live(self) -> Resident:
        if self._closed or self._model.closed:
            raise SessionClosed()
        m = self._model
        if self._parked is not None:  # switch the resident context to this session's
            if m.active is not None and m.active is not self and not m.active._closed:
                m.active._parked = copy.deepcopy(m.resident)
            m.resident.take_view(self._parked)
            self._parked = None
            m.active = self
        return m.resident

    def fork(self, at_position: int) -> MemorySession:
        """A session on this one's first ``at_position`` tokens; the reference's "KV" is its tape, so a switch
        between the two costs nothing."""
        if self._closed or self._model.closed:
            raise SessionClosed()
        view = (self._parked or self._model.resident).fork(at_position)
        return MemorySession(self._model, parked=view)

    # --- Session -------------------------------------------------------------------
    def ensure_prefix(self, prefix: PrefixInput) -> PrefixStatus:
        res = self._live()
        check_manifest_names(prefix.manifest, BACKEND_NAME, self._model.digest)
        t0 = time.perf_counter()
        tokens = _tokens(prefix.text + prefix.tools)
        same = (
            res.manifest is not None
            and prefix.manifest.compatible_with(res.manifest)
            and res.stable_text == prefix.text
            and res.tools == prefix.tools
            and len(res.tokens) >= res.prefix_len
        )
        res.plan_prefix(prefix.manifest, tokens)  # raises ContextOverflow for an oversize prefix
        # The reference reuses all or nothing (see module docstring); on a hit the
        # previous turn stays behind the prefix for the next suffix to reuse.
        if same:
            plan = PrefixPlan(keep=len(tokens), tail=[], dropped=len(res.live) - len(tokens))
        else:
            plan = PrefixPlan(keep=0, tail=tokens, dropped=len(res.live))
        res.commit_prefix(prefix.manifest, tokens, prefix.text, prefix.tools, keep_tail=same)
        return res.prefix_status(plan, (time.perf_counter() - t0) * 1000)

    def prefill_suffix(self, suffix: SuffixInput) -> SuffixStatus:
        res = self._live()
        check_conversation(suffix.messages)  # a suffix built without validation is checked here too
        if suffix.readouts:
            raise UnsupportedFeature("the reference backend has no residual stream to read out")
        target = _target(res, res.tokens[: res.prefix_len], suffix)
        tokens = target[res.prefix_len :]
        res.check_suffix(suffix.manifest, len(tokens))
        # the token LCP with everything resident (the previous turn and reply included)
        reused = max(0, common_prefix_len(res.tokens, target) - res.prefix_len)
        wanted: list[bool] = []
        if suffix.logprobs is not None:
            wanted = positions_covered(suffix.logprobs_ranges, res.prefix_len, len(target))
            # a scored token is computed again, and the one before it, as an engine computes its rows
            reused = min(reused, max(first_covered(wanted) - 1, 0))
        res.tokens = target
        res.live_len = None
        status = res.suffix_status(len(tokens), reused)
        if suffix.logprobs is not None:
            status.logprobs = [_certain(t, suffix.logprobs) if at > 0 and wanted[at - res.prefix_len] else None
                               for at, t in enumerate(target) if at >= res.prefix_len]
        return status

    def count_tokens(self, prefix: PrefixInput, suffix: SuffixInput) -> TokenCount:
        res = self._live()
        check_manifest_names(prefix.manifest, BACKEND_NAME, self._model.digest)
        check_conversation(suffix.messages)
        # (an append at an offset counts against the tape as it is)
        stable = _tokens(prefix.text + prefix.tools) if suffix.offset is None else res.tokens[: res.prefix_len]
        target = _target(res, stable, suffix)
        compatible = res.manifest is not None and prefix.manifest.compatible_with(res.manifest)
        return TokenCount(
            prompt_tokens=len(target),
            prefix_tokens=len(stable),
            num_ctx=res.num_ctx,
            resident_tokens=common_prefix_len(res.tokens, target) if compatible else 0,
        )

    def decode(self, cfg: DecodeConfig) -> Generator[StreamChunk, None, None]:
        res = self._live()
        if res.live_len is not None:  # drop the previous turn kept behind the prefix
            res.tokens, res.live_len = res.live, None
        if cfg.readouts:
            raise UnsupportedFeature("the reference backend has no residual stream to read out")
        if cfg.structured_output.is_set():
            raise UnsupportedFeature("the memory backend cannot constrain output")
        if cfg.parser_protocols:
            # it emits plain words: a protocol parser would be a silent no-op
            raise UnsupportedFeature(
                f"the memory backend parses no output protocols; got {cfg.parser_protocols}",
                protocols=list(cfg.parser_protocols),
            )
        if not res.tokens:
            raise InvalidArgument("nothing is resident: call ensure_prefix first")
        return self._decode(res, cfg)

    def _decode(self, res: Resident, cfg: DecodeConfig) -> Generator[StreamChunk, None, None]:
        start = time.perf_counter()
        prompt_tokens = len(res.tokens)
        seed_material = bytes(res.tokens)
        if cfg.temperature:
            rng = random.Random(cfg.seed if cfg.seed is not None else time.time_ns())
        else:
            rng = random.Random(hashlib.sha256(seed_material).digest())
        produced = 0
        finish: FinishReason = "length"
        first_ms = 0.0
        pending = ""
        held = ""
        matched = ""
        # with no limit the reply ends after a few words, as a model's end of generation does
        words_left = rng.randint(8, 40) if cfg.max_tokens is None else -1
        while cfg.max_tokens is None or produced < cfg.max_tokens:
            if not pending:
                if words_left == 0:
                    finish = "stop"
                    break
                words_left -= 1
                pending = rng.choice(_WORDS) + " "
            char, pending = pending[0], pending[1:]  # one ASCII byte is one token
            if len(res.tokens) + 1 > res.num_ctx:
                finish = "context_full"
                break
            if self._closed or self._model.closed:
                return
            if self._model.token_delay_s:
                time.sleep(self._model.token_delay_s)  # simulated decode speed
            if interrupt.stopped():  # a decode step (a beat); a cancel ends it here, text held back or not
                return
            interrupt.decoded(produced)
            res.tokens.append(ord(char))
            produced += 1
            if not first_ms:
                first_ms = (time.perf_counter() - start) * 1000
            held += char
            hit, matched = min(((held.find(s), s) for s in cfg.stop if s and s in held), default=(-1, ""))
            if hit >= 0:
                finish = "stop"
                held = held[:hit]
                break
            # Hold back text that may be the start of a stop string.
            keep = max((k for s in cfg.stop for k in range(1, len(s)) if held.endswith(s[:k])), default=0)
            out, held = held[: len(held) - keep], held[len(held) - keep :]
            if out:
                yield _chunk(out, cfg)
        if held:
            yield _chunk(held, cfg)
        final = StreamChunk.final(finish, prompt_tokens, produced, first_ms, start)
        final.stop_sequence = matched
        yield final

    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        self._live()
        return _tokens(text)  # the reference has no BOS: add_special adds nothing

    def detokenize(self, tokens: Sequence[int]) -> str:
        self._live()
        return bytes(check_token_ids(tokens, 256)).decode("utf-8", "replace")

    def explain_context(self) -> ContextReport:
        closed = self._closed or self._model.closed
        return (self._parked or self._model.resident).report(closed)

    def snapshot(self) -> SessionSnapshot:
        res = self._live()
        return res.snapshot(BACKEND_NAME, bytes(res.live), "kv")

    def restore(self, snap: SessionSnapshot) -> None:
        res = self._live()
        res.validate_snapshot(snap, BACKEND_NAME, self._model.digest)
        if snap.state_kind != "kv":
            raise SnapshotRejected(f"state_kind {snap.state_kind!r} is not restorable by the memory backend")
        if any(not 0 <= t < 256 for t in snap.resident_token_ids) or bytes(snap.resident_token_ids) != snap.state:
            raise SnapshotRejected("state bytes do not match the token tape")
        res.adopt_snapshot(snap)

    def close(self) -> None:
        self._closed = True
        if self._model.active is self:
            self._model.active = None

    @property
    def manifest_defaults(self) -> ContextManifest:
        return self._model.manifest_defaults()


class MemoryBackend:
    """The reference model behind the daemon's Backend seam.

    ``token_delay_s`` simulates decode speed so the daemon's concurrency (status
    during a decode, cancel, leases) can be exercised without a real model; ``lanes``
    models side by side serve that many sessions at once (``backends.lanes``), as an
    engine that batches does.
    """

    name = BACKEND_NAME

    def __init__(self, token_delay_s: float = 0.0, lanes: int = 1) -> None:
        if lanes < 1:
            raise ValueError("lanes must be 1 or more")
        self.token_delay_s = token_delay_s
        self.lanes = lanes

    def runtime_version(self) -> str:
        return "reference"

    def load(self, req: OpenSessionRequest, progress: Callable[[float], None]) -> LoadedModel:
        check_model_type(req.type, BACKEND_NAME)
        check_options(SPEC, req.config)
        progress(0.0)
        model: LoadedModel = MemoryModel(req, self.token_delay_s)
        if self.lanes > 1:
            model = Lanes([model, *(MemoryModel(req, self.token_delay_s) for _ in range(self.lanes - 1))])
        progress(1.0)
        return model

    def describe(self, req: OpenSessionRequest, credit_bytes: int = 0) -> ModelInfo:
        check_model_type(req.type, BACKEND_NAME)
        check_options(SPEC, req.config)
        n = req.config.num_ctx or DEFAULT_NUM_CTX
        return ModelInfo(
            model_max_context=MAX_NUM_CTX,
            effective_context=min(n, MAX_NUM_CTX),
            kv_bytes_per_token=1,
            required_bytes=min(n, MAX_NUM_CTX),
            runtime_name=BACKEND_NAME,
            device_kind="cpu",
        )

    def model_facts(self, req: OpenSessionRequest) -> ModelFacts | None:
        """None: the reference has no memory model; its ``describe`` answers alone."""
        return None

    def memory_pools(self) -> Sequence[MemoryPool]:
        return ()

    def close(self) -> None:
        return None


class MemoryService:
    """In-process Service (the contract's reference); safe for concurrent use."""

    def __init__(self, owner_fence: str | None = None) -> None:
        self._owner = owner_fence
        self._lock = threading.Lock()
        self._models: dict[tuple[str, str, str, int], MemoryModel] = {}
        self._backend = MemoryBackend()

    def _fence(self, owner: str) -> None:
        if self._owner is not None and owner != self._owner:
            raise StaleFence(f"fence {owner!r} does not match owner {self._owner!r}")

    def open_session(self, req: OpenSessionRequest) -> MemorySession:
        self._fence(req.owner_instance_id)
        check_model_type(req.type, BACKEND_NAME)
        check_options(SPEC, req.config)
        key = (req.model_name, req.digest, req.path, req.config.num_ctx)
        with self._lock:
            model = self._models.get(key)
            if model is None:
                model = self._models[key] = MemoryModel(req)
        return model.open_session()

    def describe(self, req: OpenSessionRequest) -> ModelInfo:
        self._fence(req.owner_instance_id)
        info = self._backend.describe(req)
        # The reference echoes the requested window.
        return info.model_copy(update={"effective_context": req.config.num_ctx})

    def embed(self, req: EmbedRequest) -> EmbedResult:
        self._fence(req.owner_instance_id)
        raise UnsupportedFeature("the reference service computes no embeddings")


def with_owner_fence(owner_instance_id: str) -> MemoryService:
    """The reference service fenced to ``owner_instance_id``."""
    return MemoryService(owner_fence=owner_instance_id)


__all__ = ["ContextOverflow", "MemoryBackend", "MemoryModel", "MemoryService", "MemorySession", "with_owner_fence"]


def _chunk(text: str, cfg: DecodeConfig) -> StreamChunk:
    """A text delta, one token a byte; with ``cfg.logprobs``, each token's: the reference's next byte is a
    function of its tape and seed, so each is certain (log probability 0, itself its only likely token)."""
    chunk = StreamChunk(text=text, token_ids=[ord(c) for c in text] if cfg.return_token_ids else [])
    if cfg.logprobs is not None:
        chunk.logprobs = [_certain(ord(c), cfg.logprobs, c) for c in text]
    return chunk


def _certain(token: int, k: int, text: str | None = None) -> TokenLogprob:
    """A token the reference was sure of (log probability 0), itself the only likely token when ``k`` asks for
    alternatives: its next byte is a function of its tape and seed, and a prompt's bytes are what they are.
    A token is a byte; ``text`` is what it shows (its byte decoded, unless given)."""
    shown = text if text is not None else bytes([token]).decode("utf-8", "replace")
    one = TopLogprob(token_id=token, token=shown, bytes=[token], logprob=0.0)
    return TokenLogprob(**one.model_dump(), top=[one] if k else [])
