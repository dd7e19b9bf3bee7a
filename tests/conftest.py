from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from backends.tape.draft_costs import FIXED_ENV as FIXED_DRAFT_COSTS_ENV
from tests.engine_kit import DEAR_CHECKS


def _pin_to_a_share_of_the_cpus() -> None:
    """Under pytest-xdist, each worker runs on its own share of the CPUs this run may use, and so do the daemons it
    starts (they inherit the mask, and the engines size their threads by it). Two workers each running an engine
    with a thread per core would put twice the threads on the cores, and llama.cpp's threads spin at every barrier
    of a step: a test beside another on two cores took 3 to 13 times as long as alone, where a core each costs 2."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    index = int(worker[2:])
    os.sched_setaffinity(0, cpus[index::count] or [cpus[index % len(cpus)]])


_pin_to_a_share_of_the_cpus()
# Tests must never talk to a daemon the developer is running.
os.environ.pop("MODELD_ENDPOINT", None)
os.environ.pop("MODELD_OWNER", None)
# nor read the developer's settings: every MODELD_* variable and the config file are theirs, except the suite's own
# knobs (``make fuzz`` sets the examples of warm equals cold: scrubbed, it ran the suite's 60 instead of thousands)
SUITE_KNOBS = ("MODELD_LLAMA_EXTRA_BUFTS", "MODELD_WARM_COLD_EXAMPLES", "MODELD_WARM_COLD_MODEL", "MODELD_SWEEP_PER_MODE", "MODELD_SWEEP_MODEL", "MODELD_REFERENCE_PYTHON",
               "MODELD_TEST_VLLM_PORT")
for _name in [n for n in os.environ if n.startswith("MODELD_") and n not in SUITE_KNOBS]:
    os.environ.pop(_name)
# Drafts are priced by a fixed check cost table in every model and daemon the suite starts, one by which they never
# pay (``DEAR_CHECKS``): a table timed at load hangs on the CPU and on how busy it is (beside other work it is refused
# as implausible and timed again at the next load, a 2,048-token prefill in the background of every daemon's tests),
# and so would any greedy answer a draft can move. The tests of drafting set ``CHEAP_CHECKS``; those of the timing
# itself unset it.
os.environ[FIXED_DRAFT_COSTS_ENV] = DEAR_CHECKS
os.environ["XDG_CONFIG_HOME"] = _config_home = tempfile.mkdtemp(prefix="modeld-test-config-")
# each run (and each xdist worker) makes its own; leave none behind in the system's temp dir
atexit.register(shutil.rmtree, _config_home, ignore_errors=True)

#: what `make setup` installs and the suites import (or skip without): in CI every one must import, since a
#: skip is for a developer's partial install, and a green run that ran no engine test proves nothing
CI_REQUIRED = ("llama_cpp", "openvino", "openvino_genai", "fastapi", "openai", "anthropic", "hypothesis", "lm_eval",
               "websockets", "grpc")


def pytest_sessionstart(session: object) -> None:
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return
    import importlib

    import pytest

    missing = []
    for name in CI_REQUIRED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure is the finding
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    if missing:
        pytest.exit("CI runs every suite, but these do not import, so their tests would only skip: "
                    + "; ".join(missing), returncode=1)


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a vLLM CPU server on the bundled model, for the vLLM engine's tests: one of the session's own
    (``--dtype float32``: bf16 is several times slower on a CPU without bf16 instructions, and nearer llama.cpp's
    numerics), or the one ``MODELD_TEST_VLLM_PORT`` names (started with ``python -m harness.vllm_server serve --dtype
    float32``: a minute saved per run while working on the engine). Skipped where vLLM's CPU build is not installed
    (``make vllm``; ``make test-vllm`` installs it and runs these tests)."""
    from harness import vllm_server

    if not vllm_server.venv_python().exists() or not (vllm_server.model_dir() / "config.json").is_file():
        pytest.skip("vLLM's CPU build is not installed here (make vllm)")
    port = os.environ.get("MODELD_TEST_VLLM_PORT")
    if port:
        yield f"http://127.0.0.1:{int(port)}"
        return
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with vllm_server.VllmServer(log_path=log, extra_args=("--dtype", "float32")) as s:
        yield s.base_url
