"""The models a daemon can load by name: the store's, the bundled one, and the one it was started with.

``resolve`` is what ``modeld load NAME`` (no ``--path``) and a request that names another model use
to find the files; ``names`` is what ``/v1/models`` lists. The store is read at each call: a model
pulled while the daemon runs is loadable at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from contract.types import ModelsStatus

from .store import ModelStore

__all__ = ["Catalog", "Known"]


@dataclass(frozen=True)
class Known:
    """A loadable model: its canonical name and what a load opens."""

    name: str
    path: str


@dataclass
class Catalog:
    store: ModelStore
    #: name → path of models that are not in the store (the bundled model, the one ``serve --model PATH`` named)
    extra: dict[str, str] = field(default_factory=dict)

    def resolve(self, name: str) -> Known | None:
        if not name:
            return None
        if name in self.extra:
            return Known(name, self.extra[name])
        found = self.store.find(name)
        if found is None:
            return None
        model, directory = found
        return Known(model.name, str(model.path_in(directory)))

    def models(self) -> list[str]:
        """The stored models' names, then the others'."""
        stored = [m.name for m in self.store.models()]
        return [*stored, *(n for n in self.extra if n not in stored)]

    def names(self) -> list[str]:
        """``models``, then the store's aliases."""
        return [*self.models(), *sorted(self.store.aliases())]

    def status(self) -> ModelsStatus:
        """``DaemonStatus.models``: the store's directory, its models and bytes, the names a request may give."""
        n, size = self.store.disk_usage()
        return {"dir": str(self.store.root), "models": n, "bytes": size, "names": self.models(),
                "aliases": self.store.aliases()}

    def add(self, name: str, path: str | Path) -> None:
        if name and self.store.find(name) is None:
            self.extra[name] = str(path)
