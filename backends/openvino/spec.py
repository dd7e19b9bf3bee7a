"""The OpenVINO engine's spec (``SPEC``, listed by ``backends.registry``), the options only it takes, and its
preferences in ``--backend auto``.

This module stays light: every factory imports the engine when it is called.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from contract.interfaces import Backend, EngineFactory, StateCache
from contract.sizing import OverheadModel
from contract.types import GPU_LAYERS_ALL

from ..engine_spec import X86_64, BackendSettings, EngineFacts, EngineOptions, EngineSpec, Verdict
from ..formats import GGUF, OPENVINO_IR

__all__ = ["EVIDENCE", "SPEC", "OpenVINOOptions"]


def _openvino_backend(cache: StateCache | None, settings: BackendSettings) -> Backend:
    from backends.openvino.backend import OpenVINOBackend

    return OpenVINOBackend(cache=cache, speculative=settings.speculative, readouts=settings.readouts)


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
    offloading = sorted(f.titles.get(n, n) for n in f.gpu_engines if n != "openvino")
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


SPEC = EngineSpec(
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
)
