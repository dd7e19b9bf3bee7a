"""Convert a GGUF into an OpenVINO IR directory once, and find it again later.

openvino-genai builds an OpenVINO graph straight from a GGUF (``llama``, ``qwen2``
and ``qwen3`` architectures, byte-level BPE vocabularies). That conversion takes seconds on every load,
but ``LLMPipeline(gguf, enable_save_ov_model=True)`` also serialises what it
built — ``openvino_model.xml/.bin`` (the stateful LLM), and
``openvino_tokenizer.xml/.bin`` / ``openvino_detokenizer.xml/.bin`` (with the chat
template in their rt_info) — into the GGUF's own directory. We want neither the
conversion cost on every load nor files written into site-packages, so:

* the IR lives in ``model_cache_dir()/ov/<first 16 hex of the GGUF's sha256>/``;
* GenAI is pointed at a symlink to the GGUF inside a private temporary
  directory next to that target, so "the GGUF's directory" is ours;
* a ``config.json`` with the HF-style shape keys (from the GGUF header) is added,
  because the IR itself does not record the training context and the backend's
  ``describe`` reads it; ``modeld_ir.json`` is written last and marks the
  directory complete;
* the temporary directory is renamed into place in one step, so a reader never
  sees a half-written IR, and two processes racing to prepare the same GGUF
  both end up using whichever rename won.

``python -m backends.openvino.prepare [GGUF]`` (or ``modeld prepare``) prepares the bundled model (or GGUF) and
prints the IR directory; ``make setup`` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..bundled import bundled_gguf_path, model_cache_dir
from ..digest import file_digest
from ..gguf_file import GGUFFacts, is_gguf, read_gguf

__all__ = [
    "IR_FILES",
    "MARKER_FILE",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "ConversionError",
    "check_convertible",
    "ir_dir_for",
    "is_complete_ir",
    "main",
    "prepare_ir",
]

#: files openvino-genai needs to serve an IR directory (each .xml has its .bin)
IR_FILES: tuple[str, ...] = (
    "openvino_model.xml",
    "openvino_model.bin",
    "openvino_tokenizer.xml",
    "openvino_tokenizer.bin",
    "openvino_detokenizer.xml",
    "openvino_detokenizer.bin",
)
#: written last; its presence means the directory is complete
MARKER_FILE = "modeld_ir.json"
#: what openvino-genai's GGUF reader builds (gguf_utils/gguf_modeling.cpp)
SUPPORTED_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3"})
#: tensor types gguf.cpp unpacks natively or through gguflib
SUPPORTED_TENSOR_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"})
_DIGEST_CHARS = 16


class ConversionError(RuntimeError):
    """The GGUF cannot be converted (unsupported content or a failed conversion)."""


def ir_dir_for(gguf_digest: str, cache_dir: Path | None = None) -> Path:
    """Where the IR of the GGUF with ``gguf_digest`` ("sha256:<hex>") lives."""
    hexpart = gguf_digest.split(":", 1)[-1]
    return (cache_dir or model_cache_dir()) / "ov" / hexpart[:_DIGEST_CHARS]


def is_complete_ir(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in (*IR_FILES, MARKER_FILE))


def check_convertible(facts: GGUFFacts) -> None:
    """Refuse, with the reason, a GGUF that openvino-genai's reader would reject or mis-read."""
    problems: list[str] = []
    if facts.architecture not in SUPPORTED_ARCHITECTURES:
        problems.append(
            f"architecture {facts.architecture!r} is not one of {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if facts.tokenizer_model != "gpt2":
        problems.append(f"tokenizer model {facts.tokenizer_model!r} is not byte-level BPE ('gpt2')")
    bad = sorted(facts.tensor_types - SUPPORTED_TENSOR_TYPES)
    if bad:
        problems.append(f"tensor types {bad} are not readable (supported: {sorted(SUPPORTED_TENSOR_TYPES)})")
    if problems:
        raise ConversionError("openvino-genai cannot convert this GGUF: " + "; ".join(problems))


def _hf_config(facts: GGUFFacts) -> dict[str, Any]:
    """The HF ``config.json`` keys describe() reads, from the GGUF header."""
    return {
        "model_type": facts.architecture,
        "max_position_embeddings": facts.shape.n_ctx_train,
        "num_hidden_layers": facts.shape.n_layer,
        "num_attention_heads": facts.shape.n_head,
        "num_key_value_heads": facts.shape.n_head_kv,
        "hidden_size": facts.shape.n_embd,
        "head_dim": facts.shape.head_dim_k,
        "bos_token_id": facts.bos_token_id,
        "eos_token_id": facts.eos_token_id,
    }


def prepare_ir(
    gguf: str | os.PathLike[str],
    *,
    cache_dir: Path | None = None,
    digest: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The IR directory for ``gguf``, converting it first when it is not cached.

    ``digest`` saves re-hashing when the caller already knows it. Raises
    ``ConversionError`` for an unconvertible GGUF, ``FileNotFoundError`` for a
    missing one, and whatever openvino-genai raises (RuntimeError) when the
    conversion itself fails; the backend maps those to ModelLoadFailed.
    """
    src = Path(gguf).resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF not found: {gguf}")
    if not is_gguf(src):
        raise ConversionError(f"{gguf} is not a GGUF file (bad magic)")
    root = cache_dir or model_cache_dir()
    digest = digest or file_digest(src, root)
    target = ir_dir_for(digest, root)
    if is_complete_ir(target):
        return target
    facts = read_gguf(src)
    check_convertible(facts)
    if progress is not None:
        progress(f"converting {src.name} to OpenVINO IR in {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        t0 = time.perf_counter()
        _convert(src, tmp)
        missing = [f for f in IR_FILES if not (tmp / f).is_file()]
        if missing:
            raise ConversionError(f"openvino-genai did not write {missing} for {src}")
        (tmp / "config.json").write_text(json.dumps(_hf_config(facts), indent=2, sort_keys=True))
        (tmp / MARKER_FILE).write_text(
            json.dumps(
                {
                    "source_gguf": str(src),
                    "source_digest": digest,
                    "openvino_genai": _genai_version(),
                    "convert_seconds": round(time.perf_counter() - t0, 3),
                },
                indent=2,
                sort_keys=True,
            )
        )
        if target.exists() and not is_complete_ir(target):
            shutil.rmtree(target)  # a leftover from an interrupted run of an older layout
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete_ir(target):
                raise
            # Another process finished the same conversion first; use its copy.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(src: Path, workdir: Path) -> None:
    import openvino_genai  # heavy; only a conversion needs it

    link = workdir / "model.gguf"
    link.symlink_to(src)
    # SDPA skips the paged-attention scheduler's KV pre-allocation: we only want the
    # side effect of enable_save_ov_model, which writes next to ``link``.
    pipe = openvino_genai.LLMPipeline(str(link), "CPU", ATTENTION_BACKEND="SDPA", enable_save_ov_model=True)
    del pipe
    link.unlink()


def _genai_version() -> str:
    import openvino_genai

    return str(openvino_genai.__version__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert a GGUF (default: the bundled model) to an OpenVINO IR once.")
    parser.add_argument("gguf", nargs="?", help="GGUF file; default: the bundled SmolLM2 model")
    args = parser.parse_args(argv)
    try:
        src = Path(args.gguf) if args.gguf else bundled_gguf_path()
        t0 = time.perf_counter()
        out = prepare_ir(src, progress=lambda msg: print(msg, file=sys.stderr))
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"ov_prepare: {exc}", file=sys.stderr)
        return 1
    print(out)
    print(f"ov_prepare: ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
