"""``modeld.settings``: the serve settings from flags, environment and config file, and the one size parser."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from modeld.bootstrap import ServeOptions
from modeld.capacity.sizes import parse_size, parse_size_or_auto
from modeld.serve import build_parser
from modeld.settings import (
    SIZE_SETTINGS,
    ServeSettings,
    SettingsError,
    env_name,
    flag_name,
    load_settings,
)

from .daemon_proc import ROOT, DaemonProcess

GiB = 2**30
MiB = 2**20
MODELD = ROOT / ".venv" / "bin" / "modeld"
SETTINGS = list(ServeSettings.model_fields)


@pytest.fixture
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An XDG_CONFIG_HOME of the test's own and no MODELD_* setting in the environment."""
    home = tmp_path / "xdg-config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    for name in SETTINGS:
        monkeypatch.delenv(env_name(name), raising=False)
    return home


def write_config(home: Path, body: str) -> Path:
    path = home / "modeld" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


# --- the size parser ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        (4096, 4096),
        ("1KB", 1000),
        ("1kib", 1024),
        ("60MB", 60_000_000),
        ("60mib", 60 * MiB),
        ("8GB", 8_000_000_000),
        ("8GiB", 8 * GiB),
        ("8gib", 8 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("512k", 512_000),
    ],
)
def test_parse_size_reads_bytes_and_units(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected
    assert parse_size_or_auto(text) == expected


def test_auto_is_a_size_only_where_a_budget_has_one() -> None:
    assert parse_size_or_auto("auto") is None
    assert parse_size_or_auto(" AUTO ") is None
    with pytest.raises(ValueError, match="invalid size 'auto'"):
        parse_size("auto")


@pytest.mark.parametrize("bad", ["-1", "-1GiB", " -0.5MB", -1])
def test_parse_size_refuses_negatives(bad: str | int) -> None:
    with pytest.raises(ValueError, match="invalid size .*must be >= 0"):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["", "lots", "8XB", "1.5", "GiB", "1e9", "1,5GiB", "nan"])
def test_parse_size_refuses_garbage(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size_or_auto(bad)


# --- one field per flag, the same defaults as the composition root -------------------------------


def test_every_flag_is_a_setting_and_every_setting_a_flag() -> None:
    dests = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert dests == set(SETTINGS)
    options = {f.name for f in dataclasses.fields(ServeOptions)}
    assert options == set(SETTINGS) - {"config"} | {"backend_reason", "config_file"}


def test_no_flag_has_an_argparse_default() -> None:
    assert vars(build_parser().parse_args([])) == {}


def test_built_in_defaults_are_the_composition_roots(config_home: Path) -> None:
    assert load_settings().options() == ServeOptions()


# --- precedence -------------------------------------------------------------------------------


def test_flag_beats_environment_beats_file_beats_default(config_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_config(config_home, 'lease = 3\nsession_ttl = 3\nidle_unload = 3\ncache_ram = "3MiB"\n')
    monkeypatch.setenv("MODELD_LEASE", "2")
    monkeypatch.setenv("MODELD_SESSION_TTL", "2")
    monkeypatch.setenv("MODELD_CACHE_RAM", "2MiB")
    s = ServeSettings(lease=1, cache_ram="1MiB")
    assert (s.lease, s.session_ttl, s.idle_unload, s.embed_idle) == (1, 2, 3, ServeOptions().embed_idle)
    assert s.cache_ram == MiB
    assert load_settings({"lease": 1.0}).options().cache_ram == 2 * MiB


def test_an_empty_variable_is_unset(config_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_config(config_home, 'http = "127.0.0.1:9"\n')
    monkeypatch.setenv("MODELD_HTTP", "")
    monkeypatch.setenv("MODELD_LEASE", "")
    s = load_settings()
    assert (s.http, s.lease) == ("127.0.0.1:9", ServeOptions().lease)


@pytest.mark.parametrize(
    ("variable", "value", "setting", "expected"),
    [
        ("MODELD_BACKEND", "memory", "backend", "memory"),
        ("MODELD_OWNER", "me", "owner", "me"),
        ("MODELD_ENDPOINT", "tcp://127.0.0.1:5555", "endpoint", "tcp://127.0.0.1:5555"),
        ("MODELD_MEM_MAX", "8GiB", "mem_max", 8 * GiB),
        ("MODELD_MEM_RESERVE", "512MB", "mem_reserve", 512_000_000),
        ("MODELD_CACHE_RAM", "0", "cache_ram", 0),
        ("MODELD_CACHE_DISK", "auto", "cache_disk", None),
        ("MODELD_HTTP", "127.0.0.1:8377", "http", "127.0.0.1:8377"),
        ("MODELD_API_KEY", "k", "api_key", "k"),
        ("MODELD_LOG_LEVEL", "debug", "log_level", "DEBUG"),
        ("MODELD_KV_CACHE_TYPE", "q8_0", "kv_cache_type", "q8_0"),
        ("MODELD_FLASH_ATTN", "true", "flash_attn", True),
        ("MODELD_EXACT_DECODE", "1", "exact_decode", True),
    ],
)
def test_the_documented_variables_keep_their_meaning(
    config_home: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, setting: str, expected: Any
) -> None:
    monkeypatch.setenv(variable, value)
    assert getattr(load_settings().options(), setting) == expected


# --- the config file --------------------------------------------------------------------------


def test_the_config_file_is_under_xdg_config_home(config_home: Path) -> None:
    assert load_settings().config_file == config_home / "modeld" / "config.toml"
    assert load_settings().options().config_file is None  # absent: fine, and nothing for the planner
    path = write_config(config_home, "session_ttl = 60\n")
    s = load_settings()
    assert (s.session_ttl, s.options().config_file) == (60, path)


def test_config_flag_and_variable_name_another_file(
    config_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_config(config_home, "session_ttl = 60\n")
    by_env = tmp_path / "env.toml"
    by_env.write_text("session_ttl = 70\n")
    by_flag = tmp_path / "flag.toml"
    by_flag.write_text("session_ttl = 80\n")
    monkeypatch.setenv("MODELD_CONFIG", str(by_env))
    assert load_settings().session_ttl == 70
    s = load_settings({"config": by_flag})
    assert (s.session_ttl, s.config_file, s.options().config_file) == (80, by_flag, by_flag)


def test_a_named_config_file_must_exist(config_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match="missing.toml does not exist"):
        load_settings({"config": tmp_path / "missing.toml"})
    monkeypatch.setenv("MODELD_CONFIG", str(tmp_path / "gone.toml"))
    with pytest.raises(SettingsError, match="gone.toml does not exist"):
        load_settings()


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("sesion_ttl = 5\n", r"unknown setting 'sesion_ttl' in config file .*config.toml \(did you mean 'session_ttl'\?\)"),
        ("[daemon]\nlease = 5\n", "unknown setting 'daemon'"),
        ("session_ttl = 'soon'\n", r"session_ttl \(config file .*config.toml\): Input should be a valid number"),
        ("lease = -1\n", r"lease \(config file .*\): Input should be greater than 0"),
        ("backend = 'gpu'\n", "backend .*unknown backend 'gpu'; choose one of auto, llama, openvino, memory"),
        ("kv_cache_type = 'q5_1'\n", r"kv_cache_type \(config file .*\): Input should be '', 'f16', 'f32', 'q8_0' or 'q4_0'"),
        ("memory = 3\n", r"\[memory\] must be a table"),
        ("config = 'other.toml'\n", "cannot be set inside"),
        ("lease = [\n", "not valid TOML"),
    ],
)
def test_the_config_file_refuses_unknown_keys_and_bad_values(config_home: Path, body: str, match: str) -> None:
    write_config(config_home, body)
    with pytest.raises(SettingsError, match=match):
        load_settings()


def test_the_memory_table_is_left_to_the_planner(config_home: Path) -> None:
    write_config(config_home, 'session_ttl = 9\n[memory]\nheadroom = "20%"\n')
    assert load_settings().session_ttl == 9


# --- sizes in every source -------------------------------------------------------------------------


@pytest.mark.parametrize("setting", SIZE_SETTINGS)
def test_a_bad_size_is_refused_naming_the_setting_and_its_source(
    config_home: Path, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    with pytest.raises(SettingsError, match=rf"^{setting} \({flag_name(setting)}\): invalid size '-1GiB': must be >= 0$"):
        load_settings({setting: "-1GiB"})
    monkeypatch.setenv(env_name(setting), "lots")
    with pytest.raises(SettingsError, match=rf"^{setting} \({env_name(setting)}\): invalid size 'lots'"):
        load_settings()
    monkeypatch.delenv(env_name(setting))
    write_config(config_home, f'{setting} = "8XB"\n')
    with pytest.raises(SettingsError, match=rf"^{setting} \(config file .*config.toml\): invalid size '8XB'"):
        load_settings()


@pytest.mark.parametrize("setting", SIZE_SETTINGS)
def test_every_size_setting_takes_units_fractions_and_bytes(config_home: Path, setting: str) -> None:
    assert getattr(load_settings({setting: "1.5GiB"}), setting) == 3 * GiB // 2
    write_config(config_home, f"{setting} = 4096\n")
    assert getattr(load_settings(), setting) == 4096


def test_auto_only_where_the_budget_has_one(config_home: Path) -> None:
    assert load_settings({"cache_ram": "auto", "cache_disk": "AUTO"}).options().cache_ram is None
    with pytest.raises(SettingsError, match=r"blob_disk \(--blob-disk\): invalid size 'auto'"):
        load_settings({"blob_disk": "auto"})


# --- the real command -----------------------------------------------------------------------------


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(MODELD), *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=env if env is not None else dict(os.environ))


def test_serve_help_lists_every_flag_with_its_variable(config_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELD_SESSION_TTL", "42")
    monkeypatch.setenv("MODELD_API_KEY", "sekrit-key")
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps long paths at their hyphens
    write_config(config_home, 'blob_disk = "1536MiB"\n')
    out = run("serve", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for name in SETTINGS:
        assert flag_name(name) in text and env_name(name) in text, name
    assert "(default: 42; env MODELD_SESSION_TTL)" in text  # what applies without the flag
    assert "(default: 1.50GiB; env MODELD_BLOB_DISK)" in text
    assert str(config_home / "modeld" / "config.toml") in text
    assert "sekrit-key" not in out.stdout


def test_serve_help_survives_a_broken_config_file(config_home: Path) -> None:
    write_config(config_home, "lease = 'x'\n")
    out = run("serve", "--help")
    assert out.returncode == 0, out.stderr
    assert "the built-in ones, because: lease" in " ".join(out.stdout.split())


def test_serve_refuses_bad_settings_with_exit_2(config_home: Path, tmp_path: Path) -> None:
    bad = run("serve", "--backend", "memory", "--blob-disk=-1GiB")
    assert bad.returncode == 2 and "blob_disk (--blob-disk): invalid size '-1GiB': must be >= 0" in bad.stderr
    write_config(config_home, "sesion_ttl = 5\n")
    typo = run("serve", "--backend", "memory")
    assert typo.returncode == 2 and "unknown setting 'sesion_ttl'" in typo.stderr
    missing = run("serve", "--backend", "memory", "--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "nope.toml does not exist" in missing.stderr


def test_the_named_config_file_reaches_the_memory_planner(config_home: Path, tmp_path: Path) -> None:
    """The planner reads the ``[memory]`` table of the file ``--config`` names, not the default one."""
    named = tmp_path / "named.toml"
    named.write_text("[memory]\nmaxx = 1\n")
    out = run("serve", "--backend", "memory", "--no-preload", "--config", str(named),
              "--endpoint", f"ipc://{tmp_path / 'm.sock'}", "--data-dir", str(tmp_path / "data"))
    assert out.returncode == 2 and "unknown [memory] keys ['maxx']" in out.stderr, out.stderr


def test_a_daemon_serves_what_the_file_the_environment_and_the_flags_say(
    config_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_config(config_home, 'session_ttl = 77\nidle_unload = 5\nblob_disk = "1.5GiB"\nblob_max_age_days = 3\n')
    monkeypatch.setenv("MODELD_IDLE_UNLOAD", "33")  # beats the file
    with DaemonProcess(tmp_path / "d", "memory", None, "--no-preload", "--blob-max-age-days", "2") as d:
        out = run("status", "--json", "--endpoint", d.endpoint)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert (st["session_ttl_s"], st["idle_unload_s"]) == (77, 33)
    assert (st["blobs"]["max_bytes"], st["blobs"]["max_age_s"]) == (3 * GiB // 2, 2 * 86400)
