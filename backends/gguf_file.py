"""GGUF files: metadata for planning and identity, read without loading weights.

Everything is read straight from the mapped header: ``read_gguf`` (the shape, template, tokenizer facts, the
tensor table) walks the vocabulary's arrays without decoding them, so it takes tens of milliseconds where the
``gguf`` package's reader, which turns every array element into a numpy view, took 2-3 s for the bundled model
(on every load and describe: ``tests/test_gguf_file.py`` holds the two readers equal); ``gguf_scalars`` reads
only the scalar keys, for a load that needs a handful of numbers before the engine opens the file itself.
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


#: arrays ``read_gguf`` leaves out of ``GGUFFacts.raw`` (the vocabulary: tens of thousands of elements)
_VOCAB_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                 "tokenizer.ggml.scores")


def read_gguf(path: str | Path) -> GGUFFacts:
    """Scalar metadata and tensor totals; raises ValueError for a file that is not a valid GGUF."""
    p = Path(path)
    if not is_gguf(p):
        raise ValueError(f"{p} is not a GGUF file (bad magic)")
    try:
        with open(p, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = _Header(buf)
            raw, arrays, off = header.metadata(skip=_VOCAB_ARRAYS)
            alignment = raw.get("general.alignment", 32)
            tensors = header.tensors(off, alignment if isinstance(alignment, int) and alignment > 0 else 32)
            control = header.control_tokens(arrays.get("tokenizer.ggml.tokens"), arrays.get("tokenizer.ggml.token_type"))
    except (struct.error, IndexError, UnicodeDecodeError, OverflowError, ValueError, KeyError, MemoryError) as exc:
        raise ValueError(f"{p} is not a readable GGUF: {type(exc).__name__}: {exc}") from exc
    arch = str(raw.get("general.architecture", ""))

    def g(key: str, default: Any = 0) -> Any:
        return raw.get(f"{arch}.{key}", default)

    n_head = int(g("attention.head_count", 0) or 0)
    n_head_kv_raw = g("attention.head_count_kv", n_head)
    n_head_kv = int(max(n_head_kv_raw) if isinstance(n_head_kv_raw, list) else n_head_kv_raw)
    n_embd = int(g("embedding_length", 0) or 0)
    head_default = n_embd // n_head if n_head else 0
    tokens = arrays.get("tokenizer.ggml.tokens")
    shape = ModelShape(
        n_ctx_train=int(g("context_length", 0) or 0),
        n_layer=int(g("block_count", 0) or 0),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=int(g("attention.key_length", head_default) or head_default),
        head_dim_v=int(g("attention.value_length", head_default) or head_default),
        weights_bytes=sum(n_bytes for _, n_bytes in tensors),
        n_embd=n_embd,
        n_vocab=tokens[2] if tokens is not None else 0,  # the token list's length, its strings left undecoded
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
        tensor_types=frozenset(name for name, _ in tensors),
        raw=raw,
        control_tokens=control,
    )


#: token types (``gguf.TokenType``) whose text the tokenizer keeps whole: CONTROL, USER_DEFINED
_WHOLE_TOKEN_TYPES = (3, 4)


class _Header:
    """The walk of a mapped GGUF header (the gguf specification's layout: magic, version, tensor and key
    counts, the key/value metadata, then the tensor table); every reader here goes through it."""

    def __init__(self, buf: mmap.mmap) -> None:
        if buf[:4] != GGUF_MAGIC:
            raise ValueError("bad GGUF magic")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        self.buf = buf
        self.n_tensors, self.n_kv = struct.unpack_from("<QQ", buf, 8)

    def string(self, at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self.buf, at)
        end = at + 8 + n
        if end > len(self.buf):
            raise IndexError("a string runs past the end of the file")
        return bytes(self.buf[at + 8 : end]).decode("utf-8"), end

    def skip(self, vtype: int, at: int) -> int:
        """The offset after a value, read no further than its lengths."""
        if vtype in _GGUF_SCALARS:
            return at + struct.calcsize(_GGUF_SCALARS[vtype])
        if vtype == _GGUF_STRING:
            (n,) = struct.unpack_from("<Q", self.buf, at)
            return at + 8 + int(n)
        if vtype == _GGUF_ARRAY:
            etype, count = struct.unpack_from("<IQ", self.buf, at)
            at += 12
            if etype in _GGUF_SCALARS:
                return at + int(count) * struct.calcsize(_GGUF_SCALARS[etype])
            if etype == _GGUF_STRING:  # a vocabulary: tens of thousands, so the loop stays tight
                for _ in range(count):
                    at += 8 + struct.unpack_from("<Q", self.buf, at)[0]
                return at
            for _ in range(count):
                at = self.skip(etype, at)
            return at
        raise ValueError(f"unknown GGUF value type {vtype}")

    def value(self, vtype: int, at: int) -> Any:
        """One value: a scalar, a string, or an array as a list (nested ones too)."""
        if vtype in _GGUF_SCALARS:
            return struct.unpack_from(_GGUF_SCALARS[vtype], self.buf, at)[0]
        if vtype == _GGUF_STRING:
            return self.string(at)[0]
        if vtype == _GGUF_ARRAY:
            etype, count = struct.unpack_from("<IQ", self.buf, at)
            at += 12
            if etype in _GGUF_SCALARS:
                return list(struct.unpack_from(f"<{count}{_GGUF_SCALARS[etype][1]}", self.buf, at))
            items = []
            for _ in range(count):
                items.append(self.value(etype, at))
                at = self.skip(etype, at)
            return items
        raise ValueError(f"unknown GGUF value type {vtype}")

    def entries(self) -> tuple[list[tuple[str, int, int]], int]:
        """Each metadata key with its value's type and offset, and the offset where the metadata ends (the
        tensor table's start)."""
        out = []
        off = 24
        for _ in range(self.n_kv):
            key, off = self.string(off)
            (vtype,) = struct.unpack_from("<I", self.buf, off)
            out.append((key, vtype, off + 4))
            off = self.skip(vtype, off + 4)
            if off > len(self.buf):
                raise IndexError("the metadata runs past the end of the file")
        return out, off

    def scalars(self, where: dict[str, tuple[int, int]] | None = None) -> tuple[dict[str, Any], int]:
        """Scalar and string keys, and the offset where the metadata ends; ``where`` (when given) receives each
        scalar's (value type, offset)."""
        entries, end = self.entries()
        out: dict[str, Any] = {}
        for key, vtype, at in entries:
            if vtype in _GGUF_SCALARS or vtype == _GGUF_STRING:
                out[key] = self.value(vtype, at)
            if where is not None and vtype in _GGUF_SCALARS:
                where[key] = (vtype, at)
        return out, end

    def metadata(self, skip: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, tuple[int, int, int]], int]:
        """Every key's value but the arrays in ``skip``, which are located instead (element type, offset of the
        first element, count); the offset where the metadata ends."""
        entries, end = self.entries()
        out: dict[str, Any] = {}
        located: dict[str, tuple[int, int, int]] = {}
        for key, vtype, at in entries:
            if vtype == _GGUF_ARRAY and key in skip:
                etype, count = struct.unpack_from("<IQ", self.buf, at)
                located[key] = (etype, at + 12, count)
            else:
                out[key] = self.value(vtype, at)
        return out, located, end

    def tensor_table(self, off: int) -> tuple[list[tuple[str, tuple[int, ...], int, int, int, int]], int]:
        """Each tensor's (name, dimensions, type, data offset, where its entry starts, where its name, dimensions
        and type end), and the offset where the table ends."""
        out = []
        for _ in range(self.n_tensors):
            name, at = self.string(off)
            (n_dims,) = struct.unpack_from("<I", self.buf, at)
            dims = struct.unpack_from(f"<{n_dims}Q", self.buf, at + 4)
            raw_type, data_at = struct.unpack_from("<IQ", self.buf, at + 4 + 8 * n_dims)
            typed_end = at + 4 + 8 * n_dims + 4
            out.append((name, dims, raw_type, data_at, off, typed_end))
            off = typed_end + 8
        if off > len(self.buf):
            raise IndexError("the tensor table runs past the end of the file")
        return out, off

    def tensors(self, off: int, alignment: int) -> list[tuple[str, int]]:
        """Each tensor's type name and size in bytes (elements × the type's bytes per block ÷ its block).

        ValueError when a tensor's data runs past the end of the file: a truncated download keeps its header,
        and an engine that maps the file would read past its end (OpenVINO's GGUF reader crashed the process)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # the type table: imported lazily

        table, end = self.tensor_table(off)
        out = []
        names: set[str] = set()
        extent = 0  # how far past the data section's start the tensors reach
        for name, dims, raw_type, data_at, _, _ in table:
            if name in names:
                raise ValueError(f"tensor {name!r} appears twice")
            names.add(name)
            ggml_type = GGMLQuantizationType(raw_type)
            block, type_bytes = GGML_QUANT_SIZES[ggml_type]
            n_elements = 1
            for d in dims:
                n_elements *= d
            n_bytes = n_elements * type_bytes // block
            extent = max(extent, data_at + n_bytes)
            out.append((ggml_type.name, n_bytes))
        data_start = -(-end // alignment) * alignment  # the data section begins at the next aligned offset
        if data_start + extent > len(self.buf):
            raise ValueError(f"its tensor data needs {data_start + extent:,} bytes and the file has "
                             f"{len(self.buf):,} (truncated?)")
        return out

    def control_tokens(self, tokens: tuple[int, int, int] | None,
                       types: tuple[int, int, int] | None) -> frozenset[str]:
        """The texts of the vocabulary's control and user-defined tokens (none without a vocabulary)."""
        if tokens is None or types is None or tokens[2] != types[2] or tokens[0] != _GGUF_STRING:
            return frozenset()
        etype, first, count = types
        if etype not in (4, 5):  # (u)int32, as the gguf writer stores token types
            return frozenset()
        kinds = struct.unpack_from(f"<{count}{_GGUF_SCALARS[etype][1]}", self.buf, first)
        wanted = {i for i, kind in enumerate(kinds) if kind in _WHOLE_TOKEN_TYPES}
        found = set()
        at = tokens[1]
        for i in range(count):
            end = self.skip(_GGUF_STRING, at)
            if i in wanted:
                found.add(bytes(self.buf[at + 8 : end]).decode("utf-8", "replace"))
            at = end
        return frozenset(found)


# --- cached facts -------------------------------------------------------------------------
_facts_cache: dict[tuple[str, int, int], GGUFFacts] = {}
_facts_lock = threading.Lock()


def gguf_facts(path: str | os.PathLike[str]) -> GGUFFacts:
    """``read_gguf`` cached per (resolved path, size, mtime)."""
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
    """``gguf_facts`` only when it was already read."""
    st = path.stat()
    with _facts_lock:
        return _facts_cache.get((str(path.resolve()), st.st_size, st.st_mtime_ns))


# --- the scalar fast path ---------------------------------------------------------------
# GGUF value types (gguf spec) and the struct codes of the scalar ones
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_scalars(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The scalar metadata of a GGUF header, arrays skipped; a few ms.

    A load needs only a handful of scalars before llama.cpp opens the file itself.
    ValueError for a file that is not a readable GGUF.
    """
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _Header(buf).scalars()[0]
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise ValueError(f"{path} has a truncated or corrupt GGUF header: {exc}") from exc


def patch_scalars(path: str | os.PathLike[str], values: dict[str, int | float]) -> None:
    """Overwrite scalar metadata of the GGUF at ``path`` in place, each in the type the file already has.

    Only keys present as scalars can be patched (KeyError otherwise): the header keeps its size, so the
    tensors stay where they are.
    """
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as buf:
        where: dict[str, tuple[int, int]] = {}
        _Header(buf).scalars(where)
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
            header = _Header(buf)
            scalars, off = header.scalars()
            arch = str(scalars.get("general.architecture", ""))
            h = hashlib.sha256(repr(sorted((k, v) for k, v in scalars.items() if k.startswith(arch + "."))).encode())
            for *_, start, typed_end in header.tensor_table(off)[0]:
                h.update(bytes(buf[start:typed_end]))  # name, dims and type; the data offset left out
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise ValueError(f"{path} has a truncated or corrupt GGUF header: {exc}") from exc
    return "sha256:" + h.hexdigest()


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
