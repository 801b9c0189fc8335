"""The benchmark harness itself: what it pairs and in which order (no model needed)."""

from __future__ import annotations

from typing import Any

import pytest

import benchmarks.bench_spec as bench_spec
from benchmarks.common import WorkItem


def test_paired_runs_alternate_which_side_goes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    plain, spec = object(), object()
    order: list[str] = []
    rates = {id(plain): 10.0, id(spec): 20.0}

    def measure(llm: Any, prompts: list[Any], max_tokens: int) -> bench_spec.RunFigures:
        if max_tokens == 64:  # the warm-up runs use 8 tokens
            order.append("plain" if llm is plain else "spec")
        return bench_spec.RunFigures(rates[id(llm)], 1.0, 0.0, 0.0)

    monkeypatch.setattr(bench_spec, "measure", measure)
    monkeypatch.setattr(bench_spec, "load_workload", lambda: [WorkItem("rag", "grounded", "p")])
    out = bench_spec.run_spec_benchmark(plain, spec, batch_sizes=(8,), repeats=3)  # type: ignore[arg-type]
    assert order == ["plain", "spec", "spec", "plain", "plain", "spec"]
    assert out["b8/rag"]["pair_ratios"] == [2.0, 2.0, 2.0]
