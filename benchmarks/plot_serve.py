"""Plot a serve-sweep JSON log (``python -m benchmarks serve --workload sweep --out F``): one colour per mode.

Left: aggregate completion tok/s against concurrency. Right: TPOT p50 (solid) and p99 (dashed)
against concurrency.

python -m benchmarks.plot_serve benchmarks/results/serve_sweep_cpu.json benchmarks/results/serve_sweep_cpu.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any

# mode -> (concurrency, tok/s, TPOT p50 ms, TPOT p99 ms), sorted by concurrency
Series = dict[str, list[tuple[int, float, float, float]]]


def series(log: dict[str, Any]) -> Series:
    result = log.get("result", log)
    out: Series = defaultdict(list)
    for lv in result["levels"]:
        mode = lv.get("mode", "ngram" if lv["speculative"] else "off")
        out[mode].append((lv["concurrency"], lv["throughput_tok_s"], lv["tpot_p50_ms"], lv["tpot_p99_ms"]))
    for pts in out.values():
        pts.sort()
    return out


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(json.load(open(src)))
    colours = plt.get_cmap("tab10")
    fig, (rate, tpot) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, (mode, pts) in enumerate(sorted(data.items())):
        conc = [p[0] for p in pts]
        rate.plot(conc, [p[1] for p in pts], marker="o", color=colours(i), label=mode)
        tpot.plot(conc, [p[2] for p in pts], marker="o", color=colours(i), label=f"{mode} p50")
        tpot.plot(
            conc, [p[3] for p in pts], marker="s", linestyle="--", color=colours(i), label=f"{mode} p99"
        )
    for ax in (rate, tpot):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
    rate.set(ylabel="completion tok/s (aggregate)", title="Throughput per mode")
    tpot.set(ylabel="time per output token (ms)", title="TPOT p50 (solid) and p99 (dashed)")
    rate.legend(fontsize=8)
    tpot.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
