"""Ratings clients send over the WebSocket protocol (``feedback``): a JSON-lines log in the data dir, counted in
``/metrics``, listed by ``modeld feedback``.

Each line: when (``time``, Unix seconds), the generation (``request_id``), the model and its digest, the
``rating`` (-1 to 1), the client's ``text`` and ``position`` (a place in the generation), if it sent them. The
file is 0600; nothing is pruned (a line is a few hundred bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

__all__ = ["FILE_NAME", "FeedbackLog", "build_parser", "main", "read"]

#: the log's name in the data dir
FILE_NAME = "feedback.jsonl"


def _kind(rating: float) -> str:
    return "positive" if rating > 0 else "negative" if rating < 0 else "neutral"


class FeedbackLog:
    """The log at ``path`` (None: counted only); thread-safe."""

    def __init__(self, path: Path | None, registry: CollectorRegistry) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._count = Counter("modeld_ws_feedback", "WebSocket feedback messages recorded, by rating's sign",
                              ["rating"], registry=registry)

    def add(self, entry: dict[str, Any]) -> None:
        """Append ``entry`` (``time`` is added) and count it; OSError when the file cannot be written."""
        line = json.dumps({"time": round(time.time(), 3), **entry}, ensure_ascii=False, separators=(",", ":"))
        with self._lock:
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                with os.fdopen(fd, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
            self._count.labels(_kind(float(entry.get("rating", 0.0)))).inc()


def read(path: Path) -> list[dict[str, Any]]:
    """The log's entries, oldest first (a line that is not JSON is skipped); none when there is no log."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="modeld feedback", description="The ratings clients sent over /v1/ws.")
    p.add_argument("--data-dir", type=Path, default=None, help="the daemon's data dir (default: as serve finds it)")
    p.add_argument("--last", type=int, default=20, metavar="N", help="the last N ratings (0: all)")
    p.add_argument("--json", action="store_true", help="one JSON object per line, as logged")
    return p


def main(argv: list[str] | None = None) -> int:
    """``modeld feedback``: the last ratings clients sent."""
    from ...settings import SettingsError, data_dir_of

    args = build_parser().parse_args(argv)
    try:
        path = data_dir_of(args.data_dir) / FILE_NAME
    except SettingsError as exc:
        print(f"modeld feedback: {exc}", file=sys.stderr)
        return 2
    entries = read(path)
    if args.last > 0:
        entries = entries[-args.last:]
    if not entries:
        print(f"no feedback in {path}")
        return 0
    for e in entries:
        if args.json:
            print(json.dumps(e, ensure_ascii=False))
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(e.get("time", 0))))
        at = f" @{e['position']}" if e.get("position") is not None else ""
        text = f"  {e['text']}" if e.get("text") else ""
        print(f"{when}  {float(e.get('rating', 0)):+.2f}  {e.get('model', '')}  {e.get('request_id', '')}{at}{text}")
    return 0
