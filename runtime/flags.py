"""Command-line flags written from a model's fields (``contract.flags.Flag``): the one helper ``modeld serve``'s
settings (``modeld.settings_cli``) and the client commands that name a model (``modeld load``, ``describe``,
``run``, ``embed``) write their flags with.

What a load takes is declared once, in ``contract.types.Config`` (its fields with a ``Flag``) and in each engine's
options model (``OptionFlag``: an option of ``Config.options`` as a flag of its own); ``load_config`` reads a
parsed command line back into a ``Config``.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator
from pydantic.fields import FieldInfo

from contract.flags import LOAD_GROUP, UNSET, Flag
from contract.types import Config

__all__ = ["CLIENT_FLAGS", "LoadSetting", "OptionFlag", "add_load_flags", "argparse_kw", "flag_name", "flag_of", "load_config", "load_fields",
           "option_flags", "option_pairs"]


#: the client commands' own flags where they name a model (``runtime.cli``): an engine option of one of these
#: names is a flag by another (``option_flags``)
CLIENT_FLAGS = frozenset({
    "path", "type", "digest", "name", "pull", "data_dir", "expected_generation", "endpoint", "json", "owner",
    "timeout", "server_key", "texts", "truncate", "prompt", "system", "system_file", "max_tokens", "temperature",
    "seed", "option", "help", "command", "handle",
})


def flag_name(setting: str) -> str:
    """``cache_ram`` → ``--cache-ram``."""
    return "--" + setting.replace("_", "-")


def flag_of(info: FieldInfo) -> Flag | None:
    """The field's ``Flag``; None: the field is no flag."""
    return next((m for m in info.metadata if isinstance(m, Flag)), None)


def _one_kind(ann: Any) -> Any:
    """``T`` of ``T | None``; None for a union of several kinds."""
    if get_origin(ann) in (Union, types.UnionType):
        kinds = [a for a in get_args(ann) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else None
    return ann


def argparse_kw(info: FieldInfo, flag: Flag, *, size: bool = False) -> dict[str, Any]:
    """argparse's keywords for a field (``Flag``'s docstring says how each follows from the field); ``size``:
    the value is a size ("8GiB"), which the field's validator reads."""
    kw: dict[str, Any] = {}
    if flag.metavar or size:
        kw["metavar"] = flag.metavar or "SIZE"
    ann = _one_kind(info.annotation)
    if ann is bool:
        if info.default is False:
            kw = {"action": "store_true"}
        else:  # on by default, or unset (None): the engine decides
            kw["choices"] = ("on", "off")  # pydantic reads on/off as a bool
    elif get_origin(ann) in (tuple, dict):
        kw["action"] = "append"
    elif get_origin(ann) is Literal:
        kw["choices"] = tuple(a for a in get_args(ann) if a != "")
    elif any(isinstance(m, BeforeValidator) for m in info.metadata):
        pass  # the field's validator reads the text (a size, "auto")
    elif ann in (int, float, Path):
        kw["type"] = ann
    return kw


@dataclass(frozen=True)
class LoadSetting:
    """A field of ``Config`` that is a setting and a flag: its setting's name, the field's, and how it shows."""

    setting: str
    field: str
    info: FieldInfo
    flag: Flag

    def taken_by(self, command: str) -> bool:
        return self.flag.commands is None or command in self.flag.commands or command == "serve"


def load_fields() -> list[LoadSetting]:
    """``Config``'s fields with a ``Flag``, in the order declared."""
    out = []
    for name, info in Config.model_fields.items():
        flag = flag_of(info)
        if flag is not None:
            out.append(LoadSetting(setting=flag.name_of(name), field=name, info=info, flag=flag))
    return out


@dataclass(frozen=True)
class OptionFlag:
    """An engine's option (a field of its options model, carried in ``Config.options``) as a setting and a flag
    of its own: ``setting`` is the option's name, or ``ENGINE_OPTION`` where that name is another setting's."""

    setting: str
    option: str
    info: FieldInfo
    #: the engines that take it, as messages call them
    titles: tuple[str, ...]

    @property
    def flag(self) -> Flag:
        return Flag(group=LOAD_GROUP, metavar="VALUE" if _one_kind(self.info.annotation) is str else None)

    @property
    def help(self) -> str:
        return f"{', '.join(self.titles)}: {self.info.description or ''} (an engine option)"


def option_flags(engines: Iterable[tuple[str, str, type[BaseModel]]], taken: Iterable[str]) -> list[OptionFlag]:
    """The options of ``engines`` ((name, title, options model) each) as flags: an option two engines take is one
    flag; one whose name is ``taken`` (another setting's or flag's) is named ``ENGINE_OPTION``."""
    taken = set(taken)
    found: dict[str, OptionFlag] = {}
    for name, title, model in engines:
        for option, info in model.model_fields.items():
            setting = f"{name}_{option}" if option in taken else option
            if setting in found and found[setting].option == option:
                found[setting] = OptionFlag(setting, option, found[setting].info, (*found[setting].titles, title))
            else:
                found[setting] = OptionFlag(setting, option, info, (title,))
    return list(found.values())


def option_pairs(items: Iterable[str | tuple[str, Any]]) -> dict[str, Any]:
    """NAME=VALUE texts (or (name, value) pairs) as a mapping, names and text values stripped; ValueError for one
    that is not NAME=VALUE."""
    out: dict[str, Any] = {}
    for item in items:
        if isinstance(item, tuple):
            name, value = item
        else:
            name, sep, value = item.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"an engine option is NAME=VALUE, got {item!r}")
        out[name.strip()] = value.strip() if isinstance(value, str) else value
    return out


def add_load_flags(p: argparse.ArgumentParser, command: str, options: Iterable[OptionFlag] = ()) -> None:
    """The flags of what a load takes, for client command ``command``: ``Config``'s (those it takes) and the
    engines' options ``options``. None has an argparse default: ``load_config`` fills in the rest."""
    for s in load_fields():
        if not s.taken_by(command):
            continue
        names = [flag_name(s.setting)] + (["--option"] if s.field == "options" else [])  # --option: older name
        shown = f" (default: {s.flag.unset[command]})" if command in s.flag.unset else ""
        p.add_argument(*names, dest=s.setting, default=argparse.SUPPRESS,
                       help=(s.info.description or "").replace("%", "%%") + shown, **argparse_kw(s.info, s.flag))
    for o in options:
        p.add_argument(flag_name(o.setting), dest=o.setting, default=argparse.SUPPRESS,
                       help=o.help.replace("%", "%%"), **argparse_kw(o.info, o.flag))


def load_config(given: Mapping[str, Any], command: str, options: Iterable[OptionFlag] = ()) -> Config:
    """The ``Config`` of a parsed command line (``given``: setting → value, the flags given only): each field
    given, else the command line's default (``Flag.default``), else the field's; engine options from
    ``--engine-option`` pairs, an option's own flag winning. ValueError (pydantic's) for a bad value."""
    values: dict[str, Any] = {}
    for s in load_fields():
        if s.setting in given and s.field != "options":
            values[s.field] = given[s.setting]
        elif s.flag.default is not UNSET and s.taken_by(command):
            values[s.field] = s.flag.default
    chosen = option_pairs(given.get("engine_option") or ())
    chosen.update({o.option: given[o.setting] for o in options if o.setting in given})
    values["options"] = chosen
    return Config.model_validate(values)
