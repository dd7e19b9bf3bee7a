"""Models by name through real daemons: stored models loaded by name, a request naming another one switches the
slot (the official ``openai`` SDK), ``--switch-on-request off`` refuses, ``serve --model REF --pull``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from harness.daemon import ROOT  # noqa: E402
from modeld.store.pull import pull  # noqa: E402
from modeld.store.store import ModelStore  # noqa: E402
from tests.hubstub import Hub, HubServer, Repo  # noqa: E402
from tests.test_openai_front import Front  # noqa: E402

SYSTEM = {"role": "system", "content": "You are a terse coding assistant."}
HI = [SYSTEM, {"role": "user", "content": "hi"}]


def quiet(_: str) -> None:
    pass


def stock(tmp: Path, models: dict[str, Path]) -> ModelStore:
    """The store of the daemon whose data dir is ``tmp/data`` (``DaemonProcess``), with ``models`` linked in."""
    store = ModelStore(tmp / "data" / "models")
    for name, path in models.items():
        pull(store, str(path), name=name, log=quiet)
    return store


def fake_ggufs(tmp: Path, *names: str) -> dict[str, Path]:
    """Files the memory backend 'loads' (it reads no weights): distinct, so their digests differ."""
    out = {}
    for n in names:
        p = tmp / "src" / f"{n}.gguf"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"GGUF" + n.encode() * 64)
        out[n] = p
    return out


def cli(front: Front, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MODELD_ENDPOINT": front.daemon.endpoint,
           "MODELD_DATA_DIR": str(front.daemon.tmp / "data")}
    return subprocess.run([sys.executable, "-m", "modeld", *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)


def status(front: Front) -> object:
    with front.daemon.client(timeout_s=30.0) as c:
        return c.status()


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    tmp = tmp_path_factory.mktemp("two")
    store = stock(tmp, fake_ggufs(tmp, "alpha", "beta"))
    store.set_alias("b", "beta")
    f = Front(tmp, "--memory-token-delay-ms", "5")
    f.daemon.extra[f.daemon.extra.index("/models/ref")] = "alpha"  # serve --model NAME: from the store
    f.daemon.extra[f.daemon.extra.index("ref")] = "alpha"
    with f:
        yield f


def test_models_lists_every_loadable_model_the_loaded_one_first(two: Front) -> None:
    st = status(two)
    assert st.active.model_name == "alpha" and st.active.path.endswith("alpha.gguf")
    assert [m.id for m in two.sdk().models.list()] == ["alpha", "beta", "b"]
    assert st.models["models"] == 2 and st.models["bytes"] > 0
    out = cli(two, "status")
    assert "model store" in out.stdout and "2 models" in out.stdout, out.stdout + out.stderr


def test_a_request_naming_a_stored_model_switches_the_slot_and_answers(two: Front) -> None:
    sdk = two.sdk()
    before = status(two).generation
    out = sdk.chat.completions.create(model="beta", messages=HI, max_tokens=3)
    assert out.model == "beta" and out.choices[0].message.content
    st = status(two)
    assert st.active.model_name == "beta" and st.generation == before + 1
    # its alias, and a name an agent hard-codes, are served by it without another switch
    assert sdk.chat.completions.create(model="b", messages=HI, max_tokens=2).model == "beta"
    assert sdk.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2).model == "beta"
    assert status(two).generation == before + 1
    assert [m.id for m in sdk.models.list()] == ["beta", "alpha", "b"]
    # and back, by the CLI's load by name (no --path)
    out_load = cli(two, "load", "alpha")
    assert out_load.returncode == 0, out_load.stderr
    assert status(two).active.model_name == "alpha"
    unknown = cli(two, "load", "nothing-known")
    assert unknown.returncode == 1 and "alpha" in unknown.stderr and "beta" in unknown.stderr


def test_the_session_holding_the_slot_finishes_before_a_switch(two: Front) -> None:
    sdk = two.sdk()
    sdk.chat.completions.create(model="alpha", messages=HI, max_tokens=1)
    got: dict[str, object] = {}
    started = threading.Event()

    def long_alpha() -> None:
        parts = []
        for chunk in sdk.chat.completions.create(model="alpha", messages=HI, max_tokens=60, stream=True):
            started.set()
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            got["model"] = chunk.model
            if chunk.choices and chunk.choices[0].finish_reason:
                got["finish"] = chunk.choices[0].finish_reason
        got["text"] = "".join(parts)

    t = threading.Thread(target=long_alpha)
    t.start()
    assert started.wait(30)
    switched = sdk.chat.completions.create(model="beta", messages=HI, max_tokens=2)
    t.join(60)
    assert got["model"] == "alpha" and got["finish"] in ("length", "stop") and got["text"]
    assert switched.model == "beta"


def test_ls_and_rm_know_the_loaded_model(two: Front) -> None:
    two.sdk().chat.completions.create(model="beta", messages=HI, max_tokens=1)
    listing = json.loads(cli(two, "ls", "--json").stdout)
    assert {r["name"]: r["loaded"] for r in listing["models"]} == {"alpha": False, "beta": True}
    refused = cli(two, "rm", "beta")
    assert refused.returncode == 1 and "loaded model" in refused.stderr
    forced = cli(two, "rm", "beta", "--force")
    assert forced.returncode == 0, forced.stderr
    st = status(two)
    assert st.active is None and st.models["models"] == 1
    assert [m.id for m in two.sdk().models.list()] == ["alpha"]  # the alias went with it
    # an empty slot: a request naming a stored model loads it
    assert two.sdk().chat.completions.create(model="alpha", messages=HI, max_tokens=1).model == "alpha"


def test_load_ref_pull_fetches_then_loads_by_name(two: Front) -> None:
    hub = Hub(repos={"acme/Third-GGUF": Repo({"third-Q4_0.gguf": b"GGUF" + os.urandom(3000)})})
    with HubServer(hub):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MODELD_ENDPOINT": two.daemon.endpoint,
               "MODELD_DATA_DIR": str(two.daemon.tmp / "data"), "HF_ENDPOINT": hub.url}
        out = subprocess.run([sys.executable, "-m", "modeld", "load", "acme/Third-GGUF:Q4_0", "--pull"],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr
        assert status(two).active.model_name == "third:q4_0"
        again = subprocess.run([sys.executable, "-m", "modeld", "load", "acme/Third-GGUF:Q4_0", "--pull"],
                               capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        assert again.returncode == 0 and len(hub.requests) == 1  # in the store already: nothing fetched again
    ModelStore(two.daemon.tmp / "data" / "models").remove("third:q4_0")


def test_switch_on_request_off_refuses_with_the_names(tmp_path: Path) -> None:
    stock(tmp_path, fake_ggufs(tmp_path, "alpha", "beta"))
    f = Front(tmp_path, "--switch-on-request", "off")
    f.daemon.extra[f.daemon.extra.index("/models/ref")] = "alpha"
    f.daemon.extra[f.daemon.extra.index("ref")] = "alpha"
    with f:
        sdk = f.sdk()
        with pytest.raises(openai.ConflictError) as refused:
            sdk.chat.completions.create(model="beta", messages=HI, max_tokens=2)
        msg = refused.value.message
        assert "--switch-on-request off" in msg and "loaded: alpha" in msg and "beta" in msg
        assert status(f).active.model_name == "alpha"
        assert sdk.chat.completions.create(model="alpha", messages=HI, max_tokens=1).model == "alpha"


def test_serve_model_ref_pulls_only_when_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = Hub(repos={"acme/Tiny-GGUF": Repo({"tiny-Q8_0.gguf": b"GGUF" + os.urandom(5000)})})
    with HubServer(hub):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.url}
        base = [sys.executable, "-m", "modeld", "serve", "--backend", "llama", "--model", "acme/Tiny-GGUF:Q8_0",
                "--endpoint", f"ipc://{tmp_path / 's.sock'}", "--data-dir", str(tmp_path / "data")]
        out = subprocess.run(base, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
        assert out.returncode == 2 and "modeld pull acme/Tiny-GGUF:Q8_0" in out.stderr and "--pull" in out.stderr
        assert not hub.requests  # nothing was fetched without --pull
        f = Front(tmp_path / "pulled")
        f.daemon.extra[f.daemon.extra.index("/models/ref")] = "acme/Tiny-GGUF:Q8_0"
        f.daemon.extra[f.daemon.extra.index("ref")] = "tiny"
        f.daemon.extra.append("--pull")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with f:
            st = status(f)
            assert st.active.model_name == "tiny"
            assert st.active.path.endswith("tiny-Q8_0.gguf")
            assert [m.id for m in f.sdk().models.list()] == ["tiny", "tiny:q8_0"]
        assert [m.name for m in ModelStore(tmp_path / "pulled" / "data" / "models").models()] == ["tiny:q8_0"]


@pytest.mark.llama
def test_a_real_engine_switches_between_two_stored_models_by_name(tmp_path: Path) -> None:
    """llama.cpp serving the bundled SmolLM2 from the store; a request for the stored Gemma 3 270M switches the
    slot to it and Gemma answers; a broken stored model refused on the way keeps the working model serving."""
    pytest.importorskip("llama_cpp")
    from backends.bundled import bundled_gguf_path, gemma_gguf_path

    smol, gemma = bundled_gguf_path(), gemma_gguf_path()
    broken = tmp_path / "src" / "broken-Q4_1.gguf"
    broken.parent.mkdir(parents=True)
    data = smol.read_bytes()
    broken.write_bytes(data.replace(b"output_norm.weight", b"output_norm.weighX"))  # plans, then llama.cpp refuses
    stock(tmp_path, {"smol": smol, "gemma": gemma, "broken": broken})
    f = Front(tmp_path, backend="llama")
    f.daemon.extra[:0] = ["--model", "smol", "--cache-ram", "0", "--cache-disk", "0"]
    with f:
        sdk = f.sdk()
        assert [m.id for m in sdk.models.list()][:1] == ["smol"]
        ask = [{"role": "user", "content": "Name a colour."}]
        first = sdk.chat.completions.create(model="smol", messages=ask, max_tokens=8, temperature=0)
        assert first.model == "smol" and first.usage.completion_tokens > 0
        other = sdk.chat.completions.create(model="gemma", messages=ask, max_tokens=8, temperature=0)
        st = status(f)
        assert other.model == "gemma" and other.usage.completion_tokens > 0
        assert st.active.model_name == "gemma" and st.active.path.endswith(gemma.name)
        with pytest.raises(openai.InternalServerError, match="ModelLoadFailed"):
            sdk.chat.completions.create(model="broken", messages=ask, max_tokens=4)
        assert status(f).active.model_name == "gemma"
        back = sdk.chat.completions.create(model="smol", messages=ask, max_tokens=8, temperature=0)
        assert back.model == "smol" and back.choices[0].message.content == first.choices[0].message.content


class _Pool:
    """Just enough of ``ClientPool`` for ``Serving.route``: a client whose status is ``st``."""

    def __init__(self, st: object) -> None:
        self.st = st

    def client(self) -> object:
        import contextlib

        pool = self

        class _C:
            def status(self) -> object:
                return pool.st

        return contextlib.nullcontext(_C())


@pytest.mark.parametrize("requested, want", [
    ("SmolLM2.Q4_1.gguf", ("SmolLM2.Q4_1.gguf", True)),   # the loaded model, by its own (mixed-case) name
    ("smollm2.q4_1.gguf", ("SmolLM2.Q4_1.gguf", True)),   # names are matched without case
    ("coder", ("qwen:q4_k_m", True)),                      # a store alias: the model it leads to, switching
    ("Qwen:Q4_K_M", ("qwen:q4_k_m", True)),
    ("gpt-4o", ("SmolLM2.Q4_1.gguf", False)),              # unknown: whatever is loaded, no name sent
    ("", ("SmolLM2.Q4_1.gguf", False)),
])
def test_route_decisions(requested: str, want: tuple[str, bool]) -> None:
    from contract.types import ActiveModel, DaemonStatus, ModelsStatus, SlotState
    from modeld.front.core import Serving
    from modeld.settings import HttpSettings

    st = DaemonStatus(state=SlotState.READY, active=ActiveModel(model_name="SmolLM2.Q4_1.gguf"),
                      models=ModelsStatus(dir="/m", models=1, bytes=1, names=["qwen:q4_k_m", "SmolLM2.Q4_1.gguf"],
                                          aliases={"coder": "qwen:q4_k_m"}))
    route = Serving(_Pool(st), HttpSettings.model_construct(http_queue_timeout=1)).route(requested)  # type: ignore[arg-type]
    assert (route.model, route.switch) == want
