"""Context extension of a GGUF by metadata alone: write the copy, then measure it against the original.

The bundled SmolLM2-135M-Instruct was trained on 8,192 tokens; agents' first requests run to
8k-22k tokens. This module writes a copy of a GGUF whose only changes are header keys that
both engines read without runtime flags, and measures what the copy costs and buys:

* ``write``   – the copy, by one of three methods (``--method``, ``--scale s``):

  - ``ntk``: NTK-aware RoPE base scaling, ``{arch}.rope.freq_base`` = base * s^(d/(d-2))
    (d = the rotary dimension), and ``{arch}.context_length`` = ``--ctx``;
  - ``yarn``: ``{arch}.rope.scaling.type`` = ``yarn``, ``{arch}.rope.scaling.factor`` = s,
    ``{arch}.rope.scaling.original_context_length`` = the trained context, and
    ``{arch}.context_length`` = ``--ctx``;
  - ``linear``: ``{arch}.rope.scaling.type`` = ``linear``, ``{arch}.rope.scaling.factor`` = s,
    and ``{arch}.context_length``.

  llama.cpp reads all of these keys at load. openvino-genai's GGUF reader
  (gguf_utils/gguf.cpp, ``config_from_meta``) reads ``rope.freq_base`` and
  ``context_length`` but none of the ``rope.scaling.*`` keys; ``openvino`` below checks it.
* ``diff``    – the header keys two GGUFs differ in, and whether their tensors are byte-identical.
* ``ppl``     – negative log-likelihood of every token of one long text (up to 32,768 tokens,
  llama.cpp, logits of every position, log-softmax in numpy), averaged over position buckets
  [0,2k) [2k,4k) [4k,8k) [8k,16k) [16k,24k) [24k,32k). Texts: ``code`` (excerpts of the
  standard library's top-level modules), ``code-rev`` (the same, other modules first) and
  ``agent`` (an agent-like prompt: documentation prose, OpenAI-style tool schemas in JSON
  built from standard-library signatures, and files from standard-library packages).
  ``--window W`` scores the same positions with at most W tokens of context (blocks of W/2,
  each after W/2 of context): what truncating the prompt to the trained context would give.
* ``needle``  – a ``SECRET_KEY = "..."`` line early in a long code prompt, a question at the end,
  chat template, greedy answer; and with the answer primed (``SECRET_KEY = "``), the answer's
  NLL and greedy continuation. A short prompt of the same form is the control.
* ``short``   – five short chat questions answered greedily.
* ``openvino`` – each GGUF through ``openvino_genai.LLMPipeline(path, "CPU")`` (converted in memory;
  the IR it serialises goes to a temporary folder): greedy continuation of the same long prompt,
  compared across files and with llama.cpp; the time to first token of a long prompt; and with
  ``--nll-tokens`` the NLL by position bucket through the converted IR (default CPU precisions).
  Prompts are passed as token IDs: the tokenizer openvino-genai builds from a GGUF keeps only
  the *last* 8,192 tokens of a text (``MAX_LENGTH`` in gguf_utils/gguf_tokenizer.cpp), whatever
  ``context_length`` says; ``tokenizer_keeps_tokens`` records it.
* ``timing``  – llama.cpp prefill of one long prompt on an empty cache, with the elapsed wall and
  process CPU time at 2k / 8k / 16k / 24k tokens (what a cold first request of that size costs)
  and the rate of the batches just before each point.
* ``table``   – the ``ppl`` results as a markdown table.

Every command prints JSON (``--out`` also writes it). The daemon's llama.cpp settings are used:
f16 KV cache, no flash attention (``--flash-attn`` turns it on), batch 512, all cores.

Example::

    python -m benchmarks.context_ext write --method ntk --scale 4 --out-dir /tmp/ctx
    python -m benchmarks.context_ext ppl --model /tmp/ctx/<file>.gguf --text code --out ntk4.json
    python -m benchmarks.context_ext table orig.json ntk4.json

A bench script of its own (``python -m benchmarks.context_ext``): its length is its three writers,
its measurements and their tables.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from backends.devices import usable_cpus

__all__ = [
    "BUCKETS",
    "LlamaRunner",
    "build_text",
    "extension_changes",
    "main",
    "metadata_diff",
    "ntk_base",
    "write_extended",
]

#: position buckets of the perplexity table: [start, end) in tokens
BUCKETS: tuple[tuple[int, int], ...] = (
    (0, 2048),
    (2048, 4096),
    (4096, 8192),
    (8192, 16384),
    (16384, 24576),
    (24576, 32768),
)
METHODS = ("ntk", "yarn", "linear")
TEXTS = ("code", "code-rev", "agent")
#: characters taken from each file, so a text spans many files as an agent's prompt does
_FILE_CHARS = 12_000
_NEEDLE_VALUE = "mango-7341"
_NEEDLE_LINE = f'SECRET_KEY = "{_NEEDLE_VALUE}"'
_NEEDLE_PRIMER = 'SECRET_KEY = "'
_NEEDLE_QUESTION = "Question: what is the value of SECRET_KEY in the code above? Answer with the value only."
SHORT_QUESTIONS = (
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "What does the command `git status` show?",
    "Name three primary colors.",
    "What is 12 plus 7?",
)
_TOOL_MODULES = ("os", "shutil", "subprocess", "json", "re", "textwrap", "glob", "fnmatch", "difflib", "tempfile")
_PACKAGE_DIRS = ("json", "email", "asyncio", "importlib", "http", "logging", "concurrent", "xml", "urllib", "unittest")

F32Array = npt.NDArray[np.float32]
F64Array = npt.NDArray[np.float64]


# --- the copy ---------------------------------------------------------------------------------


def ntk_base(base: float, scale: float, rot_dim: int) -> float:
    """NTK-aware RoPE base for a context ``scale`` times longer: base * s^(d/(d-2))."""
    return float(base * math.pow(scale, rot_dim / (rot_dim - 2)))


def _fields(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r")
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            continue
        try:
            out[name] = field.contents()
        except Exception:  # noqa: BLE001 - an exotic field type is not part of the comparison
            continue
    return out


def model_facts(path: Path) -> dict[str, Any]:
    """The header values the extension depends on."""
    f = _fields(path)
    arch = str(f["general.architecture"])
    n_head = int(f[f"{arch}.attention.head_count"])
    head_dim = int(f[f"{arch}.embedding_length"]) // n_head
    return {
        "architecture": arch,
        "context_length": int(f[f"{arch}.context_length"]),
        "freq_base": float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        "rot_dim": int(f.get(f"{arch}.rope.dimension_count", head_dim)),
        "head_dim": head_dim,
        "rope_keys": {k: v for k, v in f.items() if ".rope." in k or k.endswith(".context_length")},
    }


def extension_changes(path: Path, method: str, scale: float, ctx: int) -> dict[str, tuple[str, Any]]:
    """The header keys (name -> (GGUF value type name, value)) the copy sets."""
    facts = model_facts(path)
    arch = facts["architecture"]
    changes: dict[str, tuple[str, Any]] = {f"{arch}.context_length": ("UINT32", ctx)}
    if method == "ntk":
        changes[f"{arch}.rope.freq_base"] = ("FLOAT32", ntk_base(facts["freq_base"], scale, facts["rot_dim"]))
    elif method in ("yarn", "linear"):
        changes[f"{arch}.rope.scaling.type"] = ("STRING", method)
        changes[f"{arch}.rope.scaling.factor"] = ("FLOAT32", float(scale))
        if method == "yarn":
            changes[f"{arch}.rope.scaling.original_context_length"] = ("UINT32", facts["context_length"])
    else:
        raise ValueError(f"unknown method {method!r}; one of {METHODS}")
    return changes


def write_extended(src: Path, dst: Path, changes: dict[str, tuple[str, Any]]) -> None:
    """Copy ``src`` to ``dst`` with ``changes`` applied to the header; tensors and every other key unchanged."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src), "r")
    arch = str(reader.fields["general.architecture"].contents())
    pending = dict(changes)
    tmp = dst.with_name(dst.name + ".part")
    writer = GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
    align = reader.fields.get("general.alignment")
    if align is not None:
        writer.data_alignment = int(align.contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer adds both
        if field.name in pending:
            type_name, value = pending.pop(field.name)
            writer.add_key_value(field.name, value, GGUFValueType[type_name])
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for name, (type_name, value) in pending.items():
        writer.add_key_value(name, value, GGUFValueType[type_name])
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    os.replace(tmp, dst)


def metadata_diff(a: Path, b: Path) -> dict[str, Any]:
    """Header keys that differ between two GGUFs, and whether their tensors are byte for byte the same."""
    from gguf import GGUFReader

    fa, fb = _fields(a), _fields(b)
    changed = {k: [fa[k], fb[k]] for k in sorted(fa.keys() & fb.keys()) if fa[k] != fb[k]}
    added = {k: fb[k] for k in sorted(fb.keys() - fa.keys())}
    removed = {k: fa[k] for k in sorted(fa.keys() - fb.keys())}
    ra, rb = GGUFReader(str(a), "r"), GGUFReader(str(b), "r")
    same = len(ra.tensors) == len(rb.tensors) and all(
        x.name == y.name and x.tensor_type == y.tensor_type and np.array_equal(x.data, y.data)
        for x, y in zip(ra.tensors, rb.tensors, strict=True)
    )
    return {"changed": changed, "added": added, "removed": removed, "tensors_identical": same}


def default_name(src: Path, method: str, scale: float, ctx: int) -> str:
    s = f"{scale:g}".replace(".", "p")
    return f"{src.stem}.{method}-x{s}-ctx{ctx}.gguf"


# --- texts -------------------------------------------------------------------------------------


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read(path: Path, limit: int = _FILE_CHARS) -> str:
    return path.read_text(encoding="utf-8", errors="replace")[:limit]


def _code_files(reverse: bool) -> list[Path]:
    files = sorted(p for p in _stdlib().glob("*.py") if p.is_file())
    return files[::-1] if reverse else files


def _json_type(default: Any) -> str:
    if isinstance(default, bool):
        return "boolean"
    if isinstance(default, int):
        return "integer"
    if isinstance(default, float):
        return "number"
    if isinstance(default, (list, tuple)):
        return "array"
    if isinstance(default, dict):
        return "object"
    return "string"


def tool_schemas() -> list[dict[str, Any]]:
    """OpenAI-style function tools built from the public Python functions of a few standard modules."""
    tools: list[dict[str, Any]] = []
    for mod_name in _TOOL_MODULES:
        mod = importlib.import_module(mod_name)
        for name, fn in sorted(vars(mod).items()):
            if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != mod_name:
                continue
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):
                continue
            props: dict[str, Any] = {}
            required: list[str] = []
            for p in sig.parameters.values():
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    continue
                has_default = p.default is not inspect.Parameter.empty
                props[p.name] = {
                    "type": _json_type(p.default) if has_default else "string",
                    "description": f"The {p.name} argument of {mod_name}.{name}.",
                }
                if has_default and isinstance(p.default, (bool, int, float, str)) and p.default is not None:
                    props[p.name]["default"] = p.default
                if not has_default:
                    required.append(p.name)
            doc = (inspect.getdoc(fn) or f"{mod_name}.{name}").split("\n\n")[0].replace("\n", " ")[:400]
            tools.append(
                {
                    "type": "function",
                    "function": {
                        "name": f"{mod_name}_{name}",
                        "description": doc,
                        "parameters": {"type": "object", "properties": props, "required": required},
                    },
                }
            )
    return tools


def _agent_text(min_chars: int) -> str:
    """Documentation prose, tool schemas (JSON) and package source files, in turn, like an agent's prompt."""
    import pydoc_data.topics as topics_mod

    topics: dict[str, str] = topics_mod.topics
    prose = [f"## Documentation: {k}\n\n{topics[k][:6000]}\n" for k in sorted(topics)]
    tools = tool_schemas()
    tool_blocks = [
        "## Tools\n\n```json\n" + json.dumps(tools[i : i + 6], indent=2) + "\n```\n" for i in range(0, len(tools), 6)
    ]
    files: list[str] = []
    for d in _PACKAGE_DIRS:
        for p in sorted((_stdlib() / d).rglob("*.py")):
            files.append(f"## File: {p.relative_to(_stdlib())}\n\n```python\n{_read(p)}\n```\n")
    parts: list[str] = []
    n = 0
    i = 0
    while n < min_chars:
        for block in (prose[i % len(prose)], tool_blocks[i % len(tool_blocks)], files[i % len(files)]):
            parts.append(block)
            n += len(block)
        i += 1
    return "\n".join(parts)


def build_text(name: str, min_chars: int = 160_000) -> str:
    """A deterministic evaluation text of at least ``min_chars`` characters (Python's own files)."""
    if name == "agent":
        return _agent_text(min_chars)
    if name not in ("code", "code-rev"):
        raise ValueError(f"unknown text {name!r}; one of {TEXTS}")
    parts: list[str] = []
    n = 0
    for p in _code_files(reverse=name == "code-rev"):
        block = f"# ===== file: Lib/{p.name} =====\n{_read(p)}\n"
        parts.append(block)
        n += len(block)
        if n >= min_chars:
            break
    return "\n".join(parts)


# --- llama.cpp ------------------------------------------------------------------------------


def token_nll(logits: F32Array, targets: npt.NDArray[np.int64]) -> tuple[F64Array, npt.NDArray[np.bool_]]:
    """Per-row NLL (natural log) of ``targets`` under ``logits`` (log-softmax), and whether each was the argmax."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
    rows = np.arange(len(targets))
    return lse - x[rows, targets], x.argmax(axis=1) == targets


class LlamaRunner:
    """One llama.cpp context driven batch by batch, with the logits of every row when asked."""

    def __init__(self, path: Path, n_ctx: int, *, n_batch: int = 512, flash_attn: bool = False) -> None:
        from backends.llama.native import open_llama

        threads = usable_cpus()
        t0 = time.perf_counter()
        self.llm: Any = open_llama(
            str(path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=flash_attn,
            logits_all=True,
        )
        self.load_s = time.perf_counter() - t0
        self.n_batch = n_batch
        self.n_vocab: int = int(self.llm.n_vocab())
        self.n_past = 0

    def close(self) -> None:
        self.llm.close()

    def tokenize(self, text: str, *, special: bool = False, bos: bool = True) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=bos, special=special))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return bytes(self.llm.detokenize(list(tokens))).decode("utf-8", "replace")

    def truncate(self, n: int) -> None:
        self.llm._ctx.kv_cache_seq_rm(-1, n, -1)
        self.n_past = n

    def feed(
        self,
        tokens: Sequence[int],
        *,
        all_rows: bool = False,
        on_rows: Callable[[int, F32Array], None] | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> F32Array:
        """Evaluate ``tokens`` after the cached ones; the last row's logits.

        With ``all_rows``, ``on_rows(first_position, logits)`` gets every row of each batch.
        ``on_batch(end_position)`` is called after each batch (for timing).
        """
        last: F32Array = np.zeros(self.n_vocab, dtype=np.float32)
        for i in range(0, len(tokens), self.n_batch):
            chunk = list(tokens[i : i + self.n_batch])
            self.llm._batch.set_batch(batch=chunk, n_past=self.n_past, logits_all=all_rows)
            self.llm._ctx.decode(self.llm._batch)
            if all_rows:
                ptr = self.llm._ctx.get_logits()
                rows = np.ctypeslib.as_array(ptr, shape=(len(chunk) * self.n_vocab,)).reshape(len(chunk), self.n_vocab)
                if on_rows is not None:
                    on_rows(self.n_past, rows)
                last = rows[-1].copy()
            else:
                ptr = self.llm._ctx.get_logits_ith(len(chunk) - 1)
                last = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
            self.n_past += len(chunk)
            if on_batch is not None:
                on_batch(self.n_past)
        return last

    def stop_ids(self) -> set[int]:
        ids = {int(self.llm.token_eos())}
        for special in ("<|im_end|>", "<|endoftext|>"):
            toks = self.tokenize(special, special=True, bos=False)
            if len(toks) == 1:
                ids.add(toks[0])
        return ids

    def greedy(self, logits: F32Array, max_tokens: int) -> list[int]:
        """Greedy tokens from ``logits`` (of the last evaluated row) on, stopping at an end token."""
        stops = self.stop_ids()
        out: list[int] = []
        for _ in range(max_tokens):
            tok = int(np.argmax(logits))
            if tok in stops:
                break
            out.append(tok)
            logits = self.feed([tok])
        return out

    def chat_prompt(self, user: str) -> list[int]:
        """``user`` as one user turn in the GGUF's own chat template, with the assistant header."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        md = self.llm.metadata
        vocab_tok = self.llm._model.token_get_text
        fmt = Jinja2ChatFormatter(
            template=md["tokenizer.chat_template"],
            eos_token=vocab_tok(int(self.llm.token_eos())),
            bos_token=vocab_tok(int(self.llm.token_bos())),
        )
        prompt = fmt(messages=[{"role": "user", "content": user}]).prompt
        return self.tokenize(prompt, special=True)


def _bucket_rows(nll: F64Array, hit: npt.NDArray[np.bool_]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for lo, hi in BUCKETS:
        seg = nll[lo:hi]
        ok = ~np.isnan(seg)
        if not ok.any():
            continue
        mean = float(seg[ok].mean())
        rows.append(
            {
                "bucket": f"[{lo // 1024}k,{hi // 1024}k)",
                "tokens": int(ok.sum()),
                "mean_nll": round(mean, 4),
                "ppl": round(math.exp(mean), 3),
                "top1": round(float(hit[lo:hi][ok].mean()), 4),
            }
        )
    return rows


def cmd_ppl(args: argparse.Namespace) -> dict[str, Any]:
    path = Path(args.model)
    runner = LlamaRunner(path, args.tokens, n_batch=args.batch, flash_attn=args.flash_attn)
    try:
        tokens = runner.tokenize(build_text(args.text))[: args.tokens]
        if len(tokens) < args.tokens:
            raise SystemExit(f"text {args.text!r} has only {len(tokens)} tokens")
        n = len(tokens)
        nll = np.full(n, np.nan)
        hit = np.zeros(n, dtype=bool)
        target = np.asarray(tokens, dtype=np.int64)
        marks: list[tuple[int, float]] = []
        t0 = time.perf_counter()

        def on_rows(first: int, logits: F32Array) -> None:
            # row r predicts the token at first + r + 1
            k = min(len(logits), n - 1 - first)
            if k > 0:
                v, h = token_nll(logits[:k], target[first + 1 : first + 1 + k])
                nll[first + 1 : first + 1 + k] = v
                hit[first + 1 : first + 1 + k] = h

        def on_batch(end: int) -> None:
            marks.append((end, time.perf_counter() - t0))
            if args.progress and end % 4096 < args.batch:
                print(f"  {end} tokens, {marks[-1][1]:.0f} s", file=sys.stderr, flush=True)

        if args.window:
            # the truncation baseline: blocks of window/2 scored tokens, each after at least window/2 of context
            stride = args.window // 2
            for s in range(0, n, stride):
                lo = max(0, s - (args.window - stride))
                runner.truncate(0)
                rows: list[F32Array] = []

                def keep(_first: int, lg: F32Array, acc: list[F32Array] = rows) -> None:
                    acc.append(lg.copy())

                runner.feed(tokens[lo : s + stride], all_rows=True, on_rows=keep, on_batch=on_batch)
                block = np.concatenate(rows)
                k = min(s + stride, n - 1) - s  # positions s+1 .. s+k are predicted by rows s-lo .. s-lo+k-1
                if k > 0:
                    v, h = token_nll(block[s - lo : s - lo + k], target[s + 1 : s + 1 + k])
                    nll[s + 1 : s + 1 + k] = v
                    hit[s + 1 : s + 1 + k] = h
        else:
            runner.feed(tokens, all_rows=True, on_rows=on_rows, on_batch=on_batch)
        seconds = time.perf_counter() - t0
    finally:
        runner.close()
    if args.npy:
        np.save(args.npy, nll)
    return {
        "model": path.name,
        "rope": model_facts(path)["rope_keys"],
        "text": args.text,
        "tokens": n,
        "window": args.window,
        "buckets": _bucket_rows(nll, hit),
        "all": {"mean_nll": round(float(np.nanmean(nll)), 4), "ppl": round(math.exp(float(np.nanmean(nll))), 3)},
        "eval_s": round(seconds, 1),
        "eval_tok_s": round(n / seconds, 1),
        "elapsed_s_at": {str(end): round(t, 1) for end, t in marks if end % 4096 < args.batch or end == n},
        "load_s": round(runner.load_s, 2),
    }


def _needle_user(runner: LlamaRunner, n_tokens: int, depth: float) -> str:
    """About ``n_tokens`` of standard-library code with the needle line at ``depth`` (a fraction), then the question."""
    code_tokens = runner.tokenize(build_text("code"), bos=False)[:n_tokens]
    code = runner.detokenize(code_tokens)
    lines = code.split("\n")[:-1]  # the last line may be cut mid-token
    at = max(1, int(len(lines) * depth))
    while at < len(lines) and lines[at].startswith((" ", "\t")):
        at += 1  # a top-level position, so the line reads as a module constant
    lines.insert(at, _NEEDLE_LINE)
    return "\n".join(lines) + "\n\n" + _NEEDLE_QUESTION


def cmd_needle(args: argparse.Namespace) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    sizes = [int(x) for x in args.sizes.split(",")]
    for model in args.model:
        path = Path(model)
        runner = LlamaRunner(path, max(sizes) + 1024, n_batch=args.batch, flash_attn=args.flash_attn)
        try:
            for size in sizes:
                prompt = runner.chat_prompt(_needle_user(runner, size, args.depth))
                runner.truncate(0)
                t0 = time.perf_counter()
                logits = runner.feed(prompt)
                prefill_s = time.perf_counter() - t0
                answer = runner.detokenize(runner.greedy(logits, 24))
                # primed: the answer's first words given, then the value's NLL and a greedy continuation
                runner.truncate(len(prompt))
                primer = runner.tokenize(_NEEDLE_PRIMER, bos=False)
                full = runner.tokenize(_NEEDLE_PRIMER + _NEEDLE_VALUE + '"', bos=False)
                if full[: len(primer)] != primer:
                    raise RuntimeError("the primer does not tokenize as a prefix of the primed answer")
                value = full[len(primer) :]
                rows: list[F32Array] = []

                def keep(_first: int, lg: F32Array, acc: list[F32Array] = rows) -> None:
                    acc.append(lg.copy())

                runner.feed(primer + value, all_rows=True, on_rows=keep)
                logits_all = np.concatenate(rows)
                k = len(primer)
                v_nll, v_hit = token_nll(logits_all[k - 1 : k - 1 + len(value)], np.asarray(value, dtype=np.int64))
                runner.truncate(len(prompt) + len(primer))
                primed = runner.detokenize(runner.greedy(logits_all[k - 1], 12))
                results.append(
                    {
                        "model": path.name,
                        "prompt_tokens": len(prompt),
                        "needle_depth": args.depth,
                        "answer": answer,
                        "answer_has_value": _NEEDLE_VALUE in answer,
                        "primed_continuation": primed,
                        "primed_has_value": primed.startswith(_NEEDLE_VALUE),
                        "value_nll_sum": round(float(v_nll.sum()), 3),
                        "value_tokens_argmax": f"{int(v_hit.sum())}/{len(value)}",
                        "prefill_s": round(prefill_s, 1),
                    }
                )
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        finally:
            runner.close()
    return {"needle": _NEEDLE_LINE, "results": results}


def cmd_short(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in args.model:
        path = Path(model)
        runner = LlamaRunner(path, 2048, flash_attn=args.flash_attn)
        try:
            answers: list[str] = []
            for q in SHORT_QUESTIONS:
                prompt = runner.chat_prompt(q)
                runner.truncate(0)
                answers.append(runner.detokenize(runner.greedy(runner.feed(prompt), args.max_tokens)))
            out[path.name] = dict(zip(SHORT_QUESTIONS, answers, strict=True))
        finally:
            runner.close()
    return out


def cmd_timing(args: argparse.Namespace) -> dict[str, Any]:
    """Cold prefill: wall and process CPU seconds when the prompt reaches each point.

    The CPU seconds (all threads) are less sensitive than the wall time to other work on the machine.
    """
    path = Path(args.model)
    points = sorted(int(x) for x in args.points.split(","))
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeat):
        runner = LlamaRunner(path, max(points) + args.batch, n_batch=args.batch, flash_attn=args.flash_attn)
        try:
            tokens = runner.tokenize(build_text("code"))[: max(points)]
            marks: list[tuple[int, float, float]] = []
            t0 = time.perf_counter()
            c0 = time.process_time()

            def mark(end: int, acc: list[tuple[int, float, float]] = marks, start: float = t0, cstart: float = c0) -> None:
                acc.append((end, time.perf_counter() - start, time.process_time() - cstart))

            runner.feed(tokens, on_batch=mark)
        finally:
            runner.close()
        at: dict[str, Any] = {}
        window = max(1, 2048 // args.batch)
        for p in points:
            i = next(j for j, m in enumerate(marks) if m[0] >= p)
            end, s, c = marks[i]
            b_end, b_s, _ = marks[i - window] if i >= window else (0, 0.0, 0.0)
            at[str(p)] = {
                "elapsed_s": round(s, 2),
                "cpu_s": round(c, 1),
                "avg_tok_s": round(end / s, 1),
                "marginal_tok_s": round((end - b_end) / (s - b_s), 1) if s > b_s else None,
            }
        runs.append({"load_s": round(runner.load_s, 2), "loadavg": os.getloadavg()[0], "at": at})
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    return {"model": path.name, "batch": args.batch, "flash_attn": args.flash_attn, "runs": runs}


# --- OpenVINO -----------------------------------------------------------------------------------


def _ov_ir(gguf: Path, workdir: Path) -> tuple[Any, Path, float]:
    """openvino-genai's pipeline for ``gguf`` (converted in memory), and the IR it serialised into ``workdir``."""
    import openvino_genai as ov_genai

    workdir.mkdir(parents=True, exist_ok=True)
    link = workdir / "model.gguf"
    if not link.exists():
        link.symlink_to(gguf.resolve())
    t0 = time.perf_counter()
    # enable_save_ov_model writes the converted IR next to the GGUF it was given: the symlink's folder
    pipe = ov_genai.LLMPipeline(str(link), "CPU", enable_save_ov_model=True)
    return pipe, workdir / "openvino_model.xml", time.perf_counter() - t0


def ov_nll(xml: Path, tokens: Sequence[int], chunk: int = 512) -> tuple[F64Array, npt.NDArray[np.bool_], dict[str, Any]]:
    """Per-position NLL of ``tokens`` through the stateful IR (position 0 is NaN), chunk by chunk."""
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(str(xml), "CPU")
    req = compiled.create_infer_request()
    req.reset_state()
    n = len(tokens)
    target = np.asarray(tokens, dtype=np.int64)
    nll = np.full(n, np.nan)
    hit = np.zeros(n, dtype=bool)
    t0 = time.perf_counter()
    for first in range(0, n, chunk):
        ids = target[first : first + chunk]
        m = len(ids)
        req.infer(
            {
                "input_ids": ids[None, :],
                "attention_mask": np.ones((1, first + m), dtype=np.int64),
                "position_ids": np.arange(first, first + m, dtype=np.int64)[None, :],
                "beam_idx": np.zeros(1, dtype=np.int32),
            }
        )
        logits = np.asarray(req.get_tensor("logits").data)[0]
        k = min(m, n - 1 - first)
        if k > 0:
            v, h = token_nll(logits[:k].astype(np.float32), target[first + 1 : first + 1 + k])
            nll[first + 1 : first + 1 + k] = v
            hit[first + 1 : first + 1 + k] = h
    info = {
        "inference_precision": str(compiled.get_property("INFERENCE_PRECISION_HINT")),
        "kv_cache_precision": str(compiled.get_property("KV_CACHE_PRECISION")),
        "eval_s": round(time.perf_counter() - t0, 1),
    }
    return nll, hit, info


def _ov_generate_ids(pipe: Any, ids: Sequence[int], cfg: Any) -> tuple[list[int], float, Any]:
    """Greedy tokens for the prompt ``ids`` given as token IDs (the GGUF tokenizer would keep only the last 8,192)."""
    import openvino as ov

    t0 = time.perf_counter()
    res = pipe.generate(ov.Tensor(np.asarray([list(ids)], dtype=np.int64)), cfg)
    wall = time.perf_counter() - t0
    return [int(t) for t in res.tokens[0]], wall, res


def cmd_openvino(args: argparse.Namespace) -> dict[str, Any]:
    """Each GGUF through openvino-genai: the prompt tokens are passed as IDs, so no tokenizer cap applies.

    Also records how many tokens the pipeline's own (GGUF-built) tokenizer keeps of a long text.
    """
    import openvino_genai as ov_genai

    first = Path(args.model[0])
    runner = LlamaRunner(first, 512)
    try:
        all_tokens = runner.tokenize(build_text("code"), bos=False)
    finally:
        runner.close()
    prompt = all_tokens[: args.tokens]
    out: dict[str, Any] = {"prompt_tokens": len(prompt), "models": []}
    for model in args.model:
        path = Path(model)
        workdir = Path(tempfile.mkdtemp(prefix="ctxext-ov-"))
        try:
            pipe, xml, load_s = _ov_ir(path, workdir)
            kept = int(pipe.get_tokenizer().encode(build_text("code"), add_special_tokens=False).input_ids.get_shape()[1])
            cfg = ov_genai.GenerationConfig()
            cfg.max_new_tokens = args.gen
            cfg.do_sample = False
            cont, gen_s, res = _ov_generate_ids(pipe, prompt, cfg)
            row: dict[str, Any] = {
                "model": path.name,
                "load_s": round(load_s, 1),
                "tokenizer_keeps_tokens": kept,
                "text_tokens": len(all_tokens),
                "continuation_ids": cont,
                "generate_s": round(gen_s, 1),
                "ttft_ms": round(float(res.perf_metrics.get_ttft().mean), 1),
            }
            if args.prefill_tokens:
                cfg1 = ov_genai.GenerationConfig()
                cfg1.max_new_tokens = 1
                cfg1.do_sample = False
                walls: list[float] = []
                ttfts: list[float] = []
                for r in range(args.repeat):
                    # another start each time, so the pipeline's prefix cache cannot serve it
                    start = 1000 * (r + 1)
                    _, wall, res1 = _ov_generate_ids(pipe, all_tokens[start : start + args.prefill_tokens], cfg1)
                    walls.append(round(wall, 1))
                    ttfts.append(round(float(res1.perf_metrics.get_ttft().mean), 1))
                row["long_prompt_tokens"] = args.prefill_tokens
                row["long_wall_s"] = walls
                row["long_ttft_ms"] = ttfts
                row["loadavg"] = os.getloadavg()[0]
            del pipe
            if args.nll_tokens:
                nll, hit, info = ov_nll(xml, all_tokens[: args.nll_tokens])
                row["ir_nll"] = {**info, "tokens": args.nll_tokens, "buckets": _bucket_rows(nll, hit)}
                if args.npy_prefix:
                    np.save(f"{args.npy_prefix}{path.stem}.npy", nll)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        out["models"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    if args.compare_llama:
        for model in args.model:
            path = Path(model)
            runner = LlamaRunner(path, args.tokens + 512)
            try:
                ids = runner.greedy(runner.feed(prompt), args.gen)
            finally:
                runner.close()
            out.setdefault("llama_cpp", []).append({"model": path.name, "continuation_ids": ids})
            print(json.dumps(out["llama_cpp"][-1]), file=sys.stderr, flush=True)
    # the same IDs as text, and which continuations agree
    runner = LlamaRunner(first, 512)
    try:
        rows = out["models"] + out.get("llama_cpp", [])
        for row in rows:
            row["continuation"] = runner.detokenize(row["continuation_ids"])
    finally:
        runner.close()
    ref = out["models"][0]["continuation_ids"]
    for row in rows:
        same = 0
        for x, y in zip(ref, row["continuation_ids"], strict=False):
            if x != y:
                break
            same += 1
        row["common_prefix_with_first_ov"] = same
    return out


# --- table / CLI ----------------------------------------------------------------------------


def cmd_table(args: argparse.Namespace) -> str:
    results = [json.loads(Path(p).read_text()) for p in args.results]
    heads = [b for b in (f"[{lo // 1024}k,{hi // 1024}k)" for lo, hi in BUCKETS)]
    lines = ["| model | text | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    for r in results:
        by = {b["bucket"]: b for b in r["buckets"]}
        cells = [f"{by[h]['ppl']:.2f} ({by[h]['mean_nll']:.3f})" if h in by else "" for h in heads]
        lines.append(f"| {r['model']} | {r['text']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cmd_write(args: argparse.Namespace) -> dict[str, Any]:
    src = Path(args.src) if args.src else _bundled()
    changes = extension_changes(src, args.method, args.scale, args.ctx)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / (args.name or default_name(src, args.method, args.scale, args.ctx))
    write_extended(src, dst, changes)
    return {"src": str(src), "dst": str(dst), "set": {k: v[1] for k, v in changes.items()}, "diff": metadata_diff(src, dst)}


def _bundled() -> Path:
    from backends.bundled import bundled_gguf_path

    return bundled_gguf_path()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.context_ext", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p: argparse.ArgumentParser, *, many: bool) -> None:
        if many:
            p.add_argument("--model", action="append", required=True, help="GGUF path (repeatable)")
        else:
            p.add_argument("--model", required=True, help="GGUF path")
        p.add_argument("--batch", type=int, default=512, help="n_batch = n_ubatch (default 512, the daemon's)")
        p.add_argument("--flash-attn", action="store_true", help="llama.cpp flash attention (the daemon's default: off)")
        p.add_argument("--out", help="also write the JSON here")

    w = sub.add_parser("write", help="write the context-extended copy")
    w.add_argument("--src", help="source GGUF (default: the bundled model)")
    w.add_argument("--method", choices=METHODS, default="ntk")
    w.add_argument("--scale", type=float, required=True, help="context scale s (e.g. 4: 8k -> 32k)")
    w.add_argument("--ctx", type=int, default=32768, help="context_length written (default 32768)")
    w.add_argument("--out-dir", default=str(Path(tempfile.gettempdir()) / "modeld-context-ext"))
    w.add_argument("--name", help="file name (default: <stem>.<method>-x<s>-ctx<ctx>.gguf)")
    w.add_argument("--out", help="also write the JSON here")

    d = sub.add_parser("diff", help="header keys that differ between two GGUFs")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--out", help="also write the JSON here")

    p = sub.add_parser("ppl", help="NLL / perplexity by position bucket of one long text")
    common(p, many=False)
    p.add_argument("--text", choices=TEXTS, default="code")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--npy", help="save the per-position NLL array here")
    p.add_argument(
        "--window",
        type=int,
        default=0,
        help="score with a sliding window of this many tokens (the prompt-truncation baseline; 0: whole text)",
    )
    p.add_argument("--progress", action="store_true")

    n = sub.add_parser("needle", help="needle retrieval in a long code prompt, greedy, chat template")
    common(n, many=True)
    n.add_argument("--sizes", default="2000,20000", help="code tokens per prompt, comma-separated")
    n.add_argument("--depth", type=float, default=0.1, help="needle position as a fraction of the code")

    s = sub.add_parser("short", help="five short chat questions, greedy")
    common(s, many=True)
    s.add_argument("--max-tokens", type=int, default=48)

    t = sub.add_parser("timing", help="llama.cpp cold prefill time at several prompt sizes")
    common(t, many=False)
    t.add_argument("--points", default="2048,8192,16384,24576")
    t.add_argument("--repeat", type=int, default=2)

    o = sub.add_parser("openvino", help="whether openvino-genai honours the header, and its long prefill")
    o.add_argument("--model", action="append", required=True, help="GGUF path (repeatable)")
    o.add_argument("--tokens", type=int, default=10000, help="prompt size of the greedy comparison")
    o.add_argument("--gen", type=int, default=32, help="greedy tokens")
    o.add_argument("--prefill-tokens", type=int, default=20000, help="prompt size of the prefill timing (0: skip)")
    o.add_argument("--repeat", type=int, default=2)
    o.add_argument("--compare-llama", action="store_true", help="also llama.cpp's greedy continuation of the text")
    o.add_argument("--nll-tokens", type=int, default=0, help="NLL by position bucket through the converted IR (0: skip)")
    o.add_argument("--npy-prefix", help="save the IR's per-position NLL as <prefix><stem>.npy")
    o.add_argument("--out", help="also write the JSON here")

    tb = sub.add_parser("table", help="markdown table of ppl results")
    tb.add_argument("results", nargs="+")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "table":
        print(cmd_table(args))
        return 0
    handlers: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "write": cmd_write,
        "diff": lambda a: metadata_diff(Path(a.a), Path(a.b)),
        "ppl": cmd_ppl,
        "needle": cmd_needle,
        "short": cmd_short,
        "timing": cmd_timing,
        "openvino": cmd_openvino,
    }
    result = handlers[args.cmd](args)
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if getattr(args, "out", None):
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
