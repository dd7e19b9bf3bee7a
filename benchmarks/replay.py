"""Draft policies replayed on recorded answers: what a policy would cost, beside the best any could.

A speculative figure from ``make bench`` moves by +-5% run to run here, and in the
engines' default layouts the speculative answer may part from the plain one. To
weigh a change to ``backends.tape.speculate`` (its priors, match classes, when to
probe), replay it instead: record each task's plain greedy answer once per engine
(``record``: the tape before the answer, the answer's token ids and the check cost
table the model measured at load), then walk each answer as the decode loop would
(``replay``: the same lookup, the same policy, the same limits), pricing a plain
step at 1 and a check at what the table says. The answer is the same whatever is
drafted (true with exact decode, where a check's rows are one-token steps'), so
ratios of two policies compare like with like and cost no engine time.

``oracle`` is the least cost of the same answer knowing it in advance, drafting
from the same lookup: how much any policy over these drafts could still gain.

    python -m benchmarks.replay record llama rec-llama.json [--exact] [--model PATH]
    python -m benchmarks.replay show rec-llama.json [more.json ...]

``tests/test_replay.py`` checks that a replay drafts what the session's decode
loop drafts on the same tape, batch for batch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from backends.tape.speculate import MATCH_CLASSES, CheckCosts, DraftPolicy, PromptLookup, draft_limit

__all__ = ["Recorded", "Replayed", "copies_known", "oracle", "record", "replay"]

#: a draft the answer agrees with for this many tokens is a copy (``copies_known``)
COPY_RUN = 8


@dataclass
class Recorded:
    """One plain greedy answer: the tape before it, its tokens, and the turn's token budget."""

    name: str
    prompt: list[int]
    answer: list[int]
    max_tokens: int


@dataclass
class Replayed:
    """What a policy's drafts cost over one answer, in plain steps, and the checks it ran."""

    cost: float
    drafted: int = 0
    kept: int = 0
    #: the rows of every check, in order (the pending token and its draft)
    checks: list[list[int]] = field(default_factory=list)

    def speedup(self, answer: list[int]) -> float:
        return speedup(answer, self.cost)


def speedup(answer: list[int], cost: float) -> float:
    """Plain decoding's cost of ``answer`` over ``cost`` (plain evaluates every token but the first)."""
    return (len(answer) - 1) / cost if cost > 0 else 1.0


def _kept(draft: list[int], answer: list[int], after: int) -> int:
    """How many of ``draft`` the answer's tokens after index ``after`` agree with."""
    kept = 0
    while kept < len(draft) and after + 1 + kept < len(answer) and draft[kept] == answer[after + 1 + kept]:
        kept += 1
    return kept


def replay(rec: Recorded, costs: CheckCosts, num_ctx: int,
           policy: Callable[[CheckCosts], DraftPolicy] = DraftPolicy,
           lookup_of: Callable[[Recorded], PromptLookup] = lambda rec: PromptLookup(rec.prompt)) -> Replayed:
    """Walk ``rec``'s answer as ``TapeSession``'s decode loop would with ``policy``, pricing each
    evaluation from ``costs``: 1 a plain step, ``costs.cost(rows, context)`` a check, and
    ``costs.switch()`` on the evaluation after every change of row count."""
    pol = policy(costs)
    lookup = lookup_of(rec)
    answer = rec.answer
    out = Replayed(cost=0.0)
    checking = False
    j = 0  # answer[j] is the pending token: sampled, not yet evaluated
    while j < len(answer) - 1:
        tok = answer[j]
        lookup.extend([tok])
        context = len(rec.prompt) + j
        draft, matched = lookup.propose(draft_limit(rec.max_tokens, j + 1, num_ctx, context))
        draft = draft[: pol.plan(len(draft), matched, context)]
        if not draft:
            out.cost += 1.0 + (costs.switch() if checking else 0.0)
            checking = False
            pol.plain_step()
            j += 1
            continue
        out.cost += costs.cost(len(draft) + 1, context) + (0.0 if checking else costs.switch())
        checking = True
        kept = _kept(draft, answer, j)
        out.checks.append([tok, *draft])
        lookup.extend(draft[:kept])
        pol.checked(matched, len(draft), kept)
        out.drafted += len(draft)
        out.kept += kept
        j += kept + 1
    if checking:
        out.cost += costs.switch()  # the next pass starts with a step
    return out


class _KnownCopies(PromptLookup):
    """The lookup, but a match whose draft the answer goes on to follow for ``COPY_RUN`` tokens or
    more says it matched as far as a long match does: the policy trusts every copy from its start."""

    def __init__(self, rec: Recorded) -> None:
        super().__init__(rec.prompt)
        self._rec = rec

    def propose(self, limit: int) -> tuple[list[int], int]:
        draft, matched = super().propose(limit)
        pending = len(self.tape) - len(self._rec.prompt) - 1  # the answer's index of the tape's last token
        if draft and _kept(draft, self._rec.answer, pending) >= COPY_RUN:
            matched = MATCH_CLASSES[-1]
        return draft, matched


def copies_known(rec: Recorded, costs: CheckCosts, num_ctx: int) -> Replayed:
    """The policy told which matches start a copy (a draft the answer follows for ``COPY_RUN`` tokens
    or more), however short the match: what knowing when a copy starts could gain, beside what
    knowing where each copy ends too (``oracle``) could."""
    return replay(rec, costs, num_ctx, lookup_of=_KnownCopies)


def oracle(rec: Recorded, costs: CheckCosts, num_ctx: int) -> float:
    """The least cost of ``rec``'s answer, in plain steps, choosing each draft's length knowing the
    answer (the drafts are the lookup's: the tape before each token is the answer's, whatever was
    drafted). A dynamic program over (pending token, whether the last evaluation was a check)."""
    answer = rec.answer
    n = len(answer)
    if n < 2:
        return 0.0
    lookup = PromptLookup(rec.prompt)
    drafts: list[list[int]] = []
    for j in range(n - 1):
        lookup.extend([answer[j]])
        drafts.append(lookup.propose(draft_limit(rec.max_tokens, j + 1, num_ctx, len(rec.prompt) + j))[0])
    sw = costs.switch()
    # best[j][c]: the cost from pending token j on; c: the last evaluation was a check
    best = [[0.0, sw] for _ in range(n)]
    for j in range(n - 2, -1, -1):
        context = len(rec.prompt) + j
        agree = _kept(drafts[j], answer, j)
        for c in (0, 1):
            cost = 1.0 + (sw if c else 0.0) + best[j + 1][0]
            for k in range(1, len(drafts[j]) + 1):
                nxt = min(j + 1 + min(agree, k), n - 1)
                cost = min(cost, costs.cost(k + 1, context) + (0.0 if c else sw) + best[nxt][1])
            best[j][c] = cost
    return best[0][0]


def record(engine: str, exact: bool = False, model: str | None = None) -> dict[str, Any]:  # pragma: no cover
    """Each decode task and prose prompt of ``benchmarks.decode`` answered plainly, in process, on
    ``model`` (a GGUF path; the bundled model by default) with exact decode's settings when
    ``exact``, and the model's cost table (kept from an earlier load, else measured first, as an idle daemon does)."""
    from backends.bundled import bundled_gguf_path
    from benchmarks.decode import EXACT_DECODE, NUM_CTX, PROSE_PROMPTS, TASKS, _backend, prefill_turn
    from contract.types import ChatMessage, Config, DecodeConfig, OpenSessionRequest, SuffixInput

    settings = EXACT_DECODE[engine] if exact else {}
    req = OpenSessionRequest(path=model or str(bundled_gguf_path()), config=Config(num_ctx=NUM_CTX, **settings))
    loaded = _backend(engine).load(req, lambda _f: None)
    try:
        loaded.idle_work()  # the check costs, when none are kept for this model and machine
        sess = loaded.open_session()
        manifest = loaded.manifest_defaults().model_copy(update={"profile": "bench-replay"})
        turns = list(TASKS) + [(f"prose prompt {i}", SuffixInput(messages=[ChatMessage(role="user", content=text)]), 128)
                               for i, text in enumerate(PROSE_PROMPTS[1:], 2)]
        recs: list[Recorded] = []
        for name, suffix, n in turns:
            prefill_turn(sess, manifest, suffix)
            prompt = list(loaded.res.tokens)
            ids: list[int] = []
            for chunk in sess.decode(DecodeConfig(max_tokens=n, temperature=0.0, speculative=False,
                                                  return_token_ids=True)):
                ids += chunk.token_ids
            recs.append(Recorded(name, prompt, ids, n))
        costs = loaded.draft_costs
        return {"engine": engine, "exact": exact, "model": req.path, "num_ctx": loaded.num_ctx,
                "recs": [asdict(r) for r in recs],
                "costs": costs.table(), "growth": costs.growth(), "switch": costs.switch()}
    finally:
        loaded.close()


def show(data: dict[str, Any]) -> list[str]:
    """A line per recorded answer: the current policy's speedup and kept drafts, the policy's told
    where copies start (``copies_known``), and the oracle's."""
    costs = CheckCosts(data["costs"], data["growth"], data["switch"])
    model = f", {Path(data['model']).name}" if data.get("model") else ""
    lines = [f"{data['engine']}{' (exact decode)' if data['exact'] else ''}{model}: {costs}"]
    for raw in data["recs"]:
        rec = Recorded(**raw)
        got = replay(rec, costs, data["num_ctx"])
        known = copies_known(rec, costs, data["num_ctx"]).speedup(rec.answer)
        ideal = speedup(rec.answer, oracle(rec, costs, data["num_ctx"]))
        lines.append(f"  {rec.name:24} {len(rec.answer):4} tokens  policy {got.speedup(rec.answer):.3f}x "
                     f"({got.kept} of {got.drafted} kept)  copy starts known {known:.3f}x  oracle {ideal:.3f}x")
    return lines


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - a manual entry point
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replay", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="answer the bench's turns plainly and keep the tapes")
    rec.add_argument("engine", choices=("llama", "openvino"))
    rec.add_argument("out", type=Path)
    rec.add_argument("--exact", action="store_true", help="with exact decode's settings")
    rec.add_argument("--model", help="a GGUF file to answer with (default: the bundled model)")
    shown = sub.add_parser("show", help="replay the current policy over recorded tapes")
    shown.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "record":
        args.out.write_text(json.dumps(record(args.engine, args.exact, args.model)))
        return 0
    for path in args.files:
        print("\n".join(show(json.loads(path.read_text()))))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
