"""llama-cpp-python at the C boundary: log capture, error translation, and a ``Llama`` with the params it hides.

* llama.cpp reports the reason for a failed load or context creation only
  through its log callback (Python sees "Failed to load model from file"); a
  callback chained in front of llama-cpp-python's own keeps the recent warnings
  and errors, and ``map_errors`` quotes them in the typed error.
* ``map_errors`` is the one place llama-cpp-python / jinja2 / OS exceptions
  become contract errors, most specific first.
* This llama-cpp-python build segfaults in ``ggml_backend_amx_mul_mat`` on CPUs
  that report AMX (seen in a Firecracker VM with AMX-INT8, Q4_1 weights).
  Extra weight buffer types (AMX/repack) are therefore disabled when the build
  reports ``AMX_INT8 = 1``; ``MODELD_LLAMA_EXTRA_BUFTS=1|0`` overrides.
  ``Llama`` exposes neither that switch nor a load-progress callback, so
  ``open_llama`` sets both on the model params through a property on a subclass.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp import _logger as llama_logger

from contract.errors import (
    Cancelled,
    ContextOverflow,
    InsufficientMemory,
    Internal,
    InvalidArgument,
    ModeldError,
    ModelLoadFailed,
)

__all__ = [
    "KV_GGML_TYPES",
    "ParamsLlama",
    "extra_bufts_default",
    "gpu_offload",
    "install_mtmd_log",
    "log_mark",
    "log_since",
    "map_errors",
    "open_llama",
    "runtime_version",
    "system_info",
]

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


_mtmd_log_installed = False


def install_mtmd_log() -> None:
    """llama.cpp's multimodal library logs through the same capture (its warnings and errors kept for errors)."""
    global _mtmd_log_installed
    _install_log_capture()
    with _log_lock:
        if not _mtmd_log_installed:
            import llama_cpp.mtmd_cpp as mt

            mt.mtmd_log_set(_c_log_callback, ctypes.c_void_p(0))
            mt.mtmd_helper_log_set(_c_log_callback, ctypes.c_void_p(0))
            _mtmd_log_installed = True


def log_mark() -> int:
    return _log_seq


def log_since(mark: int) -> str:
    lines = [text for seq, text in list(_LOG_TAIL) if seq > mark and text]
    return ("; llama.cpp said: " + " | ".join(lines[-6:])) if lines else ""


# --- the one place foreign exceptions become typed errors ------------------------------
@contextlib.contextmanager
def map_errors(action: str, *, loading: bool = False) -> Iterator[None]:
    """Translate llama-cpp-python / jinja2 / OS exceptions into modeld errors.

    Most specific first; typed errors pass through untouched. While ``loading``
    every failure is a ModelLoadFailed carrying llama.cpp's own log lines.
    """
    mark = log_mark()
    try:
        yield
    except ModeldError:
        raise
    except jinja2.TemplateError as exc:
        raise InvalidArgument(f"{action}: the model's chat template failed: {exc}") from exc
    except MemoryError as exc:
        raise InsufficientMemory(f"{action}: out of memory") from exc
    except (OSError, ValueError, RuntimeError, TypeError) as exc:
        msg = f"{action}: {type(exc).__name__}: {exc}{log_since(mark)}"
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


def extra_bufts_default() -> bool:
    env = os.environ.get("MODELD_LLAMA_EXTRA_BUFTS", "").strip().lower()
    if env in ("1", "true", "on", "yes"):
        return True
    if env in ("0", "false", "off", "no"):
        return False
    # See the module docstring: the AMX matmul of this build crashes the process.
    return "AMX_INT8 = 1" not in system_info()


def gpu_offload() -> bool:
    """Whether this llama.cpp build can offload layers to a GPU (a CUDA, Metal or Vulkan build; not a CPU one)."""
    return bool(llama_cpp.llama_supports_gpu_offload())


def system_info() -> str:
    return bytes(llama_cpp.llama_print_system_info()).decode("utf-8", "replace").strip()


class LayerTap:
    """Copies of chosen layers' outputs (llama.cpp's ``l_out-N`` tensors), taken through the context's graph
    evaluation callback (``cb_eval``) while ``active``.

    The callback is asked about every graph node before it runs; it wants only the listed layers' outputs, and
    only while active, so a context built with it computes as one without it (the scheduler splits the graph at
    a wanted node only). ``rows`` then holds, per layer, its rows in the order the micro-batches ran.
    """

    def __init__(self, layers: list[int]) -> None:
        import llama_cpp._ggml as ggml

        lib = ggml.libggml
        lib.ggml_get_name.restype = ctypes.c_char_p
        lib.ggml_get_name.argtypes = [ctypes.c_void_p]
        lib.ggml_nbytes.restype = ctypes.c_size_t
        lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_tensor_get.restype = None
        lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self._lib = lib
        self._wanted = {f"l_out-{n}".encode(): n for n in layers}
        self.active = False
        self.rows: dict[int, list[np.ndarray]] = {}
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_node)

    def _on_node(self, tensor: int, ask: bool, _user: Any) -> bool:
        # Called from llama.cpp's compute thread with the GIL taken; an exception cannot cross C, so none escapes.
        try:
            layer = self._wanted.get(self._lib.ggml_get_name(tensor)) if self.active else None
            if ask or layer is None:
                return layer is not None
            size = int(self._lib.ggml_nbytes(tensor))
            out = np.empty(size // 4, np.float32)  # l_out is float32 on every backend
            self._lib.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, size)
            self.rows.setdefault(layer, []).append(out)
        except Exception:  # noqa: BLE001 - see above; a missing row shows as a short readout
            pass
        return True

    def take(self, hidden: int) -> dict[int, np.ndarray]:
        """Each layer's rows since the last take, ``[n_tokens, hidden]``."""
        rows, self.rows = self.rows, {}
        return {layer: np.concatenate(parts).reshape(-1, hidden) for layer, parts in rows.items()}


class ParamsLlama(Llama):
    """``Llama`` whose model params get a progress callback and the extra-buffer switch, and whose context params
    a graph evaluation callback (``LayerTap``).

    ``Llama.__init__`` creates ``self.model_params`` and loads the model in the same
    call; assigning through this property is the only point where the struct can
    be amended before llama.cpp reads it (``context_params`` likewise).
    """

    _pending_progress: Any = None
    _pending_extra_bufts: bool = True
    _pending_cb_eval: Any = None

    @property
    def context_params(self) -> Any:
        return self.__dict__["_modeld_context_params"]

    @context_params.setter
    def context_params(self, params: Any) -> None:
        if self._pending_cb_eval is not None:
            params.cb_eval = self._pending_cb_eval
        self.__dict__["_modeld_context_params"] = params

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
    tap: LayerTap | None = None,
    **llama_kwargs: Any,
) -> Llama:
    """A ``Llama`` for ``path`` with real load progress and this build's AMX workaround.

    ``llama_kwargs`` go to ``Llama`` unchanged (verbose defaults to False). Use it
    for any Llama in this process (tests' reference instances included), so every
    instance computes with the same kernels.
    """
    _install_log_capture()
    llama_kwargs.setdefault("verbose", False)
    cls: type[ParamsLlama] = type("_ConfiguredLlama", (ParamsLlama,), {})
    cls._pending_extra_bufts = extra_bufts_default() if extra_bufts is None else extra_bufts
    cls._pending_cb_eval = tap.callback if tap is not None else None
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
    llm.__dict__["_modeld_tap_ref"] = tap
    return llm
