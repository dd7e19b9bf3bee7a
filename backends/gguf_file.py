"""GGUF files: metadata for planning and identity, read without loading weights.

Two readers, both here: ``read_gguf`` parses the whole header with the ``gguf``
package (every array too: ~2 s for the bundled model's vocabulary, so its
result is cached per file by ``gguf_facts``); ``gguf_scalars`` reads only the
scalar keys straight from the mapped header in a few milliseconds, for a load
that needs a handful of numbers before the engine opens the file itself.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.sizing import ModelShape

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFFacts:
    """A GGUF header: the model's shape and what else the engines read there (template, tokenizer, tensor types).

    Kept apart from ``ModelShape``: conversion, templates and embeddings read the rest of the header."""

    architecture: str
    shape: ModelShape
    file_bytes: int
    chat_template: str
    tokenizer_model: str
    tokenizer_pre: str
    bos_token_id: int
    eos_token_id: int
    add_bos_token: bool | None
    pooling_type: int
    tensor_types: frozenset[str]
    raw: dict[str, Any]
    #: the text of every control and user-defined token (turn markers such as ``<start_of_turn>``)
    control_tokens: frozenset[str] = frozenset()


def is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_gguf(path: str | Path) -> GGUFFacts:
    """Scalar metadata and tensor totals; raises ValueError for a file that is not a valid GGUF."""
    from gguf import GGUFReader  # imported lazily: only the backends need it

    p = Path(path)
    if not is_gguf(p):
        raise ValueError(f"{p} is not a GGUF file (bad magic)")
    try:
        reader = GGUFReader(str(p), "r")
    except Exception as exc:  # gguf raises ValueError/IndexError/struct.error on truncation
        raise ValueError(f"{p} is not a readable GGUF: {type(exc).__name__}: {exc}") from exc
    raw: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name in (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores",
        ):
            continue  # large arrays we never need here
        try:
            raw[name] = fld.contents()
        except Exception:  # an exotic field type; irrelevant for planning
            continue
    arch = str(raw.get("general.architecture", ""))

    def g(key: str, default: Any = 0) -> Any:
        return raw.get(f"{arch}.{key}", default)

    n_head = int(g("attention.head_count", 0) or 0)
    n_head_kv_raw = g("attention.head_count_kv", n_head)
    n_head_kv = int(max(n_head_kv_raw) if isinstance(n_head_kv_raw, list) else n_head_kv_raw)
    n_embd = int(g("embedding_length", 0) or 0)
    head_default = n_embd // n_head if n_head else 0
    shape = ModelShape(
        n_ctx_train=int(g("context_length", 0) or 0),
        n_layer=int(g("block_count", 0) or 0),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=int(g("attention.key_length", head_default) or head_default),
        head_dim_v=int(g("attention.value_length", head_default) or head_default),
        weights_bytes=int(sum(int(t.n_bytes) for t in reader.tensors)),
        n_embd=n_embd,
        # The token list's length, without decoding the strings.
        n_vocab=len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0,
        sliding_window=int(g("attention.sliding_window", 0) or 0),
    )
    return GGUFFacts(
        architecture=arch,
        shape=shape,
        file_bytes=p.stat().st_size,
        chat_template=str(raw.get("tokenizer.chat_template", "") or ""),
        tokenizer_model=str(raw.get("tokenizer.ggml.model", "")),
        tokenizer_pre=str(raw.get("tokenizer.ggml.pre", "")),
        bos_token_id=int(raw.get("tokenizer.ggml.bos_token_id", -1)),
        eos_token_id=int(raw.get("tokenizer.ggml.eos_token_id", -1)),
        add_bos_token=(bool(raw["tokenizer.ggml.add_bos_token"]) if "tokenizer.ggml.add_bos_token" in raw else None),
        pooling_type=int(g("pooling_type", -1)),
        tensor_types=frozenset(t.tensor_type.name for t in reader.tensors),
        raw=raw,
        control_tokens=_control_tokens(reader),
    )


#: token types (``gguf.TokenType``) whose text the tokenizer keeps whole: CONTROL, USER_DEFINED
_WHOLE_TOKEN_TYPES = (3, 4)


def _control_tokens(reader: Any) -> frozenset[str]:
    """The texts of the vocabulary's control and user-defined tokens (empty when the header has no vocabulary)."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    types = reader.fields.get("tokenizer.ggml.token_type")
    if tokens is None or types is None or len(tokens.data) != len(types.data):
        return frozenset()
    return frozenset(
        bytes(tokens.parts[tokens.data[i]]).decode("utf-8", "replace")
        for i, part in enumerate(types.data)
        if int(types.parts[part][0]) in _WHOLE_TOKEN_TYPES
    )


# --- cached facts -------------------------------------------------------------------------
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


def cached_gguf_facts(path: Path) -> GGUFFacts | None:
    """``gguf_facts`` only when it was already read (it costs ~2 s otherwise)."""
    st = path.stat()
    with _facts_lock:
        return _facts_cache.get((str(path.resolve()), st.st_size, st.st_mtime_ns))


# --- the scalar fast path ---------------------------------------------------------------
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
            return _parse_gguf_scalars(buf)[0]
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise ValueError(f"{path} has a truncated or corrupt GGUF header: {exc}") from exc


def patch_scalars(path: str | os.PathLike[str], values: dict[str, int | float]) -> None:
    """Overwrite scalar metadata of the GGUF at ``path`` in place, each in the type the file already has.

    Only keys present as scalars can be patched (KeyError otherwise): the header keeps its size, so the
    tensors stay where they are.
    """
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as buf:
        where: dict[str, tuple[int, int]] = {}
        _parse_gguf_scalars(buf, where)
        for key, value in values.items():
            if key not in where:
                raise KeyError(f"{path} has no scalar {key!r} to patch")
            vtype, off = where[key]
            struct.pack_into(_GGUF_SCALARS[vtype], buf, off, value)
        buf.flush()


def gguf_layout_digest(path: str | os.PathLike[str]) -> str:
    """What a GGUF computes per token, not with which values: a digest of its architecture's scalars and
    its tensor table (each tensor's name, dimensions and type); a few ms.

    Two files that differ only in their weights' values or in tokenizer and general metadata (another chat
    template, name or license) have the same layout, so they cost the same to run. ValueError for a file
    that is not a readable GGUF.
    """
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            scalars, off = _parse_gguf_scalars(buf)
            (n_tensors,) = struct.unpack_from("<Q", buf, 8)
            arch = str(scalars.get("general.architecture", ""))
            h = hashlib.sha256(repr(sorted((k, v) for k, v in scalars.items() if k.startswith(arch + "."))).encode())
            for _ in range(n_tensors):
                (n,) = struct.unpack_from("<Q", buf, off)
                (n_dims,) = struct.unpack_from("<I", buf, off + 8 + n)
                info_end = off + 8 + n + 4 + 8 * n_dims + 4  # name, dims and type; the data offset left out
                if info_end > len(buf):
                    raise IndexError("the tensor table runs past the end of the file")
                h.update(bytes(buf[off:info_end]))
                off = info_end + 8
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise ValueError(f"{path} has a truncated or corrupt GGUF header: {exc}") from exc
    return "sha256:" + h.hexdigest()


def _parse_gguf_scalars(buf: mmap.mmap, where: dict[str, tuple[int, int]] | None = None) -> tuple[dict[str, Any], int]:
    """Scalar and string keys, and the offset where the metadata ends (the tensor table's start); ``where``
    (when given) receives each scalar's (value type, offset)."""
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
            if where is not None:
                where[key] = (vtype, off)
        elif vtype == _GGUF_STRING:
            out[key], _ = string(off)
        off = skip(vtype, off)
        if off > len(buf):
            raise IndexError("metadata runs past the end of the file")
    return out, off


#: GGUF keys a model's publisher sets for its recommended sampling (llama.cpp reads the same keys)
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repeat_penalty",
    "general.sampling.penalty_last_n": "repeat_last_n",
}


def recommended_sampling(scalars: dict[str, Any]) -> dict[str, float | int]:
    """The sampling a GGUF's publisher recommends (``general.sampling.*``), by ``DecodeConfig`` field name."""
    found: dict[str, float | int] = {}
    for key, name in _SAMPLING_KEYS.items():
        value = scalars.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        found[name] = int(value) if name in ("top_k", "repeat_last_n") else float(value)
    return found

