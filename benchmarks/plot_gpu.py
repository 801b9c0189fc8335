"""Plot tok/s vs batch size per variant from a gpu_bench JSON log.

python -m benchmarks.plot_gpu benchmarks/results/gpu_bench_h200.json benchmarks/results/gpu_tok_s.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def series(log: dict) -> dict[str, list[tuple[int, float]]]:  # type: ignore[type-arg]
    small = log["smollm2"] if "error" not in log["smollm2"] else log["smollm2_eager"]
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for key, v in small.items():
        if "/" not in key or not isinstance(v, dict):
            continue
        bs = int(key.split("/")[0][1:])
        cat = key.split("/")[1]
        if cat == "json":
            for label in ("plain+grammar", "ngram+grammar", "ngram+grammar readback"):
                out[f"json {label}"].append((bs, v[label]["tok_s"]))
        else:
            out[f"{cat} plain"].append((bs, v["plain_tok_s"]))
            out[f"{cat} ngram"].append((bs, v["ngram_tok_s"]))
    for key, v in log.get("links_equal_work", {}).items():  # the policy-off D = 16 pair (part "links")
        if isinstance(v, dict) and "host_links_tok_s" in v:
            bs = int(key[1:])
            out["json D=16 host links"].append((bs, v["host_links_tok_s"]))
            out["json D=16 readback links"].append((bs, v["readback_tok_s"]))
    return out


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = json.load(open(src))
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, pts in sorted(series(log).items()):
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            label=label,
            linestyle="--" if "plain" in label else "-",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tok/s (aggregate)")
    ax.set_title(f"SmolLM2-135M bf16 on {log['machine'].get('gpu', 'GPU')} ({log['date']})")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
