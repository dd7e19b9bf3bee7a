"""Measurement pieces shared by the in-process benchmarks and ``python -m benchmarks``."""

from __future__ import annotations

import http.client
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from contract.interfaces import Session
from contract.manifest import ContextManifest
from contract.types import PrefixInput, SuffixInput
from harness.daemon import wait_http

#: the stable prefix's filler: a repository map, one line per module
PREFIX_LINE = "src/pkg/module_{i}.py: class Handler{i}(Base): def run(self, x): return x * {i}"
#: a new turn's filler: failing-test output
SUFFIX_LINE = "test_{i}: AssertionError at line {i} in test_handler_{i}"


def text_of_tokens(count: Callable[[str], int], target: int, line: str) -> str:
    """Deterministic filler of about ``target`` tokens (by ``count``), built from numbered lines."""
    lines: list[str] = []
    i = 0
    while True:
        lines.append(line.format(i=i))
        i += 1
        if i % 16 == 0 and count("\n".join(lines)) >= target:
            break
    while count("\n".join(lines)) > target and len(lines) > 1:
        lines.pop()
    return "\n".join(lines)


def text_of_exact_tokens(count: Callable[[str], int], target: int, line: str, word: str = " ok") -> str:
    """``text_of_tokens`` topped up one short ``word`` at a time: ``target`` tokens (by ``count``), or one over.

    Lines alone land up to a line short of the target, which matters for a 16-token turn.
    """
    text = text_of_tokens(count, target, line)
    if count(text) > target:  # one line is already too long: the words alone
        text = word.strip()
    while count(text) < target:
        text += word
    return text


def snapshot_vs_reprefill(
    sess: Session, system: str, turn: str, manifest: ContextManifest, other: ContextManifest
) -> dict[str, Any]:
    """Snapshot save and restore of a prefix + turn against recomputing the same context.

    Between the steps an unrelated prefix (under ``other``) replaces the resident
    state, so the restore and the re-prefill both start from somewhere else.
    """
    out: dict[str, Any] = {}
    sess.ensure_prefix(PrefixInput(text=system, manifest=manifest))
    sess.prefill_suffix(SuffixInput(text=turn, manifest=manifest))
    t0 = time.perf_counter()
    snap = sess.snapshot()
    out["snapshot_save_ms"] = (time.perf_counter() - t0) * 1000
    out["snapshot_tokens"] = snap.resident_tokens
    out["snapshot_bytes"] = len(snap.state)
    out["snapshot_bytes_per_token"] = len(snap.state) / max(1, snap.resident_tokens)
    sess.ensure_prefix(PrefixInput(text="Unrelated.", manifest=other))
    t0 = time.perf_counter()
    sess.restore(snap)
    out["snapshot_restore_ms"] = (time.perf_counter() - t0) * 1000
    sess.ensure_prefix(PrefixInput(text="Unrelated.", manifest=other))
    t0 = time.perf_counter()
    sess.ensure_prefix(PrefixInput(text=system, manifest=manifest))
    sess.prefill_suffix(SuffixInput(text=turn, manifest=manifest))
    out["reprefill_ms"] = (time.perf_counter() - t0) * 1000
    return out


@contextmanager
def served(argv: list[str], log: Path, port: int, path: str = "/health", timeout_s: float = 600.0) -> Iterator[int]:
    """A peer server (``argv``) with its output in ``log``, once ``path`` answers on ``port``; stopped after."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                wait_http(port, path, timeout_s, proc)
            except RuntimeError as exc:
                raise RuntimeError(f"{argv[0]}: {exc}; see {log}") from exc
            yield port
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def sse_chat(port: int, body: dict[str, Any], timeout_s: float = 1800.0) -> Iterator[dict[str, Any]]:
    """A streamed chat completion's events from the server on ``port``: each ``data:`` line's JSON (``[DONE]``
    left out), read as they come; RuntimeError for a reply that is not 200. The connection is closed when the
    events are read, or when the caller stops reading them."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                yield json.loads(line[5:])
    finally:
        conn.close()
