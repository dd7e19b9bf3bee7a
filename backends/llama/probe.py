"""Whether a loaded model's rows are exact on this CPU: measured at load, in a few tokens.

The layout that can make them exact (flash attention over a quantized K/V cache, the weights as the file
has them: ``LoadOptions.exact_layout``) runs attention through one kernel for every row, but the matrix
products are the weights' own: some types' batch kernels round apart from their one-row kernels on some
CPUs (Gemma 3 270M Q4_K_M, a mixture with Q5_0, Q6_K and Q8_0 tensors, parted on an AVX-512 EPYC at checks
of 8 rows and more; the bundled Q4_1 model never did). Which kernels run depends on the build and the CPU
(AVX2, AVX-512, AMX), so the load measures it instead of assuming it from the config.

``measure`` evaluates a short token sequence three ways on the model's own context, with nothing resident
(the load runs it before any session and before the workspace cache is attached), and clears the KV after:

* its first ``check`` tokens as one batch with every row's logits (a draft's check at its largest,
  ``MAX_DRAFT`` + 1 rows; here over no past, which changes no kernel: the layout's attention runs every
  query row alike whatever the keys);
* the check's last ``alone`` tokens again, one single-row decode step each (what plain decoding does);
* all the tokens as one batch of ``PREFILL_TOKENS`` rows, the first ``check`` rows' logits kept (a prefill);

and compares the float32 logits bit for bit: the check's rows against the prefill's, its last rows against
the steps'. Equal rows mean a check and a prefill compute what one-token steps compute at these batch
sizes. The rows computed alone are the check's last ones, where a kernel that tiles a batch would put a
remainder. The probe is kept to six decode calls and 52 rows (a batch row costs up to ~0.6 of a step in
Q4_1 on AVX2). Not covered: a long past, and batches of other sizes (the matrix products choose their
kernel by row count, which the three shapes span from 1 to ``PREFILL_TOKENS``). At most ``check`` rows
of logits are asked for at once, as a draft's check asks, so the context's output buffer grows no
further than speculation grows it anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import llama_cpp
import numpy as np
from llama_cpp import Llama

from ..tape.speculate import MAX_DRAFT

__all__ = ["ALONE_ROWS", "CHECK_ROWS", "PREFILL_TOKENS", "PROBE_TEXT", "RowsProbe", "measure", "probe_tokens"]

#: a draft's check at its largest: the pending token and ``MAX_DRAFT`` drafted ones
CHECK_ROWS = MAX_DRAFT + 1
#: the check's last rows, computed again one decode step each
ALONE_ROWS = 4
#: the one-batch prefill whose first rows are the check's
PREFILL_TOKENS = 32
#: ordinary text with code in it, tokenized by the model's own vocabulary (repeated when it is short)
PROBE_TEXT = (
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] <= b[0] else b.pop(0))\n"
    "    return out + a + b\n\nThe function merges two sorted lists; each step takes the smaller head, so the "
    "result stays sorted."
)


@dataclass(frozen=True)
class RowsProbe:
    """What the load's probe measured: whether the rows were equal bit for bit, and by how much they were not."""

    #: every compared logit equal bit for bit
    exact: bool
    #: the largest |difference| between a row alone and the same row in a batch (0.0 when exact)
    max_diff: float
    #: the rows of the check, of them the ones also computed alone, and the tokens of the one-batch prefill
    check_rows: int
    alone_rows: int
    prefill_tokens: int
    #: which comparisons parted (none when exact): "steps and check", "check and prefill"
    parted: tuple[str, ...]
    #: what the probe cost, wall time
    ms: float

    def describe(self) -> str:
        """One line for ``status``: what was compared and what came out."""
        shapes = (f"{self.alone_rows} one-token steps, a {self.check_rows}-row check and a "
                  f"{self.prefill_tokens}-token prefill")
        if self.exact:
            return f"probed at load: {shapes}, their rows equal bit for bit ({self.ms:.0f} ms)"
        return (f"probed at load: {shapes}, rows apart by up to {self.max_diff:.3g} in the logits "
                f"({' and '.join(self.parted)}; {self.ms:.0f} ms)")


def probe_tokens(encoded: list[int], bos: int | None, n: int) -> list[int]:
    """``n`` tokens of ``encoded`` (repeated as needed), after ``bos`` when the model adds one."""
    head = [bos] if bos is not None else []
    body = encoded or [0]
    reps = -(-max(n - len(head), 0) // len(body))
    return (head + body * reps)[:n]


def _decode(llm: Llama, tokens: list[int], n_past: int, logit_rows: range) -> np.ndarray:
    """One ``llama_decode`` of ``tokens`` at ``n_past`` (sequence 0), with logits for ``logit_rows`` (indices
    into ``tokens``); those rows' float32 logits, copied out of llama.cpp's buffer."""
    batch = llm._batch
    batch.set_batch(batch=tokens, n_past=n_past, logits_all=False)
    for i in range(len(tokens)):
        batch.batch.logits[i] = i in logit_rows
    llm._ctx.decode(batch)
    n_vocab = int(llm.n_vocab())
    ptr = llama_cpp.llama_get_logits(llm._ctx.ctx)
    return np.ctypeslib.as_array(ptr, shape=(len(logit_rows), n_vocab)).copy()


def measure(llm: Llama, tokens: list[int], check: int = CHECK_ROWS, alone: int = ALONE_ROWS) -> RowsProbe:
    """Compare the logits of ``tokens``' first rows computed alone, in one check and in one prefill (module
    docstring).

    Call it with nothing resident: it decodes into sequence 0 from position 0 and empties the KV after,
    whatever happens (llama.cpp's errors are raised; the load maps them).
    """
    check = min(check, len(tokens) // 2)
    alone = min(alone, check)
    if check < 2:
        raise ValueError(f"a rows probe needs at least 4 tokens, got {len(tokens)}")
    ctx = llm._ctx
    t0 = time.perf_counter()
    try:
        ctx.kv_cache_seq_rm(-1, 0, -1)
        checked = _decode(llm, tokens[:check], 0, range(check))
        ctx.kv_cache_seq_rm(-1, check - alone, -1)
        steps = np.concatenate([_decode(llm, [tokens[p]], p, range(1)) for p in range(check - alone, check)])
        ctx.kv_cache_seq_rm(-1, 0, -1)
        prefilled = _decode(llm, tokens, 0, range(check))
    finally:
        ctx.kv_cache_seq_rm(-1, 0, -1)
    ms = (time.perf_counter() - t0) * 1000
    pairs = {"steps and check": (steps, checked[check - alone :]), "check and prefill": (checked, prefilled)}
    parted = tuple(name for name, (a, b) in pairs.items() if not np.array_equal(a, b))
    diff = max(float(np.max(np.abs(a - b))) for a, b in pairs.values()) if parted else 0.0
    return RowsProbe(exact=not parted, max_diff=diff, check_rows=check, alone_rows=alone,
                     prefill_tokens=len(tokens), parted=parted, ms=ms)
