"""How well the draft policy prices verify steps: accepted drafts expected at each exploit or explore
decision against those the verify step then accepted, per match length (greedy, NGRAM D = 16).

A policy that over-prices speculates where it loses (a verify step priced above what it accepts costs more
than the plain steps it replaces); one that under-prices leaves speed unused.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common import chat, load_workload, print_table
from ngrammar import LLM, SamplingParams
from ngrammar.speculative.policy import MAX_MATCH, AdaptiveDraftPolicy


def run_calibration(
    spec: LLM,
    categories: tuple[str, ...] = ("code_edit", "extraction", "summarization", "rag"),
    max_tokens: int = 64,
    per_category: int = 2,
) -> dict[str, Any]:
    """Each grounded prompt alone (batch 1), stepped by hand so that every verify step's expectation
    (``AdaptiveDraftPolicy.priced``) meets its outcome (``NgramSpecWorker`` last accepted drafts)."""
    eng, worker = spec.engine, spec.engine.ngram
    assert worker is not None and isinstance(worker.policy, AdaptiveDraftPolicy), (
        "calibration needs the adaptive policy"
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    work = [w for c in categories for w in [x for x in load_workload() if x.category == c][:per_category]]
    pairs: list[tuple[int, float, int]] = []  # match length, expected, accepted
    for item in work:
        ids = eng.tokenize(chat(item.prompt))
        eng.add_request(ids, params)
        # The pricing of each verify step launched and not committed yet, oldest first: a pipelined
        # verify step (``pipeline_verify``) is committed by the engine step after its own.
        launched: list[dict[str, tuple[int, float]]] = []
        seen = worker.last_drafts
        while eng.has_unfinished():
            eng.step_trace = []
            eng.step()
            record = eng.step_trace[-1]
            if record.kind == "verify":
                exploit = record.reason in ("exploit", "explore")
                launched.append(dict(worker.policy.priced) if exploit else {})
            if worker.last_drafts is not seen:  # the oldest of them was committed
                seen = worker.last_drafts
                for seq_id, (length, expected) in launched.pop(0).items():
                    if seq_id in seen:
                        pairs.append((min(length, MAX_MATCH), expected, seen[seq_id]))
        eng.step_trace = None
    rows, result = [], {}
    for n in sorted({p[0] for p in pairs}):
        got = [p for p in pairs if p[0] == n]
        fig = {
            "steps": len(got),
            "expected": statistics.mean(p[1] for p in got),
            "accepted": statistics.mean(p[2] for p in got),
        }
        result[f"match {n}"] = fig
        rows.append([n, fig["steps"], fig["expected"], fig["accepted"]])
    result["shadow_samples"] = eng.stats.shadow_samples
    print_table(
        f"Draft policy calibration (batch 1, {max_tokens} tokens, {len(work)} grounded prompts)",
        ["match length", "verify steps", "drafts expected", "drafts accepted"],
        rows,
    )
    return result
