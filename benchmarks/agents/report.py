"""The figures of one agent's run, from the daemon's access-log lines, and the table that prints them.

The access log is read tolerantly: the fields the front has not written yet count as 0 / None.
"""

from __future__ import annotations

import bisect
import datetime
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["AccessLine", "AgentResult", "assign", "side_by_side", "started_at", "table", "usage_of"]


def _int(v: Any) -> int:
    try:
        return int(v or 0)
    except (TypeError, ValueError):
        return 0


def _float(v: Any) -> float | None:
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None


def started_at(rec: dict[str, Any]) -> float:
    """When the daemon received the request (wall clock): the line's ``ts`` less ``total_ms``.

    A line is written when its response is complete, possibly long after the agent that sent it
    has gone; the start says whose it was. Without ``ts``, the time the harness read the line.
    """
    end = float(rec.get("_arrived") or 0.0)
    ts = rec.get("ts")
    if isinstance(ts, str):
        try:
            end = datetime.datetime.fromisoformat(ts).timestamp()
        except ValueError:
            pass
    return end - (_float(rec.get("total_ms")) or 0.0) / 1000


def assign(records: list[dict[str, Any]], starts: list[float]) -> list[list[dict[str, Any]]]:
    """Split access records among agents that started at ``starts`` (ascending, one after the other).

    A record belongs to the last agent started before the daemon received it; records from before the
    first agent (the harness's own health checks) belong to none. Each agent's records come in start order.
    """
    out: list[list[dict[str, Any]]] = [[] for _ in starts]
    for rec in sorted(records, key=started_at):
        i = bisect.bisect_right(starts, started_at(rec)) - 1
        if i >= 0:
            out[i].append(rec)
    return out


@dataclass(frozen=True)
class AccessLine:
    """One ``modeld.access`` record."""

    method: str
    route: str
    status: int
    model: str | None
    stream: bool
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None
    ttft_ms: float | None
    total_ms: float | None
    error: str | None

    @classmethod
    def parse(cls, rec: dict[str, Any]) -> AccessLine:
        return cls(
            method=str(rec.get("method") or ""), route=str(rec.get("route") or rec.get("path") or ""),
            status=_int(rec.get("status")), model=rec.get("model") or None, stream=bool(rec.get("stream")),
            prompt_tokens=_int(rec.get("prompt_tokens")), cached_tokens=_int(rec.get("cached_tokens")),
            completion_tokens=_int(rec.get("completion_tokens")), finish_reason=rec.get("finish_reason") or None,
            ttft_ms=_float(rec.get("ttft_ms")), total_ms=_float(rec.get("total_ms")), error=rec.get("error") or None,
        )

    @classmethod
    def from_proxied(cls, rec: dict[str, Any]) -> AccessLine:
        """The figures of a request the proxy recorded (its dump, or the summary with the ``usage`` it read), for a
        server that writes no access log (a peer): its status and error, the usage its response carried
        (``usage_of``), the first byte of the response for the time to first token (a stream's first event;
        the whole reply otherwise) and its duration."""
        read = rec.get("usage")
        if isinstance(read, dict) and "cached_tokens" in read:
            prompt, cached, completion = (_int(read.get(k)) for k in ("prompt_tokens", "cached_tokens",
                                                                      "completion_tokens"))
        else:
            prompt, cached, completion = usage_of(rec)
        status = _int(rec.get("status"))
        return cls(
            method=str(rec.get("method") or ""), route=str(rec.get("path") or "").split("?", 1)[0], status=status,
            model=None, stream=bool(rec.get("stream")), prompt_tokens=prompt, cached_tokens=cached,
            completion_tokens=completion, finish_reason=None,
            ttft_ms=_float(rec.get("first_byte_ms") if rec.get("stream") else rec.get("duration_ms")),
            total_ms=_float(rec.get("duration_ms")), error=rec.get("error") or None,
        )

    @property
    def failed(self) -> bool:
        return self.status >= 400 or bool(self.error)


def _events(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON objects a recorded response carried: its body, or the SSE events in its stream's tail."""
    body = rec.get("response_body")
    if isinstance(body, dict):
        return [body]
    out: list[dict[str, Any]] = []
    for line in str(rec.get("response_tail") or "").splitlines():
        if line.startswith("data:"):
            try:
                event = json.loads(line[5:].strip())
            except ValueError:
                continue  # the tail's first line may be cut, and "[DONE]" is not JSON
            if isinstance(event, dict):
                out.append(event)
    return out


def usage_of(rec: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens from the last usage a recorded response carried, in each API's own
    fields (chat completions' ``usage``, Responses' ``response.usage``, Messages' ``usage`` with
    ``cache_read_input_tokens``); zeros when it carried none."""
    for event in reversed(_events(rec)):
        usage = event.get("usage")
        if not isinstance(usage, dict):
            response = event.get("response") or event.get("message")
            usage = response.get("usage") if isinstance(response, dict) else None
        if not isinstance(usage, dict):
            continue
        if "prompt_tokens" in usage:  # chat completions
            details = usage.get("prompt_tokens_details") or {}
            return (_int(usage.get("prompt_tokens")), _int(details.get("cached_tokens")),
                    _int(usage.get("completion_tokens")))
        details = usage.get("input_tokens_details")
        if isinstance(details, dict):  # Responses
            return (_int(usage.get("input_tokens")), _int(details.get("cached_tokens")),
                    _int(usage.get("output_tokens")))
        cached = _int(usage.get("cache_read_input_tokens"))  # Messages: input_tokens is what was not cached
        return (_int(usage.get("input_tokens")) + cached + _int(usage.get("cache_creation_input_tokens")), cached,
                _int(usage.get("output_tokens")))
    return 0, 0, 0


@dataclass
class AgentResult:
    """One agent's run: what it did, what the daemon saw, what the proxy recorded."""

    agent: str
    argv: list[str]
    started: float  # wall clock
    exit_code: int | None  # the first task's that failed, else the last's; None: it ran past its timeout and was killed
    timed_out: bool
    seconds: float
    changed: bool
    fixed: bool
    access: list[AccessLine] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)  # the proxy's summaries
    diff: str = ""
    note: str = ""
    daemon_after: dict[str, Any] | None = None  # its status once the agent's requests were done (or settle ran out)
    task_exits: list[int | None] = field(default_factory=list)  # each task's exit code in order (None: timed out)
    #: ``--kill-within``: when the harness killed it (seconds into its run; None: it ended first), and how soon after
    #: the daemon's slot was free (None: not within a minute)
    killed_at: float | None = None
    freed_s: float | None = None

    @property
    def errors(self) -> int:
        return sum(1 for a in self.access if a.failed)

    @property
    def prompt_tokens(self) -> int:
        return sum(a.prompt_tokens for a in self.access)

    @property
    def reuse(self) -> float | None:
        """Cached ÷ prompt tokens over the generating requests after the first; None with fewer than two."""
        turns = [a for a in self.access if a.prompt_tokens > 0]
        later = turns[1:]
        prompt = sum(a.prompt_tokens for a in later)
        if not prompt:
            return None
        return sum(a.cached_tokens for a in later) / prompt

    def routes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self.access:
            key = f"{a.method} {a.route} {a.status}" + (f" {a.error}" if a.error else "")
            out[key] = out.get(key, 0) + 1
        return out

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in asdict(self).items() if k not in ("access",)}
        out.update(requests_served=len(self.access), errors=self.errors, reuse=self.reuse,
                   prompt_tokens_total=self.prompt_tokens, routes=self.routes(),
                   access=[asdict(a) for a in self.access], proxied=len(self.requests))
        return out


HEADER = ("agent", "requests", "errors", "reuse", "prompt tok", "time s", "changed", "fixed", "exit")


def _row(r: AgentResult) -> tuple[str, ...]:
    reuse = "-" if r.reuse is None else f"{r.reuse:.0%}"
    exit_code = "timeout" if r.timed_out else str(r.exit_code)
    if len(r.task_exits) > 1 and any(code != 0 for code in r.task_exits):
        # which tasks failed: a failure before a last task that ended well is not hidden behind its 0
        exit_code = "/".join("timeout" if code is None else str(code) for code in r.task_exits)
    if r.killed_at is not None:  # (--kill-within): when, and how soon the slot was free after
        exit_code = f"killed at {r.killed_at:.0f} s, slot free " + ("past 60 s" if r.freed_s is None
                                                                     else f"{r.freed_s:.2f} s after")
    requests = str(len(r.access)) + ("" if len(r.requests) == len(r.access) else f" ({len(r.requests)} sent)")
    return (r.agent, requests, str(r.errors), reuse, f"{r.prompt_tokens:,}", f"{r.seconds:.0f}",
            "yes" if r.changed else "no", "yes" if r.fixed else "no", exit_code)


def table(results: list[AgentResult]) -> str:
    """A plain-text table, one row per agent (``requests`` says how many the proxy saw when that differs)."""
    return _layout([HEADER, *(_row(r) for r in results)])


def _layout(rows: Sequence[tuple[str, ...]]) -> str:
    """Rows as plain-text columns (the first left-aligned, the rest right), a rule under the first (the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _median_request_s(r: AgentResult) -> str:
    """The median request's seconds as the proxy timed it, for either server alike (a stream's first byte is not
    its first token on both: modeld sends keep-alives while it prefills, llama-server nothing)."""
    took = [float(q["duration_ms"]) for q in r.requests if q.get("method") == "POST" and q.get("duration_ms")]
    return f"{statistics.median(took) / 1000:.1f}" if took else "-"


SIDE_HEADER = ("agent", "requests", "errors", "reuse", "request s (median)", "time s", "fixed")


def side_by_side(ours: list[AgentResult], peer: list[AgentResult], peer_name: str) -> str:
    """One row per agent: modeld's figure, then the peer's (``a / b``), for the same agents and tasks."""
    by_name = {r.agent: r for r in peer}
    rows = [SIDE_HEADER]
    for r in ours:
        p = by_name.get(r.agent)

        def pair(f: Any, r: AgentResult = r, p: AgentResult | None = p) -> str:
            return f"{f(r)} / {f(p) if p is not None else '-'}"

        rows.append((r.agent, pair(lambda x: str(len(x.access))), pair(lambda x: str(x.errors)),
                     pair(lambda x: "-" if x.reuse is None else f"{x.reuse:.0%}"), pair(_median_request_s),
                     pair(lambda x: f"{x.seconds:.0f}"), pair(lambda x: "yes" if x.fixed else "no")))
    return f"modeld / {peer_name}, the same agents and tasks\n" + _layout(rows)
