"""The llama.cpp embedding engine: an embedding GGUF in its own ``Llama`` instance (see ``backends.embeddings``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from contract.errors import ModelLoadFailed, UnsupportedFeature
from contract.types import Config

from ..bundled import model_cache_dir
from ..devices import usable_cpus
from ..digest import file_digest
from ..embed_prepare import default_embedding_gguf
from ..embeddings import MIB, EmbeddingPlan, model_name_for, plan_threads, plan_window
from ..gguf_file import is_gguf, read_gguf
from .native import open_llama

__all__ = ["LlamaEmbedder"]

# llama.h: enum llama_pooling_type
_POOL_NONE, _POOL_MEAN, _POOL_CLS, _POOL_LAST, _POOL_RANK = 0, 1, 2, 3, 4
_POOLING_NAMES = {_POOL_MEAN: "mean", _POOL_CLS: "cls", _POOL_LAST: "last"}


class LlamaEmbedder:
    """An embedding GGUF served by llama-cpp-python in its own ``Llama`` instance."""

    backend: ClassVar[str] = "llama"

    # --- factory side (classmethods: no model loaded) ---
    @classmethod
    def default_path(cls) -> Path:
        return default_embedding_gguf()

    @classmethod
    def plan_for(cls, path: Path, config: Config) -> EmbeddingPlan:

        if not path.is_file():
            raise ModelLoadFailed(f"embedding model not found: {path}", path=str(path))
        if not is_gguf(path):
            raise ModelLoadFailed(f"{path} is not a GGUF file", path=str(path))
        try:
            facts = read_gguf(path)
        except ValueError as exc:
            raise ModelLoadFailed(str(exc), path=str(path)) from exc
        arch = facts.architecture
        causal = facts.raw.get(f"{arch}.attention.causal")
        pooling = facts.pooling_type
        if pooling == -1:
            if causal is False:
                pooling = _POOL_MEAN  # an encoder without a declared pooling: mean, like sentence-transformers
            else:
                raise UnsupportedFeature(
                    f"{path.name} ({arch}) declares no pooling type: it is not an embedding model "
                    "(a chat model's mean-pooled states are not sentence embeddings); use an embedding GGUF",
                    path=str(path),
                    architecture=arch,
                )
        if pooling not in _POOLING_NAMES:
            kind = {_POOL_NONE: "per-token outputs (pooling NONE)", _POOL_RANK: "a reranker (pooling RANK)"}
            raise UnsupportedFeature(
                f"{path.name} declares {kind.get(pooling, f'pooling type {pooling}')}, not sentence embeddings",
                path=str(path),
                pooling_type=pooling,
            )
        window = plan_window(facts.shape.n_ctx_train, config, path)
        digest = file_digest(path, model_cache_dir())
        return EmbeddingPlan(
            backend=cls.backend,
            path=path,
            model_name=model_name_for(path),
            digest=digest,
            window=window,
            pooling=_POOLING_NAMES[pooling],
            resident_bytes=cls.estimate_bytes(
                file_bytes=facts.file_bytes,
                n_embd=facts.shape.n_embd,
                n_layer=facts.shape.n_layer,
                n_head=facts.shape.n_head,
                n_ctx=window,
                n_ff=int(facts.raw.get(f"{arch}.feed_forward_length", 4 * facts.shape.n_embd) or 0),
                n_embd_kv=facts.shape.n_head_kv * facts.shape.head_dim_k,
                n_vocab=facts.shape.n_vocab,
                causal=causal is not False,
            ),
            dims=facts.shape.n_embd,
            # the CPUs this process may run on (llama-cpp-python's own default is half the machine's cores)
            num_threads=plan_threads(config) or usable_cpus(),
            details={"architecture": arch, "pooling_type": pooling, "n_ctx_train": facts.shape.n_ctx_train},
        )

    @staticmethod
    def estimate_bytes(
        *,
        file_bytes: int,
        n_embd: int,
        n_layer: int,
        n_head: int,
        n_ctx: int,
        n_ff: int,
        n_embd_kv: int,
        n_vocab: int,
        causal: bool,
    ) -> int:
        """Resident bytes of an embedding ``Llama`` at window ``n_ctx``, from the GGUF header.

        * weights twice: the mapped file plus the copy llama.cpp repacks for the CPU's
          extra buffer types (AMX / AVX-512 repack: 20 of MiniLM's 42 MiB);
        * the output buffer, reserved for ``n_seq_max`` (= min(n_ctx, 256)) outputs of
          ``n_vocab`` floats even when the model has no LM head, plus the per-token embeddings;
        * the compute buffer for one full-window micro-batch: attention scores
          (n_head x n_ctx x n_ctx f32), FFN and n_embd-wide intermediates;
        * the KV cache if the model is causal (an encoder keeps none);
        * a fixed 32 MiB for the tokenizer, allocator and Python objects.

        MiniLM-L6 f16 at 512: estimate 178 MiB; measured RSS growth after a 32 x 512-token
        batch 161 MiB with the repack on (llama.cpp reports 42 mapped + 20 repacked + 30 output
        + 18 compute) and 133 MiB with it off (``open_llama``'s AMX workaround on this CPU).
        """
        n_seq_max = min(n_ctx, 256)
        outputs = n_seq_max * n_vocab * 4 + n_ctx * n_embd * 4 * 2
        compute = n_head * n_ctx * n_ctx * 4 + n_ctx * (n_ff * 4 * 2 + n_embd * 4 * 12)
        kv = (n_layer * n_ctx * n_embd_kv * 2 * 2) if causal else 0
        return int(2 * file_bytes + outputs + compute + kv + 32 * MIB)

    # --- engine side ---
    def __init__(self, plan: EmbeddingPlan) -> None:
        import llama_cpp

        self.plan = plan
        self._llama_cpp = llama_cpp
        pooling = {"mean": _POOL_MEAN, "cls": _POOL_CLS, "last": _POOL_LAST}[plan.pooling]
        kwargs: dict[str, Any] = dict(
            model_path=str(plan.path),
            embedding=True,
            pooling_type=pooling,
            n_ctx=plan.window,
            n_batch=plan.window,
            n_ubatch=plan.window,
            # Flash attention: packing many inputs into one micro-batch makes the attention
            # n_tokens x n_tokens (masked per sequence); without FA a full 512-token batch of
            # short texts ran ~3x slower per text than one text at a time (measured, 2 cores).
            flash_attn=True,
            n_gpu_layers=0,
            verbose=False,
        )
        if plan.num_threads:
            kwargs.update(n_threads=plan.num_threads, n_threads_batch=plan.num_threads)

        self._llm: Any = None
        try:
            self._llm = open_llama(kwargs.pop("model_path"), **kwargs)
        except (OSError, ValueError, RuntimeError, TypeError, AssertionError) as exc:
            raise ModelLoadFailed(
                f"llama.cpp could not load {plan.path}: {type(exc).__name__}: {exc}", path=str(plan.path)
            ) from exc
        try:
            self.dims = int(self._llm.n_embd())
            # the special tokens the tokenizer wraps every input in, e.g. [CLS] ... [SEP]
            empty = self._llm.tokenize(b"", add_bos=True, special=False)
            bos = int(self._llm.token_bos())
            self._n_lead = 1 if empty and empty[0] == bos else 0
            self._trailing = [int(t) for t in empty[self._n_lead :]]
            self._last: tuple[list[str], list[list[int]]] = ([], [])
            if len(empty) >= plan.window:
                raise ModelLoadFailed(f"{plan.path}: window {plan.window} cannot hold the special tokens")
        except BaseException:
            self._llm.close()
            raise

    def _tokens(self, text: str) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        toks = [self._tokens(t) for t in texts]
        self._last = (list(texts), toks)  # embed() of the same texts reuses the tokens
        return [len(t) for t in toks]

    def _fit(self, toks: list[int]) -> list[int]:
        w = self.plan.window
        if len(toks) <= w:
            return toks
        tail = self._trailing if toks[len(toks) - len(self._trailing) :] == self._trailing else []
        return toks[: w - len(tail)] + tail

    def embed(self, texts: Sequence[str], counts: Sequence[int] = ()) -> np.ndarray:
        """Packs as many inputs into one decode as the window and the sequence limit allow."""
        last_texts, last_toks = self._last
        all_toks = last_toks if last_texts == list(texts) else [self._tokens(t) for t in texts]
        self._last = ([], [])
        lc = self._llama_cpp
        llm = self._llm
        ctx, batch = llm._ctx, llm._batch  # the same objects Llama.embed uses (it only takes strings)
        n_batch = self.plan.window
        n_seq_max = int(llm.context_params.n_seq_max) or 1
        out = np.empty((len(texts), self.dims), dtype=np.float32)
        pending: list[int] = []
        used = 0

        def flush() -> None:
            ctx.kv_cache_clear()
            try:
                ctx.decode(batch)
            finally:
                batch.reset()
            for seq, idx in enumerate(pending):
                ptr = lc.llama_get_embeddings_seq(ctx.ctx, seq)
                if not ptr:
                    raise RuntimeError(f"llama.cpp returned no pooled embedding for sequence {seq}")
                out[idx] = np.ctypeslib.as_array(ptr, shape=(self.dims,))

        try:
            batch.reset()
            for i, raw_toks in enumerate(all_toks):
                toks = self._fit(raw_toks)
                if pending and (used + len(toks) > n_batch or len(pending) >= n_seq_max):
                    flush()
                    pending, used = [], 0
                batch.add_sequence(toks, len(pending), True)
                pending.append(i)
                used += len(toks)
            if pending:
                flush()
        finally:
            ctx.kv_cache_clear()
            llm.reset()
        return out

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            self._llm = None
            llm.close()
