"""What ``modeld pull REF`` (and ``serve --model``, ``load``) accept, and how a repository's files become choices.

A reference is one of:

* ``user/repo:QUANT``: the GGUF in the Hugging Face repository whose file name carries that
  quantization (``Q4_K_M`` matches ``…-q4_k_m.gguf`` and the parts of a split one, not ``…-q4_k_m_l.gguf``);
* ``user/repo``: the repository's only model, else its ``Q4_K_M`` GGUF (the quant llama-server and
  Ollama default to); several others are listed to choose from;
* ``user/repo/path/FILE.gguf``: that file (and, for a split GGUF's first part, the other parts);
  ``user/repo/path/openvino_model.xml``: the OpenVINO IR in that folder;
* a local file or directory (``./x.gguf``, ``/models/ir``): linked or copied into the store.

What a repository offers is asked of the registered engines' formats (``backends.formats``): which
files make a model, how a reference names one, how a list shows it. This module names none.

``hf.co/`` and ``huggingface.co/`` in front of a repository, as Ollama writes them, are accepted.
A ``@REVISION`` after the repository (``user/repo@v2:Q8_0``) pins a branch, tag or commit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from backends.formats import GGUF, Choice, ModelFormat, quant_of
from backends.registry import model_format, model_formats, not_a_known_format

from ..capacity.sizes import format_size

__all__ = [
    "DEFAULT_QUANT",
    "Choice",
    "HubRef",
    "RefError",
    "choices",
    "default_name",
    "format_of",
    "is_hub_ref",
    "label",
    "parse_ref",
    "pick",
    "ref_of",
    "quant_of",
]

#: the quant a repository reference without one takes when the repository has it
DEFAULT_QUANT = "Q4_K_M"

_HUB_PREFIXES = ("https://huggingface.co/", "huggingface.co/", "hf.co/")
_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class RefError(ValueError):
    """A reference that names nothing pullable (or several things): the message says what to write instead."""


@dataclass(frozen=True)
class HubRef:
    """A model in a Hugging Face repository."""

    repo: str
    #: the quant asked for (``user/repo:QUANT``), else ""
    quant: str = ""
    #: the file asked for (``user/repo/FILE.gguf``), else ""
    file: str = ""
    revision: str = ""

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        if self.file:
            return f"{self.repo}{rev}/{self.file}"
        return f"{self.repo}{rev}:{self.quant}" if self.quant else f"{self.repo}{rev}"


def format_of(kind: str) -> ModelFormat:
    """The format a choice's or a stored model's ``kind`` names; RefError when no registered engine reads it."""
    fmt = model_format(kind)
    if fmt is None:
        raise RefError(f"no engine here reads models of the format {kind!r}")
    return fmt


def label(c: Choice) -> str:
    """How a choice is named in a list of a repository's models."""
    return format_of(c.kind).label(c)


def is_hub_ref(text: str) -> bool:
    """Whether ``text`` reads as a repository reference rather than a local path or a stored name."""
    if os.path.exists(text) or text.startswith(("/", "./", "../", "~")):
        return False
    for prefix in _HUB_PREFIXES:
        if text.startswith(prefix):
            return True
    head = text.split(":", 1)[0].split("@", 1)[0]
    parts = head.split("/")
    return len(parts) >= 2 and all(_REPO_PART.match(p) for p in parts[:2])


def parse_ref(text: str) -> HubRef | Path:
    """A reference as a ``HubRef`` or an existing local ``Path``; RefError naming what is wrong."""
    text = text.strip()
    if not text:
        raise RefError("an empty model reference: write user/repo:QUANT, user/repo/FILE.gguf or a path")
    local = Path(text).expanduser()
    if local.exists():
        return local.resolve()
    if not is_hub_ref(text):
        raise RefError(f"{text!r} is neither a file nor a directory here, nor a Hugging Face reference "
                       "(user/repo:QUANT or user/repo/FILE.gguf)")
    for prefix in _HUB_PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix):]
    quant = ""
    if ":" in text:
        text, quant = text.rsplit(":", 1)
        if not quant or "/" in quant:
            raise RefError(f"the quant after ':' in {text}:{quant!r} is not one (write user/repo:Q4_K_M)")
    parts = text.split("/")
    owner, repo_name = parts[0], parts[1]
    revision = ""
    if "@" in repo_name:
        repo_name, revision = repo_name.split("@", 1)
        if not revision:
            raise RefError(f"an empty revision after '@' in {text!r}")
    if not (_REPO_PART.match(owner) and _REPO_PART.match(repo_name)):
        raise RefError(f"{owner}/{repo_name!r} is not a repository name")
    file = "/".join(parts[2:])
    if file and quant:
        raise RefError(f"{text}:{quant}: name a file or a quant, not both")
    if file and not any(fmt.names(file) for fmt in model_formats()):
        raise RefError(f"{file!r} names no model: {not_a_known_format()}")
    return HubRef(repo=f"{owner}/{repo_name}", quant=quant, file=file, revision=revision)


def choices(files: dict[str, int]) -> list[Choice]:
    """What a repository with ``files`` (path → size) offers: each model once, in every registered format."""
    return [c for fmt in model_formats() for c in fmt.choices(files)]


def ref_of(c: Choice, repo: str, *, by_file: bool = False) -> str:
    """The reference that pulls ``c`` from ``repo`` (by file when its quant does not tell it apart)."""
    return f"{repo}:{c.quant}" if c.quant and not by_file else f"{repo}/{format_of(c.kind).reference_file(c)}"


def _listing(found: list[Choice], repo: str) -> str:
    quants = [c.quant for c in found if c.quant]
    rows = [(ref_of(c, repo, by_file=quants.count(c.quant) > 1), label(c), format_size(sum(c.sizes))) for c in found]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"  {ref:{width}}  {what}, {size}" for ref, what, size in rows)


def pick(found: list[Choice], ref: HubRef) -> Choice:
    """The choice ``ref`` names among a repository's; RefError lists them when it names none or several."""
    if not found:
        raise RefError(f"{ref.repo} has no model to pull: its files are {not_a_known_format()}")
    if ref.file:
        hit = [c for c in found if format_of(c.kind).named_by(c, ref.file)]
        if not hit:
            raise RefError(f"{ref.repo} has no file {ref.file!r}; it has:\n{_listing(found, ref.repo)}")
        return hit[0]
    if ref.quant:
        hit = [c for c in found if c.quant == ref.quant.upper()]
        if len(hit) == 1:
            return hit[0]
        if hit:
            raise RefError(f"{ref.repo} has {len(hit)} GGUFs quantized {ref.quant.upper()}; name one by its file:\n"
                           f"{_listing(hit, ref.repo)}")
        raise RefError(f"{ref.repo} has no GGUF quantized {ref.quant.upper()}; it has:\n{_listing(found, ref.repo)}")
    if len(found) == 1:
        return found[0]
    default = [c for c in found if c.quant == DEFAULT_QUANT]
    if len(default) == 1:
        return default[0]
    raise RefError(f"{ref.repo} offers {len(found)} models; name one:\n{_listing(found, ref.repo)}")


def default_name(ref: HubRef | Path, chosen: Choice | None = None) -> str:
    """The store name a pull gives when ``--name`` does not: ``repo:quant`` in lower case, the ``-GGUF`` suffix
    of the repository dropped (``Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M`` → ``qwen2.5-coder-7b-instruct:q4_k_m``)."""
    if isinstance(ref, Path):
        stem = ref.name[: -len(".gguf")] if ref.name.lower().endswith(".gguf") else ref.name
        quant = quant_of(ref.name) if ref.is_file() else ""
        if quant and stem.lower().endswith(quant.lower()):
            stem = stem[: -len(quant)].rstrip("-._")
        return (f"{stem}:{quant}" if quant else stem).lower()
    base = ref.repo.split("/")[1]
    fmt = format_of(chosen.kind) if chosen is not None else GGUF  # a quant names a GGUF
    suffix = next((s for s in fmt.repo_suffixes if base.lower().endswith(s) and len(base) > len(s)), "")
    base = base[: len(base) - len(suffix)]
    quant = chosen.quant if chosen is not None else ref.quant
    return (f"{base}:{quant}" if quant else base).lower()
