"""A turn never outlives its client: the disconnect sweep (``tests.turn_sweep``) on llama.cpp, one instant per API
and mode, with two CPU-bound processes beside the daemon (a loaded machine); and what a person sees and does
about the turn that holds the slot (``status``, ``modeld cancel``).

The daemon serves the bundled model cut to its first two blocks (``harness.fixtures.shallow_gguf``): the sweep
is about the turn's lifetime, not the model's answers, and on the whole model the loaded machine's compute made it
the suite's longest test (167 s; 30 s so). ``make soak`` runs the same sweep with many instants on the bundled
model (``python -m tests.soak_daemon --sweep N``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llama_cpp")

from harness.load import cpu_burners  # noqa: E402
from tests.test_openai_front import Front  # noqa: E402
from tests.turn_sweep import MODES, PHASES, SERVE_ARGS, Sweep, plan  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.llama]

#: instants per API and mode in the suite (every phase is hit: they rotate); ``make soak`` runs many more
PER_MODE = int(os.environ.get("MODELD_SWEEP_PER_MODE", "1"))
#: the model the daemon serves: "shallow" (``harness.fixtures.shallow_gguf``: the bundled model's first two blocks,
#: so a chunk costs its delay rather than its compute on a loaded machine) or "bundled"
MODEL = os.environ.get("MODELD_SWEEP_MODEL", "shallow")


@pytest.fixture(scope="module")
def loaded() -> Iterator[None]:
    """Two CPU-bound processes for the module's whole run: the machine of a user with other work going on."""
    with cpu_burners(2):
        yield


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, loaded: None) -> Iterator[Front]:
    from harness.fixtures import shallow_gguf

    model = () if MODEL == "bundled" else ("--model", str(shallow_gguf()))
    with Front(tmp_path_factory.mktemp("lifetime"), *SERVE_ARGS, *model, backend="llama") as f:
        yield f


def test_the_plan_hits_every_phase_on_every_api() -> None:
    cases = plan(1)
    assert {c.phase for c in cases} == set(PHASES)
    assert {(c.api, c.stream) for c in cases} == set(MODES)


def test_a_client_gone_at_any_instant_of_its_turn_frees_the_slot_and_loses_nothing(front: Front) -> None:
    sweep = Sweep(front.daemon, front.port)
    outcomes = []
    try:
        for case in plan(PER_MODE):
            outcomes.append(sweep.run(case))
    finally:
        sweep.close()
    report = "\n".join(o.line() for o in outcomes)
    print(report)  # (shown with -s, and in the failure below)
    assert all(o.ok for o in outcomes), report


def test_status_shows_the_running_turn_and_modeld_cancel_ends_it(front: Front) -> None:
    """A person sees what holds the slot (the client's route and address, the phase, how far it came) and ends
    it with ``modeld cancel``: the prefill stops, keeping its chunks, and the next client is served."""
    sweep = Sweep(front.daemon, front.port)
    try:
        sweep.wait_free()
        from tests.turn_sweep import CHUNK, PREFIX_CHUNKS, _text

        system = _text(PREFIX_CHUNKS, "cancelled")
        body = sweep.body("chat", system, "hi", stream=True, reply={"max_tokens": 8, "temperature": 0.0, "seed": 1})
        leave, who = sweep.send("chat", body)
        try:
            st = sweep.wait("the turn prefilling", lambda s: s.turn is not None and s.turn.phase == "prefill"
                            and s.turn.client.endswith(f" from {who}") and s.turn.done >= 3 * CHUNK)
            turn = st.turn
            assert turn is not None and turn.client.startswith("POST /v1/chat/completions from 127.0.0.1:")
            assert turn.operation == "ensure_prefix" and turn.reused <= turn.done <= turn.total and turn.age_s >= 0
            from runtime.cli import main, status_text

            assert "modeld cancel ends it" in status_text(st)
            t0 = time.monotonic()
            assert main(["cancel", "--endpoint", front.daemon.endpoint]) == 0
            sweep.wait_free(timeout_s=60.0)
            freed = time.monotonic() - t0
            assert freed < 30.0, freed  # (a ceiling: the prefill stops at its next chunk)
            assert "modeld cancel: ended the turn of session" in front.daemon.log()
            with front.daemon.client(timeout_s=10.0) as c:
                assert c.cancel_turn().session_id == ""  # nothing holds the slot now
            # what the cancelled prefill computed stays: the same request again finds it
            prompt, cached = sweep.cached("chat", sweep.complete("chat", {**body, "max_tokens": 1}))
            assert cached >= turn.done - CHUNK, (cached, turn.done)
        finally:
            leave()
    finally:
        sweep.close()
