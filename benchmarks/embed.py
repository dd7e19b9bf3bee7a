"""Embeddings per second: both side-slot engines next to sentence-transformers, same texts.

``bench()`` embeds the same corpus of short, varied texts (code, prose, unicode) in
batches of 1 and of 32 through

* ``EmbeddingSlot(LlamaEmbedder)`` on the prepared all-MiniLM-L6-v2 GGUF,
* ``EmbeddingSlot(OpenVINOEmbedder)`` on the prepared IR,
* ``sentence_transformers.SentenceTransformer`` on the original weights, in process,

and returns embeddings/s for each (model load excluded, one warm-up pass first, best of
5 rounds because the machine may be shared).
It also reports each engine's minimum cosine against sentence-transformers on the
corpus, so a fast-but-wrong engine shows.

``python -m benchmarks.embed`` prints the table (``--json`` for the raw dict,
``--quick`` for a short run). ``python -m benchmarks.embed --reference IN.json
OUT.npy`` writes sentence-transformers' normalised vectors for the texts in IN.json:
the tests call it in a subprocess, so torch never loads into the test process.

sentence-transformers and torch are conversion/test/benchmark tools (the ``convert``,
``dev`` and ``bench`` extras), never daemon dependencies: they are imported only inside the functions
that need them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BENCH_TEXTS", "bench", "format_table", "main", "st_reference"]

BENCH_TEXTS: tuple[str, ...] = (
    "def add(a, b):\n    return a + b",
    "How do I reverse a linked list in place?",
    "The quick brown fox jumps over the lazy dog.",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "Ünïcödé façade naïve café — 日本語のテキスト 🚀",
    "for (let i = 0; i < items.length; i++) { total += items[i].price; }",
    "Fix the flaky test: the socket closes before the reply arrives.",
    "git rebase --onto main feature~3 feature",
    "Cats sleep for most of the day and hunt at dusk.",
    'fn main() { println!("hello, world"); }',
    "Kubernetes pods restart when the liveness probe fails three times.",
    "El rápido zorro marrón salta sobre el perro perezoso.",
    "raise ValueError(f'bad size: {n}')",
    "The mitochondria is the powerhouse of the cell.",
    "import numpy as np\nx = np.linspace(0, 1, 100)\ny = np.sin(2 * np.pi * x)",
    "Пример текста на русском языке для проверки.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)",
    "Merge sort splits the list in halves, sorts each and merges them.",
    "TypeError: 'NoneType' object is not subscriptable",
    "The meeting moved to Thursday at 3 pm because of the holiday.",
    "async fn fetch(url: &str) -> Result<String, Error> { reqwest::get(url).await?.text().await }",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "x = [i * i for i in range(10) if i % 2 == 0]",
    "中文句子用于测试嵌入模型的多语言能力。",
)


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _load_st(max_seq_length: int | None = None) -> Any:
    _offline()
    from sentence_transformers import SentenceTransformer

    from backends.embed_prepare import source_model_dir

    model = SentenceTransformer(str(source_model_dir()), device="cpu", local_files_only=True)
    if max_seq_length:
        model.max_seq_length = max_seq_length
    return model


def st_reference(texts: Sequence[str], max_seq_length: int | None = None) -> np.ndarray:
    """sentence-transformers' own L2-normalised vectors for ``texts`` (the acceptance reference)."""
    model = _load_st(max_seq_length)
    return np.asarray(model.encode(list(texts), normalize_embeddings=True, batch_size=32), dtype=np.float64)


def _rate(
    fn: Callable[[list[str]], Any], texts: Sequence[str], batch: int, min_seconds: float, rounds: int = 5
) -> float:
    """Embeddings per second: the best of ``rounds`` rounds, each cycling through ``texts`` in
    batches of ``batch`` for ``min_seconds / rounds``. The best round is reported because the
    machine is shared (2 cores): other processes only ever make a round slower."""
    batches = [list(texts[i : i + batch]) for i in range(0, len(texts), batch)]
    batches = [b for b in batches if len(b) == batch] or [list(texts[:batch])]
    best = 0.0
    for _ in range(rounds):
        done = 0
        t0 = time.perf_counter()
        while True:
            for b in batches:
                fn(b)
                done += len(b)
            elapsed = time.perf_counter() - t0
            if elapsed >= min_seconds / rounds:
                break
        best = max(best, done / elapsed)
    return best


def bench(
    batch_sizes: Sequence[int] = (1, 32),
    min_seconds: float = 3.0,
    texts: Sequence[str] | None = None,
    engines: Sequence[str] = ("llama", "openvino", "sentence-transformers"),
) -> dict[str, Any]:
    """Embeddings/s per engine and batch size, plus each engine's min cosine vs sentence-transformers.

    Returns ``{"texts": n, "batch_sizes": [...], "engines": {name: {"load_s", "rate": {batch: e/s},
    "min_cosine"}}}``. The corpus is repeated to fill the largest batch.
    """
    from backends.llama.embedder import LlamaEmbedder
    from backends.openvino.embedder import OpenVINOEmbedder
    from contract.types import EmbedRequest
    from modeld.embedding_slot import EmbeddingSlot

    base = list(texts or BENCH_TEXTS)
    corpus = (base * (max(batch_sizes) // len(base) + 2))[: max(max(batch_sizes) * 2, len(base))]
    out: dict[str, Any] = {"texts": len(corpus), "batch_sizes": list(batch_sizes), "engines": {}}
    reference: np.ndarray | None = None
    runners: dict[str, Callable[[], Callable[[list[str]], np.ndarray]]] = {}

    def slot_runner(factory: Any) -> Callable[[], Callable[[list[str]], np.ndarray]]:
        def make() -> Callable[[list[str]], np.ndarray]:
            slot = EmbeddingSlot(factory)

            def run(batch: list[str]) -> np.ndarray:
                return np.asarray(slot.embed(EmbedRequest(texts=batch)).vectors)

            run.slot = slot  # type: ignore[attr-defined]
            return run

        return make

    def st_runner() -> Callable[[list[str]], np.ndarray]:
        model = _load_st()

        def run(batch: list[str]) -> np.ndarray:
            return np.asarray(model.encode(batch, normalize_embeddings=True, batch_size=len(batch)))

        return run

    runners["llama"] = slot_runner(LlamaEmbedder)
    runners["openvino"] = slot_runner(OpenVINOEmbedder)
    runners["sentence-transformers"] = st_runner
    order = sorted(engines, key=lambda e: e != "sentence-transformers")  # reference first
    for name in order:
        t0 = time.perf_counter()
        run = runners[name]()
        first = run(list(base))  # warm-up, also loads lazily-loaded engines
        load_s = time.perf_counter() - t0
        if name == "sentence-transformers":
            reference = first
        entry: dict[str, Any] = {"load_s": round(load_s, 2), "rate": {}}
        if reference is not None:
            entry["min_cosine"] = float(np.min(np.sum(first * reference, axis=1)))
        for b in batch_sizes:
            entry["rate"][b] = round(_rate(run, corpus, b, min_seconds), 1)
        out["engines"][name] = entry
        slot = getattr(run, "slot", None)
        if slot is not None:
            slot.close()
    return out


def format_table(result: dict[str, Any]) -> str:
    sizes = result["batch_sizes"]
    head = f"{'engine':<24}" + "".join(f"{f'batch {b} (emb/s)':>20}" for b in sizes) + f"{'min cos vs ST':>16}"
    lines = [head, "-" * len(head)]
    for name, e in result["engines"].items():
        cos = e.get("min_cosine")
        lines.append(
            f"{name:<24}"
            + "".join(f"{e['rate'][b]:>20.1f}" for b in sizes)
            + (f"{cos:>16.5f}" if cos is not None else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.embed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the raw result as JSON")
    ap.add_argument("--quick", action="store_true", help="a short run (0.5 s per measurement)")
    ap.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    ap.add_argument(
        "--reference",
        nargs=2,
        metavar=("IN_JSON", "OUT_NPY"),
        help="write sentence-transformers' vectors for the texts in IN_JSON to OUT_NPY and exit",
    )
    ap.add_argument("--max-seq-length", type=int, default=0, help="with --reference: sentence-transformers' truncation")
    args = ap.parse_args(argv)
    if args.reference:
        texts = json.loads(Path(args.reference[0]).read_text())
        np.save(args.reference[1], st_reference(texts, args.max_seq_length or None))
        return 0
    result = bench(min_seconds=0.5 if args.quick else args.seconds)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
