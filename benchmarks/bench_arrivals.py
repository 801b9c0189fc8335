"""Continuous arrivals, offline: ``c`` streams (ramped up one per step), each replaced by a new
request as it finishes, so
the engine runs mixed steps (decode rows + a newcomer's prefill) as a serving engine does; the same
engine with its mixed-step graphs on and off (``gpu_bench --parts arrivals``).

Prompts are tokenized before the clock starts (a server's API processes do that, not its core);
greedy, ``ignore_eos``, so both variants decode the same number of tokens.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from benchmarks.common import print_table

_runs = itertools.count()


def arrivals(
    llm: Any, prompts: list[list[int]], concurrency: int, requests: int, max_tokens: int
) -> dict[str, Any]:
    """``requests`` requests, at most ``concurrency`` at a time; tok/s, the share of mixed steps,
    the outputs in request order."""
    from ngrammar import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    run = next(_runs)
    steps, mixed = eng.stats.steps, eng.stats.mixed_steps
    done: dict[int, list[int]] = {}
    added = 0

    def add() -> None:
        nonlocal added
        eng.add_request(
            prompts[added % len(prompts)], params, request_id=f"arrival-{run}-{added}", stream=False
        )
        added += 1

    start = time.perf_counter()
    add()
    while eng.has_unfinished():
        finished = [o for o in eng.step() if o.finished]
        for out in finished:
            done[int(out.request_id.rsplit("-", 1)[1])] = out.outputs[0].token_ids
        # one newcomer per step while the streams ramp up (their ends then fall on different
        # steps, as a server's do), then one per finished stream
        want = len(finished) + (added - len(done) < concurrency)
        for _ in range(min(want, requests - added, concurrency - (added - len(done)))):
            add()
    seconds = time.perf_counter() - start
    n = eng.stats.steps - steps
    return {
        "tok_s": sum(map(len, done.values())) / seconds,
        "steps": n,
        "mixed_share": (eng.stats.mixed_steps - mixed) / n if n else 0.0,
        "outputs": [done[i] for i in range(requests)],
    }


def bench_arrivals(llm: Any, prompts: list[Any], sizes: list[int], max_tokens: int) -> dict[str, Any]:
    """Per concurrency: tok/s with the mixed-step graphs and without (the same engine, its
    ``runner.mixed`` set aside), whether the outputs are the same, the share of mixed steps."""
    runner = llm.engine.runner
    graphs = runner.mixed
    ids = [llm.engine.tokenize(p) for p in prompts]
    arrivals(llm, ids, max(sizes), max(sizes), 4)  # first-use costs (the attention kernels' shapes)
    res: dict[str, Any] = {}
    try:
        for c in sizes:
            runs = {}
            for name, g in (("graphs", graphs), ("eager", None)):
                if name == "graphs" and graphs is None:
                    continue
                runner.mixed = g
                runs[name] = arrivals(llm, ids, c, 4 * c, max_tokens)
            cell: dict[str, Any] = {f"{k}_tok_s": r["tok_s"] for k, r in runs.items()}
            cell["mixed_share"] = runs["eager"]["mixed_share"]
            if "graphs" in runs:
                cell["ratio"] = runs["graphs"]["tok_s"] / runs["eager"]["tok_s"]
                cell["same"] = runs["graphs"]["outputs"] == runs["eager"]["outputs"]
            res[f"c{c}"] = cell
    finally:
        runner.mixed = graphs
    return res


def summarize_arrivals(res: dict[str, Any]) -> None:
    rows = [
        [
            key,
            v.get("graphs_tok_s", "-"),
            v["eager_tok_s"],
            v.get("ratio", "-"),
            v.get("same", "-"),
            f"{v['mixed_share']:.0%}",
        ]
        for key, v in res.items()
    ]
    print_table(
        "Continuous arrivals (each finished stream replaced): mixed-step graphs on / off, same engine",
        ["concurrency", "graphs tok/s", "eager tok/s", "graphs / eager", "same tokens", "mixed steps"],
        rows,
    )
