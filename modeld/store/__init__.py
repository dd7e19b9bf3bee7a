"""The local model store: ``modeld pull`` brings models in by reference, the daemon loads them by name.

* ``refs``: what a reference is (``user/repo:QUANT``, ``user/repo/FILE.gguf``, a path) and how a
  repository's files become choices;
* ``store``: the directory per model and its manifest, aliases;
* ``pull``: the download, checked and resumable, through ``huggingface_hub``;
* ``catalog``: the names a daemon resolves (the store's, the bundled model, the preloaded one);
* ``cli``: ``modeld pull | ls | show | rm | alias``.
"""

from .catalog import Catalog, Known
from .store import ModelStore, StoredFile, StoredModel, StoreError, default_store_dir

__all__ = ["Catalog", "Known", "ModelStore", "StoreError", "StoredFile", "StoredModel", "default_store_dir"]
