"""Several sessions at once, in the daemon as a real process: ``serve --sessions N`` on an engine whose models serve
that many (``backends.lanes``). The memory backend stands in for the vLLM engine here (its lanes are the same
class), so the daemon's part is tested on every run: the model workers, the waiting opens, status, and the HTTP
front's turns side by side; ``tests/test_vllm_engine.py`` runs the same against a vLLM server.

Nothing here measures time: each check is an order of events (a short turn ends while a long one is still
streaming), which a one-lane daemon cannot produce whatever the machine's speed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from contract.errors import ModelBusy
from contract.types import DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput
from harness.daemon import wait_until
from runtime import Client
from tests.test_openai_front import Front

#: a decode long enough that the other lane's turns end first on any machine (it is closed, never read to its end)
LONG = 100_000


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    with Front(tmp_path_factory.mktemp("lanes"), "--sessions", "2", "--memory-token-delay-ms", "5",
               "--num-ctx", str(LONG + 4096)) as f:
        yield f


def turn(client: Client, who: str, question: str, max_tokens: int) -> Iterator[str]:
    """A session's turn, its reply streamed: the session stays open until the generator is closed."""
    sess = client.open_session(OpenSessionRequest(client=who, queue_timeout_s=600))
    try:
        m = sess.manifest(profile="lanes")
        sess.ensure_prefix(PrefixInput(text="You are terse.", manifest=m))
        sess.prefill_suffix(SuffixInput(text=question, manifest=m))
        for chunk in sess.decode(DecodeConfig(max_tokens=max_tokens, temperature=0.0)):
            yield chunk.text
    finally:
        sess.close()


def test_two_sessions_decode_at_once_and_a_third_waits_for_a_lane(front: Front) -> None:
    """Two clients' decodes stream at the same time (the short one ends while the long one streams); a third
    client's open with no queue time is ModelBusy, one that waits goes in when a lane frees; status counts them."""
    with front.daemon.client(timeout_s=600) as a, front.daemon.client(timeout_s=600) as b, \
            front.daemon.client(timeout_s=600) as c:
        long = turn(a, "agent-a", " Tell me everything.", LONG)
        assert next(long) is not None  # a's decode streams
        short = "".join(turn(b, "agent-b", " Hi.", 4))
        assert short  # b's turn ran to its end beside a's
        st = a.status()
        assert (st.session_lanes, st.sessions_open, st.busy_operation) == (2, 1, "decode")

        held = turn(b, "agent-b", " Hold on.", LONG)
        next(held)
        st = c.status()
        assert st.sessions_open == 2
        # each session's own turn: both decoding, whose each is
        assert sorted((t.client, t.phase, t.operation) for t in st.turns) == [
            ("agent-a", "decode", "decode"), ("agent-b", "decode", "decode")], st.turns
        assert st.turn is not None and st.turn.session_id == st.turns[0].session_id
        with pytest.raises(ModelBusy):
            c.open_session(OpenSessionRequest(queue_timeout_s=0))
        opened = threading.Event()
        failed: list[BaseException] = []

        def waits() -> None:
            try:
                c.open_session(OpenSessionRequest(queue_timeout_s=600)).close()
                opened.set()
            except BaseException as exc:
                failed.append(exc)

        waiter = threading.Thread(target=waits)
        waiter.start()
        with front.daemon.client(timeout_s=60) as watcher:  # (c is the waiter's, busy in its open)
            wait_until(lambda: watcher.status().waiting == 1, "the third open waiting for a lane")
        assert not opened.is_set()  # no lane is free: it waits, as long as it takes
        long.close()  # a's session goes: its lane is the waiter's
        waiter.join(timeout=600)
        assert opened.is_set(), failed
        held.close()
        assert c.status().sessions_open == 0


def test_every_front_serves_a_turn_while_another_streams(front: Front) -> None:
    """A streamed chat completion holds one lane; a request of each API (chat completions, Messages, Responses)
    and a WebSocket generation are answered on the other while it still streams."""
    import anthropic

    from runtime.ws import WsClient

    sdk = front.sdk()
    stream = sdk.chat.completions.create(model="ref", messages=[{"role": "user", "content": "Go on for ever."}],
                                         max_tokens=LONG, stream=True)
    try:
        first = next(iter(stream))
        assert first.choices
        reply = sdk.chat.completions.create(model="ref", messages=[{"role": "user", "content": "Hi."}], max_tokens=3)
        assert reply.choices[0].message.content and reply.choices[0].finish_reason == "length"
        messages = anthropic.Anthropic(base_url=f"http://127.0.0.1:{front.port}", api_key="none", max_retries=0,
                                       timeout=600)
        try:
            said = messages.messages.create(model="ref", max_tokens=3, messages=[{"role": "user", "content": "Hi."}])
        finally:
            messages.close()
        assert said.content and said.stop_reason == "max_tokens"
        response = sdk.responses.create(model="ref", input="Hi.", max_output_tokens=3)
        assert response.output_text and response.status == "incomplete"
        with WsClient(f"ws://127.0.0.1:{front.port}/v1/ws", timeout_s=600.0) as ws:
            done = ws.generate(prompt="Hi.", max_tokens=3, temperature=0)
        assert done["usage"]["completion_tokens"] == 3
        with front.daemon.client(timeout_s=60) as c:
            assert c.status().busy_operation == "decode"  # the first still streams
    finally:
        stream.close()


def test_an_open_that_switches_the_model_waits_for_every_session(front: Front) -> None:
    """A lane is free, but an open naming another model must switch it, which needs every session closed: it
    waits in line (as on a one-lane slot) instead of being refused at once, and switches when the last one goes."""
    other = OpenSessionRequest(model_name="other", path="/models/other", type="memory", switch=True,
                               queue_timeout_s=600)
    back = OpenSessionRequest(model_name="ref", path="/models/ref", type="memory", switch=True, queue_timeout_s=600)
    with front.daemon.client(timeout_s=600) as a, front.daemon.client(timeout_s=600) as c, \
            front.daemon.client(timeout_s=60) as watcher:
        held = a.open_session(OpenSessionRequest(client="agent-a"))
        switched: list[str] = []
        failed: list[BaseException] = []

        def switches() -> None:
            try:
                sess = c.open_session(other)
                switched.append(c.status().active.model_name)  # type: ignore[union-attr]
                sess.close()
            except BaseException as exc:
                failed.append(exc)

        t = threading.Thread(target=switches)
        t.start()
        wait_until(lambda: watcher.status().waiting == 1, "the switching open waiting for the sessions to close")
        assert not switched and not failed and watcher.status().active.model_name == "ref"  # type: ignore[union-attr]
        held.close()
        t.join(timeout=600)
        assert switched == ["other"], failed
        a.open_session(back).close()  # (the other tests' model again)
        assert watcher.status().active.model_name == "ref"  # type: ignore[union-attr]
