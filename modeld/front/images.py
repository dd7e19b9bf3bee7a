"""Images in requests: each API's image shape read into one checked ``Image`` before the slot is taken.

The APIs' shapes, gathered by their translations as ``ImageRef`` s (where in the request, and what was sent):

* chat completions: a content part ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,…"}}``;
* Responses: ``{"type": "input_image", "image_url": "data:…"}`` (a ``file_id`` is refused: there are no files);
* Messages: ``{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "…"}}``.

``read_images`` checks them in the order that costs least first, each refusal a 400 (413 for a size) naming the
field: an ``http(s)`` URL is refused unless ``--allow-image-urls`` (then ``image_fetch`` fetches it, with its
limits on addresses, redirects, size and time); the base64 decodes; at most
``max_images`` images and ``max_image_bytes`` bytes each; the format, sniffed from the bytes, is PNG, JPEG, WebP or
GIF; its width times height, read from the header before any pixel is decoded, is at most ``max_image_pixels`` (no
decompression bomb); then it decodes whole (a truncated or corrupt file is refused here, not in the engine).

What follows the checks is the model's: one without an image encoder answers ``vision_unsupported``
(``Serving.begin``), naming the model, in each API's error shape; nothing is dropped silently.

Where each image sat in its message is kept while the translation joins the text around it: the translation
writes ``IMAGE_MARK`` there (``joined``), and ``place_images`` turns each mark back into the message's
``ChatMessage.images`` entry at that offset once the images are read. The mark holds a secret drawn per
process, so no request can write one; the marks and the images must still agree one for one.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import re
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from contract.types import ChatMessage, ImageInput

from .errors import ApiError

__all__ = ["FORMATS", "IMAGE_MARK", "Image", "ImageLimits", "ImageRef", "image_url_ref", "joined", "place_images",
           "read_images", "take_images"]

#: where an image sat in its message's text, between the translation and ``place_images``
IMAGE_MARK = f"\x00image-{secrets.token_hex(12)}\x00"

#: the formats an image may come in (Pillow's names, lower case), and their media types
FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "gif": "image/gif"}
_DATA_URL = re.compile(r"data:(?P<media>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


@dataclass(frozen=True)
class ImageRef:
    """An image as a request sent it, not read yet: where it sits and what it carries."""

    #: the request field (``messages[1].content[0]``), for errors
    where: str
    #: a URL (``data:``, or one this daemon refuses to fetch) ...
    url: str = ""
    #: ... or base64 data with its declared media type (the Messages API's ``source``)
    data: str = ""
    media_type: str = ""


@dataclass(frozen=True)
class Image:
    """An image read and checked: its bytes, their sha256 (what a warm prefix is keyed by), format and size."""

    where: str
    data: bytes
    digest: str
    format: str
    width: int
    height: int


@dataclass(frozen=True)
class ImageLimits:
    """The front's limits on images (``HttpSettings``: ``max_images``, ``max_image_bytes``, ``max_image_pixels``)."""

    max_images: int
    max_bytes: int
    max_pixels: int
    #: http(s) image URLs are fetched (``image_fetch``); refused otherwise
    fetch_urls: bool = False


def read_images(refs: list[ImageRef], limits: ImageLimits) -> list[Image]:
    """``refs`` read and checked (see the module's docstring); the first failure is the ``ApiError``."""
    if len(refs) > limits.max_images:
        raise ApiError(413, f"the request carries {len(refs)} images; this daemon takes at most {limits.max_images} "
                       "a request (--max-images)", code="too_many_images", param=refs[limits.max_images].where)
    return [_read(ref, limits) for ref in refs]


def image_url_ref(value: Any, where: str) -> ImageRef:
    """A chat completions ``image_url`` part's value (``{"url": …, "detail": …}``, or the URL alone) as a ref."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{where} is an image_url part without a url", param=f"{where}.image_url")
    return ImageRef(where, url=url)


def joined(parts: Sequence[str | ImageRef], sep: str = "") -> str:
    """Texts joined by ``sep`` with each image's mark where it sat: after the text before it (the separator is
    the texts', not the image's), or before the first text."""
    texts: list[str] = []
    pending = ""
    for part in parts:
        if isinstance(part, ImageRef):
            if texts:
                texts[-1] += IMAGE_MARK
            else:
                pending += IMAGE_MARK
        else:
            texts.append(pending + part)
            pending = ""
    if pending:
        texts.append(pending)
    return sep.join(texts)


def place_images(messages: list[ChatMessage], images: list[Image]) -> list[ChatMessage]:
    """The messages with each image's mark (``joined``) taken out of the text and the image put in its
    message's ``images`` at that offset; a 400 where the marks and the images do not agree, or an image sits
    in a message that cannot carry one (a system prompt, an assistant's reply)."""
    left = list(images)
    out = []
    for i, msg in enumerate(messages):
        text = msg.content or ""
        if IMAGE_MARK not in text:
            out.append(msg)
            continue
        pieces = text.split(IMAGE_MARK)
        if len(pieces) - 1 > len(left):
            raise ApiError(400, f"messages[{i}] holds more image places than the request has images",
                           code="invalid_image")
        if msg.role not in ("user", "tool"):
            raise ApiError(400, f"{left[0].where}: an image goes in a user message or a tool result, not in a "
                           f"{msg.role} message", code="invalid_image", param=left[0].where)
        content, placed = pieces[0], []
        for piece in pieces[1:]:
            placed.append(ImageInput(data=left.pop(0).data, at=len(content)))
            content += piece
        out.append(msg.model_copy(update={"content": content, "images": [*msg.images, *placed]}))
    if left:
        raise ApiError(400, f"{left[0].where}: the image has no place in any message", code="invalid_image",
                       param=left[0].where)
    return out


def take_images(messages: list[dict[str, Any]], images: list[ImageRef]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages (the WebSocket protocol's) with each ``image_url`` part to ``images`` and its mark
    (``joined``) left in its place as a text part."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        kept = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                images.append(image_url_ref(part.get("image_url"), f"messages[{i}].content[{j}]"))
                kept.append({"type": "text", "text": IMAGE_MARK})
            else:
                kept.append(part)
        out.append({**m, "content": kept})
    return out


def _read(ref: ImageRef, limits: ImageLimits) -> Image:
    raw = _bytes(ref, limits)
    if len(raw) > limits.max_bytes:
        raise ApiError(413, f"{ref.where}: the image is {len(raw):,} bytes; this daemon takes at most "
                       f"{limits.max_bytes:,} (--max-image-bytes)", code="image_too_large", param=ref.where)
    from PIL import Image as Pil
    from PIL import UnidentifiedImageError

    _bomb_warnings_are_errors(Pil.DecompressionBombWarning)
    try:
        # open reads the header only: the size is known before a pixel is decoded
        with Pil.open(io.BytesIO(raw), formats=[f.upper() for f in FORMATS]) as img:
            fmt = (img.format or "").lower()
            width, height = img.size
            if width * height > limits.max_pixels:
                raise ApiError(413, f"{ref.where}: the image is {width}x{height} pixels; this daemon takes at most "
                               f"{limits.max_pixels:,} pixels (--max-image-pixels)", code="image_too_large",
                               param=ref.where)
            img.load()  # the whole file now: a truncated or corrupt one fails here
    except ApiError:
        raise
    except (Pil.DecompressionBombError, Pil.DecompressionBombWarning) as exc:
        # Pillow's own guard, from the header too, for a size far past any sane limit (its message gives it)
        raise ApiError(413, f"{ref.where}: the image claims more than the {limits.max_pixels:,} pixels this daemon "
                       f"takes (--max-image-pixels): {exc}", code="image_too_large", param=ref.where) from None
    except UnidentifiedImageError as exc:
        raise ApiError(400, f"{ref.where}: not an image this daemon reads (PNG, JPEG, WebP or GIF): {exc}",
                       code="invalid_image", param=ref.where) from None
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's truncated, corrupt and malformed files
        raise ApiError(400, f"{ref.where}: the image could not be decoded ({exc})", code="invalid_image",
                       param=ref.where) from None
    return Image(ref.where, raw, hashlib.sha256(raw).hexdigest(), fmt, width, height)


@functools.cache
def _bomb_warnings_are_errors(category: type[Warning]) -> None:
    """Pillow warns (and goes on) for an image between its two bomb sizes; here that is an error, once per process."""
    warnings.filterwarnings("error", category=category)


def _bytes(ref: ImageRef, limits: ImageLimits) -> bytes:
    """The image's bytes, from its data URL or base64 data, or fetched from its URL (``limits.fetch_urls``)."""
    if ref.url:
        scheme = ref.url.split(":", 1)[0].lower() if ":" in ref.url else ""
        if scheme in ("http", "https"):
            if limits.fetch_urls:
                from .image_fetch import fetch

                return fetch(ref.url, ref.where, limits.max_bytes)
            raise ApiError(400, f"{ref.where}: this daemon does not fetch image URLs (--allow-image-urls); send the "
                           "image inline as a data: URL (data:image/png;base64,…)", code="image_url_refused",
                           param=ref.where)
        m = _DATA_URL.match(ref.url)
        if m is None:
            raise ApiError(400, f"{ref.where}: an image URL must be a data: URL (data:image/png;base64,…)",
                           code="invalid_image", param=ref.where)
        if not m.group("b64"):
            raise ApiError(400, f"{ref.where}: a data: URL's image must be base64 (data:image/png;base64,…)",
                           code="invalid_image", param=ref.where)
        payload, media = ref.url[m.end():], m.group("media") or ""
    else:
        payload, media = ref.data, ref.media_type
    if media and media.lower() not in FORMATS.values():
        raise ApiError(400, f"{ref.where}: media type {media!r} is not an image this daemon reads "
                       f"({', '.join(FORMATS.values())})", code="invalid_image", param=ref.where)
    # base64 is 4 characters per 3 bytes: a payload far past the limit is refused before it is decoded
    if len(payload) > (limits.max_bytes // 3 + 2) * 4:
        raise ApiError(413, f"{ref.where}: the image is over {limits.max_bytes:,} bytes (--max-image-bytes)",
                       code="image_too_large", param=ref.where)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)  # (some clients wrap the lines)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(400, f"{ref.where}: the image's base64 does not decode: {exc}", code="invalid_image",
                       param=ref.where) from None
