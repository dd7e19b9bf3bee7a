"""Evergreen over gRPC (``--grpc``) through a real daemon process on both engines, driven by
``runtime.evergreen.EvergreenClient`` over grpcio: the seed's examples (the second turn warm, a prompt streamed
with ``continued``, ``EndOfTurn``), the protocol's error rules, a killed client, the API key."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
grpc = pytest.importorskip("grpc")

from harness.daemon import free_port  # noqa: E402
from runtime.evergreen import EvergreenClient  # noqa: E402
from tests.test_metrics import samples  # noqa: E402
from tests.test_openai_front import Front  # noqa: E402
from tests.test_ws import killed_client  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = "eg-key"


class GrpcFront(Front):
    grpc_port = 0


@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.llama),
                                        pytest.param("openvino", marks=pytest.mark.openvino)])
def front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcFront]:
    pytest.importorskip("llama_cpp" if request.param == "llama" else "openvino_genai")
    port = free_port()
    with GrpcFront(tmp_path_factory.mktemp(f"eg-{request.param}"), "--num-ctx", "4096", "--api-key", API_KEY,
                   "--grpc", f"127.0.0.1:{port}", backend=request.param) as f:
        f.grpc_port = port
        yield f


def _client(front: GrpcFront, key: str = API_KEY) -> EvergreenClient:
    return EvergreenClient(f"127.0.0.1:{front.grpc_port}", api_key=key, timeout_s=300)


def _usage(front: GrpcFront, output: str) -> dict[str, int]:
    line = front.daemon.wait_lines(lambda ln: f"evergreen GENERATE {output} " in ln)[-1]
    return {k: int(v) for k, v in re.findall(r"(\w+_tokens)=(\d+)", line)}


def _prefilled(front: GrpcFront) -> float:
    with front.daemon.client(timeout_s=10.0) as d:
        return samples(d.metrics()).get(("modeld_prompt_tokens_total", (("kind", "prefilled"),)), 0.0)


def test_the_second_turn_prefills_only_its_question(front: GrpcFront) -> None:
    with _client(front) as c:
        s = c.session()
        # the action before its prompt, the prompt's parent before its child: the server waits for them
        s.send(s.generate("prompt_1", "response_1", {"max_tokens": 16, "temperature": 0}),
               s.parent("prompt_1", "question_1"),
               s.text("question_1", "List three prime numbers and say why each is prime."))
        first = s.output("response_1")
        frags = s.received["response_1"]
        assert first and frags[0].chunk_fragment.metadata.mimetype == "text/plain"
        assert all(not f.chunk_fragment.HasField("metadata") for f in frags[1:])
        assert [f.seq for f in frags] == list(range(len(frags))) and not frags[-1].continued
        before = _prefilled(front)
        s.send(s.generate("prompt_2", "response_2", {"max_tokens": 8, "temperature": 0}),
               s.parent("prompt_2", "prompt_1", "response_1", "question_2"),
               s.text("question_2", "Which of them is the largest?"))
        assert s.output("response_2")
        s.close()
    u1, u2 = _usage(front, "response_1"), _usage(front, "response_2")
    # the first prompt and the model's own reply were resident: only the question (and its template glue) is new
    assert u2["reused_tokens"] >= u1["prompt_tokens"] + u1["completion_tokens"] - 2, (u1, u2)
    assert u2["prefilled_tokens"] < u2["prompt_tokens"] - u1["prompt_tokens"], (u1, u2)
    assert _prefilled(front) - before == u2["prefilled_tokens"]


def test_a_prompt_streamed_with_continued_and_end_of_turn(front: GrpcFront) -> None:
    """The seed's last example: prompt_1 comes in two fragments, the second naming the EndOfTurn marker, and a
    duplicate of a fragment is ignored."""
    with _client(front) as c:
        s = c.session()
        s.send(s.generate("prompt_1", "response_1", {"max_tokens": 8, "temperature": 0}),
               s.parent("prompt_1", "prompt_1_text", continued=True),
               s.text("prompt_1_text", "Write a heroic novel about a half-eaten jam doughnut."),
               s.parent("prompt_1", "nothing_of_this", continued=True),  # seq 0 again: ignored
               s.parent("prompt_1", "prompt_1_eot", seq=1),
               s.end_of_turn("prompt_1_eot"))
        assert s.output("response_1")
        s.close()
    assert _usage(front, "response_1")["completion_tokens"] >= 1


@pytest.mark.parametrize("case, code, words", [
    ("metadata past seq 0", "INVALID_ARGUMENT", "metadata in fragment 1"),
    ("a reused output id", "INVALID_ARGUMENT", "not new"),
    ("a fragment past the final one", "INVALID_ARGUMENT", "after its final fragment"),
    ("a file reference", "INVALID_ARGUMENT", "file references are refused"),
    ("a failed action", "INVALID_ARGUMENT", "GENERATE failed"),
])
def test_a_broken_rule_aborts_the_session_with_a_status(front: GrpcFront, case: str, code: str, words: str) -> None:
    with _client(front) as c:
        s = c.session()
        if case == "metadata past seq 0":
            bad = s.text("q", "more", seq=1)
            bad.node_fragment.chunk_fragment.metadata.mimetype = "text/plain"
            s.send(s.text("q", "first", continued=True), bad)
        elif case == "a reused output id":
            s.send(s.text("q", "hi"), s.generate("q", "r", {"max_tokens": 2}))
            s.output("r")
            s.send(s.generate("q", "r"))
        elif case == "a fragment past the final one":
            s.send(s.text("q", "done"), s.text("q", "late", seq=1))
        elif case == "a file reference":
            ref = s.text("q", "")
            ref.node_fragment.chunk_fragment.ref = "file:///etc/hostname"
            s.send(ref)
        else:
            s.send(s.text("q", "hi"), s.generate("q", "r", {"max_tokens": -1}))
        with pytest.raises(grpc.RpcError) as err:
            s.output("never")
        assert err.value.code().name == code, err.value.details()
        assert words in err.value.details()
    # the daemon serves the next session
    with _client(front) as c:
        s = c.session()
        s.send(s.text("ok", "Say hi."), s.generate("ok", "ok_out", {"max_tokens": 2, "temperature": 0}))
        assert s.output("ok_out") is not None
        s.close()


def test_the_api_key_is_required(front: GrpcFront) -> None:
    with _client(front, "wrong") as c:
        s = c.session()
        s.send(s.text("q", "hi"))
        with pytest.raises(grpc.RpcError) as err:
            s.output("r")
        assert err.value.code().name == "UNAUTHENTICATED"


_KILLED = """
import sys
from runtime.evergreen import EvergreenClient
c = EvergreenClient(sys.argv[1], api_key=sys.argv[2])
s = c.session()
s.send(s.text("q", "Write a long story about a lighthouse keeper."),
       s.generate("q", "long_story", {"max_tokens": 2000, "temperature": 0}))
while True:
    m = next(s._replies)
    print("fragment", flush=True)
"""


def test_a_killed_client_frees_the_slot(front: GrpcFront) -> None:
    assert killed_client(front, _KILLED, f"127.0.0.1:{front.grpc_port}", API_KEY) == "fragment"
    line = front.daemon.wait_lines(lambda ln: "evergreen GENERATE long_story " in ln)[-1]
    assert "finish=cancelled error=client_gone" in line, line
