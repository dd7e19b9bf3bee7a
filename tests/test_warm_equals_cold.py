"""Warm equals cold: a prompt's tokens, and so its greedy reply, never depend on what the slot held before.

A property test (hypothesis): pairs and triples of prompts that share text up to an arbitrary character (inside a
special token's text, where two multi-byte characters share their first bytes, at and around spaces and newlines,
inside a tool call's JSON, and on llama.cpp before and after an image block), sent one after the other through
chat completions, Responses, Messages or ``/v1/completions`` to one daemon, whose KV then holds what the prompts
before left; each prompt is also sent to a reference daemon whose KV holds nothing of it (a displacing request
first, its workspace cache off): a fresh daemon's view. Every request's prompt tokens (the digest ``modeld why``
reports) and its greedy reply must be the same on both.

The property's daemons serve ``harness.fixtures.shallow_gguf``: the bundled model cut to its first two blocks, so
its vocabulary, special tokens, chat template and KV reuse are the bundled model's and a token costs a tenth of
the compute; that is what lets the suite run a few hundred examples per engine (one costs ~0.2 s, against ~1 s on
the whole model). ``MODELD_WARM_COLD_MODEL=bundled`` runs it on the bundled model itself. On llama.cpp the daemons
also carry the vision test model's projector (``harness.vision``), and prompts on the three chat APIs may hold
images.

The daemons of the property serve the layout whose rows are exact (``EXACT_ROWS``): there a token's logits are the
same whether its prompt was prefilled in one batch or on top of KV an earlier request left, which is what makes a
greedy reply comparable at all. In the default layout the batches of a warm prefill differ from a cold one's, and a
near tie can flip (seen in a run of 300 examples on llama.cpp: a chat prompt whose tokens were the same warm and cold
answered "The company has" warm and "The original sentence" cold; ``docs/contract.md``). The tokens do not hang on the
layout: the issue's examples are also sent to a pair of daemons serving the bundled model in the default layout,
their prompt tokens compared.

The suite runs a fixed seed and ``EXAMPLES`` examples per engine; ``make fuzz`` runs thousands
(``MODELD_WARM_COLD_EXAMPLES``).
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, event, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.test_openai_front import Front  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("MODELD_WARM_COLD_EXAMPLES", "250"))
#: "shallow" (``harness.fixtures.shallow_gguf``) or "bundled": the model the property's daemons serve
MODEL = os.environ.get("MODELD_WARM_COLD_MODEL", "shallow")
#: the reply compared: greedy, this many tokens
REPLY_TOKENS = 3
APIS = ("chat", "responses", "messages", "completions")
#: the APIs whose messages may carry an image (``/v1/completions`` takes text)
IMAGE_APIS = ("chat", "responses", "messages")

#: pieces prompts are made of: special tokens' texts and their heads, characters whose UTF-8 bytes share a head
#: (é/è, 日/旦), spaces and newlines, a tool call's JSON and its markers, plain words and brackets
PIECES = (
    "<|im_end|>", "<|im_start|>", "<|im_e", "<|im_", "<|", "|>", "<", ">",
    "é", "è", "ê", "日", "旦", "本", "🙂", "🙃",
    " ", "  ", "\n", "\n\n", " \n", "\t",
    "Is", " x", "y?", "[1, 2, 3]", " [", "]", "Answer:", " 3",
    '<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>', '{"name": "re', '"arguments": {',
    "def f(x):", "    return x", "the", " quick", " brown", "fox",
)


@dataclass(frozen=True)
class Image:
    """An image block of a prompt: a plain square of one colour."""

    colour: tuple[int, int, int]

    def png(self) -> bytes:
        from PIL import Image as Pil

        out = io.BytesIO()
        Pil.new("RGB", (64, 64), self.colour).save(out, "PNG")
        return out.getvalue()

    def data_url(self) -> str:
        return "data:image/png;base64," + base64.b64encode(self.png()).decode()


IMAGES = (Image((200, 0, 200)), Image((0, 160, 0)), Image((20, 20, 20)))

#: a prompt: its text and image blocks in order (adjacent texts joined)
Prompt = tuple["str | Image", ...]


def _joined(parts: Sequence[str | Image]) -> Prompt:
    out: list[str | Image] = []
    for p in parts:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif p != "":
            out.append(p)
    return tuple(out)


def _head(prompt: Prompt, n: int) -> Prompt:
    """The first ``n`` units of ``prompt``: a character of text is one, an image one."""
    out: list[str | Image] = []
    for p in prompt:
        if n <= 0:
            break
        size = len(p) if isinstance(p, str) else 1
        out.append(p[:n] if isinstance(p, str) else p)
        n -= size
    return tuple(out)


def _units(prompt: Prompt) -> int:
    return sum(len(p) if isinstance(p, str) else 1 for p in prompt)


def _content(api: str, prompt: Prompt) -> str | list[dict[str, Any]]:
    """The user message's content for ``api``: a string when the prompt is text alone, else its blocks."""
    if all(isinstance(p, str) for p in prompt):
        return "".join(p for p in prompt if isinstance(p, str))
    blocks: list[dict[str, Any]] = []
    for p in prompt:
        if isinstance(p, str):
            blocks.append({"type": "input_text" if api == "responses" else "text", "text": p})
        elif api == "chat":
            blocks.append({"type": "image_url", "image_url": {"url": p.data_url()}})
        elif api == "responses":
            blocks.append({"type": "input_image", "image_url": p.data_url()})
        else:
            blocks.append({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                       "data": base64.b64encode(p.png()).decode()}})
    return blocks


def _body(api: str, prompt: Prompt) -> tuple[str, dict[str, Any]]:
    """The route and the request's body that sends ``prompt`` through ``api``, greedy, ``REPLY_TOKENS`` long."""
    content = _content(api, prompt)
    if api == "chat":
        return "/v1/chat/completions", {"max_tokens": REPLY_TOKENS, "messages": [{"role": "user", "content": content}]}
    if api == "responses":
        item = content if isinstance(content, str) else [{"role": "user", "content": content}]
        return "/v1/responses", {"max_output_tokens": REPLY_TOKENS, "store": False, "input": item}
    if api == "messages":
        return "/v1/messages", {"max_tokens": REPLY_TOKENS, "messages": [{"role": "user", "content": content}]}
    assert isinstance(content, str), "/v1/completions takes text"
    return "/v1/completions", {"max_tokens": REPLY_TOKENS, "prompt": content}


def _reply(api: str, body: dict[str, Any]) -> str:
    if api == "chat":
        return str(body["choices"][0]["message"]["content"])
    if api == "responses":
        return body.get("output_text") or json.dumps(body["output"])
    if api == "messages":
        return json.dumps(body["content"])
    return str(body["choices"][0]["text"])


class Daemons:
    """The daemon under test and the reference whose KV never holds the prompt sent to it."""

    def __init__(self, warm: Front, cold: Front, *, vision: bool) -> None:
        self.warm = warm
        self.cold = cold
        #: the daemons read images (llama.cpp with the vision test model's projector)
        self.vision = vision
        self._http = {f: httpx.Client(base_url=f"http://127.0.0.1:{f.port}", timeout=600.0,
                                      headers={"x-api-key": "none", "anthropic-version": "2023-06-01"})
                      for f in (warm, cold)}
        self._why = {f: f.daemon.client(timeout_s=60.0) for f in (warm, cold)}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference")

    def close(self) -> None:
        self._pool.shutdown()
        for c in self._http.values():
            c.close()
        for z in self._why.values():
            z.close()

    def ask(self, front: Front, api: str, prompt: Prompt | str) -> tuple[str, str]:
        """``prompt`` through ``api``: the greedy reply's text and the prompt tokens' digest."""
        route, body = _body(api, (prompt,) if isinstance(prompt, str) else prompt)
        r = self._http[front].post(route, json={"model": "default", "temperature": 0, **body})
        assert r.status_code == 200, (api, prompt, r.status_code, r.text[:300])
        return _reply(api, r.json()), self._why[front].why(1)[-1].prompt_token_hash

    def ask_both(self, api: str, prompt: Prompt) -> tuple[tuple[str, str], tuple[str, str]]:
        """``prompt`` to the daemon under test, and at the same time to the reference after a displacing request
        (the two daemons are processes of their own: on the shallow model 69 ms a prompt against 72 in a row on
        llama.cpp, whose threads take both cores, and 70 against 86 on OpenVINO)."""
        cold = self._pool.submit(lambda: (self.displace(), self.ask(self.cold, api, prompt))[1])
        warm = self.ask(self.warm, api, prompt)
        return warm, cold.result()

    def displace(self) -> None:
        """The reference's KV holds nothing a prompt starts with afterwards: a raw prompt whose one character no
        piece has (the property's prompts start with a chat template's first token, or with a piece's)."""
        r = self._http[self.cold].post("/v1/completions", json={"model": "default", "max_tokens": 1, "prompt": "§"})
        assert r.status_code == 200, r.text[:300]


#: each engine's layout whose rows are exact (``--exact-decode``; llama.cpp: flash attention over a q8_0 cache, the
#: weights as the file has them), as ``test_backends_daemon`` starts it
EXACT_ROWS = {
    "llama": ("--flash-attn", "--kv-cache-type", "q8_0", "--exact-decode", "--engine-option", "extra_bufts=false"),
    "openvino": ("--exact-decode",),
}
ENGINES = [pytest.param("llama", marks=pytest.mark.llama), pytest.param("openvino", marks=pytest.mark.openvino)]


def _pair(tmp: Path, backend: str, layout: tuple[str, ...], *, vision: bool = False) -> Iterator[Daemons]:
    pytest.importorskip("llama_cpp" if backend == "llama" else "openvino_genai")
    args = ("--num-ctx", "2048", "--speculative", "off", *layout)
    with Front(tmp / "warm", *args, backend=backend) as warm, \
         Front(tmp / "cold", *args, "--cache-ram", "0", "--cache-disk", "0", backend=backend) as cold:
        d = Daemons(warm, cold, vision=vision)
        try:
            yield d
        finally:
            d.close()


@pytest.fixture(scope="module", params=ENGINES)
def daemons(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """The warm daemon and the reference, in the layout whose rows are exact, serving the property's model (and on
    llama.cpp reading images)."""
    model: tuple[str, ...] = ()
    if MODEL != "bundled":
        from harness.fixtures import shallow_gguf

        model = ("--model", str(shallow_gguf()))
    vision = request.param == "llama"
    if vision:
        from harness.vision import vision_projector

        model += ("--mmproj", str(vision_projector()))
    yield from _pair(tmp_path_factory.mktemp(f"warmcold-{request.param}"), request.param,
                     (*EXACT_ROWS[request.param], *model), vision=vision)


@pytest.fixture(scope="module", params=ENGINES)
def default_daemons(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """The pair in the default layout, serving the bundled model."""
    yield from _pair(tmp_path_factory.mktemp(f"warmcold-default-{request.param}"), request.param, ())


@st.composite
def prompts(draw: st.DrawFn, images: bool) -> tuple[str, list[Prompt]]:
    """An API and two or three prompts: a base, then the base cut at an arbitrary character (or image block) with
    other text (or an image) after. Images only where ``images`` and the API reads them."""
    api = draw(st.sampled_from(APIS))
    # an image is a piece like the others (3 of 45): about a third of the chat APIs' prompts hold one
    piece = st.sampled_from((*PIECES, *IMAGES) if images and api in IMAGE_APIS else PIECES)
    base = _joined(draw(st.lists(piece, min_size=2, max_size=10)))
    out = [base]
    for _ in range(draw(st.integers(1, 2))):
        cut = draw(st.integers(0, _units(base)))
        out.append(_joined([*_head(base, cut), *draw(st.lists(piece, min_size=0, max_size=4))]) or ("x",))
    return api, out


@seed(78)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_prompt_s_tokens_and_greedy_reply_are_what_a_fresh_daemon_gives(daemons: Daemons,
                                                                          data: st.DataObject) -> None:
    api, sequence = data.draw(prompts(daemons.vision), label="case")
    event(api)  # what the examples covered: --hypothesis-show-statistics
    if any(isinstance(p, Image) for prompt in sequence for p in prompt):
        event("with an image")
    for prompt in sequence:
        warm, cold = daemons.ask_both(api, prompt)
        assert warm[1] == cold[1], (api, prompt, "the prompt's tokens differ from a fresh daemon's")
        assert warm[0] == cold[0], (api, prompt, "the greedy reply differs from a fresh daemon's", warm[0], cold[0])


ISSUE_EXAMPLES = (("chat", ["Is x<y?", "Is x"]),
                  ("completions", ["What does len([1, 2, 3]) return?\nAnswer: 3",
                                   "What does len([1, 2, 3]) return?\nAnswer: [1, 2, 3]"]))


def test_the_examples_in_the_issue(daemons: Daemons) -> None:
    """The reported cases: a held lone "<" must not stay where a fresh prompt has "<|im_end|>", nor a held " "
    where a fresh raw prompt has " ["."""
    for api, sequence in ISSUE_EXAMPLES:
        for prompt in sequence:
            warm = daemons.ask(daemons.warm, api, prompt)
            daemons.displace()
            assert warm == daemons.ask(daemons.cold, api, prompt), (api, prompt)


def test_the_examples_in_the_issue_keep_their_tokens_in_the_default_layout(default_daemons: Daemons) -> None:
    """The same cases on the default layout (what ``modeld serve`` runs unless told): the prompt tokens are a
    fresh daemon's (the greedy reply is not compared: see the module's note on near ties)."""
    d = default_daemons
    for api, sequence in ISSUE_EXAMPLES:
        for prompt in sequence:
            warm = d.ask(d.warm, api, prompt)
            d.displace()
            assert warm[1] == d.ask(d.cold, api, prompt)[1], (api, prompt)
