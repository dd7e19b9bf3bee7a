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


def _task(where: Path, name: str, data: Path) -> None:
    (where / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        # a chat turn, the answer the assistant's: an instruct model ends its reply after a short answer, the
        # case where the sampled token is its end of generation
        'doc_to_text: "<|im_start|>user\\n{{question}}<|im_end|>\\n<|im_start|>assistant\\n"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )


def _run(tmp: Path, port: int, name: str) -> list[dict[str, object]]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
         f"base_url=http://127.0.0.1:{port}/v1/completions,model=any,tokenizer_backend=remote,"
         "num_concurrent=1,max_retries=1",
         "--tasks", name, "--include_path", str(tmp), "--log_samples", "--output_path", str(tmp / f"out-{name}")],
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for f in (tmp / f"out-{name}").rglob(f"samples_{name}_*.jsonl")
            for line in f.read_text().splitlines()]


def test_lm_eval_multiple_choice_scores_as_llama_cpp_does(tmp_path: Path) -> None:
    """The items sent in two orders to one daemon (the second run finds the first's prompts resident, in another
    order): each choice's log likelihood is llama.cpp's own, whatever the daemon held before the request, and the
    choice that ends the reply (the model's next token is its end of generation) counts its own last token."""
    from backends.llama.native import open_llama  # the daemon's kernels (its AMX workaround too)

    docs = [json.loads(line) for line in DATA.read_text().splitlines()]
    reversed_data = tmp_path / "code_mc_reversed.jsonl"
    reversed_data.write_text("".join(json.dumps(d) + "\n" for d in reversed(docs)))
    _task(tmp_path, TASK, DATA)
    _task(tmp_path, TASK + "_reversed", reversed_data)
    port = free_port()
    d = DaemonProcess(tmp_path / "d", "llama", None, "--http", f"127.0.0.1:{port}", "--num-ctx", "1024")
    d.start(wait_state=("Ready",))
    try:
        wait_http(port)
        with d.client(timeout_s=30.0) as c:
            active = c.status().active
        assert active is not None
        forward = _run(tmp_path, port, TASK)
        backward = _run(tmp_path, port, TASK + "_reversed")
    finally:
        d.stop()
    assert len(forward) == len(backward) == len(docs)
    by_doc = {id(s): docs[s["doc_id"]] for s in forward}  # type: ignore[index]
    by_doc.update({id(s): docs[len(docs) - 1 - s["doc_id"]] for s in backward})  # type: ignore[operator]

    ref = open_llama(active.path, n_ctx=1024, n_batch=512, n_ubatch=512, logits_all=True, verbose=False,
                     swa_full=True)
    ends = {ref.token_eos(), *(t for t in range(ref.n_vocab())
                                if ref.detokenize([t], special=True) in (b"<|im_end|>", b"<|endoftext|>"))}
    ended = 0
    try:
        expected_of: dict[str, list[tuple[float, bool]]] = {}
        for doc in docs:
            context = f"<|im_start|>user\n{doc['question']}<|im_end|>\n<|im_start|>assistant\n"
            expected = []
            for choice in doc["choices"]:
                # as the harness asks: the whole text tokenized, the context's tokens first (the context's trailing
                # whitespace moved to the continuation, as the harness moves it)
                head = context.rstrip()
                ids = ref.tokenize((context + " " + choice).encode(), add_bos=False, special=True)
                start = len(ref.tokenize(head.encode(), add_bos=False, special=True))
                ref.reset()
                ref.eval(ids)
                rows = np.asarray(ref.scores[: len(ids)], dtype=np.float64)
                peak = rows.max(axis=1, keepdims=True)
                lsm = rows - (peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True)))
                expected.append((sum(lsm[i - 1, ids[i]] for i in range(start, len(ids))),
                                 all(int(np.argmax(lsm[i - 1])) == ids[i] for i in range(start, len(ids)))))
                ended += int(np.argmax(lsm[len(ids) - 1])) in ends
            expected_of[doc["question"]] = expected
        for s in [*forward, *backward]:
            doc = by_doc[id(s)]
            expected = expected_of[doc["question"]]
            got = [(float(r[0]), r[1] == "True") for r in s["filtered_resps"]]  # type: ignore[index]
            for (lg, greedy), (le, greedy_ref) in zip(got, expected, strict=True):
                assert lg == pytest.approx(le, abs=LOGLIK_TOLERANCE), (doc["question"], got, expected)
                assert greedy == greedy_ref
            assert int(np.argmax([g[0] for g in got])) == int(np.argmax([e[0] for e in expected]))
    finally:
        ref.close()
    # the data holds choices the model would end its reply after: the case a reply without its end token's
    # entry scored wrong (its last token dropped)
    assert ended >= 1
