"""A streamed request that waits for the slot (modeld/front/queued.py): past ``--http-stream-grace`` its stream
starts and keeps the client alive while it waits, and what the wait ends in (the turn, or the queue's timeout)
reaches the official SDKs as the reply or as the error they raise.

The daemon is a real process on the reference backend: what is tested is the front's handling of the wait, the
same on every engine. Another client holds the slot (an open session), so the wait lasts exactly as long as the
test says."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from contract.types import OpenSessionRequest  # noqa: E402
from harness.daemon import wait_until  # noqa: E402

from .test_openai_front import SYSTEM, Front  # noqa: E402

APIS = ("chat", "completions", "responses", "messages")
USER = "Name three colours."


class Reader(threading.Thread):
    """Reads one API's stream through its official SDK: every event the SDK yields, with when it came, and the
    text the reply assembles (or the error the SDK raised)."""

    def __init__(self, front: Front, api: str) -> None:
        super().__init__(daemon=True)
        self.api = api
        self.events: list[tuple[float, Any]] = []
        self.text = ""
        self.error: Exception | None = None
        self.opened = threading.Event()
        self._oa = openai.OpenAI(base_url=front.url, api_key="none", max_retries=0, timeout=120)
        self._an = anthropic.Anthropic(base_url=front.url.removesuffix("/v1"), api_key="none", max_retries=0,
                                       timeout=120)

    def _open(self) -> Any:
        if self.api == "chat":
            return self._oa.chat.completions.create(model="ref", messages=[SYSTEM, {"role": "user", "content": USER}],
                                                    max_tokens=6, temperature=0, stream=True)
        if self.api == "completions":
            return self._oa.completions.create(model="ref", prompt=USER, max_tokens=6, temperature=0, stream=True)
        if self.api == "responses":
            return self._oa.responses.create(model="ref", input=USER, instructions=SYSTEM["content"],
                                             max_output_tokens=6, temperature=0, stream=True)
        return self._an.messages.create(model="ref", system=SYSTEM["content"], max_tokens=6, stream=True, extra_body={"temperature": 0},
                                        messages=[{"role": "user", "content": USER}])

    def run(self) -> None:
        try:
            stream = self._open()  # returns once the response's headers came
            self.opened.set()
            for event in stream:
                self.events.append((time.monotonic(), event))
                self.text += _text_of(self.api, event)
        except Exception as exc:  # what the SDK raised, for the test to read
            self.error = exc
        finally:
            self.opened.set()
            self._oa.close()
            self._an.close()


def _text_of(api: str, event: Any) -> str:
    if api == "chat":
        return "".join(c.delta.content or "" for c in event.choices)
    if api == "completions":
        return "".join(c.text for c in event.choices)
    if api == "responses":
        return event.delta if event.type == "response.output_text.delta" else ""
    return event.delta.text if event.type == "content_block_delta" and event.delta.type == "text_delta" else ""


def _says_queued(api: str, event: Any) -> bool:
    """The event is a keep-alive sent while the request waited for the slot (``queued``, an extension field the
    SDKs keep as an extra)."""
    if api in ("chat", "completions", "responses"):
        return bool((event.model_extra or {}).get("queued"))
    return False  # Messages waits with pings, which the SDK does not yield


def _plain(front: Front, api: str) -> str:
    """The same request's reply when it does not wait: what the waiting one must assemble."""
    r = Reader(front, api)
    r.run()
    assert r.error is None, r.error
    return r.text


def test_a_streamed_request_that_waits_starts_its_stream_and_keeps_its_client_alive(tmp_path: Path) -> None:
    with Front(tmp_path, "--http-stream-grace", "0.2") as f:
        expected = {api: _plain(f, api) for api in APIS}
        assert all(expected.values()), expected
        with f.daemon.client(timeout_s=30.0) as holder:
            session = holder.open_session(OpenSessionRequest())  # another agent holds the slot
            readers = {api: Reader(f, api) for api in APIS}
            for r in readers.values():
                r.start()
                assert r.opened.wait(60) and r.error is None, r.error  # the headers came while the slot is held
            assert holder.status().waiting == len(APIS)
            # each keep-alive kind the SDKs yield comes while the requests wait (every KEEPALIVE_S)
            wait_until(lambda: all(any(_says_queued(a, e) for _, e in readers[a].events)
                                   for a in ("chat", "completions", "responses")), "a keep-alive while queued", 60)
            assert not any(r.text for r in readers.values())
            released = time.monotonic()
            session.close()
            for r in readers.values():
                r.join(120)
        for api, r in readers.items():
            assert r.error is None, (api, r.error)
            assert r.text == expected[api], api  # the wait changed nothing in the reply
            assert all(t >= released for t, e in r.events if not _says_queued(api, e) and _text_of(api, e)), api
        assert readers["responses"].events[0][1].type == "response.created"  # the order the API documents
        assert readers["messages"].events[0][1].type == "message_start"  # (after the slot: it carries the prompt)
        assert readers["messages"].events[0][0] >= released


def test_a_streamed_request_whose_wait_times_out_ends_with_the_error_its_sdk_raises(tmp_path: Path) -> None:
    with Front(tmp_path, "--http-stream-grace", "0.2", "--http-queue-timeout", "2") as f:
        with f.daemon.client(timeout_s=30.0) as holder:
            session = holder.open_session(OpenSessionRequest())
            readers = {api: Reader(f, api) for api in APIS}
            for r in readers.values():
                r.start()
            for r in readers.values():
                r.join(60)
            session.close()
        for api, r in readers.items():
            assert r.opened.is_set() and not r.text, api
            err = r.error
            if api == "messages":
                assert isinstance(err, anthropic.APIStatusError), (api, err)
                assert err.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
            else:
                assert isinstance(err, openai.APIError), (api, err)
                assert "queue" in str(err).lower(), (api, err)
        # the daemon goes on serving: the same requests, the slot free, answer
        assert all(_plain(f, api) for api in APIS)
