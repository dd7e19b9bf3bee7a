"""``modeld metrics`` and the HTTP front's ``/metrics`` (``modeld.metrics``), against a real daemon process.

The text must parse with ``prometheus_client``'s own parser, and the counters
must move with the turns the daemon serves.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from contract.errors import ModeldError
from contract.wire import Op
from harness.daemon import ROOT
from runtime import Client
from tests.test_openai_front import Front

SYSTEM = {"role": "system", "content": "You are a terse coding assistant."}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    with Front(tmp_path_factory.mktemp("metrics")) as f:
        yield f


def test_counters_move_with_the_turns(front: Front) -> None:
    with front.daemon.client(timeout_s=30.0) as c:
        before = samples(c.metrics())
        history = [SYSTEM, {"role": "user", "content": "What does slot.py do?"}]
        first = c.chat(history, max_tokens=6)
        history += [{"role": "assistant", "content": first.message.content}, {"role": "user", "content": "And?"}]
        c.chat(history, max_tokens=6)
        with pytest.raises(ModeldError):  # refused by the daemon: counted as an error of its operation
            c.call(Op.DECODE, {"session_id": "nope", "max_tokens": 4})
        after = samples(c.metrics())

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("modeld_requests_total", op="decode") == 3  # two turns and the refused one
    assert grew("modeld_requests_total", op="open") >= 2
    assert grew("modeld_decoded_tokens_total") == 12
    assert grew("modeld_prompt_tokens_total", kind="prefilled") > 0
    assert grew("modeld_prompt_tokens_total", kind="reused") > 0  # the second turn reused the first
    assert grew("modeld_time_to_first_token_seconds_count") == 2
    assert grew("modeld_errors_total", op="decode", error="SessionClosed") == 1
    assert after[("modeld_slot_state", (("state", "Ready"),))] == 1
    assert 0 < after[("modeld_reuse_ratio", ())] < 1
    assert after[("modeld_process_rss_bytes", ())] > 10 * 2**20


def test_the_cli_and_the_http_front_serve_the_same_text(front: Front) -> None:
    out = subprocess.run([sys.executable, "-m", "modeld", "metrics", "--endpoint", front.daemon.endpoint],
                         capture_output=True, text=True, cwd=ROOT, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and ("modeld_requests_total", (("op", "status"),)) in samples(out.stdout)
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read().decode()
    finally:
        conn.close()
    assert resp.status == 200 and resp.getheader("content-type", "").startswith("text/plain; version=0.0.4")
    assert ("modeld_slot_state", (("state", "Ready"),)) in samples(body)


def test_a_memory_daemon_has_no_cache_metrics(front: Front) -> None:
    with Client(front.daemon.endpoint, timeout_s=10.0) as c:
        names = {name for name, _ in samples(c.metrics())}
    assert "modeld_cache_bytes" not in names  # the memory backend has no workspace cache
