"""The local model store: one directory per model under ``DATA_DIR/models``, its files and a manifest.

::

    models/
      aliases.json                      {"coder": "qwen2.5-coder-7b-instruct:q4_k_m"}
      .downloads/                       partial downloads, by content hash (a pull resumes from them)
      qwen2.5-coder-7b-instruct--q4_k_m/
        manifest.json                   StoredModel
        qwen2.5-coder-7b-instruct-q4_k_m.gguf

A model is in the store once its manifest is written, which happens last (after every file is
checked against its hash): a directory without one is an interrupted pull and is not listed.
Names are lower case; lookups take a name, an alias, or the reference the model was pulled by.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from backends.registry import model_format

__all__ = [
    "DOWNLOADS_DIR",
    "MANIFEST",
    "ModelStore",
    "StoreError",
    "StoredFile",
    "StoredModel",
    "check_name",
    "default_store_dir",
]

MANIFEST = "manifest.json"
ALIASES = "aliases.json"
DOWNLOADS_DIR = ".downloads"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._:+-]{0,127}$")


class StoreError(ValueError):
    """A store operation that cannot be done as asked (unknown name, a name taken, a bad name): the message says why."""


class StoredFile(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    #: the path inside the model's directory (as in the repository)
    name: str
    size: int = Field(ge=0)
    #: hex sha256 of the content, checked when the file came in
    sha256: str


class StoredModel(BaseModel):
    """A model's ``manifest.json``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    #: what it was pulled by: ``user/repo:QUANT``, ``user/repo/FILE.gguf`` or the local path it came from
    source: str
    #: the repository (``user/repo``), "" for a local import
    repo: str = ""
    #: the commit the files came from, "" for a local import
    revision: str = ""
    #: its format's kind (``backends.formats``): "gguf", "ir", …; an earlier manifest's "openvino" reads as "ir"
    format: str
    quant: str = ""
    #: what a load opens, inside the model's directory: the GGUF (a split one's first part) or the IR's folder
    primary: str
    files: list[StoredFile]
    size: int = Field(ge=0)
    #: the license the model card or the GGUF header declares ("" when neither does)
    license: str = ""
    #: when it came into the store, Unix time
    added: float = 0.0

    @field_validator("format")
    @classmethod
    def _current_kind(cls, kind: str) -> str:
        fmt = model_format(kind)
        return fmt.kind if fmt is not None else kind

    def path_in(self, directory: Path) -> Path:
        return directory / self.primary if self.primary else directory


def default_store_dir(data_dir: Path | None = None) -> Path:
    """``DATA_DIR/models``: ``data_dir``, else the daemon's (``modeld.settings.data_dir_of``: ``$MODELD_DATA_DIR``,
    else the config file's, else the platform's)."""
    from ..settings import data_dir_of

    return data_dir_of(data_dir) / "models"


def check_name(name: str) -> str:
    """``name`` as the store keeps it (lower case); StoreError when it is not one."""
    low = name.strip().lower()
    if not _NAME.match(low):
        raise StoreError(f"{name!r} is not a model name: lower-case letters, digits and . _ : + -, at most 128")
    return low


def _dir_name(name: str) -> str:
    return name.replace(":", "--")


class ModelStore:
    """The models in ``root`` (created on first write)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        #: the listing as of the root directory's mtime: a model or alias coming or going renames an entry
        #: in the root, which moves it (status reads the listing on every call)
        self._listing: tuple[int, list[tuple[Path, StoredModel]]] | None = None

    # --- reading --------------------------------------------------------------------------------
    def _entries(self) -> Iterator[tuple[Path, StoredModel]]:
        try:
            mtime = self.root.stat().st_mtime_ns
        except OSError:
            return
        if self._listing is None or self._listing[0] != mtime:
            self._listing = (mtime, list(self._scan()))
        yield from self._listing[1]

    def _scan(self) -> Iterator[tuple[Path, StoredModel]]:
        for d in sorted(self.root.iterdir()):
            m = d / MANIFEST
            if d.name.startswith(".") or not m.is_file():
                continue
            try:
                yield d, StoredModel.model_validate_json(m.read_bytes())
            except (OSError, ValidationError):
                continue  # a damaged manifest lists nothing rather than breaking every listing

    def models(self) -> list[StoredModel]:
        """Every stored model, by name."""
        return sorted((m for _, m in self._entries()), key=lambda m: m.name)

    def aliases(self) -> dict[str, str]:
        try:
            raw = json.loads((self.root / ALIASES).read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}

    def find(self, ref: str) -> tuple[StoredModel, Path] | None:
        """The stored model ``ref`` names (a name, an alias, or the reference it was pulled by) and its directory."""
        key = ref.strip().lower()
        key = self.aliases().get(key, key)
        by_source = None
        for d, m in self._entries():
            if m.name == key:
                return m, d
            if m.source.lower() == key:
                by_source = (m, d)
        return by_source

    def get(self, ref: str) -> tuple[StoredModel, Path]:
        """``find`` or StoreError listing what the store holds."""
        found = self.find(ref)
        if found is None:
            names = ", ".join(self.names()) or "nothing yet"
            raise StoreError(f"no model {ref!r} in the store ({self.root}); it holds: {names}")
        return found

    def names(self) -> list[str]:
        """The stored names, then the aliases."""
        return [m.name for m in self.models()] + sorted(self.aliases())

    def disk_usage(self) -> tuple[int, int]:
        """(models, bytes) held: the manifests' sizes (a partial download not counted)."""
        ms = self.models()
        return len(ms), sum(m.size for m in ms)

    # --- writing --------------------------------------------------------------------------------
    def staging(self, name: str) -> Path:
        """A fresh directory to assemble ``name`` in, on the store's filesystem (``commit`` moves it in place)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        d = self.root / f".staging-{_dir_name(check_name(name))}-{os.getpid()}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        return d

    def downloads(self) -> Path:
        d = self.root / DOWNLOADS_DIR
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return d

    def commit(self, staged: Path, model: StoredModel, *, replace: bool = False) -> Path:
        """Write ``model``'s manifest into ``staged`` and move it into the store; StoreError if the name is taken."""
        name = check_name(model.name)
        existing = self.check_free(name, replace=replace)
        if existing is not None:
            shutil.rmtree(existing)
        if name in self.aliases():
            raise StoreError(f"{name!r} is an alias in the store; remove it first (modeld alias --rm {name})")
        model = model.model_copy(update={"name": name, "added": model.added or time.time()})
        (staged / MANIFEST).write_text(model.model_dump_json(indent=2) + "\n")
        target = self.root / _dir_name(name)
        n = 1
        while target.exists():  # a directory without a manifest (an interrupted import), or a name's twin
            n += 1
            target = self.root / f"{_dir_name(name)}-{n}"
        staged.rename(target)
        return target

    def check_free(self, name: str, *, replace: bool = False) -> Path | None:
        """StoreError when a model is stored as ``name`` and ``replace`` is not given; else the directory a
        replace would delete (None: the name is free). A pull asks before it downloads, ``commit`` again."""
        existing = self.find(name)
        if existing is None or existing[0].name != name:
            return None
        if not replace:
            raise StoreError(f"{name!r} is already in the store (modeld rm {name}, or pull with another --name)")
        return existing[1]

    def remove(self, ref: str) -> StoredModel:
        """Delete the model ``ref`` names and the aliases leading to it."""
        model, d = self.get(ref)
        aliases = {k: v for k, v in self.aliases().items() if v != model.name}
        self._write_aliases(aliases)
        shutil.rmtree(d)
        return model

    def set_alias(self, alias: str, target: str) -> str:
        """Make ``alias`` name the stored model ``target`` names; returns the model's name."""
        alias = check_name(alias)
        model, _ = self.get(target)
        if any(m.name == alias for m in self.models()):
            raise StoreError(f"{alias!r} is a stored model's name, not free for an alias")
        self._write_aliases({**self.aliases(), alias: model.name})
        return model.name

    def remove_alias(self, alias: str) -> None:
        aliases = self.aliases()
        if alias.lower() not in aliases:
            raise StoreError(f"no alias {alias!r} in the store")
        del aliases[alias.lower()]
        self._write_aliases(aliases)

    def _write_aliases(self, aliases: dict[str, str]) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.root / f".{ALIASES}.{os.getpid()}"
        tmp.write_text(json.dumps(dict(sorted(aliases.items())), indent=2) + "\n")
        tmp.replace(self.root / ALIASES)
