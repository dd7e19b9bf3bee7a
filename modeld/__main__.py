"""The composition root: the only place concrete backends are chosen.

``modeld serve`` (and ``python -m modeld``) builds a backend, wraps it in the
slot service, binds the ZeroMQ endpoint and serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from contract.endpoint import default_endpoint
from contract.interfaces import Backend
from contract.types import Config, LoadModelRequest

from .blobs import BlobStore
from .server import Daemon
from .slot import DEFAULT_LEASE_S, Embedder, SlotService

log = logging.getLogger("modeld")

BACKENDS = ("llama", "openvino", "memory")


def build_backend(name: str, args: argparse.Namespace) -> Backend:
    if name == "memory":
        from contract.memory import MemoryBackend

        return MemoryBackend(token_delay_s=args.memory_token_delay_ms / 1000.0)
    if name == "llama":
        from backends.llama import LlamaBackend

        return LlamaBackend()
    if name == "openvino":
        from backends.openvino import OpenVINOBackend

        return OpenVINOBackend()
    raise SystemExit(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


def build_embedder(args: argparse.Namespace, generation_bytes: Callable[[], int]) -> Embedder | None:
    """The embedding side slot for the backend (none for the memory backend)."""
    if args.backend == "memory":
        return None
    from backends.embeddings import EmbeddingSlot, LlamaEmbedder, OpenVINOEmbedder

    from .capacity import make_budget_check

    check = make_budget_check(args.mem_max, args.mem_reserve, other_bytes=generation_bytes)
    factory = LlamaEmbedder if args.backend == "llama" else OpenVINOEmbedder
    return EmbeddingSlot(factory, idle_unload_s=args.embed_idle, budget_check=check)


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "modeld"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default=None, help="ipc://PATH or tcp://HOST:PORT (env MODELD_ENDPOINT)")
    p.add_argument("--backend", choices=BACKENDS, default=os.environ.get("MODELD_BACKEND", "llama"))
    p.add_argument("--model", default=None, help="model to preload (default: the bundled model for llama/openvino)")
    p.add_argument("--model-name", default=None, help="logical name of the preloaded model")
    p.add_argument("--num-ctx", type=int, default=0, help="context window of the preloaded model (0 = memory-fitted)")
    p.add_argument("--owner", default=os.environ.get("MODELD_OWNER", ""), help="owner instance id for fencing")
    p.add_argument("--data-dir", type=Path, default=None, help="snapshot blobs and state (default ~/.local/share/modeld)")
    p.add_argument("--mem-max", default=None, help="memory limit for model + KV, e.g. 8GiB (env MODELD_MEM_MAX)")
    p.add_argument("--mem-reserve", default=None, help="memory kept free, e.g. 1GiB (env MODELD_MEM_RESERVE)")
    p.add_argument("--lease", type=float, default=DEFAULT_LEASE_S, help="seconds a silent client keeps its session")
    p.add_argument("--no-preload", action="store_true", help="start with an empty slot")
    p.add_argument("--embed-idle", type=float, default=300.0, help="seconds before an idle embedding model is unloaded")
    p.add_argument(
        "--memory-token-delay-ms",
        type=float,
        default=0.0,
        help="memory backend only: simulated time per generated token",
    )
    p.add_argument("--log-level", default=os.environ.get("MODELD_LOG_LEVEL", "INFO"))


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    endpoint = args.endpoint or default_endpoint()
    backend = build_backend(args.backend, args)
    planner = _planner(args)
    slot_ref: list[SlotService] = []
    embedder = build_embedder(args, lambda: slot_ref[0].generation_resident_bytes() if slot_ref else 0)
    slot = SlotService(
        backend, owner=args.owner, lease_s=args.lease, planner=planner, endpoint=endpoint, embedder=embedder
    )
    slot_ref.append(slot)
    data_dir = args.data_dir or default_data_dir()
    daemon = Daemon(slot, endpoint, BlobStore(data_dir / "blobs"))

    fired = False

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal fired
        if not fired:  # fire once; a second signal during shutdown is ignored
            fired = True
            log.info("received %s", signal.Signals(signum).name)
            daemon.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    model = args.model
    if model is None and args.backend in ("llama", "openvino") and not args.no_preload:
        from backends.bundled import BUNDLED_MODEL_NAME, bundled_gguf_path

        model = str(bundled_gguf_path())
        args.model_name = args.model_name or BUNDLED_MODEL_NAME
    if args.backend == "memory":
        log.warning("serving the memory reference backend: no inference, byte-length token proxies")
    if model and not args.no_preload:
        daemon.preload(
            LoadModelRequest(
                owner_instance_id=args.owner,
                model_name=args.model_name or Path(model).name,
                type=args.backend,
                path=model,
                config=Config(num_ctx=args.num_ctx),
            )
        )
    try:
        daemon.serve()
    except RuntimeError as exc:
        print(f"modeld: {exc}", file=sys.stderr)
        return 1
    return 0


def _planner(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    try:
        from . import capacity
    except ImportError:
        return None
    make = getattr(capacity, "make_planner", None)
    if make is None:
        return None
    return make(mem_max=args.mem_max, mem_reserve=args.mem_reserve)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="modeld serve", description="Serve one model slot over ZeroMQ.")
    add_serve_arguments(p)
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    from .cli import main as cli_main

    sys.exit(cli_main())
