"""Unit tests of backends/tape/output.py: incremental UTF-8, stop strings, <think>, tool calls.

Every stage must give the same output however the stream is chunked, so most
properties are checked over arbitrary split points with hypothesis.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.tape.output import (
    OutputPipeline,
    StopMatcher,
    ThinkSplitter,
    Utf8Stream,
    ends_inside_thinking,
    resolve_protocols,
)
from backends.tape.toolformats import FORMATS, parse_json_call
from contract.errors import UnsupportedFeature


def split_at(data: bytes | str, cuts: list[int]) -> list:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in points:
        out.append(data[prev:p])
        prev = p
    out.append(data[prev:])
    return out


cuts_st = st.lists(st.integers(min_value=0, max_value=10_000), max_size=12)


# --- UTF-8 -----------------------------------------------------------------------------------
MULTIBYTE = "héllo 日本語 🎉👩‍💻 ok ✓"


def test_utf8_never_splits_a_character_bytewise() -> None:
    data = MULTIBYTE.encode()
    dec = Utf8Stream()
    pieces = [dec.feed(data[i : i + 1]) for i in range(len(data))]
    assert "".join(pieces) + dec.finish() == MULTIBYTE
    assert all("\ufffd" not in p for p in pieces)
    # the 4-byte emoji comes out whole, in the call that received its last byte
    assert "🎉" in pieces


@given(text=st.text(), cuts=cuts_st)
def test_utf8_any_chunking_roundtrips(text: str, cuts: list[int]) -> None:
    dec = Utf8Stream()
    out = "".join(dec.feed(part) for part in split_at(text.encode(), cuts)) + dec.finish()
    assert out == text


def test_utf8_invalid_bytes_become_replacement_not_errors() -> None:
    dec = Utf8Stream()
    out = dec.feed(b"ok\xff") + dec.feed(b"\xe6\x97") + dec.finish()  # truncated 3-byte char at the end
    assert out.startswith("ok\ufffd") and out.endswith("\ufffd")


# --- stop strings ------------------------------------------------------------------------------
def test_stop_holds_back_partial_match_then_releases_it() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.feed("AR") == "STAR"  # proven not to be the stop string
    assert m.feed("x STO") == "x "
    assert m.feed("P tail") == ""
    assert m.stopped
    assert m.feed("more") == "" and m.finish() == ""


def test_stop_finish_releases_a_held_partial() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("value </en") == "value "
    assert m.finish() == "</en"


def test_stop_earliest_of_several() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == "hel"


@given(
    text=st.text(alphabet="abxyz \n", max_size=60),
    stops=st.lists(st.text(alphabet="abxyz\n", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=cuts_st,
)
def test_stop_any_chunking_matches_one_shot(text: str, stops: list[str], cuts: list[int]) -> None:
    # The stop string that completes first in the text decides the cut (ties: earlier start).
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    expected_cut = min(hits)[1] if hits else -1
    expected = text if expected_cut < 0 else text[:expected_cut]
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in split_at(text, cuts)) + m.finish()
    assert out == expected
    assert m.stopped == (expected_cut >= 0)


# --- <think> ---------------------------------------------------------------------------------------
def test_think_split_basic() -> None:
    t = ThinkSplitter()
    c1, th1 = t.feed("<think>plan a")
    c2, th2 = t.feed("nd b</thi")
    c3, th3 = t.feed("nk>answer")
    c4, th4 = t.finish()
    assert c1 + c2 + c3 + c4 == "answer"
    assert th1 + th2 + th3 + th4 == "plan and b"


def test_think_start_inside_for_templates_that_open_the_block() -> None:
    t = ThinkSplitter(start_inside=True)
    content, thinking = t.feed("reasoning</think>final")
    assert (content, thinking) == ("final", "reasoning")


def test_think_unclosed_block_is_reasoning_at_finish() -> None:
    t = ThinkSplitter()
    c, th = t.feed("x<think>still thinking</th")
    c2, th2 = t.finish()
    assert c + c2 == "x" and th + th2 == "still thinking</th"


def test_think_lookalike_tag_stays_content() -> None:
    t = ThinkSplitter()
    c, th = t.feed("a <thin")
    c2, th2 = t.feed("ker> b")
    assert c + c2 == "a <thinker> b" and th + th2 == ""


@given(
    parts=st.lists(st.tuples(st.booleans(), st.text(alphabet="ab<>/ ", max_size=8)), max_size=6),
    cuts=cuts_st,
)
def test_think_any_chunking_matches_one_shot(parts: list[tuple[bool, str]], cuts: list[int]) -> None:
    # Build a stream of alternating regions whose bodies never contain the tags.
    parts = [(inside, body.replace("<think>", "").replace("</think>", "")) for inside, body in parts]
    text = "".join(f"<think>{b}</think>" if inside else b for inside, b in parts)
    one = ThinkSplitter()
    c0, t0 = one.feed(text)
    cf, tf = one.finish()
    many = ThinkSplitter()
    cs, ts = [], []
    for p in split_at(text, cuts):
        c, t = many.feed(p)
        cs.append(c)
        ts.append(t)
    c, t = many.finish()
    assert ("".join(cs) + c, "".join(ts) + t) == (c0 + cf, t0 + tf)


def test_ends_inside_thinking() -> None:
    assert ends_inside_thinking("<|im_start|>assistant\n<think>\n")
    assert not ends_inside_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not ends_inside_thinking("<|im_start|>assistant\n")


# --- tool calls (the Hermes format; the other families are in test_toolformats) -----------------------
class ToolCallParser:
    """The Hermes parser, as (content, calls): it finds no reasoning of its own."""

    def __init__(self) -> None:
        self._p = FORMATS["hermes"].parser()

    def feed(self, text: str) -> tuple[str, list]:
        content, reasoning, calls = self._p.feed(text)
        assert reasoning == ""
        return content, calls

    def finish(self) -> tuple[str, list]:
        content, reasoning, calls = self._p.finish()
        assert reasoning == ""
        return content, calls


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_call_valid() -> None:
    p = ToolCallParser()
    content, calls = p.feed("Let me check. " + CALL)
    assert content == "Let me check. "
    assert len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert calls[0].type == "function" and calls[0].id.startswith("call_") and len(calls[0].id) == 29


def test_tool_call_multiple_and_string_arguments() -> None:
    second = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    p = ToolCallParser()
    content, calls = p.feed(CALL + "\n" + second)
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].function.arguments) == {"tz": "UTC"}
    assert len({c.id for c in calls}) == 2  # ids unique: clients key results (and some their history) by them
    assert content == "\n"


def test_tool_call_invalid_json_stays_text() -> None:
    bad = "<tool_call>{not json}</tool_call>"
    p = ToolCallParser()
    content, calls = p.feed("x " + bad + " y")
    assert calls == [] and content == "x " + bad + " y"


def test_tool_call_missing_name_or_bad_arguments_stays_text() -> None:
    for body in ('{"arguments": {}}', '{"name": "f", "arguments": [1]}', '{"name": "", "arguments": {}}', "[1]"):
        p = ToolCallParser()
        block = f"<tool_call>{body}</tool_call>"
        assert p.feed(block) == (block, [])


def test_tool_call_unterminated_is_returned_at_finish() -> None:
    p = ToolCallParser()
    content, calls = p.feed('ok <tool_call>{"name": "f"')
    assert content == "ok " and calls == []
    assert p.finish() == ('<tool_call>{"name": "f"', [])


def test_parse_tool_call_json_parameters_alias() -> None:
    call = parse_json_call('{"name": "f", "parameters": {"a": 1}}', "id1")
    assert call is not None and json.loads(call.function.arguments) == {"a": 1} and call.id == "id1"


@given(cuts=cuts_st, prefix=st.text(alphabet="abc <>", max_size=10))
def test_tool_calls_any_chunking(cuts: list[int], prefix: str) -> None:
    text = prefix + CALL + " and " + CALL.replace("Paris", "東京") + " done"
    p = ToolCallParser()
    content, calls = [], []
    for part in split_at(text, cuts):
        c, k = p.feed(part)
        content.append(c)
        calls += k
    c, k = p.finish()
    content.append(c)
    calls += k
    assert "".join(content) == prefix + " and  done"
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "東京"]


# --- the pipeline --------------------------------------------------------------------------------------
def _run(pipe: OutputPipeline, pieces: list[bytes]) -> tuple[str, str, list[str], bool]:
    text, thinking, names, stopped = "", "", [], False
    for p in pieces:
        d = pipe.feed_bytes(p)
        text += d.text
        thinking += d.thinking
        names += [c.function.name for c in d.tool_calls]
        if d.stopped:
            stopped = True
            break
    d = pipe.finish()
    return text + d.text, thinking + d.thinking, names + [c.function.name for c in d.tool_calls], stopped


STREAM = "<think>need weather 🌧</think>Checking 日本.\n" + CALL + "\nEND more text"


@settings(max_examples=200)
@given(cuts=cuts_st)
def test_pipeline_any_byte_chunking(cuts: list[int]) -> None:
    pieces = split_at(STREAM.encode(), cuts)
    text, thinking, names, stopped = _run(OutputPipeline(stops=["END"], tool_format=FORMATS["hermes"]), pieces)
    assert thinking == "need weather 🌧"
    assert text == "Checking 日本.\n\n"
    assert names == ["get_weather"]
    assert stopped


def test_pipeline_without_parsers_is_plain_text() -> None:
    text, thinking, names, stopped = _run(
        OutputPipeline(split_thinking=False), [STREAM.encode()]
    )
    assert text == STREAM and thinking == "" and names == [] and not stopped


def test_resolve_protocols() -> None:
    hermes, mistral, harmony = FORMATS["hermes"], FORMATS["mistral"], FORMATS["harmony"]

    def resolve(protocols: list[str], reasoning: str, *, has_tools: bool, model=hermes) -> tuple:  # noqa: ANN001
        return resolve_protocols(protocols, reasoning, has_tools=has_tools, model_format=model)

    assert resolve([], "", has_tools=False) == (True, None)
    assert resolve([], "", has_tools=True) == (True, hermes)
    assert resolve([], "", has_tools=True, model=mistral) == (True, mistral)
    assert resolve([], "none", has_tools=True) == (False, hermes)
    assert resolve(["hermes"], "", has_tools=False) == (False, hermes)
    assert resolve(["think", "qwen"], "deepseek", has_tools=False) == (True, hermes)
    # harmony carries reasoning in its own channels: it runs without tools and <think> is not split
    assert resolve([], "", has_tools=False, model=harmony) == (False, harmony)
    assert resolve([], "none", has_tools=False, model=harmony) == (False, None)
    assert resolve(["think", "gpt-oss"], "", has_tools=False) == (False, harmony)
    assert resolve(["mistral"], "", has_tools=False, model=harmony) == (False, mistral)
    with pytest.raises(UnsupportedFeature):
        resolve(["harmonica"], "", has_tools=False)
    with pytest.raises(UnsupportedFeature):
        resolve(["hermes", "mistral"], "", has_tools=False)
    with pytest.raises(UnsupportedFeature):
        resolve([], "gpt-oss", has_tools=False)
