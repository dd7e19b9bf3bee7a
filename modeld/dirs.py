"""Where the daemon keeps its files, by the platform's conventions (``platformdirs``; XDG on Linux).

* ``config_file()``: ``$XDG_CONFIG_HOME/modeld/config.toml``, else ``~/.config/modeld/config.toml``;
* ``data_dir()``: ``$XDG_DATA_HOME/modeld``, else ``~/.local/share/modeld``.

The socket's runtime directory is not here: the client computes it too
(``contract.endpoint``), and the client install carries no platformdirs.
"""

from __future__ import annotations

from pathlib import Path

from platformdirs import user_config_path, user_data_path

__all__ = ["APP_NAME", "CONFIG_FILE_NAME", "config_file", "data_dir"]

APP_NAME = "modeld"
CONFIG_FILE_NAME = "config.toml"


def config_file() -> Path:
    """The default settings file (``modeld serve --config`` / ``$MODELD_CONFIG`` name another)."""
    return user_config_path(APP_NAME) / CONFIG_FILE_NAME


def data_dir() -> Path:
    """The default ``--data-dir``: snapshot blobs, the workspace cache, CURVE keys."""
    return user_data_path(APP_NAME)
