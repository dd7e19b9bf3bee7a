"""``modeld.settings``: the serve, memory and http settings from flags, environment and config file, each
declared once, and the one size parser."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings

import modeld
from contract.types import Config
from harness.daemon import ROOT, DaemonProcess, free_port
from modeld.capacity import Policy
from modeld.capacity.sizes import parse_size, parse_size_or_auto
from modeld.defaults import (
    DEFAULT_BLOB_BYTES,
    DEFAULT_EMBED_IDLE_S,
    DEFAULT_ENGINE_NICE,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_LEASE_S,
    DEFAULT_LISTEN,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_SESSION_TTL_S,
    DEFAULT_STREAM_INTERVAL_S,
    DEFAULT_WEDGE_S,
    QUEUE_TIMEOUT_S,
)
from modeld.front.main import build_parser as build_http_parser
from modeld.serve import build_parser
from modeld.settings import (
    MEMORY_FLAGS,
    MEMORY_SETTINGS,
    SESSIONS,
    SIZE_SETTINGS,
    Flag,
    HttpSettings,
    NonNegative,
    ServeSettings,
    SettingsError,
    data_dir_of,
    env_name,
    flag_name,
    load_names,
    load_settings,
    option_flags_of,
)
from modeld.settings_cli import add_flags, command_settings, parse_settings, setting_value
from modeld.store import default_store_dir

GiB = 2**30
MiB = 2**20
MODELD = ROOT / ".venv" / "bin" / "modeld"
#: the flags of ``modeld serve``: its fields', the memory policy's MEMORY_FLAGS, the load config's settings and the
#: registered engines' options in place of the nested ``load_config``
FLAGS = command_settings(ServeSettings)
#: every setting by its flat name: a flag's dest, a variable's MODELD_<NAME> (the memory policy's by MEMORY_SETTINGS)
SETTINGS = [name for name in FLAGS if name not in MEMORY_FLAGS] + list(MEMORY_SETTINGS)


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


def layer(home: Path, monkeypatch: pytest.MonkeyPatch, body: str, variables: dict[str, str]) -> None:
    """The config file ``body`` under ``home`` and the environment's ``variables``."""
    write_config(home, body)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


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


# --- one field per flag, each declared once, the same defaults as the daemon and the front -------------


def _help_sections(p: argparse.ArgumentParser) -> dict[str, list[str]]:
    """The flags each section of ``p``'s help lists, by the section's title, each as the user reads it
    (``--lease S``, ``--speculative {on,off}``)."""
    out: dict[str, list[str]] = {}
    title = ""
    for line in p.format_help().splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            out[title] = []
        elif title and line.startswith("  -"):
            out[title].append(re.split(r"\s{2,}", line.strip())[0])
    return out


def _flags(p: argparse.ArgumentParser) -> dict[str, str]:
    """Every flag of ``p``'s help but ``--help``, by its name: how the help shows it."""
    return {e.split()[0]: e for entries in _help_sections(p).values() for e in entries if not e.startswith("-h")}


def test_every_flag_is_a_setting_and_every_setting_a_flag() -> None:
    assert set(_flags(build_parser())) == {flag_name(name) for name in FLAGS}
    assert set(_flags(build_http_parser())) == {flag_name(name) for name in HttpSettings.model_fields}


def test_each_flag_is_written_from_its_field() -> None:
    """The kind of flag follows from the field: a switch for a bool off by default, on/off for one on by default,
    a repeatable flag for a tuple, a Literal's choices, argparse's type for int/float/Path, the text as given
    where the field's validator parses it (a size shows SIZE), the metavar and the section from ``Flag``."""
    p = build_parser()
    shown = _flags(p)

    def parsed(*argv: str) -> dict[str, Any]:
        return vars(p.parse_args(list(argv)))

    assert parsed() == {}  # a flag left out takes no part (the environment and the config file fill it in)
    assert parsed("--flash-attn") == {"flash_attn": True} and shown["--flash-attn"] == "--flash-attn"
    assert shown["--speculative"] == "--speculative {on,off}"
    assert shown["--switch-on-request"] == "--switch-on-request {on,off}"
    assert parsed("--alias", "a=b", "--alias", "c=d") == {"alias": ["a=b", "c=d"]}
    assert shown["--kv-cache-type"] == "--kv-cache-type {f16,f32,q8_0,q4_0}"
    assert shown["--log-format"] == "--log-format {plain,json}"
    assert parsed("--num-ctx", "4096", "--lease", "2.5", "--cache-dir", "/x") == {
        "num_ctx": 4096, "lease": 2.5, "cache_dir": Path("/x")}
    assert parsed("--cache-ram", "8GiB", "--gpu-layers", "auto") == {"cache_ram": "8GiB", "gpu_layers": "auto"}
    assert shown["--cache-ram"] == "--cache-ram SIZE" and shown["--mem-max"] == "--mem-max SIZE"
    assert shown["--lease"] == "--lease S" and shown["--gpu-layers"] == "--gpu-layers N|auto|all"
    for bad in (["--flash-attn", "on"], ["--speculative", "maybe"], ["--kv-cache-type", "q2"], ["--num-ctx", "lots"],
                ["--lease", "soon"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    sections = {title: {e.split()[0] for e in entries} for title, entries in _help_sections(p).items()}
    assert {"--lease", "--session-ttl"} <= sections[SESSIONS] and "--cache-ram" in sections["memory and caches"]


class _OneMore(ServeSettings):
    """The settings with one more, declared as the contributing guide says: one field."""

    answer_delay: Annotated[NonNegative, Flag("S", SESSIONS)] = Field(
        0.0, description="hold each answer back S seconds"
    )


def _one_more_parser(current: _OneMore | None, note: str, config: Path | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="modeld serve")
    add_flags(p, _OneMore, "serve", current)
    return p


def test_a_new_setting_is_one_field(config_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Added as one field, a setting has its flag, its variable, its config key and its help, and reaches the
    component that takes the settings whole."""
    assert parse_settings(_OneMore, ["--answer-delay", "2.5"], _one_more_parser).answer_delay == 2.5
    write_config(config_home, "answer_delay = 3\n")
    assert parse_settings(_OneMore, [], _one_more_parser).answer_delay == 3
    monkeypatch.setenv("MODELD_ANSWER_DELAY", "1.5")
    current = parse_settings(_OneMore, [], _one_more_parser)
    assert current.answer_delay == 1.5
    monkeypatch.setenv("COLUMNS", "1000")
    text = " ".join(_one_more_parser(current, "", None).format_help().split())
    assert "--answer-delay S hold each answer back S seconds (default: 1.5; env MODELD_ANSWER_DELAY)" in text
    with pytest.raises(SettingsError, match="answer_delay"):
        parse_settings(_OneMore, ["--answer-delay", "-1"], _one_more_parser)
    # the front's components take HttpSettings whole: a field of it is there without being handed on
    from modeld.front.core import Serving

    serving = Serving(None, current)  # type: ignore[arg-type]
    assert serving.settings.answer_delay == 1.5  # type: ignore[attr-defined]


def test_the_configuration_page_lists_every_setting_from_its_field() -> None:
    """docs/configuration.md's table is written at build time by docs/hooks/settings_reference.py from
    ``modeld.settings_cli.reference``: one row per flag, each with its variable, in a known section."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("settings_reference", ROOT / "docs" / "hooks" / "settings_reference.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.on_page_markdown("before\n" + hook.MARKER + "\nafter", page=None)
    rows = [line for line in page.splitlines() if line.startswith("| `--")]
    assert len(rows) == len(FLAGS)
    for name in FLAGS:
        assert sum(f"| `{flag_name(name)}" in row and f"`{env_name(name)}`" in row for row in rows) == 1, name
    assert "| `--lease S` | `MODELD_LEASE` | `30` | seconds a silent client keeps its session |" in page
    assert "(also `modeld http`)" in next(row for row in rows if row.startswith("| `--api-key"))
    assert page.startswith("before\n") and page.endswith("after")


def test_no_flag_has_an_argparse_default() -> None:
    assert vars(build_parser().parse_args([])) == {}
    assert vars(build_http_parser().parse_args([])) == {}


def _declared(cls: type) -> set[str]:
    """The fields ``cls`` declares in its own body (not those it inherits)."""
    own = set(vars(cls).get("__annotations__", {}))
    if dataclasses.is_dataclass(cls):
        return own & {f.name for f in dataclasses.fields(cls)}
    return own & set(cls.model_fields)


def _models_in_modeld() -> list[type]:
    """Every pydantic model and dataclass defined in the modeld package."""
    found = []
    for info in pkgutil.walk_packages(modeld.__path__, "modeld."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and (dataclasses.is_dataclass(cls) or issubclass(cls, BaseModel)):
                found.append(cls)
    return found


def test_no_setting_is_declared_twice() -> None:
    """Each setting has one declaration: a settings class's own field, or a field of a model nested in one.

    The settings classes (every ``BaseSettings`` in modeld and the models nested in them) declare disjoint
    fields; a nested model's flat names (``MEMORY_SETTINGS``) are no field of the class that nests it; and no
    other model or dataclass of the package repeats several settings (as ``ServeOptions`` once repeated every
    one of them).
    """
    models = _models_in_modeld()
    settings = [cls for cls in models if issubclass(cls, BaseSettings)]
    nested = [f.annotation for cls in settings for f in cls.model_fields.values()
              if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)]
    assert set(settings) == {HttpSettings, ServeSettings} and nested == [Config, Policy]
    family = [*settings, *nested]
    seen: dict[str, type] = {}
    for cls in family:
        for name in _declared(cls):
            assert name not in seen, f"{name} is declared by {seen[name].__name__} and by {cls.__name__}"
            seen[name] = cls
    assert not set(ServeSettings.model_fields) & {*MEMORY_SETTINGS, *Policy.model_fields, "max", "reserve"}
    assert not set(ServeSettings.model_fields) & {*load_names(), *(o.setting for o in option_flags_of())}
    assert set(MEMORY_SETTINGS.values()) == set(Policy.model_fields)
    # (a request default is named as the request field it fills: an API's request model declares that field)
    assert REQUEST_DEFAULTS <= set(ServeSettings.model_fields)
    names = ((set(seen) - set(Config.model_fields)) | set(MEMORY_SETTINGS) | set(load_names())) - REQUEST_DEFAULTS
    for cls in models:
        if cls not in family:
            assert len(_declared(cls) & names) < 3, f"{cls.__module__}.{cls.__name__} repeats settings"


#: settings that give a request's field when the request leaves it unset (``serve --temperature``, ``--max-tokens``)
REQUEST_DEFAULTS = {"temperature", "max_tokens"}


def test_the_defaults_are_the_daemons_and_the_fronts(config_home: Path) -> None:
    s = load_settings()
    assert (s.lease, s.session_ttl, s.wedge_timeout, s.engine_nice, s.blob_disk, s.embed_idle) == (
        DEFAULT_LEASE_S, DEFAULT_SESSION_TTL_S, DEFAULT_WEDGE_S, DEFAULT_ENGINE_NICE, DEFAULT_BLOB_BYTES,
        DEFAULT_EMBED_IDLE_S)
    assert s.stream_interval_ms == DEFAULT_STREAM_INTERVAL_S * 1000
    assert (s.http_queue_timeout, s.http_max_body, s.http_max_connections, s.http_header_timeout) == (
        QUEUE_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, DEFAULT_HEADER_TIMEOUT_S)
    assert s.memory == Policy() and s.backend == "auto" and s.http is None
    h = HttpSettings.load()
    assert h.model_dump() == {name: getattr(s, name) for name in HttpSettings.model_fields}


# --- precedence -------------------------------------------------------------------------------


def test_flag_beats_environment_beats_file_beats_default(config_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_config(config_home, 'lease = 3\nsession_ttl = 3\nidle_unload = 3\ncache_ram = "3MiB"\n')
    monkeypatch.setenv("MODELD_LEASE", "2")
    monkeypatch.setenv("MODELD_SESSION_TTL", "2")
    monkeypatch.setenv("MODELD_CACHE_RAM", "2MiB")
    s = ServeSettings(lease=1, cache_ram="1MiB")
    assert (s.lease, s.session_ttl, s.idle_unload, s.embed_idle) == (1, 2, 3, 300)
    assert s.cache_ram == MiB
    assert load_settings({"lease": 1.0}).cache_ram == 2 * MiB


def test_an_empty_variable_is_unset(config_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_config(config_home, 'http = "127.0.0.1:9"\n')
    monkeypatch.setenv("MODELD_HTTP", "")
    monkeypatch.setenv("MODELD_LEASE", "")
    s = load_settings()
    assert (s.http, s.lease) == ("127.0.0.1:9", DEFAULT_LEASE_S)


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
        ("MODELD_MEM_HEADROOM", "20%", "mem_headroom", 0.2),
        ("MODELD_MIN_CONTEXT", "768", "min_context", 768),
        ("MODELD_DEFAULT_CONTEXT", "4096", "default_context", 4096),
    ],
)
def test_the_documented_variables_keep_their_meaning(
    config_home: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, setting: str, expected: Any
) -> None:
    monkeypatch.setenv(variable, value)
    assert setting_value(load_settings(), setting) == expected


# --- the config file --------------------------------------------------------------------------


def test_the_config_file_is_under_xdg_config_home(config_home: Path) -> None:
    assert load_settings().config_file == config_home / "modeld" / "config.toml"  # absent: fine
    path = write_config(config_home, "session_ttl = 60\n")
    s = load_settings()
    assert (s.session_ttl, s.config_file) == (60, path)


def test_config_flag_and_variable_name_another_file(
    config_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_config(config_home, "session_ttl = 60\n")
    by_env = tmp_path / "env.toml"
    by_env.write_text('session_ttl = 70\n[memory]\nmax = "2GiB"\ndefault_context = 8192\n')  # the memory policy's too
    by_flag = tmp_path / "flag.toml"
    by_flag.write_text("session_ttl = 80\n")
    monkeypatch.setenv("MODELD_CONFIG", str(by_env))
    monkeypatch.setenv("MODELD_DEFAULT_CONTEXT", "1024")
    s = load_settings()
    assert (s.session_ttl, s.memory.user_limit_bytes, s.memory.default_context) == (70, 2 * GiB, 1024)
    s = load_settings({"config": by_flag})
    assert (s.session_ttl, s.config_file) == (80, by_flag)


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
        ("backend = 'gpu'\n", "backend .*unknown backend 'gpu'; choose one of auto, llama, openvino, vllm, memory"),
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


def test_the_memory_table_is_the_memory_policy(config_home: Path) -> None:
    write_config(config_home, 'session_ttl = 9\n[memory]\nheadroom = "20%"\n')
    s = load_settings()
    assert (s.session_ttl, s.memory.headroom_fraction) == (9, 0.2)


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
    assert setting_value(load_settings({setting: "1.5GiB"}), setting) == 3 * GiB // 2
    write_config(config_home, f"{setting} = 4096\n")
    assert setting_value(load_settings(), setting) == 4096


def test_auto_only_where_the_budget_has_one(config_home: Path) -> None:
    assert load_settings({"cache_ram": "auto", "cache_disk": "AUTO"}).cache_ram is None
    with pytest.raises(SettingsError, match=r"blob_disk \(--blob-disk\): invalid size 'auto'"):
        load_settings({"blob_disk": "auto"})


# --- the memory policy, nested ----------------------------------------------------------------------


def test_the_memory_policy_flag_beats_environment_beats_file_beats_default(
    config_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer(config_home, monkeypatch, '[memory]\nmax = "8GiB"\nreserve = "1GB"\nheadroom = "20%"\nmin_context = 1024\n',
          {"MODELD_MEM_RESERVE": "2GiB", "MODELD_MEM_HEADROOM": "0.3", "MODELD_MIN_CONTEXT": "768"})
    m = load_settings({"mem_reserve": "3GiB"}).memory
    assert m.user_limit_bytes == 8 * GiB  # the file
    assert m.reserve_bytes == 3 * GiB  # the flag, over the variable and the file
    assert (m.headroom_fraction, m.min_context) == (0.3, 768)  # the variables, over the file
    assert m.default_context == 0  # the default: as large as fits
    m = load_settings({"mem_max": "1GiB", "mem_reserve": 0}).memory
    assert (m.user_limit_bytes, m.reserve_bytes) == (GiB, 0)  # a flag's 0 is a value, not "unset"
    monkeypatch.setenv("MODELD_MEM_RESERVE", "")  # empty: unset
    assert load_settings().memory.reserve_bytes == 10**9


def test_top_level_mem_max_and_mem_reserve_win_over_the_memory_table(config_home: Path) -> None:
    write_config(config_home, 'mem_max = "2GiB"\n[memory]\nmax = "8GiB"\nreserve = "1GiB"\n')
    m = load_settings().memory
    assert (m.user_limit_bytes, m.reserve_bytes) == (2 * GiB, GiB)


@pytest.mark.parametrize(
    ("variables", "body", "match"),
    [
        ({"MODELD_MEM_HEADROOM": "1.5"}, "", r"^MODELD_MEM_HEADROOM: fraction '1.5' must be in \[0, 1\)$"),
        ({"MODELD_MEM_HEADROOM": "lots"}, "", r"^MODELD_MEM_HEADROOM: invalid fraction 'lots': expected e.g. 0.1 or 10%$"),
        ({"MODELD_MIN_CONTEXT": "big"}, "", r"^MODELD_MIN_CONTEXT: invalid token count 'big': expected a whole number$"),
        ({"MODELD_MEM_MAX": "lots"}, "", r"^mem_max \(MODELD_MEM_MAX\): invalid size 'lots'"),
        ({}, '[memory]\nreserve = "??"\n', r"^\[memory\] reserve: invalid size '\?\?'"),
        ({}, "[memory]\nmin_context = 1.5\n", r"^\[memory\] min_context: invalid token count 1.5"),
        ({}, "[memory]\ndefault_context = -1\n", r"^\[memory\] default_context: token count -1 must be >= 0$"),
        ({}, 'mem_reserve = "??"\n[memory]\nreserve = "1GiB"\n', r"^mem_reserve \(config file .*\): invalid size"),
        ({}, "[memory]\nmaxx = 1\n", r"config file .*: unknown \[memory\] keys \['maxx'\]; known: \['default_context', "
                                     r"'headroom', 'max', 'min_context', 'reserve'\]$"),
    ],
)
def test_a_bad_memory_setting_is_refused_naming_its_source(
    config_home: Path, monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], body: str, match: str
) -> None:
    layer(config_home, monkeypatch, body, variables)
    with pytest.raises(SettingsError, match=match):
        load_settings()


# --- modeld http ----------------------------------------------------------------------------------


def test_http_settings_flag_beats_environment_beats_file_beats_default(
    config_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer(config_home, monkeypatch, "http_queue_timeout = 3\nhttp_header_timeout = 3\nhttp_max_connections = 3\n",
          {"MODELD_HTTP_QUEUE_TIMEOUT": "2", "MODELD_HTTP_HEADER_TIMEOUT": "2", "MODELD_API_KEY": "k"})
    h = HttpSettings.load({"http_queue_timeout": 1})
    assert (h.http_queue_timeout, h.http_header_timeout, h.http_max_connections) == (1, 2, 3)
    assert (h.api_key, h.http_max_body, h.http, h.log_level) == ("k", DEFAULT_MAX_BODY_BYTES, None, "INFO")


def test_http_passes_over_what_only_serve_reads_and_refuses_a_typo(config_home: Path) -> None:
    write_config(config_home, 'backend = "memory"\nmem_max = "1GiB"\nalias = ["a=b"]\n[memory]\nheadroom = "5%"\n')
    assert HttpSettings.load().alias == ("a=b",)
    write_config(config_home, "sesion_ttl = 5\n")
    with pytest.raises(SettingsError, match=r"unknown setting 'sesion_ttl' .*\(did you mean 'session_ttl'\?\)"):
        HttpSettings.load()
    write_config(config_home, "http_max_body = '8XB'\n")
    with pytest.raises(SettingsError, match=r"^http_max_body \(config file .*\): invalid size '8XB'"):
        HttpSettings.load()


def test_http_help_lists_its_flags_with_their_variables(config_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELD_HTTP_QUEUE_TIMEOUT", "42")
    monkeypatch.setenv("COLUMNS", "1000")
    text = " ".join(build_http_parser(HttpSettings.load()).format_help().split())
    for name in HttpSettings.model_fields:
        assert flag_name(name) in text and env_name(name) in text, name
    assert f"(default: {DEFAULT_LISTEN}; env MODELD_HTTP)" in text
    assert "(default: 42; env MODELD_HTTP_QUEUE_TIMEOUT)" in text


def python_modeld(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "modeld", *args], cwd=ROOT, text=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**env, "PYTHONPATH": str(ROOT)})


def test_modeld_http_serves_what_the_file_the_environment_and_the_flags_say(config_home: Path) -> None:
    write_config(config_home, f'http = "127.0.0.1:{free_port()}"\nhttp_max_body = "-1"\n')
    env = {**os.environ, "MODELD_HTTP_MAX_BODY": "lots"}
    _, err = python_modeld("http", "--http-max-body=-1GiB", env=env).communicate(timeout=60)
    assert err.strip() == "modeld http: http_max_body (--http-max-body): invalid size '-1GiB': must be >= 0"
    port = free_port()
    write_config(config_home, f'http = "127.0.0.1:{port}"\nhttp_max_connections = 0\n')
    env["MODELD_HTTP_MAX_BODY"] = "1MiB"
    bad = python_modeld("http", env=env)
    _, err = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "http_max_connections (config file " in err, err
    front = python_modeld("http", "--http-max-connections", "4", env=env)
    assert front.stderr is not None
    line = front.stderr.readline()
    front.terminate()
    _, err = front.communicate(timeout=10)
    assert f"HTTP APIs at http://127.0.0.1:{port}/v1" in line, line + err
    assert front.returncode == 0


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
    for name in FLAGS:
        assert flag_name(name) in text and env_name(name) in text, name
    assert "(default: 42; env MODELD_SESSION_TTL)" in text  # what applies without the flag
    assert "(default: 1.50GiB; env MODELD_BLOB_DISK)" in text
    assert str(config_home / "modeld" / "config.toml") in text
    assert "sekrit-key" not in out.stdout


def test_every_command_finds_the_data_dir_the_config_file_names(config_home: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``data_dir`` in the config file (or MODELD_DATA_DIR) is where serve, the store, ``keys`` and ``pull`` all
    look: one resolution, not each command's own."""
    monkeypatch.delenv("MODELD_DATA_DIR", raising=False)
    there = tmp_path / "from-the-file"
    write_config(config_home, f'data_dir = "{there}"\n')
    assert load_settings().data_dir == there == data_dir_of()
    assert default_store_dir() == there / "models"
    assert data_dir_of(tmp_path / "flag") == tmp_path / "flag"
    out = run("keys")
    assert out.returncode == 0, out.stderr
    assert str(there / "keys") in out.stderr and (there / "keys").is_dir()
    monkeypatch.setenv("MODELD_DATA_DIR", str(tmp_path / "from-the-env"))
    assert data_dir_of() == tmp_path / "from-the-env" and default_store_dir() == tmp_path / "from-the-env" / "models"
    monkeypatch.delenv("MODELD_DATA_DIR")
    write_config(config_home, "data_dir = 5\n")
    out = run("keys")
    assert out.returncode == 2 and "data_dir" in out.stderr, out.stderr


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
