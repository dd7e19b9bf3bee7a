"""The daemon commands' command lines, made from their settings (``modeld.settings``): a flag per setting, with
its help, its current value and where a value comes from; the settings reference the docs print; the parse that
turns a command line into settings, naming where a bad value came from."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic.fields import FieldInfo

from contract.endpoint import default_endpoint
from contract.types import Config, format_gpu_layers
from runtime.flags import OptionFlag, argparse_kw, flag_of

from . import dirs
from .capacity.policy import Policy
from .capacity.sizes import format_size
from .settings import (
    ENGINE_OPTION,
    GROUPS,
    LOAD,
    MEMORY,
    MEMORY_FLAGS,
    MEMORY_SETTINGS,
    SIZE_SETTINGS,
    Flag,
    HttpSettings,
    ServeSettings,
    SettingsError,
    env_name,
    flag_name,
    load_names,
    option_flags_of,
)

__all__ = ["Reference", "add_flags", "add_setting", "command_settings", "layering_epilog", "parse_settings", "reference", "setting_field", "setting_value"]

# --- the command lines ---------------------------------------------------------------------------

Settings = TypeVar("Settings", bound=HttpSettings)


def setting_field(cls: type[HttpSettings], name: str) -> FieldInfo:
    """The field that declares setting ``name``: ``cls``' own, the memory policy's for a memory flag, the load
    config's (``contract.types.Config``) for one of its settings, an engine's options model's for its option."""
    if name in MEMORY_SETTINGS and "memory" in cls.model_fields:
        return Policy.model_fields[MEMORY_SETTINGS[name]]
    if LOAD in cls.model_fields:
        fields = load_names()
        if name in fields:
            return Config.model_fields[fields[name]]
        option = _option(name)
        if option is not None:
            return option.info
    return cls.model_fields[name]


def _option(name: str) -> OptionFlag | None:
    return next((o for o in option_flags_of() if o.setting == name), None)


def setting_value(settings: HttpSettings, name: str) -> Any:
    """Setting ``name``'s value in ``settings`` (a memory flag's from ``memory``, a load setting's from
    ``load_config``: its engine options as NAME=VALUE pairs, an option's own from them)."""
    if name in MEMORY_SETTINGS and isinstance(settings, ServeSettings):
        return getattr(settings.memory, MEMORY_SETTINGS[name])
    if isinstance(settings, ServeSettings):
        load = settings.load_config
        if name == ENGINE_OPTION:
            return tuple(f"{k}={v}" for k, v in load.options.items())
        fields = load_names()
        if name in fields:
            return getattr(load, fields[name])
        option = _option(name)
        if option is not None:
            return load.options.get(option.option)
    return getattr(settings, name)


#: never printed by --help: the HTTP key, and the owner id that is the fence
_SECRET = ("api_key", "owner")


def _shown(name: str, value: Any) -> str | None:
    """How ``--help`` shows a setting's current value; None shows nothing (unset, off, or a secret)."""
    if name in _SECRET or (_option(name) is not None and "key" in name):
        return None
    if value is None:
        if name == "config":
            return str(dirs.config_file())
        if name == "data_dir":
            return str(dirs.data_dir())
        if name == "endpoint":
            return default_endpoint()
        return "auto" if name in ("cache_ram", "cache_disk") else None
    if isinstance(value, bool):
        return "on" if value else None
    if name == "gpu_layers":
        return format_gpu_layers(value)
    if isinstance(value, tuple):
        return ", ".join(value) or None
    if name in MEMORY_FLAGS and not value:  # 0: no limit, no reserve
        return None
    if name in SIZE_SETTINGS:
        return format_size(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) or None


def command_settings(cls: type[HttpSettings]) -> list[str]:
    """The settings ``cls``' command takes as flags, in the order declared: its fields, the memory policy's
    ``MEMORY_FLAGS`` in place of the nested ``memory``, the load config's settings and the engines' options in
    place of the nested ``load_config``."""
    out: list[str] = []
    for name in cls.model_fields:
        if name == "memory":
            out += list(MEMORY_FLAGS)
        elif name == LOAD:
            out += list(load_names()) + [o.setting for o in option_flags_of()]
        else:
            out.append(name)
    return out


def _flag(cls: type[HttpSettings], name: str) -> tuple[FieldInfo, Flag, str]:
    """Setting ``name``'s field, its ``Flag`` and its help text: the memory policy's fields (``MEMORY_FLAGS``,
    declared in ``modeld.capacity.Policy``, which does not import this module) are flags of the memory section,
    an engine's option one of the model's, its help naming the engines that take it."""
    option = _option(name) if LOAD in cls.model_fields else None
    if option is not None:
        return option.info, option.flag, option.help
    info = setting_field(cls, name)
    flag = flag_of(info) or Flag(group=MEMORY)
    return info, flag, info.description or ""


def add_flags(
    p: argparse.ArgumentParser,
    cls: type[HttpSettings],
    command: str,
    current: HttpSettings | None = None,
    *,
    choices: Mapping[str, tuple[str, ...]] | None = None,
) -> None:
    """Command ``command``'s flags: one per setting of ``cls`` (``command_settings``), written from its field
    (``Flag``), in the help's sections; the help shows ``current``'s values, else the built-in ones.
    ``choices`` gives the choices known only at run time (the engines registered)."""
    shown = current if current is not None else cls.model_construct()
    sections: dict[str, Any] = {}
    for name in command_settings(cls):
        info, flag, text = _flag(cls, name)
        if flag.group not in sections:
            sections[flag.group] = p.add_argument_group(flag.group) if flag.group else p
        kw = argparse_kw(info, flag, size=name in SIZE_SETTINGS)
        if choices and name in choices:
            kw["choices"] = choices[name]
        add_setting(sections[flag.group], shown, name, unset=flag.unset.get(command, ""),
                    help=flag.help.get(command, "") or text, **kw)


def add_setting(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    current: HttpSettings,
    name: str,
    *,
    unset: str = "",
    help: str = "",
    **kw: Any,
) -> None:
    """The flag of setting ``name``, with no argparse default (``argparse.SUPPRESS``: a flag left out takes no
    part, so the environment and the config file fill it in). Its help is ``help``, else the field's description,
    and says what applies without the flag: its value in ``current``, else ``unset``."""
    text = (help or setting_field(type(current), name).description or "").replace("%", "%%")
    value = _shown(name, setting_value(current, name)) or unset
    where = f"default: {value}; env {env_name(name)}" if value else f"env {env_name(name)}"
    p.add_argument(flag_name(name), dest=name, default=argparse.SUPPRESS, help=f"{text} ({where})", **kw)


@dataclass(frozen=True)
class Reference:
    """One setting as the documentation lists it (``reference``)."""

    section: str
    flag: str
    variable: str
    default: str
    description: str
    #: the commands that take it as a flag
    commands: tuple[str, ...]


#: the defaults that depend on the user and the platform, as the documentation states them
_PLATFORM_DEFAULTS = {
    "config": "$XDG_CONFIG_HOME/modeld/config.toml, else ~/.config/modeld/config.toml",
    "data_dir": "$XDG_DATA_HOME/modeld, else ~/.local/share/modeld",
    "endpoint": "ipc://$XDG_RUNTIME_DIR/modeld/modeld.sock, else ipc:///tmp/modeld-UID/modeld.sock",
}


def reference() -> list[Reference]:
    """Every ``modeld serve`` setting, by the help's sections, for the documentation (generated, so it cannot
    drift from the fields): its flag with its value's form, variable, built-in default and description."""
    http = set(command_settings(HttpSettings))
    shown = ServeSettings.model_construct()
    out: list[Reference] = []
    for name in command_settings(ServeSettings):
        info, flag, text = _flag(ServeSettings, name)
        kw = argparse_kw(info, flag, size=name in SIZE_SETTINGS)
        form = ("{" + ",".join(kw["choices"]) + "}") if "choices" in kw else kw.get("metavar", "")
        if not form and kw.get("action") is None:
            form = name.upper()
        out.append(Reference(
            section=flag.group, flag=f"{flag_name(name)} {form}".strip(), variable=env_name(name),
            default=_PLATFORM_DEFAULTS.get(name) or _shown(name, setting_value(shown, name)) or "",
            description=text,
            commands=("serve", "http") if name in http else ("serve",),
        ))
    return sorted(out, key=lambda r: GROUPS.index(r.section))


def layering_epilog(config: Path, note: str) -> str:
    """The help's word on where settings come from (``config``: the file read); ``note``: why the defaults shown
    are the built-in ones."""
    epilog = (
        "Each setting comes from its flag, else the environment (MODELD_<SETTING>, e.g. MODELD_CACHE_RAM), "
        f"else the config file ({config}; TOML, keys are the settings' names, e.g. cache_ram = \"2GiB\"), "
        "else its built-in default. A default shown is what applies without the flag."
    )
    if note:
        epilog += f" The defaults shown are the built-in ones, because: {note}"
    return epilog.replace("%", "%%")


def parse_settings(
    cls: type[Settings],
    argv: list[str] | None,
    build_parser: Callable[[Settings | None, str, Path | None], argparse.ArgumentParser],
) -> Settings:
    """``cls`` for the command line ``argv`` over the environment and the config file; raises SettingsError.

    ``build_parser(current, note, config)`` makes the command's parser, its help
    showing ``current`` (the settings without the command line; None, and
    ``note`` saying why, when those do not load: the help shows the built-in
    ones) and the config file (``--config``, read first, names it; None: the
    default one). The parser exits for ``--help`` or a malformed flag.
    """
    pre = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    pre.add_argument("--config", type=Path, default=None)
    try:
        named = pre.parse_known_args(argv)[0].config
    except argparse.ArgumentError:  # the full parser says what is wrong
        named = None
    current: Settings | None
    try:
        current, note = cls.load({} if named is None else {"config": named}), ""
    except SettingsError as exc:
        current, note = None, str(exc)
    args = build_parser(current, note, named).parse_args(argv)
    return cls.load(vars(args))
