"""What a tape engine is: the typed seam ``TapeSession`` drives, and the bookkeeping every engine shares.

An engine (llama.cpp, OpenVINO) keeps ONE KV cache whose contents follow a
token tape, ``Resident.tokens``. ``TapeModel`` is everything the one
``TapeSession`` needs of it; ``TapeModelBase`` implements the parts that do not
depend on the engine (identity, session generations, epochs, BOS policy,
template checks, the manifest a client should use, closing). An engine class
derives from the base and supplies only what differs: tokenizing, KV mechanics,
its decode steps, and exporting/importing its state bytes.

Over ~400 lines on purpose: the ``TapeModel`` protocol and the base class that implements its
engine-independent half are read side by side; the base's rules (BOS, templates, identity) are
what every engine inherits.
"""

from __future__ import annotations

import json
import os
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from contract.errors import (
    Cancelled,
    InvalidArgument,
    ModelLoadFailed,
    SessionClosed,
    UnsupportedFeature,
)
from contract.interfaces import StateCache
from contract.manifest import ContextManifest, canonical_digest
from contract.types import DEFAULT_SAMPLING, Config, DecodeConfig, SamplingParams, SessionSnapshot, SpeculationStatus

from ..image_tokens import block_start
from ..lanes import check_lane
from ..resident import Resident
from . import draft_costs as cost_tables
from .cache import SWITCHING_TURNS, save_tape
from .images import ImageEncoder
from .miss import SHARED as SHARED_SEEN
from .miss import SeenPrompts
from .output import THINK_OPEN, resolve_protocols
from .speculate import MAX_DRAFT, CheckCosts, SpeculationStats
from .toolformats import FORMATS, ToolFormat, detect_format, require_format

if TYPE_CHECKING:
    import numpy as np

    from ..readouts import Readouts
    from .decoding import DecodeSteps
    from .session import TapeSession

#: what a scored prefill hands each chunk's logits to (``set_kv``'s ``rows``): the position of the chunk's first
#: token, and a [tokens, vocab] array of the logits after each of them (valid during the call only)
RowsFn = Callable[[int, "np.ndarray"], None]
#: what a prefill with readouts hands each chunk's concept readouts to (``set_kv``'s ``states``): the position of the
#: chunk's first token, and ``[n_tokens, n_layers, n_concepts]`` (``backends.readouts.Readouts.project``)
StatesFn = Callable[[int, "np.ndarray"], None]

#: ContextManifest.bos_policy values: the model's default, always add, never add
BOS_POLICIES = ("", "add", "none")
#: the check sizes ``status`` shows the costs of (a check of 16 rows is the pending token and MAX_DRAFT)
STATUS_CHECK_ROWS = (2, 4, 8, MAX_DRAFT + 1)


class ChatTemplate(Protocol):
    """A model's own chat template, as its engine renders it."""

    @property
    def digest(self) -> str:
        """sha256 of the template source (part of the manifest identity)."""
        ...

    @property
    def prompt_format(self) -> str:
        """A short name for the format: "chatml" or "jinja"."""
        ...

    @property
    def source(self) -> str:
        """The template's own text (what its digest is of)."""
        ...

    @property
    def supports_tools(self) -> bool:
        """Whether the template renders a ``tools`` list itself (else they go in a generic system block)."""
        ...

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None, *, generation: bool, **extra: Any) -> str:
        """The conversation as prompt text; ``generation`` appends the assistant's turn opener."""
        ...


class TapeModel(Protocol):
    """A loaded model whose one KV follows ``res.tokens``: what ``TapeSession`` drives.

    Invariant: after every call returns (or raises), ``res.tokens`` equals the
    tokens whose K/V the engine holds. ``epoch`` is bumped by every operation
    that changes the KV, so an abandoned decode stream can tell it lost the KV.
    """

    backend_name: ClassVar[str]
    res: Resident
    config: Config
    epoch: int
    closed: bool
    session_gen: int
    view_holder: TapeSession | None
    template: ChatTemplate | None
    #: the family replies' tool calls are parsed and forced in (``backends.tape.toolformats``)
    tool_format: ToolFormat
    #: the workspace cache the daemon gave the model (None: none)
    cache: StateCache | None
    #: the concept readouts a prefill may ask for (``serve --readouts``; None: none)
    readouts: Readouts | None
    #: the prompts this model prefilled (``backends.tape.miss``): a later miss on one of them is an eviction
    seen: SeenPrompts
    #: decode passes speculate (prompt lookup) unless their DecodeConfig says otherwise
    speculative: bool
    #: the engine computes every row as a one-token step does, alone or in any batch
    rows_exact: bool
    #: the seconds ``tokenize`` spent since the load (an operation's share is the difference across it)
    tokenize_s: float
    #: what a draft's check costs on this model, in plain steps (measured once, then fixed)
    draft_costs: CheckCosts
    #: draft tokens checked and kept by every decode pass since the load (``speculation``)
    drafts: SpeculationStats
    #: decodes finished since the workspace cache last swapped a tape for another (``turn_ended``)
    turns_since_switch: int
    #: the model's image encoder (``backends.tape.images``; None: the model reads text only)
    image_encoder: ImageEncoder | None

    @property
    def digest(self) -> str: ...

    @property
    def num_ctx(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def engine_version(self) -> str: ...

    def reuse_identity(self) -> dict[str, Any]: ...

    def cost_identity(self) -> dict[str, Any]: ...

    def layout_digest(self) -> str: ...

    def errors(self, action: str) -> AbstractContextManager[None]:
        """The engine's one translation of foreign exceptions into contract errors."""
        ...

    def tokenize(self, text: str, *, bos_policy: str | None = None) -> list[int]:
        """Tokens of rendered text (special tokens parsed); BOS per policy when given, never doubled."""
        ...

    def prompt_text(self, tokens: list[int]) -> str:
        """Tokens as text, special tokens included."""
        ...

    def token_bytes(self, tokens: list[int]) -> list[bytes]:
        """Each token's bytes (special tokens as their text), as the tokenizer spells them."""
        ...

    def marker_pieces(self, markers: frozenset[str]) -> dict[int, bytes]:
        """Control tokens whose text is one of ``markers``, with that text: a decode feeds them to the
        parser as text (a control token is otherwise no text at all)."""
        ...

    def reusable(self, n: int) -> int:
        """How many of ``n`` matching resident tokens the engine can keep exactly (<= n)."""
        ...

    def check_rows(self, n: int) -> int:
        """The row count a batch of ``n`` tokens checked at once really runs with (>= n)."""
        ...

    def set_kv(self, tokens: list[int], keep: int, rows: RowsFn | None = None, states: StatesFn | None = None) -> int:
        """Make the KV hold ``tokens``, keeping the first ``keep``; returns how many were kept. With ``rows``,
        every computed position's logits go to it, chunk by chunk (prefill-only scoring); with ``states``, every
        computed position's concept readouts (the model's ``readouts`` manifest)."""
        ...

    def clear_kv(self) -> None: ...

    def decode_steps(self, cfg: DecodeConfig) -> DecodeSteps:
        """Sampler, constraint and stepping for one decode pass (bad settings raise before anything runs)."""
        ...

    def export_state(self) -> tuple[bytes, str]:
        """The KV as state bytes and their ``state_kind``."""
        ...

    def import_state(self, snap: SessionSnapshot, *, backup: bool = True) -> None:
        """Replace the KV with a snapshot already checked by ``Resident.validate_snapshot``.

        Refuses (SnapshotRejected) before touching the KV when the bytes do not
        fit this engine; on a refusal after that, the KV is left unchanged (when
        the engine keeps a ``backup`` to put back) or cleared.
        """
        ...

    def turn_ended(self) -> None:
        """A decode finished (``TapeModelBase.turn_ended``)."""
        ...

    def drop_idle_save(self) -> None:
        """An operation began on a session: the finished turn's save (if any) is not the tape's any more."""
        ...


# --- rules both engines follow ----------------------------------------------------------------------
def check_digest(path: str, expected: str, actual: str) -> None:
    """Refuse a model file whose content digest is not the one the request names."""
    if expected and expected != actual:
        raise ModelLoadFailed(
            f"{path} has digest {actual}, the request expects {expected}",
            path=path,
            expected=expected,
            actual=actual,
        )


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


#: how tools reach a model whose template does not render them: a system block in the Hermes form,
#: the call syntax ``backends.tape.output`` parses back (and the history fallback writes calls in)
GENERIC_TOOLS_HEADER = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request. "
    "The functions you can call are described by the JSON Schemas inside <tools></tools>:\n<tools>"
)
GENERIC_TOOLS_FOOTER = (
    "</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
)


def generic_tools_text(tools: list[Any], fmt: ToolFormat | None = None) -> str:
    """The tool block a template without tool support gets in its system turn (one JSON line per tool), its
    call syntax the model's family's (``fmt``; Hermes's by default)."""
    lines = [json.dumps(tool, ensure_ascii=False) for tool in tools]
    footer = GENERIC_TOOLS_FOOTER
    if fmt is not None and fmt.name != "hermes":
        footer = "</tools>\n\nTo call a function, answer in this form, one call at a time:\n" + fmt.example
    return "\n".join([GENERIC_TOOLS_HEADER, *lines, footer])


def with_tools(
    template: ChatTemplate, system: str, tools: list[Any] | None, fmt: ToolFormat | None = None
) -> tuple[str, list[Any] | None]:
    """The system text and the tools to hand ``template``: its own rendering when it renders tools, else
    the generic block appended to the system text (tools are never dropped)."""
    if not tools or template.supports_tools:
        return system, tools
    block = generic_tools_text(tools, fmt)
    return (f"{system}\n\n{block}" if system else block), None


#: two user turns that part at their first character (``stable_text``)
_PROBE_TURNS = ("A", "B")


def stable_text(template: ChatTemplate, system: str, tools: list[Any] | None) -> str:
    """The text every conversation after this system turn begins with, through ``template``.

    That is the system turn rendered alone, for most templates. Some hold the system text back until a user
    turn comes (Gemma's merges it into the first user turn, Mistral Nemo's into the last): rendered alone it
    is missing, and the stable part is what two conversations that part at their user turn's first character
    share.
    """
    alone = template.render([{"role": "system", "content": system}], tools, generation=False)
    if not system.strip() or system.strip() in alone:
        return alone
    a, b = (template.render([{"role": "system", "content": system}, {"role": "user", "content": probe}], tools,
                            generation=True) for probe in _PROBE_TURNS)
    return os.path.commonprefix([a, b])


def render_prefix(template: ChatTemplate | None, text: str, tools: list[Any] | None, fmt: ToolFormat | None = None) -> str:
    """The stable prefix as prompt text: the system turn (and tools) through the model's template."""
    if template is None:
        if tools:
            raise UnsupportedFeature("the model has no chat template, so it cannot be given tools")
        return text
    system, tools = with_tools(template, text, tools, fmt)
    return stable_text(template, system, tools)


def model_format(template: ChatTemplate | None, requested: str) -> tuple[ToolFormat, str]:
    """The tool-call family a model is served with, and why: the one asked for, else the one its template
    writes calls in, else Hermes. A template that renders no tool list gets the tools in a generic block
    that teaches the same family's call syntax."""
    if requested:
        return require_format(requested), f"{require_format(requested).name} (asked for)"
    if template is None:
        return FORMATS["hermes"], ""
    found = detect_format(template.source)
    where = "" if template.supports_tools else "; the template renders no tool list: tools go in a generic block"
    if found.name == "hermes" and not template.supports_tools:
        return found, "hermes (the template renders no tools: they go in a generic block)"
    return found, f"{found.name} (detected from the template{where})"


#: what in a template's source says it renders the model's reasoning: Qwen3's and DeepSeek-R1's ``<think>``,
#: the ``enable_thinking`` switch, the ``reasoning_content`` field templates read a turn's reasoning from
REASONING_MARKS = (THINK_OPEN, "enable_thinking", "reasoning_content")


def model_capabilities(template: ChatTemplate | None, fmt: ToolFormat, *, vision: bool = False) -> list[str]:
    """What a chat model can be asked for (``contract.types.CAPABILITIES``), read from the model and its template,
    never declared: ``text`` always; ``vision`` with an image encoder; ``tools`` when the template renders a tool
    list itself (any model takes tools, in a generic block, but one whose template has none was not trained on
    them); ``reasoning`` when its tool format has reasoning channels or its template renders thinking."""
    caps = ["text"]
    if vision:
        caps.append("vision")
    if template is not None and template.supports_tools:
        caps.append("tools")
    if fmt.own_reasoning or (template is not None and any(m in template.source for m in REASONING_MARKS)):
        caps.append("reasoning")
    return caps


# --- the bookkeeping every engine shares ------------------------------------------------------------
#: ``TapeModelBase.tokenize`` keeps this many texts' tokens, of texts this long or longer (a shorter one costs less
#: to tokenize than to look up)
TOKENIZED_KEPT = 8
TOKENIZED_MIN_CHARS = 512


class TapeModelBase(ABC):
    """Identity, session generations, epochs, BOS policy and closing, for a ``TapeModel``.

    A subclass sets ``backend_name``, calls ``__init__`` once its engine is
    ready, and implements the abstract methods: the engine half of ``TapeModel``
    plus ``engine_version``, ``runtime_identity``, ``_encode`` and ``_release``.
    """

    backend_name: ClassVar[str] = ""

    def __init__(
        self,
        *,
        path: str,
        digest: str,
        config: Config,
        num_ctx: int,
        resident_bytes: int,
        template: ChatTemplate | None,
        bos_id: int,
        adds_bos: bool,
    ) -> None:
        self.path = path
        self._digest = digest
        self.config = config
        self._num_ctx = num_ctx
        self._resident_bytes = resident_bytes
        self.template = template
        self.bos_id = bos_id
        self._adds_bos = adds_bos
        self.res = Resident(num_ctx=num_ctx)
        #: bumped by every operation that changes the KV; an abandoned decode stream
        #: compares it before touching the KV again
        self.epoch = 0
        #: the generation of the newest session; older session handles are closed
        self.session_gen = 0
        #: the session whose context ``res`` is: the newest one, or one of its forks (``TapeSession.fork``)
        self.view_holder: TapeSession | None = None
        self.closed = False
        #: the tape's first ``exact_len`` tokens were computed by prefill (not by one-token
        #: decode steps), so they hold exactly what a cold prefill computes; engines keep it
        self.exact_len = 0
        #: texts tokenized lately and their tokens, the newest last (``tokenize``); the seconds ``tokenize`` took in
        #: all (an operation's share is the difference across it)
        self._tokenized: OrderedDict[str, list[int]] = OrderedDict()
        self.tokenize_s = 0.0
        #: the workspace cache (``backends.tape.cache``); the backend sets it after the load
        self.cache: StateCache | None = None
        #: the readout manifest (``backends.readouts``); the engine reads its layers' outputs when a prefill asks
        self.readouts: Readouts | None = None
        #: fingerprints of the prompts this model prefilled: a miss on one of them is an eviction (``.miss``)
        self.seen = SHARED_SEEN
        #: the daemon's default for ``DecodeConfig.speculative`` (``backends.tape.speculate``)
        self.speculative = True
        #: kept from an earlier load, or measured while the slot is idle (``backends.tape.draft_costs``), when it
        #: speculates; the prior until then
        self.draft_costs = CheckCosts.prior()
        self.draft_costs_measured = False
        #: no table is kept for this model and machine: ``idle_work`` measures one
        self.costs_pending = False
        #: decodes finished since the workspace cache last swapped a tape for another (restored one, or saved
        #: one before discarding it); while that is recent, a finished turn's tape is saved in the next idle
        #: moment (``save_pending``), so the next switch finds it saved and only restores
        self.turns_since_switch = SWITCHING_TURNS + 1
        self.save_pending = False
        #: draft tokens checked and kept by every decode pass since the load
        self.drafts = SpeculationStats()
        #: the engine's kernels compute a token's row the same alone, in a draft's check or in a
        #: prefill of any split (a backend sets it for a layout where they do): drafts then never
        #: change an answer, sampled ones included, and decoded tokens hold what a prefill computes
        self.rows_exact = False
        #: what the load measured of ``rows_exact``, for ``status`` ("" where nothing was probed)
        self.rows_probe = ""
        #: the GGUF's layout (``layout_digest``), set by the backend before the draft costs; "": the digest
        self.layout = ""
        self._sampling: SamplingParams | None = None
        #: the family replies' tool calls are parsed and forced in, and why (``status``)
        self.tool_format, self.tool_format_origin = model_format(template, config.tool_format)
        #: what the model can be asked for (``model_capabilities``): ``status``, ``/v1/models``, ``describe``
        self.capabilities = model_capabilities(template, self.tool_format)
        self._marker_ids: dict[frozenset[str], dict[int, bytes]] = {}
        #: an engine with an image encoder sets it (and "vision" in ``capabilities``)
        self.image_encoder: ImageEncoder | None = None

    # --- identity ---------------------------------------------------------------------------
    @property
    def digest(self) -> str:
        return self._digest

    @property
    def num_ctx(self) -> int:
        return self._num_ctx

    @abstractmethod
    def engine_version(self) -> str:
        """The engine library's version (part of the manifest identity)."""

    @abstractmethod
    def runtime_identity(self) -> dict[str, Any]:
        """The settings that change numerics (and so KV reuse and snapshot validity)."""

    def reuse_identity(self) -> dict[str, Any]:
        """``runtime_identity`` plus the reuse rule: KV computed under one is never reused under the other."""
        return self.runtime_identity() | {"exact_reuse": self.config.exact_reuse}

    def cost_identity(self) -> dict[str, Any]:
        """Settings that change what a draft's check costs but not its numbers (none by default): part of
        the key a measured cost table is kept under (``backends.tape.draft_costs``)."""
        return {}

    def layout_digest(self) -> str:
        """What the model computes per token, not with which values (the key a cost table is kept under):
        ``layout`` where the backend read it from the GGUF (``gguf_layout_digest``), else the model's digest.
        Files that differ only in weights' values or in metadata (another chat template) cost the same to
        run and share one measurement."""
        return self.layout or self.digest

    def decode_format(self, cfg: DecodeConfig) -> ToolFormat:
        """The tool-call family a decode forces calls in: the one its parser protocols name, else the model's."""
        _, named = resolve_protocols(cfg.parser_protocols, cfg.reasoning_format or self.config.reasoning_format,
                                     has_tools=True, model_format=self.tool_format)
        return named or self.tool_format

    def marker_pieces(self, markers: frozenset[str]) -> dict[int, bytes]:
        hit = self._marker_ids.get(markers)
        if hit is None:
            hit = {}
            for marker in markers:
                ids = self.tokenize(marker)
                if len(ids) == 1 and self.token_bytes(ids) == [marker.encode()]:
                    hit[ids[0]] = marker.encode()
            self._marker_ids[markers] = hit
        return hit

    def is_control(self, token: int) -> bool:
        """Whether ``token`` is a control token (none by default; the engines read their vocabulary's types)."""
        return False

    def forced_markers(self, fmt: ToolFormat) -> dict[str, int]:
        """``fmt``'s markers that this vocabulary has as one control token, with its id.

        A forced call's grammar writes these as the token (``toolformats.marker_split``): a grammar literal
        would let the decode spell the marker in text tokens (llguidance allows nothing else), which the
        next prompt, rendered and tokenized, holds as the one control token, so reuse would stop there.
        """
        found = self.marker_pieces(frozenset(fmt.markers))
        return {text.decode(): token for token, text in found.items() if self.is_control(token)}

    def reusable(self, n: int) -> int:
        """How many of ``n`` matching resident tokens are kept.

        All of them by default, tokens the model decoded included (as every serving
        engine does; a decode step's KV differs slightly in numerics from a batched
        prefill's). With ``Config.exact_reuse`` only the prefilled ones, so decoded
        tokens are recomputed and a warm turn answers bit for bit like a cold one —
        unless the engine's rows are exact (``rows_exact``): a decoded token's KV is
        then what a prefill computes, and recomputing it would change nothing.
        """
        n = min(n, self.exact_len) if self.config.exact_reuse and not self.rows_exact else n
        return block_start(self.res.tokens, n)  # never half an image's block (``images``)

    def check_rows(self, n: int) -> int:
        """``n``: an engine that pads checks to compiled shapes says so here."""
        return n

    def turn_ended(self) -> None:
        """A decode finished with the tape holding its prompt and reply: while the slot is switching between
        conversations, that tape is saved in the next idle moment (an agent runs its tools between turns), not
        on the next switch's clock. Any operation on the session cancels the save (``drop_idle_save``)."""
        self.turns_since_switch += 1
        self.save_pending = self.cache is not None and self.turns_since_switch <= SWITCHING_TURNS

    def drop_idle_save(self) -> None:
        self.save_pending = False

    def idle_pending(self) -> bool:
        """Whether ``idle_work`` has something to do now: a finished turn's tape to save (``turn_ended``), or
        the draft costs are unmeasured and nothing is resident (the measurement prefills a throwaway context,
        which would evict a tape)."""
        if self.closed:
            return False
        return self.save_pending or (self.costs_pending and not self.res.tokens)

    def idle_work(self) -> None:
        """Save a finished turn's tape into the workspace cache (one copy of the state, not interrupted), or
        measure the draft check costs (``draft_costs.measure_costs``), run by the daemon while the slot is
        idle, inside an ``interrupt.interruptible`` scope that a request's arrival sets: then it raises
        ``Cancelled`` with the KV cleared and stays pending, for the next idle moment with nothing resident."""
        if self.save_pending:
            self.save_pending = False
            save_tape(self)
            return
        if not self.idle_pending():
            return
        try:
            with self.errors("draft cost timing"):
                measured = cost_tables.measure_costs(self, cost_tables.table_dir())
        except Cancelled:
            raise  # still pending
        except BaseException:
            self.costs_pending = False  # a failure is not retried at every idle moment (the next load times them)
            raise
        self.costs_pending = False
        if measured is not None:
            self.draft_costs, self.draft_costs_measured = measured, True

    def speculation(self) -> SpeculationStatus:
        """How this model drafts: the daemon's default, the check costs its drafts are priced by, and
        the draft tokens kept so far (``DaemonStatus.speculation``)."""
        costs = self.draft_costs
        return SpeculationStatus(
            enabled=self.speculative,
            measured=self.draft_costs_measured,
            pending=self.costs_pending,
            check_costs={str(rows): round(costs.cost(rows), 2) for rows in STATUS_CHECK_ROWS},
            check_growth_per_1k=round(costs.growth()[MAX_DRAFT], 2),
            drafted_tokens=self.drafts.drafted,
            accepted_tokens=self.drafts.accepted,
            rows_exact=self.rows_exact,
            rows_probe=self.rows_probe,
        )

    def sampling_defaults(self) -> SamplingParams:
        """The sampling the model's GGUF recommends (``general.sampling.*``), else the documented defaults."""
        if self._sampling is None:
            from ..gguf_file import gguf_scalars, is_gguf, recommended_sampling

            found: dict[str, float | int] = {}
            path = Path(self.path)
            if path.is_file() and is_gguf(path):
                try:
                    found = recommended_sampling(gguf_scalars(path))
                except (OSError, ValueError):
                    found = {}
            if found:
                self._sampling = DEFAULT_SAMPLING.model_copy(update={**found, "source": "model"})
            else:
                self._sampling = DEFAULT_SAMPLING
        return self._sampling

    def manifest_defaults(self) -> ContextManifest:
        """The identity a client puts in its ContextManifest for this model."""
        tpl = self.template
        return ContextManifest(
            backend=self.backend_name,
            backend_version=self.engine_version(),
            model_digest=self._digest,
            prompt_format=tpl.prompt_format if tpl is not None else "raw",
            template_digest=tpl.digest if tpl is not None else "",
            runtime_digest=canonical_digest(self.reuse_identity()),
            bos_policy="add" if self.wants_bos("") else "none",
        )

    def warm_up(self) -> None:
        """Run what the first request would otherwise wait for (``loading.finish_load`` calls it); nothing here."""
        return None

    def check_declared_template(self) -> None:
        """Refuse a load whose profile declares another chat template than the model's."""
        declared = self.config.prompt_template_digest
        actual = self.template.digest if self.template is not None else ""
        if declared and declared != actual:
            raise ModelLoadFailed(
                f"the profile declares template {declared} but the model's chat template is {actual or 'absent'}",
                declared=declared,
                actual=actual,
            )

    # --- tokens -----------------------------------------------------------------------------
    def wants_bos(self, policy: str) -> bool:
        return wants_bos(policy, disabled=self.config.disable_bos, model_default=self._adds_bos)

    @abstractmethod
    def _encode(self, text: str) -> list[int]:
        """Tokens of rendered text with special tokens parsed and no BOS added."""

    def tokenize(self, text: str, *, bos_policy: str | None = None) -> list[int]:
        """Tokens of rendered text (special tokens parsed); BOS per policy when given, never doubled.

        A text tokenized lately is not tokenized again (``TOKENIZED_KEPT`` texts of ``TOKENIZED_MIN_CHARS`` or
        more are kept): a warm request renders the same stable prefix every turn, and counts its prompt before it
        prefills it, so most of what it tokenizes was tokenized before, with the same result."""
        t0 = time.perf_counter()
        tokens = self._encode_kept(text) if text else []
        self.tokenize_s += time.perf_counter() - t0
        return with_bos(tokens, self.bos_id, bos_policy is not None and self.wants_bos(bos_policy))

    def _encode_kept(self, text: str) -> list[int]:
        if len(text) < TOKENIZED_MIN_CHARS:
            return self._encode(text)
        kept = self._tokenized.get(text)
        if kept is not None:
            self._tokenized.move_to_end(text)
            return list(kept)
        tokens = self._encode(text)
        self._tokenized[text] = list(tokens)
        while len(self._tokenized) > TOKENIZED_KEPT:
            self._tokenized.popitem(last=False)
        return tokens

    # --- lifecycle --------------------------------------------------------------------------
    @property
    def lanes(self) -> int:
        """One: the model's one KV (``backends.lanes`` puts several models side by side)."""
        return 1

    def open_session(self, lane: int = 0) -> TapeSession:
        """A session over the model's KV; it retires every older session handle."""
        from .session import TapeSession

        check_lane(lane, 1)
        if self.closed:
            raise SessionClosed("model was unloaded")
        self.session_gen += 1
        self.epoch += 1  # an open stream of an older session must not touch the KV
        self.view_holder = TapeSession(self, self.session_gen)
        return self.view_holder

    def resident_bytes(self) -> int:
        """Weights, KV and scratch of this model (precomputed: other threads read it)."""
        return 0 if self.closed else self._resident_bytes

    @abstractmethod
    def _release(self) -> None:
        """Free the engine's objects (called once, by ``close``)."""

    def close(self) -> None:
        if self.closed:
            return
        save_tape(self)  # an unload or a stop keeps the tape in the workspace cache
        self.closed = True
        self.epoch += 1
        self.res.clear()
        self._release()

    # --- the engine half of TapeModel ---------------------------------------------------------
    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def errors(self, action: str) -> AbstractContextManager[None]: ...

    @abstractmethod
    def prompt_text(self, tokens: list[int]) -> str: ...

    @abstractmethod
    def token_bytes(self, tokens: list[int]) -> list[bytes]: ...

    @abstractmethod
    def set_kv(self, tokens: list[int], keep: int, rows: RowsFn | None = None, states: StatesFn | None = None) -> int: ...

    @abstractmethod
    def clear_kv(self) -> None: ...

    @abstractmethod
    def decode_steps(self, cfg: DecodeConfig) -> DecodeSteps: ...

    @abstractmethod
    def export_state(self) -> tuple[bytes, str]: ...

    @abstractmethod
    def import_state(self, snap: SessionSnapshot, *, backup: bool = True) -> None: ...
