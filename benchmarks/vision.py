"""The vision section of ``make bench``: an image turn cold, then the next turn resending the image, beside llama.cpp's
``llama-server`` with the same projector.

The model is the bundled GGUF with the test projector (``harness.vision``: a tiny random image encoder, so the
figures measure the pipeline around the image, not a real encoder's cost). Each conversation is a system prompt
of ~``PREFIX_TOKENS`` tokens nobody sent before (a new head line) and a user turn with a question and a
640x480 PNG, as a screenshot would come; the turns, streamed chat completions timed to their first text:

* **cold** – the first turn: the whole prompt and the image are computed;
* **resend** – the second turn: the first turn, its reply and a new question, the image sent again as every
  chat API resends it; the image's block is reused where the server keys it by the image;
* **new image** – a third turn adding another image: the conversation reused up to it, the new block computed.

Each figure is the median over ``RUNS`` conversations; ``cached`` is the server's own count of prompt tokens it
did not compute (``prompt_tokens_details.cached_tokens``). Nothing here asserts a timing.
"""

from __future__ import annotations

import base64
import io
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import PREFIX_LINE, sse_chat, text_of_tokens
from harness.daemon import DaemonProcess, free_port, wait_http

__all__ = ["RUNS", "rows", "section"]

PREFIX_TOKENS = 2000
NUM_CTX = 4096
RUNS = 3
REPLY_TOKENS = 4
TURNS = ("cold", "resend", "new image")


def png(seed: int, size: tuple[int, int] = (640, 480)) -> bytes:
    """A screenshot-sized PNG with some structure: bands of colour drawn from ``seed``."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (240, 240, 240))
    draw = ImageDraw.Draw(img)
    for k in range(12):
        y = k * size[1] // 12
        draw.rectangle((0, y, size[0] * (k + 1) // 12, y + size[1] // 24),
                       fill=((seed * 53 + k * 20) % 256, (seed * 97) % 256, (k * 41) % 256))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def _part(image: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}


def _stream(port: int, messages: list[dict[str, Any]]) -> tuple[float, str, dict[str, Any]]:
    """A streamed chat completion: seconds to its first text (to its end when it has none), its text, its usage."""
    body = {"model": "default", "messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    first, text = 0.0, ""
    usage: dict[str, Any] = {}
    t0 = time.perf_counter()
    for chunk in sse_chat(port, body):
        usage = chunk.get("usage") or usage
        piece = ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content")
        if piece:
            first = first or time.perf_counter() - t0
            text += piece
    return first or time.perf_counter() - t0, text, usage


def _conversations(port: int, system: str) -> dict[str, list[tuple[float, int, int]]]:
    """Per turn: (seconds to first text, prompt tokens, cached tokens) of each of ``RUNS`` conversations."""
    out: dict[str, list[tuple[float, int, int]]] = {t: [] for t in TURNS}
    for run in range(RUNS):
        sys_msg = {"role": "system", "content": f"# workspace {uuid.uuid4().hex}\n{system}"}
        first = {"role": "user", "content": [{"type": "text", "text": "What does this screenshot show?"},
                                             _part(png(2 * run))]}
        msgs: list[dict[str, Any]] = [sys_msg, first]
        for turn in TURNS:
            if turn == "resend":
                msgs += [{"role": "user", "content": "And which colour is the top band?"}]
            elif turn == "new image":
                msgs += [{"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                                      _part(png(2 * run + 1))]}]
            secs, text, usage = _stream(port, msgs)
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            out[turn].append((secs, int(usage.get("prompt_tokens") or 0), cached))
            msgs.append({"role": "assistant", "content": text or "."})
    return out


def section(tmp: Path, count: Callable[[str], int]) -> dict[str, dict[str, list[tuple[float, int, int]]]]:
    """{server: {turn: [(seconds, prompt tokens, cached tokens)]}}; a server that could not run is left out."""
    from backends.bundled import bundled_gguf_path
    from benchmarks import llama_server
    from harness.vision import vision_projector

    model, projector = bundled_gguf_path(), vision_projector()
    system = text_of_tokens(count, PREFIX_TOKENS, PREFIX_LINE)
    out: dict[str, dict[str, list[tuple[float, int, int]]]] = {}
    port = free_port()
    d = DaemonProcess(tmp / "vision", "llama", None, "--model", str(model), "--mmproj", str(projector),
                      "--num-ctx", str(NUM_CTX), "--http", f"127.0.0.1:{port}", "--cache-ram", "0")
    d.start(ready_timeout_s=900, wait_state=("Ready",))
    try:
        wait_http(port, "/health", timeout_s=300.0)
        _stream(port, [{"role": "user", "content": "Hello."}])  # nothing one-off lands on the first figure
        out["modeld llama.cpp"] = _conversations(port, system)
    finally:
        d.stop()
    with llama_server.serving(model, NUM_CTX, tmp / "llama-server-vision.log", "--mmproj", str(projector)) as port:
        _stream(port, [{"role": "user", "content": "Hello."}])
        out[llama_server.NAME] = _conversations(port, system)
    return out


def rows(r: dict[str, dict[str, list[tuple[float, int, int]]]]) -> list[tuple[str, Any, str]]:
    """The table's rows: per server and turn, the median seconds to first text, with tokens, cached and the
    ratio to that server's cold turn."""
    out: list[tuple[str, Any, str]] = []
    for name, turns in r.items():
        cold = statistics.median(s for s, _, _ in turns["cold"])
        for turn, got in turns.items():
            secs = statistics.median(s for s, _, _ in got)
            prompt = int(statistics.median(p for _, p, _ in got))
            cached = int(statistics.median(c for _, _, c in got))
            note = f"{prompt:,} prompt tokens, {cached:,} cached"
            if turn != "cold":
                note += f"; {cold / secs:.1f}x faster than the cold turn"
            out.append((f"{name}, {turn}: TTFT ms", secs * 1000, note))
    return out
