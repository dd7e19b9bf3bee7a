"""Warm equals cold: a prompt's tokens, and so its greedy reply, never depend on what the slot held before.

A property test (hypothesis): pairs and triples of prompts that share text up to an arbitrary character (inside a
special token's text, where two multi-byte characters share their first bytes, at and around spaces and newlines,
inside a tool call's JSON), sent one after the other through chat completions, Responses, Messages or
``/v1/completions`` to one daemon, whose KV then holds what the prompts before left; each prompt is also sent to
a reference daemon whose KV holds nothing of it (a displacing request first, its workspace cache off): a fresh
daemon's view. Every request's prompt tokens (the digest ``modeld why`` reports) and its greedy reply must be the
same on both. Both engines serve the bundled model.

The daemons of the property serve the layout whose rows are exact (``EXACT_ROWS``): there a token's logits are the
same whether its prompt was prefilled in one batch or on top of KV an earlier request left, which is what makes a
greedy reply comparable at all. In the default layout the batches of a warm prefill differ from a cold one's, and a
near tie can flip (seen in a run of 300 examples on llama.cpp: a chat prompt whose tokens were the same warm and cold
answered "The company has" warm and "The original sentence" cold; ``docs/contract.md``). The tokens do not hang on the
layout: the issue's examples are also sent to a pair of daemons in the default layout, their prompt tokens compared.

The suite runs a fixed seed and ``EXAMPLES`` examples per engine; ``make fuzz`` runs thousands
(``MODELD_WARM_COLD_EXAMPLES``).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.test_openai_front import Front  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("MODELD_WARM_COLD_EXAMPLES", "60"))
#: the reply compared: greedy, this many tokens
REPLY_TOKENS = 3
APIS = ("chat", "responses", "messages", "completions")

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


class Daemons:
    """The daemon under test and the reference whose KV never holds the prompt sent to it."""

    def __init__(self, warm: Front, cold: Front) -> None:
        self.warm = warm
        self.cold = cold
        self._http = {f: httpx.Client(base_url=f"http://127.0.0.1:{f.port}", timeout=600.0) for f in (warm, cold)}
        self._why = {f: f.daemon.client(timeout_s=60.0) for f in (warm, cold)}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference")

    def close(self) -> None:
        self._pool.shutdown()
        for c in self._http.values():
            c.close()
        for z in self._why.values():
            z.close()

    def ask(self, front: Front, api: str, prompt: str) -> tuple[str, str]:
        """``prompt`` through ``api``: the greedy reply's text and the prompt tokens' digest."""
        http = self._http[front]
        if api == "chat":
            r = http.post("/v1/chat/completions", json={"model": "default", "max_tokens": REPLY_TOKENS,
                                                        "temperature": 0,
                                                        "messages": [{"role": "user", "content": prompt}]})
            text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else ""
        elif api == "responses":
            r = http.post("/v1/responses", json={"model": "default", "max_output_tokens": REPLY_TOKENS,
                                                 "temperature": 0, "store": False, "input": prompt})
            text = r.json().get("output_text", "") if r.status_code == 200 else ""
            if r.status_code == 200 and not text:
                text = json.dumps(r.json()["output"])
        elif api == "messages":
            r = http.post("/v1/messages", json={"model": "default", "max_tokens": REPLY_TOKENS, "temperature": 0,
                                                "messages": [{"role": "user", "content": prompt}]},
                          headers={"x-api-key": "none", "anthropic-version": "2023-06-01"})
            text = json.dumps(r.json()["content"]) if r.status_code == 200 else ""
        else:
            r = http.post("/v1/completions", json={"model": "default", "max_tokens": REPLY_TOKENS, "temperature": 0,
                                                   "prompt": prompt})
            text = r.json()["choices"][0]["text"] if r.status_code == 200 else ""
        assert r.status_code == 200, (api, prompt, r.status_code, r.text[:300])
        return text, self._why[front].why(1)[-1].prompt_token_hash

    def ask_both(self, api: str, prompt: str) -> tuple[tuple[str, str], tuple[str, str]]:
        """``prompt`` to the daemon under test, and at the same time to the reference after a displacing request:
        the two daemons are processes of their own, so the pair costs about one request's time, not three."""
        cold = self._pool.submit(lambda: (self.displace(), self.ask(self.cold, api, prompt))[1])
        warm = self.ask(self.warm, api, prompt)
        return warm, cold.result()

    def displace(self) -> None:
        """The reference's KV holds nothing a prompt starts with afterwards (a raw prompt on another first token)."""
        r = self._http[self.cold].post("/v1/completions", json={"model": "default", "max_tokens": 1,
                                                                "prompt": f"§§ {uuid.uuid4().hex}"})
        assert r.status_code == 200, r.text[:300]


#: each engine's layout whose rows are exact (``--exact-decode``; llama.cpp: flash attention over a q8_0 cache, the
#: weights as the file has them), as ``test_backends_daemon`` starts it
EXACT_ROWS = {
    "llama": ("--flash-attn", "--kv-cache-type", "q8_0", "--exact-decode", "--engine-option", "extra_bufts=false"),
    "openvino": ("--exact-decode",),
}
ENGINES = [pytest.param("llama", marks=pytest.mark.llama), pytest.param("openvino", marks=pytest.mark.openvino)]


def _pair(tmp: Path, backend: str, layout: tuple[str, ...]) -> Iterator[Daemons]:
    pytest.importorskip("llama_cpp" if backend == "llama" else "openvino_genai")
    args = ("--num-ctx", "2048", "--speculative", "off", *layout)
    with Front(tmp / "warm", *args, backend=backend) as warm, \
         Front(tmp / "cold", *args, "--cache-ram", "0", "--cache-disk", "0", backend=backend) as cold:
        d = Daemons(warm, cold)
        try:
            yield d
        finally:
            d.close()


@pytest.fixture(scope="module", params=ENGINES)
def daemons(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """The warm daemon and the reference, in the layout whose rows are exact."""
    yield from _pair(tmp_path_factory.mktemp(f"warmcold-{request.param}"), request.param, EXACT_ROWS[request.param])


@pytest.fixture(scope="module", params=ENGINES)
def default_daemons(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    """The pair in the default layout."""
    yield from _pair(tmp_path_factory.mktemp(f"warmcold-default-{request.param}"), request.param, ())


@st.composite
def prompts(draw: st.DrawFn) -> tuple[str, list[str]]:
    """An API and two or three prompts: a base, then the base cut at arbitrary characters with other text after."""
    base = "".join(draw(st.lists(st.sampled_from(PIECES), min_size=2, max_size=10)))
    out = [base]
    for _ in range(draw(st.integers(1, 2))):
        cut = draw(st.integers(0, len(base)))
        tail = "".join(draw(st.lists(st.sampled_from(PIECES), min_size=0, max_size=4)))
        out.append(base[:cut] + tail or "x")
    return draw(st.sampled_from(APIS)), out


@seed(78)
@settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=prompts())
def test_a_prompt_s_tokens_and_greedy_reply_are_what_a_fresh_daemon_gives(daemons: Daemons,
                                                                          case: tuple[str, list[str]]) -> None:
    api, sequence = case
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
