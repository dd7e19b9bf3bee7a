"""Measurements of the OpenVINO backend, with openvino-genai's prefix cache for comparison.

``measure()`` returns a flat dict (milliseconds, tokens per second, bytes); run
``python -m benchmarks.openvino`` to print it as JSON. The scenario is the
agent loop: a ~2,000-token stable prefix and ~128-token
suffixes. "cold" is the first turn on a freshly loaded model; "warm" is the next
turn with the same prefix and a different suffix. TTFT is ensure_prefix +
prefill_suffix + the first sampled token, as a client sees it.

The comparison runs openvino-genai's ``LLMPipeline`` on the same IR with a
``SchedulerConfig(enable_prefix_caching=True)`` (paged attention) at the same
inference and KV precisions, on the same two rendered prompts, and reads its
own ``perf_metrics`` TTFT. It reports no reused-token count (it has none).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from backends.bundled import bundled_gguf_path
from backends.openvino import OpenVINOBackend, OpenVINOLoadedModel
from backends.openvino.prepare import prepare_ir
from backends.tape.model import render_prefix
from backends.tape.session import TapeSession
from contract.manifest import ContextManifest
from contract.types import Config, DecodeConfig, OpenSessionRequest, PrefixInput, SuffixInput

__all__ = ["measure"]

_PARAGRAPH = (
    "The repository contains a daemon that keeps one language model resident and serves a persistent "
    "session over a local socket. Agents send a stable prefix with the system prompt, the tool list and "
    "a map of the repository, followed by a small volatile suffix such as a diff or failing test output. "
    "File src/modeld/slot.py owns the single model slot; src/modeld/server.py moves frames; "
    "src/backends/openvino_backend.py drives a paged OpenVINO graph. "
)
_SUFFIX_LINES = (
    "def test_{i}(): assert reuse({i}) == expected[{i}]  # failing on line {i}\n",
    "- old_value_{i} = compute({i})\n+ new_value_{i} = compute_fast({i})\n",
    "E   AssertionError: slot {i} expected Ready, got Busy (generation {i})\n",
    "  File \"src/modeld/server.py\", line {i}, in handle_frame_{i}\n",
)
#: warm turns measured (alternating suffixes); the median is reported, all are in warm_ttft_all_ms
_WARM_TURNS = 3


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 1)


def _text_of_tokens(m: OpenVINOLoadedModel, unit: str, target: int, *, system: bool) -> str:
    """Repeat ``unit`` until the text (rendered as a system turn when ``system``) is ~``target`` tokens."""
    text = ""
    i = 0
    while True:
        candidate = text + unit.format(i=i)
        rendered = render_prefix(m.template, candidate, None) if system else candidate
        if len(m.tokenize(rendered)) > target:
            return text or candidate
        text = candidate
        i += 1


def _turn(s: TapeSession, man: ContextManifest, prefix: str, suffix: str) -> dict[str, float]:
    t0 = time.perf_counter()
    ps = s.ensure_prefix(PrefixInput(text=prefix, manifest=man))
    ss = s.prefill_suffix(SuffixInput(text=suffix, manifest=man))
    t1 = time.perf_counter()
    stream = s.decode(DecodeConfig(max_tokens=8, return_token_ids=True))
    next(stream)
    ttft = _ms(t0)
    first = _ms(t1)
    stream.close()  # evaluates the token already handed out; not part of the TTFT
    return {
        "ttft_ms": ttft,
        "prefix_ms": round(ps.prefill_ms, 1),
        "suffix_ms": round(ss.prefill_ms, 1),
        "first_token_ms": first,
        "reused_tokens": ps.reused_tokens + ss.reused_tokens,
        "prefilled_tokens": ps.prefilled_tokens + ss.suffix_tokens - ss.reused_tokens,
        "prefix_tokens": ps.prefix_tokens,
        "suffix_tokens": ss.suffix_tokens,
    }


def measure(
    source: str | None = None,
    *,
    prefix_tokens: int = 2000,
    suffix_tokens: int = 128,
    decode_tokens: int = 64,
    measure_conversion: bool = True,
    compare_genai: bool = True,
    inference_precision: str = "",
) -> dict[str, Any]:
    """Run the scenario once and return the figures (see the module docstring)."""
    out: dict[str, Any] = {}
    gguf = Path(source) if source else bundled_gguf_path()
    if measure_conversion and gguf.suffix == ".gguf":
        with tempfile.TemporaryDirectory(prefix="ov-bench-") as tmp:
            t0 = time.perf_counter()
            prepare_ir(gguf, cache_dir=Path(tmp))
            out["ir_conversion_ms"] = _ms(t0)
    ir = prepare_ir(gguf) if gguf.suffix == ".gguf" else gguf

    backend = OpenVINOBackend()
    num_ctx = max(4096, prefix_tokens + 2 * suffix_tokens + decode_tokens + 64)
    options = {"inference_precision": inference_precision} if inference_precision else {}
    t0 = time.perf_counter()
    m = backend.load(OpenSessionRequest(path=str(ir), config=Config(num_ctx=num_ctx, options=options)), lambda _f: None)
    out["load_ms"] = _ms(t0)
    out["inference_precision"] = m.inference_precision
    out["kv_precision"] = m.kv_precision
    try:
        s = m.open_session()
        man = m.manifest_defaults()
        prefix = _text_of_tokens(m, _PARAGRAPH, prefix_tokens, system=True)
        suffixes = [_text_of_tokens(m, line, suffix_tokens - 8, system=False) for line in _SUFFIX_LINES]

        cold = _turn(s, man, prefix, suffixes[0])
        warms = [_turn(s, man, prefix, suffixes[1 + i % (len(suffixes) - 1)]) for i in range(_WARM_TURNS)]
        warm = sorted(warms, key=lambda w: w["ttft_ms"])[len(warms) // 2]
        out.update({f"cold_{k}": v for k, v in cold.items()})
        out.update({f"warm_{k}": v for k, v in warm.items()})
        out["warm_ttft_all_ms"] = [w["ttft_ms"] for w in warms]
        out["prefill_tok_per_s_cold_prefix"] = round(cold["prefix_tokens"] / (cold["prefix_ms"] / 1000), 1)
        out["prefill_tok_per_s_warm_suffix"] = round(warm["suffix_tokens"] / (warm["suffix_ms"] / 1000), 1)

        # decode: a prompt that makes this model write at length
        s.prefill_suffix(SuffixInput(text="Write a long, detailed essay about the history of Rome.", manifest=man))
        chunks = list(s.decode(DecodeConfig(max_tokens=decode_tokens, speculative=False)))  # as the peer pipeline
        usage = chunks[-1].usage
        out["decode_tokens"] = usage.completion_tokens if usage is not None else 0
        out["decode_tok_per_s"] = round(usage.tokens_per_second, 1) if usage is not None else 0.0

        # snapshot of the warm turn's state (prefix + suffix)
        s.ensure_prefix(PrefixInput(text=prefix, manifest=man))
        s.prefill_suffix(SuffixInput(text=suffixes[1], manifest=man))
        t0 = time.perf_counter()
        snap = s.snapshot()
        out["snapshot_save_ms"] = _ms(t0)
        out["snapshot_tokens"] = snap.resident_tokens
        out["snapshot_bytes"] = len(snap.state)
        out["snapshot_bytes_per_token"] = round(len(snap.state) / max(1, snap.resident_tokens))
        out["kv_bytes_per_token"] = m.kv_bytes_per_token
        s.ensure_prefix(PrefixInput(text="You are terse.", manifest=man))
        t0 = time.perf_counter()
        s.restore(snap)
        out["snapshot_restore_ms"] = _ms(t0)

        if compare_genai:
            template = m.template
            assert template is not None, "the bundled model has a chat template"
            prompts = [
                m.tokenize(
                    template.render(
                        [{"role": "system", "content": prefix}, {"role": "user", "content": suf}], None, generation=True
                    )
                )
                for suf in suffixes
            ]
            out.update(_genai_prefix_cache(m, prompts))
    finally:
        m.close()
    return out


def _genai_prefix_cache(m: OpenVINOLoadedModel, prompts: list[list[int]]) -> dict[str, Any]:
    import openvino as ov
    import openvino_genai

    sc = openvino_genai.SchedulerConfig()
    sc.enable_prefix_caching = True
    sc.max_num_batched_tokens = 4096  # the default (256) would split a 2k prompt into 8 steps
    sc.cache_size = 1
    t0 = time.perf_counter()
    pipe = openvino_genai.LLMPipeline(
        str(m.ir),
        "CPU",
        scheduler_config=sc,
        INFERENCE_PRECISION_HINT=m.inference_precision,
        KV_CACHE_PRECISION=m.kv_precision,
    )
    out: dict[str, Any] = {"genai_pa_load_ms": _ms(t0)}
    ttfts: list[float] = []
    for i in range(1 + _WARM_TURNS):
        ids = prompts[0] if i == 0 else prompts[1 + (i - 1) % (len(prompts) - 1)]
        res = pipe.generate(ov.Tensor(np.array([ids], np.int64)), max_new_tokens=1, do_sample=False)
        ttfts.append(round(float(res.perf_metrics.get_ttft().mean), 1))
    res = pipe.generate(
        ov.Tensor(np.array([prompts[0]], np.int64)), max_new_tokens=64, do_sample=False, ignore_eos=True
    )
    tpot_ms = float(res.perf_metrics.get_tpot().mean)
    out["genai_pa_decode_tok_per_s"] = round(1000.0 / tpot_ms, 1) if tpot_ms > 0 else 0.0
    del pipe
    out["genai_pa_cold_ttft_ms"] = ttfts[0]
    out["genai_pa_warm_ttft_ms"] = sorted(ttfts[1:])[len(ttfts[1:]) // 2]
    out["genai_pa_prompt_tokens"] = len(prompts[0])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure the OpenVINO backend (and GenAI's prefix cache).")
    parser.add_argument("source", nargs="?", help="GGUF or IR directory; default: the bundled model")
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--suffix-tokens", type=int, default=128)
    parser.add_argument("--no-conversion", action="store_true", help="skip timing a fresh GGUF conversion")
    parser.add_argument("--no-genai", action="store_true", help="skip the openvino-genai comparison")
    parser.add_argument("--precision", default="", help="INFERENCE_PRECISION_HINT (default: the device's)")
    args = parser.parse_args(argv)
    result = measure(
        args.source,
        prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens,
        measure_conversion=not args.no_conversion,
        compare_genai=not args.no_genai,
        inference_precision=args.precision,
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
