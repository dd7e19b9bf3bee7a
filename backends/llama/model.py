"""The llama.cpp engine: a model resident in llama-cpp-python with one persistent KV.

One ``llama_cpp.Llama`` holds the model and one context whose KV (sequence 0) is
the session's resident context; a ``backends.resident.Resident`` keeps the token
tape, and the invariant is ``Resident.tokens == llm.input_ids[:llm.n_tokens] ==``
the tokens in the KV. Reuse is the manifest gate then the token LCP; only the tail
is prefilled, and every sampled token is evaluated into the KV. The llama.cpp
behaviour this works around (logits valid only after a decode, ``eval`` dropping
cells, per-sequence state without logits): ``docs/engines.md``.

Threading: the daemon calls everything from one worker thread; only
``resident_bytes()`` and ``explain_context()`` may run on another thread, and
they read plain attributes.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import jinja2
import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from contract import interrupt
from contract.errors import Internal, InvalidArgument, SnapshotRejected, UnsupportedFeature
from contract.sizing import ModelShape, kv_bytes_per_token
from contract.types import Config, DecodeConfig, SessionSnapshot

from ..image_tokens import inside_block, is_image_token
from ..readouts import Readouts
from ..tape.decoding import DecodeSteps
from ..tape.model import RowsFn, StatesFn, TapeModelBase, model_capabilities
from ..tape.state import refuse_diffs, state_buffer, unpack_state
from ..tape.templates import check_renders, choose_template, render_defaults, renders_tools
from . import probe
from .native import KV_GGML_TYPES, LayerTap, map_errors, runtime_version
from .options import LoadOptions
from .sampling import LlamaSteps, build_sampler, grammar_source
from .vision import LlamaVision

__all__ = ["BACKEND_NAME", "LlamaLoadedModel", "LlamaTemplate", "VocabTokens", "model_template", "token_piece"]

BACKEND_NAME = "llama"
STATE_MAGIC = b"MODELD-LLAMA-KV1"


# --- the chat template ---------------------------------------------------------------------
class LlamaTemplate:
    """The model's own Jinja template, rendered the way HF/llama-cpp-python do."""

    def __init__(self, template: str, eos_token: str, bos_token: str) -> None:
        self.source = template
        self.digest = "sha256:" + hashlib.sha256(template.encode("utf-8")).hexdigest()
        self.prompt_format = "chatml" if "<|im_start|>" in template else "jinja"
        self._plain = Jinja2ChatFormatter(template, eos_token, bos_token, add_generation_prompt=False)
        self._gen = Jinja2ChatFormatter(template, eos_token, bos_token, add_generation_prompt=True)
        self._defaults = render_defaults(template)
        self.supports_tools = renders_tools(self)

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None, *, generation: bool, **extra: Any) -> str:
        fmt = self._gen if generation else self._plain
        return str(fmt(messages=messages, tools=tools, **{**self._defaults, **extra}).prompt)  # type: ignore[arg-type]


def model_template(llm: Llama, requested: tuple[str, str] | None) -> tuple[LlamaTemplate, str]:
    """The template a model loaded in ``llm`` (its vocabulary at least) serves with, and where it comes from: the
    one asked for (``templates.choose_template``), else the GGUF's own. InvalidArgument for one that does not
    compile or, asked for, does not render."""
    own = llm.metadata.get("tokenizer.chat_template", "")
    source, origin = choose_template(
        requested, own, lambda text: len(llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)) == 1)
    bos_id = int(llm.token_bos())
    eos = llm._model.token_get_text(llm.token_eos()) if llm.token_eos() != -1 else ""
    bos = llm._model.token_get_text(bos_id) if bos_id != -1 else ""
    try:
        template = LlamaTemplate(source, eos, bos)
    except jinja2.TemplateError as exc:
        raise InvalidArgument(f"the chat template ({origin}) does not compile: {exc}", chat_template=origin) from None
    if source != own:
        check_renders(template, origin)
    return template, origin


def token_piece(vocab: Any, token: int, *, special: bool = False) -> bytes:
    """A token's bytes as llama.cpp's vocabulary spells them (control tokens as their text with ``special``)."""
    if is_image_token(token):
        return b""  # an image's position (``backends.tape.images``): no text
    # Llama.detokenize uses a 32-byte buffer and silently truncates longer pieces.
    size = 64
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, size, 0, special)
        if n >= 0:
            return buf.raw[:n]
        size = -n


class VocabTokens:
    """Tokens through llama.cpp's vocabulary: what every engine that reads a GGUF's tokenizer shares (the
    class sets ``_llm``, a ``Llama`` with the model's vocabulary at least, and ``_vocab``, its vocabulary)."""

    _llm: Llama
    _vocab: Any

    def _encode(self, text: str) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    def prompt_text(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(tokens)).decode("utf-8", "replace")

    def token_bytes(self, tokens: list[int]) -> list[bytes]:
        return [self.piece(t, special=True) for t in tokens]

    def piece(self, token: int, *, special: bool = False) -> bytes:
        return token_piece(self._vocab, token, special=special)

    def is_control(self, token: int) -> bool:
        return not is_image_token(token) and bool(llama_cpp.llama_vocab_is_control(self._vocab, token))

    def is_eog(self, token: int) -> bool:
        return not is_image_token(token) and bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))


# --- the loaded model -------------------------------------------------------------------------
class LlamaLoadedModel(VocabTokens, TapeModelBase):
    """A model resident in llama.cpp with its one persistent KV (what the slot holds).

    Build it with ``LlamaBackend.load``. Sessions opened on it share the KV; a new
    session makes older session handles closed, since there is one KV to drive.
    """

    backend_name = BACKEND_NAME

    def __init__(self, llm: Llama, *, path: str, digest: str, shape: ModelShape, options: LoadOptions, config: Config,
                 requested_template: tuple[str, str] | None = None, tap: LayerTap | None = None,
                 readouts: Readouts | None = None, vision: LlamaVision | None = None,
                 mmproj_digest: str = "") -> None:
        self._llm = llm
        self.shape = shape
        self.options = options
        self._vocab = llm._model.vocab
        self._n_vocab = int(llm.n_vocab())
        bos_id = int(llm.token_bos())
        template, self.template_origin = model_template(llm, requested_template)
        kv_per_token = kv_bytes_per_token(shape.facts(kv_cache_type=options.kv_cache_type))
        super().__init__(
            path=path,
            digest=digest,
            config=config,
            num_ctx=options.num_ctx,
            resident_bytes=shape.weights_bytes + kv_per_token * options.num_ctx + (vision.bytes if vision else 0),
            template=template,
            bos_id=bos_id,
            adds_bos=bool(llama_cpp.llama_vocab_get_add_bos(self._vocab)),
        )
        #: set by ``probe_rows`` (the load calls it): the layout alone does not make rows exact
        self.rows_exact = False
        #: what the load's rows probe measured (None: the layout cannot be exact, nothing probed)
        self.probe: probe.RowsProbe | None = None
        #: the logits buffer holds the distribution after the last resident token
        self.logits_live = False
        #: the readout layers' tap (``native.LayerTap``; the backend builds the context with it when readouts are
        #: served) and the manifest it serves
        self.tap: LayerTap | None = tap
        self.readouts = readouts
        #: set while a prefill runs inside contract.interrupt.interruptible(...)
        self._abort_event: threading.Event | None = None
        # llama.cpp polls this between graph nodes; the reference keeps ctypes' thunk alive
        self._abort_cb = llama_cpp.ggml_abort_callback(self._should_abort)
        #: the image encoder (``serve --mmproj``), and the digest of its file (part of the reuse identity)
        self.vision = self.image_encoder = vision
        self._mmproj_digest = mmproj_digest
        if vision is not None:
            self.capabilities = model_capabilities(self.template, self.tool_format, vision=True)

    def _should_abort(self, _data: Any) -> bool:
        # called between graph nodes: a long prefill is visibly alive, and its progress is the
        # batches eval has finished (it advances n_tokens after each)
        interrupt.prefilled(self._llm.n_tokens)
        event = self._abort_event
        return event is not None and event.is_set()

    @property
    def llm(self) -> Llama:
        return self._llm

    def probe_rows(self) -> None:
        """Measure whether this model's rows are exact on this CPU, and set ``rows_exact`` from that.

        Runs at load, with nothing resident, in the layout that can be exact (``LoadOptions.exact_layout``;
        in any other nothing is probed and rows are not exact): a few tokens alone, in a check and in a
        prefill, compared bit for bit (``backends.llama.probe``), then the KV emptied again. Where they
        part and the load asked for exact decode, the load is refused: exact decode promises that drafts
        and reuse never change an answer, and serving without that promise kept would hand the client
        answers it asked to be guaranteed with nothing to tell them apart. Without exact decode the model
        serves with ``rows_exact`` False (sampled passes do not draft by default, ``exact_reuse``
        recomputes decoded tokens) and ``status`` says what the probe measured.
        """
        if not self.options.exact_layout:
            return
        n = min(probe.PREFILL_TOKENS, self.options.num_ctx, self.options.num_batch)
        bos = self.bos_id if self._adds_bos and self.bos_id >= 0 else None
        tokens = probe.probe_tokens(self._encode(probe.PROBE_TEXT), bos, n)
        result = probe.measure(self._llm, tokens)
        self.probe = result
        self.rows_probe = result.describe()
        self.rows_exact = result.exact
        if not result.exact and self.config.exact_decode:
            raise UnsupportedFeature(
                f"exact_decode: {self.path} does not compute a token's row the same alone and in a batch on this "
                f"CPU with llama.cpp's kernels (its load's probe: {result.describe()}), so drafts and reuse could "
                "change answers; serve it without --exact-decode (greedy decodes still draft, sampled ones do not, "
                "and --exact-reuse keeps warm turns answering like cold ones), or use another quantization of "
                "the model or another engine",
                model=self.path,
                max_abs_diff=result.max_diff,
                parted=list(result.parted),
                probe_ms=round(result.ms, 1),
            )

    # --- TapeModelBase ------------------------------------------------------------------
    def engine_version(self) -> str:
        return runtime_version()

    def runtime_identity(self) -> dict[str, Any]:
        own = self.options.runtime_identity()
        return own | {"mmproj": self._mmproj_digest} if self._mmproj_digest else own

    def cost_identity(self) -> dict[str, Any]:
        """The thread count: it changes what a step and a check cost, not their numbers."""
        return {"n_threads": self.options.num_threads}

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    def errors(self, action: str) -> AbstractContextManager[None]:
        return map_errors(action)

    def _release(self) -> None:
        if self.vision is not None:
            self.vision.close()
        self._llm.close()

    def decode_steps(self, cfg: DecodeConfig) -> DecodeSteps:
        fmt = self.decode_format(cfg)
        so = cfg.structured_output
        markers = self.forced_markers(fmt) if so.tool_call else {}
        return LlamaSteps(self, build_sampler(self, cfg, grammar_source(so, fmt, markers)))

    # --- tokens and the KV ----------------------------------------------------------------
    def set_kv(self, tokens: list[int], keep: int, rows: RowsFn | None = None, states: StatesFn | None = None) -> int:
        """Make the KV hold ``tokens``, reusing the first ``keep`` resident ones.

        Returns how many were actually reused (0 when the memory cannot drop a
        tail, e.g. recurrent models). Updates the tape; on failure the KV and the
        tape are left equal to whatever prefix was computed, and the error raised.
        With ``rows``, each batch's logits go to it, every row of it; with ``states``, each batch's readouts.
        """
        llm = self._llm
        self.epoch += 1
        keep = min(keep, len(tokens), len(self.res.tokens), llm.n_tokens)
        if not llm._ctx.kv_cache_seq_rm(0, keep, -1):
            llm._ctx.kv_cache_seq_rm(0, 0, -1)
            keep = 0
        llm.n_tokens = keep
        self.res.tokens = list(tokens[:keep])
        self.logits_live = False
        extends_exact = self.exact_len >= keep
        self.exact_len = min(self.exact_len, keep)
        try:
            if keep < len(tokens):
                with self._abortable():
                    # batch by batch, as eval would batch the whole tail (the same batches, so the same
                    # numerics), each one a point where a cancel stops and what came before stays; an image's
                    # block is computed whole by its encoder, text batches end where one starts
                    a = keep
                    while a < len(tokens):
                        interrupt.check("prefill")
                        if is_image_token(tokens[a]):
                            a = self._eval_image(tokens, a, rows is not None or states is not None)
                        else:
                            end = min(a + llm.n_batch, len(tokens))
                            end = next((i for i in range(a, end) if is_image_token(tokens[i])), end)
                            if rows is None and states is None:
                                llm.eval(tokens[a:end])
                            else:
                                self._eval_rows(tokens[a:end], rows, states)
                            a = end
                        interrupt.chunk_done(llm.n_tokens)
                self.logits_live = True
        finally:
            # eval advances n_tokens per completed batch; keep the tape equal to it
            self.res.tokens = list(tokens[: llm.n_tokens])
            if extends_exact:
                self.exact_len = len(self.res.tokens)
        return keep

    def _eval_image(self, tokens: list[int], a: int, scored: bool) -> int:
        """The image block whose embeddings start at ``tokens[a]`` computed into the KV; the position after it. A
        failure (a cancel's abort among them) drops whatever of the block reached the KV: half a block is never
        kept."""
        llm = self._llm
        end = a + 1
        while inside_block(tokens, end):
            end += 1
        if self.vision is None:
            raise Internal("an image block is on the tape of a model without an image encoder")
        if scored:
            raise UnsupportedFeature("scores and readouts are of text: this prompt's scored part holds an image")
        if llm.n_tokens != a:
            raise Internal(f"the KV holds {llm.n_tokens} tokens where an image block starts at {a}")
        try:
            after = self.vision.evaluate(tokens[a], a, llm.n_batch, logits_last=end == len(tokens))
        except RuntimeError:
            llm._ctx.kv_cache_seq_rm(0, a, -1)
            interrupt.check("prefill")  # an abort was a cancel: say so as one
            raise
        if after != end:
            llm._ctx.kv_cache_seq_rm(0, a, -1)
            raise Internal(f"the image encoder took positions {a}..{after}, its block on the tape {a}..{end}")
        llm.input_ids[a:end] = tokens[a:end]
        llm.n_tokens = end
        return end

    def _eval_rows(self, batch: list[int], rows: RowsFn | None, states: StatesFn | None = None) -> None:
        """``Llama.eval`` of one batch with the logits of every row kept (as ``Llama(logits_all=True)`` evaluates),
        handed to ``rows``. Done here because a ``Llama`` built without ``logits_all`` keeps room for one batch of
        scores only, and this one model serves plain prefills too. With ``states`` the readout layers' outputs are
        taken while the batch runs (``native.LayerTap``; every row is an output, so the last layer keeps them
        all) and their readouts handed to it."""
        llm = self._llm
        n_past = llm.n_tokens
        tap, readouts = self.tap, self.readouts
        if states is not None and (tap is None or readouts is None):
            raise UnsupportedFeature("this model was loaded without a readout manifest (serve --readouts FILE)")
        llm._ctx.kv_cache_seq_rm(-1, n_past, -1)
        llm._batch.set_batch(batch=batch, n_past=n_past, logits_all=True)
        if tap is not None:
            tap.rows.clear()
            tap.active = states is not None
        try:
            llm._ctx.decode(llm._batch)
        finally:
            if tap is not None:
                tap.active = False
        llm.input_ids[n_past : n_past + len(batch)] = batch
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm._ctx.ctx), shape=(len(batch), self.vocab_size))
        llm.n_tokens += len(batch)
        if rows is not None:
            rows(n_past, logits)
        if states is not None:
            assert tap is not None and readouts is not None
            streams = tap.take(readouts.hidden_size)
            short = [layer for layer in readouts.layers if streams.get(layer, np.empty((0,))).shape[0] != len(batch)]
            if short:
                raise Internal(f"llama.cpp handed no full output of layers {short} for a batch of {len(batch)}")
            states(n_past, readouts.project(streams))

    @contextlib.contextmanager
    def _abortable(self) -> Iterator[None]:
        """Let an interrupt stop llama_decode mid-batch (it then returns 2).

        Installed for prefills only: llama.cpp calls the hook once per graph node,
        a Python call each time, which decode steps need not pay. An aborted batch
        leaves its finished ubatches in the KV past ``n_tokens``; the caller's
        rollback removes them.
        """
        event = interrupt.current()
        if event is None:
            yield
            return
        ctx = self._llm._ctx.ctx
        self._abort_event = event
        llama_cpp.llama_set_abort_callback(ctx, self._abort_cb, None)
        try:
            yield
        finally:
            llama_cpp.llama_set_abort_callback(ctx, llama_cpp.ggml_abort_callback(), None)
            self._abort_event = None

    def append(self, token: int) -> None:
        """Evaluate one sampled token into the KV and the tape."""
        self._llm.eval([token])
        self.res.tokens.append(token)
        self.logits_live = True

    def verify(self, tokens: list[int]) -> None:
        """Evaluate ``tokens`` in one batch with logits for every row (a speculative draft's check).

        ``Llama.eval`` asks llama.cpp for the last row's logits only, so the batch is
        built here with all of them; the sampler then reads row ``i`` by its index.
        """
        llm = self._llm
        n_past = llm.n_tokens
        llm._ctx.kv_cache_seq_rm(-1, n_past, -1)  # as eval does: nothing stale past the tape
        llm._batch.set_batch(batch=tokens, n_past=n_past, logits_all=True)
        llm._ctx.decode(llm._batch)
        llm.input_ids[n_past : n_past + len(tokens)] = tokens
        llm.n_tokens = n_past + len(tokens)
        self.res.tokens.extend(tokens)
        self.logits_live = True

    def rollback(self, n: int) -> None:
        """Drop the last ``n`` tokens from the KV and the tape (rejected draft tokens)."""
        if n <= 0:
            return
        llm = self._llm
        llm.n_tokens -= n
        llm._ctx.kv_cache_seq_rm(0, llm.n_tokens, -1)
        del self.res.tokens[-n:]
        self.logits_live = False  # the last row's logits belong to a dropped token

    def refresh_logits(self) -> None:
        """Decode the last resident token again so sampling sees live logits."""
        if self.logits_live or not self.res.tokens:
            return
        llm = self._llm
        last = self.res.tokens[-1]
        llm.n_tokens = len(self.res.tokens) - 1
        # the last cell is recomputed by a one-token step: no longer what a prefill computes
        self.exact_len = min(self.exact_len, llm.n_tokens)
        try:
            llm.eval([last])  # eval drops the old cell at that position first
        except BaseException:
            self.res.tokens = self.res.tokens[: llm.n_tokens]
            raise
        self.logits_live = True

    def clear_kv(self) -> None:
        self.epoch += 1
        with contextlib.suppress(Exception):
            self._llm._ctx.kv_cache_seq_rm(0, 0, -1)
        self._llm.n_tokens = 0
        self.logits_live = False
        self.exact_len = 0
        self.res.clear()

    # --- state bytes --------------------------------------------------------------------------
    def state_header(self) -> dict[str, Any]:
        return {
            "model_digest": self._digest,
            "type_k": KV_GGML_TYPES[self.options.kv_cache_type],
            "type_v": KV_GGML_TYPES[self.options.kv_cache_type],
            "flash_attn": self.options.flash_attn,
            "session_version": int(llama_cpp.LLAMA_SESSION_VERSION),
            "runtime": runtime_version(),
            "n_tokens": len(self.res.tokens),
        }

    def seq_state(self) -> bytes:
        ctx = self._llm.ctx
        size = int(llama_cpp.llama_state_seq_get_size(ctx, 0))
        buf = (ctypes.c_uint8 * max(size, 1))()
        n = int(llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0))
        return bytes(memoryview(buf)[:n])

    def set_seq_state(self, data: bytes, offset: int = 0) -> bool:
        """Replace sequence 0 with ``data[offset:]``; False when llama.cpp refuses it.

        llama.cpp only reads the bytes, so it is given a pointer into ``data``
        itself: a 2k-token state is ~50 MB, and a copy costs ~15 ms here.
        """
        size = len(data) - offset
        if size <= 0:
            return False
        self._llm._ctx.kv_cache_seq_rm(0, 0, -1)
        base = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
        assert base is not None
        src = ctypes.cast(base + offset, ctypes.POINTER(ctypes.c_uint8))
        n = int(llama_cpp.llama_state_seq_set_data(self._llm.ctx, src, size, 0))
        return n == size

    def kv_pos_max(self) -> int:
        mem = llama_cpp.llama_get_memory(self._llm.ctx)
        return int(llama_cpp.llama_memory_seq_pos_max(mem, 0))

    # --- snapshots ------------------------------------------------------------------------
    def export_state(self) -> tuple[bytes, str]:
        """Header + the per-sequence state, which llama.cpp writes straight into the framed buffer."""
        header = self.state_header() | {"exact_len": self.exact_len}
        ctx = self._llm.ctx
        size = int(llama_cpp.llama_state_seq_get_size(ctx, 0))
        out, start, address = state_buffer(STATE_MAGIC, header, size)
        n = 0
        if size:
            dst = ctypes.cast(address + start, ctypes.POINTER(ctypes.c_uint8))
            n = int(llama_cpp.llama_state_seq_get_data(ctx, dst, size, 0))
        if n < size:  # (llama.cpp wrote less than it sized: the bytes it wrote)
            return out[: start + n], "kv"
        return out, "kv"

    def import_state(self, snap: SessionSnapshot, *, backup: bool = True) -> None:
        if snap.state_kind != "kv":
            raise SnapshotRejected(f"state_kind {snap.state_kind!r} is not restorable by the llama backend")
        header, body = unpack_state(STATE_MAGIC, snap.state, "a llama.cpp KV snapshot of this backend")
        expected = self.state_header() | {"n_tokens": snap.resident_tokens}
        refuse_diffs(header, expected, "snapshot was taken under another runtime")
        offset = len(snap.state) - len(body)
        n = len(snap.resident_token_ids)
        with map_errors("restore"):
            # Everything above was checked without touching the KV. llama.cpp can still
            # refuse the bytes (returns 0), so keep the current state to put back.
            saved = self.seq_state() if backup else None
            self.epoch += 1
            self.logits_live = False  # state bytes carry no logits
            if not (self.set_seq_state(snap.state, offset) and self.kv_pos_max() == n - 1):
                if saved is not None and self.set_seq_state(saved) and self.kv_pos_max() == len(self.res.tokens) - 1:
                    raise SnapshotRejected("llama.cpp refused the state bytes; the session is unchanged")
                self.clear_kv()
                raise SnapshotRejected("llama.cpp refused the state bytes; the resident context was cleared")
            self._llm.input_ids[:n] = snap.resident_token_ids
            self._llm.n_tokens = n
            exact = header.get("exact_len", 0)
            self.exact_len = max(0, min(exact if isinstance(exact, int) else 0, n))
