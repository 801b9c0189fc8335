"""NGRAM speculation vs plain decoding per prompt category and batch size (same run, same prompts)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common import (
    WorkItem,
    chat,
    decode_seconds,
    forget_outputs,
    load_workload,
    print_table,
    timed,
)
from ngrammar import LLM, SamplingParams


@dataclass
class RunFigures:
    tok_s: float
    accept_len: float
    verify_ms: float
    draft_us: float  # drafting and indexing per verify step
    shadow_us: float  # shadow drafts per engine step


def measure(llm: LLM, prompts: list[Any], max_tokens: int) -> RunFigures:
    forget_outputs(llm)
    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    s0 = (
        eng.stats.spec_steps,
        eng.stats.verify_seconds,
        eng.stats.draft_seconds,
        eng.stats.shadow_seconds,
        eng.stats.steps,
    )
    _, outs = timed(lambda: llm.chat(prompts, params, use_tqdm=False))
    decode = decode_seconds(outs)
    tokens = sum(len(o.token_ids) - 1 for o in outs)
    steps = eng.stats.spec_steps - s0[0]
    accept = [o.metrics["spec_accept_length"] for o in outs if "spec_accept_length" in o.metrics]
    return RunFigures(
        tok_s=tokens / decode,
        accept_len=statistics.mean(accept) if accept else 1.0,
        verify_ms=1e3 * (eng.stats.verify_seconds - s0[1]) / steps if steps else 0.0,
        draft_us=1e6 * (eng.stats.draft_seconds - s0[2]) / steps if steps else 0.0,
        shadow_us=1e6 * (eng.stats.shadow_seconds - s0[3]) / max(eng.stats.steps - s0[4], 1),
    )


def groups(work: list[WorkItem], batch_size: int) -> dict[str, list[list[Any]]]:
    """Batches per category: at batch 1 each prompt alone; larger batches cycle the category."""
    cats: dict[str, list[WorkItem]] = {}
    for w in work:
        cats.setdefault(w.category if w.kind == "grounded" else "open-ended", []).append(w)
    out: dict[str, list[list[Any]]] = {}
    for name, items in cats.items():
        if batch_size == 1:
            out[name] = [[chat(w.prompt)] for w in items[:2]]
        else:
            out[name] = [[chat(items[i % len(items)].prompt) for i in range(batch_size)]]
    return out


def run_spec_benchmark(
    plain: LLM, spec: LLM, batch_sizes: Sequence[int] = (1, 8, 32), max_tokens: int = 64, repeats: int = 1
) -> dict[str, Any]:
    """Per category and batch size: plain and NGRAM runs of the same batches, interleaved
    ``repeats`` times; the ratio is the median of the paired ratios, so a slow spell of a shared
    machine hits both sides of a pair. Odd repeats run NGRAM first (plain, NGRAM, NGRAM, plain,
    ...), so that whatever the first run of a pair leaves behind (warm caches, a grown heap) does
    not always favour the same side."""
    work = load_workload()
    warm = [chat(work[0].prompt)]
    measure(plain, warm, 8)
    measure(spec, warm, 8)
    results: dict[str, Any] = {}
    rows = []
    for bs in batch_sizes:
        for cat, batches in groups(work, bs).items():
            if bs > 8 and cat != "open-ended" and cat != "summarization":
                continue  # large batches: one grounded and one open-ended mix keep the run short
            p: list[RunFigures] = []
            s: list[RunFigures] = []
            ratios = []
            for r in range(repeats):
                sides = [(plain, p), (spec, s)]
                for b in batches:
                    for llm, figures in sides[::-1] if r % 2 else sides:
                        figures.append(measure(llm, b, max_tokens))
                    ratios.append(s[-1].tok_s / p[-1].tok_s)
            p_rate = statistics.median(r.tok_s for r in p)
            s_rate = statistics.median(r.tok_s for r in s)
            fig = {
                "plain_tok_s": p_rate,
                "spec_tok_s": s_rate,
                "ratio": statistics.median(ratios),
                "pair_ratios": ratios,
                "accept_len": statistics.mean(r.accept_len for r in s),
                "verify_ms": statistics.mean(r.verify_ms for r in s),
                "draft_us": statistics.mean(r.draft_us for r in s),
                "shadow_us": statistics.mean(r.shadow_us for r in s),
            }
            results[f"b{bs}/{cat}"] = fig
            rows.append(
                [
                    bs,
                    cat,
                    p_rate,
                    s_rate,
                    fig["ratio"],
                    fig["accept_len"],
                    fig["verify_ms"],
                    fig["draft_us"],
                    fig["shadow_us"],
                ]
            )
    print_table(
        "NGRAM speculation vs plain (greedy)",
        [
            "batch",
            "category",
            "plain tok/s",
            "spec tok/s",
            "ratio",
            "accept len",
            "verify ms/step",
            "draft us/verify step",
            "shadow us/step",
        ],
        rows,
    )
    return results
