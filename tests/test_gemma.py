"""Gemma 3 270M in Q4_K_M, the second real model: ``modeld serve --model GEMMA_GGUF`` with no other flag.

Gemma 3 attends over a 512-token sliding window on 15 of its 18 layers, is a K-quant, and its file has no
chat template (a base model). Served as a user would serve it, through a real daemon and the OpenAI SDK:
``auto`` picks the engine that can load it and says why, the template its vocabulary selects is named, a
conversation far longer than the window stays warm turn after turn, and a forced tool call comes back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("llama_cpp")

from contract.types import OpenSessionRequest  # noqa: E402
from tests.test_family_templates import CITY_TOOL  # noqa: E402
from tests.test_openai_front import Front  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.llama]

#: about 1,400 tokens: well past the 512-token window, so a reuse that kept only the window would show
SYSTEM = "You review Python code for a small team. " + " ".join(
    f"Rule {i}: a function named step_{i} must return the value {i * 7} and log it once." for i in range(60)
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    from backends.bundled import gemma_gguf_path

    path = gemma_gguf_path()
    with Front(tmp_path_factory.mktemp("gemma"), "--model", str(path), "--model-name", "gemma",
               backend="auto") as f:
        yield f


def test_auto_picks_the_engine_that_loads_it_and_status_says_what_it_serves_with(gemma: Front) -> None:
    with gemma.daemon.client(timeout_s=30.0) as c:
        st = c.status()
        assert st.active is not None
        described = c.describe(OpenSessionRequest(model_name="gemma", type="llama", path=st.active.path))
    assert st.active.type == "llama"
    # describe, which loads nothing, names the template and tool format the load chose
    assert (described.chat_template, described.tool_format) == (st.active.chat_template, st.active.tool_format)
    assert st.backend_reason.startswith("auto: OpenVINO cannot convert this GGUF") and "gemma3" in st.backend_reason
    assert st.active.chat_template == "built-in gemma3 (the model's file has none; its vocabulary has <start_of_turn>)"
    assert st.active.tool_format.startswith("hermes (the template renders no tools")
    assert st.active.effective_context == 32_768  # the model's whole window, no flag needed


def test_a_conversation_far_longer_than_the_window_stays_warm(gemma: Front) -> None:
    sdk = gemma.sdk()
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    previous = 0
    for turn, question in enumerate(["What must step_3 return?", "And step_41?", "Which rule covers step_59?"]):
        messages.append({"role": "user", "content": question})
        out = sdk.chat.completions.create(model="gemma", messages=messages, max_tokens=12, temperature=0)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        cached = out.usage.prompt_tokens_details.cached_tokens or 0
        if turn == 0:
            assert out.usage.prompt_tokens > 1_000  # past the window twice over
        else:  # the whole earlier prompt came from the KV, not just the last window of it
            assert cached >= previous, (turn, cached, previous, out.usage)
        previous = out.usage.prompt_tokens + out.usage.completion_tokens
        messages.append({"role": "assistant", "content": out.choices[0].message.content or ""})


def test_a_forced_tool_call_comes_back_and_is_reused(gemma: Front) -> None:
    sdk = gemma.sdk()
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris?"}]
    first = sdk.chat.completions.create(model="gemma", messages=messages, tools=[CITY_TOOL], temperature=0,
                                        tool_choice="required")
    calls = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Oslo")
    assert first.usage is not None
    messages += [{"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"}]
    second = sdk.chat.completions.create(model="gemma", messages=messages, tools=[CITY_TOOL], max_tokens=8)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    # the prompt: Gemma's template renders no tool calls, so the call is history text in the Hermes form, the form
    # the forced call was decoded in, tokenized as a fresh daemon tokenizes it (warm equals cold: the grammar's
    # spelling of the call is computed again where the tokenizer spells it otherwise)
    assert cached >= first.usage.prompt_tokens - 4, (first.usage, second.usage)

