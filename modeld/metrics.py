"""The daemon's Prometheus metrics (``modeld metrics``, the wire op ``metrics``, the HTTP front's ``/metrics``).

Counted by the server as requests are answered (``Metrics.request``,
``Metrics.reply``), read from the slot at scrape time (``SlotCollector``): the
state, memory, the workspace cache. Exposed as Prometheus text by
``prometheus-client``; one registry per daemon, so tests can run several.

| metric | kind | what |
|---|---|---|
| ``modeld_requests_total{op}`` | counter | requests answered, by operation |
| ``modeld_errors_total{op,error}`` | counter | error replies, by operation and error class |
| ``modeld_prompt_tokens_total{kind}`` | counter | ``reused`` / ``prefilled`` / ``cached`` (restored by the workspace cache) |
| ``modeld_decoded_tokens_total`` | counter | tokens generated |
| ``modeld_draft_tokens_total{result}`` | counter | speculative draft tokens ``accepted`` / ``rejected`` |
| ``modeld_reuse_ratio`` | gauge | reused / (reused + prefilled) since start |
| ``modeld_cache_misses_total{cause}`` | counter | requests whose prompt lost what the daemon held, by cause (``ReuseMiss``) |
| ``modeld_time_to_first_token_seconds`` | histogram | a turn's prefill (prefix + suffix) plus decode to its first token |
| ``modeld_decode_tokens_per_second`` | histogram | decode rate of each finished decode |
| ``modeld_slot_state{state}`` | gauge | 1 for the slot's current state |
| ``modeld_resident_bytes``, ``modeld_process_rss_bytes`` | gauge | the model's bytes; the daemon's RSS |
| ``modeld_cache_bytes{tier}``, ``modeld_cache_entries{tier}`` | gauge | the workspace cache |
| ``modeld_cache_lookups_total{result}`` | counter | workspace switches that were restored (``hit``) or not |
| ``modeld_cache_disk_written_bytes_total`` | counter | bytes the workspace cache wrote to disk |
| ``modeld_io_wakeups_total{cause}`` | counter | the IO thread's wake-ups: a socket ``event`` or a ``timer`` |
| ``modeld_connections_total{event}`` | counter | client connections ``accepted`` / ``closed`` |
| ``modeld_peers_connected``, ``modeld_peers_closing`` | gauge | clients with a connection open; clients whose connections all closed, within the grace |
| ``modeld_peers_gone_total`` | counter | clients whose connections stayed closed past the grace: their requests cancelled, their session released |
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import psutil  # no stubs in the venv (ignore_missing_imports)
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel

from contract.messages import WHY_KEPT
from contract.types import DaemonStatus, PrefixStatus, ReuseRecord, SlotState, StreamChunk, SuffixStatus

from .peers import PeerWatch

__all__ = ["CONTENT_TYPE", "Metrics"]

#: the Prometheus text exposition format
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SlotCollector(Collector):
    """What the slot knows at scrape time: state, memory, the workspace cache."""

    def __init__(self, status: Callable[[], DaemonStatus]) -> None:
        self._status = status
        self._proc = psutil.Process()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self._status()
        state = GaugeMetricFamily("modeld_slot_state", "1 for the slot's current state", labels=["state"])
        for s in SlotState:
            state.add_metric([s.value], 1.0 if st.state is s else 0.0)
        yield state
        yield GaugeMetricFamily("modeld_resident_bytes", "bytes the loaded model holds (weights, KV, scratch)",
                                value=float(st.active.resident_bytes if st.active else 0))
        yield GaugeMetricFamily("modeld_process_rss_bytes", "the daemon's resident set size",
                                value=float(self._proc.memory_info().rss))
        c = st.cache
        if c is not None:
            size = GaugeMetricFamily("modeld_cache_bytes", "workspace cache bytes", labels=["tier"])
            count = GaugeMetricFamily("modeld_cache_entries", "workspace cache entries", labels=["tier"])
            size.add_metric(["ram"], float(c["ram_bytes"]))
            size.add_metric(["disk"], float(c["disk_bytes"]))
            count.add_metric(["ram"], float(c["ram_entries"]))
            count.add_metric(["disk"], float(c["disk_entries"]))
            yield size
            yield count
            lookups = CounterMetricFamily("modeld_cache_lookups", "workspace switches that asked the cache",
                                          labels=["result"])
            lookups.add_metric(["hit"], float(c.get("hits", 0)))
            lookups.add_metric(["miss"], float(c.get("misses", 0)))
            yield lookups
            yield CounterMetricFamily("modeld_cache_disk_written_bytes", "bytes the workspace cache wrote to disk",
                                      value=float(c.get("disk_written_bytes", 0)))


class _Gauge(Collector):
    """One gauge whose value is read at scrape time."""

    def __init__(self, name: str, doc: str, value: Callable[[], float]) -> None:
        self._name, self._doc, self._value = name, doc, value

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self._name, self._doc, value=self._value())


class PeerCollector(Collector):
    """The IO thread's view of the clients' connections (``modeld.peers``), read at scrape time."""

    def __init__(self, peers: PeerWatch) -> None:
        self._peers = peers

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        w = self._peers
        conns = CounterMetricFamily("modeld_connections", "client connections accepted and closed", labels=["event"])
        conns.add_metric(["accepted"], w.accepted)
        conns.add_metric(["closed"], w.closed)
        yield conns
        yield GaugeMetricFamily("modeld_peers_connected", "clients with a connection open", value=len(w))
        yield GaugeMetricFamily("modeld_peers_closing", "clients whose connections all closed, within the grace "
                                "they have to come back", value=w.closing)
        yield CounterMetricFamily("modeld_peers_gone", "clients whose connections stayed closed past the grace "
                                  "(their requests cancelled, their session released)", value=w.gone_total)


class Metrics:
    """The daemon's counters and histograms, and the text a scrape returns."""

    def __init__(self, status: Callable[[], DaemonStatus]) -> None:
        self._lock = threading.Lock()
        self._reused = self._prefilled = 0
        #: session id -> prefill time of its current turn (ms), added to the decode's first token
        self._turn_ms: dict[str, float] = {}
        #: session id -> its turn's prefix status, until its suffix makes the turn's ``ReuseRecord``
        self._prefix: dict[str, PrefixStatus] = {}
        #: the last requests' reuse, oldest first (``modeld why``)
        self._recent: deque[ReuseRecord] = deque(maxlen=WHY_KEPT)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("modeld_requests", "requests answered, by operation", ["op"], registry=r)
        self.errors = Counter("modeld_errors", "error replies, by operation and error class", ["op", "error"], registry=r)
        self.prompt_tokens = Counter("modeld_prompt_tokens", "prompt tokens by how they were served", ["kind"],
                                     registry=r)
        self.decoded = Counter("modeld_decoded_tokens", "tokens generated", registry=r)
        self.wakeups = Counter("modeld_io_wakeups", "times the IO thread woke, by cause: a socket's event (a message, "
                               "a reply, a connection) or a timer (its poll timed out); an idle daemon wakes for its "
                               "timers only, twice a second", ["cause"], registry=r)
        self.misses = Counter("modeld_cache_misses", "requests whose prompt lost part of what the daemon held (or "
                              "was new to it), by cause", ["cause"], registry=r)
        self.drafts = Counter("modeld_draft_tokens", "speculative draft tokens, accepted or rejected", ["result"],
                              registry=r)
        self.ttft = Histogram("modeld_time_to_first_token_seconds",
                              "a turn's prefill (prefix + suffix) plus its decode up to the first token", registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.rate = Histogram("modeld_decode_tokens_per_second", "decode rate of each finished decode", registry=r,
                              buckets=(5, 10, 20, 40, 60, 80, 100, 150, 200, 400))
        r.register(SlotCollector(status))
        r.register(_Gauge("modeld_reuse_ratio", "reused / (reused + prefilled) prompt tokens since start",
                          self._reuse_ratio))

    def request(self, op: str, error: str = "") -> None:
        self.requests.labels(op).inc()
        if error:
            self.errors.labels(op, error).inc()

    def reply(self, session_id: str, reply: BaseModel) -> None:
        """Count what a prefix/suffix status or a final decode chunk says."""
        if isinstance(reply, PrefixStatus | SuffixStatus):
            self.prompt_tokens.labels("reused").inc(reply.reused_tokens)
            self.prompt_tokens.labels("prefilled").inc(reply.prefilled_tokens)
            self.prompt_tokens.labels("cached").inc(reply.cached_tokens)
            with self._lock:
                self._reused += reply.reused_tokens
                self._prefilled += reply.prefilled_tokens
                self._turn_ms[session_id] = self._turn_ms.get(session_id, 0.0) + reply.prefill_ms
                if isinstance(reply, PrefixStatus):
                    self._prefix[session_id] = reply
                    return
                record = self._record(self._prefix.pop(session_id, None), reply)
                self._recent.append(record)
            if record.miss is not None:
                self.misses.labels(record.miss.cause.value).inc()
        elif isinstance(reply, StreamChunk) and reply.done and reply.usage is not None:
            u = reply.usage
            self.decoded.inc(u.completion_tokens)
            self.drafts.labels("accepted").inc(u.accepted_tokens)
            self.drafts.labels("rejected").inc(u.drafted_tokens - u.accepted_tokens)
            with self._lock:
                prefill_ms = self._turn_ms.pop(session_id, 0.0)
            if u.completion_tokens:
                self.ttft.observe((prefill_ms + u.ttft_ms) / 1000)
            if u.tokens_per_second > 0:
                self.rate.observe(u.tokens_per_second)

    @staticmethod
    def _record(pre: PrefixStatus | None, suf: SuffixStatus) -> ReuseRecord:
        """A turn's prompt: its prefix (when it was ensured in this session) and its suffix."""
        reused, cached, prefilled, ms = suf.reused_tokens, suf.cached_tokens, suf.prefilled_tokens, suf.prefill_ms
        render, tokenize = suf.render_ms, suf.tokenize_ms
        if pre is not None:
            reused, cached = reused + pre.reused_tokens, cached + pre.cached_tokens
            prefilled, ms = prefilled + pre.prefilled_tokens, ms + pre.prefill_ms
            render, tokenize = render + pre.render_ms, tokenize + pre.tokenize_ms
        return ReuseRecord(at=time.time(), prompt_tokens=suf.prefix_tokens + suf.suffix_tokens, reused_tokens=reused,
                           cached_tokens=cached, prefilled_tokens=prefilled, prefill_ms=ms, render_ms=render,
                           tokenize_ms=tokenize,
                           miss=(pre.miss if pre is not None else None) or suf.miss,
                           prompt_token_hash=suf.context_token_hash)

    def recent(self, last: int) -> list[ReuseRecord]:
        """The last ``last`` requests' reuse, oldest first."""
        with self._lock:
            return list(self._recent)[-last:]

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._turn_ms.pop(session_id, None)
            self._prefix.pop(session_id, None)

    def watch_peers(self, peers: PeerWatch) -> None:
        """Report the IO thread's ``PeerWatch`` too."""
        self.registry.register(PeerCollector(peers))

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def _reuse_ratio(self) -> float:
        with self._lock:
            total = self._reused + self._prefilled
            return self._reused / total if total else 0.0
