"""An image's positions on a tape: placeholder ids above every vocabulary, drawn from the image's digest.

A block's first position is drawn from one range and the rest from another, so a position can be told to be
inside a block (``inside_block``) without a table: the KV is never cut there (the encoder attends across the
whole block, not causally, so half a block is not a prefix of it), and a fork or an offset there is refused.
Imports nothing of the project: the tape (``backends.resident``) and the engines read it alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["FIRST_ID", "block_start", "inside_block", "is_image_token", "placeholders"]

#: placeholder ids start here (every vocabulary is far smaller); a block's first position in [FIRST_ID, _REST)
FIRST_ID = 1 << 30
#: ... and its other positions in [_REST, _REST + _WIDTH)
_WIDTH = 1 << 29
_REST = FIRST_ID + _WIDTH


def is_image_token(token: int) -> bool:
    return token >= FIRST_ID


def placeholders(digest: str, n: int) -> list[int]:
    """The ids of an image's ``n`` embedding positions (``digest``: the sha256 of its bytes, hex)."""
    out = []
    for i in range(n):
        h = int.from_bytes(hashlib.sha256(f"{digest}:{i}".encode()).digest()[:8], "big") % _WIDTH
        out.append((FIRST_ID if i == 0 else _REST) + h)
    return out


def inside_block(tokens: Sequence[int], at: int) -> bool:
    """Whether a cut before position ``at`` splits an image's block (``tokens[at]`` continues one)."""
    return 0 <= at < len(tokens) and tokens[at] >= _REST


def block_start(tokens: Sequence[int], at: int) -> int:
    """``at``, or where the image block it falls inside starts: the longest prefix of ``tokens[:at]`` that ends
    between blocks."""
    while inside_block(tokens, at):
        at -= 1
    return at
