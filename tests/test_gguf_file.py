"""backends.gguf_file: the header reader against the ``gguf`` package's own reader, on every model the tests use.

``read_gguf`` walks the mapped header itself (the vocabulary's arrays passed over, not decoded); the ``gguf``
package's ``GGUFReader``, which it replaced, decodes every element. Both must say the same of each file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends.gguf_file import read_gguf

gguf = pytest.importorskip("gguf")

#: the arrays the facts leave out (the vocabulary)
VOCAB = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def _models() -> list[Path]:
    """The bundled model (Q4_1; its copies differ only in metadata) and the embedding model (BERT, f16)."""
    from backends.bundled import bundled_gguf_path
    from backends.embed_prepare import default_embedding_gguf

    return [bundled_gguf_path(), default_embedding_gguf()]


def _reference(path: Path) -> dict[str, Any]:
    """What the ``gguf`` package reads of the file, in the facts' terms."""
    reader = gguf.GGUFReader(str(path), "r")
    raw = {name: f.contents() for name, f in reader.fields.items() if name not in VOCAB}
    tokens, types = reader.fields.get("tokenizer.ggml.tokens"), reader.fields.get("tokenizer.ggml.token_type")
    control = frozenset(
        bytes(tokens.parts[tokens.data[i]]).decode("utf-8", "replace")
        for i, part in enumerate(types.data) if int(types.parts[part][0]) in (3, 4)
    ) if tokens is not None and types is not None else frozenset()
    return {"raw": raw, "weights_bytes": sum(int(t.n_bytes) for t in reader.tensors),
            "tensor_types": frozenset(t.tensor_type.name for t in reader.tensors),
            "n_vocab": len(tokens.data) if tokens is not None else 0, "control_tokens": control}


def test_the_header_reader_says_what_the_gguf_package_reads() -> None:
    for path in _models():
        facts, want = read_gguf(path), _reference(path)
        got_raw = {k: v for k, v in facts.raw.items() if not k.startswith("GGUF.")}
        want_raw = {k: v for k, v in want["raw"].items() if not k.startswith("GGUF.")}  # the reader's own fields
        assert got_raw == want_raw, path
        assert facts.shape.weights_bytes == want["weights_bytes"], path
        assert facts.tensor_types == want["tensor_types"], path
        assert facts.shape.n_vocab == want["n_vocab"] > 0, path
        assert facts.control_tokens == want["control_tokens"], path
        assert facts.shape.n_layer > 0 and facts.shape.n_head > 0, path


def test_a_k_quant_s_tensor_sizes_fill_its_file() -> None:
    """Gemma 3 270M (Q4_K_M and others, sliding-window attention, a 262k vocabulary: the package's reader takes
    over ten seconds on it, so it is checked against the file itself): its tensors' sizes, summed from their
    types' block sizes, are the file's data section to within the alignment padding."""
    from backends.bundled import gemma_gguf_path

    path = gemma_gguf_path()
    facts = read_gguf(path)
    assert {"Q4_K", "Q6_K"} <= facts.tensor_types, facts.tensor_types
    assert (facts.architecture, facts.shape.n_vocab, facts.shape.sliding_window) == ("gemma3", 262144, 512)
    assert {"<start_of_turn>", "<end_of_turn>"} <= facts.control_tokens
    # what is not tensor data is the header (its 262k-token vocabulary: ~6 MB) and alignment padding; a type
    # sized wrong would be off by tens of MB (the weights are ~240 MB)
    slack = facts.file_bytes - facts.shape.weights_bytes
    assert 4 * 1024 * 1024 < slack < 12 * 1024 * 1024, slack


def test_a_truncated_or_foreign_file_is_refused(tmp_path: Path) -> None:
    from backends.bundled import bundled_gguf_path
    from harness.fixtures import truncated_gguf

    # the header whole, the tensor data cut (a download that stopped): engines that map it would read past its end
    half = truncated_gguf(bundled_gguf_path(), tmp_path / "half.gguf", 0.5)
    with pytest.raises(ValueError, match=r"tensor data needs .* \(truncated\?\)"):
        read_gguf(half)
    whole = tmp_path / "whole.gguf"
    whole.write_bytes(bundled_gguf_path().read_bytes())
    assert read_gguf(whole).shape.weights_bytes > 0
    last = tmp_path / "last.gguf"  # one byte short
    last.write_bytes(bundled_gguf_path().read_bytes()[:-1])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(last)
    head = bundled_gguf_path().read_bytes()[:200_000]  # the header stops inside the vocabulary
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        read_gguf(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="bad magic"):
        read_gguf(other)
