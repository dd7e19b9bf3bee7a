"""The operator's memory policy, layered: command line over environment over config file over defaults."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import dirs
from .sizes import parse_count, parse_fraction, parse_size

__all__ = ["DEFAULT_CONTEXT", "DEFAULT_HEADROOM_FRACTION", "DEFAULT_MIN_CONTEXT", "Policy"]

#: the window served when the request says 0; 0: as large as fits, up to the model's maximum (agents send
#: first requests of 8k-22k tokens, so a smaller default only turns them away)
DEFAULT_CONTEXT = 0
#: below this many tokens a memory-cut window is refused instead of served
DEFAULT_MIN_CONTEXT = 512
#: fraction of free memory left untouched for allocator slack and estimate error
DEFAULT_HEADROOM_FRACTION = 0.10

#: Policy field -> (CLI key, environment variable, [memory] key in the config file)
_POLICY_SOURCES: dict[str, tuple[str, str, str]] = {
    "user_limit_bytes": ("mem_max", "MODELD_MEM_MAX", "max"),
    "reserve_bytes": ("mem_reserve", "MODELD_MEM_RESERVE", "reserve"),
    "headroom_fraction": ("mem_headroom", "MODELD_MEM_HEADROOM", "headroom"),
    "min_context": ("min_context", "MODELD_MIN_CONTEXT", "min_context"),
    "default_context": ("default_context", "MODELD_DEFAULT_CONTEXT", "default_context"),
}


@dataclass(frozen=True)
class Policy:
    """The operator's memory policy.

    * ``user_limit_bytes`` (--mem-max): cap on everything the model uses (weights
      + overhead + KV) in each pool; 0 = no cap.
    * ``reserve_bytes`` (--mem-reserve): memory kept free for everything else.
    * ``headroom_fraction``: share of free memory (incl. the switch credit) kept
      free on top of the reserve, for allocator slack and estimate error; 0.10.
    * ``min_context``: a memory-cut window below this is refused
      (InsufficientMemory) rather than served; 512. A smaller window that was
      asked for (or is the model's maximum) is still served.
    * ``default_context``: the window when the request says 0; 0 (the default)
      means "as large as fits, up to the model's maximum": coding agents send
      first requests of 8k to 22k tokens and rarely ask for a window.
    """

    user_limit_bytes: int = 0
    reserve_bytes: int = 0
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION
    min_context: int = DEFAULT_MIN_CONTEXT
    default_context: int = DEFAULT_CONTEXT

    def __post_init__(self) -> None:
        for name in ("user_limit_bytes", "reserve_bytes", "min_context", "default_context"):
            if getattr(self, name) < 0:
                raise ValueError(f"Policy.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.headroom_fraction < 1.0:
            raise ValueError(f"Policy.headroom_fraction must be in [0, 1), got {self.headroom_fraction}")

    @classmethod
    def load(
        cls,
        env: Mapping[str, str] | None = None,
        config_file: str | os.PathLike[str] | None = None,
        cli: Mapping[str, Any] | None = None,
    ) -> Policy:
        """Resolve each field independently: CLI > environment > config file > default.

        * ``cli``: keys ``mem_max``, ``mem_reserve``, ``mem_headroom``,
          ``min_context``, ``default_context`` (argparse names); None = not given.
        * ``env`` (default ``os.environ``): ``MODELD_MEM_MAX``, ``MODELD_MEM_RESERVE``,
          ``MODELD_MEM_HEADROOM``, ``MODELD_MIN_CONTEXT``, ``MODELD_DEFAULT_CONTEXT``;
          empty = not set.
        * config file: ``config_file``, else ``$MODELD_CONFIG``, else
          ``modeld.dirs.config_file()`` ($XDG_CONFIG_HOME or ~/.config, ``modeld/config.toml``;
          only this default may be absent). TOML,
          section ``[memory]`` with keys ``max``, ``reserve``, ``headroom``,
          ``min_context``, ``default_context``; an unknown key is an error.

        Sizes go through ``parse_size``; headroom accepts 0.1 or "10%". A bad value
        raises ValueError naming its source.
        """
        env = os.environ if env is None else env
        cli = cli or {}
        file_values = _read_memory_section(env, config_file)
        values: dict[str, Any] = {}
        for fname, (cli_key, env_key, file_key) in _POLICY_SOURCES.items():
            raw: Any = None
            source = ""
            if cli.get(cli_key) is not None:
                raw, source = cli[cli_key], f"--{cli_key.replace('_', '-')}"
            elif env.get(env_key):
                raw, source = env[env_key], env_key
            elif file_key in file_values:
                raw, source = file_values[file_key], f"[memory] {file_key}"
            if source:
                values[fname] = _convert(fname, raw, source)
        return cls(**values)


def _convert(fname: str, raw: Any, source: str) -> Any:
    if fname in ("user_limit_bytes", "reserve_bytes"):
        try:
            return parse_size(raw)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
    if fname == "headroom_fraction":
        return parse_fraction(raw, source)
    return parse_count(raw, source)


def _read_memory_section(env: Mapping[str, str], config_file: str | os.PathLike[str] | None) -> dict[str, Any]:
    explicit = config_file is not None or bool(env.get("MODELD_CONFIG"))
    if config_file is not None:
        path = Path(config_file)
    elif env.get("MODELD_CONFIG"):
        path = Path(env["MODELD_CONFIG"])
    else:
        path = dirs.config_file()  # the file `modeld serve` reads its settings from
    try:
        with path.open("rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        if explicit:
            raise ValueError(f"config file {path} does not exist") from None
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
    section = doc.get("memory", {})
    if not isinstance(section, dict):
        raise ValueError(f"config file {path}: [memory] must be a table")
    known = {keys[2] for keys in _POLICY_SOURCES.values()}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"config file {path}: unknown [memory] keys {unknown}; known: {sorted(known)}")
    return dict(section)
