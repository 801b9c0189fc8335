"""Shared benchmark helpers: the workload, timing, medians, paired A/B runs and table printing."""

from __future__ import annotations

import json
import platform
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class WorkItem:
    category: str
    kind: str  # "grounded" or "open"
    prompt: str


def load_workload() -> list[WorkItem]:
    with open(DATA / "spec_workload.jsonl") as f:
        return [WorkItem(**json.loads(line)) for line in f if line.strip()]


def chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def median_of(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def decode_seconds(outs: Sequence[Any]) -> float:
    """The decode phase of one batch of finished outputs: from the last first token to the last finish.

    (Total time minus the longest time to first token over-counts when admission work - prompt
    indexing for NGRAM - delays the first requests more than the last ones: the difference then
    includes later prefill chunks.) It assumes every prefill ends before decoding starts, as it does
    while the batch fits ``max_running_requests`` and the KV pool."""
    done = [o.metrics for o in outs if "first_token_time" in o.metrics and "finish_time" in o.metrics]
    if len(done) != len(outs):
        raise ValueError(
            f"{len(outs) - len(done)} of {len(outs)} outputs have no first token or never finished"
        )
    return max(m["finish_time"] for m in done) - max(m["first_token_time"] for m in done)


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        from ngrammar.kernels.device_info import pdl_supported

        info["gpu"] = torch.cuda.get_device_name()
        info["pdl"] = pdl_supported(torch.device("cuda"))  # programmatic dependent launch (NGRAMMAR_PDL)
    return info


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    print(f"\n## {title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)


def forget_outputs(llm: Any) -> None:
    """Empty the n-gram corpus (and the field memory) so a repeated prompt cannot draft from its own
    earlier output."""
    spec = llm.engine.ngram
    if spec is not None:
        spec.corpus.reset()
        if spec.proposer.memory is not None:
            spec.proposer.memory.clear()


def run_chat(llm: Any, prompts: list[Any], params: Any) -> tuple[float, list[Any]]:
    """One batch of chats from an empty corpus: decode tok/s (``decode_seconds``) and the outputs."""
    forget_outputs(llm)
    outs = llm.chat(prompts, params, use_tqdm=False)
    decode = decode_seconds(outs)
    return sum(len(o.token_ids) - 1 for o in outs) / decode, outs


def accept_length(outs: list[Any]) -> float:
    """Mean spec accept length over outputs (1.0 where none verified)."""
    vals = [o.metrics["spec_accept_length"] for o in outs if "spec_accept_length" in o.metrics]
    return statistics.mean(vals) if vals else 1.0


VerifyRun = tuple[float, list[Any], float]  # tok/s, outputs, ms per verify step


def verify_run(llm: Any, prompts: list[Any], params: Any) -> VerifyRun:
    """``run_chat`` plus the run's mean ms per verify step (of the engine's stats)."""
    stats = llm.engine.stats
    steps, seconds = stats.spec_steps, stats.verify_seconds
    tok_s, outs = run_chat(llm, prompts, params)
    return tok_s, outs, 1e3 * (stats.verify_seconds - seconds) / max(stats.spec_steps - steps, 1)


def verify_pairs(
    a: tuple[str, Callable[[], VerifyRun]], b: tuple[str, Callable[[], VerifyRun]], repeats: int
) -> dict[str, Any]:
    """Two variants of the same work run in interleaved pairs after one dropped warm-up pair (odd
    pairs run ``a`` first): medians of tok/s and ms per verify step per side (keys prefixed by the
    side's name), the paired tok/s ratio a / b, ``a``'s accept length, and the share of requests
    whose tokens were identical on both sides in the last pair."""
    (name_a, run_a), (name_b, run_b) = a, b
    runs: tuple[list[VerifyRun], list[VerifyRun]] = ([], [])
    for i in range(repeats + 1):
        for side in (0, 1) if i % 2 else (1, 0):
            r = (run_a, run_b)[side]()
            if i:
                runs[side].append(r)
    ra, rb = runs
    same = [x.token_ids == y.token_ids for x, y in zip(ra[-1][1], rb[-1][1])]
    return {
        f"{name_a}_tok_s": statistics.median(r[0] for r in ra),
        f"{name_b}_tok_s": statistics.median(r[0] for r in rb),
        "ratio": statistics.median(x[0] / y[0] for x, y in zip(ra, rb)),
        f"{name_a}_verify_ms": statistics.median(r[2] for r in ra),
        f"{name_b}_verify_ms": statistics.median(r[2] for r in rb),
        "accept_len": accept_length(ra[-1][1]),
        "identical": sum(same) / len(same),
    }


def switch_pairs(
    llm: Any,
    prompts: list[Any],
    params: Any,
    switch: str,
    a: tuple[str, Any],
    b: tuple[str, Any],
    repeats: int,
) -> dict[str, Any]:
    """``verify_pairs`` of one engine whose NGRAM worker attribute ``switch`` is set to ``a``'s
    value for side a and ``b``'s for side b (name, value), restored afterwards: one engine, so the
    two sides share everything but the switch."""
    worker = llm.engine.ngram
    before = getattr(worker, switch)

    def side(value: Any) -> Callable[[], VerifyRun]:
        def go() -> VerifyRun:
            setattr(worker, switch, value)
            return verify_run(llm, prompts, params)

        return go

    try:
        return verify_pairs((a[0], side(a[1])), (b[0], side(b[1])), repeats)
    finally:
        setattr(worker, switch, before)


def copy_tokenizer(source: Path, folder: Path) -> None:
    """Copy a model folder's tokenizer files and chat template into ``folder`` (a benchmark's
    random-weight model speaks the embedded model's tokens)."""
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, folder / f.name)
