"""Model formats, each declared once: how a model of that kind is told on disk, which of a repository's files make one,
how a reference names it, and what its header says.

A format is named by its ``kind``, the word a stored model's manifest records (``format``) and ``--backend auto``
weighs (``EngineFacts.model_kind``). Engines list the formats they read (``EngineSpec.formats``); the store,
``modeld pull`` and ``auto`` ask the registered engines' formats (``backends.registry.model_formats``) and name
none. Two are built in: ``GGUF`` (a ``.gguf`` file, a split one's parts with it; llama.cpp and OpenVINO read it)
and ``OPENVINO_IR`` (a directory holding ``openvino_model.xml``; OpenVINO's own). A format that is a directory
marked by one file is a ``MarkedDirectory``; an engine with such a format of its own declares one in its spec.

This module stays light (the engines' specs and the registry import it): no engine package, no ``gguf`` until a
header is read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GGUF", "OPENVINO_IR", "Choice", "Gguf", "MarkedDirectory", "ModelFormat", "find_projector", "is_projector",
           "quant_of"]


@dataclass(frozen=True)
class Choice:
    """One model a repository (or a local path) offers in one format: what a pull fetches and a load opens."""

    #: its format's kind ("gguf", "ir", …)
    kind: str
    #: the files, in the repository's paths; a split GGUF's parts in order
    files: tuple[str, ...]
    #: the quant the model's name carries ("" when none)
    quant: str = ""
    #: what a load opens: the file (a split GGUF's first part) or the directory ("" for the repository root)
    primary: str = ""
    sizes: tuple[int, ...] = field(default=())


class ModelFormat:
    """How models of one kind are stored. Subclasses say how they are told apart; the base holds the names."""

    #: the manifest's ``format`` and ``EngineFacts.model_kind``
    kind: str = ""
    #: how messages name one ("a GGUF file")
    title: str = ""
    #: kinds earlier manifests recorded for it
    aliases: tuple[str, ...] = ()
    #: repository-name endings that only say the format (``-GGUF``, ``-ov``): a pulled model's default name drops them
    repo_suffixes: tuple[str, ...] = ()

    def is_model(self, path: Path) -> bool:
        """Whether ``path`` on disk is a model of this format."""
        raise NotImplementedError

    def choices(self, files: Mapping[str, int]) -> list[Choice]:
        """The models of this format among a repository's ``files`` (path → size)."""
        raise NotImplementedError

    def names(self, file: str) -> bool:
        """Whether a reference's file part (``user/repo/FILE``) can name a model of this format."""
        raise NotImplementedError

    def named_by(self, choice: Choice, file: str) -> bool:
        """Whether a reference's file part names ``choice``."""
        return file in choice.files

    def reference_file(self, choice: Choice) -> str:
        """The file part a reference to ``choice`` writes after ``user/repo/``."""
        return choice.primary

    def label(self, choice: Choice) -> str:
        """How ``choice`` is named in a list of a repository's models."""
        return choice.primary

    def local(self, path: Path) -> Choice:
        """A local model of this format as a choice; a file's paths relative to its folder, a directory's to itself.
        ValueError when ``path`` is not one, with what to name instead."""
        raise NotImplementedError

    def facts(self, path: Path) -> dict[str, Any]:
        """What its header or config says: ``architecture``, ``context`` (trained) and ``layers``, where it does."""
        return {}


#: a repository's projectors in the order one is chosen when it has several (16-bit first: what the Hub's
#: vision repositories ship, and llama-server's ``-hf`` takes); then any other, by name
_PROJECTOR_ORDER = ("f16", "bf16", "q8_0", "f32")


def is_projector(path: str) -> bool:
    """A multimodal projector GGUF (a vision model's image encoder), by the Hub's naming: ``mmproj`` in its name."""
    name = path.rpartition("/")[2].lower()
    return "mmproj" in name and name.endswith(".gguf")


def find_projector(model: Path) -> Path | None:
    """The projector beside ``model`` (``is_projector``), as the Hub's repositories and ``modeld pull`` lay them
    out; None when there is none, or more than one."""
    found = sorted(p for p in model.parent.glob("*.gguf") if is_projector(p.name) and p != model)
    return found[0] if len(found) == 1 else None


def _projectors(files: Mapping[str, int]) -> dict[str, str]:
    """Per folder of a repository, the projector a model there comes with (``_PROJECTOR_ORDER``)."""
    found: dict[str, list[str]] = {}
    for path in sorted(files):
        if is_projector(path):
            found.setdefault(path.rpartition("/")[0], []).append(path)

    def rank(path: str) -> tuple[int, str]:
        name = path.rpartition("/")[2].lower()
        return next((i for i, q in enumerate(_PROJECTOR_ORDER) if re.search(rf"(^|[-_.]){q}([-_.]|$)", name)),
                    len(_PROJECTOR_ORDER)), path

    return {folder: min(paths, key=rank) for folder, paths in found.items()}


#: the file name of a split GGUF's part: ``-00001-of-00003.gguf``
_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
#: a quantization name as GGUF files carry it: Q4_K_M, IQ3_XXS, Q8_0, F16, BF16, TQ1_0, MXFP4 …
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32|TQ\d_\d|MXFP4(?:_MOE)?)(?=[-.]|$)",
                    re.IGNORECASE)


def quant_of(filename: str) -> str:
    """The quantization a GGUF's file name carries (upper case), else ""."""
    stem = _PART.sub(".gguf", Path(filename).name)
    found = _QUANT.findall(stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem)
    return found[-1].upper() if found else ""


class Gguf(ModelFormat):
    """A ``.gguf`` file; a split one is its numbered parts, loaded by the first."""

    kind = "gguf"
    title = "a GGUF file"
    repo_suffixes = ("-gguf", "_gguf", ".gguf")

    def is_model(self, path: Path) -> bool:
        from .gguf_file import is_gguf

        return path.is_file() and is_gguf(path)

    def choices(self, files: Mapping[str, int]) -> list[Choice]:
        out: list[Choice] = []
        parts: dict[str, list[tuple[int, str]]] = {}
        projectors = _projectors(files)
        for path in sorted(files):
            if not path.lower().endswith(".gguf") or is_projector(path):
                continue
            m = _PART.search(path)
            if m:
                parts.setdefault(path[: m.start()], []).append((int(m.group(1)), path))
            else:
                out.append(Choice(self.kind, (path,), quant_of(path), path, (files[path],)))
        for _, numbered in sorted(parts.items()):
            ordered = tuple(p for _, p in sorted(numbered))
            out.append(Choice(self.kind, ordered, quant_of(ordered[0]), ordered[0], tuple(files[p] for p in ordered)))
        # a vision model's projector (its image encoder) comes with it, beside it, where the load finds it
        with_projector = []
        for c in out:
            extra = projectors.get(c.primary.rpartition("/")[0])
            with_projector.append(c if extra is None else Choice(c.kind, (*c.files, extra), c.quant, c.primary,
                                                                 (*c.sizes, files[extra])))
        return with_projector

    def names(self, file: str) -> bool:
        return file.lower().endswith(".gguf")

    def label(self, choice: Choice) -> str:
        return f"{choice.primary} ({len(choice.files)} parts)" if len(choice.files) > 1 else choice.primary

    def local(self, path: Path) -> Choice:
        found = [c for c in self.choices({p.name: p.stat().st_size for p in path.parent.iterdir() if p.is_file()})
                 if path.name in c.files]
        if not found:
            raise ValueError(f"{path} is not a GGUF file (its name ends in .gguf)")
        if found[0].primary != path.name:
            raise ValueError(f"{path} is part of a split GGUF: name its first part, {path.parent / found[0].primary}")
        return found[0]

    def facts(self, path: Path) -> dict[str, Any]:
        from .gguf_file import gguf_scalars
        from .tape.loading import source_capabilities

        sc = gguf_scalars(path)
        arch = str(sc.get("general.architecture", ""))
        return {"architecture": arch, "context": int(sc.get(f"{arch}.context_length", 0) or 0),
                "layers": int(sc.get(f"{arch}.block_count", 0) or 0),
                "capabilities": source_capabilities(str(sc.get("tokenizer.chat_template", "") or ""))}


@dataclass(frozen=True)
class MarkedDirectory(ModelFormat):
    """A directory told by one file in it (``marker``); a repository's copy is that file's folder, flat, without any
    GGUF beside it. Its architecture, context and layers are read from a Hugging Face ``config.json`` when one is there.
    """

    kind: str = ""
    title: str = ""
    marker: str = ""
    aliases: tuple[str, ...] = ()
    repo_suffixes: tuple[str, ...] = ()

    def is_model(self, path: Path) -> bool:
        return path.is_dir() and (path / self.marker).is_file()

    def choices(self, files: Mapping[str, int]) -> list[Choice]:
        out = []
        for path in sorted(files):
            if path == self.marker or path.endswith("/" + self.marker):
                folder = path[: -len(self.marker)].rstrip("/")
                start = len(folder) + 1 if folder else 0
                inside = tuple(p for p in sorted(files) if (not folder or p.startswith(folder + "/"))
                               and "/" not in p[start:] and not p.lower().endswith(".gguf"))
                out.append(Choice(self.kind, inside, "", folder, tuple(files[p] for p in inside)))
        return out

    def names(self, file: str) -> bool:
        return file == self.marker or file.endswith("/" + self.marker)

    def named_by(self, choice: Choice, file: str) -> bool:
        return self.names(file) and choice.primary == file[: -len(self.marker)].rstrip("/")

    def reference_file(self, choice: Choice) -> str:
        return f"{choice.primary}/{self.marker}" if choice.primary else self.marker

    def label(self, choice: Choice) -> str:
        return f"{self.title.removeprefix('an ').removeprefix('a ')} in {choice.primary or '/'}"

    def local(self, path: Path) -> Choice:
        if not self.is_model(path):
            raise ValueError(f"{path} is a directory without an {self.marker}: not {self.title}")
        return Choice(self.kind, tuple(sorted(p.name for p in path.iterdir() if p.is_file())), "", "")

    def facts(self, path: Path) -> dict[str, Any]:
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return {}
        return {"architecture": str(cfg.get("model_type", "")), "context": int(cfg.get("max_position_embeddings", 0)),
                "layers": int(cfg.get("num_hidden_layers", 0))}


GGUF = Gguf()
#: what ``openvino_genai.LLMPipeline`` loads; "openvino" is what manifests recorded before the kind was "ir"
OPENVINO_IR = MarkedDirectory(kind="ir", title="an OpenVINO IR directory", marker="openvino_model.xml",
                              aliases=("openvino",), repo_suffixes=("-ov", "-openvino", "_ov"))
