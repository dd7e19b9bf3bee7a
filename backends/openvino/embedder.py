"""The OpenVINO embedding engine: an embedding IR in ``openvino_genai.TextEmbeddingPipeline`` (see ``backends.embeddings``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from contract.errors import ModeldError, ModelLoadFailed, UnsupportedFeature
from contract.types import Config

from ..bundled import model_cache_dir
from ..digest import files_digest, load_json_map
from ..embed_prepare import IR_MARKER_FILE, default_embedding_ir, st_pooling_mode
from ..embeddings import MIB, EmbeddingPlan, model_name_for, plan_threads, plan_window

__all__ = ["OpenVINOEmbedder"]

_OV_REQUIRED = ("openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml", "openvino_tokenizer.bin")


class OpenVINOEmbedder:
    """An embedding IR directory served by ``openvino_genai.TextEmbeddingPipeline`` on CPU."""

    backend: ClassVar[str] = "openvino"
    #: The pipeline pads one call's inputs to the longest, and its activations grow with
    #: inputs x padded length (attention scores: x n_head x length). Inputs are sorted by
    #: length and split into calls of at most ``max_batch`` inputs and ``max_padded_tokens``
    #: padded tokens, which bounds the activation memory whatever the request holds.
    max_batch: ClassVar[int] = 32
    max_padded_tokens: ClassVar[int] = 4096

    @classmethod
    def default_path(cls) -> Path:
        return default_embedding_ir()

    @classmethod
    def plan_for(cls, path: Path, config: Config) -> EmbeddingPlan:
        ir = path.parent if path.is_file() and path.suffix == ".xml" else path
        if not ir.is_dir():
            raise ModelLoadFailed(f"embedding IR directory not found: {path}", path=str(path))
        missing = [f for f in _OV_REQUIRED if not (ir / f).is_file()]
        if missing:
            raise ModelLoadFailed(f"{ir} is not an OpenVINO embedding IR: missing {missing}", path=str(ir))
        try:
            import openvino as ov

            model = ov.Core().read_model(str(ir / "openvino_model.xml"))
            inputs = [set(p.get_names()) for p in model.inputs]
            outputs = [set(p.get_names()) for p in model.outputs]
            hidden = None
            for p in model.outputs:
                if "last_hidden_state" in p.get_names():
                    hidden = p.get_partial_shape()
        except ModeldError:
            raise
        except Exception as exc:  # openvino raises RuntimeError subclasses for unreadable IR
            raise ModelLoadFailed(f"OpenVINO could not read {ir}: {type(exc).__name__}: {exc}", path=str(ir)) from exc
        flat_in = set().union(*inputs) if inputs else set()
        flat_out = set().union(*outputs) if outputs else set()
        if "beam_idx" in flat_in or "logits" in flat_out:
            raise UnsupportedFeature(f"{ir} is a text-generation IR, not an embedding model", path=str(ir))
        if "last_hidden_state" not in flat_out:
            raise UnsupportedFeature(
                f"{ir} has no 'last_hidden_state' output (outputs {sorted(flat_out)}): not an embedding encoder",
                path=str(ir),
            )
        if len(outputs) != 1:
            raise ModelLoadFailed(
                f"{ir} has {len(outputs)} outputs; TextEmbeddingPipeline needs exactly one, 'last_hidden_state' "
                "(re-export the encoder returning only last_hidden_state, as backends.embed_prepare does)",
                path=str(ir),
            )
        marker = load_json_map(ir / IR_MARKER_FILE)
        hf = load_json_map(ir / "config.json")
        pooling = str(marker.get("pooling") or cls._st_pooling(ir) or "mean")
        if pooling not in ("mean", "cls", "last"):
            raise UnsupportedFeature(f"{ir}: pooling {pooling!r} is not supported", path=str(ir))
        native = int(marker.get("max_length") or hf.get("max_position_embeddings") or 512)
        window = plan_window(native, config, ir)
        dims = int(marker.get("dims") or hf.get("hidden_size") or 0)
        if not dims and hidden is not None and hidden.rank.is_static and hidden[-1].is_static:
            dims = int(hidden[-1].get_length())
        bin_files = sorted(ir.glob("*.bin"))
        weights = sum(f.stat().st_size for f in bin_files)
        n_layer = int(hf.get("num_hidden_layers") or 12)
        n_head = int(hf.get("num_attention_heads") or 12)
        n_ff = int(hf.get("intermediate_size") or 4 * (dims or 768))
        digest = files_digest(
            [
                ir / f
                for f in (
                    "openvino_model.xml",
                    "openvino_model.bin",
                    "openvino_tokenizer.xml",
                    "openvino_tokenizer.bin",
                )
            ],
            model_cache_dir(),
        )
        return EmbeddingPlan(
            backend=cls.backend,
            path=ir,
            model_name=str(marker.get("model_name") or model_name_for(ir)),
            digest=digest,
            window=window,
            pooling=pooling,
            resident_bytes=cls.estimate_bytes(weights, dims or 768, n_layer, n_head, n_ff, window),
            dims=dims,
            num_threads=plan_threads(config),
            details={"max_length": native},
        )

    @staticmethod
    def _st_pooling(ir: Path) -> str:
        return st_pooling_mode(load_json_map(ir / "1_Pooling" / "config.json"))

    @classmethod
    def estimate_bytes(cls, weights: int, n_embd: int, n_layer: int, n_head: int, n_ff: int, n_ctx: int) -> int:
        """Resident bytes of the compiled IR: weights twice (f16 in the file, unpacked for the CPU
        kernels), one call's activations at the padded-token cap (attention scores
        n_head x tokens x n_ctx f32, FFN and n_embd-wide intermediates) and a fixed 96 MiB for the
        CPU plugin and tokenizer. MiniLM-L6: estimate 376 MiB; measured RSS growth 216 MiB
        after 32 inputs of 512 tokens."""
        tokens = max(cls.max_padded_tokens, n_ctx)
        activations = n_head * tokens * n_ctx * 4 + tokens * (n_ff * 4 * 2 + n_embd * 4 * 8)
        return int(2 * weights + activations + 96 * MIB)

    def __init__(self, plan: EmbeddingPlan) -> None:
        import openvino_genai as og

        self.plan = plan
        kind = og.TextEmbeddingPipeline.PoolingType
        cfg = og.TextEmbeddingPipeline.Config()
        cfg.pooling_type = {"mean": kind.MEAN, "cls": kind.CLS, "last": kind.LAST_TOKEN}[plan.pooling]
        cfg.normalize = True
        cfg.max_length = plan.window
        props: dict[str, Any] = {}
        if plan.num_threads:
            props["INFERENCE_NUM_THREADS"] = plan.num_threads
        try:
            self._pipe = og.TextEmbeddingPipeline(str(plan.path), "CPU", cfg, **props)
            self._tok = og.Tokenizer(str(plan.path))
            probe = self._pipe.embed_documents(["a"])
        except Exception as exc:  # openvino raises RuntimeError subclasses
            raise ModelLoadFailed(
                f"OpenVINO could not load {plan.path}: {type(exc).__name__}: {exc}", path=str(plan.path)
            ) from exc
        self.dims = len(probe[0])

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        counts: list[int] = []
        for start in range(0, len(texts), self.max_batch):
            part = list(texts[start : start + self.max_batch])
            enc = self._tok.encode(part, truncation=False)
            counts.extend(int(n) for n in np.asarray(enc.attention_mask.data).sum(axis=1))
        return counts

    def _calls(self, counts: Sequence[int]) -> list[list[int]]:
        """Input indices grouped into pipeline calls, shortest first (see ``max_padded_tokens``)."""
        order = sorted(range(len(counts)), key=lambda i: counts[i])
        calls: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            longest = min(counts[i], self.plan.window)  # sorted: the newest is the longest
            if cur and (len(cur) >= self.max_batch or (len(cur) + 1) * longest > self.max_padded_tokens):
                calls.append(cur)
                cur = []
            cur.append(i)
        if cur:
            calls.append(cur)
        return calls

    def embed(self, texts: Sequence[str], counts: Sequence[int]) -> np.ndarray:
        out = np.empty((len(texts), self.dims), dtype=np.float32)
        for idx in self._calls(counts):
            vecs = self._pipe.embed_documents([texts[i] for i in idx])
            out[idx] = np.asarray(vecs, dtype=np.float32)
        return out

    def close(self) -> None:
        self._pipe = None
        self._tok = None
