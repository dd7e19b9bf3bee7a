"""The engines modeld serves, each registered once: ``ENGINES`` maps a name to its ``EngineSpec``.

A spec is everything the rest of modeld knows about an engine: how to build its
backend and its embedding engine, its ``modeld prepare`` step, the pip extra that
installs it (and the modules that extra brings, for the CLI's message), its memory
overhead (``contract.sizing.OverheadModel``, calibrated by ``make bench``), the options only it
takes in a load's ``Config.options`` (``EngineOptions``), what
``--backend auto`` weighs (``modeld.engine_choice``), and what the daemon builds around it (a workspace cache
for a tape engine, an embedding slot, the bundled model for an engine that serves
files). The composition root (``modeld.bootstrap``), ``auto`` and the CLI read this
table; none of them names an engine. Adding an engine is one entry here; the
contract's reference backend (``memory``, no inference) is an entry too, one
``auto`` never picks.

This module stays light: it imports no engine package. Every factory imports its
engine when it is called, so an engine whose package is not installed breaks none
of the others (``EngineSpec.package`` says which module tells it is there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contract.errors import InvalidArgument
from contract.interfaces import Backend, EngineFactory, StateCache
from contract.sizing import OverheadModel
from contract.types import GPU_LAYERS_ALL, QUANTIZED_KV_CACHE_TYPES, Config, EngineOption

from .formats import GGUF, OPENVINO_IR, ModelFormat

__all__ = ["ENGINES", "X86_64", "EngineFacts", "EngineOptions", "EngineSpec", "engine", "engine_options",
           "exclusive_given", "format_on_disk", "model_format", "model_formats", "not_a_known_format", "option_list"]

X86_64 = frozenset({"x86_64", "amd64", "x64"})


@dataclass(frozen=True)
class EngineFacts:
    """What ``--backend auto`` weighs about this machine, the model and the settings asked for."""

    #: ``platform.machine()``
    machine: str
    #: the engines whose package is installed (``EngineSpec.package``)
    installed: frozenset[str]
    #: the model's format (``ModelFormat.kind``: "gguf", "ir", …) or "other" (missing, unreadable, no engine's)
    model_kind: str
    #: for a GGUF, per engine: why it cannot serve this file (absent or "": it can)
    refusals: Mapping[str, str] = field(default_factory=dict)
    #: ``Config.num_gpu_layers`` asked for: 0 none, -1 all, -2 as many as fit (auto), else a count
    num_gpu_layers: int = 0
    #: per engine: the settings asked for that only it offers (``EngineSpec.exclusive_settings``)
    exclusive: Mapping[str, str] = field(default_factory=dict)
    #: the GPUs found (``backends.devices.read_gpus``), as status names them ("NVIDIA L4, 24GiB")
    gpus: tuple[str, ...] = ()
    #: the installed engines whose build offloads to them (``EngineSpec.gpu_offload``)
    gpu_engines: frozenset[str] = frozenset()


#: an engine's preference in ``auto``: (takes the model, why); see ``EngineSpec.prefers``
Verdict = tuple[bool, str]


class EngineOptions(BaseModel):
    """The base of an engine's options model (``EngineSpec.options``): each field is an option of
    ``Config.options``, its description what ``describe`` and the docs say of it; None is "unset"."""

    model_config = ConfigDict(extra="forbid", frozen=True)


_Options = TypeVar("_Options", bound=EngineOptions)


@dataclass(frozen=True)
class EngineSpec:
    """One engine, as the composition root, ``auto`` and the CLI see it."""

    #: ``--backend`` value, ``LoadModelRequest.type`` and status's backend
    name: str
    #: how reasons and messages call it
    title: str
    #: the top-level module whose presence means the engine is installed
    package: str
    #: the pip extra that installs it (``pip install '.[EXTRA]'``)
    extra: str
    #: top-level modules only this engine's extra brings: the CLI names the extra when one is missing
    modules: tuple[str, ...]
    #: what ``auto`` says when ``package`` is missing
    missing: str
    #: its runtime's memory beyond weights and KV (``contract.sizing``), calibrated by ``make bench``
    overhead: OverheadModel
    #: the Backend for ``modeld serve``: (workspace cache, the serve settings by name) → backend; the engine reads
    #: the settings it takes (``speculative``; the reference backend's ``memory_token_delay_ms``)
    backend: Callable[[StateCache | None, Mapping[str, Any]], Backend]
    #: the embedding side slot's engine factory (``contract.interfaces.EngineFactory``); None: it embeds nothing
    embedder: Callable[[], EngineFactory[Any]] | None
    #: ``modeld prepare``'s step for it: (a GGUF, or None for the bundled ones; log) → outputs; None: no step
    prepare: Callable[[Path | None, Callable[[str], None]], list[Path]] | None = None
    #: where ``auto`` ranks it: lower is asked first; the last one takes what every other declines; None: ``auto``
    #: never picks it (it must be named)
    auto_rank: int | None = 0
    #: its preferences in ``auto`` once it is installed and another engine is too (None: it takes the model)
    prefers: Callable[[EngineFacts], Verdict] | None = None
    #: the model formats it reads (``backends.formats``): the store, ``pull`` and ``auto`` know no others
    formats: tuple[ModelFormat, ...] = ()
    #: why it cannot serve a GGUF ("": it can); asked only while it is installed
    refusal: Callable[[Path], str] | None = None
    #: the settings in a load config that only it offers, as flags ("" for none)
    exclusive_settings: Callable[[Config], str] | None = None
    #: whether its installed build offloads layers to a GPU (None: it never does); imports the engine
    gpu_offload: Callable[[], bool] | None = None
    #: what its installed build was built with, for status (None: nothing to say); imports the engine
    build_info: Callable[[], str] | None = None
    #: its models are files (the bundled model is preloaded, ``--model`` is looked up in the store); False: any
    #: text names a model (the reference backend's models are names)
    serves_files: bool = True
    #: it keeps a token tape whose KV the workspace cache saves and restores (False: the daemon builds no cache)
    tape: bool = True
    #: what ``modeld serve`` logs when it starts on it ("": nothing)
    notice: str = ""
    #: the options it takes in a load's ``Config.options`` (``engine_options`` checks them; ``describe``,
    #: ``serve --engine-option`` and ``modeld load --option`` pass them); None: it takes none
    options: type[EngineOptions] | None = None


def engine_options(name: str, cfg: Config, model: type[_Options]) -> _Options:
    """``cfg.options`` as the options model of engine ``name`` (``model``, its ``EngineSpec.options``); an option
    it does not take, or a value it does not, is InvalidArgument naming the engine's options."""
    try:
        return model.model_validate(cfg.options)
    except ValidationError as exc:
        title = engine(name).title if name in ENGINES else name
        takes = ", ".join(model.model_fields) or "none"
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: "
                             f"{'not an option it takes' if e['type'] == 'extra_forbidden' else e['msg']}"
                             for e in exc.errors())
        raise InvalidArgument(f"engine option refused by {title}: {problems} (its options: {takes})",
                              options=sorted(cfg.options)) from exc


def check_options(name: str, cfg: Config) -> None:
    """Refuse (InvalidArgument) a load whose ``Config.options`` engine ``name`` does not take."""
    spec = engine(name)
    if spec.options is not None:
        engine_options(name, cfg, spec.options)
    elif cfg.options:
        raise InvalidArgument(f"engine option refused by {spec.title}: it takes none (given: "
                              f"{', '.join(sorted(cfg.options))})", options=sorted(cfg.options))


def option_list(name: str) -> list[EngineOption]:
    """The options engine ``name`` takes, as ``describe`` lists them (none for an unknown engine)."""
    spec = ENGINES.get(name)
    if spec is None or spec.options is None:
        return []
    out = []
    properties = spec.options.model_json_schema()["properties"]
    for field_name, f in spec.options.model_fields.items():
        schema = properties[field_name]
        kinds = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
        kind = kinds[0] if kinds else {}
        out.append(EngineOption(name=field_name, type=str(kind.get("type", "")),
                                choices=[str(c) for c in kind.get("enum", [])],
                                default="unset" if f.default is None else str(f.default),
                                description=f.description or ""))
    return out


def exclusive_given(cfg: Config) -> dict[str, str]:
    """Per engine, what among ``cfg`` only it offers, as flags ("--flash-attn", "--engine-option NAME"): ``auto``
    leaves the model to an engine that takes everything asked for."""
    out: dict[str, str] = {}
    for spec in ENGINES.values():
        given = [spec.exclusive_settings(cfg)] if spec.exclusive_settings is not None else []
        takes = set(spec.options.model_fields) if spec.options is not None else set()
        others = {f for s in ENGINES.values() if s is not spec and s.options is not None for f in s.options.model_fields}
        given += [f"--engine-option {o}" for o in sorted(cfg.options) if o in takes and o not in others]
        if text := " and ".join(g for g in given if g):
            out[spec.name] = text
    return out


# --- llama.cpp ----------------------------------------------------------------------------


def _llama_backend(cache: StateCache | None, settings: Mapping[str, Any]) -> Backend:
    from backends.llama import LlamaBackend

    return LlamaBackend(cache=cache, speculative=bool(settings.get("speculative", True)),
                        readouts=settings.get("readouts_manifest"))


def _llama_embedder() -> EngineFactory[Any]:
    from backends.llama.embedder import LlamaEmbedder

    return LlamaEmbedder


def _llama_gpu_offload() -> bool:
    from backends.llama.native import gpu_offload

    return gpu_offload()


def _llama_build_info() -> str:
    from backends.llama.native import system_info

    return system_info()


def _llama_only_settings(cfg: Config) -> str:
    """Flash attention and a quantized KV cache: OpenVINO serves an f16 cache and exact decodes too."""
    given = ["--flash-attn"] if cfg.flash_attn else []
    if cfg.kv_cache_type in QUANTIZED_KV_CACHE_TYPES:
        given.append(f"--kv-cache-type {cfg.kv_cache_type}")
    return " and ".join(given)


class LlamaOptions(EngineOptions):
    """What only llama.cpp takes in ``Config.options``."""

    extra_bufts: bool | None = Field(
        None, description="the CPU's repacked forms of the weights (llama.cpp's extra buffer types); unset: on, "
        "except on a build that reports AMX (its AMX matrix product crashed the process; MODELD_LLAMA_EXTRA_BUFTS=1|0 "
        "sets what unset means) and in the exact-decode layout, which keeps the file's weights")
    mmproj: str | None = Field(
        None, description="the model's multimodal projector GGUF (its image encoder: `modeld serve --mmproj FILE`); "
        "unset: the one projector file beside the model (an mmproj*.gguf in its directory), if there is one; none: "
        "no image encoder")


# --- OpenVINO -----------------------------------------------------------------------------


def _openvino_backend(cache: StateCache | None, settings: Mapping[str, Any]) -> Backend:
    from backends.openvino import OpenVINOBackend

    return OpenVINOBackend(cache=cache, speculative=bool(settings.get("speculative", True)),
                           readouts=settings.get("readouts_manifest"))


def _openvino_embedder() -> EngineFactory[Any]:
    from backends.openvino.embedder import OpenVINOEmbedder

    return OpenVINOEmbedder


def _openvino_prepare(gguf: Path | None, log: Callable[[str], None]) -> list[Path]:
    """The bundled GGUF and the copy ``serve`` preloads (its context extended), or ``gguf``, as IR directories."""
    from backends.bundled import bundled_gguf_path, served_bundled_gguf
    from backends.openvino.prepare import prepare_ir

    return [prepare_ir(source, progress=log)
            for source in ([gguf] if gguf is not None else [bundled_gguf_path(), served_bundled_gguf()])]


def _openvino_refusal(path: Path) -> str:
    from backends.formats import find_projector
    from backends.gguf_file import gguf_facts
    from backends.openvino.prepare import ConversionError, check_convertible

    projector = find_projector(path)
    if projector is not None:
        return (f"the model has an image encoder beside it ({projector.name}), which the OpenVINO backend does not "
                "serve")
    try:
        check_convertible(gguf_facts(path))
    except (ConversionError, OSError, ValueError) as exc:
        return str(exc).removeprefix("openvino-genai cannot convert this GGUF: ")
    return ""


class OpenVINOOptions(EngineOptions):
    """What only the OpenVINO backend takes in ``Config.options``."""

    inference_precision: Literal["bf16", "f16", "f32"] | None = Field(
        None, description="the precision the device computes in (OpenVINO's INFERENCE_PRECISION_HINT); unset: the "
        "device's default (bf16 on a CPU with AVX-512 BF16 or AMX, else f32); f32 computes alike on every x86-64 CPU "
        "and is what kv_cache_type f32 needs")


#: where the choice's evidence is (figures measured on the project's machines, not on this one)
EVIDENCE = "prefill-bound agent turns ran faster on OpenVINO in the project's x86-64 runs of make bench (docs/benchmarks.md)"


def _openvino_prefers(f: EngineFacts) -> Verdict:
    """A GGUF it converts, on an x86-64 CPU (``auto`` has already declined it for a setting only another engine
    offers).

    The rule is backed by ``make bench`` on the bundled model (docs/benchmarks.md, docs/engines.md): OpenVINO
    prefilled several times faster than llama.cpp on x86-64 with AVX-512 and still about twice as fast on an
    AVX2-only CPU, where llama.cpp decodes faster; an agent's turns are prefill-bound, so the rule stands. It declines
    GPU layers (the OpenVINO backend here serves the CPU): a count or all, and under
    "auto" a GPU another engine's build offloads to; another CPU architecture (not measured) and a GGUF its reader cannot convert
    (``backends.openvino.prepare.check_convertible``). The measurements are the
    project's machines': the reason ``status`` shows points at them and quotes none.
    """
    if f.num_gpu_layers > 0:
        return False, f"{f.num_gpu_layers} GPU layers were asked for; the OpenVINO backend serves the CPU"
    if f.num_gpu_layers == GPU_LAYERS_ALL:
        return False, "every layer on the GPU was asked for; the OpenVINO backend serves the CPU"
    offloading = sorted(engine(n).title for n in f.gpu_engines if n != "openvino" and n in ENGINES)
    if f.num_gpu_layers != 0 and f.gpus and offloading:
        # a GPU decodes a 7B model at 100+ tokens/s where two CPU cores give a few: that outweighs any CPU engine
        return False, (f"GPU {f.gpus[0]} found and {offloading[0]}'s build offloads to it; "
                       "the OpenVINO backend serves the CPU")
    if f.machine.lower() not in X86_64:
        return False, f"CPU architecture {f.machine!r}: OpenVINO is measured faster on x86-64 only"
    if f.model_kind != "gguf":
        return False, "the model is not a readable GGUF; llama.cpp reports the load error"
    refusal = f.refusals.get("openvino", "")
    if refusal:
        return False, f"OpenVINO cannot convert this GGUF ({refusal})"
    return True, f"x86-64 CPU and a GGUF OpenVINO converts; {EVIDENCE}"


# --- vLLM ----------------------------------------------------------------------------------


def _vllm_backend(cache: StateCache | None, settings: Mapping[str, Any]) -> Backend:
    from backends.vllm import VLLMBackend

    return VLLMBackend(lanes=int(settings.get("sessions") or VLLM_SESSIONS))


#: how many sessions the vLLM engine serves at once unless ``serve --sessions`` says
VLLM_SESSIONS = 4


class VLLMOptions(EngineOptions):
    """What the vLLM engine takes in ``Config.options``: its server."""

    engine_url: str | None = Field(
        None, description="the vLLM server's base URL (http://HOST:PORT), or a router's in front of several; required")
    served_model: str | None = Field(
        None, description="the model's name on the server (its --served-model-name); unset: the server's only model")
    api_key: str | None = Field(None, description="the server's API key (its --api-key); unset: none")
    timeout_s: float | None = Field(
        None, gt=0, description="how long one request to the server may wait for its answer; unset: 600")
    block_size: int | None = Field(
        None, ge=1, le=65536, description="the servers' prefix-cache block size (their --block-size); unset: read "
        "from the server's metrics, 16 where it publishes none (a router)")


# --- the contract's reference backend -----------------------------------------------------


def _memory_backend(cache: StateCache | None, settings: Mapping[str, Any]) -> Backend:
    from backends.memory import MemoryBackend

    return MemoryBackend(token_delay_s=float(settings.get("memory_token_delay_ms", 0.0)) / 1000.0,
                         lanes=int(settings.get("sessions") or 1))


# --- the table ----------------------------------------------------------------------------

ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            name="llama",
            title="llama.cpp",
            package="llama_cpp",
            extra="llama",
            modules=("llama_cpp",),
            missing="llama-cpp-python is not installed",
            # Compute buffer and KQ scores without flash attention. The logits term is 0:
            # llama-cpp-python allocates an (n_batch, n_vocab) float32 ``scores`` array but,
            # without logits_all, writes only its last row, so the rest is never backed by
            # RAM (``make bench``: RSS growth was 20% below the estimate that counted it, and
            # 6% below without it).
            overhead=OverheadModel(name="llama.cpp", logits_copies=0.0),
            backend=_llama_backend,
            embedder=_llama_embedder,
            # every other engine is asked first: llama.cpp serves what they decline, and its load
            # says what it cannot serve
            auto_rank=100,
            formats=(GGUF,),
            exclusive_settings=_llama_only_settings,
            gpu_offload=_llama_gpu_offload,
            build_info=_llama_build_info,
            options=LlamaOptions,
        ),
        EngineSpec(
            name="openvino",
            title="OpenVINO",
            package="openvino_genai",
            extra="openvino",
            modules=("openvino", "openvino_genai", "openvino_tokenizers", "llguidance"),
            missing="OpenVINO is not installed",
            # Paged attention keeps no n_ctx-sized score matrix, but the CPU plugin's compiled
            # model and runtime hold far more than llama.cpp's: ``make bench`` measured 470 MB
            # of RSS growth for load + a 4k prefill of the bundled model where weights and KV
            # are 187 MB (openvino 2026.4.1), hence a fixed part of 280 MiB. That measurement was of
            # the whole runtime, logits and activations included: the fixed part is all of it.
            overhead=OverheadModel(name="openvino", fixed_bytes=280 * 1024 * 1024, logits_copies=0.0,
                                   compute_rows=0.0, kq_copies=0.0),
            backend=_openvino_backend,
            embedder=_openvino_embedder,
            prepare=_openvino_prepare,
            auto_rank=10,
            prefers=_openvino_prefers,
            formats=(GGUF, OPENVINO_IR),
            refusal=_openvino_refusal,
            options=OpenVINOOptions,
        ),
        EngineSpec(
            name="vllm",
            title="vLLM",
            package="httpx",
            extra="vllm",
            modules=("httpx", "llama_cpp"),
            missing="the vLLM engine's client is not installed",
            # the weights and the KV are the server's: the daemon holds a vocabulary
            overhead=OverheadModel(name="vllm", fixed_bytes=0, logits_copies=0.0, compute_rows=0.0, kq_copies=0.0),
            backend=_vllm_backend,
            embedder=None,
            auto_rank=None,  # a server is named, never guessed
            formats=(GGUF,),
            # the KV is the server's: the daemon's workspace cache has nothing to save
            tape=False,
            notice="serving through a vLLM server: its weights and KV are its own (docs/scaling.md)",
            options=VLLMOptions,
        ),
        EngineSpec(
            name="memory",
            title="the memory reference backend",
            package="backends",
            extra="server",
            modules=(),
            missing="",
            # no weights and no KV: byte-length token proxies
            overhead=OverheadModel(name="memory", fixed_bytes=0, logits_copies=0.0, compute_rows=0.0, kq_copies=0.0),
            backend=_memory_backend,
            embedder=None,
            auto_rank=None,
            serves_files=False,
            tape=False,
            notice="serving the memory reference backend: no inference, byte-length token proxies",
        ),
    )
}


def engine(name: str) -> EngineSpec:
    """The spec registered as ``name``; KeyError for an unknown one."""
    return ENGINES[name]


def model_formats() -> list[ModelFormat]:
    """Every registered engine's formats, each once, in the table's order (GGUF first)."""
    out: dict[str, ModelFormat] = {}
    for spec in ENGINES.values():
        for fmt in spec.formats:
            out.setdefault(fmt.kind, fmt)
    return list(out.values())


def format_on_disk(path: Path) -> ModelFormat | None:
    """The registered format ``path`` on disk is a model of; None for none."""
    return next((f for f in model_formats() if f.is_model(path)), None)


def not_a_known_format() -> str:
    """What a path or a file that no registered format takes is not: "not a GGUF file, nor an OpenVINO IR …"."""
    return "not " + ", nor ".join(f.title for f in model_formats())


def model_format(kind: str) -> ModelFormat | None:
    """The registered format ``kind`` names (an earlier manifest's alias too); None for none."""
    return next((f for f in model_formats() if kind == f.kind or kind in f.aliases), None)
