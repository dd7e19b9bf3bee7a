"""The llama.cpp backend: real inference through llama-cpp-python, one persistent KV.

Mechanism
---------
One ``llama_cpp.Llama`` instance holds the model and ONE context whose KV cache
(sequence 0) is the session's resident context. Next to it a
``contract.resident.Resident`` keeps the token tape, and the invariant of this
module is::

    Resident.tokens == llm.input_ids[:llm.n_tokens] == the tokens in the KV

``ensure_prefix`` renders the stable text through the model's own chat template
(GGUF ``tokenizer.chat_template``, tools included), tokenizes it, lets
``Resident.plan_prefix`` decide how much is reusable (manifest identity gate,
then token longest-common-prefix), removes the rest of the KV with
``llama_memory_seq_rm`` and prefills only the tail. ``prefill_suffix`` renders
[system, user] plus the generation prompt and appends the part after the
rendered prefix; a template that is not prefix-stable is reconciled by a token
LCP over the whole conversation. ``decode`` samples with a llama.cpp sampler
chain and evaluates every sampled token into the KV, so a later turn whose
text contains the previous answer reuses it, and closing the stream at any
point leaves tape and KV equal.

llama.cpp gotchas handled here (see /work/shared/docs/BACKENDS.md §1)
---------------------------------------------------------------------
* Logits are only valid right after a decode. After a restore, a full-prefix hit
  or a prefill that added nothing, the last resident token is decoded again
  before sampling (``n_tokens -= 1; eval([last])``); ``logits_live`` tracks it.
* ``Llama.eval`` itself drops KV cells at positions >= ``n_tokens``, so
  "truncate to N and continue" is bookkeeping plus one ``seq_rm``.
* Per-sequence state (``llama_state_seq_get_data``) is proportional to resident
  tokens and carries no logits; it is only valid for the same model, KV types,
  flash-attention layout and session version, so snapshots carry a small header
  with those and a restore refuses anything else before touching the KV.
* This llama-cpp-python build segfaults in ``ggml_backend_amx_mul_mat`` on CPUs
  that report AMX (seen in a Firecracker VM with AMX-INT8, Q4_1 weights).
  Extra weight buffer types (AMX/repack) are therefore disabled when the build
  reports ``AMX_INT8 = 1``; ``MODELD_LLAMA_EXTRA_BUFTS=1|0`` overrides.
  ``Llama`` exposes neither that switch nor a load-progress callback, so
  ``open_llama`` sets both on the model params through a property on a subclass.
* ``Llama.embed`` clears the KV: it is never called on the generation instance.

Threading: the daemon calls everything from one worker thread; only
``resident_bytes()`` and ``explain_context()`` may run on another thread, and
they read plain attributes.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import math
import mmap
import os
import struct
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import llama_cpp
from llama_cpp import Llama
from llama_cpp import _internals as llama_internals
from llama_cpp import _logger as llama_logger
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from llama_cpp.llama_grammar import json_schema_to_gbnf

from contract import interrupt
from contract.errors import (
    BackendMismatch,
    Cancelled,
    ContextOverflow,
    InsufficientMemory,
    Internal,
    InvalidArgument,
    ModeldError,
    ModelLoadFailed,
    SessionClosed,
    SnapshotRejected,
    UnsupportedFeature,
)
from contract.manifest import canonical_digest
from contract.resident import Resident
from contract.types import (
    Config,
    DecodeConfig,
    EmbedRequest,
    EmbedResult,
    ModelInfo,
    OpenSessionRequest,
    SessionSnapshot,
    StreamChunk,
    StructuredOutputConfig,
)

from .bundled import model_cache_dir
from .digest import file_digest
from .gguf_meta import GGUFFacts, is_gguf, read_gguf
from .tape_session import Render, TapeSession, resolve_num_ctx, wants_bos, with_bos

__all__ = [
    "BACKEND_NAME",
    "LlamaBackend",
    "LlamaLoadedModel",
    "LlamaSession",
    "kv_bytes_per_token",
    "open_llama",
]

BACKEND_NAME = "llama"
RUNTIME_NAME = "llama.cpp"
DEFAULT_NUM_CTX = 4096
DEFAULT_NUM_BATCH = 512
#: Config.kv_cache_type -> ggml type id ("" is llama.cpp's default, f16)
KV_GGML_TYPES: dict[str, int] = {
    "": llama_cpp.GGML_TYPE_F16,
    "f16": llama_cpp.GGML_TYPE_F16,
    "f32": llama_cpp.GGML_TYPE_F32,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}
#: bytes per KV element; q8_0 / q4_0 store 32 values in 34 / 18 bytes
KV_BYTES_PER_ELEM: dict[str, float] = {"": 2.0, "f16": 2.0, "f32": 4.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
_QUANT_BLOCK = 32
_STATE_MAGIC = b"MODELD-LLAMA-KV1"


def runtime_version() -> str:
    return str(llama_cpp.__version__)


# --- llama.cpp log capture ---------------------------------------------------------
# llama.cpp reports the reason for a failed load or context creation only through
# its log callback (Python sees "Failed to load model from file"). We chain a
# callback in front of llama-cpp-python's own one, keep the recent warnings and
# errors, and quote them in the typed error.
_LOG_TAIL: deque[tuple[int, str]] = deque(maxlen=64)
_log_seq = 0
_log_installed = False
_log_lock = threading.Lock()
# ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (llama_cpp/_logger.py's
# comment lists an older numbering; "error loading model" arrives as 4).
_LOG_KEEP_LEVELS = (3, 4)
_LOG_CONT = 5
_log_last_kept = False


def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # An exception cannot cross the C boundary, and this also runs during
    # interpreter shutdown when module globals may already be gone.
    global _log_seq, _log_last_kept
    try:
        keep = level in _LOG_KEEP_LEVELS or (level == _LOG_CONT and _log_last_kept)
        _log_last_kept = keep
        if keep and text:
            _log_seq += 1
            _LOG_TAIL.append((_log_seq, text.decode("utf-8", "replace").rstrip()))
        # llama-cpp-python's own printer, which honours Llama(verbose=...)
        llama_logger.llama_log_callback(level, text, user_data)
    except BaseException:  # noqa: BLE001 - see comment above
        pass


_c_log_callback = llama_cpp.llama_log_callback(_log_callback)


def _install_log_capture() -> None:
    global _log_installed
    with _log_lock:
        if not _log_installed:
            llama_cpp.llama_log_set(_c_log_callback, ctypes.c_void_p(0))
            _log_installed = True


def _log_mark() -> int:
    return _log_seq


def _log_since(mark: int) -> str:
    lines = [text for seq, text in list(_LOG_TAIL) if seq > mark and text]
    return ("; llama.cpp said: " + " | ".join(lines[-6:])) if lines else ""


# --- the one place foreign exceptions become typed errors ------------------------------
@contextlib.contextmanager
def _map_llama_errors(action: str, *, loading: bool = False) -> Iterator[None]:
    """Translate llama-cpp-python / jinja2 / OS exceptions into modeld errors.

    Most specific first; typed errors pass through untouched. While ``loading``
    every failure is a ModelLoadFailed carrying llama.cpp's own log lines.
    """
    mark = _log_mark()
    try:
        yield
    except ModeldError:
        raise
    except jinja2.TemplateError as exc:
        raise InvalidArgument(f"{action}: the model's chat template failed: {exc}") from exc
    except MemoryError as exc:
        raise InsufficientMemory(f"{action}: out of memory") from exc
    except (OSError, ValueError, RuntimeError, TypeError) as exc:
        msg = f"{action}: {type(exc).__name__}: {exc}{_log_since(mark)}"
        if loading:
            raise ModelLoadFailed(msg) from exc
        if isinstance(exc, RuntimeError) and "llama_decode returned 1" in str(exc):
            # 1 = no KV slot for the batch: the context is full
            raise ContextOverflow(msg) from exc
        if isinstance(exc, RuntimeError) and "llama_decode returned 2" in str(exc):
            # 2 = the abort hook fired: only an interrupt installs it
            raise Cancelled(f"{action} was cancelled") from exc
        if isinstance(exc, ValueError):
            raise InvalidArgument(msg) from exc
        raise Internal(msg) from exc


# --- constructing a Llama with the params it does not expose --------------------------
ProgressFn = Callable[[float], None]


def _extra_bufts_default() -> bool:
    env = os.environ.get("MODELD_LLAMA_EXTRA_BUFTS", "").strip().lower()
    if env in ("1", "true", "on", "yes"):
        return True
    if env in ("0", "false", "off", "no"):
        return False
    # See the module docstring: the AMX matmul of this build crashes the process.
    return "AMX_INT8 = 1" not in system_info()


def system_info() -> str:
    return bytes(llama_cpp.llama_print_system_info()).decode("utf-8", "replace").strip()


class _ParamsLlama(Llama):
    """``Llama`` whose model params get a progress callback and the extra-buffer switch.

    ``Llama.__init__`` creates ``self.model_params`` and loads the model in the same
    call; assigning through this property is the only point where the struct can
    be amended before llama.cpp reads it.
    """

    _pending_progress: Any = None
    _pending_extra_bufts: bool = True

    @property
    def model_params(self) -> Any:
        return self.__dict__["_modeld_model_params"]

    @model_params.setter
    def model_params(self, params: Any) -> None:
        params.use_extra_bufts = self._pending_extra_bufts
        if self._pending_progress is not None:
            params.progress_callback = self._pending_progress
        self.__dict__["_modeld_model_params"] = params


def open_llama(
    path: str | os.PathLike[str],
    *,
    progress: ProgressFn | None = None,
    extra_bufts: bool | None = None,
    **llama_kwargs: Any,
) -> Llama:
    """A ``Llama`` for ``path`` with real load progress and this build's AMX workaround.

    ``llama_kwargs`` go to ``Llama`` unchanged (verbose defaults to False). Use it
    for any Llama in this process (tests' reference instances included), so every
    instance computes with the same kernels.
    """
    _install_log_capture()
    llama_kwargs.setdefault("verbose", False)
    cls: type[_ParamsLlama] = type("_ConfiguredLlama", (_ParamsLlama,), {})
    cls._pending_extra_bufts = _extra_bufts_default() if extra_bufts is None else extra_bufts
    c_progress = None
    if progress is not None:
        last = [0.0]

        def on_progress(fraction: float, _user: ctypes.c_void_p) -> bool:
            # Called on the loading thread with the GIL re-acquired; an exception
            # here could not propagate through C, so it is swallowed.
            try:
                f = max(last[0], min(1.0, float(fraction)))
                if f >= last[0] + 0.01 or f >= 1.0:
                    last[0] = f
                    progress(f)
            except Exception:  # noqa: BLE001 - see comment above
                pass
            return True  # False would abort the load

        c_progress = llama_cpp.llama_progress_callback(on_progress)
        cls._pending_progress = c_progress
    llm = cls(str(path), **llama_kwargs)
    # The callback pointer stays in the params struct; keep the Python object alive
    # as long as the instance.
    llm.__dict__["_modeld_progress_ref"] = c_progress
    return llm


# --- GGUF metadata, cached -------------------------------------------------------------
_facts_cache: dict[tuple[str, int, int], GGUFFacts] = {}
_facts_lock = threading.Lock()


def gguf_facts(path: str | os.PathLike[str]) -> GGUFFacts:
    """``read_gguf`` cached per (resolved path, size, mtime): it takes ~2 s."""
    p = Path(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    with _facts_lock:
        hit = _facts_cache.get(key)
    if hit is not None:
        return hit
    facts = read_gguf(p)
    with _facts_lock:
        _facts_cache[key] = facts
    return facts


@dataclass(frozen=True)
class ModelShape:
    """The numbers memory planning and load validation need."""

    n_ctx_train: int
    n_layer: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    weights_bytes: int

    @classmethod
    def from_facts(cls, f: GGUFFacts) -> ModelShape:
        return cls(f.n_ctx_train, f.n_layer, f.n_head_kv, f.head_dim_k, f.head_dim_v, f.weights_bytes)


def kv_bytes_per_token(shape: ModelShape | GGUFFacts, kv_cache_type: str) -> int:
    """n_layer × n_head_kv × (head_dim_k + head_dim_v) × bytes per element, rounded up."""
    bpe = KV_BYTES_PER_ELEM[kv_cache_type]
    return math.ceil(shape.n_layer * shape.n_head_kv * (shape.head_dim_k + shape.head_dim_v) * bpe)


# GGUF value types (gguf spec) and the struct codes of the scalar ones
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_scalars(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The scalar metadata of a GGUF header, arrays skipped; a few ms.

    ``gguf.GGUFReader`` (behind ``read_gguf``) parses every vocabulary array into
    numpy objects and takes ~2 s for this model; a load needs only a handful of
    scalars before llama.cpp opens the file itself. ValueError for a file that is
    not a readable GGUF.
    """
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse_gguf_scalars(buf)
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise ValueError(f"{path} has a truncated or corrupt GGUF header: {exc}") from exc


def _parse_gguf_scalars(buf: mmap.mmap) -> dict[str, Any]:
    if buf[:4] != b"GGUF":
        raise ValueError("bad GGUF magic")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    _n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    off = 24
    out: dict[str, Any] = {}

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        end = at + 8 + n
        if end > len(buf):
            raise IndexError("string runs past the end of the file")
        return bytes(buf[at + 8 : end]).decode("utf-8"), end

    def skip(vtype: int, at: int) -> int:
        if vtype in _GGUF_SCALARS:
            return at + struct.calcsize(_GGUF_SCALARS[vtype])
        if vtype == _GGUF_STRING:
            (n,) = struct.unpack_from("<Q", buf, at)
            return at + 8 + int(n)
        if vtype == _GGUF_ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if etype in _GGUF_SCALARS:
                return at + int(count) * struct.calcsize(_GGUF_SCALARS[etype])
            for _ in range(count):
                at = skip(etype, at)
            return at
        raise ValueError(f"unknown GGUF value type {vtype}")

    for _ in range(n_kv):
        key, off = string(off)
        (vtype,) = struct.unpack_from("<I", buf, off)
        off += 4
        if vtype in _GGUF_SCALARS:
            (out[key],) = struct.unpack_from(_GGUF_SCALARS[vtype], buf, off)
        elif vtype == _GGUF_STRING:
            out[key], _ = string(off)
        off = skip(vtype, off)
        if off > len(buf):
            raise IndexError("metadata runs past the end of the file")
    return out


def _shape_hint(scalars: dict[str, Any]) -> ModelShape:
    """What the header says before loading (per-layer arrays are not read here)."""
    arch = str(scalars.get("general.architecture", ""))

    def g(key: str) -> int:
        v = scalars.get(f"{arch}.{key}", 0)
        return int(v) if isinstance(v, (int, float)) else 0

    n_head = g("attention.head_count")
    head = g("embedding_length") // n_head if n_head else 0
    return ModelShape(
        n_ctx_train=g("context_length"),
        n_layer=g("block_count"),
        n_head_kv=g("attention.head_count_kv") or n_head,
        head_dim_k=g("attention.key_length") or head,
        head_dim_v=g("attention.value_length") or head,
        weights_bytes=0,
    )


def _cached_facts(path: Path) -> GGUFFacts | None:
    st = path.stat()
    with _facts_lock:
        return _facts_cache.get((str(path.resolve()), st.st_size, st.st_mtime_ns))


# --- load options -----------------------------------------------------------------------
@dataclass(frozen=True)
class _LoadOptions:
    num_ctx: int
    num_batch: int
    num_threads: int
    num_gpu_layers: int
    flash_attn: bool
    kv_cache_type: str  # normalised: "" becomes "f16"
    extra_bufts: bool
    tensor_split: tuple[float, ...]

    @classmethod
    def resolve(cls, cfg: Config, facts: ModelShape) -> _LoadOptions:
        num_ctx = resolve_num_ctx(cfg.num_ctx, facts.n_ctx_train, DEFAULT_NUM_CTX)
        kv = cfg.kv_cache_type or "f16"
        if kv in ("q8_0", "q4_0"):
            if not cfg.flash_attn:
                # llama.cpp refuses a quantized V cache without flash attention and
                # only says "Failed to create llama_context".
                raise InvalidArgument(
                    f"kv_cache_type {kv!r} needs flash_attn=true (llama.cpp cannot quantize the V cache without it)",
                    kv_cache_type=kv,
                )
            for dim in (facts.head_dim_k, facts.head_dim_v):
                if dim % _QUANT_BLOCK:
                    raise InvalidArgument(
                        f"kv_cache_type {kv!r} needs a head dimension divisible by {_QUANT_BLOCK}; this model has {dim}",
                        kv_cache_type=kv,
                    )
        num_batch = min(cfg.num_batch or DEFAULT_NUM_BATCH, num_ctx)
        return cls(
            num_ctx=num_ctx,
            num_batch=num_batch,
            num_threads=cfg.num_threads or (os.cpu_count() or 1),
            num_gpu_layers=cfg.num_gpu_layers,
            flash_attn=cfg.flash_attn,
            kv_cache_type=kv,
            extra_bufts=_extra_bufts_default(),
            tensor_split=tuple(cfg.tensor_split),
        )

    def llama_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "n_ctx": self.num_ctx,
            "n_batch": self.num_batch,
            "n_ubatch": self.num_batch,
            "n_threads": self.num_threads,
            "n_threads_batch": self.num_threads,
            "n_gpu_layers": self.num_gpu_layers,
            "flash_attn": self.flash_attn,
            "type_k": KV_GGML_TYPES[self.kv_cache_type],
            "type_v": KV_GGML_TYPES[self.kv_cache_type],
            "verbose": False,
        }
        if self.tensor_split:
            kw["tensor_split"] = list(self.tensor_split)
        return kw

    def runtime_identity(self) -> dict[str, Any]:
        """The settings that change numerics (and so KV reuse/snapshot validity)."""
        return {
            "n_ctx": self.num_ctx,
            "kv_cache_type": self.kv_cache_type,
            "flash_attn": self.flash_attn,
            "num_gpu_layers": self.num_gpu_layers,
            "extra_bufts": self.extra_bufts,
        }


# --- the chat template ---------------------------------------------------------------------
class _ChatTemplate:
    """The model's own Jinja template, rendered the way HF/llama-cpp-python do."""

    def __init__(self, template: str, eos_token: str, bos_token: str) -> None:
        self.source = template
        self.digest = "sha256:" + hashlib.sha256(template.encode("utf-8")).hexdigest()
        self.prompt_format = "chatml" if "<|im_start|>" in template else "jinja"
        self._plain = Jinja2ChatFormatter(template, eos_token, bos_token, add_generation_prompt=False)
        self._gen = Jinja2ChatFormatter(template, eos_token, bos_token, add_generation_prompt=True)

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None, *, generation: bool, **extra: Any) -> str:
        fmt = self._gen if generation else self._plain
        return str(fmt(messages=messages, tools=tools, **extra).prompt)  # type: ignore[arg-type]




# --- the loaded model -------------------------------------------------------------------------
class LlamaLoadedModel:
    """A model resident in llama.cpp with its one persistent KV (what the slot holds).

    Build it with ``LlamaBackend.load``. Sessions opened on it share the KV; a new
    session makes older session handles closed, since there is one KV to drive.
    """

    def __init__(self, llm: Llama, *, path: str, digest: str, shape: ModelShape, options: _LoadOptions, config: Config) -> None:
        self._llm = llm
        self.path = path
        self._digest = digest
        self.shape = shape
        self.options = options
        self.config = config
        self.res = Resident(num_ctx=options.num_ctx)
        self._vocab = llm._model.vocab
        self._n_vocab = int(llm.n_vocab())
        self._bos_id = int(llm.token_bos())
        self._add_bos_default = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        template = llm.metadata.get("tokenizer.chat_template", "")
        self.template: _ChatTemplate | None = None
        if template:
            eos = llm._model.token_get_text(llm.token_eos()) if llm.token_eos() != -1 else ""
            bos = llm._model.token_get_text(self._bos_id) if self._bos_id != -1 else ""
            self.template = _ChatTemplate(template, eos, bos)
        self._kv_per_token = kv_bytes_per_token(shape, options.kv_cache_type)
        self._resident_bytes = shape.weights_bytes + self._kv_per_token * options.num_ctx
        #: the logits buffer holds the distribution after the last resident token
        self.logits_live = False
        #: bumped by every operation that changes the KV; an abandoned decode stream
        #: compares it before touching the KV again
        self.epoch = 0
        self._session_gen = 0
        self.closed = False
        #: set while a prefill runs inside contract.interrupt.interruptible(...)
        self._abort_event: threading.Event | None = None
        # llama.cpp polls this between graph nodes; the reference keeps ctypes' thunk alive
        self._abort_cb = llama_cpp.ggml_abort_callback(self._should_abort)

    def _should_abort(self, _data: Any) -> bool:
        event = self._abort_event
        return event is not None and event.is_set()

    # --- LoadedModel ---------------------------------------------------------------------
    @property
    def digest(self) -> str:
        return self._digest

    @property
    def num_ctx(self) -> int:
        return self.options.num_ctx

    @property
    def llm(self) -> Llama:
        return self._llm

    def open_session(self) -> LlamaSession:
        if self.closed:
            raise SessionClosed("model was unloaded")
        self._session_gen += 1
        self.epoch += 1  # an open stream of an older session must not touch the KV
        return LlamaSession(self, self._session_gen)

    def resident_bytes(self) -> int:
        """Weights plus the KV cache allocated for num_ctx (a precomputed attribute)."""
        return 0 if self.closed else self._resident_bytes

    def manifest_defaults(self) -> dict[str, str]:
        """What a client puts in its ContextManifest for this model."""
        tpl = self.template
        return {
            "backend": BACKEND_NAME,
            "backend_version": runtime_version(),
            "model_digest": self._digest,
            "prompt_format": tpl.prompt_format if tpl is not None else "raw",
            "template_digest": tpl.digest if tpl is not None else "",
            "runtime_digest": canonical_digest(self.options.runtime_identity()),
            "bos_policy": "add" if self._wants_bos("") else "none",
        }

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.epoch += 1
        self.res.clear()
        self._llm.close()

    # --- tokens and the KV ----------------------------------------------------------------
    def _wants_bos(self, policy: str) -> bool:
        return wants_bos(policy, disabled=self.config.disable_bos, model_default=self._add_bos_default)

    def tokenize(self, text: str, *, bos_policy: str | None = None) -> list[int]:
        """Tokens of rendered text (special tokens parsed); BOS per policy, never doubled."""
        tokens = list(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))
        return with_bos(tokens, self._bos_id, bos_policy is not None and self._wants_bos(bos_policy))

    def piece(self, token: int, *, special: bool = False) -> bytes:
        # Llama.detokenize uses a 32-byte buffer and silently truncates longer pieces.
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, size, 0, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def set_kv(self, tokens: list[int], keep: int) -> int:
        """Make the KV hold ``tokens``, reusing the first ``keep`` resident ones.

        Returns how many were actually reused (0 when the memory cannot drop a
        tail, e.g. recurrent models). Updates the tape; on failure the KV and the
        tape are left equal to whatever prefix was computed, and the error raised.
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
        tail = tokens[keep:]
        try:
            if tail:
                interrupt.check("prefill")
                with self._abortable():
                    llm.eval(tail)
                self.logits_live = True
        finally:
            # eval advances n_tokens per completed batch; keep the tape equal to it
            self.res.tokens = list(tokens[: llm.n_tokens])
        return keep

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

    def refresh_logits(self) -> None:
        """Decode the last resident token again so sampling sees live logits."""
        if self.logits_live or not self.res.tokens:
            return
        llm = self._llm
        last = self.res.tokens[-1]
        llm.n_tokens = len(self.res.tokens) - 1
        try:
            llm.eval([last])  # eval drops the old cell at that position first
        except BaseException:
            self.res.tokens = self.res.tokens[: llm.n_tokens]
            raise
        self.logits_live = True

    def reusable(self, n: int) -> int:
        """llama.cpp keeps any prefix of the KV exactly."""
        return n

    def clear_kv(self) -> None:
        self.epoch += 1
        with contextlib.suppress(Exception):
            self._llm._ctx.kv_cache_seq_rm(0, 0, -1)
        self._llm.n_tokens = 0
        self.logits_live = False
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

    def set_seq_state(self, blob: bytes) -> bool:
        """Replace sequence 0 with ``blob``; False when llama.cpp refuses it."""
        if not blob:
            return False
        self._llm._ctx.kv_cache_seq_rm(0, 0, -1)
        src = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        n = int(llama_cpp.llama_state_seq_set_data(self._llm.ctx, src, len(blob), 0))
        return n == len(blob)

    def kv_pos_max(self) -> int:
        mem = llama_cpp.llama_get_memory(self._llm.ctx)
        return int(llama_cpp.llama_memory_seq_pos_max(mem, 0))


def _pack_state(header: dict[str, Any], blob: bytes) -> bytes:
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return _STATE_MAGIC + struct.pack("<I", len(head)) + head + blob


def _unpack_state(state: bytes) -> tuple[dict[str, Any], bytes]:
    n0 = len(_STATE_MAGIC)
    if state[:n0] != _STATE_MAGIC or len(state) < n0 + 4:
        raise SnapshotRejected("state bytes are not a llama.cpp KV snapshot of this backend")
    (hlen,) = struct.unpack("<I", state[n0 : n0 + 4])
    raw = state[n0 + 4 : n0 + 4 + hlen]
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise SnapshotRejected("snapshot header is not valid JSON") from exc
    if not isinstance(header, dict) or len(raw) != hlen:
        raise SnapshotRejected("snapshot header is truncated")
    return header, state[n0 + 4 + hlen :]


# --- the session ---------------------------------------------------------------------------------
class LlamaSession(TapeSession):
    """A Session over a LlamaLoadedModel's persistent KV."""

    backend_name = BACKEND_NAME

    def _errors(self, action: str) -> AbstractContextManager[None]:
        return _map_llama_errors(action)

    def _render_prefix(self, m: LlamaLoadedModel, text: str, tools: list[Any] | None) -> str:
        tpl = m.template
        if tpl is None:
            if tools:
                raise UnsupportedFeature("the model has no chat template, so it cannot be given tools")
            return text
        messages = [{"role": "system", "content": text}]
        rendered = tpl.render(messages, tools, generation=False)
        if tools and rendered == tpl.render(messages, None, generation=False):
            raise UnsupportedFeature(
                "the model's chat template does not render tools; refusing to drop them silently",
                template_digest=tpl.digest,
            )
        return rendered

    def _renderer(self, m: LlamaLoadedModel) -> Render | None:
        return m.template.render if m.template is not None else None

    def _prompt_text(self, m: LlamaLoadedModel, tokens: list[int]) -> str:
        return b"".join(m.piece(t, special=True) for t in tokens).decode("utf-8", "replace")

    # --- Session -------------------------------------------------------------------------------
    def decode(self, cfg: DecodeConfig) -> Generator[StreamChunk, None, None]:
        """Stream chunks; closing the generator cancels within one token (see ``TapeSession._stream``)."""
        m = self._live()
        with _map_llama_errors("decode"):
            pipeline = self._output_pipeline(m, cfg)
            sampler = _build_sampler(m, cfg, _grammar_source(cfg.structured_output))
        m.epoch += 1
        return self._stream(m, cfg, _Steps(m, sampler), pipeline, m.epoch)

    def snapshot(self) -> SessionSnapshot:
        m = self._live()
        with _map_llama_errors("snapshot"):
            blob = m.seq_state()
        return m.res.snapshot(BACKEND_NAME, _pack_state(m.state_header(), blob), "kv")

    def restore(self, snap: SessionSnapshot) -> None:
        m = self._live()
        res = m.res
        res.validate_snapshot(snap, BACKEND_NAME, m.digest)
        if snap.state_kind != "kv":
            raise SnapshotRejected(f"state_kind {snap.state_kind!r} is not restorable by the llama backend")
        header, blob = _unpack_state(snap.state)
        expected = m.state_header() | {"n_tokens": snap.resident_tokens}
        diffs = [f"{k}: snapshot {header.get(k)!r} != session {v!r}" for k, v in expected.items() if header.get(k) != v]
        if diffs:
            raise SnapshotRejected("snapshot was taken under another runtime: " + "; ".join(diffs), problems=diffs)
        if any(not 0 <= t < m._n_vocab for t in snap.resident_token_ids):
            raise SnapshotRejected("snapshot token ids are outside this model's vocabulary")
        if snap.manifest.backend and snap.manifest.backend != BACKEND_NAME:
            raise SnapshotRejected(f"snapshot manifest names backend {snap.manifest.backend!r}")
        n = len(snap.resident_token_ids)
        with _map_llama_errors("restore"):
            # Everything above was checked without touching the KV. llama.cpp can still
            # refuse the bytes (returns 0), so keep the current state to put back.
            backup = m.seq_state()
            m.epoch += 1
            m.logits_live = False  # state bytes carry no logits
            if not (m.set_seq_state(blob) and m.kv_pos_max() == n - 1):
                if m.set_seq_state(backup) and m.kv_pos_max() == len(res.tokens) - 1:
                    raise SnapshotRejected("llama.cpp refused the state bytes; the session is unchanged")
                m.clear_kv()
                raise SnapshotRejected("llama.cpp refused the state bytes; the resident context was cleared")
            llm = m.llm
            llm.input_ids[:n] = snap.resident_token_ids
            llm.n_tokens = n
            res.adopt_snapshot(snap)


class _Steps:
    """DecodeSteps on a llama.cpp context: its sampler chain over the context's logits."""

    def __init__(self, m: LlamaLoadedModel, sampler: llama_internals.LlamaSampler) -> None:
        self._m = m
        self._sampler = sampler

    def start(self) -> None:
        self._m.refresh_logits()

    def sample(self) -> int:
        return int(self._sampler.sample(self._m.llm._ctx, -1))

    def feed(self, token: int) -> None:
        self._m.append(token)

    def is_end(self, token: int) -> bool:
        return self._m.is_eog(token)

    def piece(self, token: int) -> bytes:
        return self._m.piece(token)

    def settle(self, token: int) -> None:
        with contextlib.suppress(Exception):
            self._m.append(token)  # a failed eval leaves n_tokens and the tape unchanged

    def close(self) -> None:
        self._sampler.close()


def _grammar_source(so: StructuredOutputConfig) -> str | None:
    """The GBNF text for a structured-output request (None when unconstrained)."""
    if so.regex:
        raise UnsupportedFeature("the llama backend does not constrain output by regex; use grammar or json_schema")
    if so.json_schema:
        try:
            schema = json.loads(so.json_schema)
        except ValueError as exc:
            raise InvalidArgument(f"json_schema is not valid JSON: {exc}") from exc
        ignored = sorted(_unenforced_keywords(schema))
        if ignored:
            raise UnsupportedFeature(
                f"the llama backend's JSON-schema grammar cannot enforce {ignored}; refusing to drop them silently",
                keywords=ignored,
            )
        try:
            return str(json_schema_to_gbnf(so.json_schema))
        # the converter asserts on schemas it does not recognise
        except (ValueError, KeyError, TypeError, AssertionError, RecursionError) as exc:
            raise InvalidArgument(f"json_schema cannot be turned into a grammar: {exc!r}") from exc
    return so.grammar or None


#: JSON-schema keywords llama-cpp-python's json_schema_to_gbnf accepts but does not enforce
_UNENFORCED_SCHEMA_KEYWORDS = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "uniqueItems",
        "minProperties",
        "maxProperties",
        "patternProperties",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
#: keywords whose value maps names to subschemas (the names are data, not keywords)
_SCHEMA_MAPS = ("properties", "$defs", "definitions")


def _unenforced_keywords(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, list):
        for item in node:
            found |= _unenforced_keywords(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for sub in value.values():
                    found |= _unenforced_keywords(sub)
            elif key in ("const", "enum", "default", "examples", "description", "title"):
                continue  # literal data
            else:
                if key in _UNENFORCED_SCHEMA_KEYWORDS:
                    found.add(key)
                found |= _unenforced_keywords(value)
    return found


def _build_sampler(m: LlamaLoadedModel, cfg: DecodeConfig, grammar: str | None) -> llama_internals.LlamaSampler:
    """A sampler chain in llama-cpp-python's order: grammar, then greedy or top-k/top-p/temp/dist.

    Penalties are left out (llama-cpp-python's defaults make them a no-op) and
    min_p is 0, so top_k/top_p mean what they say.
    """
    sampler = llama_internals.LlamaSampler()
    try:
        if grammar is not None:
            mark = _log_mark()
            g = llama_cpp.llama_sampler_init_grammar(m.llm._model.vocab, grammar.encode("utf-8"), b"root")
            if not g:  # llama.cpp returns NULL for a grammar it cannot parse
                raise InvalidArgument(f"the grammar does not parse{_log_since(mark)}")
            llama_cpp.llama_sampler_chain_add(sampler.sampler, g)
        if not cfg.temperature:
            sampler.add_greedy()
        else:
            if cfg.top_k > 0:
                sampler.add_top_k(cfg.top_k)
            if cfg.top_p is not None and cfg.top_p < 1.0:
                sampler.add_top_p(cfg.top_p, 1)
            sampler.add_temp(cfg.temperature)
            seed = llama_cpp.LLAMA_DEFAULT_SEED if cfg.seed is None else cfg.seed & 0xFFFFFFFF
            m.llm.set_seed(seed)
            sampler.add_dist(seed)
    except BaseException:
        sampler.close()
        raise
    return sampler


# --- the backend -------------------------------------------------------------------------------------
def _check_type(t: str) -> None:
    if t not in ("", BACKEND_NAME):
        raise BackendMismatch(f"model type {t!r} is not served by the llama backend", type=t)


def _model_path(req: OpenSessionRequest | EmbedRequest) -> Path:
    if not req.path:
        raise ModelLoadFailed("the request names no model path")
    p = Path(req.path)
    if not p.is_file():
        raise ModelLoadFailed(f"model file not found: {req.path}", path=req.path)
    if not is_gguf(p):
        raise ModelLoadFailed(f"{req.path} is not a GGUF file", path=req.path)
    return p


class LlamaBackend:
    """The llama.cpp implementation of the daemon's Backend seam."""

    name = BACKEND_NAME

    def runtime_version(self) -> str:
        return runtime_version()

    def load(self, req: OpenSessionRequest, progress: Callable[[float], None]) -> LlamaLoadedModel:
        _check_type(req.type)
        progress(0.0)
        path = _model_path(req)
        with _map_llama_errors(f"loading {req.path}", loading=True):
            facts = _cached_facts(path)  # describe() may have read it already
            hint = ModelShape.from_facts(facts) if facts is not None else _shape_hint(gguf_scalars(path))
            options = _LoadOptions.resolve(req.config, hint)
            digest = file_digest(path, model_cache_dir())
            if req.digest and req.digest != digest:
                raise ModelLoadFailed(
                    f"{req.path} has digest {digest}, the request expects {req.digest}",
                    path=req.path,
                    expected=req.digest,
                    actual=digest,
                )
            llm = open_llama(path, progress=progress, extra_bufts=options.extra_bufts, **options.llama_kwargs())
            try:
                shape = ModelShape(
                    n_ctx_train=int(llama_cpp.llama_model_n_ctx_train(llm.model)),
                    n_layer=int(llama_cpp.llama_model_n_layer(llm.model)),
                    n_head_kv=hint.n_head_kv or int(llama_cpp.llama_model_n_head_kv(llm.model)),
                    head_dim_k=hint.head_dim_k,
                    head_dim_v=hint.head_dim_v,
                    weights_bytes=int(llama_cpp.llama_model_size(llm.model)),
                )
                model = LlamaLoadedModel(
                    llm, path=str(path), digest=digest, shape=shape, options=options, config=req.config
                )
                self._check_declared_template(model, req.config)
            except BaseException:
                llm.close()
                raise
        progress(1.0)
        return model

    @staticmethod
    def _check_declared_template(model: LlamaLoadedModel, cfg: Config) -> None:
        declared = cfg.prompt_template_digest
        actual = model.template.digest if model.template is not None else ""
        if declared and declared != actual:
            raise ModelLoadFailed(
                f"the profile declares template {declared} but the model's chat template is {actual or 'absent'}",
                declared=declared,
                actual=actual,
            )

    def describe(self, req: OpenSessionRequest, credit_bytes: int = 0) -> ModelInfo:
        """ModelInfo from GGUF metadata; loads no weights. ``credit_bytes`` is for the memory planner."""
        _check_type(req.type)
        path = _model_path(req)
        with _map_llama_errors(f"describing {req.path}", loading=True):
            facts = gguf_facts(path)
            options = _LoadOptions.resolve(req.config, ModelShape.from_facts(facts))
            digest = file_digest(path, model_cache_dir())
        kvpt = kv_bytes_per_token(facts, options.kv_cache_type)
        gpu = bool(llama_cpp.llama_supports_gpu_offload())
        return ModelInfo(
            model_max_context=facts.n_ctx_train,
            effective_context=options.num_ctx,
            kv_bytes_per_token=kvpt,
            weights_bytes=facts.weights_bytes,
            required_bytes=facts.weights_bytes + kvpt * options.num_ctx,
            device_kind="cpu",
            requested_gpu_layers=req.config.num_gpu_layers,
            resolved_gpu_layers=req.config.num_gpu_layers if gpu else 0,
            runtime_name=RUNTIME_NAME,
            runtime_digest=f"llama-cpp-python=={runtime_version()}",
            runtime_system_info=system_info(),
            supports_gpu_offload=gpu,
            n_layer=facts.n_layer,
            n_head_kv=facts.n_head_kv,
            head_dim=facts.head_dim_k,
            digest=digest,
        )

    def model_facts(self, req: OpenSessionRequest) -> dict[str, Any]:
        """What the daemon's memory planner needs, as plain fields (no weights loaded)."""
        _check_type(req.type)
        path = _model_path(req)
        with _map_llama_errors(f"describing {req.path}", loading=True):
            facts = gguf_facts(path)
        kv_type = req.config.kv_cache_type or "f16"
        return {
            "n_ctx_train": facts.n_ctx_train,
            "n_layer": facts.n_layer,
            "n_head_kv": facts.n_head_kv,
            "head_dim_k": facts.head_dim_k,
            "head_dim_v": facts.head_dim_v,
            "weights_bytes": facts.weights_bytes,
            "sliding_window": facts.sliding_window,
            "kv_cache_type": kv_type,
            # A quantized V cache turns flash attention on (see _LoadOptions).
            "flash_attn": req.config.flash_attn or kv_type in ("q8_0", "q4_0"),
            "n_batch": req.config.num_batch or DEFAULT_NUM_BATCH,
            "n_vocab": facts.n_vocab,
            "n_embd": facts.n_embd,
            "n_head": facts.n_head,
        }

    def embed(self, req: EmbedRequest) -> EmbedResult:
        # Llama.embed on the generation instance would wipe the resident KV.
        raise UnsupportedFeature("embeddings are served by the embedding side slot, not the llama generation model")

    def close(self) -> None:
        return None
