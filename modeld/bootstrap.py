"""The composition root: the only module of modeld that imports a concrete backend.

``build_daemon(options)`` wires what ``modeld serve`` runs: the backend, the
memory planner, the embedding side slot, the slot service and the daemon with
its blob store. Each piece has its own builder, and ``build_slot`` /
``build_daemon`` take a ready backend, so tests pass fakes (the contract's
``MemoryBackend``) through the same door. The engines are the entries of
``backends.registry``, whose factories import an engine only when called: a
memory-backend daemon never loads one, and no engine is named here.

``prepare_models`` is the same choice for ``modeld prepare``: which converters
turn the bundled models into the formats the backends serve.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from backends.registry import ENGINES
from contract.endpoint import default_endpoint
from contract.interfaces import Backend, Embedder, StateCache
from contract.types import Config, KVCacheType, LoadModelRequest

from . import dirs
from .blobs import DEFAULT_MAX_BYTES, BlobStore
from .capacity import make_budget_check, make_planner
from .engine_choice import EngineFacts, choose_backend
from .netsec import check_tcp_exposure, server_keys
from .server import DEFAULT_ENGINE_NICE, DEFAULT_STREAM_INTERVAL_S, DEFAULT_WEDGE_S, Daemon
from .slot import DEFAULT_LEASE_S, DEFAULT_SESSION_TTL_S, Planner, SlotService
from .state_cache import StateCacheStore

__all__ = [
    "BACKENDS",
    "BACKEND_CHOICES",
    "PREPARE_STEPS",
    "ServeOptions",
    "build_backend",
    "build_cache",
    "build_daemon",
    "build_embedder",
    "build_planner",
    "build_slot",
    "default_data_dir",
    "embed_cache_dir",
    "model_cache_dir",
    "prepare_models",
    "prepare_steps",
    "preload_request",
    "resolve_backend",
]

#: the registered engines (``backends.registry``) and the contract's reference backend
BACKENDS = (*ENGINES, "memory")
#: what ``--backend`` accepts: a backend, or ``auto`` (``modeld.engine_choice``)
BACKEND_CHOICES = ("auto", *BACKENDS)


def prepare_steps() -> tuple[str, ...]:
    """What ``modeld prepare --only`` accepts: the engines' conversion steps (named as the engine), then the
    embedding models'."""
    return (*(spec.name for spec in ENGINES.values() if spec.prepare is not None), "embed")


PREPARE_STEPS = prepare_steps()


@dataclass(frozen=True)
class ServeOptions:
    """The resolved ``modeld serve`` settings (``modeld.settings.ServeSettings.options``); field names are the flags'.

    Sizes are bytes, already parsed; these defaults are the settings' built-in ones.
    """

    #: a BACKENDS name, or "auto" (``resolve_backend`` picks one and says why)
    backend: str = "auto"
    #: why ``backend`` was picked when it was "auto" (status shows it)
    backend_reason: str = ""
    #: "" or None = the per-user default endpoint
    endpoint: str | None = None
    #: model to preload; None = the bundled model for llama/openvino, nothing for memory
    model: str | None = None
    model_name: str | None = None
    num_ctx: int = 0
    #: llama.cpp's attention kernel and KV cache type for the preloaded model ("": the engine's default)
    flash_attn: bool = False
    kv_cache_type: KVCacheType = ""
    #: decoded tokens computed as a prefill computes them (``contract.types.Config.exact_decode``)
    exact_decode: bool = False
    #: the preloaded model's chat template (``contract.types.Config.chat_template``; "": its own)
    chat_template: str = ""
    #: the preloaded model's tool-call format (``contract.types.Config.tool_format``; "": from its template)
    tool_format: str = ""
    owner: str = ""
    #: snapshot blobs and state; None = ``default_data_dir()``
    data_dir: Path | None = None
    #: --mem-max / --mem-reserve in bytes; None = not set (the memory planner reads its environment and [memory])
    mem_max: int | None = None
    mem_reserve: int | None = None
    lease: float = DEFAULT_LEASE_S
    #: seconds without a session or an operation before the chat model is unloaded (0 = never)
    idle_unload: float = 0.0
    #: seconds a session may go without an operation (heartbeats aside) before it is released
    session_ttl: float = DEFAULT_SESSION_TTL_S
    no_preload: bool = False
    #: seconds before an idle embedding model is unloaded
    embed_idle: float = 300.0
    #: memory backend only: simulated time per generated token
    memory_token_delay_ms: float = 0.0
    log_level: str = "INFO"
    #: HOST:PORT of the OpenAI-compatible HTTP front (None: no front)
    http: str | None = None
    http_allow_remote: bool = False
    #: a bearer key the HTTP front requires ("" = none)
    api_key: str = ""
    #: how long an HTTP request waits for the slot while another holds it
    http_queue_timeout: float = 300.0
    #: the largest HTTP request body, in bytes (413 past it)
    http_max_body: int = 32 * 1024 * 1024
    #: open HTTP connections served at once (503 past it; kept under the open files limit)
    http_max_connections: int = 512
    #: seconds an HTTP connection may take to send a request head (408 and closed past it; 0 = no limit)
    http_header_timeout: float = 30.0
    #: HTTP requests naming a model the daemon does not serve: refused (404) instead of served by the loaded one
    strict_model_names: bool = False
    #: Messages API: keep a system block that only carries a client's per-request billing header
    keep_billing_header: bool = False
    #: NAME=MODEL: HTTP requests for NAME are served by MODEL
    alias: tuple[str, ...] = ()
    #: the temperature of requests that set no sampling parameter (None: the model's recommendation)
    temperature: float | None = None
    #: "plain" or "json" (one JSON object per log line)
    log_format: Literal["plain", "json"] = "plain"
    #: workspace cache budgets in bytes (None = auto: the cache sizes them; 0 = off) and its directory
    #: (None = ``<data dir>/cache``)
    cache_ram: int | None = None
    cache_disk: int | None = None
    cache_dir: Path | None = None
    #: tcp security (``modeld.netsec``): speak CURVE with the key pair in DATA_DIR/keys, or
    #: accept an open non-loopback socket
    curve: bool = False
    insecure_tcp: bool = False
    #: seconds without progress before the model worker is reported wedged, and whether to exit then
    wedge_timeout: float = DEFAULT_WEDGE_S
    exit_when_wedged: bool = False
    #: snapshot blob store limits: bytes and an age in days
    blob_disk: int = DEFAULT_MAX_BYTES
    blob_max_age_days: float = 7.0
    #: the config file the settings came from (None: none); the memory planner reads its [memory] table
    config_file: Path | None = None
    #: prompt-lookup speculative decoding unless a request says otherwise (``backends.tape.speculate``)
    speculative: bool = True
    #: a decode stream sends at most one frame per this many milliseconds (``modeld.coalesce``; 0 = one per token)
    stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_S * 1000
    #: the model workers' threads run this much nicer than the daemon (``modeld.priority``; 0 = the same)
    engine_nice: int = DEFAULT_ENGINE_NICE


def default_data_dir() -> Path:
    """``--data-dir`` when not given: ``$XDG_DATA_HOME/modeld``, else ``~/.local/share/modeld`` (``modeld.dirs``)."""
    return dirs.data_dir()


def engine_facts(model: str, num_gpu_layers: int = 0, exclusive: dict[str, str] | None = None) -> EngineFacts:
    """The facts ``choose_backend`` needs about this machine and ``model`` (a GGUF file or an engine's own format)."""
    p = Path(model)
    installed = frozenset(s.name for s in ENGINES.values() if importlib.util.find_spec(s.package) is not None)
    own = next((s.own_kind for s in ENGINES.values() if s.is_own_model is not None and s.is_own_model(p)), "")
    refusals: dict[str, str] = {}
    if own:
        kind = own
    elif p.is_dir():
        kind = "other"
    else:
        from backends.gguf_file import is_gguf

        kind = "gguf" if p.is_file() and is_gguf(p) else "other"
        if kind == "gguf":  # an engine's reader is imported only where its package is installed
            refusals = {s.name: s.refusal(p) for s in ENGINES.values() if s.refusal is not None and s.name in installed}
    return EngineFacts(
        machine=platform.machine(),
        installed=installed,
        model_kind=kind,
        refusals=refusals,
        num_gpu_layers=num_gpu_layers,
        exclusive=exclusive or {},
    )


def exclusive_settings(opts: ServeOptions) -> dict[str, str]:
    """Per engine, the flags among ``opts`` that only it serves (none: empty): ``auto`` then picks it."""
    cfg = load_config(opts)
    return {s.name: given for s in ENGINES.values() if s.exclusive_settings is not None
            and (given := s.exclusive_settings(cfg))}


def resolve_backend(opts: ServeOptions) -> ServeOptions:
    """``opts`` with ``backend="auto"`` replaced by the engine ``choose_backend`` picks for the preloaded model."""
    if opts.backend != "auto":
        return opts
    model = opts.model
    if model is None:
        from backends.bundled import served_bundled_gguf

        model = str(served_bundled_gguf())
    name, reason = choose_backend(engine_facts(model, exclusive=exclusive_settings(opts)))
    return dataclasses.replace(opts, backend=name, backend_reason=f"auto: {reason}")


def build_cache(opts: ServeOptions) -> StateCacheStore | None:
    """The workspace cache for the tape engines (none for the memory backend, or with both budgets 0)."""
    if opts.backend == "memory":
        return None
    if opts.cache_ram == 0 and opts.cache_disk == 0:
        return None
    directory = opts.cache_dir or (opts.data_dir or default_data_dir()) / "cache"
    return StateCacheStore(directory, ram_budget=opts.cache_ram, disk_budget=opts.cache_disk)


def build_backend(opts: ServeOptions, cache: StateCache | None = None) -> Backend:
    if opts.backend == "memory":
        from backends.memory import MemoryBackend

        return MemoryBackend(token_delay_s=opts.memory_token_delay_ms / 1000.0)
    spec = ENGINES.get(opts.backend)
    if spec is not None:
        return spec.backend(cache, opts.speculative)
    raise SystemExit(f"unknown backend {opts.backend!r}; choose one of {', '.join(BACKEND_CHOICES)}")


def build_planner(opts: ServeOptions) -> Planner:
    """The memory planner (``modeld.capacity``): --mem-max/--mem-reserve over env over config file."""
    return make_planner(mem_max=opts.mem_max, mem_reserve=opts.mem_reserve, config_file=opts.config_file)


def build_embedder(opts: ServeOptions, generation_bytes: Callable[[], int]) -> Embedder | None:
    """The embedding side slot for the backend (none for the memory backend).

    ``generation_bytes`` is what the generation model holds now: the side slot's
    budget check takes it off --mem-max, which both models share.
    """
    if opts.backend == "memory":
        return None
    from .embedding_slot import EmbeddingSlot

    check = make_budget_check(opts.mem_max, opts.mem_reserve, other_bytes=generation_bytes, config_file=opts.config_file)
    return EmbeddingSlot(ENGINES[opts.backend].embedder(), idle_unload_s=opts.embed_idle, budget_check=check)


def build_slot(
    opts: ServeOptions, endpoint: str, backend: Backend | None = None, cache: StateCacheStore | None = None
) -> SlotService:
    """The slot service over ``backend`` (default: the one ``opts`` names), with its planner, side slot and
    workspace cache (built from ``opts`` with the backend; a given backend comes with its own ``cache``)."""
    opts = resolve_backend(opts)
    if backend is None:
        cache = build_cache(opts)
        backend = build_backend(opts, cache)
    # The side slot's budget check asks the slot what the generation model holds,
    # and the slot needs the side slot: the check reads the slot through this box.
    built: list[SlotService] = []
    embedder = build_embedder(opts, lambda: built[0].generation_resident_bytes() if built else 0)
    slot = SlotService(
        backend,
        owner=opts.owner,
        lease_s=opts.lease,
        planner=build_planner(opts),
        endpoint=endpoint,
        embedder=embedder,
        cache=cache,
        backend_reason=opts.backend_reason,
        idle_unload_s=opts.idle_unload,
        session_ttl_s=opts.session_ttl,
        default_temperature=opts.temperature,
    )
    built.append(slot)
    return slot


def build_daemon(opts: ServeOptions, backend: Backend | None = None) -> Daemon:
    """The daemon, bound to nothing yet (``Daemon.serve`` binds), with its slot and snapshot blob store."""
    endpoint = opts.endpoint or default_endpoint()
    check_tcp_exposure(endpoint, curve=opts.curve, insecure=opts.insecure_tcp)  # ValueError before anything starts
    data_dir = opts.data_dir or default_data_dir()
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # snapshots and cached KV: the user's alone
    curve_keys = server_keys(data_dir) if opts.curve else None
    slot = build_slot(opts, endpoint, backend)
    blobs = BlobStore(data_dir / "blobs", max_bytes=opts.blob_disk, max_age_s=opts.blob_max_age_days * 86400)
    return Daemon(slot, endpoint, blobs, curve_keys=curve_keys, wedge_s=opts.wedge_timeout,
                  exit_when_wedged=opts.exit_when_wedged, stream_interval_s=opts.stream_interval_ms / 1000,
                  engine_nice=opts.engine_nice)


def preload_request(opts: ServeOptions) -> LoadModelRequest | None:
    """The model to load at start: ``--model``, else the bundled model for an engine; None for none."""
    if opts.no_preload:
        return None
    model, name = opts.model, opts.model_name
    if model is None and opts.backend in ENGINES:
        from backends.bundled import BUNDLED_MODEL_NAME, served_bundled_gguf

        model = str(served_bundled_gguf())  # its context extended four-fold (``backends.bundled``)
        name = name or BUNDLED_MODEL_NAME
    if not model:
        return None
    return LoadModelRequest(
        owner_instance_id=opts.owner,
        model_name=name or Path(model).name,
        type=opts.backend,
        path=model,
        config=load_config(opts),
    )


def load_config(opts: ServeOptions) -> Config:
    """The preloaded model's load config, from the flags."""
    return Config(
        num_ctx=opts.num_ctx,
        flash_attn=opts.flash_attn,
        kv_cache_type=opts.kv_cache_type,
        exact_decode=opts.exact_decode,
        chat_template=opts.chat_template,
        tool_format=opts.tool_format,
    )


# --- modeld prepare -----------------------------------------------------------------------


def model_cache_dir() -> Path:
    """Where converted models live ($MODELD_MODEL_CACHE, .cache/models in a checkout, ~/.cache/modeld/models)."""
    from backends.bundled import model_cache_dir as cache_dir

    return cache_dir()


def embed_cache_dir() -> Path:
    """Where the converted embedding models live, inside ``model_cache_dir()``."""
    from backends.embed_prepare import embed_cache_dir as cache_dir

    return cache_dir()


def prepare_models(
    *,
    only: str | None = None,
    gguf: Path | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> list[Path]:
    """Convert the bundled models once into what the backends serve; return the output paths.

    * an engine's step (``EngineSpec.prepare``, named as the engine): the bundled GGUF and the copy `serve`
      preloads (or ``gguf``) to the engine's own format (OpenVINO's IR directories);
    * ``embed``: the bundled embedding model to a GGUF and an OpenVINO IR
      (``backends.embed_prepare``); ``force`` rebuilds these two.

    ``only`` picks one step (``PREPARE_STEPS``). Each step keeps an output that is
    already complete, so a second run converts nothing. Raises what the
    converters raise (OSError, ValueError, RuntimeError) with the reason.
    """
    steps = prepare_steps()
    if only is not None and only not in steps:
        raise ValueError(f"unknown preparation step {only!r}; choose one of {', '.join(steps)}")
    out: list[Path] = []
    for spec in ENGINES.values():
        if spec.prepare is not None and only in (None, spec.name):
            out.extend(spec.prepare(gguf, log))
    if only in (None, "embed"):
        from backends.embed_prepare import prepare_gguf
        from backends.embed_prepare import prepare_ir as prepare_embed_ir

        out.append(prepare_gguf(force, log))
        out.append(prepare_embed_ir(force, log))
    return out
