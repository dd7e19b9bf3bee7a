"""The front's core without a daemon: a turn's step when its route is cancelled (``next_event``: the turn is cancelled and
the step ends, whenever the cancel comes, so a client that goes away never leaves the slot held), and the conversation
a request's headers name."""

from __future__ import annotations

import threading
from collections.abc import Generator

import anyio
import pytest

pytest.importorskip("fastapi")

from modeld.front.core import next_event  # noqa: E402
from runtime.chat import ChatEvent  # noqa: E402


class _Turn:
    """What ``next_event`` calls on the chat turn: ``cancel``, which ends the events that wait for it."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def _events(chat_turn: _Turn) -> Generator[ChatEvent, None, None]:
    """A decode that streams until it is cancelled."""
    while not chat_turn.cancelled.wait(0.001):
        yield ChatEvent(text="x")


@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_a_step_cancelled_at_any_moment_ends_and_cancels_the_turn(delay_s: float) -> None:
    # delay 0: the cancel comes in the same turn of the loop, before a worker thread took the step (anyio then
    # never runs it); 0.05 s: the step runs in its thread, and the cancel stops the decode it waits on
    async def one() -> bool:
        chat_turn = _Turn()
        events = _events(chat_turn)
        with anyio.CancelScope() as scope:
            async def cancel_soon() -> None:
                if delay_s:
                    await anyio.sleep(delay_s)
                scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_soon)
                while True:
                    await next_event(events, chat_turn.cancel)
        events.close()  # (after the step's thread gave the generator back: it raises if that thread still runs)
        return chat_turn.cancelled.is_set()

    async def many() -> None:
        for _ in range(100 if not delay_s else 5):
            assert await one()

    # in a thread of its own, so a step that waits for ever (for a thread that never runs) fails the test instead
    # of hanging it: the wait is shielded from any cancel, as it must be while a step runs
    failure: list[BaseException] = []

    def run() -> None:
        try:
            anyio.run(many)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            failure.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(120)
    assert not runner.is_alive(), "a cancelled step never ended: the slot it holds would stay held"
    assert not failure, failure


def test_the_conversation_a_request_continues_is_the_most_specific_id_its_headers_name() -> None:
    from modeld.front.core import conversation_of

    claude_main = {"x-claude-code-session-id": "s1", "user-agent": "claude-cli"}
    claude_sub = {**claude_main, "x-claude-code-agent-id": "a7"}
    assert conversation_of(claude_main) == "s1"
    assert conversation_of(claude_sub) == "a7"  # a sub-agent is its own conversation within the session
    assert conversation_of({"session-id": "t", "thread-id": "t"}) == "t"  # Codex
    assert conversation_of({"x-session-id": "ses_1"}) == "ses_1"  # OpenCode
    assert conversation_of({"x-claude-code-agent-id": "  ", "x-session-id": "ses_2"}) == "ses_2"  # blank: not an id
    assert conversation_of({}) == ""
    assert len(conversation_of({"thread-id": "x" * 1000})) == 256  # as long as the contract's field allows
