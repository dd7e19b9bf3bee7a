"""The tape engines' side of the workspace cache (``contract.interfaces.StateCache``).

Both engines follow the same rules, so they live here once:

* **Save points.** Before an operation discards more than ``MIN_GAIN_TOKENS`` of
  the tape (a request switched to another workspace: another system prompt, or
  another conversation under the same one: a sub-agent beside its parent), the
  whole tape is saved first, so switching back restores it: a restore gives back
  as little as that, and a copy of the state costs less than prefilling it again
  (a tape holds at least ``SAVE_MIN_TOKENS``). After ``ensure_prefix`` prefilled at least
  ``SAVE_MIN_TOKENS`` of a stable prefix, the prefix is saved (a later save of
  the same tape with a conversation after it replaces that entry). When the
  model is unloaded or the daemon stops, the tape is saved (the cache writes it
  to disk, so a restart resumes warm).
* **Restore rule.** When a request's target tokens share more than
  ``MIN_GAIN_TOKENS`` more with a cached entry than with the resident tape, the
  entry is restored and only the rest is prefilled. A restore is an exact copy
  of the KV that was saved, so decoding after it gives what the uninterrupted
  session gives.
* **Keys.** An entry is filed under ``cache_key``: the engine, its version, the
  model digest, the runtime settings that change numerics (the reuse identity),
  the context size and the manifest's identity fields. A different template
  digest, BOS policy or runtime config is a different key and never hits.

A failed save is logged and costs the request nothing; a refused restore drops
the entry and the request prefills as if there were no cache.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from contract.errors import ModeldError, SnapshotRejected
from contract.manifest import ContextManifest, canonical_digest

from .state import check_restorable

if TYPE_CHECKING:
    from .model import TapeModel

log = logging.getLogger("modeld.cache")

#: shorter tapes are not saved: prefilling them again costs about what saving and reading them back does
SAVE_MIN_TOKENS = 256
#: a restore must spare at least this many tokens of prefill beyond what the resident tape gives
MIN_GAIN_TOKENS = 32
#: for this many finished turns after a switch (a restore, or a save before a discard) the slot counts as
#: switching between conversations: each turn's tape is saved while the slot is idle (``TapeModel.turn_ended``)
SWITCHING_TURNS = 8


def cache_key(m: TapeModel, manifest: ContextManifest) -> str:
    """Everything a state's bytes are valid for; entries are only restored under the same key."""
    return canonical_digest(
        {
            "backend": m.backend_name,
            "engine": m.engine_version(),
            "model": m.digest,
            "runtime": m.reuse_identity(),
            "num_ctx": m.num_ctx,
            "manifest": manifest.identity(),
        }
    )


def save_tape(m: TapeModel, conversation: str | None = None) -> bool:
    """Put the whole tape (the KV kept past the context included) into the cache unless an entry holds it, as
    ``conversation``'s state (None: the conversation the tape holds)."""
    cache, res = m.cache, m.res
    # the head of a prefix whose prefill was cancelled is kept too (``Resident.partial``): an agent that gave up on
    # its long first request resends it, maybe after another request took the slot, and goes on from there
    manifest = res.manifest or res.partial
    if cache is None or manifest is None or len(res.tokens) < SAVE_MIN_TOKENS or m.closed:
        return False
    key = cache_key(m, manifest)
    if cache.covers(key, res.tokens):
        return False
    try:
        with m.errors("workspace cache: save"):
            state, kind = m.export_state()
        snap = res.tape_snapshot(m.backend_name, state, kind)
        snap.manifest = manifest
        cache.put(key, snap, conversation=res.conversation if conversation is None else conversation)
    except (ModeldError, OSError, MemoryError) as exc:
        log.warning("workspace cache: could not save the tape: %s", exc)
        return False
    return True


def save_before_discard(m: TapeModel, keep: int) -> None:
    """Save the tape when an operation is about to keep only ``keep`` of it and drop what a restore would give back.

    A short stretch that is only the model's last reply (a template that drops earlier reasoning, a reply the
    agent resent otherwise) is not worth a copy of the whole tape: no prompt will hold it again.
    """
    res = m.res
    dropped = len(res.tokens) - keep
    only_reply = res.reply_from is not None and keep >= res.reply_from
    if dropped >= SAVE_MIN_TOKENS or (dropped > MIN_GAIN_TOKENS and not only_reply):
        save_tape(m)
        m.turns_since_switch = 0


def restore_best(m: TapeModel, manifest: ContextManifest, target: list[int], have: int, *, count_miss: bool) -> int:
    """Restore the entry covering most of ``target`` when it spares prefill; returns the tokens it covers.

    ``have`` is what the resident tape already gives. On a restore the tape is
    saved first (when a long stretch is dropped) and the KV and ``res.tokens``
    then hold the entry's tape; the caller re-plans against it. Returns 0 when
    nothing was restored; the KV is then unchanged, or cleared when the engine
    refused the state after touching it (the caller re-plans either way).
    """
    cache = m.cache
    if cache is None or len(target) - have <= MIN_GAIN_TOKENS:
        return 0
    key = cache_key(m, manifest)
    found = cache.lookup(key, target, min_len=have + MIN_GAIN_TOKENS, max_tokens=m.num_ctx, count_miss=count_miss)
    if found is None:
        return 0
    snap, covered = found
    save_before_discard(m, have)
    try:
        # the cache verified the bytes when it read them from disk; the tape was saved above
        m.res.validate_snapshot(snap, m.backend_name, m.digest, check_digest=False)
        check_restorable(snap, m.backend_name, m.vocab_size)
        m.import_state(snap, backup=False)
    except SnapshotRejected as exc:
        cache.reject(key, snap, exc.message)
        return 0
    m.res.tokens = list(snap.resident_token_ids)
    m.res.live_len = None
    m.res.manifest = snap.manifest  # the same identity (the key says so); the caller commits its own
    m.res.partial = None
    m.res.messages = None
    m.res.reply_from = None
    m.res.conversation = ""  # (the request that restored it names its own once its prefill is done)
    gained = m.reusable(covered) - have
    cache.note_restored(gained)
    m.turns_since_switch = 0
    log.info("workspace cache: restored %d tokens (%d beyond the resident tape)", len(snap.resident_token_ids), gained)
    return covered
