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

import importlib.util
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.engine_spec import BackendSettings
from backends.formats import GGUF
from backends.registry import ENGINES, exclusive_given, format_on_disk
from contract import interrupt
from contract.endpoint import default_endpoint
from contract.errors import ModeldError
from contract.interfaces import Backend, Embedder, StateCache
from contract.sizing import MemoryPool
from contract.types import LoadModelRequest

if TYPE_CHECKING:
    from backends.readouts import Readouts

from .blobs import BlobStore
from .capacity import format_size, make_budget_check, make_planner
from .engine_choice import EngineFacts, choose_backend
from .netsec import check_tcp_exposure, server_keys
from .server import Daemon
from .settings import ServeSettings
from .slot import Planner, SlotService
from .state_cache import StateCacheStore
from .store import Catalog, ModelStore, default_store_dir

__all__ = [
    "backend_choices",
    "PREPARE_STEPS",
    "build_backend",
    "build_cache",
    "build_daemon",
    "build_embedder",
    "build_planner",
    "build_catalog",
    "build_slot",
    "engine_build",
    "embed_cache_dir",
    "model_cache_dir",
    "prepare_models",
    "prepare_steps",
    "preload_request",
    "resolve_backend",
    "resolve_model",
]

def backend_choices() -> tuple[str, ...]:
    """What ``--backend`` accepts, as the registry holds it now (an engine registered after import included):
    ``auto`` (``modeld.engine_choice``) and the registered engines (the contract's reference backend among them)."""
    return ("auto", *ENGINES)


def serves_files(backend: str) -> bool:
    """Whether ``backend``'s models are files (``EngineSpec.serves_files``; ``auto`` picks an engine that serves
    files): the bundled model is preloaded and ``--model`` is looked up in the store."""
    spec = ENGINES.get(backend)
    return spec is None or spec.serves_files


def prepare_steps() -> tuple[str, ...]:
    """What ``modeld prepare --only`` accepts: the engines' conversion steps (named as the engine), then the
    embedding models'."""
    return (*(spec.name for spec in ENGINES.values() if spec.prepare is not None), "embed")


PREPARE_STEPS = prepare_steps()


def engine_facts(
    model: str,
    num_gpu_layers: int = 0,
    exclusive: dict[str, str] | None = None,
    gpus: Callable[[], Sequence[MemoryPool]] | None = None,
) -> EngineFacts:
    """The facts ``choose_backend`` needs about this machine and ``model`` (a GGUF file or an engine's own format).

    The GPUs are read only when layers may go to one (``num_gpu_layers`` not 0), and an engine's build is
    asked whether it offloads (which imports the engine) only when there is a GPU.
    """
    p = Path(model)
    installed = frozenset(s.name for s in ENGINES.values() if importlib.util.find_spec(s.package) is not None)
    from backends.devices import read_gpus  # imported here, as every engine-side module is (the composition root)

    reader = gpus if gpus is not None else read_gpus
    found = list(reader()) if num_gpu_layers != 0 else []
    offloading = frozenset(s.name for s in ENGINES.values()
                           if found and s.name in installed and s.gpu_offload is not None and s.gpu_offload())
    fmt = format_on_disk(p)
    kind = fmt.kind if fmt is not None else "other"
    refusals: dict[str, str] = {}
    if kind == GGUF.kind:  # an engine's reader is imported only where its package is installed
        refusals = {s.name: s.refusal(p) for s in ENGINES.values() if s.refusal is not None and s.name in installed}
    return EngineFacts(
        machine=platform.machine(),
        installed=installed,
        model_kind=kind,
        refusals=refusals,
        num_gpu_layers=num_gpu_layers,
        exclusive=exclusive or {},
        gpus=tuple(f"{g.name or 'gpu ' + g.id}, {format_size(g.total_bytes)}" for g in found),
        gpu_engines=offloading,
    )


def exclusive_settings(opts: ServeSettings) -> dict[str, str]:
    """Per engine, the flags among ``opts`` that only it serves (none: empty): ``auto`` then picks it."""
    return exclusive_given(opts.load_config)


def model_store(opts: ServeSettings) -> ModelStore:
    """The daemon's model store: ``DATA_DIR/models`` (``modeld.store``)."""
    return ModelStore(default_store_dir(opts.data_home))  # resolved once, with the settings


def resolve_model(opts: ServeSettings, log: Callable[[str], None] = print) -> ServeSettings:
    """``opts`` with ``--model`` as the path a load opens.

    A file or directory that exists is that; else a stored model's name, alias or the reference it was
    pulled by (``modeld ls``); else a Hugging Face reference, pulled first when ``--pull`` says so and
    refused otherwise. The memory backend takes any other text as it is (its models are not files).
    ValueError says what to do instead; a pull's own errors say why it failed.
    """
    if not opts.model or Path(opts.model).expanduser().exists():
        return opts
    store = model_store(opts)
    found = store.find(opts.model)
    if found is None:
        from .store.refs import is_hub_ref

        hub = is_hub_ref(opts.model)
        if hub and opts.pull:
            from .store.pull import pull

            found = store.get(pull(store, opts.model, log=log).name)
        elif serves_files(opts.backend):
            if not hub:
                raise ValueError(f"--model {opts.model!r} is no file here and no model in the store ({store.root}; "
                                 "modeld ls)")
            raise ValueError(f"--model {opts.model!r} is not in the store yet: `modeld pull {opts.model}` first, "
                             "or add --pull to download it now")
    if found is None:
        return opts
    model, directory = found
    return opts.model_copy(update={"model": str(model.path_in(directory)), "model_name": opts.model_name or model.name})


def build_catalog(opts: ServeSettings) -> Catalog:
    """The models the daemon loads by name: its store's, the bundled one (for an engine), the preloaded one."""
    catalog = Catalog(model_store(opts))
    if opts.backend in ENGINES and serves_files(opts.backend):
        from backends.bundled import BUNDLED_MODEL_NAME, served_bundled_gguf

        try:
            catalog.add(BUNDLED_MODEL_NAME, served_bundled_gguf())
        except (OSError, ValueError):  # the bundled model's package is missing: the store's still load
            pass
    pre = preload_request(opts)
    if pre is not None:
        catalog.add(pre.model_name, pre.path)
    return catalog


def resolve_backend(opts: ServeSettings) -> ServeSettings:
    """``opts`` with ``backend="auto"`` replaced by the engine ``choose_backend`` picks for the preloaded model."""
    if opts.backend != "auto":
        return opts
    model = opts.model
    if model is None:
        from backends.bundled import served_bundled_gguf

        model = str(served_bundled_gguf())
    name, reason = choose_backend(engine_facts(model, opts.load_config.num_gpu_layers, exclusive=exclusive_settings(opts)))
    return opts.with_backend(name, f"auto: {reason}")


def build_cache(opts: ServeSettings) -> StateCacheStore | None:
    """The workspace cache for a tape engine (``EngineSpec.tape``; none with both budgets 0)."""
    spec = ENGINES.get(opts.backend)
    if spec is None or not spec.tape:
        return None
    if opts.cache_ram == 0 and opts.cache_disk == 0:
        return None
    directory = opts.cache_dir or opts.data_home / "cache"
    return StateCacheStore(directory, ram_budget=opts.cache_ram, disk_budget=opts.cache_disk)


def build_backend(opts: ServeSettings, cache: StateCache | None = None, readouts: Readouts | None = None) -> Backend:
    """The engine's backend (``EngineSpec.backend``), given the serve settings it may read and the readout
    manifest (``build_readouts``)."""
    spec = ENGINES.get(opts.backend)
    if spec is not None:
        return spec.backend(cache, BackendSettings(engine=opts.backend, speculative=opts.speculative,
                                                   readouts=readouts, sessions=opts.sessions,
                                                   memory_token_delay_ms=opts.memory_token_delay_ms))
    raise SystemExit(f"unknown backend {opts.backend!r}; choose one of {', '.join(backend_choices())}")


def build_readouts(opts: ServeSettings) -> Readouts | None:
    """The readout manifest of ``--readouts`` (``backends.readouts``), read once; a file that is not one stops
    the start with what is wrong with it."""
    if opts.readouts is None:
        return None
    from backends.readouts import Readouts

    try:
        return Readouts.load(opts.readouts)
    except ModeldError as exc:
        raise SystemExit(f"--readouts: {exc.message}") from None


def build_planner(opts: ServeSettings) -> Planner:
    """The memory planner (``modeld.capacity``) under the settings' memory policy."""
    return make_planner(opts.memory)


def build_embedder(opts: ServeSettings, generation_bytes: Callable[[], int]) -> Embedder | None:
    """The embedding side slot for the engine (none for one that embeds nothing: ``EngineSpec.embedder``).

    ``generation_bytes`` is what the generation model holds now: the side slot's
    budget check takes it off --mem-max, which both models share.
    """
    spec = ENGINES.get(opts.backend)
    if spec is None or spec.embedder is None:
        return None
    from .embedding_slot import EmbeddingSlot

    check = make_budget_check(opts.memory, other_bytes=generation_bytes)
    return EmbeddingSlot(spec.embedder(), idle_unload_s=opts.embed_idle, budget_check=check)


def engine_build(backend: str) -> dict[str, Any]:
    """What status says of the machine and the engine's build: the GPU reader, the build and whether it offloads."""
    from backends.devices import read_gpus

    spec = ENGINES.get(backend)
    return {
        "devices": read_gpus,
        "build": spec.build_info() if spec is not None and spec.build_info is not None else "",
        "gpu_offload": bool(spec is not None and spec.gpu_offload is not None and spec.gpu_offload()),
    }


def build_slot(
    opts: ServeSettings, endpoint: str, backend: Backend | None = None, cache: StateCacheStore | None = None
) -> SlotService:
    """The slot service over ``backend`` (default: the one ``opts`` names), with its planner, side slot and
    workspace cache (built from ``opts`` with the backend; a given backend comes with its own ``cache``)."""
    opts = resolve_backend(opts)
    readouts = build_readouts(opts)
    if backend is None:
        cache = build_cache(opts)
        backend = build_backend(opts, cache, readouts)
    # The side slot's budget check asks the slot what the generation model holds,
    # and the slot needs the side slot: the check reads the slot through this box.
    built: list[SlotService] = []
    embedder = build_embedder(opts, lambda: built[0].generation_resident_bytes() if built else 0)
    slot = SlotService(
        backend,
        opts,
        planner=build_planner(opts),
        endpoint=endpoint,
        embedder=embedder,
        cache=cache,
        backend_reason=opts.backend_reason,
        catalog=build_catalog(opts),
        readouts=readouts.info() if readouts is not None else None,
        **engine_build(opts.backend),
    )
    built.append(slot)
    return slot


def build_daemon(opts: ServeSettings, backend: Backend | None = None) -> Daemon:
    """The daemon, bound to nothing yet (``Daemon.serve`` binds), with its slot and snapshot blob store."""
    endpoint = opts.endpoint or default_endpoint()
    check_tcp_exposure(endpoint, curve=opts.curve, insecure=opts.insecure_tcp)  # ValueError before anything starts
    data_dir = opts.data_home
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # snapshots and cached KV: the user's alone
    curve_keys = server_keys(data_dir) if opts.curve else None
    slot = build_slot(opts, endpoint, backend)
    interrupt.set_chunk_delay(opts.prefill_chunk_delay_ms / 1000)
    interrupt.set_slow_prefix(opts.slow_prefix_s)
    blobs = BlobStore(data_dir / "blobs", max_bytes=opts.blob_disk, max_age_s=opts.blob_max_age_days * 86400)
    return Daemon(slot, endpoint, blobs, opts, curve_keys=curve_keys)


def preload_request(opts: ServeSettings) -> LoadModelRequest | None:
    """The model to load at start: ``--model``, else the bundled model for an engine; None for none."""
    if opts.no_preload:
        return None
    model, name = opts.model, opts.model_name
    if model is None and opts.backend in ENGINES and serves_files(opts.backend):
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
        config=opts.load_config,
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
