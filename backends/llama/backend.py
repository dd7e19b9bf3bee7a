"""The llama.cpp implementation of the daemon's Backend seam: load, describe, model facts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import llama_cpp

from backends.resident import check_model_type
from contract.errors import ModelLoadFailed
from contract.interfaces import StateCache
from contract.sizing import MemoryPool, ModelFacts, kv_bytes_per_token
from contract.types import QUANTIZED_KV_CACHE_TYPES, EmbedRequest, ModelInfo, OpenSessionRequest

from ..bundled import model_cache_dir
from ..devices import read_gpus
from ..digest import file_digest
from ..engine_spec import describe_options, engine_options
from ..formats import find_projector
from ..gguf_file import cached_gguf_facts, gguf_facts, gguf_layout_digest, gguf_scalars, is_gguf
from ..readouts import Readouts
from ..tape.loading import check_load, finish_load, template_report
from ..tape.model import check_digest
from .model import BACKEND_NAME, LlamaLoadedModel
from .native import LayerTap, gpu_offload, map_errors, open_llama, runtime_version, system_info
from .options import DEFAULT_NUM_BATCH, LoadOptions, shape_from_scalars
from .spec import SPEC, LlamaOptions
from .vision import LlamaVision

RUNTIME_NAME = "llama.cpp"


def _model_path(req: OpenSessionRequest | EmbedRequest) -> Path:
    if not req.path:
        raise ModelLoadFailed("the request names no model path")
    p = Path(req.path)
    if not p.is_file():
        raise ModelLoadFailed(f"model file not found: {req.path}", path=req.path)
    if not is_gguf(p):
        raise ModelLoadFailed(f"{req.path} is not a GGUF file", path=req.path)
    return p


def projector_path(req: OpenSessionRequest, model: Path) -> Path | None:
    """The model's image encoder (``LlamaOptions.mmproj``): the file named, none for "none", else the one projector
    beside the model (``formats.find_projector``). ModelLoadFailed for a named file that is not there."""
    named = engine_options(SPEC, req.config, LlamaOptions).mmproj
    if named is None or named == "":
        return find_projector(model)
    if named.lower() == "none":
        return None
    p = Path(named).expanduser()
    if not p.is_file() or not is_gguf(p):
        raise ModelLoadFailed(f"projector file not found or not a GGUF file: {named}", mmproj=named)
    return p


class LlamaBackend:
    """The llama.cpp implementation of the daemon's Backend seam."""

    name = BACKEND_NAME
    #: one session at a time: the model's one KV (``contract.interfaces.Backend.lanes``)
    lanes = 1

    def __init__(
        self,
        cache: StateCache | None = None,
        speculative: bool = True,
        *,
        readouts: Readouts | None = None,
        gpus: Callable[[], Sequence[MemoryPool]] = read_gpus,
        offload: Callable[[], bool] = gpu_offload,
    ) -> None:
        #: the workspace cache every loaded model saves to and restores from (None: none)
        self.cache = cache
        #: decode passes speculate unless a request says otherwise (``backends.tape.speculate``)
        self.speculative = speculative
        #: the concept readouts every model serves (``serve --readouts``; checked against each model at its load)
        self.readouts = readouts
        #: the machine's GPUs (``backends.devices.read_gpus``), and whether this build offloads to them
        self._gpus = gpus
        self._offload = offload

    def runtime_version(self) -> str:
        return runtime_version()

    def load(self, req: OpenSessionRequest, progress: Callable[[float], None]) -> LlamaLoadedModel:
        template = check_load(req, BACKEND_NAME)
        progress(0.0)
        path = _model_path(req)
        with map_errors(f"loading {req.path}", loading=True):
            facts = cached_gguf_facts(path)  # describe() may have read it already
            hint = facts.shape if facts is not None else shape_from_scalars(gguf_scalars(path))
            options = LoadOptions.resolve(req.config, hint)
            digest = file_digest(path, model_cache_dir())
            check_digest(req.path, req.digest, digest)
            tap = None
            if self.readouts is not None:
                self.readouts.check(hint.n_embd, hint.n_layer)  # before any weight is read
                tap = LayerTap(self.readouts.layers)
            projector = projector_path(req, path)
            llm = open_llama(path, progress=progress, extra_bufts=options.extra_bufts, tap=tap,
                             **options.llama_kwargs())
            vision = None
            try:
                if projector is not None:
                    vision = LlamaVision(projector, llm, threads=options.num_threads)
                shape = replace(
                    hint,
                    n_ctx_train=int(llama_cpp.llama_model_n_ctx_train(llm.model)),
                    n_layer=int(llama_cpp.llama_model_n_layer(llm.model)),
                    n_head_kv=hint.n_head_kv or int(llama_cpp.llama_model_n_head_kv(llm.model)),
                    weights_bytes=int(llama_cpp.llama_model_size(llm.model)),
                )
                model = LlamaLoadedModel(
                    llm, path=str(path), digest=digest, shape=shape, options=options, config=req.config,
                    requested_template=template, tap=tap, readouts=self.readouts, vision=vision,
                    mmproj_digest=file_digest(projector, model_cache_dir()) if projector is not None else "",
                )
                model.layout = gguf_layout_digest(path)  # the key its draft costs are kept under
                model.probe_rows()  # before the draft costs: a refused load measures nothing more
            except BaseException:
                if vision is not None:
                    vision.close()
                llm.close()
                raise
            finish_load(model, self.cache, self.speculative)
        progress(1.0)
        return model

    def describe(self, req: OpenSessionRequest, credit_bytes: int = 0) -> ModelInfo:
        """ModelInfo from GGUF metadata; loads no weights. ``credit_bytes`` is for the memory planner."""
        check_model_type(req.type, BACKEND_NAME)
        path = _model_path(req)
        with map_errors(f"describing {req.path}", loading=True):
            facts = gguf_facts(path)
            shape = facts.shape
            options = LoadOptions.resolve(req.config, shape)
            digest = file_digest(path, model_cache_dir())
        template, tool_format, capabilities = template_report(req, facts.chat_template, facts.control_tokens,
                                                              vision=projector_path(req, path) is not None)
        kvpt = kv_bytes_per_token(shape.facts(kv_cache_type=options.kv_cache_type))
        gpu = self._offload()
        return ModelInfo(
            model_max_context=shape.n_ctx_train,
            effective_context=options.num_ctx,
            kv_bytes_per_token=kvpt,
            weights_bytes=shape.weights_bytes,
            required_bytes=shape.weights_bytes + kvpt * options.num_ctx,
            device_kind="cpu",
            requested_gpu_layers=req.config.num_gpu_layers,
            resolved_gpu_layers=options.num_gpu_layers if gpu else 0,
            runtime_name=RUNTIME_NAME,
            runtime_digest=f"llama-cpp-python=={runtime_version()}",
            runtime_system_info=system_info(),
            chat_template=template,
            tool_format=tool_format,
            capabilities=capabilities,
            supports_gpu_offload=gpu,
            engine_options=describe_options(LlamaOptions),
            n_layer=shape.n_layer,
            n_head_kv=shape.n_head_kv,
            head_dim=shape.head_dim_k,
            digest=digest,
        )

    def model_facts(self, req: OpenSessionRequest) -> ModelFacts:
        """What the daemon's memory planner needs (no weights loaded)."""
        check_model_type(req.type, BACKEND_NAME)
        path = _model_path(req)
        with map_errors(f"describing {req.path}", loading=True):
            shape = gguf_facts(path).shape
        kv_type = req.config.kv_cache_type or "f16"
        return shape.facts(
            kv_cache_type=kv_type,
            n_batch=req.config.num_batch or DEFAULT_NUM_BATCH,
            # A quantized V cache turns flash attention on (see LoadOptions).
            flash_attn=req.config.flash_attn or kv_type in QUANTIZED_KV_CACHE_TYPES,
            overhead=SPEC.overhead,
        )

    def memory_pools(self) -> Sequence[MemoryPool]:
        """The GPUs this build can offload to, with their memory now (the planner reads host memory itself).

        None on a CPU build, whatever the machine has: its layers cannot leave the host. A
        CUDA build gets the NVIDIA devices NVML reads; a Metal or Vulkan build none (their
        memory is not read here), so the planner keeps such a build's layers on the host.
        """
        if not self._offload():
            return ()
        return tuple(self._gpus())

    def close(self) -> None:
        return None
