"""Why a prompt was not all reused: the place and the cause of every cache miss (``contract.types.ReuseMiss``).

A request is ``ensure_prefix`` (the system prompt and the tools) then ``prefill_suffix`` (the conversation).
Each compares its tokens with what the daemon held when it began: the resident tape (the KV, the previous
reply included) or the workspace cache's entry it restored. Where the prompt parts from that tape before the
tape's end, the tokens the daemon had computed past that point were lost to this prompt, and the status says
where (the token index, a few words of each side) and why:

* ``manifest_changed``: what was resident was computed under another identity (model, template, runtime
  settings, BOS policy), and nothing cached is under this one;
* ``evicted``: the daemon computed more of this very prompt before (``SeenPrompts`` remembers a fingerprint of
  every prompt it prefilled, block by block), but neither the KV nor the cache holds it now: another
  conversation took its place;
* in the prefix: ``system_changed`` or ``tools_changed`` (the texts tell which), or ``first_sight`` when not
  even the system prompt's first words are the resident one's (another agent);
* in the conversation: ``first_sight`` when it parts at its first message (a new conversation under a resident
  head: a sub-agent, a new task), ``history_rewritten`` at a later one (an edited message, a reply the agent
  resent otherwise than the model wrote it, a template that drops earlier reasoning); where the two part at an
  image's block (``backends.image_tokens``), the detail says it was another image.

A prompt that only adds to what was resident (a new turn) reports no miss: nothing held was lost. The first
prompt a daemon sees reports ``first_sight`` at token 0.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from contract.manifest import ContextManifest, common_prefix_len
from contract.types import ChatMessage, MissCause, ReuseMiss, SuffixInput

from ..image_tokens import is_image_token

__all__ = ["SEEN_BLOCK", "SHARED", "Held", "SeenPrompts", "message_keys", "prefix_miss", "suffix_miss"]

#: prompts are remembered in blocks of this many tokens (an eviction is seen to this precision)
SEEN_BLOCK = 64
#: fingerprints kept, oldest dropped first: 131,072 blocks of 64 tokens are 8M tokens of prompts (about 12 MB)
SEEN_LIMIT = 131_072
#: a prompt computed before must exceed what is reusable now by more than this to count as evicted
#: (the workspace cache does not restore smaller gains either: ``backends.tape.cache.MIN_GAIN_TOKENS``)
EVICTED_MIN_TOKENS = 32
#: two system prompts that share fewer leading characters than this are two agents', not one changed
SAME_AGENT_CHARS = 16
#: the excerpts' length in tokens, and their cap in characters
EXCERPT_TOKENS = 12
EXCERPT_CHARS = 80
#: how an excerpt shows an image's block (its placeholder tokens have no text)
IMAGE_WORD = "[image]"


class SeenPrompts:
    """Fingerprints of the token prefixes the daemon prefilled, every ``SEEN_BLOCK`` tokens, per cache key.

    Each fingerprint chains the one before it, so a hit at block ``k`` means the whole prefix up to it was
    computed before under the same key. Bounded: the oldest fingerprints go first. One per process
    (``SHARED``): the models a daemon loads one after another share it, as they share the workspace cache.
    """

    def __init__(self, limit: int = SEEN_LIMIT) -> None:
        self._limit = limit
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        #: the lanes of a model that serves several sessions at once note and look up from their own workers
        self._lock = threading.Lock()
        #: the manifest of the last prefix ensured, whichever model it was on: the first request after a switch
        #: to another model or template is told so
        self.last_manifest: ContextManifest | None = None

    @staticmethod
    def _chain(key: str, tokens: Sequence[int]) -> Iterator[tuple[int, bytes]]:
        h = hashlib.blake2b(key.encode(), digest_size=16)
        whole = len(tokens) - len(tokens) % SEEN_BLOCK
        # the ids as little-endian signed 32-bit integers, packed in one go (a 20k-token prompt in well under a ms)
        packed = array.array("i", tokens[:whole])
        if sys.byteorder == "big":
            packed.byteswap()
        data = memoryview(packed.tobytes())
        for end in range(SEEN_BLOCK, whole + 1, SEEN_BLOCK):
            h.update(data[(end - SEEN_BLOCK) * 4 : end * 4])
            yield end, h.copy().digest()

    def note(self, key: str, tokens: Sequence[int]) -> None:
        """``tokens`` are computed (the KV holds them) under ``key``."""
        seen = self._seen
        fingerprints = [fp for _, fp in self._chain(key, tokens)]
        with self._lock:
            for fp in fingerprints:
                seen[fp] = None
                seen.move_to_end(fp)
            while len(seen) > self._limit:
                seen.popitem(last=False)

    def longest(self, key: str, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` were computed before under ``key`` (a multiple of the block)."""
        n = 0
        for end, fp in self._chain(key, tokens):
            with self._lock:
                if fp not in self._seen:
                    break
            n = end
        return n


#: the daemon's (models are loaded one at a time; the keys tell their prompts apart)
SHARED = SeenPrompts()


@dataclass
class Held:
    """What the session held when an operation began: the tape it compares the new prompt with."""

    tokens: list[int]
    #: the manifest the tape was computed under (a cancelled prefill's too: ``partial``)
    manifest: ContextManifest | None
    #: the tape is the head of a prefix whose prefill was cancelled (no texts to compare)
    partial: bool = False
    stable_text: str = ""
    tools: str = ""
    #: the conversation the tape holds, one key per message (``message_keys``); None when not known
    messages: list[str] | None = None


def message_keys(suffix: SuffixInput) -> list[str]:
    """One key per message of the conversation a suffix sends (a text suffix is one message)."""
    if suffix.tokens:
        return [_key({"tokens": suffix.tokens})]
    if not suffix.messages:
        return [_key({"role": suffix.role, "content": suffix.text, "render": suffix.render})]
    return [_key(msg) for msg in suffix.messages]


def _key(msg: ChatMessage | dict[str, object]) -> str:
    if isinstance(msg, ChatMessage):  # an image by its digest (its bytes are no text)
        data = msg.model_dump(mode="json", exclude_defaults=True, exclude={"images"})
        if msg.images:
            data["images"] = [[image.digest, image.at] for image in msg.images]
    else:
        data = msg
    return hashlib.sha256(json.dumps(data, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


#: the engine's bytes of each token (``TapeModel.token_bytes``)
TokenBytes = Callable[[list[int]], list[bytes]]


class _Words:
    """A few words of a tape from a token on, for a person to read."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._tb = token_bytes

    def at(self, tokens: Sequence[int], i: int) -> str:
        """``EXCERPT_TOKENS`` tokens of text from ``i``, each image's block on the way as ``IMAGE_WORD``."""
        parts: list[str] = []
        text: list[int] = []
        taken, j = 0, i
        while j < len(tokens) and taken < EXCERPT_TOKENS:
            if is_image_token(tokens[j]):
                parts.append(self._text(text) + IMAGE_WORD)
                text = []
                while j < len(tokens) and is_image_token(tokens[j]):
                    j += 1
                continue
            text.append(tokens[j])
            taken += 1
            j += 1
        return ("".join(parts) + self._text(text))[:EXCERPT_CHARS]

    def _text(self, tokens: list[int]) -> str:
        return b"".join(self._tb(tokens)).decode("utf-8", errors="replace") if tokens else ""


def _evicted(index: int, seen: int, new: Sequence[int], words: _Words) -> ReuseMiss:
    return ReuseMiss(
        cause=MissCause.EVICTED, index=index, held_tokens=seen, new_text=words.at(new, index),
        detail=f"{seen} tokens of this prompt were computed before; another conversation has taken their place",
    )


def _diverged(held: Sequence[int], new: Sequence[int], reused: int) -> int | None:
    """Where ``new`` parts from ``held`` before either ends; None when it only adds to it (or ends inside it)."""
    lcp = common_prefix_len(held, new)
    if lcp >= min(len(held), len(new)) or lcp < reused:
        return None
    return lcp


def prefix_miss(
    held: Held, manifest: ContextManifest, tokens: list[int], text: str, tools: str, *,
    reused: int, seen: int, restored: list[int] | None, token_bytes: TokenBytes,
    last_manifest: ContextManifest | None = None,
) -> ReuseMiss | None:
    """Why ``ensure_prefix`` reused only ``reused`` of ``tokens`` (None: nothing it held was lost).

    ``seen``: how much of ``tokens`` the daemon computed before; ``restored``: the tape the workspace cache
    restored for this prefix, if it did; ``last_manifest``: the manifest of the daemon's last prefix, when the
    session holds nothing (a model just loaded).
    """
    words = _Words(token_bytes)
    if reused >= len(tokens):
        return None
    if seen - reused > EVICTED_MIN_TOKENS:
        return _evicted(reused, seen, tokens, words)
    if restored is not None:
        at = _diverged(restored, tokens, reused)
        if at is None:
            return None
        return ReuseMiss(cause=MissCause.SYSTEM_CHANGED, index=at, held_tokens=len(restored),
                         held_text=words.at(restored, at), new_text=words.at(tokens, at),
                         detail="the prefix parts from the workspace cache's closest entry")
    under = held.manifest if held.tokens else last_manifest
    if under is not None and not manifest.compatible_with(under):
        old, new = under.identity(), manifest.identity()
        changed = [k for k in new if old.get(k) != new[k]]
        return ReuseMiss(cause=MissCause.MANIFEST_CHANGED, index=reused, held_tokens=len(held.tokens),
                         new_text=words.at(tokens, 0), detail="changed: " + ", ".join(changed))
    if not held.tokens or held.manifest is None:
        return ReuseMiss(cause=MissCause.FIRST_SIGHT, index=reused, new_text=words.at(tokens, reused),
                         detail="nothing resident or cached shares this prompt")
    at = _diverged(held.tokens, tokens, reused)
    if at is None:
        return None  # the prefix grew, or a cancelled prefill's head is resumed: nothing held was lost
    miss = ReuseMiss(index=at, held_tokens=len(held.tokens), held_text=words.at(held.tokens, at),
                     new_text=words.at(tokens, at))
    if held.partial:  # a cancelled prefill's head: no texts to compare
        miss.cause, miss.detail = MissCause.SYSTEM_CHANGED, "the prefix parts from a cancelled prefill's head"
    elif text != held.stable_text:
        shared = len(_common_chars(text, held.stable_text))
        if shared < SAME_AGENT_CHARS:
            miss.cause, miss.detail = MissCause.FIRST_SIGHT, "another system prompt from its first words"
        else:
            miss.cause, miss.detail = MissCause.SYSTEM_CHANGED, f"the system prompt differs from character {shared}"
    elif tools != held.tools:
        miss.cause, miss.detail = MissCause.TOOLS_CHANGED, "the same system prompt with other tool definitions"
    else:
        # the same texts under a compatible manifest: what parts is the conversation kept past the prefix
        return None
    return miss


def _common_chars(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def suffix_miss(
    held: Held, target: list[int], new_messages: list[str], *, prefix_len: int, reused: int, seen: int,
    restored: list[int] | None, token_bytes: TokenBytes,
) -> ReuseMiss | None:
    """Why ``prefill_suffix`` reused only ``reused`` of ``target`` (token indexes count from the prompt's start).

    ``held`` is the tape when the suffix began (the stable prefix, and the previous conversation the KV kept
    after it); ``restored`` the workspace cache's entry restored for this suffix, if any.
    """
    words = _Words(token_bytes)
    if reused >= len(target):
        return None
    if seen - reused > EVICTED_MIN_TOKENS:
        return _evicted(reused, seen, target, words)
    tape = restored if restored is not None else held.tokens
    at = _diverged(tape, target, reused)
    if at is None:
        return None  # a new turn after everything held
    miss = ReuseMiss(cause=MissCause.HISTORY_REWRITTEN, index=at, held_tokens=len(tape),
                     held_text=words.at(tape, at), new_text=words.at(target, at))
    if at < prefix_len:
        miss.cause, miss.detail = MissCause.SYSTEM_CHANGED, "the prompt parts from the held one inside the prefix"
        return miss
    old = held.messages if restored is None else None
    if old is None:
        miss.detail = "the conversation parts from the held one"
        return miss
    j = next((i for i, (a, b) in enumerate(zip(old, new_messages, strict=False)) if a != b), min(len(old), len(new_messages)))
    miss.message = j
    if is_image_token(tape[at]) and is_image_token(target[at]):
        # the texts agree up to an image's block: the image is another (a message's image changed, or a new
        # conversation that begins with the same words)
        miss.cause = MissCause.FIRST_SIGHT if j == 0 else MissCause.HISTORY_REWRITTEN
        miss.detail = f"message {j} carries another image than the one held, where the texts still agree"
    elif j == 0:
        miss.cause, miss.detail = MissCause.FIRST_SIGHT, "a new conversation under the resident system prompt"
    elif j >= len(old):
        miss.detail = f"message {j}, the model's reply, came back otherwise than the model wrote it"
    else:
        miss.detail = f"message {j} differs from the one sent before"
    return miss
