"""Images on a tape: each one a block of placeholder ids the daemon computes from the image's digest.

An engine with an image encoder (``ImageEncoder``: llama.cpp's multimodal library) turns an image into its
model's block: the text tokens its projector wraps an image in, then one position per image embedding. On the
tape those positions hold placeholder ids above every vocabulary (``FIRST_ID`` on), drawn from the image's
sha256 and the position's index in the block, so the token LCP that reuses text reuses an image the same way:
the same image at the same place matches, another one differs from its block's first position on. A client can
never write one (token ids are checked against the vocabulary), which is salience's rule: the server, not the
client, expands an image into its tokens.

The ids themselves are ``backends.image_tokens``'s.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from contract.errors import InvalidArgument
from contract.types import ImageInput

from ..image_tokens import placeholders

__all__ = ["ImageBlock", "ImageEncoder", "Segments", "marked_text", "new_marker", "split_marked"]


@dataclass(frozen=True)
class ImageBlock:
    """An image as its model reads it: the text tokens before its embeddings, their count, the text tokens after."""

    digest: str
    before: tuple[int, ...]
    n_embd: int
    after: tuple[int, ...]

    @property
    def tokens(self) -> list[int]:
        return [*self.before, *placeholders(self.digest, self.n_embd), *self.after]

    @property
    def first_embd(self) -> int:
        """The first placeholder id (what the encoder looks the image up by on the tape)."""
        return placeholders(self.digest, 1)[0]


class ImageEncoder(Protocol):
    """What a tape engine with an image encoder offers the session: an image's block (the image registered to be
    computed when its positions are prefilled)."""

    def block(self, image: ImageInput) -> ImageBlock: ...


#: text and images in order, as a rendered prompt holds them
Segments = list[str | ImageInput]


def marked_text(text: str, images: Sequence[ImageInput], marker: str) -> str:
    """``text`` with ``marker`` where each image sits (``ImageInput.at``)."""
    out, last = [], 0
    for image in images:
        out += [text[last : image.at], marker]
        last = image.at
    return "".join([*out, text[last:]])


def new_marker() -> str:
    """A marker no message can hold by chance: where the template put each image is found by it after rendering."""
    return f"<modeld-image-{secrets.token_hex(12)}>"


def split_marked(text: str, marker: str, images: Sequence[ImageInput]) -> Segments:
    """``text`` cut at each ``marker``, the images in its places; InvalidArgument when the template rendered
    another number of them than were sent (it dropped or repeated a message's content)."""
    pieces = text.split(marker)
    if len(pieces) - 1 != len(images):
        raise InvalidArgument(f"the chat template rendered {len(pieces) - 1} of the conversation's {len(images)} "
                              "images: it does not render each message's content once", images=len(images))
    out: Segments = [pieces[0]]
    for image, piece in zip(images, pieces[1:], strict=True):
        out += [image, piece]
    return out
