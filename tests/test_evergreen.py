"""Evergreen's session (``modeld.front.evergreen``): the seed's examples and its rules on the node store, then
actions run on the serving core against a real daemon process (the reference backend), the second turn warm.

The gRPC transport is tested through real gRPC clients in test_evergreen_grpc.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

pytest.importorskip("fastapi")

from harness.daemon import DaemonProcess  # noqa: E402
from modeld.front.core import Serving  # noqa: E402
from modeld.front.evergreen import (  # noqa: E402
    END_OF_TURN,
    TEXT,
    Abort,
    Action,
    Chunk,
    EvergreenSession,
    Fragment,
    NodeStore,
)
from modeld.front.pool import ClientPool  # noqa: E402
from modeld.settings import HttpSettings  # noqa: E402
from runtime import Client  # noqa: E402


def text(node: str, data: str, *, seq: int = 0, continued: bool = False) -> Fragment:
    return Fragment(id=node, seq=seq, continued=continued, chunk=Chunk(TEXT, data.encode()), has_metadata=seq == 0)


def parent(node: str, *children: str, seq: int = 0, continued: bool = False) -> Fragment:
    return Fragment(id=node, seq=seq, continued=continued, child_ids=children)


def eot(node: str) -> Fragment:
    return Fragment(id=node, chunk=Chunk(END_OF_TURN), has_metadata=True)


def generate(prompt: str, response: str, **config: object) -> Action:
    return Action("GENERATE", (("prompt", prompt),), (("response", response),), dict(config))


# --- the node store ---------------------------------------------------------------------------------------------


def test_a_prompt_may_come_before_or_after_its_children_and_in_any_order() -> None:
    s = NodeStore()
    s.receive(parent("prompt_1", "question_1", "code_1"))
    assert not s.complete("prompt_1")  # its children have not come
    s.receive(text("code_1", "x = 1\n", seq=1))
    s.receive(text("question_1", "What is x? "))
    assert not s.complete("prompt_1")  # code_1's fragment 0 is missing
    s.receive(text("code_1", "Here: ", seq=0, continued=True))
    assert s.complete("prompt_1")
    assert s.prompt_messages("prompt_1") == [{"role": "user", "content": "What is x? Here: x = 1\n"}]


def test_the_second_turn_names_the_first_prompt_and_response() -> None:
    s = NodeStore()
    inp, out = s.check_action(generate("prompt_1", "response_1"))
    assert (inp, out) == ("prompt_1", "response_1")
    s.receive(parent("prompt_1", "question_1"))
    s.receive(text("question_1", "Write a haiku about tests."))
    s.write_output("response_1", 0, "Green bar at last, ", final=False)
    s.write_output("response_1", 1, "the build sleeps.", final=True)
    s.check_action(generate("prompt_2", "response_2"))
    s.receive(parent("prompt_2", "prompt_1", "response_1", "question_2"))
    s.receive(text("question_2", "Another?"))
    assert s.complete("prompt_2")
    assert s.prompt_messages("prompt_2") == [
        {"role": "user", "content": "Write a haiku about tests."},
        {"role": "assistant", "content": "Green bar at last, the build sleeps."},
        {"role": "user", "content": "Another?"},
    ]


def test_a_streamed_prompt_with_continued_and_an_end_of_turn_marker() -> None:
    """The seed's last example: prompt_1 arrives in two fragments, the second naming the EndOfTurn marker."""
    s = NodeStore()
    s.receive(parent("prompt_1", "prompt_1_text", continued=True))
    s.receive(text("prompt_1_text", "Write a heroic novel about a half-eaten jam doughnut."))
    assert not s.complete("prompt_1")  # more of prompt_1 is to come
    s.receive(parent("prompt_1", "prompt_1_eot", seq=1))
    s.receive(eot("prompt_1_eot"))
    assert s.complete("prompt_1")
    # after the marker, more text starts the user's next turn
    s.receive(parent("prompt_2", "prompt_1", "more"))
    s.receive(text("more", "Make it short."))
    assert [m["content"] for m in s.prompt_messages("prompt_2")] == [
        "Write a heroic novel about a half-eaten jam doughnut.", "Make it short."]


def test_a_repeated_seq_is_ignored_first_one_wins() -> None:
    s = NodeStore()
    s.receive(text("q", "first ", continued=True))
    s.receive(text("q", "retry ", continued=True))  # the same seq again: ignored, no error
    s.receive(text("q", "end", seq=1))
    assert s.prompt_messages("q") == [{"role": "user", "content": "first end"}]


@pytest.mark.parametrize("fragments, reason", [
    ([Fragment("q", seq=1, chunk=Chunk(TEXT, b"x"), has_metadata=True)], "metadata in fragment 1"),
    ([text("q", "a"), text("q", "b", seq=1)], "after its final fragment"),
    ([text("q", "b", seq=2, continued=True), text("q", "a", continued=False)], "is final but fragment 2"),
    ([Fragment("q", chunk=Chunk(TEXT, b"x"))], "must carry the chunk's metadata"),
    ([parent("p", "q", continued=True), text("p", "x", seq=1)], "both a leaf and a parent"),
    ([parent("p", "p")], "lists itself"),
    ([Fragment("", chunk=Chunk(TEXT, b"x"), has_metadata=True)], "without an id"),
    ([Fragment("q", chunk=Chunk(TEXT, ref="https://example.com/x"), has_metadata=True)], "only file://"),
    ([Fragment("q", chunk=Chunk(TEXT, ref="file:///etc/passwd"), has_metadata=True)], "refused"),
])
def test_a_fragment_that_breaks_a_rule_aborts(fragments: list[Fragment], reason: str) -> None:
    s = NodeStore()
    with pytest.raises(Abort, match=reason):
        for f in fragments:
            s.receive(f)


def test_file_references_only_under_the_allowed_directory(tmp_path: Path) -> None:
    (tmp_path / "part1").write_text("Hello, ")
    (tmp_path / "part2").write_text("world.")
    s = NodeStore(allow_file_refs=tmp_path)
    s.receive(Fragment("q", continued=True, chunk=Chunk(TEXT, ref=f"file://{tmp_path}/part1"), has_metadata=True))
    s.receive(Fragment("q", seq=1, chunk=Chunk(TEXT, ref=f"file://{tmp_path}/part2")))
    assert s.prompt_messages("q") == [{"role": "user", "content": "Hello, world."}]
    with pytest.raises(Abort, match="outside the directory"):
        s.receive(Fragment("r", chunk=Chunk(TEXT, ref=f"file://{tmp_path}/../escape"), has_metadata=True))


def test_cycles_nesting_and_size_are_bounded() -> None:
    s = NodeStore()
    s.receive(parent("a", "b"))
    s.receive(parent("b", "a"))
    with pytest.raises(Abort, match="contains itself"):
        s.complete("a")
    deep = NodeStore()
    for i in range(70):
        deep.receive(parent(f"n{i}", f"n{i + 1}"))
    deep.receive(text("n70", "x"))
    with pytest.raises(Abort, match="deeper than"):
        deep.complete("n0")
    small = NodeStore(max_bytes=10)
    with pytest.raises(Abort, match="passed 10 bytes"):
        small.receive(text("q", "x" * 11))


def test_an_output_id_must_be_new_and_only_the_server_writes_it() -> None:
    s = NodeStore()
    s.receive(text("q", "hi"))
    with pytest.raises(Abort, match="not new"):
        s.check_action(generate("q", "q"))  # a node the session has
    s.check_action(generate("q", "r1"))
    with pytest.raises(Abort, match="not new"):
        s.check_action(generate("q", "r1"))  # an output given before
    with pytest.raises(Abort, match="only the server writes it"):
        s.receive(text("r1", "forged"))
    with pytest.raises(Abort, match="not served"):
        s.check_action(Action("TRANSLATE", (("prompt", "q"),), (("response", "r9"),)))
    with pytest.raises(Abort, match="takes one input"):
        s.check_action(Action("GENERATE", (("image", "q"),), (("response", "r9"),)))


def test_a_prompt_of_other_media_or_without_the_users_text_is_refused() -> None:
    s = NodeStore()
    s.receive(Fragment("v", chunk=Chunk("video/mp4", b"\0\0"), has_metadata=True))
    with pytest.raises(Abort, match="reads text/plain only"):
        s.prompt_messages("v")
    s.receive(eot("e"))
    with pytest.raises(Abort, match="nothing to answer"):
        s.prompt_messages("e")


# --- actions on a daemon ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    d = DaemonProcess(tmp_path_factory.mktemp("evergreen"), "memory", None, "--model", "/models/ref",
                      "--model-name", "ref")
    with d.start(wait_state=("Ready",)):
        pool = ClientPool(lambda: Client(d.endpoint, timeout_s=120))
        try:
            yield Serving(pool, HttpSettings(data_dir=d.tmp / "data"))
        finally:
            pool.close()


def _drain(session: EvergreenSession, messages: list[Fragment | Action]) -> list[Fragment]:
    async def run() -> list[Fragment]:
        out: list[Fragment] = []
        for m in messages:
            out += [f async for f in session.take(m)]
        return out

    return anyio.run(run)


def test_two_turns_the_second_warm(serving: Serving) -> None:
    session = EvergreenSession(serving)
    # the action first, its prompt after (the receiver must wait for it)
    first = _drain(session, [generate("prompt_1", "response_1", max_tokens=8, temperature=0),
                             parent("prompt_1", "question_1"),
                             text("question_1", "Name three primes and say why each is prime.")])
    assert first and first[0].seq == 0 and first[0].has_metadata and first[0].chunk is not None
    assert [f.seq for f in first] == list(range(len(first))) and not first[-1].continued
    assert all(f.continued for f in first[:-1]) and all(f.id == "response_1" for f in first)
    reply = b"".join(f.chunk.data for f in first if f.chunk is not None).decode()
    assert reply and session.usage["response_1"]["completion_tokens"] >= 1
    second = _drain(session, [generate("prompt_2", "response_2", max_tokens=4, temperature=0),
                              parent("prompt_2", "prompt_1", "response_1", "question_2"),
                              text("question_2", "And one more?")])
    assert second and not second[-1].continued
    u1, u2 = session.usage["response_1"], session.usage["response_2"]
    # the conversation the daemon held (the first prompt and its reply) was reused: only the question is new
    assert u2["reused_tokens"] >= u1["prompt_tokens"] + u1["completion_tokens"] - 2, (u1, u2)
    assert u2["prefilled_tokens"] < u2["prompt_tokens"] - u1["prompt_tokens"], (u1, u2)


def test_a_failed_action_aborts(serving: Serving) -> None:
    session = EvergreenSession(serving)
    with pytest.raises(Abort, match="config keys"):
        _drain(session, [generate("p", "r", colour="blue")])
    with pytest.raises(Abort, match="GENERATE failed"):
        _drain(session, [generate("p2", "r2", max_tokens=-1), text("p2", "hi")])
