"""The workspace cache: KV states of token prefixes the slot may need again, in RAM and on disk.

One slot holds one KV tape. A coding agent alternates prompts (the main agent
and its sub-agents each have their own system prompt and tools; a user hops
between repositories), and without a cache every switch re-prefills the whole
prefix. The tape engines (``backends.tape.cache``) save the tape's state here
before they discard a long stretch of it, after they prefill a stable prefix,
and when the model is unloaded; when a request's token LCP with the resident
tape is shorter than what an entry covers, they restore the entry and prefill
only the rest.

**Entries and lookup.** An entry is one whole engine state (a
``SessionSnapshot``: state bytes, the token ids they hold, the manifest) filed
under a key that names everything the bytes are valid for: engine and version,
model digest, runtime settings, context size and the manifest's identity
(template digest, BOS policy …). A lookup takes the entries under the request's
key and picks the one with the longest token LCP. A flat list of whole states,
not a token trie or a block hash chain, because an engine restores a state as a
whole: neither llama.cpp's per-sequence state nor the OpenVINO block pools can
share blocks between entries, so a trie would save no bytes; and a state that
extends another replaces it (``put``), so entries do not repeat each other.
Entries number in the tens (a 2k-token state of the bundled model is ~50 MB)
and an LCP over each costs microseconds.

**Tiers.** RAM is an LRU under ``ram_budget`` bytes that gives up a named
conversation's older entries (``SuffixInput.conversation``: an agent's id for it)
before any conversation's newest, so a parent and its sub-agents keep their latest
states while any of them holds an older one. The disk tier, an LRU
under ``disk_budget`` bytes, is written back, not through: an entry is written
by one background thread when RAM evicts it (or when it never fitted in RAM),
and the entries still only in RAM are written when the cache closes (an unload
or a stop), newest first. So a conversation that keeps extending one tape
writes nothing while it runs, and only a state that could be restored later
costs disk bandwidth; a daemon killed outright loses the RAM tier's entries
that were not written yet. A state fewer than ``WRITE_MIN_GAIN_TOKENS`` past a
file that holds its start is not written: RAM keeps the longer state (its
restore is exact), the disk the file (whose restore spares nearly all the
prefill). A disk
file is ``MAGIC | header length | header (JSON) | state | sha256 of all before``,
mode 0600 in a 0700 directory, named by the entry id (a hash of key and
tokens). It is verified when it is read: the trailing digest, the id against
key and tokens, the header against the snapshot schema; a corrupt or foreign
file is deleted and reported (``rejected``, ``last_rejection``), never restored.
Budgets of 0 turn a tier off; ``None`` sizes it automatically (RAM from the
capacity planner's spare memory after each load, disk from the free space).

Over ~400 lines on purpose: the RAM and disk tiers share one entry table under one lock, and the
write-back thread moves entries from one to the other; the rules below are the module's whole job.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil  # no stubs in the venv (ignore_missing_imports)
from pydantic import ValidationError

from contract.manifest import common_prefix_len, token_hash
from contract.types import CacheEntryInfo, CacheStatus, SessionSnapshot

__all__ = ["AUTO_DISK_CAP", "AUTO_RAM_CAP", "StateCacheStore", "entry_id"]

log = logging.getLogger("modeld.cache")

MAGIC = b"modeld-kvcache1\n"
_LEN = struct.Struct("<I")
_DIGEST_BYTES = 32
#: the largest header a disk entry may have (token ids of a long context as JSON)
_MAX_HEADER = 64 * 1024 * 1024
#: automatic budgets: RAM at most this (and half of what the planner leaves spare), disk at most this
#: (and a quarter of the free space)
AUTO_RAM_CAP = 4 * 2**30
AUTO_DISK_CAP = 16 * 2**30
#: how long ``close`` waits for queued disk writes
CLOSE_WAIT_S = 20.0
#: an entry is written to disk only when it holds at least this many tokens more than a file already holds
WRITE_MIN_GAIN_TOKENS = 256
#: the disk writer's niceness (Linux schedules threads one by one)
WRITER_NICE = 10


def entry_id(key: str, tokens: Sequence[int]) -> str:
    """An entry's name: sha256 over its key and its token ids (also its file name)."""
    return hashlib.sha256(f"{key}\n{token_hash(tokens)}".encode()).hexdigest()


@dataclass
class _Entry:
    id: str
    key: str
    tokens: list[int]
    prefix_tokens: int
    model_digest: str
    backend: str
    #: bytes it holds in RAM (state + token ids), and its file size when on disk
    nbytes: int
    last_used: float
    snap: SessionSnapshot | None = None
    disk_bytes: int = 0
    #: a disk write is queued or running
    writing: bool = False
    #: whose state it is (``SuffixInput.conversation``); "" when not named (a file keeps it in its header)
    conversation: str = ""


def _ram_bytes(snap: SessionSnapshot) -> int:
    return len(snap.state) + 8 * len(snap.resident_token_ids) + len(snap.stable_text) + len(snap.tools)


class StateCacheStore:
    """The daemon's ``StateCache`` (for the tape engines) and ``CacheAdmin`` (for the slot and status)."""

    def __init__(self, directory: Path | None, *, ram_budget: int | None = None, disk_budget: int | None = None) -> None:
        self._dir = directory if disk_budget != 0 else None
        self._ram_auto = ram_budget is None
        self._ram_budget = min(AUTO_RAM_CAP, int(psutil.virtual_memory().available) // 4) if ram_budget is None else ram_budget
        self._disk_budget = 0
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._ram: OrderedDict[str, None] = OrderedDict()  # LRU order of the entries held in RAM
        self._ram_bytes = 0
        self._disk_bytes = 0
        self._hits = self._misses = self._restored = self._saves = self._evictions = self._rejected = 0
        #: bytes written to the disk tier since start
        self._written = 0
        self._last_rejection = ""
        self._queue: queue.Queue[_Entry | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._closed = False
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self._dir, 0o700)
            if disk_budget is None:
                disk_budget = min(AUTO_DISK_CAP, shutil.disk_usage(self._dir).free // 4)
            self._disk_budget = disk_budget
            self._scan()
            self._writer = threading.Thread(target=self._write_loop, name="modeld-cache-writer", daemon=True)
            self._writer.start()

    @property
    def enabled(self) -> bool:
        return self._ram_budget > 0 or self._dir is not None

    # --- StateCache (the engine's side; the worker thread) -----------------------------------
    def lookup(
        self, key: str, tokens: Sequence[int], *, min_len: int, max_tokens: int, count_miss: bool = True
    ) -> tuple[SessionSnapshot, int] | None:
        with self._lock:
            found = [
                (common_prefix_len(e.tokens, tokens), e.last_used, e)
                for e in self._entries.values()
                if e.key == key and len(e.tokens) <= max_tokens
            ]
        for lcp, _, entry in sorted((c for c in found if c[0] > min_len), key=lambda c: (-c[0], -c[1])):
            snap = entry.snap if entry.snap is not None else self._read(entry)
            if snap is None:
                continue  # refused and dropped; try the next best
            with self._lock:
                self._hits += 1
                self._touch(entry)
                if entry.snap is None and entry.id in self._entries:
                    self._hold_in_ram(entry, snap)
            return snap, lcp
        if count_miss:
            with self._lock:
                self._misses += 1
        return None

    def covers(self, key: str, tokens: Sequence[int]) -> bool:
        n = len(tokens)
        with self._lock:
            return any(
                e.key == key and len(e.tokens) >= n and common_prefix_len(e.tokens, tokens) == n
                for e in self._entries.values()
            )

    def put(self, key: str, snap: SessionSnapshot, conversation: str = "") -> None:
        tokens = list(snap.resident_token_ids)
        n = len(tokens)
        if not self.enabled or self._closed or not tokens:
            return
        nbytes = _ram_bytes(snap)
        with self._lock:
            for e in self._entries.values():
                if e.key == key and len(e.tokens) >= n and common_prefix_len(e.tokens, tokens) == n:
                    self._touch(e)  # already covered: the longer entry restores this too
                    return
            for e in [e for e in self._entries.values() if e.key == key and common_prefix_len(e.tokens, tokens) == len(e.tokens)]:
                if e.disk_bytes and n - len(e.tokens) < WRITE_MIN_GAIN_TOKENS:
                    self._unhold(e)  # the new entry extends it by a few tokens: RAM keeps the new, disk the old
                else:
                    self._drop(e)  # the new entry extends it
            entry = _Entry(
                id=entry_id(key, tokens),
                key=key,
                tokens=tokens,
                prefix_tokens=snap.prefix_tokens,
                model_digest=snap.manifest.model_digest,
                backend=snap.backend,
                nbytes=nbytes,
                last_used=time.time(),
                conversation=conversation,
            )
            kept = False
            if nbytes <= self._ram_budget:
                self._entries[entry.id] = entry
                self._hold_in_ram(entry, snap)
                kept = True
            elif self._queue_write(entry, snap):  # too large for RAM: straight to disk
                self._entries[entry.id] = entry
                kept = True
            if kept:
                self._saves += 1

    def reject(self, key: str, snap: SessionSnapshot, reason: str) -> None:
        eid = entry_id(key, snap.resident_token_ids)
        with self._lock:
            entry = self._entries.get(eid)
            if entry is not None:
                self._drop(entry)
            self._note_rejection(f"{eid[:12]}: {reason}")

    def note_restored(self, tokens: int) -> None:
        with self._lock:
            self._restored += max(0, tokens)

    # --- CacheAdmin (the slot and status; any thread) ---------------------------------------------
    def status(self) -> CacheStatus:
        with self._lock:
            asked = self._hits + self._misses
            return CacheStatus(
                ram_entries=len(self._ram),
                ram_bytes=self._ram_bytes,
                ram_budget_bytes=self._ram_budget,
                disk_entries=sum(1 for e in self._entries.values() if e.disk_bytes),
                disk_bytes=self._disk_bytes,
                disk_budget_bytes=self._disk_budget,
                disk_dir=str(self._dir) if self._dir is not None else "",
                disk_written_bytes=self._written,
                hits=self._hits,
                misses=self._misses,
                hit_rate=self._hits / asked if asked else None,
                restored_tokens=self._restored,
                saves=self._saves,
                evictions=self._evictions,
                rejected=self._rejected,
                last_rejection=self._last_rejection,
            )

    def entries(self) -> list[CacheEntryInfo]:
        with self._lock:
            out = [
                CacheEntryInfo(
                    id=e.id[:16],
                    model_digest=e.model_digest,
                    backend=e.backend,
                    tokens=len(e.tokens),
                    prefix_tokens=e.prefix_tokens,
                    bytes=max(e.nbytes if e.snap is not None else 0, e.disk_bytes),
                    where="+".join(w for w, on in (("ram", e.snap is not None), ("disk", e.disk_bytes > 0 or e.writing)) if on),
                    last_used=e.last_used,
                    conversation=e.conversation,
                )
                for e in self._entries.values()
            ]
        return sorted(out, key=lambda i: -i.last_used)

    def clear(self) -> int:
        with self._lock:
            gone = list(self._entries.values())
            for e in gone:
                self._drop(e)
            return len(gone)

    def fit_ram(self, spare_bytes: int) -> None:
        if not self._ram_auto:
            return
        with self._lock:
            self._ram_budget = max(0, min(AUTO_RAM_CAP, spare_bytes // 2))
            self._evict_ram()

    def release_ram(self) -> None:
        """Hand the RAM tier back (before a model load); its entries are written to disk first where it takes them."""
        with self._lock:
            for eid in list(self._ram):
                entry = self._entries[eid]
                if entry.snap is not None:
                    self._queue_write(entry, entry.snap)
                self._unhold(entry)

    def drain(self) -> None:
        """Wait until every disk write queued so far is done (written or given up): what the disk tier holds is
        then settled (a test's seam, and a point a caller may wait for before reading the directory)."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Write the entries only RAM holds (newest first), finish the queued disk writes (at most
        ``CLOSE_WAIT_S`` in all), then stop the writer."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for eid in reversed(self._ram):
                entry = self._entries[eid]
                if entry.snap is not None:
                    self._queue_write(entry, entry.snap)
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(CLOSE_WAIT_S)
            if self._writer.is_alive():
                log.warning("workspace cache: disk writes still running after %.0f s; leaving them", CLOSE_WAIT_S)

    # --- RAM tier (callers hold the lock) --------------------------------------------------------
    def _touch(self, entry: _Entry) -> None:
        entry.last_used = time.time()
        if entry.id in self._ram:
            self._ram.move_to_end(entry.id)
        if entry.disk_bytes and self._dir is not None:
            # the file's mtime carries the LRU order across a restart
            with contextlib.suppress(OSError):
                os.utime(self._path(entry.id))

    def _hold_in_ram(self, entry: _Entry, snap: SessionSnapshot) -> None:
        if entry.nbytes > self._ram_budget:
            return
        entry.snap = snap
        self._ram[entry.id] = None
        self._ram_bytes += entry.nbytes
        self._evict_ram()

    def _unhold(self, entry: _Entry) -> None:
        """Take ``entry`` out of RAM; it stays an entry only while it is (or is being written) on disk."""
        if entry.id in self._ram:
            del self._ram[entry.id]
            self._ram_bytes -= entry.nbytes
        entry.snap = None
        if not entry.disk_bytes and not entry.writing:
            self._entries.pop(entry.id, None)

    def _evict_ram(self) -> None:
        while self._ram_bytes > self._ram_budget and self._ram:
            entry = self._entries[self._ram_victim()]
            if entry.snap is not None and not self._queue_write(entry, entry.snap):
                self._evictions += 1  # gone for good: no disk copy
            self._unhold(entry)

    def _ram_victim(self) -> str:
        """The RAM entry to give up first: the least recently used of those a newer entry of the same named
        conversation supersedes (a history the agent rewrote, a state it has moved past), else the least recently
        used. So parallel sub-agents and their parent each keep their newest state while any of them has an older
        one to give. Caller holds the lock."""
        newest: dict[str, str] = {}
        for eid in self._ram:  # least recently used first: the last one seen of a conversation is its newest
            conv = self._entries[eid].conversation
            if conv:
                newest[conv] = eid
        for eid in self._ram:
            conv = self._entries[eid].conversation
            if conv and newest[conv] != eid:
                return eid
        return next(iter(self._ram))

    def _queue_write(self, entry: _Entry, snap: SessionSnapshot) -> bool:
        """Queue ``entry``'s disk write unless it is on disk or queued already; False when the disk tier cannot
        take it (off, or the entry is larger than its budget). Caller holds the lock."""
        if entry.disk_bytes or entry.writing:
            return True
        if self._dir is None or self._writer is None or entry.nbytes > self._disk_budget:
            return False
        n = len(entry.tokens)
        if any(o.key == entry.key and o.id != entry.id and o.disk_bytes and len(o.tokens) > n - WRITE_MIN_GAIN_TOKENS
               and common_prefix_len(o.tokens, entry.tokens) == len(o.tokens) for o in self._entries.values()):
            return True  # a file holds all but a few of its tokens: restoring that one spares nearly all the prefill
        entry.writing = True
        self._queue.put(_Entry(**{**entry.__dict__, "snap": snap}))
        return True

    def _drop(self, entry: _Entry) -> None:
        """Forget ``entry`` in both tiers (a queued write of it is skipped)."""
        self._unhold(entry)
        self._entries.pop(entry.id, None)
        entry.writing = False
        self._delete_file(entry)

    def _path(self, eid: str) -> Path:
        assert self._dir is not None
        return self._dir / f"{eid}.kv"

    def _delete_file(self, entry: _Entry) -> None:
        """Remove the entry's disk copy, if it has one (caller holds the lock)."""
        if entry.disk_bytes:
            self._path(entry.id).unlink(missing_ok=True)
            self._disk_bytes -= entry.disk_bytes
            entry.disk_bytes = 0

    def _note_rejection(self, why: str) -> None:
        self._rejected += 1
        self._last_rejection = why
        log.warning("workspace cache: refused an entry: %s", why)

    # --- disk tier --------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        # Below the engine's threads: hashing and writing ~50 MB must not slow a turn on a 2-core box.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            try:
                self._write(item)
            except Exception as exc:  # a full disk must not stop the daemon: the entry stays RAM-only
                log.warning("workspace cache: could not write entry %s: %s", item.id[:12], exc)
                with self._lock:
                    live = self._entries.get(item.id)
                    if live is not None:
                        live.writing = False
                        if live.snap is None:
                            self._entries.pop(live.id, None)
            finally:
                if item is not None:
                    self._queue.task_done()

    def _write(self, item: _Entry) -> None:
        assert self._dir is not None and item.snap is not None
        with self._lock:
            live = self._entries.get(item.id)
            if live is None or not live.writing:
                return  # dropped (or replaced by a longer entry) while queued
        snap = item.snap
        meta = snap.model_dump(mode="json", exclude={"state"})
        meta["state_digest"] = "sha256:" + hashlib.sha256(snap.state).hexdigest()  # left to this thread by the saver
        header = json.dumps({"key": item.key, "snapshot": meta, "state_len": len(snap.state),
                             "conversation": item.conversation}, separators=(",", ":")).encode()
        size = len(MAGIC) + _LEN.size + len(header) + len(snap.state) + _DIGEST_BYTES
        with self._lock:
            # room first: the tier never holds more than its budget, not even while a file is being written
            self._prune_disk(reserve=size)
        digest = hashlib.sha256()
        path = self._path(item.id)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                for part in (MAGIC, _LEN.pack(len(header)), header, snap.state):
                    digest.update(part)
                    f.write(part)
                f.write(digest.digest())
            size = tmp.stat().st_size
            with self._lock:
                live = self._entries.get(item.id)
                if live is None or not live.writing:
                    tmp.unlink(missing_ok=True)
                    return
                os.replace(tmp, path)
                live.writing = False
                live.disk_bytes = size
                self._disk_bytes += size
                self._written += size
                self._prune_disk()
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _prune_disk(self, reserve: int = 0) -> None:
        """Delete least recently used files until the tier fits its budget with ``reserve`` bytes to spare
        (caller holds the lock)."""
        on_disk = sorted((e for e in self._entries.values() if e.disk_bytes), key=lambda e: e.last_used)
        for e in on_disk:
            if self._disk_bytes + reserve <= self._disk_budget:
                break
            self._delete_file(e)
            if e.snap is None:
                self._entries.pop(e.id, None)
                self._evictions += 1

    def _read_header(self, path: Path, data: bytes | None = None) -> tuple[str, SessionSnapshot, int, str]:
        """Key, snapshot bookkeeping (no state), state length and conversation from a file's header; ValueError if
        not ours.

        ``data``: the whole file, already read (a restore); else only the header is read (the start-up scan).
        """
        head_len = len(MAGIC) + _LEN.size
        with contextlib.ExitStack() as stack:
            if data is None:
                f = stack.enter_context(open(path, "rb"))
                head = f.read(head_len)
            else:
                head = data[:head_len]
            if head[: len(MAGIC)] != MAGIC or len(head) != head_len:
                raise ValueError("not a workspace cache file of this version")
            (hlen,) = _LEN.unpack(head[len(MAGIC) :])
            if hlen > _MAX_HEADER:
                raise ValueError("header too large")
            raw = f.read(hlen) if data is None else data[head_len : head_len + hlen]
            size = path.stat().st_size if data is None else len(data)
        try:
            header = json.loads(raw)
            key, state_len = header["key"], header["state_len"]
            conversation = header.get("conversation", "")  # (files of earlier versions have none)
            snap = SessionSnapshot.model_validate(header["snapshot"])
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            raise ValueError(f"header unreadable: {exc}") from exc
        if not isinstance(key, str) or not isinstance(state_len, int) or state_len < 0 or not isinstance(conversation, str):
            raise ValueError("header fields have the wrong types")
        if entry_id(key, snap.resident_token_ids) != path.stem:
            raise ValueError("the file name does not match its key and tokens")
        expected = head_len + hlen + state_len + _DIGEST_BYTES
        if size != expected:
            raise ValueError(f"file is {size} bytes; its header implies {expected}")
        return key, snap, state_len, conversation

    def _read(self, entry: _Entry) -> SessionSnapshot | None:
        """The entry's snapshot from disk, verified; None (entry dropped, rejection counted) if it fails."""
        path = self._path(entry.id)
        try:
            data = path.read_bytes()  # once: the header and the state come from these bytes
            if hashlib.sha256(data[:-_DIGEST_BYTES]).digest() != data[-_DIGEST_BYTES:]:
                raise ValueError("content digest mismatch (the file is corrupt or was changed)")
            key, meta, state_len, _ = self._read_header(path, data)
            if key != entry.key:
                raise ValueError("key changed on disk")
            state = data[-_DIGEST_BYTES - state_len : -_DIGEST_BYTES]
            snap = meta.model_copy(update={"state": state})
            if snap.state_digest != "sha256:" + hashlib.sha256(state).hexdigest():
                raise ValueError("state bytes do not match the snapshot's state_digest")
        except (OSError, ValueError) as exc:
            with self._lock:
                self._drop(entry)
                self._note_rejection(f"{path.name}: {exc}")
            return None
        return snap

    def _scan(self) -> None:
        """Index the files already in the directory (headers only); drop what is not a valid entry."""
        assert self._dir is not None
        me = os.getuid()
        strangers: list[str] = []
        for path in sorted(self._dir.iterdir()):
            if ".tmp" in path.suffix:
                path.unlink(missing_ok=True)  # a write that a crash interrupted
                continue
            if path.suffix != ".kv" or not path.is_file():
                strangers.append(path.name)  # not ours: left alone, and not counted against the budget
                continue
            try:
                st = path.stat()
                if st.st_uid != me or st.st_mode & 0o077:
                    raise ValueError(f"mode {st.st_mode & 0o777:o} owner {st.st_uid}: not a private file of this user")
                key, snap, _, conversation = self._read_header(path)
            except (OSError, ValueError) as exc:
                path.unlink(missing_ok=True)
                self._note_rejection(f"{path.name}: {exc}")
                continue
            entry = _Entry(
                id=path.stem,
                key=key,
                tokens=list(snap.resident_token_ids),
                prefix_tokens=snap.prefix_tokens,
                model_digest=snap.manifest.model_digest,
                backend=snap.backend,
                nbytes=st.st_size,  # the state's RAM size, near enough, until it is read
                last_used=st.st_mtime,
                disk_bytes=st.st_size,
                conversation=conversation,
            )
            self._entries[entry.id] = entry
            self._disk_bytes += st.st_size
        if strangers:
            log.warning("the workspace cache directory %s holds %d entr%s that %s not cache files (%s%s): left alone, "
                        "not counted against its budget", self._dir, len(strangers), "y" if len(strangers) == 1 else "ies",
                        "is" if len(strangers) == 1 else "are", ", ".join(strangers[:5]), ", …" if len(strangers) > 5 else "")
        with self._lock:
            self._prune_disk()
