"""The tool-call formats by family (``backends/tape/toolformats/``): parsing each family's documented
call forms in any chunking, text that is not a call given back as content, and detection from templates.

The call samples are the forms each family's model card or format documentation shows. Rendering
with the families' published templates, forced calls and their reuse are in ``test_family_templates``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.tape.output import OutputPipeline
from backends.tape.toolformats import (
    FORMATS,
    CallParser,
    Lit,
    detect_format,
    format_named,
    marker_split,
    parameter_types,
)
from contract.errors import InvalidArgument

TYPES = {"get_weather": {"city": "string", "days": "integer"}}

#: family -> (a reply, the content, the reasoning, the calls as (name, arguments)) it must come to
SAMPLES: dict[str, list[tuple[str, str, str, list[tuple[str, dict]]]]] = {
    "hermes": [
        ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         "Let me check. ", "", [("get_weather", {"city": "Paris"})]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
         "\n", "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    ],
    "qwen3_coder": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
         "</parameter>\n</function>\n</tool_call>",
         "", "", [("get_weather", {"city": "New York", "days": 3})]),
        ("I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n"
         "</tool_call>", "I'll look.\n", "", [("get_weather", {"city": "42"})]),  # a string stays a string
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", "", [("get_weather", {"city": "Paris"})]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_weather", "parameters": {"city": "Rome"}}',
         "", "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]),
        ("The weather is {unknown} today.", "The weather is {unknown} today.", "", []),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
         "", "", [("get_weather", {"city": "Paris"})]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}, '
         '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
         "", "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    ],
    "mistral_args": [
        ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
         "Checking.", "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    ],
    "harmony": [
        ('<|channel|>analysis<|message|>User asks for the weather; call the tool.<|end|><|start|>assistant'
         '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
         "", "User asks for the weather; call the tool.", [("get_weather", {"city": "Paris"})]),
        (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
         "", "", [("get_weather", {"city": "Paris"})]),
        ("<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny."
         "<|return|>", "It is sunny.", "Simple.", []),
        ("Plain words from a model that writes no headers.\nSecond line.",
         "Plain words from a model that writes no headers.\nSecond line.", "", []),
    ],
    "deepseek_v3": [
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", "", [("get_weather", {"city": "Paris"})]),
    ],
    "deepseek_v3_1": [
        ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
         '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
         "Sure.", "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    ],
}
CASES = [(family, *sample) for family, samples in SAMPLES.items() for sample in samples]


def _parse(parser: CallParser, pieces: list[str]) -> tuple[str, str, list[tuple[str, dict]], list[str]]:
    content, reasoning, calls = "", "", []
    for piece in [*pieces, None]:
        c, r, k = parser.feed(piece) if piece is not None else parser.finish()
        content, reasoning, calls = content + c, reasoning + r, calls + k
    return content, reasoning, [(c.function.name, json.loads(c.function.arguments)) for c in calls], [c.id for c in calls]


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@pytest.mark.parametrize(("family", "reply", "content", "reasoning", "calls"), CASES)
def test_each_family_reads_its_documented_calls(family: str, reply: str, content: str, reasoning: str,
                                                calls: list) -> None:
    parser = FORMATS[family].parser(TYPES)
    got = _parse(parser, [reply])
    assert got[:3] == (content, reasoning, calls)
    assert len(set(got[3])) == len(calls) and all(got[3])  # every call has its own id
    assert parser.count == len(calls)  # what makes the finish reason "tool_calls"


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
@pytest.mark.parametrize(("family", "reply", "content", "reasoning", "calls"), CASES)
def test_streamed_in_any_chunking_the_same(family: str, reply: str, content: str, reasoning: str, calls: list,
                                           cuts: list[int]) -> None:
    assert _parse(FORMATS[family].parser(TYPES), _split(reply, cuts))[:3] == (content, reasoning, calls)


@pytest.mark.parametrize(("family", "reply"), [
    ("hermes", "<tool_call>\n{not json}\n</tool_call> after"),
    ("qwen3_coder", "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": [1, 2]}'),
    ("llama3_json", '<|python_tag|>print("hello")'),
    ("mistral", "[TOOL_CALLS] I would call a tool here"),
    ("mistral_args", "[TOOL_CALLS]f[ARGS]{broken"),
    ("harmony", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{not json<|call|>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>nothing a call looks like<｜tool▁calls▁end｜>"),
    ("hermes", 'unterminated <tool_call>\n{"name": "f", "arguments": {}}'),
])
def test_text_that_is_not_a_call_stays_content(family: str, reply: str) -> None:
    """Never swallowed, never an error: a model writing about calls, or a broken one, reaches the user."""
    content, reasoning, calls, _ = _parse(FORMATS[family].parser(), [reply])
    assert calls == [] and reasoning == ""
    assert content == reply


def test_mistral_calls_get_ids_its_templates_accept() -> None:
    """Mistral's templates refuse a call id that is not nine letters and digits; one the model wrote is kept."""
    _, _, _, ids = _parse(FORMATS["mistral"].parser(), [SAMPLES["mistral"][1][0]])
    assert ids[0] == "a1B2c3D4e" and len(ids[1]) == 9 and ids[1].isalnum() and ids[0] != ids[1]


def test_the_pipeline_feeds_the_format_and_its_reasoning() -> None:
    """Harmony's analysis channel is reasoning without any <think>; a stop string still cuts."""
    pipe = OutputPipeline(stops=["STOP"], split_thinking=False, tool_format=FORMATS["harmony"])
    reply = "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>yes STOP no"
    text = thinking = ""
    for ch in reply:
        d = pipe.feed_bytes(ch.encode())
        text, thinking = text + d.text, thinking + d.thinking
        if d.stopped:
            break
    d = pipe.finish()
    assert (text + d.text, thinking + d.thinking) == ("yes ", "hmm")
    assert pipe.markers >= {"<|channel|>", "<|message|>", "<|call|>"}


def test_names_and_aliases() -> None:
    assert format_named("Qwen") is FORMATS["hermes"] and format_named("gpt-oss") is FORMATS["harmony"]
    assert format_named("llama3") is FORMATS["llama3_json"] and format_named("nope") is None
    from backends.tape.toolformats import require_format

    with pytest.raises(InvalidArgument, match="not supported"):
        require_format("nope")


def test_parameter_types_read_both_tool_shapes() -> None:
    openai = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}}
    anthropic = {"name": "g", "input_schema": {"properties": {"s": {"type": "string"}}}}
    assert parameter_types([openai, anthropic, "junk"]) == {"f": {"n": "integer"}, "g": {"s": "string"}}


def test_detection_from_template_source() -> None:
    assert detect_format("{{ '<|im_start|>' }}{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert detect_format("{{ '[TOOL_CALLS]' }}{{ tool.name }}[ARGS]").name == "mistral_args"
    assert detect_format("{{ '[TOOL_CALLS] [' }}").name == "mistral"
    assert detect_format("<|start|>assistant to=functions.{{ name }}<|channel|>commentary<|message|>").name == "harmony"
    assert detect_format("<function={{ name }}>\n<parameter={{ k }}>").name == "qwen3_coder"
    assert detect_format("<|python_tag|>").name == "llama3_json"
    assert detect_format("no tools here").name == "hermes"


# --- calls as they are written ----------------------------------------------------------------------------------
#: the documented forms whose arguments are streamed as they are written (a Mistral list call without its
#: written id, and Hermes arguments written as a JSON string, come whole: see ``streaming``)
STREAMED = [(f, r) for f, r, _, _, calls in CASES if calls and not f == "mistral" and '"{\\"' not in r]


def _stream(family: str, pieces: list[str]) -> tuple[list[Any], list[Any]]:
    streamer = FORMATS[family].streamer(TYPES)
    calls, deltas = [], []
    for piece in [*pieces, None]:
        _, _, k, d = streamer.feed(piece) if piece is not None else streamer.finish()
        calls += k
        deltas += d
    return calls, deltas


def _check_deltas(calls: list[Any], deltas: list[Any]) -> dict[int, list[Any]]:
    """Every call's pieces: the first names it (its id and name), the arguments joined are its own, and a call's
    pieces all come before the next call's first."""
    by: dict[int, list[Any]] = {}
    order: list[int] = []
    for d in deltas:
        if d.index not in by:
            assert d.id and d.name, d  # the first piece of a call carries its id and name
            order.append(d.index)
        else:
            assert not d.id and not d.name and order[-1] == d.index, deltas
        by.setdefault(d.index, []).append(d)
    assert order == list(range(len(calls)))
    for i, call in enumerate(calls):
        assert (by[i][0].id, by[i][0].name) == (call.id, call.function.name)
        assert "".join(d.arguments for d in by[i]) == call.function.arguments
    return by


@pytest.mark.parametrize(("family", "reply", "content", "reasoning", "calls"), CASES)
def test_streamed_one_character_at_a_time_the_deltas_are_the_calls(family: str, reply: str, content: str,
                                                                   reasoning: str, calls: list) -> None:
    got, deltas = _stream(family, list(reply))
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls
    by = _check_deltas(got, deltas)
    if (family, reply) in STREAMED:  # the arguments come as the model writes them, not once at the end
        assert all(len([d for d in pieces if d.arguments]) > 1 for pieces in by.values()), by


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
@pytest.mark.parametrize(("family", "reply", "content", "reasoning", "calls"), CASES)
def test_streamed_in_any_chunking_the_deltas_are_the_calls(family: str, reply: str, content: str, reasoning: str,
                                                           calls: list, cuts: list[int]) -> None:
    _check_deltas(*_stream(family, _split(reply, cuts)))


def test_gemma3s_template_calls_stream_in_the_generic_block_format() -> None:
    """Gemma 3 renders no tools: its calls are read in the generic (Hermes) block, and stream the same."""
    from backends.tape.model import model_format
    from tests.test_family_templates import _template

    fmt, _ = model_format(_template("gemma3"), "")
    reply = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    streamer = fmt.streamer(TYPES)
    calls, deltas = [], []
    for piece in [*reply, None]:
        _, _, k, d = streamer.feed(piece) if piece is not None else streamer.finish()
        calls, deltas = calls + k, deltas + d
    by = _check_deltas(calls, deltas)
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3} and len(by[0]) > 2


def test_what_is_held_back_is_what_may_still_change() -> None:
    """Numbers, literals and escapes wait until they end; whitespace is dropped; the form is json.dumps'."""
    from backends.tape.toolformats import canonical_prefix

    assert canonical_prefix('{"n": 12') == ('{"n": ', None)
    assert canonical_prefix('{"n": 12,') == ('{"n": 12, ', None)
    assert canonical_prefix('{"b": tru') == ('{"b": ', None)
    assert canonical_prefix('{"s": "a\\') == ('{"s": "a', None)
    assert canonical_prefix('{"s": "a\\u00') == ('{"s": "a', None)
    assert canonical_prefix('{"s": "\\ud83d') == ('{"s": "', None)  # half of a pair waits for the other half
    assert canonical_prefix('{"s": "\\ud83d\\ude00"}') == ('{"s": "\U0001F600"}', 21)
    assert canonical_prefix(' {"a":[1 ,2.50e1],"b":{}}') == ('{"a": [1, 25.0], "b": {}}', 25)
    with pytest.raises(ValueError):
        canonical_prefix('{"a": 01}')


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(value=st.dictionaries(st.text(max_size=5), _json, max_size=4), ascii_=st.booleans(), indent=st.sampled_from([None, 1]))
def test_every_prefix_of_a_json_object_gives_the_start_of_its_canonical_form(value: dict, ascii_: bool,
                                                                            indent: int | None) -> None:
    """Whatever spelling the model uses (escapes, spacing), what is certain of a prefix is the start of the
    arguments the parser reports, and the whole gives them all."""
    from backends.tape.toolformats import canonical_prefix

    written = json.dumps(value, ensure_ascii=ascii_, indent=indent)
    final = json.dumps(json.loads(written), ensure_ascii=False)
    last = ""
    for n in range(len(written) + 1):
        got, end = canonical_prefix(written[:n])
        assert final.startswith(got) and got.startswith(last), (written[:n], got)
        last = got
    assert (last, end) == (final, len(written))


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_a_forced_literal_cut_at_the_markers_a_vocabulary_has_as_tokens_joins_back_to_itself(family: str) -> None:
    """Each marker of a forced call's literal text becomes its token id (ids here are made up), and nothing else
    does: the pieces, each id read as its marker, are the literal again."""
    fmt = FORMATS[family]
    ids = {marker: 100 + i for i, marker in enumerate(fmt.markers)}
    by_id = {i: marker for marker, i in ids.items()}
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    for piece in fmt.forced_pieces("get_weather", schema):
        if not isinstance(piece, Lit):
            continue
        cut = marker_split(piece.text, ids)
        assert "".join(by_id[p] if isinstance(p, int) else p for p in cut) == piece.text
        assert all(p for p in cut) and not any(isinstance(a, str) and isinstance(b, str) for a, b in zip(cut, cut[1:], strict=False))
        assert not any(m in p for p in cut if isinstance(p, str) for m in ids), cut
        assert marker_split(piece.text, {}) == [piece.text]


def test_marker_split_takes_the_longest_marker_and_leaves_partial_ones_as_text() -> None:
    ids = {"<a>": 1, "<a><b>": 2, "[X]": 3}
    assert marker_split("<a><b>c[X]<a", ids) == [2, "c", 3, "<a"]
    assert marker_split("[X][X]", ids) == [3, 3]
    assert marker_split("", ids) == []
