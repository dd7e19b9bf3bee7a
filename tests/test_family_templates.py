"""The families' published chat templates (``backends/chat_templates/``, each citing its release) with the tool formats:
detection, a history with calls and results rendered in the family's own syntax, and a forced call whose text
is what the template renders back (so the next turn reuses it), on the template alone and then on both engines.

The engine half serves the bundled weights under each family's template (``--chat-template FILE``): the
weights know none of these formats, but a forced call is decoded by a grammar in the family's syntax, parsed
by the family's parser, and rendered back by the template; what the next request reuses is measured.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.tape.conversation import abilities, template_messages
from backends.tape.templates import TEMPLATE_DIR
from backends.tape.toolformats import FORMATS, Args, CallId, Lit, ToolFormat, detect_format
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
from harness.fixtures import WEATHER_TOOL

TEMPLATES = TEMPLATE_DIR
SYSTEM = "You are a weather bot."
#: the tool the engines are forced to call: its city one of a few, so even free-text parameter syntaxes
#: (Qwen3-Coder's) end in a few tokens whatever the tiny model would ramble
CITY_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}
USER = "Weather in Paris?"
ARGS = {"city": "Paris"}

#: template file -> (the family detected, whether a turn renders after the earlier ones unchanged)
FAMILIES = {
    "qwen2_5": ("hermes", True),
    "qwen3_coder": ("qwen3_coder", True),
    "llama3": ("llama3_json", True),
    "mistral": ("mistral", False),  # Nemo moves the system text into the last user turn
    "mistral_args": ("mistral_args", True),
    "gpt_oss": ("harmony", True),
    "deepseek_v3": ("deepseek_v3", True),
    "deepseek_v3_1": ("deepseek_v3_1", True),
}


def _source(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def _template(name: str) -> Any:
    from backends.llama.model import LlamaTemplate

    return LlamaTemplate(_source(name), eos_token="</s>", bos_token="<s>")


def forced_text(fmt: ToolFormat, name: str, args: dict[str, Any], call_id: str = "a1B2c3D4e") -> str:
    """The text a forced call to ``name`` with ``args`` decodes to (each piece filled in as the grammar allows)."""
    schema = WEATHER_TOOL["function"]["parameters"]  # type: ignore[index]
    out = []
    values = iter(args.values())
    for piece in fmt.forced_pieces(name, schema):
        if isinstance(piece, Lit):
            out.append(piece.text)
        elif isinstance(piece, Args):
            out.append(json.dumps(args) if piece.fallback else json.dumps(next(values)))
        elif isinstance(piece, CallId):
            out.append(call_id)
        else:
            out.append(str(next(values)))
    return "".join(out)


def _parse(fmt: ToolFormat, text: str) -> list[ToolCall]:
    parser = fmt.parser({"get_weather": {"city": "string"}})
    _, _, calls = parser.feed(text)
    return calls + parser.finish()[2]


def _history(calls: list[ToolCall]) -> list[ChatMessage]:
    return [
        ChatMessage(role="user", content=USER),
        ChatMessage(role="assistant", content="", tool_calls=calls),
        ChatMessage(role="tool", content="sunny, 21 C", tool_call_id=calls[0].id, name="get_weather"),
    ]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_family_is_detected_and_renders_calls_and_results_itself(name: str) -> None:
    family, _ = FAMILIES[name]
    tpl = _template(name)
    assert detect_format(tpl.source).name == family
    can = abilities(tpl)
    assert can.tool_calls and can.tool_results, can
    fmt = FORMATS[family]
    calls = [ToolCall(id="call_7", function=ToolCallFunction(name="get_weather", arguments=json.dumps(ARGS)))]
    prompt = tpl.render(template_messages(tpl, SYSTEM, _history(calls), fmt), [WEATHER_TOOL], generation=True)
    assert "sunny, 21 C" in prompt and "get_weather" in prompt
    # the call is in the family's own syntax, and reads back as the same call
    shown = forced_text(fmt, "get_weather", ARGS, call_id=_template_id(fmt, "call_7"))
    assert shown.strip() in prompt, prompt
    back = _parse(fmt, shown)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in back] == [("get_weather", ARGS)]


def _template_id(fmt: ToolFormat, call_id: str) -> str:
    from backends.tape.toolformats import template_call_id

    return template_call_id(call_id, fmt)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_forced_call_is_what_the_template_renders_back(name: str) -> None:
    """The decoded call, parsed and sent back by a client, renders as the very text decoded: reused, not re-prefilled."""
    family, stable = FAMILIES[name]
    tpl, fmt = _template(name), FORMATS[family]
    system = {"role": "system", "content": SYSTEM}
    asked = tpl.render([system, {"role": "user", "content": USER}], [WEATHER_TOOL], generation=True)
    decoded = forced_text(fmt, "get_weather", ARGS)
    calls = _parse(fmt, decoded)
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) == ARGS
    nxt = tpl.render(template_messages(tpl, SYSTEM, _history(calls), fmt), [WEATHER_TOOL], generation=True)
    if stable:
        assert nxt.startswith(asked + decoded), (asked + decoded, nxt)
    else:
        assert decoded in nxt, (decoded, nxt)


def test_gemma3_renders_no_tools_so_they_go_in_the_generic_block() -> None:
    tpl = _template("gemma3")
    assert not tpl.supports_tools and not abilities(tpl).tool_calls
    from backends.tape.model import model_format

    fmt, why = model_format(tpl, "")
    assert fmt.name == "hermes" and "generic block" in why


def test_both_engines_grammars_write_a_control_token_marker_as_a_token_reference() -> None:
    """The forced call's grammar on each engine: a marker given with its control token id is a token reference,
    ``<[ID]>``, the rest of the literal text stays text; with no ids the markers are text as before."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llguidance")
    from backends.llama.sampling import tool_call_gbnf
    from backends.openvino.guidance import tool_call_lark

    fmt = FORMATS["mistral_args"]
    schema = json.dumps(CITY_TOOL["function"]["parameters"])  # type: ignore[index]
    ids = {"[TOOL_CALLS]": 9, "[ARGS]": 12}
    gbnf = tool_call_gbnf({"get_weather": schema}, fmt, ids).splitlines()
    assert "call0 ::= <[9]> \"get_weather\" <[12]> args0-1" in gbnf, gbnf
    lark = tool_call_lark({"get_weather": schema}, fmt, ids).splitlines()
    assert "call0: <[9]> \"get_weather\" <[12]> args0_1" in lark, lark
    assert 'call0 ::= "[TOOL_CALLS]get_weather[ARGS]" args0-1' in tool_call_gbnf({"get_weather": schema}, fmt)


# --- on the engines -------------------------------------------------------------------------------------------
ENGINE_FAMILIES = ["qwen3_coder", "llama3", "mistral", "mistral_args", "gpt_oss", "deepseek_v3", "deepseek_v3_1"]


def _load(engine: str, name: str, path: str = "", *, speculative: bool = True) -> Any:
    """The bundled model (or the GGUF at ``path``) under the family template ``name`` ("": the file's own).

    Without ``speculative`` the load measures no draft costs (they are kept per model layout, which the
    fixtures share with the bundled model, so either way a fixture's load reads the bundled model's)."""
    from backends.bundled import bundled_gguf_path

    config = Config(num_ctx=2048, chat_template=str(TEMPLATES / f"{name}.jinja") if name else "")
    if engine == "llama":
        from backends.llama import LlamaBackend

        backend: Any = LlamaBackend(speculative=speculative)
    else:
        from backends.openvino import OpenVINOBackend

        backend = OpenVINOBackend(speculative=speculative)
    return backend.load(OpenSessionRequest(path=path or str(bundled_gguf_path()), type=engine, config=config),
                        lambda _f: None)


@pytest.fixture(params=["llama", "openvino"])
def engine(request: pytest.FixtureRequest) -> Iterator[str]:
    pytest.importorskip("llama_cpp" if request.param == "llama" else "openvino_genai")
    yield request.param


def test_the_same_weights_under_another_template_read_the_measured_draft_costs(
    engine: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A check's cost depends on what the model computes, not on its metadata: the bundled weights without
    a chat template (another file, another digest) draft by the table the bundled model's load kept, and
    measure nothing. The context-extended copy (other RoPE scalars) has a layout of its own."""
    from backends.bundled import bundled_gguf_path, served_bundled_gguf
    from backends.gguf_file import gguf_layout_digest
    from backends.tape import draft_costs
    from harness.fixtures import truncated_gguf, untemplated_gguf
    from tests.engine_kit import forbid_measuring, quick_timing

    bundled, bare = bundled_gguf_path(), untemplated_gguf()
    assert gguf_layout_digest(bundled) == gguf_layout_digest(bare) != gguf_layout_digest(served_bundled_gguf())
    with pytest.raises(ValueError, match="truncated or corrupt"):
        gguf_layout_digest(truncated_gguf(bundled, tmp_path / "cut.gguf", keep_fraction=0.01))
    # whatever the timing gives is kept: a busy machine's table is refused as implausible (tests/test_tape.py),
    # which is not what this test is about
    monkeypatch.setattr(draft_costs, "plausible", lambda costs: True)
    monkeypatch.delenv(draft_costs.FIXED_ENV)  # the timing is the subject: not the suite's fixed table
    # its own table: another test timing the same model on another worker keeps its own in the shared model cache
    monkeypatch.setattr(draft_costs, "table_dir", lambda: tmp_path)
    quick_timing(monkeypatch)
    base = _load(engine, "")
    try:
        base.idle_work()  # timed as an idle daemon times them, where no table is kept yet
        costs, key, digest = base.draft_costs, draft_costs.cost_key(base), base.digest
        assert base.draft_costs_measured
    finally:
        base.close()

    forbid_measuring(monkeypatch)
    other = _load(engine, "", str(bare))
    try:
        assert other.digest != digest and draft_costs.cost_key(other) == key and other.draft_costs == costs
        assert other.draft_costs_measured and not other.idle_pending()
    finally:
        other.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_a_forced_call_in_the_family_syntax_comes_back_in_the_same_words(engine: str, name: str) -> None:
    """The next turn renders the call as the model wrote it, and the prompt before it stays resident. (The call's own
    tokens are reused where the tokenizer spells its text as the model did: a call decoded under a grammar is often
    spelled otherwise, and the next turn's tokens are its own cold rendering's, warm equals cold.)"""
    family, stable = FAMILIES[name]
    m = _load(engine, name)
    try:
        assert m.tool_format.name == family and "detected" in m.tool_format_origin
        s = m.open_session()
        man = m.manifest_defaults()
        tools = json.dumps([CITY_TOOL])
        s.ensure_prefix(PrefixInput(text=SYSTEM, manifest=man, tools=tools))
        s.prefill_suffix(SuffixInput(messages=[ChatMessage(role="user", content=USER)], manifest=man, render=True))
        asked = len(m.res.tokens)
        schema = json.dumps(CITY_TOOL["function"]["parameters"])  # type: ignore[index]
        chunks = list(s.decode(DecodeConfig(max_tokens=120, temperature=0.0, return_token_ids=True,
                                            structured_output=StructuredOutputConfig(tool_call={"get_weather": schema}))))
        text = m.prompt_text([t for c in chunks for t in c.token_ids])
        calls = [c for chunk in chunks for c in chunk.tool_calls]
        assert chunks[-1].finish_reason == "tool_calls", text
        assert len(calls) == 1 and calls[0].function.name == "get_weather", text
        assert set(json.loads(calls[0].function.arguments)) <= {"city"}
        st = s.prefill_suffix(SuffixInput(messages=_history(calls), manifest=man, render=True))
        assert text in m.prompt_text(m.res.tokens)  # the call is there, in the same words
        if stable:  # the prompt before the call stays resident (less where the turn's end joins it otherwise)
            assert st.prefix_tokens + st.reused_tokens >= asked - 4, (st, asked, text)
    finally:
        m.close()


def test_built_in_names_and_the_default_a_vocabulary_selects() -> None:
    from backends.tape.templates import CHATML, builtin_names, choose_template, requested_template

    assert set(FAMILIES) | {"gemma3", "chatml"} <= set(builtin_names())
    source, origin = requested_template("LLAMA3") or ("", "")
    assert source == _source("llama3") and origin == "built-in llama3"
    gemma_vocab = {"<start_of_turn>"}
    source, origin = choose_template(None, "", gemma_vocab.__contains__)
    assert source == _source("gemma3") and "its vocabulary has <start_of_turn>" in origin
    assert choose_template(None, "", {"<|start_header_id|>"}.__contains__)[0] == _source("llama3")
    assert choose_template(None, "", set().__contains__) == (CHATML, "ChatML (the model's file has none)")
    assert choose_template(None, "own", gemma_vocab.__contains__) == ("own", "the model's own")


def test_deepseek_v3_calls_render_as_the_model_writes_them_and_stream_back() -> None:
    """Two calls in DeepSeek V3 (0324)'s template: the block it renders, fed back a character at a time, is the
    same two calls, each streamed with its name first and arguments that join to its own."""
    tpl, fmt = _template("deepseek_v3"), FORMATS["deepseek_v3"]
    calls = [ToolCall(id="call_1", function=ToolCallFunction(name="get_weather", arguments=json.dumps({"city": "Paris"}))),
             ToolCall(id="call_2", function=ToolCallFunction(name="get_weather", arguments=json.dumps({"city": "Oslo"})))]
    prompt = tpl.render(template_messages(tpl, SYSTEM, _history(calls), fmt), [WEATHER_TOOL], generation=True)
    begin, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    written = prompt[prompt.index(begin) : prompt.index(end) + len(end)]
    assert "```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" in written
    streamer = fmt.streamer()
    back, deltas = [], []
    for piece in [*written, None]:
        content, _, found, d = streamer.feed(piece) if piece is not None else streamer.finish()
        assert content == ""
        back, deltas = back + found, deltas + d
    assert [(c.function.name, c.function.arguments) for c in back] == [(c.function.name, c.function.arguments)
                                                                        for c in calls]
    for i, call in enumerate(back):
        mine = [d for d in deltas if d.index == i]
        assert mine[0].name == "get_weather" and mine[0].id == call.id and len(mine) > 2
        assert "".join(d.arguments for d in mine) == call.function.arguments


@pytest.mark.slow
def test_a_marker_the_vocabulary_has_as_one_control_token_is_read_and_rendered_back_as_that_token(engine: str) -> None:
    """No fixture vocabulary holds a family's tool marker as a control token (the bundled model's and Gemma's hold
    none), so this is the seam on the one the bundled vocabulary has, ``<|im_start|>``: a control token whose text
    is a marker is fed to the parser as that text (a control token is otherwise no text), and that text, rendered
    into the next prompt, is the same single token again; a marker that is not one token is left to the text."""
    m = _load(engine, "qwen2_5")
    try:
        (control,) = m.tokenize("<|im_start|>")
        pieces = m.marker_pieces(frozenset({"<|im_start|>", "<tool_call>"}))
        assert pieces == {control: b"<|im_start|>"}
        assert len(m.tokenize("<tool_call>")) > 1  # not one token here: its pieces are text anyway
        assert m.tokenize(pieces[control].decode() + "\n") == [control, *m.tokenize("\n")]
    finally:
        m.close()


@pytest.mark.slow
def test_a_forced_call_decodes_a_marker_the_vocabulary_has_as_a_control_token_as_that_token(engine: str) -> None:
    """A Mistral-style vocabulary (``control_marker_gguf``: the bundled weights, ``[TOOL_CALLS]`` and ``[ARGS]``
    control tokens as in Devstral's, the ``mistral_args`` template in the file): the forced call's grammar
    writes each marker as its control token, so the decode holds that token, never the marker's text in
    ordinary tokens; the call parses, and the next turn's prompt, which the template renders with the same
    control tokens, reuses the decoded call."""
    from harness.fixtures import control_marker_gguf

    m = _load(engine, "", str(control_marker_gguf()), speculative=False)
    try:
        assert m.tool_format.name == "mistral_args" and "detected" in m.tool_format_origin
        markers = m.forced_markers(m.tool_format)
        assert set(markers) == {"[TOOL_CALLS]", "[ARGS]"}
        assert all(m.is_control(t) and m.tokenize(text) == [t] for text, t in markers.items())
        assert not m.is_control(m.tokenize("get")[0])
        s = m.open_session()
        man = m.manifest_defaults()
        s.ensure_prefix(PrefixInput(text=SYSTEM, manifest=man, tools=json.dumps([CITY_TOOL])))
        s.prefill_suffix(SuffixInput(messages=[ChatMessage(role="user", content=USER)], manifest=man, render=True))
        asked = len(m.res.tokens)
        schema = json.dumps(CITY_TOOL["function"]["parameters"])  # type: ignore[index]
        chunks = list(s.decode(DecodeConfig(max_tokens=60, temperature=0.0, return_token_ids=True,
                                            structured_output=StructuredOutputConfig(tool_call={"get_weather": schema}))))
        ids = [t for c in chunks for t in c.token_ids]
        text = b"".join(m.token_bytes(ids)).decode()
        calls = [c for chunk in chunks for c in chunk.tool_calls]
        assert chunks[-1].finish_reason == "tool_calls", text
        # each marker is its one control token: the text the decode spells is the call's, marker for marker
        assert ids[0] == markers["[TOOL_CALLS]"] and ids.count(markers["[ARGS]"]) == 1, (ids, text)
        assert text.startswith('[TOOL_CALLS]get_weather[ARGS]{"city": "'), text
        assert sum(m.token_bytes([t]) == [b"["] for t in ids) == 0, (ids, text)
        assert len(calls) == 1 and calls[0].function.name == "get_weather", text
        assert json.loads(calls[0].function.arguments) in ({"city": "Paris"}, {"city": "Oslo"}), text
        st = s.prefill_suffix(SuffixInput(messages=_history(calls), manifest=man, render=True))
        # the next prompt renders the call back with its markers as the control tokens the decode wrote (its own
        # cold tokens: the call's text as the tokenizer spells it), and the prompt before it stays resident
        assert st.prefix_tokens + st.reused_tokens >= asked + 1, (st, asked, ids, text)
        again = m.res.tokens[asked:]
        assert again[0] == markers["[TOOL_CALLS]"] and markers["[ARGS]"] in again, (again, ids)
    finally:
        m.close()
