"""The OpenVINO engine: an OpenVINO IR whose paged KV block pools we allocate and drive.

The stateful graph is rewritten to PagedAttention at load, its K/V pools are model
inputs owned here (block ``i`` holds positions ``[32i, 32i+32)``), and a
``backends.resident.Resident`` keeps the token tape equal to what the pools hold.
Prefill chunks run padded to shape buckets (compiled at load) so a warm turn
computes what a cold one does; ``Config.exact_decode`` pads decode steps too.
Sampling is numpy's, structured output is llguidance's (``guidance``), templates
are rendered by ``JinjaRenderer``. Why each of those, with the measurements:
``docs/engines.md``.

Over the house's ~400 lines: the model's seam (load, prefill, decode steps,
snapshots) shares one pool layout and one tape invariant, and split in two it
would hand both halves the same private state.

Threading: the daemon calls everything from one worker thread;
``resident_bytes()`` and ``explain_context()`` may run on another and only read
plain attributes.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import openvino as ov
import openvino_genai

from contract import interrupt
from contract.errors import (
    Cancelled,
    InvalidArgument,
    ModeldError,
    ModelLoadFailed,
    SnapshotRejected,
    UnsupportedFeature,
)
from contract.manifest import common_prefix_len
from contract.sizing import ModelShape
from contract.types import Config, DecodeConfig, SessionSnapshot

from ..tape.decoding import DecodeSteps
from ..tape.model import RowsFn, StatesFn, TapeModelBase
from ..tape.state import refuse_diffs, state_buffer, unpack_state
from ..tape.templates import JinjaTemplate, check_renders, choose_template
from .graph import (
    EXACT_STEP_ROWS,
    MIN_PREFILL_ROWS,
    VERIFY_ROWS,
    WARM_BUCKETS_UP_TO,
    bucket,
    readout_name,
    verify_rows,
)
from .guidance import TokenGuide, build_tokenizer, compile_grammar
from .native import map_errors, runtime_version, type_name
from .options import LoadOptions, overhead_bytes
from .sampling import OpenVINOSteps, Sampler

__all__ = ["BACKEND_NAME", "OpenVINOLoadedModel"]

BACKEND_NAME = "openvino"
STATE_MAGIC = b"MODELD-OV-PKV1\0\0"
#: how often a prefill chunk under way looks at its cancel (each look is a wait on the inference, no GIL held)
ABORT_POLL_MS = 20
#: token texts that end a turn in common chat vocabularies (llama.cpp treats them as EOG too)
_EOG_TEXTS = (b"<|endoftext|>", b"<|im_end|>", b"<|eot_id|>", b"<|eom_id|>", b"<|end|>", b"<end_of_turn>")


# --- the chat template -------------------------------------------------------------------------
def split_for_encoding(text: str, max_chars: int) -> list[str]:
    """``text`` in pieces of at most ``max_chars`` characters, cut after a newline between two non-space
    characters (else before a space that a non-space follows, else anywhere): a GPT-2-style pre-tokenizer
    never joins text across such a cut, so the pieces' tokens are the whole text's. Only a prompt longer
    than the tokenizer's own cut is split, so a cut elsewhere costs at most a token of the count."""
    pieces = []
    start = 0
    while len(text) - start > max_chars:
        end = start + max_chars
        cut = -1
        for sep in ("\n", " "):
            at = end
            while True:
                at = text.rfind(sep, start + 1, at)
                if at < 0:
                    break
                # before a word: a newline after a non-space character (a run of whitespace is one
                # pre-token at the end of a piece but may be two inside the text), or a space (the last
                # space of a run joins the word after it, in the text as in the piece)
                if at + 1 < len(text) and not text[at + 1].isspace() and (sep == " " or not text[at - 1].isspace()):
                    cut = at + 1 if sep == "\n" else at
                    break
            if cut > start:
                break
        if cut <= start:
            cut = end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


class _Vocab:
    """Token ids ↔ bytes and the special ids, from the IR tokenizer."""

    def __init__(self, tok: openvino_genai.Tokenizer) -> None:
        by_bytes = tok.get_vocab()
        self.size = int(max(by_bytes.values())) + 1
        pieces = [b""] * self.size
        for piece, tid in by_bytes.items():
            pieces[tid] = bytes(piece)
        # A special token decodes to "" only when special tokens are skipped; a lone
        # byte of a multi-byte character decodes to "" either way.
        ids = [[i] for i in range(self.size)]
        skipped = tok.decode(ids, skip_special_tokens=True)
        kept = tok.decode(ids, skip_special_tokens=False)
        self.special = frozenset(i for i in range(self.size) if skipped[i] == "" and kept[i] != "")
        #: what a generated token contributes to the text (control tokens contribute nothing)
        self.text_pieces = [b"" if i in self.special else p for i, p in enumerate(pieces)]
        self.pieces = pieces
        self.bos_id = int(tok.get_bos_token_id())
        self.eos_id = int(tok.get_eos_token_id())
        eog = {self.eos_id} if self.eos_id >= 0 else set()
        eog.update(i for i in self.special if pieces[i] in _EOG_TEXTS)
        self.eog = frozenset(eog)


# --- the loaded model -------------------------------------------------------------------------
class OpenVINOLoadedModel(TapeModelBase):
    """A model compiled on an OpenVINO device with its one persistent KV (what the slot holds).

    Build it with ``OpenVINOBackend.load``. Sessions opened on it share the KV; a
    new session makes older session handles closed, since there is one KV to drive.
    """

    backend_name = BACKEND_NAME

    def __init__(
        self,
        *,
        compiled: ov.CompiledModel,
        batch_compiled: ov.CompiledModel | None = None,
        tokenizer: openvino_genai.Tokenizer,
        ir: Path,
        digest: str,
        shape: ModelShape,
        options: LoadOptions,
        config: Config,
        device: str,
        requested_template: tuple[str, str] | None = None,
    ) -> None:
        self.ir = ir
        self.shape = shape
        self.options = options
        self.device = device
        #: decode steps run on ``compiled``; prefill chunks and draft checks on ``batch_compiled``
        #: when there is one (see "Two graphs" in docs/engines.md), else on the same request
        self._compiled = [compiled] if batch_compiled is None else [compiled, batch_compiled]
        #: their infer requests (one without a batch graph); each keeps the input shape it last ran
        self.step_req = compiled.create_infer_request()
        self.batch_req = self.step_req if batch_compiled is None else batch_compiled.create_infer_request()
        #: the batch graph's own compiled copy (counted in ``resident_bytes``; it changes a check's cost,
        #: not its numbers: both graphs compile the same kernels for a shape)
        self.batch_graph = batch_compiled is not None
        self.inference_precision = type_name(compiled.get_property("INFERENCE_PRECISION_HINT"))
        self._allocate_cache(compiled, options.num_ctx)
        self.tok = tokenizer
        self.vocab = _Vocab(tokenizer)
        own = str(tokenizer.chat_template or "")
        source, self.template_origin = choose_template(
            requested_template, own,
            lambda text: len(tokenizer.encode(text, add_special_tokens=False).input_ids.data[0]) == 1)
        try:
            template = JinjaTemplate(source, bos_token=str(tokenizer.get_bos_token()),
                                     eos_token=str(tokenizer.get_eos_token()))
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"the chat template ({self.template_origin}) does not compile: {exc}",
                                  chat_template=self.template_origin) from None
        self._guidance_tok: Any = None
        self._encode_cap: int | None = None
        #: last-position logits per tape length: prefill ends and the live decode position
        self._logits: dict[int, np.ndarray] = {}
        #: the row count of the batch request's last finished run (``_recover``)
        self._batch_width = 0
        #: the tape length whose logits entry step() created (spent by the next step)
        self._step_len: int | None = None
        super().__init__(
            path=str(ir),
            digest=digest,
            config=config,
            num_ctx=options.num_ctx,
            resident_bytes=shape.weights_bytes
            + self.cache_bytes
            + overhead_bytes(shape, options.num_ctx, options.prefill_chunk, batch_graph=self.batch_graph),
            template=template,
            bos_id=self.vocab.bos_id,
            adds_bos=self._tokenizer_adds_bos(),
        )
        if source != own:
            check_renders(template, self.template_origin)
        #: a decode step's row count: padded, a step takes a prefill's kernels (``Config.exact_decode``;
        #: ``warm_up`` measures the fewest rows that do, and a prefill's smallest chunk does by definition)
        self.step_rows = MIN_PREFILL_ROWS if options.exact_decode else 1
        # No rows probe as llama.cpp's load runs (``backends.llama.probe``): with exact decode no row runs
        # one-row kernels at all (a step is padded to a row count ``warm_up`` measures equal to a prefill's
        # on this CPU, else to a prefill's own smallest chunk), so that measurement is this engine's probe
        self.rows_exact = options.exact_decode

    def _allocate_cache(self, compiled: ov.CompiledModel, num_ctx: int) -> None:
        """One K and one V block pool per layer, sized for num_ctx, owned by us.

        Block ``i`` holds positions ``[i*B, (i+1)*B)``: the block table is the
        identity, so cutting the KV to n tokens is just ``past_lens = n``.
        """
        pools = sorted(
            (i for i in compiled.inputs if i.get_any_name().startswith(("key_cache.", "value_cache."))),
            key=lambda i: (int(i.get_any_name().split(".")[1]), i.get_any_name()),
        )
        if len(pools) != 2 * self.shape.n_layer:
            raise ModelLoadFailed(f"the paged graph has {len(pools)} cache inputs; expected {2 * self.shape.n_layer}")
        dims = [[d.get_length() for d in list(p.get_partial_shape())[1:]] for p in pools]
        if any(d != dims[0] for d in dims) or len(dims[0]) != 3:
            raise ModelLoadFailed(f"unexpected paged cache layouts {dims[:2]} (a quantised cache is not supported)")
        self.block_size = int(dims[0][1])
        self.kv_precision = type_name(pools[0].get_element_type())
        # room for the padding rows of a chunk that ends at num_ctx
        pad_room = max(bucket(k) - k for k in range(1, self.options.prefill_chunk + 1))
        self._n_blocks = -(-(num_ctx + pad_room) // self.block_size)
        self.cache_names = [p.get_any_name() for p in pools]
        self._cache_dims = dims[0]
        self._views: list[np.ndarray] = []
        requests = (self.step_req, self.batch_req) if self.batch_graph else (self.step_req,)
        for p in pools:
            tensor = ov.Tensor(p.get_element_type(), [self._n_blocks, *dims[0]])
            for req in requests:
                req.set_tensor(p.get_any_name(), tensor)  # one pool, written in place by either graph
            # a byte view of the pool: snapshots copy whole blocks, whatever the element type
            self._views.append(tensor.data.view(np.uint8).reshape(self._n_blocks, -1))
        self._block_bytes = int(self._views[0].shape[1])
        self.cache_bytes = self._block_bytes * self._n_blocks * len(pools)
        self.kv_bytes_per_token = self._block_bytes * len(pools) // self.block_size
        self._block_table = np.arange(self._n_blocks, dtype=np.int32)

    # --- TapeModelBase ------------------------------------------------------------------
    def engine_version(self) -> str:
        return runtime_version()

    def runtime_identity(self) -> dict[str, Any]:
        """The settings that change numerics (and so KV reuse and snapshot validity).

        The prefill chunk size is not one of them: paged-attention prefill is
        split-invariant (docs/engines.md, and the tests).
        """
        return {
            "attention": "paged",
            "device": self.device,
            "inference_precision": self.inference_precision,
            "kv_precision": self.kv_precision,
            "block_size": self.block_size,
            "num_ctx": self.options.num_ctx,
            "num_threads": self.options.num_threads,
            "exact_decode": self.options.exact_decode,
        }

    def cost_identity(self) -> dict[str, Any]:
        """With the batch graph a change of row count costs less (``graph.BATCH_GRAPH_MAX_WEIGHTS``)."""
        return {"batch_graph": self.batch_graph}

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    def errors(self, action: str) -> AbstractContextManager[None]:
        return map_errors(action)

    def _release(self) -> None:
        self._logits.clear()
        self._views = []
        del self.step_req, self.batch_req
        self._compiled.clear()

    def _tokenizer_adds_bos(self) -> bool:
        bos = self.vocab.bos_id
        if bos < 0:
            return False
        ids = self.tok.encode("a", add_special_tokens=True).input_ids.data[0]
        return len(ids) > 0 and int(ids[0]) == bos

    def encode_once(self, text: str) -> list[int]:
        """``text``'s tokens from one call of the converted tokenizer: cut at ``encode_limit``."""
        return [int(t) for t in self.tok.encode(text, add_special_tokens=False).input_ids.data[0]]

    @property
    def encode_limit(self) -> int:
        """The most tokens one ``encode`` returns: the converted tokenizer cuts every encoding at the model's
        context length (from the GGUF), whatever ``max_length`` or ``truncation`` say (measured once)."""
        if self._encode_cap is None:
            self._encode_cap = len(self.encode_once("a\n" * 200_000))
        return self._encode_cap

    def _encode(self, text: str) -> list[int]:
        ids = self.encode_once(text)
        if len(ids) < self.encode_limit:
            return ids
        # cut by the tokenizer: encode in pieces that each hold fewer characters than the limit (so fewer
        # tokens), split where a line ends before a non-space character (no token spans such a boundary)
        out: list[int] = []
        for piece in split_for_encoding(text, self.encode_limit - 1):
            out += self.encode_once(piece)
        return out

    def prompt_text(self, tokens: list[int]) -> str:
        return str(self.tok.decode(tokens, skip_special_tokens=False)) if tokens else ""

    def token_bytes(self, tokens: list[int]) -> list[bytes]:
        pieces = self.vocab.pieces
        return [pieces[t] for t in tokens]

    def is_control(self, token: int) -> bool:
        return token in self.vocab.special

    def guidance_tokenizer(self) -> Any:
        """The vocabulary in llguidance's form, built on the first constrained decode (~0.2 s)."""
        if self._guidance_tok is None:
            v = self.vocab
            self._guidance_tok = build_tokenizer(
                v.pieces, special=v.special, eog=v.eog, bos_id=v.bos_id, encode=self.tokenize
            )
        return self._guidance_tok

    def decode_steps(self, cfg: DecodeConfig) -> DecodeSteps:
        guide = None
        so = cfg.structured_output
        if so.is_set():
            fmt = self.decode_format(cfg)
            markers = self.forced_markers(fmt) if so.tool_call else {}
            guide = TokenGuide(self.guidance_tokenizer(), compile_grammar(so, fmt, markers))
        return OpenVINOSteps(self, Sampler(cfg), guide)

    # --- the KV ------------------------------------------------------------------------------
    def _infer(
        self, ids: list[int], past: int, *, rows: int = 0, every_row: bool = False, step: bool = False,
        abortable: bool = False,
    ) -> np.ndarray:
        """Run ``ids`` at positions past.. with ``past`` cached tokens; a view of the last one's logits.

        With ``every_row`` the LM head runs on every real row: a [len(ids), vocab] view. A decode
        ``step`` runs on the step graph, anything else on the batch graph (the same one without it).

        With ``rows`` > len(ids) the chunk is padded (the last token repeated at its
        own position): the padding writes KV cells past the tape, which the next
        step overwrites, and changes no number of the real rows.

        An ``abortable`` inference (a prefill chunk) stops part-way when this thread's interrupt is set.
        """
        n = len(ids)
        width = max(n, rows)
        total = past + width
        n_blocks = -(-total // self.block_size)
        positions = np.arange(past, total, dtype=np.int64)
        positions[n:] = past + n - 1  # stays inside the model's position range
        req = self.step_req if step else self.batch_req
        req.set_tensor("input_ids", ov.Tensor(np.asarray(ids + ids[-1:] * (width - n), np.int64)))
        req.set_tensor("position_ids", ov.Tensor(positions))
        req.set_tensor("past_lens", ov.Tensor(np.array([past], np.int32)))
        req.set_tensor("subsequence_begins", ov.Tensor(np.array([0, width], np.int32)))
        req.set_tensor("block_indices", ov.Tensor(np.ascontiguousarray(self._block_table[:n_blocks])))
        req.set_tensor("block_indices_begins", ov.Tensor(np.array([0, n_blocks], np.int32)))
        req.set_tensor("max_context_len", ov.Tensor(np.array(total, np.int32)))
        index = np.arange(n, dtype=np.int64) if every_row else np.array([n - 1], np.int64)
        req.set_tensor("sample_index", ov.Tensor(index))
        event = interrupt.current() if abortable else None
        if event is None:
            req.infer()
        else:
            self._infer_abortable(req, event)
        if req is self.batch_req:
            self._batch_width = width
        out: np.ndarray = req.get_tensor("logits").data
        if every_row:
            rows_out: np.ndarray = out.reshape(n, -1)
            return rows_out
        last: np.ndarray = out[-1, 0]
        return last

    def _infer_abortable(self, req: ov.InferRequest, event: threading.Event) -> None:
        """Run ``req`` and cancel it part-way once ``event`` is set: a chunk deep in a long prompt takes
        seconds (3 s for 512 tokens past 7k here, more on a loaded machine), and a cancel then frees the slot
        within ``ABORT_POLL_MS`` of it, not at the chunk's end. A cancelled chunk writes KV cells past the
        tape only, which the next inference overwrites (the tape is the chunks finished before it). See ``_recover``.
        """
        req.start_async()
        while not event.is_set():
            if req.wait_for(ABORT_POLL_MS):
                return
        req.cancel()
        try:
            req.wait()
        except RuntimeError:
            self._recover()
            raise Cancelled("prefill was cancelled") from None
        # it finished before the cancel reached it: a whole chunk, kept (the caller's next check stops)

    def _recover(self) -> None:
        """After a cancel part-way: the CPU plugin has reshaped some nodes of the graph for the cancelled run but
        still holds the input shapes of the last finished one, so a next run at those shapes skips its reshape
        and fails ("could not create a primitive", OpenVINO 2026.4). A throwaway run at other shapes reshapes
        every node again: the smallest chunk, or the next bucket when the last run was that, just past the tape
        (cells the next prefill overwrites; the cancelled chunk had room for it)."""
        rows = MIN_PREFILL_ROWS if self._batch_width != MIN_PREFILL_ROWS else bucket(MIN_PREFILL_ROWS + 1)
        past = len(self.res.tokens)
        self._infer([self.res.tokens[-1] if past else max(self.vocab.bos_id, 0)], past, rows=rows)

    def _readouts_of(self, n: int) -> np.ndarray:
        """The last batch inference's readouts of its first ``n`` rows: ``[n, n_layers, n_concepts]``."""
        assert self.readouts is not None
        k = len(self.readouts.concepts)
        per_layer = [self.batch_req.get_tensor(readout_name(layer)).data.reshape(-1, k)[:n]
                     for layer in self.readouts.layers]
        return np.stack(per_layer, axis=1).astype(np.float32)

    def _trim(self, n: int) -> None:
        """Forget everything after the first ``n`` tokens: bookkeeping only.

        The next ``_infer`` passes ``past_lens = n`` and overwrites those cells, so
        nothing in the pools needs to change.
        """
        if n == len(self.res.tokens):
            return
        self.res.tokens = self.res.tokens[:n]
        self._logits = {k: v for k, v in self._logits.items() if k <= n}
        if self._step_len is not None and self._step_len > n:
            self._step_len = None
        self.exact_len = min(self.exact_len, n)

    def _chunks(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """Prefill chunks of at most the chunk size."""
        size = self.options.prefill_chunk
        bounds = list(range(start, end, size)) + [end]
        yield from zip(bounds[:-1], bounds[1:], strict=False)

    def set_kv(self, tokens: list[int], keep: int, rows: RowsFn | None = None, states: StatesFn | None = None) -> int:
        """Make the KV hold ``tokens``, reusing the first ``keep`` resident ones; returns what was kept.

        Chunks run padded to their shape bucket (see the module docstring). On
        failure the tape equals the completed chunks and the error propagates.
        With ``rows``, the LM head runs on every row of each chunk, and the rows go to it; with ``states``, each
        chunk's readouts (the graph's readout outputs: ``graph.add_readouts``).
        """
        if states is not None and self.readouts is None:
            raise UnsupportedFeature("this model was loaded without a readout manifest (serve --readouts FILE)")
        self.epoch += 1
        keep = min(keep, len(tokens), len(self.res.tokens))
        self._trim(keep)
        exact = self.exact_len == keep
        for a, b in self._chunks(keep, len(tokens)):
            interrupt.check("prefill")  # between chunks: a cancel costs at most one chunk
            logits = self._infer(tokens[a:b], a, rows=bucket(b - a), every_row=rows is not None, abortable=True)
            self.res.tokens = list(tokens[:b])
            if states is not None:
                states(a, self._readouts_of(b - a))
            if rows is not None:
                rows(a, logits)
                logits = logits[-1]
            interrupt.chunk_done(b)  # the daemon's heartbeats carry the prefill's progress
            if exact:
                self.exact_len = b
        if keep < len(tokens):
            self._logits[len(tokens)] = logits.copy()
            if self._step_len == len(tokens):
                self._step_len = None  # now a prefill end, kept
        return keep

    def step(self, token: int) -> np.ndarray:
        """Evaluate one sampled token into the KV and the tape; its logits (a view)."""
        n = len(self.res.tokens)
        logits = self._infer([token], n, rows=self.step_rows, step=True)
        self.res.tokens.append(token)
        # Prefill ends stay (a full prefix hit or a restore samples from them); the
        # previous step's entry is spent.
        if self._step_len == n:
            self._logits.pop(n, None)
        self._logits[n + 1] = logits.copy()
        self._step_len = n + 1
        return logits

    def check_rows(self, n: int) -> int:
        """A check runs padded to a compiled shape (``verify_rows``): 2 to 4 rows cost the same.

        Never fewer rows than a step: with exact decode a check's rows then take a prefill's kernels too.
        """
        return max(verify_rows(n), self.step_rows)

    def verify(self, tokens: list[int]) -> np.ndarray:
        """Evaluate ``tokens`` in one padded batch; the logits after each of them (a copy, one row each)."""
        n = len(self.res.tokens)
        rows = self._infer(tokens, n, rows=self.check_rows(len(tokens)), every_row=True).copy()
        self.res.tokens.extend(tokens)
        if self._step_len == n:
            self._logits.pop(n, None)
        self._logits[len(self.res.tokens)] = rows[-1]
        self._step_len = len(self.res.tokens)
        return rows

    def rollback(self, n: int, logits_at_end: np.ndarray | None = None) -> None:
        """Drop the last ``n`` tokens (a rejected draft); ``logits_at_end``: the distribution after the rest."""
        if n <= 0:
            return
        self._trim(len(self.res.tokens) - n)
        if logits_at_end is not None:
            self._logits[len(self.res.tokens)] = logits_at_end
            self._step_len = len(self.res.tokens)

    def logits_at_end(self) -> np.ndarray:
        """The distribution after the last resident token; re-prefills the last token if none is stored."""
        n = len(self.res.tokens)
        hit = self._logits.get(n)
        if hit is not None:
            return hit
        self.set_kv(list(self.res.tokens), n - 1)
        return self._logits[n]

    def adopt_logits(self, logits: dict[int, np.ndarray], exact_len: int) -> None:
        """After a state restore: the stored logits and how much of the tape prefill computed."""
        n = len(self.res.tokens)
        self._logits = {k: v for k, v in logits.items() if 0 < k <= n}
        self._step_len = None
        self.exact_len = max(0, min(exact_len, n))

    def warm_up(self) -> None:
        """Run the small prefill buckets, the draft checks and a decode step once, and forget them.

        The CPU plugin compiles kernels for each new shape (25-110 ms here), which would otherwise
        land in a turn's time; the first inference of all costs ~0.5 s. What a decode step and a
        short warm suffix run is warmed; larger buckets and the full chunk, whose warming costs
        their whole rows, compile on first use (see ``WARM_BUCKETS_UP_TO``).
        """
        if self.options.exact_decode:
            self.step_rows = self._exact_step_rows()
        token = max(self.vocab.bos_id, 0)
        chunk = self.options.prefill_chunk
        shapes = sorted({bucket(k) for k in range(1, min(chunk, WARM_BUCKETS_UP_TO) + 1)})
        for rows in sorted(set(shapes) | set(VERIFY_ROWS)):
            self._infer([token], 0, rows=rows)
        self._infer([token, token], 0, rows=self.check_rows(2), every_row=True)
        self._infer([token], 1, rows=self.step_rows, step=True)

    def _exact_step_rows(self) -> int:
        """The fewest rows (of ``EXACT_STEP_ROWS``) a decode step can run with and compute what a prefill does.

        Measured on this CPU: one token after ~600 (a past over 512 keys), computed as
        a prefill's smallest chunk and padded to each candidate; different kernels
        round apart (by up to ~1.1 here), so equal bits mean the prefill's kernels.
        Falls back to ``MIN_PREFILL_ROWS``, which is a prefill chunk. Leaves nothing resident.
        """
        text = "".join(f"value_{i} = compute({i}, step={i % 7})\n" for i in range(80))
        ids = self._encode(text)[: max(2, min(600, self.num_ctx // 2))]
        past = len(ids) - 1
        try:
            self.set_kv(ids[:past], 0)
            reference = self._infer(ids[past:], past, rows=MIN_PREFILL_ROWS).copy()
            for rows in EXACT_STEP_ROWS:
                if np.array_equal(self._infer(ids[past:], past, rows=rows, step=True), reference):
                    return rows
            return MIN_PREFILL_ROWS
        finally:
            self.clear_kv()

    def clear_kv(self) -> None:
        self.epoch += 1
        self._logits.clear()
        self._step_len = None
        self.exact_len = 0
        self.res.clear()

    # --- state bytes --------------------------------------------------------------------------
    def state_header(self, n_tokens: int) -> dict[str, Any]:
        return {
            "format": 2,
            "model_digest": self._digest,
            "runtime": self.reuse_identity(),
            "n_tokens": n_tokens,
            "block_bytes": self._block_bytes,
            "pools": [[name, self.kv_precision, self._cache_dims] for name in self.cache_names],
        }

    def export_state(self) -> tuple[bytes, str]:
        """Header + the used blocks of every K/V pool, byte for byte + the stored logits."""
        n = len(self.res.tokens)
        n_blocks = -(-n // self.block_size)
        logits = sorted(self._logits.items())
        header = self.state_header(n) | {
            "logits": [[k, int(v.shape[0])] for k, v in logits],
            "exact_len": self.exact_len,
        }
        per_pool = n_blocks * self._block_bytes
        # One allocation, filled in place: a 2k-token snapshot is ~50 MB.
        size = per_pool * len(self._views) + sum(4 * v.shape[0] for _, v in logits)
        out, off, address = state_buffer(STATE_MAGIC, header, size)
        body = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(address + off))
        at = 0
        for view in self._views:
            body[at : at + per_pool] = view[:n_blocks].reshape(-1)
            at += per_pool
        for _, v in logits:
            body[at : at + 4 * v.shape[0]].view(np.float32)[:] = v
            at += 4 * v.shape[0]
        return out, "kv"

    def import_state(self, snap: SessionSnapshot, *, backup: bool = True) -> None:
        """``backup`` is moot: every check runs before the pools are touched, and a failed copy clears them."""
        tokens = list(snap.resident_token_ids)
        if snap.state_kind == "replay":
            self._replay(snap, tokens)
            return
        if snap.state_kind != "kv":
            raise SnapshotRejected(f"state_kind {snap.state_kind!r} is not restorable by the openvino backend")
        pools, logits, header = self.parse_state(snap.state, len(tokens))
        # Everything above was checked without touching the KV.
        try:
            with map_errors("restore"):
                self.load_state(pools, tokens)
        except ModeldError as exc:
            self.clear_kv()
            raise SnapshotRejected(f"OpenVINO refused the state: {exc.message}; the resident context was cleared") from exc
        exact = header.get("exact_len", 0)
        self.adopt_logits(logits, exact if isinstance(exact, int) else 0)

    def _replay(self, snap: SessionSnapshot, tokens: list[int]) -> None:
        """Re-prefill a token tape: the prefix, then the rest (exact, except that tokens
        which were decoded are now computed by the prefill kernel)."""
        if snap.state:
            raise SnapshotRejected("a replay snapshot carries no state bytes")
        prefix = tokens[: snap.prefix_tokens]
        try:
            with map_errors("restore: replay prefill"):
                # whatever of the tape is already resident (and exact) stays
                self.set_kv(prefix, self.reusable(common_prefix_len(self.res.tokens, prefix)))
                self.set_kv(tokens, len(prefix))
        except BaseException:
            self.clear_kv()
            raise

    def parse_state(self, blob: bytes, n_tokens: int) -> tuple[list[np.ndarray], dict[int, np.ndarray], dict[str, Any]]:
        """Check a KV snapshot against this model without touching the KV; SnapshotRejected otherwise."""
        header, body = unpack_state(STATE_MAGIC, blob, "an OpenVINO KV snapshot of this backend")
        refuse_diffs(header, self.state_header(n_tokens), "snapshot does not match this model and runtime")
        logit_specs = header.get("logits", [])
        if not isinstance(logit_specs, list) or any(
            not (isinstance(x, list) and len(x) == 2 and x[1] == self.vocab.size and 0 < x[0] <= n_tokens)
            for x in logit_specs
        ):
            raise SnapshotRejected("snapshot logits entries are malformed")
        n_blocks = -(-n_tokens // self.block_size)
        per_pool = n_blocks * self._block_bytes
        need = per_pool * len(self._views) + 4 * self.vocab.size * len(logit_specs)
        if len(body) != need:
            raise SnapshotRejected(f"snapshot holds {len(body)} state bytes; its header implies {need}")
        pools = [
            np.frombuffer(body, np.uint8, per_pool, i * per_pool).reshape(n_blocks, self._block_bytes)
            for i in range(len(self._views))
        ]
        off = per_pool * len(self._views)
        logits: dict[int, np.ndarray] = {}
        for k, size in logit_specs:
            logits[int(k)] = np.frombuffer(body, np.float32, size, off).copy()
            off += 4 * size
        return pools, logits, header

    def load_state(self, pools: list[np.ndarray], tokens: list[int]) -> None:
        """Copy snapshot blocks into the pools (one array per ``cache_names``, same order)."""
        self.epoch += 1
        for view, blocks in zip(self._views, pools, strict=True):
            view[: blocks.shape[0]] = blocks
        self.res.tokens = list(tokens)
