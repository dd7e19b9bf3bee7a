"""The model store and ``modeld pull`` against a stand-in Hub (``tests.hubstub``) reached through ``HF_ENDPOINT``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.daemon import ROOT
from modeld.store import pull as pull_mod
from modeld.store import store as store_mod
from modeld.store.cli import main as store_cli
from modeld.store.pull import PullError, pull
from modeld.store.refs import HubRef, RefError, choices, default_name, parse_ref, pick, quant_of
from modeld.store.store import DOWNLOADS_DIR, ModelStore, StoreError
from tests.hubstub import COMMIT, Hub, HubServer, Repo

REPO = "acme/Coder-1B-GGUF"


def blob(n: int, seed: int) -> bytes:
    return hashlib.shake_256(b"%d" % seed).digest(n)


@pytest.fixture
def hub() -> Hub:
    files = {
        "coder-1b-q4_k_m.gguf": blob(300_000, 1),
        "coder-1b-Q8_0-00001-of-00002.gguf": blob(200_000, 2),
        "coder-1b-Q8_0-00002-of-00002.gguf": blob(150_000, 3),
        "sub/coder-1b-f16.gguf": blob(90_000, 4),
        "README.md": b"# coder\n",
    }
    h = Hub(repos={REPO: Repo(files, license="mit"),
                   "acme/two-q4": Repo({"a-Q4_K_M.gguf": blob(5000, 5), "b-Q4_K_M.gguf": blob(5000, 6)}),
                   "acme/see-GGUF": Repo({"see-Q4_K_M.gguf": blob(6000, 8), "see-Q8_0.gguf": blob(7000, 9),
                                          "mmproj-see-BF16.gguf": blob(3000, 10), "mmproj-see-F16.gguf": blob(3000, 11),
                                          "mmproj-see-F32.gguf": blob(5000, 12)}),
                   "acme/coder-ov": Repo({"openvino_model.xml": b"<net/>", "openvino_model.bin": blob(40_000, 7),
                                          "config.json": json.dumps({"model_type": "llama",
                                                                     "max_position_embeddings": 4096}).encode()})})
    with HubServer(h):
        yield h


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    return ModelStore(tmp_path / "models")


def quiet(_: str) -> None:
    pass


# --- references -------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M", HubRef("Qwen/Qwen2.5-Coder-7B-Instruct-GGUF", quant="Q4_K_M")),
    ("hf.co/bartowski/x-GGUF:iq4_xs", HubRef("bartowski/x-GGUF", quant="iq4_xs")),
    ("a/b/sub/f-Q8_0.gguf", HubRef("a/b", file="sub/f-Q8_0.gguf")),
    ("a/b@v2:Q8_0", HubRef("a/b", quant="Q8_0", revision="v2")),
    ("a/b", HubRef("a/b")),
])
def test_references_parse(text: str, want: HubRef) -> None:
    assert parse_ref(text) == want


@pytest.mark.parametrize("text, says", [
    ("", "empty"), ("justaname", "neither a file"), ("a/b/notes.txt", "not a GGUF"), ("a/b/f.gguf:Q4", "not both"),
    ("a/b@:Q4", "empty revision"),
])
def test_bad_references_say_what_to_write(text: str, says: str) -> None:
    with pytest.raises(RefError, match=says):
        parse_ref(text)


def test_quant_names_and_default_store_names() -> None:
    assert quant_of("Qwen2.5-Coder-7B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_of("x-q4_k_m-00002-of-00003.gguf") == "Q4_K_M"
    assert quant_of("gemma-3-270m-it-UD-IQ2_XXS.gguf") == "IQ2_XXS"
    assert quant_of("model.gguf") == ""
    ref = parse_ref("Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M")
    assert isinstance(ref, HubRef)
    assert default_name(ref) == "qwen2.5-coder-7b-instruct:q4_k_m"


def test_a_quant_matches_whole_names_and_split_parts_are_one_choice() -> None:
    found = choices({"m-Q4_K_M.gguf": 1, "m-Q4_K_M_L.gguf": 2, "m-Q8_0-00001-of-00002.gguf": 3,
                     "m-Q8_0-00002-of-00002.gguf": 4, "README.md": 5})
    assert [(c.quant, c.files) for c in found] == [
        ("Q4_K_M", ("m-Q4_K_M.gguf",)), ("Q4_K_M_L", ("m-Q4_K_M_L.gguf",)),
        ("Q8_0", ("m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"))]
    assert pick(found, HubRef("u/m", quant="q4_k_m")).files == ("m-Q4_K_M.gguf",)
    assert pick(found, HubRef("u/m")).quant == "Q4_K_M"  # the default quant when there are several
    assert sum(pick(found, HubRef("u/m", quant="Q8_0")).sizes) == 7


# --- pulls ------------------------------------------------------------------------------------
def test_pull_by_quant_checks_and_records_the_model(hub: Hub, store: ModelStore) -> None:
    m = pull(store, f"{REPO}:Q4_K_M", endpoint=hub.url, log=quiet)
    data = hub.repos[REPO].files["coder-1b-q4_k_m.gguf"]
    assert (m.name, m.quant, m.format, m.revision, m.license) == ("coder-1b:q4_k_m", "Q4_K_M", "gguf", COMMIT, "mit")
    assert m.files[0].sha256 == hashlib.sha256(data).hexdigest() and m.size == len(data)
    found = store.get("coder-1b:q4_k_m")
    assert (found[1] / "coder-1b-q4_k_m.gguf").read_bytes() == data
    assert store.get(f"{REPO}:Q4_K_M".lower())[0].name == m.name  # found by the reference it was pulled by
    assert not list((store.root / DOWNLOADS_DIR).iterdir())  # nothing partial left behind


def test_pull_by_file_and_a_split_gguf_comes_whole(hub: Hub, store: ModelStore) -> None:
    m = pull(store, f"{REPO}/sub/coder-1b-f16.gguf", endpoint=hub.url, log=quiet)
    assert m.primary == "sub/coder-1b-f16.gguf" and m.name == "coder-1b:f16"
    split = pull(store, f"{REPO}:Q8_0", endpoint=hub.url, log=quiet, name="split")
    _, d = store.get("split")
    assert [f.name for f in split.files] == ["coder-1b-Q8_0-00001-of-00002.gguf", "coder-1b-Q8_0-00002-of-00002.gguf"]
    assert split.primary == "coder-1b-Q8_0-00001-of-00002.gguf"
    assert all((d / f.name).stat().st_size == f.size for f in split.files) and split.size == 350_000


def test_a_vision_model_is_pulled_with_its_projector_beside_it(hub: Hub, store: ModelStore) -> None:
    """A repository's projector (its image encoder) is no model to choose: every GGUF comes with one, the 16-bit
    one of several, and lands beside it, where the load finds it (``find_projector``)."""
    from backends.formats import find_projector

    found = choices({p: len(d) for p, d in hub.repos["acme/see-GGUF"].files.items()})
    assert [c.files for c in found] == [("see-Q4_K_M.gguf", "mmproj-see-F16.gguf"),
                                        ("see-Q8_0.gguf", "mmproj-see-F16.gguf")]
    m = pull(store, "acme/see-GGUF:Q8_0", endpoint=hub.url, log=quiet)
    assert [f.name for f in m.files] == ["see-Q8_0.gguf", "mmproj-see-F16.gguf"] and m.primary == "see-Q8_0.gguf"
    _, d = store.get(m.name)
    assert (d / "mmproj-see-F16.gguf").read_bytes() == hub.repos["acme/see-GGUF"].files["mmproj-see-F16.gguf"]
    assert find_projector(d / m.primary) == d / "mmproj-see-F16.gguf"
    assert m.size == 7000 + 3000


def test_an_openvino_ir_is_pulled_as_ir_and_small_files_are_checked_by_blob_id(hub: Hub, store: ModelStore) -> None:
    m = pull(store, "acme/coder-ov", endpoint=hub.url, log=quiet)
    assert m.format == "ir" and m.primary == "" and {f.name for f in m.files} == {
        "openvino_model.xml", "openvino_model.bin", "config.json"}
    hub.corrupt.add("config.json")  # a small (non-LFS) file is checked against its git blob id
    with pytest.raises(PullError, match="checksum"):
        pull(store, "acme/coder-ov", endpoint=hub.url, log=quiet, name="again")


def test_a_cut_connection_is_resumed_where_it_stopped(hub: Hub, store: ModelStore) -> None:
    hub.cut_after["coder-1b-q4_k_m.gguf"] = (100_000, 2)
    lines: list[str] = []
    m = pull(store, f"{REPO}:Q4_K_M", endpoint=hub.url, log=lines.append)
    ranges = [r for p, r in hub.requests if p == "coder-1b-q4_k_m.gguf"]
    assert ranges == ["", "bytes=100000-", "bytes=200000-"]
    assert sum("resuming at" in line for line in lines) == 2
    _, d = store.get(m.name)
    assert (d / "coder-1b-q4_k_m.gguf").read_bytes() == hub.repos[REPO].files["coder-1b-q4_k_m.gguf"]


def test_an_interrupted_pull_resumes_on_the_next_pull(hub: Hub, store: ModelStore,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pull_mod, "RESUME_ATTEMPTS", 0)  # the first pull gives up at the first cut
    hub.cut_after["coder-1b-q4_k_m.gguf"] = (120_000, 1)
    with pytest.raises(PullError, match="cannot reach|RemoteProtocolError"):
        pull(store, f"{REPO}:Q4_K_M", endpoint=hub.url, log=quiet)
    assert store.models() == []
    parts = list((store.root / DOWNLOADS_DIR).iterdir())
    assert len(parts) == 1 and parts[0].stat().st_size == 120_000  # kept for the next pull
    m = pull(store, f"{REPO}:Q4_K_M", endpoint=hub.url, log=quiet)
    assert [r for p, r in hub.requests if p == "coder-1b-q4_k_m.gguf"][-1] == "bytes=120000-"
    assert m.files[0].sha256 == hashlib.sha256(hub.repos[REPO].files["coder-1b-q4_k_m.gguf"]).hexdigest()


def test_a_corrupted_file_is_refused_and_removed(hub: Hub, store: ModelStore) -> None:
    hub.corrupt.add("coder-1b-q4_k_m.gguf")
    with pytest.raises(PullError, match="does not match the checksum"):
        pull(store, f"{REPO}:Q4_K_M", endpoint=hub.url, log=quiet)
    assert store.models() == [] and not list((store.root / DOWNLOADS_DIR).iterdir())
    hub.corrupt.clear()
    assert pull(store, f"{REPO}:Q4_K_M", endpoint=hub.url, log=quiet).name == "coder-1b:q4_k_m"
    assert [r for p, r in hub.requests if p == "coder-1b-q4_k_m.gguf"][-1] == ""  # anew, not resumed


def test_ambiguous_and_missing_quants_list_the_choices(hub: Hub, store: ModelStore) -> None:
    with pytest.raises(RefError) as exc:
        pull(store, f"{REPO}:Q5_K_M", endpoint=hub.url, log=quiet)
    text = str(exc.value)
    assert "no GGUF quantized Q5_K_M" in text
    assert f"{REPO}:Q4_K_M" in text and f"{REPO}:Q8_0" in text and "(2 parts)" in text and f"{REPO}:F16" in text
    with pytest.raises(RefError, match="2 GGUFs quantized Q4_K_M") as exc:
        pull(store, "acme/two-q4:Q4_K_M", endpoint=hub.url, log=quiet)
    assert "acme/two-q4/a-Q4_K_M.gguf" in str(exc.value) and "acme/two-q4/b-Q4_K_M.gguf" in str(exc.value)
    assert store.models() == [] and not hub.requests  # nothing was downloaded


def test_an_unknown_repository_and_an_unreachable_hub_fail_fast_and_the_store_still_lists(
        hub: Hub, store: ModelStore) -> None:
    pull(store, f"{REPO}:Q4_K_M", endpoint=hub.url, log=quiet)
    with pytest.raises(PullError, match="not found"):
        pull(store, "acme/nothing-here:Q4_K_M", endpoint=hub.url, log=quiet)
    with socket.socket() as s:  # a port nothing listens on: as offline as a test can be
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(PullError, match="cannot reach"):
        pull(store, f"{REPO}:Q8_0", endpoint=dead, log=quiet)
    assert time.monotonic() - t0 < 10
    assert [m.name for m in store.models()] == ["coder-1b:q4_k_m"]


def test_free_disk_is_checked_before_anything_downloads(hub: Hub, store: ModelStore,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    usage = shutil.disk_usage(store.root.parent)._replace(free=10 << 20)  # 10 MiB free
    monkeypatch.setattr(pull_mod.shutil, "disk_usage", lambda _: usage)
    with pytest.raises(PullError, match="not enough disk"):
        pull(store, f"{REPO}:Q4_K_M", endpoint=hub.url, log=quiet)
    assert not hub.requests


def test_a_name_taken_is_refused_unless_replaced(hub: Hub, store: ModelStore) -> None:
    pull(store, f"{REPO}:Q4_K_M", endpoint=hub.url, log=quiet, name="coder")
    with pytest.raises(StoreError, match="already in the store"):
        pull(store, f"{REPO}:Q8_0", endpoint=hub.url, log=quiet, name="coder")
    assert pull(store, f"{REPO}:Q8_0", endpoint=hub.url, log=quiet, name="coder", replace=True).quant == "Q8_0"
    assert [m.quant for m in store.models()] == ["Q8_0"]
    with pytest.raises(StoreError, match="not a model name"):
        pull(store, f"{REPO}:Q8_0", endpoint=hub.url, log=quiet, name="Bad Name/x")


def test_a_local_file_is_linked_in_and_a_split_part_points_to_its_first(tmp_path: Path, store: ModelStore) -> None:
    src = tmp_path / "my-model-Q4_0.gguf"
    src.write_bytes(b"GGUF" + blob(10_000, 9))  # the magic a GGUF begins with
    m = pull(store, str(src), log=quiet)
    _, d = store.get(m.name)
    assert m.name == "my-model:q4_0" and m.source == str(src)
    assert os.stat(d / src.name).st_ino == os.stat(src).st_ino  # a hard link: no second copy
    (tmp_path / "big-00001-of-00002.gguf").write_bytes(b"GGUF-a")
    (tmp_path / "big-00002-of-00002.gguf").write_bytes(b"GGUF-b")
    with pytest.raises(PullError, match="first part"):
        pull(store, str(tmp_path / "big-00002-of-00002.gguf"), log=quiet)
    assert {f.name for f in pull(store, str(tmp_path / "big-00001-of-00002.gguf"), log=quiet).files} == {
        "big-00001-of-00002.gguf", "big-00002-of-00002.gguf"}


# --- the commands -----------------------------------------------------------------------------
def test_ls_show_alias_and_rm(hub: Hub, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("MODELD_ENDPOINT", f"ipc://{tmp_path / 'none.sock'}")  # no daemon there
    data = ["--data-dir", str(tmp_path)]
    assert store_cli(["pull", f"{REPO}:Q4_K_M", *data]) == 0
    assert store_cli(["alias", "coder", "coder-1b:q4_k_m", *data]) == 0
    capsys.readouterr()
    assert store_cli(["ls", "--json", *data]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["quant"], r["loaded"]) for r in listing["models"]] == [("coder-1b:q4_k_m", "Q4_K_M", False)]
    assert listing["aliases"] == {"coder": "coder-1b:q4_k_m"} and listing["daemon"] is False
    assert store_cli(["ls", *data]) == 0
    out = capsys.readouterr().out
    assert "coder-1b:q4_k_m" in out and "1 model," in out and "LOADED is unknown" in out
    assert store_cli(["show", "coder", *data]) == 0  # by its alias
    out = capsys.readouterr().out
    assert "license" in out and "mit" in out and hashlib.sha256(
        hub.repos[REPO].files["coder-1b-q4_k_m.gguf"]).hexdigest() in out
    assert store_cli(["rm", "nothing", *data]) == 1
    assert "no model 'nothing' in the store" in capsys.readouterr().err
    assert store_cli(["rm", "coder", *data]) == 0
    assert ModelStore(tmp_path / "models").models() == [] and ModelStore(tmp_path / "models").aliases() == {}


def test_modeld_pull_runs_as_a_command_with_hf_endpoint(hub: Hub, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": hub.url, "MODELD_DATA_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "modeld", "pull", f"{REPO}:Q8_0"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("coder-1b:q8_0 ")
    bad = subprocess.run([sys.executable, "-m", "modeld", "pull", "acme/two-q4"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert bad.returncode == 1, bad.stderr
    assert "acme/two-q4 offers 2 models; name one" in bad.stderr and "acme/two-q4/b-Q4_K_M.gguf" in bad.stderr


def test_the_listing_follows_the_store_on_disk(tmp_path: Path) -> None:
    """The store caches its listing by the root's mtime: a model another process adds is seen at once."""
    a, b = ModelStore(tmp_path), ModelStore(tmp_path)
    src = tmp_path.parent / f"{tmp_path.name}-x-Q8_0.gguf"
    src.write_bytes(b"GGUF" + b"x" * 10)
    assert a.models() == []
    pull(b, str(src), log=quiet)
    assert [m.name for m in a.models()] == [b.models()[0].name]
    b.set_alias("short", b.models()[0].name)
    assert a.find("short") is not None
    assert store_mod.check_name("Coder:Q4") == "coder:q4"


def test_hf_token_is_sent_with_every_request(hub: Hub, store: ModelStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    pull(store, f"{REPO}:Q4_K_M", endpoint=hub.url, log=quiet)
    assert hub.auth and set(hub.auth) == {"Bearer hf_test_token"}
