"""The daemon commands' settings, typed, from the command line, the environment and a file.

``HttpSettings`` is what ``modeld http`` reads: the HTTP front, the daemon it
talks to, the data directory and the log. ``ServeSettings`` is ``modeld
serve``'s: those (it extends ``HttpSettings``, since ``serve --http`` runs the
same front) and the daemon's own, with the memory planner's policy nested as
``memory`` (``modeld.capacity.Policy``). Every setting is declared once, in
one of the three; the composition root (``modeld.bootstrap``) takes
``ServeSettings`` itself.

Each setting is resolved on its own: command line > environment
(``MODELD_<SETTING>``, e.g. ``MODELD_CACHE_RAM``; empty counts as unset) >
config file > built-in default. The layering is pydantic-settings' sources in
that order: the flags given (argparse suppresses its defaults, so a flag left
out takes no part) are the init source, then ``Environment``, then
``ConfigFileSource`` (a ``TomlConfigSettingsSource``).

The config file is TOML at ``modeld.dirs.config_file()``
(``$XDG_CONFIG_HOME/modeld/config.toml``, else ``~/.config/modeld/config.toml``),
or the one ``--config`` / ``$MODELD_CONFIG`` names. A missing default file is
fine; a named one must exist. Its top-level keys are the settings' names
(``session_ttl = 600``, ``cache_ram = "2GiB"``); an unknown key is refused, so a
typo fails instead of being ignored. ``modeld http`` passes over the keys only
``serve`` reads, as both read the one file.

The memory policy keeps its own names: the file's ``[memory]`` table (keys
``max``, ``reserve``, ``headroom``, ``min_context``, ``default_context``: the
policy's aliases) and the variables of ``MEMORY_SETTINGS`` (``MODELD_MEM_MAX``,
``MODELD_MEM_RESERVE``, ``MODELD_MEM_HEADROOM``, ``MODELD_MIN_CONTEXT``,
``MODELD_DEFAULT_CONTEXT``). ``mem_max`` and ``mem_reserve`` are also flags and
top-level keys, which win over ``[memory]`` ``max`` and ``reserve``.

Sizes go through ``modeld.capacity.sizes.parse_size`` (and "auto" where a budget
has one), so "8GiB" means the same in a flag, a variable and the file. A bad
value raises ``SettingsError`` naming the setting and where it came from.

Over the house's ~400 lines on purpose: it is the one place a setting is declared, and its
sources (flag, environment, file), their layering and the errors that name where a bad value came
from are read with the fields they fill. The command lines made from the settings (flags, ``--help``,
the settings reference) are ``modeld.settings_cli``'s.
"""

from __future__ import annotations

import difflib
import logging
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import AfterValidator, BeforeValidator, Field, PrivateAttr, ValidationError
from pydantic.fields import FieldInfo
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

from backends.registry import ENGINES
from contract.flags import LOAD_GROUP, UNSET, Flag
from contract.types import Config
from runtime.flags import CLIENT_FLAGS, OptionFlag, load_fields, option_flags, option_pairs

from . import dirs
from .capacity.policy import Policy
from .capacity.sizes import parse_size, parse_size_or_auto
from .defaults import (
    DEFAULT_BLOB_BYTES,
    DEFAULT_EMBED_IDLE_S,
    DEFAULT_ENGINE_NICE,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_LEASE_S,
    DEFAULT_LISTEN,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    DEFAULT_SESSION_TTL_S,
    DEFAULT_STREAM_INTERVAL_S,
    DEFAULT_WEDGE_S,
    DEFAULT_WS_PAUSE_LIMIT_S,
    EXIT_WEDGED,
    IMAGE_FETCH_REDIRECTS,
    IMAGE_FETCH_TIMEOUT_S,
    MAX_NICE,
    QUEUE_TIMEOUT_S,
    STREAM_GRACE_S,
)

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "MEMORY_FLAGS",
    "MEMORY_SETTINGS",
    "MEMORY_TABLE",
    "SIZE_SETTINGS",
    "ConfigFileSource",
    "Environment",
    "Flag",
    "GROUPS",
    "HttpSettings",
    "ServeSettings",
    "SettingsError",
    "data_dir_of",
    "env_name",
    "file_keys",
    "flag_name",
    "load_settings",
    "memory_key",
]

ENV_PREFIX = "MODELD_"
#: names another config file (as ``--config`` does)
CONFIG_ENV = ENV_PREFIX + "CONFIG"
#: the config file's table for the memory policy (``ServeSettings.memory``)
MEMORY_TABLE = "memory"
#: the memory policy's settings by their flat names (``MODELD_<NAME>``) → its fields (``modeld.capacity.Policy``)
MEMORY_SETTINGS = {
    "mem_max": "user_limit_bytes",
    "mem_reserve": "reserve_bytes",
    "mem_headroom": "headroom_fraction",
    "min_context": "min_context",
    "default_context": "default_context",
}
#: those of them that are also ``modeld serve`` flags and top-level keys of the config file
MEMORY_FLAGS = ("mem_max", "mem_reserve")
#: the settings that are sizes ("8GiB", "512MB", bytes; "auto" for the cache budgets)
SIZE_SETTINGS = ("mem_max", "mem_reserve", "cache_ram", "cache_disk", "blob_disk", "http_max_body", "max_image_bytes")


class SettingsError(ValueError):
    """A daemon command's setting is malformed or unknown, or the config file is unreadable; the message says which."""


def env_name(setting: str) -> str:
    return ENV_PREFIX + setting.upper()


def flag_name(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def memory_key(setting: str) -> str:
    """The ``[memory]`` key of a memory setting's flat name (``mem_max`` → ``max``)."""
    field = Policy.model_fields[MEMORY_SETTINGS[setting]]
    return field.alias or MEMORY_SETTINGS[setting]


def _size_or_auto(value: Any) -> int | None:
    return None if value is None else parse_size_or_auto(value)


def _backend(value: str) -> str:
    choices = ("auto", *ENGINES)  # as the registry holds them now (an engine registered after import included)
    if value not in choices:
        raise ValueError(f"unknown backend {value!r}; choose one of {', '.join(choices)}")
    return value


# --- the load config's settings ----------------------------------------------------------------------------------
#: ``ServeSettings``' field that nests the preloaded model's load config
LOAD = "load_config"
#: its engine options as NAME=VALUE pairs (``Config.options``' setting)
ENGINE_OPTION = "engine_option"


def load_names() -> dict[str, str]:
    """The load config's settings by their flat names (``gpu_layers``) → ``Config``'s fields (``num_gpu_layers``)."""
    return {s.setting: s.field for s in load_fields()}


def option_flags_of() -> list[OptionFlag]:
    """The registered engines' options (``EngineSpec.options``), each a setting and a flag of its own
    (``runtime.flags.option_flags``), named apart from every other setting and the client commands' own flags."""
    taken = {name for name in ServeSettings.model_fields if name != LOAD} | set(load_names()) | set(MEMORY_SETTINGS)
    return option_flags(((spec.name, spec.title, spec.options) for spec in ENGINES.values() if spec.options),
                        taken | CLIENT_FLAGS)


def _serve_load(value: Any) -> Any:
    """A load config given as a mapping, over the command line's defaults (``Flag.default``: ``gpu_layers`` is
    auto for ``serve``, where a bare ``Config`` asks for the CPU)."""
    if not isinstance(value, Mapping):
        return value
    return {**{s.field: s.flag.default for s in load_fields() if s.flag.default is not UNSET}, **value}


def _nest_load(settings_cls: type[BaseSettings], values: dict[str, Any], source: str) -> dict[str, Any]:
    """``values`` with the load config's flat settings (``load_names``, ``engine_option`` and each engine
    option's own) moved into ``load_config``; ``source`` names where they came from in an error."""
    if LOAD not in settings_cls.model_fields:
        return values
    fields = load_names()
    nested = {fields[name]: values.pop(name) for name in list(values) if name in fields and name != ENGINE_OPTION}
    pairs = values.pop(ENGINE_OPTION, None)
    try:
        chosen = option_pairs(_aliases(pairs) or ())
    except ValueError as exc:
        raise SettingsError(f"{ENGINE_OPTION} ({source}): {exc}") from None
    chosen.update({o.option: values.pop(o.setting) for o in option_flags_of() if o.setting in values})
    if chosen:
        nested["options"] = chosen
    if nested:
        given = values.get(LOAD)
        values[LOAD] = {**(given if isinstance(given, dict) else {}), **nested}
    return values


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


def _pairs(form: str, *, value_required: bool) -> Callable[[tuple[str, ...]], tuple[str, ...]]:
    """The check of NAME=… pairs (``form`` says what one is): a name, and a value where ``value_required``."""

    def check(value: tuple[str, ...]) -> tuple[str, ...]:
        for item in value:
            name, sep, rest = item.partition("=")
            if not sep or not name.strip() or (value_required and not rest.strip()):
                raise ValueError(f"{form}, got {item!r}")
        return value

    return check


def _expand_user(value: Path | None) -> Path | None:
    # a shell expands "~" on the command line, nothing does in a variable or the file
    return value.expanduser() if value is not None else None


#: the help's sections
DAEMON, MODEL, MEMORY, SESSIONS, HTTP = "the daemon", LOAD_GROUP, "memory and caches", "sessions and the engine", \
    "the HTTP APIs"
#: in the order the documentation lists them
GROUPS = (MODEL, MEMORY, SESSIONS, HTTP, DAEMON)


Size = Annotated[int, BeforeValidator(parse_size)]
#: None = "auto": the workspace cache sizes the budget itself
SizeOrAuto = Annotated[int | None, BeforeValidator(_size_or_auto)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
OptionalPath = Annotated[Path | None, AfterValidator(_expand_user)]
#: NAME=MODEL pairs: a list in the config file, comma-separated in the variable
Aliases = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_aliases),
                    AfterValidator(_pairs("an alias is NAME=MODEL", value_required=True))]


class HttpSettings(BaseSettings):
    """``modeld http``'s settings (and ``serve``'s for its front); the field names are the flags'.

    Construct it with the flags given (``load``); the environment and the
    config file fill in the rest.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="forbid", frozen=True)

    config: Annotated[OptionalPath, Flag("PATH", DAEMON)] = Field(
        None, description="settings file, TOML: keys are these settings' names, e.g. session_ttl = 600"
    )
    endpoint: Annotated[str | None, Flag(None, DAEMON, help={"http": "the daemon: ipc://PATH or tcp://HOST:PORT"})] = Field(None, description="ipc://PATH or tcp://HOST:PORT")
    data_dir: Annotated[OptionalPath, Flag(None, DAEMON, help={"http": "stored responses and the signing key, the daemon's data dir"})] = Field(
        None, description="snapshot blobs, stored HTTP responses, keys and state"
    )
    log_level: Annotated[str, AfterValidator(_log_level), Flag(None, DAEMON)] = Field(
        "INFO", description="DEBUG, INFO, WARNING, ERROR or CRITICAL"
    )
    log_format: Annotated[Literal["plain", "json"], Flag(None, DAEMON)] = Field(
        "plain", description="plain lines, or one JSON object per line (access-log fields as keys)"
    )
    http: Annotated[str | None, Flag("HOST:PORT", HTTP, help={"http": "serve the HTTP APIs there"}, unset={"http": DEFAULT_LISTEN})] = Field(
        None, description="also serve an OpenAI-compatible HTTP API there, e.g. 127.0.0.1:8377"
    )
    http_allow_remote: Annotated[bool, Flag(None, HTTP)] = Field(False, description="let --http bind a non-loopback address")
    # repr=False: the key stays out of logs and tracebacks
    api_key: Annotated[str, Flag(None, HTTP)] = Field("", repr=False, description="bearer key the HTTP API requires")
    http_queue_timeout: Annotated[NonNegative, Flag("S", HTTP)] = Field(
        QUEUE_TIMEOUT_S, description="seconds an HTTP request waits for a busy slot before 503"
    )
    http_stream_grace: Annotated[NonNegative, Flag("S", HTTP)] = Field(
        STREAM_GRACE_S,
        description="seconds a streamed HTTP request waits for a busy slot before its stream starts; it then sends "
        "keep-alives while it waits, and a refusal (the queue timeout) is the stream's error event",
    )
    http_max_body: Annotated[Size, Flag(None, HTTP)] = Field(
        DEFAULT_MAX_BODY_BYTES, description="largest HTTP request body; a larger one is refused with 413 unread"
    )
    http_max_connections: Annotated[int, Field(ge=1), Flag("N", HTTP)] = Field(
        DEFAULT_MAX_CONNECTIONS,
        description="open HTTP connections served at once; one past it is answered 503 and closed (the open files "
        "limit is raised where allowed, and the cap kept under it so ZeroMQ clients always find descriptors)",
    )
    http_header_timeout: Annotated[NonNegative, Flag("S", HTTP)] = Field(
        DEFAULT_HEADER_TIMEOUT_S,
        description="seconds an HTTP connection may take to send a request head before it is answered 408 and "
        "closed (0 = no limit); a request being answered is never cut",
    )
    strict_model_names: Annotated[bool, Flag(None, HTTP)] = Field(
        False,
        description="refuse (404) an HTTP request naming a model the daemon does not serve, instead of serving it "
        "with the loaded model (agents hard-code model names)",
    )
    switch_on_request: Annotated[bool, Flag(None, HTTP)] = Field(
        True,
        description="an HTTP request naming another model the daemon knows (its store: modeld pull / modeld ls) "
        "switches the slot to it once the current request is done; off: refuse it (409) with the names served",
    )
    keep_billing_header: Annotated[bool, Flag(None, HTTP)] = Field(
        False,
        description="Messages API: keep a system block that only carries a client's billing header (Claude Code "
        "rewrites it every request, so by default it is left out of the prompt to keep the prefix warm)",
    )
    alias: Annotated[Aliases, Flag("NAME=MODEL", HTTP)] = Field(
        (), description="NAME=MODEL: HTTP requests for model NAME are served by MODEL (repeatable)"
    )
    grpc: Annotated[str | None, Flag("HOST:PORT", HTTP)] = Field(
        None, description="also serve Evergreen sessions over bidirectional gRPC there, beside the HTTP front "
        "(needs --http and the grpc extra), e.g. 127.0.0.1:8378"
    )
    allow_file_refs: Annotated[OptionalPath, Flag("DIR", HTTP)] = Field(
        None, description="Evergreen: file:// chunk references may read files under DIR (refused without it)"
    )
    max_images: Annotated[int, Field(ge=0), Flag("N", HTTP)] = Field(
        DEFAULT_MAX_IMAGES, description="images one HTTP request may carry; more is refused with 413"
    )
    max_image_bytes: Annotated[Size, Flag(None, HTTP)] = Field(
        DEFAULT_MAX_IMAGE_BYTES, description="largest image in an HTTP request, decoded; a larger one is refused with 413"
    )
    allow_image_urls: Annotated[bool, Flag(None, HTTP)] = Field(
        False, description="fetch images that requests name by http(s) URL (never from loopback, link-local or "
        f"reserved addresses; --max-image-bytes, {IMAGE_FETCH_TIMEOUT_S:.0f} s, {IMAGE_FETCH_REDIRECTS} redirects); "
        "without it they are refused with 400"
    )
    max_image_pixels: Annotated[int, Field(ge=1), Flag("N", HTTP)] = Field(
        DEFAULT_MAX_IMAGE_PIXELS,
        description="largest image in an HTTP request, width times height, read from its header before anything is "
        "decoded; a larger one is refused with 413",
    )
    ws_pause_limit: Annotated[NonNegative, Flag("S", HTTP)] = Field(
        DEFAULT_WS_PAUSE_LIMIT_S,
        description="seconds a paused WebSocket generation (/v1/ws) keeps the slot; past it the generation ends "
        "with a recoverable error and the slot goes to the next request",
    )

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
        flags: dict[str, Any] = dict(init_settings.init_kwargs) if isinstance(init_settings, InitSettingsSource) else {}
        env = Environment(settings_cls)
        named: Any = flags.get("config")
        if named is None:
            named, _, _ = env.get_field_value(settings_cls.model_fields["config"], "config")
        path = Path(named).expanduser() if named else dirs.config_file()
        return (
            InitSettingsSource(settings_cls, _nest_load(settings_cls, _nest_memory(settings_cls, flags), flag_name(ENGINE_OPTION))),
            env,
            ConfigFileSource(settings_cls, path, named=bool(named)),
        )

    @classmethod
    def load(cls, given: Mapping[str, Any] | None = None) -> Self:
        """The settings from the flags ``given`` (setting name → value), over the environment and the config file.

        Raises ``SettingsError`` naming the setting, where its value came from
        (the flag, the variable or the config file) and what is wrong with it.
        """
        flags = dict(given or {})
        try:
            return cls(**flags)
        except ValidationError as exc:
            raise SettingsError(_describe(exc, flags, os.environ)) from None
        except _SourceError as exc:  # a variable pydantic-settings could not decode
            raise SettingsError(str(exc)) from None

    @property
    def data_home(self) -> Path:
        """The data directory: ``data_dir``, else the platform's (``modeld.dirs.data_dir``)."""
        return self.data_dir or dirs.data_dir()

    @property
    def aliases(self) -> dict[str, str]:
        """``alias`` as a mapping: model NAME → the MODEL that serves it."""
        return option_pairs(self.alias)

    @property
    def config_file(self) -> Path:
        """The config file these settings were read from (it may be absent when it is the default)."""
        return self.config or dirs.config_file()


class ServeSettings(HttpSettings):
    """Every ``modeld serve`` setting: ``HttpSettings``' and the daemon's, the memory policy nested as ``memory``.

    The field names are the flags' (``--cache-ram`` → ``cache_ram``), the
    memory policy's flags aside (``MEMORY_FLAGS``). ``build_daemon`` takes it.
    """

    backend: Annotated[str, AfterValidator(_backend), Flag(None, MODEL)] = Field(
        "auto",
        description="the engine; auto: OpenVINO on x86-64 for a model it converts (the faster engine here), "
        "else llama.cpp; status says which and why",
    )
    model: Annotated[str | None, Flag(None, MODEL)] = Field(
        None, description="model to preload (default: the bundled model for llama/openvino)"
    )
    model_name: Annotated[str | None, Flag(None, MODEL)] = Field(None, description="logical name of the preloaded model")
    pull: Annotated[bool, Flag(None, MODEL)] = Field(
        False,
        description="--model names a Hugging Face model (user/repo:QUANT) not yet in the store: pull it first "
        "(never done without this flag)",
    )
    load_config: Annotated[Config, BeforeValidator(_serve_load)] = Field(
        default_factory=lambda: Config.model_validate(_serve_load({})),
        description="the preloaded model's load config (``contract.types.Config``): each of its fields with a "
        "flag is a setting by its flat name (``num_ctx``, ``gpu_layers``, …), and each engine option one of its own "
        "(``load_names``, ``option_flags``)",
    )
    owner: Annotated[str, Flag(None, SESSIONS)] = Field("", description="owner instance id for fencing")
    memory: Policy = Field(
        Policy(),
        description="the memory planner's policy: the config file's [memory] table, MEMORY_SETTINGS' variables, "
        "--mem-max and --mem-reserve",
    )
    lease: Annotated[Positive, Flag("S", SESSIONS)] = Field(DEFAULT_LEASE_S, description="seconds a silent client keeps its session")
    no_preload: Annotated[bool, Flag(None, MODEL)] = Field(False, description="start with an empty slot")
    idle_unload: Annotated[NonNegative, Flag("S", SESSIONS)] = Field(
        0.0,
        description="unload the chat model after S seconds with no session and no operation (0 = never)",
    )
    session_ttl: Annotated[NonNegative, Flag("S", SESSIONS)] = Field(
        DEFAULT_SESSION_TTL_S,
        description="release a session that sent no operation for S seconds, even while its client renews the "
        "lease (0 = never; any operation, explain included, refreshes it)",
    )
    embed_idle: Annotated[NonNegative, Flag("S", SESSIONS)] = Field(DEFAULT_EMBED_IDLE_S, description="seconds before an idle embedding model is unloaded")
    sessions: Annotated[int | None, Field(ge=1, le=256), Flag("N", SESSIONS)] = Field(
        None,
        description="sessions served at once on an engine that batches (vllm: each a request of its own in flight "
        "on the server, the HTTP APIs' turns included); default: 4 on vllm, 1 on the memory backend. llama.cpp and "
        "OpenVINO hold one KV: they serve one session at a time, the others wait for the slot",
    )
    memory_token_delay_ms: Annotated[NonNegative, Flag("MS", SESSIONS)] = Field(
        0.0, description="memory backend only: simulated time per generated token"
    )
    prefill_chunk_delay_ms: Annotated[NonNegative, Flag("MS", SESSIONS)] = Field(
        0.0, description="hold each prefill chunk back MS milliseconds: a slower machine on demand, for tests and "
        "demonstrations of a long first request (a cancel still stops it at once; 0 = off)",
    )
    slow_prefix_s: Annotated[NonNegative, Flag("S", SESSIONS)] = Field(
        0.0, description="hold a stable prefix's prefill back so that it takes at least S seconds: an agent's long "
        "first request on a machine that slow, while its later turns (the prefix reused) run at this one's speed; "
        "for trying an agent's patience (a cancel still stops it at once; 0 = off)",
    )
    temperature: Annotated[float | None, Field(ge=0.0, le=10.0), Flag("T", MODEL)] = Field(
        None,
        description="temperature of requests that set no sampling parameter (default: the model's recommended "
        "sampling, else 0.8 with top-k 40, top-p 0.95, min-p 0.05); 0 = greedy, which speculative decoding needs",
    )
    max_tokens: Annotated[int | None, Field(ge=1), Flag("N", MODEL)] = Field(
        None,
        description="the reply length of requests that set none, as llama-server's --n-predict (default: until the "
        "end of generation or the context's end); a request's own limit is kept",
    )
    cache_ram: Annotated[SizeOrAuto, Flag(None, MEMORY)] = Field(
        None,
        description="RAM for the workspace cache of prefix states, e.g. 2GiB; 0 = off; "
        "auto = half of what the model leaves spare, at most 4GiB",
    )
    cache_disk: Annotated[SizeOrAuto, Flag(None, MEMORY)] = Field(
        None,
        description="disk for the workspace cache (survives restarts), e.g. 8GiB; 0 = off; "
        "auto = a quarter of the free space, at most 16GiB",
    )
    cache_dir: Annotated[OptionalPath, Flag(None, MEMORY)] = Field(None, description="workspace cache directory (default DATA_DIR/cache)")
    wedge_timeout: Annotated[Positive, Flag("S", SESSIONS)] = Field(
        DEFAULT_WEDGE_S,
        description="report the model worker wedged after S seconds without progress: status says so and "
        "waiting requests get EngineUnresponsive",
    )
    exit_when_wedged: Annotated[bool, Flag(None, SESSIONS)] = Field(
        False,
        description=f"then exit with status {EXIT_WEDGED}, for a supervisor (systemd Restart=) to restart the daemon",
    )
    curve: Annotated[bool, Flag(None, DAEMON)] = Field(
        False,
        description="tcp endpoints speak ZeroMQ CURVE with the key pair in DATA_DIR/keys (`modeld keys` prints "
        "the public key clients need)",
    )
    insecure_tcp: Annotated[bool, Flag(None, DAEMON)] = Field(
        False,
        description="allow a tcp endpoint beyond loopback without CURVE (anyone reaching it controls the daemon)",
    )
    blob_disk: Annotated[Size, Flag(None, MEMORY)] = Field(
        DEFAULT_BLOB_BYTES, description="disk for snapshot blobs; the least recently used are pruned beyond it"
    )
    blob_max_age_days: Annotated[NonNegative, Flag("DAYS", MEMORY)] = Field(
        7.0, description="snapshot blobs unused this long are pruned"
    )
    speculative: Annotated[bool, Flag(None, MODEL)] = Field(
        True,
        description="speculative decoding of greedy requests by default (a request's `speculative` wins): drafts copied from the "
        "context are checked in one batch, so answers that repeat what the model was shown decode faster",
    )
    readouts: Annotated[OptionalPath, Flag("FILE", MODEL)] = Field(
        None,
        description="a readout manifest (safetensors: per layer, one direction per concept; see the docs' Readouts): "
        "a prefill that asks gets each token's residual stream dotted with them",
    )
    stream_interval_ms: Annotated[NonNegative, Flag("MS", SESSIONS)] = Field(
        DEFAULT_STREAM_INTERVAL_S * 1000,
        description="a decode stream sends at most one frame per this many ms, the tokens decoded meanwhile "
        "together (fewer wake-ups beside the engine; the first token is never held); 0 = a frame per token",
    )
    engine_nice: Annotated[int, Flag("N", SESSIONS)] = Field(
        DEFAULT_ENGINE_NICE,
        ge=0,
        le=MAX_NICE,
        description="the model's threads run this much nicer than the daemon (Linux): status, cancel and "
        "heartbeats are answered a few ms sooner while a decode keeps every core busy, but any other busy "
        "program then takes the larger share of the cores from the engine; 0 (the default) = one priority",
    )

    #: why ``backend`` was picked when it was "auto" (status shows it); derived, not a setting
    _backend_reason: str = PrivateAttr("")

    @property
    def backend_reason(self) -> str:
        return self._backend_reason

    def with_backend(self, backend: str, reason: str) -> ServeSettings:
        """These settings with ``backend`` picked for "auto", and why (``modeld.bootstrap.resolve_backend``)."""
        picked = self.model_copy(update={"backend": backend})
        picked._backend_reason = reason
        return picked


def _nest_memory(settings_cls: type[BaseSettings], values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the memory flags (``mem_max``, ``mem_reserve``) moved into ``memory``, over its own keys."""
    if "memory" not in settings_cls.model_fields:
        return values
    flat = {memory_key(name): values.pop(name) for name in MEMORY_FLAGS if name in values}
    if flat:
        given = values.get("memory")
        values["memory"] = {**(given if isinstance(given, dict) else {}), **flat}
    return values


class Environment(EnvSettingsSource):
    """The environment: ``MODELD_<SETTING>``, and the memory policy's variables (``MEMORY_SETTINGS``) in ``memory``."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        if field_name in ("memory", LOAD):  # read from their own variables below, never as JSON
            return None, field_name, False
        return super().get_field_value(field, field_name)

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        data.pop("memory", None)
        data.pop(LOAD, None)
        if LOAD in self.settings_cls.model_fields:
            names = [*load_names(), *(o.setting for o in option_flags_of())]
            found = {name: self.env_vars.get(env_name(name).lower()) for name in names}
            data.update({name: value for name, value in found.items() if value})
            _nest_load(self.settings_cls, data, env_name(ENGINE_OPTION))
        if "memory" in self.settings_cls.model_fields:
            found = {name: self.env_vars.get(env_name(name).lower()) for name in MEMORY_SETTINGS}
            memory = {memory_key(name): value for name, value in found.items() if value}
            if memory:
                data["memory"] = memory
        return data


class ConfigFileSource(TomlConfigSettingsSource):
    """The config file: pydantic-settings' TOML source, with the file's errors said plainly.

    A file that was named (``--config``, ``$MODELD_CONFIG``) must exist; the
    default one may be absent. Its ``[memory]`` table and the top-level
    ``mem_max`` / ``mem_reserve`` become ``memory`` where the settings have one;
    elsewhere they, and every key only another command reads, are passed over
    (``serve`` and ``http`` share the file). ``config`` cannot name another file
    from inside one.
    """

    def __init__(self, settings_cls: type[BaseSettings], path: Path, *, named: bool) -> None:
        self.path = path
        self._for = settings_cls  # the base's __init__ reads the file, before it sets settings_cls
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
        table = data.pop(MEMORY_TABLE, {})
        if not isinstance(table, dict):
            raise SettingsError(f"config file {file_path}: [{MEMORY_TABLE}] must be a table")
        if "config" in data:
            raise SettingsError(f"config file {file_path}: 'config' names a config file; it cannot be set inside one")
        fields = self._for.model_fields
        if "memory" not in fields:
            return {key: value for key, value in data.items() if key in fields or key not in file_keys()}
        known = {memory_key(name) for name in MEMORY_SETTINGS}
        unknown = sorted(set(table) - known)
        if unknown:
            raise SettingsError(
                f"config file {file_path}: unknown [{MEMORY_TABLE}] keys {unknown}; known: {sorted(known)}"
            )
        if table:
            data["memory"] = table
        if LOAD in data:
            raise SettingsError(f"config file {file_path}: the load config's settings are top-level keys "
                                f"({', '.join(list(load_names())[:3])}, …), not {LOAD!r}")
        return _nest_load(self._for, _nest_memory(self._for, data), f"config file {file_path}")


def data_dir_of(given: Path | None = None) -> Path:
    """The data directory a command works in: ``given`` (its ``--data-dir``), else ``data_dir`` as ``modeld serve``
    resolves it (``MODELD_DATA_DIR``, else the config file's, else the platform's), so the store, ``modeld keys``,
    ``prepare`` and ``pull`` find what the daemon keeps. A config file that does not load raises SettingsError."""
    if given is not None:
        return Path(given).expanduser()
    return HttpSettings.load().data_home


def file_keys() -> list[str]:
    """The config file's top-level keys: every setting of every command, the memory flags for ``memory``, the load
    config's settings for ``load_config``."""
    return ([name for name in ServeSettings.model_fields if name not in ("memory", LOAD)] + list(MEMORY_FLAGS)
            + list(load_names()) + [o.setting for o in option_flags_of()])


def load_settings(given: Mapping[str, Any] | None = None) -> ServeSettings:
    """``ServeSettings.load``: ``modeld serve``'s settings from the flags ``given``."""
    return ServeSettings.load(given)


def _describe(exc: ValidationError, flags: Mapping[str, Any], env: Mapping[str, str]) -> str:
    """One line per error: ``setting (source): problem``; a memory setting's the memory policy's way."""
    config = flags.get("config") or env.get(CONFIG_ENV) or dirs.config_file()
    lines = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            close = difflib.get_close_matches(name, file_keys(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(f"unknown setting {name!r} in config file {config}{hint}")
            continue
        problem = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] != "value_error":  # a parser's message already quotes the value
            problem += f" (got {err['input']!r})"
        if name == "memory" and len(err["loc"]) > 1:
            lines.append(_describe_memory(str(err["loc"][1]), problem, flags, env, Path(config)))
            continue
        if name == LOAD and len(err["loc"]) > 1:  # a field of the load config: its flat setting's name
            name = {field: setting for setting, field in load_names().items()}.get(str(err["loc"][1]), name)
        if name in flags:
            source = flag_name(name)
        elif env.get(env_name(name)):
            source = env_name(name)
        else:
            source = f"config file {config}"
        lines.append(f"{name} ({source}): {problem}")
    return "; ".join(lines)


def _describe_memory(key: str, problem: str, flags: Mapping[str, Any], env: Mapping[str, str], config: Path) -> str:
    """``mem_max (SOURCE): problem`` for a memory flag's value, else ``SOURCE: problem`` (``[memory] headroom``)."""
    name = next((n for n in MEMORY_SETTINGS if key in (memory_key(n), MEMORY_SETTINGS[n])), key)
    if name in flags:
        return f"{name} ({flag_name(name)}): {problem}"
    if env.get(env_name(name)):
        return f"{name} ({env_name(name)}): {problem}" if name in MEMORY_FLAGS else f"{env_name(name)}: {problem}"
    if name in MEMORY_FLAGS and name in _top_level_keys(config):
        return f"{name} (config file {config}): {problem}"
    return f"[{MEMORY_TABLE}] {memory_key(name) if name in MEMORY_SETTINGS else key}: {problem}"


def _top_level_keys(config: Path) -> set[str]:
    try:
        with config.open("rb") as f:
            return set(tomllib.load(f))
    except (OSError, tomllib.TOMLDecodeError):  # it was read a moment ago; say [memory] if it cannot be now
        return set()
