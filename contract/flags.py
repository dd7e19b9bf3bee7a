"""How a field shows on a command line: ``Flag``, metadata a model's field carries (``Annotated[T, Flag(...)]``).

The daemon's settings (``modeld.settings``) and the load config (``contract.types.Config``) declare their flags
this way, so ``modeld serve``, ``modeld http`` and the client commands (``modeld load``, ``describe``, ``run``,
``embed``) write theirs from the one declaration (``runtime.flags``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Flag", "LOAD_GROUP", "UNSET"]

#: the help's section of what a load takes (``modeld serve``'s "the model")
LOAD_GROUP = "the model"


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: ``Flag.default`` when the command line's default is the field's own
UNSET: Any = _Unset()


@dataclass(frozen=True, eq=False)
class Flag:
    """How a setting shows on the command line, read with the field's type, default and description.

    Everything else about the flag follows from the field: its name (``cache_ram`` → ``--cache-ram``), a switch
    for a bool that is off by default and ``on``/``off`` for one that is on, a repeatable flag for a tuple (or
    NAME=VALUE pairs for a mapping), the choices of a ``Literal``, argparse's ``int``/``float``/``Path`` for
    those types, and the text as given where the field's own validator parses it (sizes, ``auto``)."""

    #: what the help shows as the flag's value (sizes show SIZE without one)
    metavar: str | None = None
    #: the help's section
    group: str = ""
    #: per command, the help there when it is not the field's description
    help: Mapping[str, str] = field(default_factory=dict)
    #: per command, what applies when the setting is unset, shown as the flag's default
    unset: Mapping[str, str] = field(default_factory=dict)
    #: the setting's name (flag, variable, config key) where it is not the field's (``Config.num_gpu_layers`` is
    #: the setting ``gpu_layers``)
    setting: str = ""
    #: the command line's default where it is not the field's (``--gpu-layers`` is ``auto``, where a request that
    #: names none asks for the CPU)
    default: Any = UNSET
    #: the client commands that take it (None: every command that names a model)
    commands: tuple[str, ...] | None = None

    def name_of(self, field_name: str) -> str:
        """The setting's name for the field ``field_name``."""
        return self.setting or field_name
