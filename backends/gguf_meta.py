"""GGUF metadata for planning and identity, read without loading weights (``gguf`` package)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFFacts:
    architecture: str
    n_ctx_train: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd: int
    head_dim_k: int
    head_dim_v: int
    sliding_window: int
    weights_bytes: int
    file_bytes: int
    chat_template: str
    tokenizer_model: str
    tokenizer_pre: str
    bos_token_id: int
    eos_token_id: int
    add_bos_token: bool | None
    pooling_type: int
    n_vocab: int
    tensor_types: frozenset[str]
    raw: dict[str, Any]


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
    return GGUFFacts(
        architecture=arch,
        n_ctx_train=int(g("context_length", 0) or 0),
        n_layer=int(g("block_count", 0) or 0),
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_embd=n_embd,
        head_dim_k=int(g("attention.key_length", head_default) or head_default),
        head_dim_v=int(g("attention.value_length", head_default) or head_default),
        sliding_window=int(g("attention.sliding_window", 0) or 0),
        weights_bytes=int(sum(int(t.n_bytes) for t in reader.tensors)),
        file_bytes=p.stat().st_size,
        chat_template=str(raw.get("tokenizer.chat_template", "") or ""),
        tokenizer_model=str(raw.get("tokenizer.ggml.model", "")),
        tokenizer_pre=str(raw.get("tokenizer.ggml.pre", "")),
        bos_token_id=int(raw.get("tokenizer.ggml.bos_token_id", -1)),
        eos_token_id=int(raw.get("tokenizer.ggml.eos_token_id", -1)),
        add_bos_token=(bool(raw["tokenizer.ggml.add_bos_token"]) if "tokenizer.ggml.add_bos_token" in raw else None),
        pooling_type=int(g("pooling_type", -1)),
        # The token list's length, without decoding the strings.
        n_vocab=len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0,
        tensor_types=frozenset(t.tensor_type.name for t in reader.tensors),
        raw=raw,
    )
