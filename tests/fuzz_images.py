"""``make fuzz`` (HTTP, images): generated images in every API's image shape against a real daemon serving a vision
model (the bundled model with the test projector, ``harness.vision``); it must never answer 5xx and keep serving.

Each case, drawn by hypothesis (shrunk to the smallest failing one), is an image encoded by Pillow (PNG, JPEG, WebP
or GIF; RGB, RGBA, greyscale, palette, 1-bit, 16-bit and CMYK where the format has them; 1 to 700 pixels a side,
some past the daemon's pixel limit; one to three frames), then perhaps broken (cut short, bytes overwritten, its
header's size rewritten, junk in front, random bytes instead), carried the way one API carries it (chat
completions' ``image_url`` data URL, Responses' ``input_image``, Messages' ``base64`` source) with a declared media
type that may be wrong, base64 that may be wrapped or unpadded, one to more images than the daemon takes, in a user
message or one that carries no image (system, assistant). Every reply is checked:

* the status is 200, 400 or 413 (a 5xx, or any other, is a failure), and a refusal is in its API's error shape;
* an image left whole, readable and within the limits is answered 200, and the prompt it was answered from counts
  its image tokens (``harness.vision.IMAGE_TOKENS`` each) beyond the same prompt without it: nothing dropped;
  one in a system or assistant message is never answered;
* after the run, the daemon is alive and answers an ordinary chat.

Prints the cases by API and status. ``python -m tests.fuzz_images [--examples N] [--seed S]``; ``tests.fuzz_http``
runs it after the schema run.
"""

from __future__ import annotations

import argparse
import base64
import collections
import http.client
import io
import json
import struct
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from harness.daemon import DaemonProcess, free_port, wait_http
from harness.vision import IMAGE_TOKENS, vision_projector

#: the daemon's limits here: low enough that generated images cross them
MAX_IMAGES = 2
MAX_PIXELS = 250_000
MAX_BYTES = 2_000_000
TEXT = "Describe it."
#: the modes each format encodes (Pillow's names)
MODES = {"PNG": ["RGB", "RGBA", "L", "P", "1", "I;16", "LA"], "JPEG": ["RGB", "L", "CMYK"],
         "WEBP": ["RGB", "RGBA"], "GIF": ["P", "L", "RGB"]}
MEDIA = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
#: the codes an image refusal may carry (``modeld.front.images``); anything else for an image case is a failure
IMAGE_CODES = {"invalid_image", "image_too_large", "image_url_refused", "too_many_images"}


@dataclass
class Picture:
    """One image of a case: how it was made, what it became, and whether it is whole and within the limits."""

    fmt: str
    mode: str
    size: tuple[int, int]
    frames: int
    broken: str  # "" for an image left whole
    data: bytes = field(repr=False)

    def acceptable(self) -> bool:
        return not self.broken and self.size[0] * self.size[1] <= MAX_PIXELS and len(self.data) <= MAX_BYTES

    def __repr__(self) -> str:  # what hypothesis prints for a failing case
        return (f"Picture({self.fmt} {self.mode} {self.size[0]}x{self.size[1]} x{self.frames}, "
                f"{self.broken or 'whole'}, {len(self.data):,} bytes)")


def encode(fmt: str, mode: str, size: tuple[int, int], frames: int, colour_seed: int) -> bytes:
    from PIL import Image

    def frame(k: int) -> Image.Image:
        rgb = Image.new("RGB", size, ((colour_seed + 85 * k) % 256, (colour_seed * 7) % 256, (37 * k) % 256))
        if size[0] > 2 and size[1] > 2:  # a little structure, so the encoders do not only see one colour
            rgb.paste((255 - (colour_seed % 256), 0, 128), (0, 0, size[0] // 2, size[1] // 2))
        return rgb.convert(mode) if mode != "I;16" else rgb.convert("L").convert("I;16")

    images = [frame(k) for k in range(frames)]
    out = io.BytesIO()
    if frames > 1 and fmt in ("GIF", "WEBP", "PNG"):
        images[0].save(out, format=fmt, save_all=True, append_images=images[1:], duration=50)
    else:
        images[0].save(out, format=fmt)
    return out.getvalue()


def _png_size(data: bytes, width: int, height: int) -> bytes:
    """A PNG whose header claims another size (its checksum fixed, so only the size is wrong)."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return data
    body = struct.pack(">II", width, height) + data[24:29]
    return data[:16] + body + struct.pack(">I", zlib.crc32(b"IHDR" + body)) + data[33:]


@st.composite
def pictures(draw: st.DrawFn) -> Picture:
    fmt = draw(st.sampled_from(sorted(MODES)))
    mode = draw(st.sampled_from(MODES[fmt]))
    side = st.one_of(st.integers(1, 64), st.integers(65, 700))
    size = (draw(side), draw(side))
    frames = draw(st.integers(1, 3)) if fmt in ("GIF", "WEBP", "PNG") else 1
    data = encode(fmt, mode, size, frames, draw(st.integers(0, 255)))
    how = draw(st.sampled_from(["", "", "", "", "", "cut", "overwrite", "size", "junk", "random"]))
    if how == "cut":
        data = data[:draw(st.integers(0, max(0, len(data) - 1)))]
    elif how == "overwrite":
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at + 16:]
    elif how == "size":
        data = _png_size(data, draw(st.integers(0, 2**31 - 1)), draw(st.integers(0, 2**31 - 1)))
        how = how if fmt == "PNG" else ""
    elif how == "junk":
        data = draw(st.binary(min_size=1, max_size=64)) + data
    elif how == "random":
        data = draw(st.binary(max_size=4096))
    return Picture(fmt, mode, size, frames, how, data)


@dataclass
class Case:
    api: str
    role: str
    pictures: list[Picture]
    #: per picture: the media type declared ("" for none: a bare data URL), and how its base64 is written
    media: list[str]
    b64: list[str]
    image_first: bool

    def acceptable(self) -> bool:
        """Whether the daemon must answer it: a user message, within the count, each image whole and within the
        limits, declared as an image type (or not at all), its base64 whole (unpadded is whole only when nothing
        was left to pad)."""
        return (self.role == "user" and len(self.pictures) <= MAX_IMAGES and all(p.acceptable() for p in self.pictures)
                and all(m in ("", *MEDIA.values()) for m in self.media)
                and not any(how == "unpadded" and len(p.data) % 3 for how, p in zip(self.b64, self.pictures, strict=True)))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    pics = draw(st.lists(pictures(), min_size=1, max_size=MAX_IMAGES + 1))
    api = draw(st.sampled_from(["chat", "responses", "messages"]))
    declared = [draw(st.sampled_from([MEDIA[p.fmt]] * 4 + ["", "image/png", "text/plain", "image/svg+xml"]))
                for p in pics]
    if api == "messages":  # its source names the media type; an empty one is a wrong one there
        declared = [m or MEDIA[p.fmt] for m, p in zip(declared, pics, strict=True)]
    role = draw(st.sampled_from(["user"] * 6 + ["system", "assistant"]))
    return Case(api, role, pics, declared, [draw(st.sampled_from(["plain", "wrapped", "unpadded"])) for _ in pics],
                draw(st.booleans()))


def _b64(data: bytes, how: str) -> str:
    text = base64.b64encode(data).decode()
    if how == "wrapped":
        return "\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    return text.rstrip("=") if how == "unpadded" else text


def body(case: Case) -> tuple[str, dict[str, Any]]:
    """The route and the request for ``case``."""
    text_part = {"chat": {"type": "text", "text": TEXT}, "responses": {"type": "input_text", "text": TEXT},
                 "messages": {"type": "text", "text": TEXT}}[case.api]
    parts = []
    for p, media, how in zip(case.pictures, case.media, case.b64, strict=True):
        payload = _b64(p.data, how)
        url = f"data:{media};base64,{payload}"
        parts.append({"chat": {"type": "image_url", "image_url": {"url": url}},
                      "responses": {"type": "input_image", "image_url": url},
                      "messages": {"type": "image", "source": {"type": "base64", "media_type": media,
                                                               "data": payload}}}[case.api])
    content = [*parts, text_part] if case.image_first else [text_part, *parts]
    messages: list[dict[str, Any]] = [{"role": case.role, "content": content}]
    if case.role != "user":
        messages.append({"role": "user", "content": TEXT})
    if case.api == "chat":
        return "/v1/chat/completions", {"model": "m", "max_tokens": 1, "temperature": 0, "messages": messages}
    if case.api == "responses":
        return "/v1/responses", {"model": "m", "max_output_tokens": 1, "temperature": 0, "input": messages}
    system = [m for m in messages if m["role"] == "system"]
    if system:  # Messages carries the system prompt beside the turns, as blocks
        return "/v1/messages", {"model": "m", "max_tokens": 1, "system": system[0]["content"],
                                "messages": [m for m in messages if m["role"] != "system"]}
    return "/v1/messages", {"model": "m", "max_tokens": 1, "messages": messages}


def post(port: int, path: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        c.request("POST", path, json.dumps(payload).encode(), {"content-type": "application/json"})
        r = c.getresponse()
        raw = r.read()
    finally:
        c.close()
    try:
        return r.status, json.loads(raw)
    except ValueError:
        return r.status, {"unparsed": raw[:200].decode(errors="replace")}


def prompt_tokens(api: str, reply: dict[str, Any]) -> int:
    u = reply["usage"]
    if api == "chat":
        return int(u["prompt_tokens"])
    if api == "responses":
        return int(u["input_tokens"])
    return int(u["input_tokens"]) + int(u.get("cache_read_input_tokens") or 0) + int(u.get("cache_creation_input_tokens") or 0)


def error_code(api: str, reply: dict[str, Any]) -> str | None:
    """The refusal's code in its API's shape; None when the shape is not that API's."""
    if api == "messages":
        err = reply.get("error")
        ok = reply.get("type") == "error" and isinstance(err, dict) and isinstance(err.get("message"), str)
        return "" if ok else None  # Anthropic's shape names a type, not a code
    err = reply.get("error")
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return None
    return str(err.get("code") or "")


class Run:
    """The cases against one daemon: counts, the text-only baselines, and the first failure's description."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.counts: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        self.baseline: dict[str, int] = {}
        for api in ("chat", "responses", "messages"):
            path, payload = body(Case(api, "user", [], [], [], False))
            status, reply = post(port, path, payload)
            assert status == 200, (api, status, reply)
            self.baseline[api] = prompt_tokens(api, reply)

    def check(self, case: Case) -> None:
        path, payload = body(case)
        status, reply = post(self.port, path, payload)
        self.counts[case.api][status] += 1
        assert status in (200, 400, 413), f"{status}: {reply}"
        # (a system or assistant message carries no image: answered, its image would have been dropped)
        assert status != 200 or case.role == "user", f"an image in a {case.role} message was answered: {reply}"
        if status == 200:
            got = prompt_tokens(case.api, reply)
            least = self.baseline[case.api] + IMAGE_TOKENS * len(case.pictures)
            assert got >= least, f"the prompt counts {got} tokens, under {least}: an image was dropped"
        else:
            code = error_code(case.api, reply)
            assert code is not None, f"a {status} not in {case.api}'s error shape: {reply}"
            assert case.api == "messages" or code in IMAGE_CODES or case.role != "user", reply
        if case.acceptable():
            assert status == 200, f"a whole image within the limits was refused: {status} {reply}"


def run(port: int, examples: int, seed_value: int) -> tuple[Run, str]:
    """``examples`` cases; the failure (hypothesis's shrunk case and its error) or ""."""
    r = Run(port)

    @seed(seed_value)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def each(case: Case) -> None:
        r.check(case)

    try:
        each()
    except AssertionError as exc:
        return r, str(exc)[:2000]
    return r, ""


def vision_daemon(tmp: Path) -> tuple[DaemonProcess, int]:
    port = free_port()
    d = DaemonProcess(tmp, "llama", None, "--num-ctx", "2048", "--mmproj", str(vision_projector()),
                      "--http", f"127.0.0.1:{port}", "--max-images", str(MAX_IMAGES),
                      "--max-image-pixels", str(MAX_PIXELS), "--max-image-bytes", str(MAX_BYTES))
    d.start(wait_state=("Ready",))
    wait_http(port)
    return d, port


def table(r: Run) -> str:
    statuses = sorted({s for c in r.counts.values() for s in c})
    lines = [f"{'images via':<12}{'cases':>7}" + "".join(f"{s:>7}" for s in statuses)]
    for api in sorted(r.counts):
        c = r.counts[api]
        lines.append(f"{api:<12}{sum(c.values()):>7,}" + "".join(f"{c[s]:>7,}" for s in statuses))
    return "\n".join(lines)


def fuzz(examples: int, seed_value: int) -> tuple[bool, list[tuple[str, object]]]:
    """The run against its own daemon: whether it passed, and its rows for the caller's table."""
    with tempfile.TemporaryDirectory(prefix="modeld-fuzz-images-") as tmp:
        d, port = vision_daemon(Path(tmp))
        t0 = time.monotonic()
        try:
            r, failure = run(port, examples, seed_value)
        finally:
            alive = d.proc is not None and d.proc.poll() is None
            served = alive and post(port, *body(Case("chat", "user", [], [], [], False)))[0] == 200
            code = d.stop()
        seconds = time.monotonic() - t0
    print(table(r))
    fives = sum(n for c in r.counts.values() for s, n in c.items() if s >= 500)
    rows: list[tuple[str, object]] = [
        ("image cases", f"{sum(sum(c.values()) for c in r.counts.values()):,} in {seconds:.0f} s"
                        + (f": FAILED: {failure}" if failure else ": all as expected")),
        ("image 5xx answers", fives),
        ("vision daemon afterwards", "served" if served else "FAILED"),
        ("vision daemon exit on SIGTERM", code),
    ]
    return not failure and not fives and served and code == 0, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=300, help="generated image cases")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    ok, rows = fuzz(args.examples, args.seed)
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(w)}  {v}" for k, v in rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
