"""The daemon's log: plain lines, or one JSON object per line (``--log-format json``) for a collector.

A JSON line carries ``ts`` (ISO 8601, UTC), ``level``, ``logger`` and ``msg``;
an access-log line (logger ``modeld.access``) adds its fields at the top level.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import TextIO

__all__ = ["LOG_FORMATS", "JsonFormatter", "setup_logging"]

LOG_FORMATS = ("plain", "json")
PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """A record as one JSON object."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "access", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(level: str, fmt: str, stream: TextIO) -> None:
    """Configure the root logger once: ``level`` by name, ``fmt`` one of ``LOG_FORMATS``."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(PLAIN))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
