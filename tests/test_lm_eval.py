"""lm-evaluation-harness as a real client of prefill-only scoring: its ``local-completions`` model (``echo``,
``logprobs``, the prompt as token ids, tokenized on the server through vLLM's tokenizer endpoints) runs a small
multiple-choice task whose data ships here, against a llama.cpp daemon; each choice's log likelihood is the one
llama.cpp's own rows give (llama-cpp-python's ``logits_all``), and each item's choice is the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("llama_cpp")
pytest.importorskip("fastapi")

from harness.daemon import ROOT, DaemonProcess, free_port, wait_http  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.llama]

DATA = Path(__file__).parent / "data" / "lm_eval" / "code_mc.jsonl"
TASK = "modeld_code_mc"
#: the daemon's prefill and llama-cpp-python's ``logits_all`` run the same batches (equal bit for bit here)
LOGLIK_TOLERANCE = 1e-3


def _task(where: Path) -> None:
    (where / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {DATA}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )


def test_lm_eval_multiple_choice_scores_as_llama_cpp_does(tmp_path: Path) -> None:
    from backends.llama.native import open_llama  # the daemon's kernels (its AMX workaround too)

    _task(tmp_path)
    port = free_port()
    d = DaemonProcess(tmp_path / "d", "llama", None, "--http", f"127.0.0.1:{port}", "--num-ctx", "1024")
    d.start(wait_state=("Ready",))
    try:
        wait_http(port)
        with d.client(timeout_s=30.0) as c:
            active = c.status().active
        assert active is not None
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             f"base_url=http://127.0.0.1:{port}/v1/completions,model=any,tokenizer_backend=remote,"
             "num_concurrent=1,max_retries=1",
             "--tasks", TASK, "--include_path", str(tmp_path), "--log_samples", "--output_path", str(tmp_path / "out")],
            env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        d.stop()
    samples = [json.loads(line) for f in (tmp_path / "out").rglob(f"samples_{TASK}_*.jsonl")
               for line in f.read_text().splitlines()]
    docs = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert len(samples) == len(docs)

    ref = open_llama(active.path, n_ctx=1024, n_batch=512, n_ubatch=512, logits_all=True, verbose=False,
                swa_full=True)
    try:
        for s in sorted(samples, key=lambda s: s["doc_id"]):
            doc = docs[s["doc_id"]]
            context = f"Question: {doc['question']}\nAnswer:"
            expected = []
            for choice in doc["choices"]:
                # as the harness asks: the whole text tokenized, the context's tokens first
                ids = ref.tokenize((context + " " + choice).encode(), add_bos=False, special=True)
                start = len(ref.tokenize(context.encode(), add_bos=False, special=True))
                ref.reset()
                ref.eval(ids)
                rows = np.asarray(ref.scores[: len(ids)], dtype=np.float64)
                peak = rows.max(axis=1, keepdims=True)
                lsm = rows - (peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True)))
                expected.append((sum(lsm[i - 1, ids[i]] for i in range(start, len(ids))),
                                 all(int(np.argmax(lsm[i - 1])) == ids[i] for i in range(start, len(ids)))))
            got = [(float(r[0]), r[1] == "True") for r in s["filtered_resps"]]
            for (lg, greedy), (le, greedy_ref) in zip(got, expected, strict=True):
                assert lg == pytest.approx(le, abs=LOGLIK_TOLERANCE), (s["doc_id"], got, expected)
                assert greedy == greedy_ref
            assert int(np.argmax([g[0] for g in got])) == int(np.argmax([e[0] for e in expected]))
    finally:
        ref.close()
