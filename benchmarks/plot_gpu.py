"""Plot a gpu_bench JSON log: one panel per question, one colour per workload.

Left: NGRAM / plain speedup per workload against batch size (1.0 = break-even). Right: aggregate
decode tok/s against batch size, plain dashed and NGRAM solid in the workload's colour.

python -m benchmarks.plot_gpu benchmarks/results/gpu_bench_h200.json benchmarks/results/gpu_speedup.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any

# (batch size, plain tok/s, speculative tok/s) per workload
Series = dict[str, list[tuple[int, float, float]]]


def series(log: dict[str, Any]) -> Series:
    """Per workload: plain and NGRAM tok/s per batch size (the grammar cell: plain + grammar vs NGRAM + grammar)."""
    small = log["smollm2"] if "error" not in log["smollm2"] else log["smollm2_eager"]
    out: Series = defaultdict(list)
    for key, v in small.items():
        if "/" not in key or not isinstance(v, dict):
            continue
        bs, cat = int(key.split("/")[0][1:]), key.split("/")[1]
        if cat == "json":
            out["json schema"].append((bs, v["plain+grammar"]["tok_s"], v["ngram+grammar"]["tok_s"]))
        else:
            out[cat].append((bs, v["plain_tok_s"], v["ngram_tok_s"]))
    for pts in out.values():
        pts.sort()
    return out


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = json.load(open(src))
    data = series(log)
    colours = plt.get_cmap("tab10")
    fig, (speed, rate) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, (cat, pts) in enumerate(sorted(data.items())):
        bs = [p[0] for p in pts]
        speed.plot(bs, [p[2] / p[1] for p in pts], marker="o", color=colours(i), label=cat)
        rate.plot(bs, [p[1] for p in pts], marker="o", linestyle="--", color=colours(i), label=f"{cat} plain")
        rate.plot(bs, [p[2] for p in pts], marker="s", color=colours(i), label=f"{cat} NGRAM")
    speed.axhline(1.0, color="grey", linewidth=1)
    speed.set(xscale="log", xlabel="batch size", ylabel="NGRAM / plain (tok/s ratio)")
    speed.set_title("Speedup of NGRAM over plain, per workload")
    speed.set_xscale("log", base=2)
    rate.set_xscale("log", base=2)
    rate.set(yscale="log", xlabel="batch size", ylabel="decode tok/s (aggregate)")
    rate.set_title("Throughput: plain (dashed) and NGRAM (solid)")
    speed.legend(fontsize=8)
    rate.legend(fontsize=7, ncol=2)
    fig.suptitle(f"SmolLM2-135M bf16 on {log['machine'].get('gpu', 'GPU')} ({log['date']})")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
