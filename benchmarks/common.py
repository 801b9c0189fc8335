"""Shared benchmark helpers: the workload, timing, medians and table printing."""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

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
        raise ValueError(f"{len(outs) - len(done)} of {len(outs)} outputs have no first token or never finished")
    return max(m["finish_time"] for m in done) - max(m["first_token_time"] for m in done)


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "threads": torch.get_num_threads()}
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
    """Empty the n-gram corpus so a repeated prompt cannot draft from its own earlier output."""
    spec = llm.engine.spec
    if spec is not None:
        spec.corpus.reset()
