"""Whole agent conversations on both engines: tool calls and results rendered by the model's template, kept warm.

The tool-capable fixture (the bundled weights under a Qwen/Hermes-style
template, harness/fixtures.py) runs a six-turn tool loop — a question, a tool
call the model makes (grammar-forced, parsed by the Hermes parser), the tool's
result, the model's answer, follow-ups — each request resending the whole
history. Checked per turn: the resident prompt is the template's own rendering
of the whole history, and only what is new is prefilled (the model's own
earlier replies are reused). In exact mode a cold model given the same history
answers like the warm one; in the default mode the test records how often it
does not. The bundled ChatML template, which cannot render tool calls, gets the
documented text fallback.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from backends.tape.conversation import abilities, template_messages, tool_call_text
from backends.tape.model import TapeModelBase, parse_tools
from backends.tape.session import TapeSession
from contract.types import (
    ChatMessage,
    Config,
    DecodeConfig,
    OpenSessionRequest,
    PrefixInput,
    StructuredOutputConfig,
    SuffixInput,
    ToolCall,
    ToolCallFunction,
)
from harness.fixtures import WEATHER_TOOL, tool_gguf

SYSTEM = "You are a weather assistant. Call get_weather for every city you are asked about, then answer in one sentence."
TOOLS = json.dumps([WEATHER_TOOL])
#: the user's turns, and the tool result each city's call gets
QUESTIONS = ["What is the weather in Paris?", "Should I take an umbrella?", "And in Oslo?", "Which city is warmer?"]
RESULTS = {"Paris": '{"temp_c": 21, "sky": "clear"}', "Oslo": '{"temp_c": 4, "sky": "rain"}'}
#: per turn: force a call for this city, or let the model answer
SCRIPT: list[str | None] = ["Paris", None, None, "Oslo", None, None]


def _load(engine: str, exact: bool = False) -> TapeModelBase:
    cfg = Config(num_ctx=2048, exact_reuse=exact)
    req = OpenSessionRequest(path=str(tool_gguf()), config=cfg)
    if engine == "llama":
        pytest.importorskip("llama_cpp")
        from backends.llama import LlamaBackend

        return LlamaBackend().load(req, lambda _f: None)
    pytest.importorskip("openvino_genai")
    from backends.openvino import OpenVINOBackend

    return OpenVINOBackend().load(req, lambda _f: None)


@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.llama), pytest.param("openvino", marks=pytest.mark.openvino)])
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _forced_call(city: str) -> StructuredOutputConfig:
    """A grammar that makes the model emit exactly the call the template would render back."""
    call = ToolCall(function=ToolCallFunction(name="get_weather", arguments=json.dumps({"city": city})))
    return StructuredOutputConfig(grammar="root ::= " + json.dumps(tool_call_text(call)))


@dataclass
class Turn:
    reused: int
    prefilled: int
    resident: int
    prompt: str
    reply: ChatMessage
    tokens: list[int] = field(default_factory=list)
    #: the messages this turn sent
    sent: list[ChatMessage] = field(default_factory=list)


def _turn(m: TapeModelBase, s: TapeSession, history: list[ChatMessage], city: str | None) -> Turn:
    man = m.manifest_defaults()
    s.ensure_prefix(PrefixInput(text=SYSTEM, tools=TOOLS, manifest=man))
    st = s.prefill_suffix(SuffixInput(messages=history, manifest=man))
    prompt = m.prompt_text(m.res.live)
    cfg: dict[str, Any] = {"max_tokens": 24, "return_token_ids": True, "parser_protocols": ["hermes"]}
    if city is not None:
        cfg.update(max_tokens=80, structured_output=_forced_call(city))
    chunks = list(s.decode(DecodeConfig(**cfg)))
    calls = [c for chunk in chunks for c in chunk.tool_calls]
    text = "".join(c.text for c in chunks)
    for i, call in enumerate(calls):
        call.id = f"call_{len(history)}_{i}"
    reply = ChatMessage(role="assistant", content=text or None, tool_calls=calls)
    tokens = [t for c in chunks for t in c.token_ids]
    return Turn(st.reused_tokens, st.prefilled_tokens, st.resident_tokens, prompt, reply, tokens, list(history))


def _conversation(m: TapeModelBase, s: TapeSession) -> tuple[list[ChatMessage], list[Turn]]:
    history: list[ChatMessage] = []
    turns: list[Turn] = []
    questions = iter(QUESTIONS)
    for city in SCRIPT:
        last = history[-1] if history else None
        if last is not None and last.tool_calls:
            for call in last.tool_calls:
                answer = RESULTS[json.loads(call.function.arguments)["city"]]
                history.append(ChatMessage(role="tool", content=answer, tool_call_id=call.id, name=call.function.name))
        else:
            history.append(ChatMessage(role="user", content=next(questions)))
        turns.append(_turn(m, s, history, city))
        if city is not None:
            assert [c.function.name for c in turns[-1].reply.tool_calls] == ["get_weather"], turns[-1].reply
        history.append(turns[-1].reply)
    return history, turns


@pytest.fixture(scope="module")
def default_run(engine: str) -> Iterator[tuple[TapeModelBase, list[ChatMessage], list[Turn]]]:
    m = _load(engine)
    try:
        history, turns = _conversation(m, m.open_session())
        yield m, history, turns
    finally:
        m.close()


def test_every_turn_is_the_template_rendering_of_the_whole_history(default_run: tuple[TapeModelBase, list[ChatMessage], list[Turn]]) -> None:
    m, history, turns = default_run
    tpl = m.template
    assert tpl is not None and abilities(tpl).tool_calls and abilities(tpl).tool_results
    for turn in turns:
        expected = tpl.render(
            template_messages(tpl, SYSTEM, turn.sent), parse_tools(TOOLS), generation=True
        )
        assert turn.prompt == expected
    assert history[-1] is turns[-1].reply and turns[-1].sent == history[:-1]
    # the template's own tool formats, not a fallback: calls as Hermes JSON, results as <tool_response>
    final = turns[-1].prompt
    for msg in turns[-1].sent:
        for call in msg.tool_calls:
            city = json.loads(call.function.arguments)["city"]
            assert f'<|im_start|>assistant\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call><|im_end|>' in final
        if msg.role == "tool":
            assert f"<tool_response>\n{msg.content}\n</tool_response>" in final
    assert sum(m.role == "tool" for m in turns[-1].sent) == 2


def test_only_what_is_new_is_prefilled(default_run: tuple[TapeModelBase, list[ChatMessage], list[Turn]]) -> None:
    _, _, turns = default_run
    for prev, turn in zip(turns, turns[1:], strict=False):
        # the previous turn's prompt is reused whole; what is prefilled is the new message and the template's glue,
        # and the model's reply from the first token the tokenizer spells otherwise (a call decoded under a grammar
        # is often spelled otherwise: a turn's tokens are its own cold rendering's, warm equals cold)
        resident_before = prev.resident + len(prev.tokens)
        new = turn.resident - resident_before
        assert turn.resident - turn.prefilled >= prev.resident - 4, (turn, prev.resident)
        assert turn.prefilled <= new + len(prev.tokens) + 16, (turn.prefilled, new)


def _replay_cold(m: TapeModelBase, turns: list[Turn]) -> list[Turn]:
    """Each turn's history prefilled from nothing and answered again, on ``m`` with its KV cleared before every
    turn (the model a conversation ran on serves: cleared, nothing of it is resident or reused)."""
    replays = []
    s = m.open_session()
    for i, turn in enumerate(turns):
        m.clear_kv()
        replay = _turn(m, s, turn.sent, SCRIPT[i])
        assert replay.reused == 0, f"turn {i + 1} reused what a cold prefill has not"
        replays.append(replay)
    return replays


def test_exact_mode_cold_history_answers_like_the_warm_session(engine: str) -> None:
    m = _load(engine, exact=True)
    try:
        _, turns = _conversation(m, m.open_session())
        for i, (turn, replay) in enumerate(zip(turns, _replay_cold(m, turns), strict=True)):
            assert replay.tokens == turn.tokens, f"turn {i + 1}"
    finally:
        m.close()


def test_default_mode_differs_from_cold_at_most_where_decoded_kv_is_reused(
    engine: str, default_run: tuple[TapeModelBase, list[ChatMessage], list[Turn]]
) -> None:
    """Reusing decode-step KV may change a greedy reply; count how often over the six turns."""
    m, _, turns = default_run
    differ = 0
    for i, (turn, replay) in enumerate(zip(turns, _replay_cold(m, turns), strict=True)):
        differ += replay.tokens != turn.tokens
        if i == 0:
            assert replay.tokens == turn.tokens  # nothing decoded is resident yet: the same computation
    print(f"\n{engine}: {differ} of {len(turns)} greedy turns differ from a cold prefill of the same history")
    assert differ <= len(turns) - 1


def test_a_template_without_tool_calls_gets_the_text_fallback(engine: str) -> None:
    from backends.bundled import bundled_gguf_path

    req = OpenSessionRequest(path=str(bundled_gguf_path()), config=Config(num_ctx=1024))
    if engine == "llama":
        from backends.llama import LlamaBackend

        m: TapeModelBase = LlamaBackend().load(req, lambda _f: None)
    else:
        from backends.openvino import OpenVINOBackend

        m = OpenVINOBackend().load(req, lambda _f: None)
    try:
        tpl = m.template
        assert tpl is not None
        can = abilities(tpl)
        # the bundled ChatML template knows neither tool calls nor the tool role
        assert not can.tool_calls and not can.tool_results
        s = m.open_session()
        man = m.manifest_defaults()
        s.ensure_prefix(PrefixInput(text=SYSTEM, manifest=man))
        call = ToolCall(id="c1", function=ToolCallFunction(name="get_weather", arguments='{"city": "Paris"}'))
        history = [
            ChatMessage(role="user", content=QUESTIONS[0]),
            ChatMessage(role="assistant", content=None, tool_calls=[call]),
            ChatMessage(role="tool", content=RESULTS["Paris"], tool_call_id="c1", name="get_weather"),
        ]
        s.prefill_suffix(SuffixInput(messages=history, manifest=man))
        prompt = m.prompt_text(m.res.live)
        assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in prompt
        label = '<tool_response name="get_weather" id="c1">'
        assert f"<|im_start|>user\n{label}\n{RESULTS['Paris']}\n</tool_response><|im_end|>" in prompt
        assert prompt.endswith("<|im_start|>assistant\n")
    finally:
        m.close()
