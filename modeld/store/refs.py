"""What ``modeld pull REF`` (and ``serve --model``, ``load``) accept, and how a repository's files become choices.

A reference is one of:

* ``user/repo:QUANT``: the GGUF in the Hugging Face repository whose file name carries that
  quantization (``Q4_K_M`` matches ``…-q4_k_m.gguf`` and the parts of a split one, not ``…-q4_k_m_l.gguf``);
* ``user/repo``: the repository's only GGUF, else its ``Q4_K_M`` (the quant llama-server and Ollama
  default to), else its OpenVINO IR; several others are listed to choose from;
* ``user/repo/path/FILE.gguf``: that file (and, for a split GGUF's first part, the other parts);
* a local file or directory (``./x.gguf``, ``/models/ir``): linked or copied into the store.

``hf.co/`` and ``huggingface.co/`` in front of a repository, as Ollama writes them, are accepted.
A ``@REVISION`` after the repository (``user/repo@v2:Q8_0``) pins a branch, tag or commit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..capacity.sizes import format_size

__all__ = [
    "DEFAULT_QUANT",
    "Choice",
    "HubRef",
    "RefError",
    "choices",
    "default_name",
    "is_hub_ref",
    "parse_ref",
    "pick",
    "ref_of",
    "quant_of",
]

#: the quant a repository reference without one takes when the repository has it
DEFAULT_QUANT = "Q4_K_M"

_HUB_PREFIXES = ("https://huggingface.co/", "huggingface.co/", "hf.co/")
_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
#: a quantization name as GGUF files carry it: Q4_K_M, IQ3_XXS, Q8_0, F16, BF16, TQ1_0, MXFP4 …
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32|TQ\d_\d|MXFP4(?:_MOE)?)(?=[-.]|$)",
                    re.IGNORECASE)
_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_IR_MARKER = "openvino_model.xml"


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


@dataclass(frozen=True)
class Choice:
    """What one pull fetches from a repository: a GGUF (all parts of a split one) or an OpenVINO IR directory."""

    kind: str  # "gguf" | "openvino"
    #: the files, in the repository's paths; a split GGUF's parts in order
    files: tuple[str, ...]
    #: the quant the GGUF's name carries ("" when none, and for an IR)
    quant: str = ""
    #: what a load opens: the GGUF (a split one's first part) or the IR's directory ("" for the repository root)
    primary: str = ""
    sizes: tuple[int, ...] = field(default=())

    @property
    def label(self) -> str:
        """How the choice is named in a list of them."""
        if self.kind == "openvino":
            return f"OpenVINO IR in {self.primary or '/'}"
        parts = f" ({len(self.files)} parts)" if len(self.files) > 1 else ""
        return f"{self.primary}{parts}"


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
    if file and not (file.lower().endswith(".gguf") or file.endswith("/" + _IR_MARKER) or file == _IR_MARKER):
        raise RefError(f"{file!r} is not a GGUF file (…/FILE.gguf), nor an OpenVINO IR's {_IR_MARKER}")
    return HubRef(repo=f"{owner}/{repo_name}", quant=quant, file=file, revision=revision)


def quant_of(filename: str) -> str:
    """The quantization a GGUF's file name carries (upper case), else ""."""
    stem = _PART.sub(".gguf", Path(filename).name)
    found = _QUANT.findall(stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem)
    return found[-1].upper() if found else ""


def choices(files: dict[str, int]) -> list[Choice]:
    """What a repository with ``files`` (path → size) offers: each GGUF once (split parts gathered), each IR."""
    out: list[Choice] = []
    parts: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(files):
        if not path.lower().endswith(".gguf"):
            continue
        m = _PART.search(path)
        if m:
            parts.setdefault(path[: m.start()], []).append((int(m.group(1)), path))
        else:
            out.append(Choice("gguf", (path,), quant_of(path), path, (files[path],)))
    for _, numbered in sorted(parts.items()):
        ordered = tuple(p for _, p in sorted(numbered))
        out.append(Choice("gguf", ordered, quant_of(ordered[0]), ordered[0], tuple(files[p] for p in ordered)))
    for path in sorted(files):
        if path == _IR_MARKER or path.endswith("/" + _IR_MARKER):
            folder = path[: -len(_IR_MARKER)].rstrip("/")
            inside = tuple(p for p in sorted(files) if (not folder or p.startswith(folder + "/"))
                           and "/" not in p[len(folder) + 1 if folder else 0:] and not p.lower().endswith(".gguf"))
            out.append(Choice("openvino", inside, "", folder, tuple(files[p] for p in inside)))
    return out


def ref_of(c: Choice, repo: str, *, by_file: bool = False) -> str:
    """The reference that pulls ``c`` from ``repo`` (by file when its quant does not tell it apart)."""
    if c.kind == "openvino":
        return f"{repo}/{c.primary + '/' if c.primary else ''}{_IR_MARKER}"
    return f"{repo}:{c.quant}" if c.quant and not by_file else f"{repo}/{c.primary}"


def _listing(found: list[Choice], repo: str) -> str:
    quants = [c.quant for c in found if c.kind == "gguf" and c.quant]
    rows = [(ref_of(c, repo, by_file=quants.count(c.quant) > 1), c.label, format_size(sum(c.sizes))) for c in found]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"  {ref:{width}}  {label}, {size}" for ref, label, size in rows)


def pick(found: list[Choice], ref: HubRef) -> Choice:
    """The choice ``ref`` names among a repository's; RefError lists them when it names none or several."""
    if not found:
        raise RefError(f"{ref.repo} has no GGUF file and no OpenVINO IR to pull")
    if ref.file:
        hit = [c for c in found if ref.file in c.files or (c.kind == "openvino" and ref.file.endswith(_IR_MARKER)
                                                           and c.primary == ref.file[: -len(_IR_MARKER)].rstrip("/"))]
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
    base = re.sub(r"[-_.]gguf$", "", ref.repo.split("/")[1], flags=re.IGNORECASE)
    if base.lower().endswith(("-ov", "-openvino", "_ov")) and chosen is not None and chosen.kind == "openvino":
        base = base.rsplit("-", 1)[0].rsplit("_", 1)[0]
    quant = chosen.quant if chosen is not None else ref.quant
    return (f"{base}:{quant}" if quant else base).lower()
