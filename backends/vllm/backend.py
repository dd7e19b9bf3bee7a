"""The vLLM engine's Backend: load (the server checked, the tokenizer read and compared), describe, no memory model.

A load names the model's GGUF as every engine's does (its tokenizer and chat template are read from it) and the
server in its engine options (``VLLMOptions``: ``engine_url``, ``served_model``, ``api_key``). The server's
window bounds the context; the daemon's memory planner has nothing to plan (the weights and the KV are the
server's), so ``model_facts`` is None and ``describe`` answers alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from llama_cpp import Llama

from contract.errors import InvalidArgument, ModelLoadFailed
from contract.sizing import MemoryPool, ModelFacts
from contract.types import EmbedRequest, ModelInfo, OpenSessionRequest

from ..bundled import model_cache_dir
from ..digest import file_digest
from ..engine_spec import describe_options, engine_options
from ..gguf_file import gguf_facts, is_gguf
from ..lanes import Lanes
from ..resident import check_model_type
from ..tape.loading import check_load, finish_load, template_report
from ..tape.model import check_digest
from .link import Link, ServerModel
from .model import BACKEND_NAME, VLLMLoadedModel
from .spec import SPEC, VLLMOptions

__all__ = ["VLLMBackend", "runtime_version"]

RUNTIME_NAME = "vLLM"
#: what the load tokenizes on both sides: the template's markers, a tool call, spaces, newlines, multi-byte text
TOKENIZER_PROBE = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                   "def f(x):\n    return x  # é 日本 🙂\n<tool_call>\n{\"name\": \"read\"}\n</tool_call><|im_end|>")


def runtime_version() -> str:
    """The engine's own library here: the HTTP client (the server's version is the model's ``engine_version``)."""
    import httpx

    return f"httpx {httpx.__version__}"


def _model_path(req: OpenSessionRequest | EmbedRequest) -> Path:
    if not req.path:
        raise ModelLoadFailed("the request names no model path (the vLLM engine reads the tokenizer and chat "
                              "template from the model's GGUF)")
    p = Path(req.path)
    if not p.is_file() or not is_gguf(p):
        raise ModelLoadFailed(f"{req.path} is not a GGUF file (the vLLM engine reads the tokenizer and chat "
                              "template from it)", path=req.path)
    return p


def _link(req: OpenSessionRequest) -> tuple[Link, VLLMOptions]:
    opts = engine_options(SPEC, req.config, VLLMOptions)
    if not opts.engine_url:
        raise InvalidArgument("the vLLM engine needs its server: --engine-option engine_url=http://HOST:PORT")
    return Link(opts.engine_url, api_key=opts.api_key or "", timeout_s=opts.timeout_s or 600.0), opts


def _num_ctx(req: OpenSessionRequest, served: ServerModel) -> int:
    if req.config.num_ctx and served.max_model_len and req.config.num_ctx > served.max_model_len:
        raise InvalidArgument(f"num_ctx {req.config.num_ctx} exceeds the window the vLLM server runs "
                              f"{served.name} with ({served.max_model_len}: its --max-model-len)",
                              num_ctx=req.config.num_ctx, server_max_model_len=served.max_model_len)
    return req.config.num_ctx or served.max_model_len


def check_tokenizer(vocab: Llama, link: Link, served: ServerModel) -> None:
    """Refuse a server whose tokenizer splits the probe otherwise than the GGUF's: its KV would not be the
    daemon's prompts."""
    local = list(vocab.tokenize(TOKENIZER_PROBE.encode("utf-8"), add_bos=False, special=True))
    remote = link.tokenize(served.name, TOKENIZER_PROBE)
    if local != remote:
        at = next((i for i, (a, b) in enumerate(zip(local, remote, strict=False)) if a != b), min(len(local), len(remote)))
        raise ModelLoadFailed(
            f"the vLLM server's tokenizer for {served.name} ({served.root}) is not the GGUF's: a probe parts at token "
            f"{at} ({len(local)} tokens here, {len(remote)} there); serve the same model on both sides",
            served_model=served.name, local_tokens=len(local), server_tokens=len(remote), parted_at=at)


class VLLMBackend:
    """The daemon's Backend over a vLLM server: a model it loads serves ``lanes`` sessions at once (``Lanes``), the
    server batching their requests."""

    name = BACKEND_NAME

    def __init__(self, lanes: int = 1) -> None:
        if lanes < 1:
            raise ValueError("lanes must be 1 or more")
        self.lanes = lanes

    def runtime_version(self) -> str:
        return runtime_version()

    def load(self, req: OpenSessionRequest, progress: Callable[[float], None]) -> VLLMLoadedModel | Lanes:
        template = check_load(req, BACKEND_NAME)
        progress(0.0)
        path = _model_path(req)
        link, opts = _link(req)
        try:
            served = link.model(opts.served_model or "", block_size=opts.block_size)
            num_ctx = _num_ctx(req, served)
            digest = file_digest(path, model_cache_dir())
            check_digest(req.path, req.digest, digest)
            vocab = Llama(str(path), vocab_only=True, verbose=False)
        except BaseException:
            link.close()
            raise

        def build(owns: bool) -> VLLMLoadedModel:
            return VLLMLoadedModel(vocab, link, served, path=str(path), digest=digest, config=req.config,
                                   num_ctx=num_ctx, requested_template=template, owns=owns)

        try:
            check_tokenizer(vocab, link, served)
            first = build(owns=True)
        except BaseException:
            vocab.close()
            link.close()
            raise
        finish_load(first, None, False)  # no workspace cache (the KV is the server's), no drafts; closes it on failure
        lanes = [first]
        try:  # the first owns the tokenizer and the connection the others share: it goes if one of them fails
            for _ in range(self.lanes - 1):
                lanes.append(build(owns=False))
                finish_load(lanes[-1], None, False)
        except BaseException:
            first.close()
            raise
        progress(1.0)
        return first if self.lanes == 1 else Lanes(lanes)

    def describe(self, req: OpenSessionRequest, credit_bytes: int = 0) -> ModelInfo:
        """What a load would serve: the server's model and window, the GGUF's template; no memory of the daemon's."""
        check_model_type(req.type, BACKEND_NAME)
        path = _model_path(req)
        link, opts = _link(req)
        try:
            served = link.model(opts.served_model or "", block_size=opts.block_size)
        finally:
            link.close()
        facts = gguf_facts(path)
        template, tool_format, capabilities = template_report(req, facts.chat_template, facts.control_tokens)
        return ModelInfo(
            model_max_context=served.max_model_len,
            effective_context=_num_ctx(req, served),
            device_kind="remote",
            device_id=f"{link.url} ({served.name})",
            runtime_name=RUNTIME_NAME,
            runtime_digest=f"vllm {served.version}".strip(),
            chat_template=template,
            tool_format=tool_format,
            capabilities=capabilities,
            engine_options=describe_options(VLLMOptions),
            digest=file_digest(path, model_cache_dir()),
            reason=f"served by the vLLM server at {link.url}: its weights and KV are its own",
        )

    def model_facts(self, req: OpenSessionRequest) -> ModelFacts | None:
        """None: the weights and the KV are the server's, nothing of the daemon's memory to plan."""
        check_model_type(req.type, BACKEND_NAME)
        return None

    def memory_pools(self) -> Sequence[MemoryPool]:
        return ()

    def close(self) -> None:
        return None
