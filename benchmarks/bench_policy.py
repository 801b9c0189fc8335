"""The draft policies A/B: plain, fixed width, threshold and adaptive on the same batches, interleaved.

``python -m benchmarks policy --device cpu --batch-sizes 1,8 --repeats 3``

Each repeat runs every engine once per batch in a rotated order (so a slow spell of a shared
machine, or what the first run leaves behind, does not always favour the same engine), and each
policy's figure is the median of its paired ratios to the plain run of the same repeat. The spread
is the half-range of those ratios: a policy wins only by more than that.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.bench_spec import groups, measure
from benchmarks.common import chat, load_workload, print_table
from ngrammar import LLM

POLICIES = ("fixed", "threshold", "adaptive")


def run_policy_benchmark(
    engines: dict[str, LLM], batch_sizes: Sequence[int] = (1, 8), max_tokens: int = 64, repeats: int = 3
) -> dict[str, Any]:
    """``engines``: "plain" and one NGRAM engine per policy name."""
    work = load_workload()
    warm = [chat(work[0].prompt)]
    for llm in engines.values():
        measure(llm, warm, 8)
    names = list(engines)
    results: dict[str, Any] = {}
    rows = []
    for bs in batch_sizes:
        for cat, batches in groups(work, bs).items():
            ratios: dict[str, list[float]] = {n: [] for n in names if n != "plain"}
            rates: dict[str, list[float]] = {n: [] for n in names}
            for r in range(repeats):
                order = names[r % len(names) :] + names[: r % len(names)]
                for b in batches:
                    tok_s = {n: measure(engines[n], b, max_tokens).tok_s for n in order}
                    for n in names:
                        rates[n].append(tok_s[n])
                    for n in ratios:
                        ratios[n].append(tok_s[n] / tok_s["plain"])
            cell = {
                n: {
                    "ratio": statistics.median(v),
                    "spread": (max(v) - min(v)) / 2,
                    "tok_s": statistics.median(rates[n]),
                }
                for n, v in ratios.items()
            }
            cell["plain"] = {"tok_s": statistics.median(rates["plain"])}
            results[f"b{bs}/{cat}"] = cell
            rows.append(
                [bs, cat, cell["plain"]["tok_s"]]
                + [f"{cell[n]['ratio']:.2f} ±{cell[n]['spread']:.2f}" for n in ratios]
            )
    print_table(
        "Draft policies: tok/s ratio to plain (median of paired ratios ± half-range)",
        ["batch", "category", "plain tok/s", *[n for n in names if n != "plain"]],
        rows,
    )
    return results
