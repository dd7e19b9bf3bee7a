"""In-process measurements of the llama.cpp backend (``make bench`` wires this in).

``measure()`` drives the backend the way an agent loop does, on a synthetic
~2,000-token stable prefix (a repository map), and returns a flat dict:

* ``load_ms``, ``cold_ttft_ms``: first turn on an empty KV (prefix + user turn
  prefilled, first token sampled) and its prefill rate;
* ``warm_ttft_ms``: the next turn, same prefix, a new 128-token suffix;
* ``decode_tok_s`` vs ``plain_decode_tok_s``: steady decode rate through the
  Session against llama-cpp-python's own ``generate`` loop on the same tokens
  (a separate instance built with the same settings);
* ``snapshot_save_ms`` / ``snapshot_restore_ms`` vs ``reprefill_ms``: per-sequence
  state save/restore against recomputing the same context, and bytes per token.

Run ``python -m benchmarks.llama`` to print it as JSON.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from backends.bundled import bundled_gguf_path
from backends.llama import LlamaBackend, LlamaLoadedModel, open_llama
from backends.tape.session import TapeSession
from benchmarks.common import snapshot_vs_reprefill, text_of_tokens
from contract.types import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput


def _text_of_tokens(model: LlamaLoadedModel, target: int, line: str) -> str:
    return text_of_tokens(lambda t: len(model.tokenize(t)), target, line)


def _first_token(session: TapeSession) -> float:
    """Milliseconds until the first sampled token arrives (the stream is then closed)."""
    t0 = time.perf_counter()
    gen = session.decode(DecodeConfig(max_tokens=1, return_token_ids=True))
    next(gen)
    ms = (time.perf_counter() - t0) * 1000
    gen.close()
    return ms


def measure(
    path: str | None = None,
    *,
    prefix_tokens: int = 2000,
    suffix_tokens: int = 128,
    decode_tokens: int = 64,
    num_ctx: int = 4096,
    num_threads: int = 0,
) -> dict[str, Any]:
    model_path = path or str(bundled_gguf_path())
    backend = LlamaBackend()
    cfg = Config(num_ctx=num_ctx, num_threads=num_threads)
    out: dict[str, Any] = {"model": os.path.basename(model_path), "num_ctx": num_ctx}

    t0 = time.perf_counter()
    model = backend.load(OpenSessionRequest(path=model_path, config=cfg), lambda f: None)
    out["load_ms"] = (time.perf_counter() - t0) * 1000
    try:
        man = model.manifest_defaults()
        system = _text_of_tokens(
            model, prefix_tokens, "src/pkg/module_{i}.py: class Handler{i}(Base): def run(self, x): return x * {i}"
        )
        suffix_a = "Why does Handler7 fail on negative input?"
        suffix_b = _text_of_tokens(model, suffix_tokens, "test_{i}: AssertionError at line {i} in test_handler_{i}")
        s = model.open_session()

        # cold: empty KV, whole prefix + turn prefilled
        t0 = time.perf_counter()
        p = s.ensure_prefix(PrefixInput(text=system, manifest=man))
        q = s.prefill_suffix(SuffixInput(text=suffix_a, manifest=man))
        first = _first_token(s)
        out["cold_ttft_ms"] = (time.perf_counter() - t0) * 1000
        out["prefix_tokens"] = p.prefix_tokens
        out["prefill_tok_s"] = (p.prefilled_tokens + q.suffix_tokens) / ((p.prefill_ms + q.prefill_ms) / 1000)
        out["cold_first_token_ms"] = first

        # warm: same prefix, new 128-token suffix
        t0 = time.perf_counter()
        p = s.ensure_prefix(PrefixInput(text=system, manifest=man))
        q = s.prefill_suffix(SuffixInput(text=suffix_b, manifest=man))
        _first_token(s)
        out["warm_ttft_ms"] = (time.perf_counter() - t0) * 1000
        out["warm_reused_tokens"] = p.reused_tokens
        out["warm_suffix_tokens"] = q.suffix_tokens

        # decode rate through the Session (steady state: after the first token)
        s.ensure_prefix(PrefixInput(text=system, manifest=man))
        s.prefill_suffix(SuffixInput(text=suffix_a, manifest=man))
        prompt = list(model.res.tokens)
        stamps: list[float] = []
        ids: list[int] = []
        counts: list[int] = []
        # plain decoding, as the loop below (speculation is measured by the decode section)
        for chunk in s.decode(DecodeConfig(max_tokens=decode_tokens, return_token_ids=True, speculative=False)):
            if chunk.token_ids:
                stamps.append(time.perf_counter())
                counts.append(len(chunk.token_ids))
                ids += chunk.token_ids
        out["decode_tokens"] = len(ids)
        out["decode_tok_s"] = sum(counts[1:]) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0

        # the same with llama-cpp-python's own loop
        plain = open_llama(model_path, **model.options.llama_kwargs())
        try:
            plain.eval(prompt)  # prefill outside the timed part, as above
            stamps = []
            for n, _tok in enumerate(plain.generate(prompt, temp=0.0), start=1):
                stamps.append(time.perf_counter())
                if n >= len(ids):
                    break
            out["plain_decode_tok_s"] = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
        finally:
            plain.close()

        # snapshot save / restore vs recomputing the same context
        out.update(snapshot_vs_reprefill(s, system, suffix_a, man, man))
        s.close()
    finally:
        model.close()
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    print(json.dumps(measure(), indent=2))


if __name__ == "__main__":
    main()
