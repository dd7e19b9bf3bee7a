"""The OpenVINO implementation of the daemon's Backend seam: load, describe, model facts."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openvino as ov
import openvino_genai
import psutil

from backends.resident import check_model_type
from contract.errors import Internal, UnsupportedFeature
from contract.interfaces import StateCache
from contract.sizing import MemoryPool, ModelFacts, kv_bytes_per_token
from contract.types import DeviceInfo, ModelInfo, OpenSessionRequest

from ..engine_spec import describe_options
from ..gguf_file import gguf_facts, gguf_layout_digest
from ..readouts import Readouts
from ..tape.loading import check_load, finish_load, template_report
from ..tape.model import check_digest
from .graph import add_readouts, paged_model, wants_batch_graph
from .model import BACKEND_NAME, OpenVINOLoadedModel
from .native import map_errors, runtime_version, type_name
from .options import (
    DEFAULT_NUM_CTX,
    DEFAULT_PREFILL_CHUNK,
    LoadOptions,
    overhead_bytes,
    resolve_source,
    shape_of_ir,
    shape_of_source,
    sizing,
)
from .spec import OpenVINOOptions


class OpenVINOBackend:
    """The OpenVINO implementation of the daemon's Backend seam.

    ``device`` is an OpenVINO device name ("CPU", "GPU", …). The precision it computes in is a load's
    ``inference_precision`` engine option (unset: the device default, e.g. bf16 on AMX CPUs, f32 elsewhere).
    """

    name = BACKEND_NAME
    #: one session at a time: the model's one KV (``contract.interfaces.Backend.lanes``)
    lanes = 1

    def __init__(
        self,
        device: str = "CPU",
        cache: StateCache | None = None,
        speculative: bool = True,
        *,
        readouts: Readouts | None = None,
    ) -> None:
        self.device = device
        #: the concept readouts every model serves (``serve --readouts``; checked against each model at its load)
        self.readouts = readouts
        #: the workspace cache every loaded model saves to and restores from (None: none)
        self.cache = cache
        #: decode passes speculate unless a request says otherwise (``backends.tape.speculate``)
        self.speculative = speculative
        self._core: ov.Core | None = None

    @property
    def core(self) -> ov.Core:
        if self._core is None:
            self._core = ov.Core()
        return self._core

    def runtime_version(self) -> str:
        return runtime_version()

    def load(self, req: OpenSessionRequest, progress: Callable[[float], None]) -> OpenVINOLoadedModel:
        template = check_load(req, BACKEND_NAME)
        progress(0.0)
        with map_errors(f"loading {req.path}", loading=True):
            src = resolve_source(req.path, prepare=True)
            check_digest(req.path, req.digest, src.digest)
            if src.ir is None:  # prepare=True converts or raises; this guards the invariant
                raise Internal(f"no IR was prepared for {req.path}")
            progress(0.4)
            shape = shape_of_ir(src.ir)
            options = LoadOptions.resolve(
                req.config, shape, speculative=self.speculative, device=self.device
            )
            hint = options.inference_precision or type_name(
                self.core.get_property(self.device, "INFERENCE_PRECISION_HINT")
            )
            if options.kv_precision == "f32" and hint != "f32":
                # the CPU paged-attention kernels pair a bf16/f16 compute with a 16-bit cache only
                raise UnsupportedFeature(
                    f"kv_cache_type 'f32' needs an f32 inference precision; this backend computes in {hint}",
                    kv_cache_type="f32",
                    inference_precision=hint,
                )
            if self.readouts is not None:
                # before anything compiles (an IR without a config: the graph's own width, in add_readouts)
                self.readouts.check(shape.n_embd or None, shape.n_layer)
            compiled, batch = self._compile(src.ir / "openvino_model.xml", options)
            progress(0.9)
            tokenizer = openvino_genai.Tokenizer(str(src.ir))
            loaded = OpenVINOLoadedModel(
                compiled=compiled,
                batch_compiled=batch,
                tokenizer=tokenizer,
                ir=src.ir,
                digest=src.digest,
                shape=shape,
                options=options,
                config=req.config,
                device=self.device,
                requested_template=template,
            )
            if src.gguf is not None:  # an IR's graph file names its nodes per conversion: the GGUF's layout
                loaded.layout = gguf_layout_digest(src.gguf)
            loaded.readouts = self.readouts
            finish_load(loaded, self.cache, self.speculative)
        progress(1.0)
        return loaded

    def _compile(self, xml: Path, options: LoadOptions) -> tuple[ov.CompiledModel, ov.CompiledModel | None]:
        """The paged graph compiled for the device, and the batch graph when the options want one.

        The batch graph compiles from a clone of the same ``ov.Model``, at the same time (``ov.Core``
        is thread-safe; the two models are distinct objects): 1.6-1.7 s here, as long as one, where
        one after the other took 3.2 s. A clone shares the constants' memory, which the two compiled
        models then partly share too: the copy added 160 MB (bundled model, after a 4k prefill),
        against 190 MB for a second graph read from the IR again.
        """
        def compile_one(m: ov.Model) -> ov.CompiledModel:
            return self.core.compile_model(m, self.device, options.compile_config())

        model = paged_model(self.core, xml)
        if self.readouts is not None:
            add_readouts(model, self.readouts)
        if not options.batch_graph:
            return compile_one(model), None
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="modeld-compile") as pool:
            step, batch = pool.map(compile_one, [model, model.clone()])
        return step, batch

    def describe(self, req: OpenSessionRequest, credit_bytes: int = 0) -> ModelInfo:
        """ModelInfo from the GGUF header or the IR's config.json; converts and compiles nothing."""
        check_model_type(req.type, BACKEND_NAME)
        with map_errors(f"describing {req.path}", loading=True):
            src = resolve_source(req.path, prepare=False)
            shape = shape_of_source(src)
            options = LoadOptions.resolve(
                req.config.model_copy(update={"num_ctx": 0}), shape, speculative=self.speculative,
                device=self.device,
            )
            devices = self._devices()
            # the template is read from the GGUF an IR is made from; an IR alone is read at its load
            facts = gguf_facts(src.gguf) if src.gguf is not None else None
        template, tool_format, capabilities = (template_report(req, facts.chat_template, facts.control_tokens)
                                                if facts else ("", "", ["text"]))
        requested = req.config.num_ctx or DEFAULT_NUM_CTX
        effective = min(requested, shape.n_ctx_train) if shape.n_ctx_train else requested
        kvpt = kv_bytes_per_token(sizing(shape, options.kv_precision))
        chunk = min(req.config.num_batch or DEFAULT_PREFILL_CHUNK, effective)
        overhead = overhead_bytes(shape, effective, chunk, batch_graph=options.batch_graph)
        main = next((d for d in devices if d.id == self.device), None)
        clamped = bool(req.config.num_ctx) and effective < req.config.num_ctx
        return ModelInfo(
            model_max_context=shape.n_ctx_train,
            effective_context=effective,
            kv_bytes_per_token=kvpt,
            weights_bytes=shape.weights_bytes,
            overhead_bytes=overhead,
            required_bytes=shape.weights_bytes + overhead + kvpt * effective,
            clamped=clamped,
            reason="model_max" if clamped else ("requested" if req.config.num_ctx else "default"),
            device_kind=main.kind if main is not None else self.device.lower(),
            device_id=self.device,
            device_total_bytes=main.total_bytes if main is not None else 0,
            free_bytes=main.free_bytes if main is not None else 0,
            requested_gpu_layers=req.config.num_gpu_layers,
            resolved_gpu_layers=0,
            runtime_name=BACKEND_NAME,
            runtime_digest=f"openvino=={runtime_version()}",
            runtime_system_info=main.name if main is not None else "",
            chat_template=template,
            tool_format=tool_format,
            capabilities=capabilities,
            supports_gpu_offload=any(d.kind == "gpu" for d in devices),
            engine_options=describe_options(OpenVINOOptions),
            devices=devices,
            n_layer=shape.n_layer,
            n_head_kv=shape.n_head_kv,
            head_dim=shape.head_dim_k,
            digest=src.digest,
        )

    def model_facts(self, req: OpenSessionRequest) -> ModelFacts:
        """What the daemon's memory planner needs (nothing converted or compiled)."""
        check_model_type(req.type, BACKEND_NAME)
        with map_errors(f"describing {req.path}", loading=True):
            shape = shape_of_source(resolve_source(req.path, prepare=False))
        return sizing(
            shape,
            req.config.kv_cache_type,
            req.config.num_batch or DEFAULT_PREFILL_CHUNK,
            batch_graph=wants_batch_graph(self.speculative, shape.weights_bytes, self.device),
        )

    def memory_pools(self) -> Sequence[MemoryPool]:
        """GPU memory pools: none are planned here (OpenVINO places the whole model on one device)."""
        return ()

    def _devices(self) -> list[DeviceInfo]:
        out: list[DeviceInfo] = []
        core = self.core
        for dev in core.available_devices:
            kind = dev.split(".")[0].lower()
            name = str(core.get_property(dev, "FULL_DEVICE_NAME"))
            total = free = 0
            if kind == "cpu":
                vm = psutil.virtual_memory()
                total, free = int(vm.total), int(vm.available)
            elif kind == "gpu":
                with contextlib.suppress(RuntimeError):
                    total = int(core.get_property(dev, "GPU_DEVICE_TOTAL_MEM_SIZE"))
            out.append(DeviceInfo(kind=kind, id=dev, name=name, total_bytes=total, free_bytes=free))
        return out

    def close(self) -> None:
        self._core = None
