"""``ServeSettings``: every ``modeld serve`` setting, typed, from the command line, the environment and a file.

Each setting is resolved on its own: command line > environment
(``MODELD_<SETTING>``, e.g. ``MODELD_CACHE_RAM``; empty counts as unset) >
config file > built-in default (``ServeOptions``' own). The layering is
pydantic-settings' sources in that order: the flags given (argparse in
``modeld.serve`` suppresses its defaults, so a flag left out takes no part) are
the init source, then ``EnvSettingsSource``, then ``ConfigFileSource`` (a
``TomlConfigSettingsSource``).

The config file is TOML at ``modeld.dirs.config_file()``
(``$XDG_CONFIG_HOME/modeld/config.toml``, else ``~/.config/modeld/config.toml``),
or the one ``--config`` / ``$MODELD_CONFIG`` names. A missing default file is
fine; a named one must exist. Its top-level keys are the settings' names
(``session_ttl = 600``, ``cache_ram = "2GiB"``); an unknown key is refused, so a
typo fails instead of being ignored. Its ``[memory]`` table belongs to the memory
planner (``modeld.capacity.Policy``: headroom, minimum and default window), which
reads and checks it itself.

Sizes go through ``modeld.capacity.sizes.parse_size`` (and "auto" where a budget
has one), so "8GiB" means the same in a flag, a variable and the file. A bad
value raises ``SettingsError`` naming the setting and where it came from.
"""

from __future__ import annotations

import difflib
import logging
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings import SettingsError as _SourceError

from contract.types import KVCacheType

from . import dirs
from .bootstrap import BACKEND_CHOICES, ServeOptions
from .capacity.sizes import parse_size, parse_size_or_auto
from .priority import MAX_NICE
from .server import EXIT_WEDGED

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "MEMORY_TABLE",
    "SIZE_SETTINGS",
    "ConfigFileSource",
    "ServeSettings",
    "SettingsError",
    "env_name",
    "flag_name",
    "load_settings",
]

ENV_PREFIX = "MODELD_"
#: names another config file (as ``--config`` does)
CONFIG_ENV = ENV_PREFIX + "CONFIG"
#: the config file's table for the memory planner; passed over here, checked there
MEMORY_TABLE = "memory"
#: the settings that are sizes ("8GiB", "512MB", bytes; "auto" for the cache budgets)
SIZE_SETTINGS = ("mem_max", "mem_reserve", "cache_ram", "cache_disk", "blob_disk", "http_max_body")

_DEFAULT = ServeOptions()


class SettingsError(ValueError):
    """A ``modeld serve`` setting is malformed or unknown, or the config file is unreadable; the message says which."""


def env_name(setting: str) -> str:
    return ENV_PREFIX + setting.upper()


def flag_name(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def _size_or_unset(value: Any) -> int | None:
    return None if value is None else parse_size(value)


def _size_or_auto(value: Any) -> int | None:
    return None if value is None else parse_size_or_auto(value)


def _backend(value: str) -> str:
    if value not in BACKEND_CHOICES:
        raise ValueError(f"unknown backend {value!r}; choose one of {', '.join(BACKEND_CHOICES)}")
    return value


def _log_level(value: str) -> str:
    level = value.strip().upper()
    if level not in logging.getLevelNamesMapping():
        raise ValueError(f"unknown log level {value!r}; choose one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return level


def _aliases(value: Any) -> Any:
    # a variable or a flag given once: NAME=MODEL[,NAME=MODEL…]
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return value


def _check_aliases(value: tuple[str, ...]) -> tuple[str, ...]:
    for item in value:
        name, sep, target = item.partition("=")
        if not sep or not name.strip() or not target.strip():
            raise ValueError(f"an alias is NAME=MODEL, got {item!r}")
    return value


def _expand_user(value: Path | None) -> Path | None:
    # a shell expands "~" on the command line, nothing does in a variable or the file
    return value.expanduser() if value is not None else None


Size = Annotated[int, BeforeValidator(parse_size)]
#: None = not set here (the memory planner then reads its own sources)
SizeOrUnset = Annotated[int | None, BeforeValidator(_size_or_unset)]
#: None = "auto": the workspace cache sizes the budget itself
SizeOrAuto = Annotated[int | None, BeforeValidator(_size_or_auto)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
OptionalPath = Annotated[Path | None, AfterValidator(_expand_user)]
#: NAME=MODEL pairs: a list in the config file, comma-separated in the variable
Aliases = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_aliases), AfterValidator(_check_aliases)]


class ServeSettings(BaseSettings):
    """Every ``modeld serve`` setting; the field names are the flags' (``--cache-ram`` → ``cache_ram``).

    Construct it with the flags given (``load_settings``); the environment and
    the config file fill in the rest. ``options()`` is what ``build_daemon`` takes.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="forbid", frozen=True)

    config: OptionalPath = Field(
        None, description="settings file, TOML: keys are these settings' names, e.g. session_ttl = 600"
    )
    endpoint: str | None = Field(_DEFAULT.endpoint, description="ipc://PATH or tcp://HOST:PORT")
    backend: Annotated[str, AfterValidator(_backend)] = Field(
        _DEFAULT.backend,
        description="the engine; auto: OpenVINO on x86-64 for a model it converts (the faster engine here), "
        "else llama.cpp; status says which and why",
    )
    model: str | None = Field(
        _DEFAULT.model, description="model to preload (default: the bundled model for llama/openvino)"
    )
    model_name: str | None = Field(_DEFAULT.model_name, description="logical name of the preloaded model")
    num_ctx: int = Field(_DEFAULT.num_ctx, ge=0, description="context window of the preloaded model (0 = memory-fitted)")
    flash_attn: bool = Field(
        _DEFAULT.flash_attn,
        description="llama.cpp: flash attention for the preloaded model (a quantized KV cache needs it)",
    )
    kv_cache_type: KVCacheType = Field(
        _DEFAULT.kv_cache_type,
        description="llama.cpp: KV cache type of the preloaded model, f16 when unset; with --flash-attn, q8_0 "
        "makes a token's logits the same alone or in a batch, so speculation and reuse never change an answer",
    )
    exact_decode: bool = Field(
        _DEFAULT.exact_decode,
        description="compute every decoded token as a prefill computes it, so drafts (sampled ones too) and "
        "reused replies never change an answer; OpenVINO: a decode step then costs more over a long context "
        "(up to 1.85x at 2,000 tokens, 2.5x at 4,000); llama.cpp: needs --flash-attn --kv-cache-type q8_0 (or q4_0)",
    )
    chat_template: str = Field(
        _DEFAULT.chat_template,
        description="the preloaded model's chat template: a built-in name (chatml, qwen2_5, qwen3_coder, llama3, "
        "mistral, mistral_args, gpt_oss, deepseek_v3_1, gemma3) or a Jinja file; default: the model's own, else the "
        "one its vocabulary's turn tokens select, else ChatML (status says which)",
    )
    tool_format: str = Field(
        _DEFAULT.tool_format,
        description="the tool-call format replies are parsed and calls forced in (hermes, qwen3_coder, llama3_json, "
        "mistral, mistral_args, harmony, deepseek_v3, deepseek_v3_1); default: detected from the chat template",
    )
    owner: str = Field(_DEFAULT.owner, description="owner instance id for fencing")
    data_dir: OptionalPath = Field(_DEFAULT.data_dir, description="snapshot blobs and state")
    mem_max: SizeOrUnset = Field(_DEFAULT.mem_max, description="memory limit for model + KV, e.g. 8GiB")
    mem_reserve: SizeOrUnset = Field(_DEFAULT.mem_reserve, description="memory kept free, e.g. 1GiB")
    lease: Positive = Field(_DEFAULT.lease, description="seconds a silent client keeps its session")
    no_preload: bool = Field(_DEFAULT.no_preload, description="start with an empty slot")
    idle_unload: NonNegative = Field(
        _DEFAULT.idle_unload,
        description="unload the chat model after S seconds with no session and no operation (0 = never)",
    )
    session_ttl: NonNegative = Field(
        _DEFAULT.session_ttl,
        description="release a session that sent no operation for S seconds, even while its client renews the "
        "lease (0 = never; any operation, explain included, refreshes it)",
    )
    embed_idle: NonNegative = Field(_DEFAULT.embed_idle, description="seconds before an idle embedding model is unloaded")
    memory_token_delay_ms: NonNegative = Field(
        _DEFAULT.memory_token_delay_ms, description="memory backend only: simulated time per generated token"
    )
    log_level: Annotated[str, AfterValidator(_log_level)] = Field(
        _DEFAULT.log_level, description="DEBUG, INFO, WARNING, ERROR or CRITICAL"
    )
    http: str | None = Field(
        _DEFAULT.http, description="also serve an OpenAI-compatible HTTP API there, e.g. 127.0.0.1:8377"
    )
    http_allow_remote: bool = Field(_DEFAULT.http_allow_remote, description="let --http bind a non-loopback address")
    http_queue_timeout: NonNegative = Field(
        _DEFAULT.http_queue_timeout, description="seconds an HTTP request waits for a busy slot before 503"
    )
    http_max_body: Size = Field(
        _DEFAULT.http_max_body, description="largest HTTP request body; a larger one is refused with 413 unread"
    )
    http_max_connections: Annotated[int, Field(ge=1)] = Field(
        _DEFAULT.http_max_connections,
        description="open HTTP connections served at once; one past it is answered 503 and closed (the open files "
        "limit is raised where allowed, and the cap kept under it so ZeroMQ clients always find descriptors)",
    )
    http_header_timeout: NonNegative = Field(
        _DEFAULT.http_header_timeout,
        description="seconds an HTTP connection may take to send a request head before it is answered 408 and "
        "closed (0 = no limit); a request being answered is never cut",
    )
    strict_model_names: bool = Field(
        _DEFAULT.strict_model_names,
        description="refuse (404) an HTTP request naming a model the daemon does not serve, instead of serving it "
        "with the loaded model (agents hard-code model names)",
    )
    keep_billing_header: bool = Field(
        _DEFAULT.keep_billing_header,
        description="Messages API: keep a system block that only carries a client's billing header (Claude Code "
        "rewrites it every request, so by default it is left out of the prompt to keep the prefix warm)",
    )
    alias: Aliases = Field(
        _DEFAULT.alias, description="NAME=MODEL: HTTP requests for model NAME are served by MODEL (repeatable)"
    )
    temperature: Annotated[float | None, Field(ge=0.0, le=10.0)] = Field(
        _DEFAULT.temperature,
        description="temperature of requests that set no sampling parameter (default: the model's recommended "
        "sampling, else 0.8 with top-k 40, top-p 0.95, min-p 0.05); 0 = greedy, which speculative decoding needs",
    )
    log_format: Literal["plain", "json"] = Field(
        _DEFAULT.log_format, description="plain lines, or one JSON object per line (access-log fields as keys)"
    )
    cache_ram: SizeOrAuto = Field(
        _DEFAULT.cache_ram,
        description="RAM for the workspace cache of prefix states, e.g. 2GiB; 0 = off; "
        "auto = half of what the model leaves spare, at most 4GiB",
    )
    cache_disk: SizeOrAuto = Field(
        _DEFAULT.cache_disk,
        description="disk for the workspace cache (survives restarts), e.g. 8GiB; 0 = off; "
        "auto = a quarter of the free space, at most 16GiB",
    )
    cache_dir: OptionalPath = Field(_DEFAULT.cache_dir, description="workspace cache directory (default DATA_DIR/cache)")
    wedge_timeout: Positive = Field(
        _DEFAULT.wedge_timeout,
        description="report the model worker wedged after S seconds without progress: status says so and "
        "waiting requests get EngineUnresponsive",
    )
    exit_when_wedged: bool = Field(
        _DEFAULT.exit_when_wedged,
        description=f"then exit with status {EXIT_WEDGED}, for a supervisor (systemd Restart=) to restart the daemon",
    )
    curve: bool = Field(
        _DEFAULT.curve,
        description="tcp endpoints speak ZeroMQ CURVE with the key pair in DATA_DIR/keys (`modeld keys` prints "
        "the public key clients need)",
    )
    insecure_tcp: bool = Field(
        _DEFAULT.insecure_tcp,
        description="allow a tcp endpoint beyond loopback without CURVE (anyone reaching it controls the daemon)",
    )
    blob_disk: Size = Field(
        _DEFAULT.blob_disk, description="disk for snapshot blobs; the least recently used are pruned beyond it"
    )
    blob_max_age_days: NonNegative = Field(
        _DEFAULT.blob_max_age_days, description="snapshot blobs unused this long are pruned"
    )
    speculative: bool = Field(
        _DEFAULT.speculative,
        description="speculative decoding of greedy requests by default (a request's `speculative` wins): drafts copied from the "
        "context are checked in one batch, so answers that repeat what the model was shown decode faster",
    )
    stream_interval_ms: NonNegative = Field(
        _DEFAULT.stream_interval_ms,
        description="a decode stream sends at most one frame per this many ms, the tokens decoded meanwhile "
        "together (fewer wake-ups beside the engine; the first token is never held); 0 = a frame per token",
    )
    engine_nice: int = Field(
        _DEFAULT.engine_nice,
        ge=0,
        le=MAX_NICE,
        description="the model's threads run this much nicer than the daemon (Linux), so status, cancel and "
        "heartbeats are answered within milliseconds while a decode keeps every core busy; competing programs "
        "then take the larger share of the cores; 0 = the daemon's own priority",
    )
    # repr=False: the key stays out of logs and tracebacks
    api_key: str = Field(_DEFAULT.api_key, repr=False, description="bearer key the HTTP API requires")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Command line (the init source), then environment, then the config file; no .env, no secrets dir."""
        named: Any = None
        if isinstance(init_settings, InitSettingsSource):
            named = init_settings.init_kwargs.get("config")
        if named is None and isinstance(env_settings, EnvSettingsSource):
            named, _, _ = env_settings.get_field_value(settings_cls.model_fields["config"], "config")
        path = Path(named).expanduser() if named else dirs.config_file()
        return init_settings, env_settings, ConfigFileSource(settings_cls, path, named=bool(named))

    @property
    def config_file(self) -> Path:
        """The config file these settings were read from (it may be absent when it is the default)."""
        return self.config or dirs.config_file()

    def options(self) -> ServeOptions:
        """The resolved settings as the composition root takes them (``modeld.bootstrap.build_daemon``)."""
        values = self.model_dump(exclude={"config"})
        return ServeOptions(**values, config_file=self.config_file if self.config_file.is_file() else None)


class ConfigFileSource(TomlConfigSettingsSource):
    """The config file: pydantic-settings' TOML source, with the file's errors said plainly.

    A file that was named (``--config``, ``$MODELD_CONFIG``) must exist; the
    default one may be absent. The ``[memory]`` table is left to the memory
    planner, and ``config`` cannot name another file from inside one.
    """

    def __init__(self, settings_cls: type[BaseSettings], path: Path, *, named: bool) -> None:
        self.path = path
        if named and not path.is_file():
            raise SettingsError(f"config file {path} does not exist" if not path.exists() else f"{path} is not a file")
        try:
            super().__init__(settings_cls, toml_file=path)
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
        except OSError as exc:
            raise SettingsError(f"config file {path}: {exc.strerror or exc}") from None

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        data: dict[str, Any] = super()._read_file(file_path)
        memory = data.pop(MEMORY_TABLE, {})
        if not isinstance(memory, dict):
            raise SettingsError(f"config file {file_path}: [{MEMORY_TABLE}] must be a table")
        if "config" in data:
            raise SettingsError(f"config file {file_path}: 'config' names a config file; it cannot be set inside one")
        return data


def load_settings(given: Mapping[str, Any] | None = None) -> ServeSettings:
    """``ServeSettings`` from the flags ``given`` (field name → value), over the environment and the config file.

    Raises ``SettingsError`` naming the setting, where its value came from (the
    flag, the variable or the config file) and what is wrong with it.
    """
    flags = dict(given or {})
    try:
        return ServeSettings(**flags)
    except ValidationError as exc:
        raise SettingsError(_describe(exc, flags, os.environ)) from None
    except _SourceError as exc:  # a variable pydantic-settings could not decode
        raise SettingsError(str(exc)) from None


def _describe(exc: ValidationError, flags: Mapping[str, Any], env: Mapping[str, str]) -> str:
    """One line per error: ``setting (source): problem``."""
    known = list(ServeSettings.model_fields)
    config = flags.get("config") or env.get(CONFIG_ENV) or dirs.config_file()
    lines = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(f"unknown setting {name!r} in config file {config}{hint}")
            continue
        if name in flags:
            source = flag_name(name)
        elif env.get(env_name(name)):
            source = env_name(name)
        else:
            source = f"config file {config}"
        problem = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] != "value_error":  # a parser's message already quotes the value
            problem += f" (got {err['input']!r})"
        lines.append(f"{name} ({source}): {problem}")
    return "; ".join(lines)
