"""Prefill cost against prompt length (CPU): ``python -m benchmarks.bench_prefill [--lengths 500,2000,8000]``.

Each prompt is ``length`` distinct-looking token ids (no prefix shared with the others, so no cache
can help), generated with ``max_tokens=1``: the time is the prefill's, plus one sampled token.
Prints tok/s per length and each length's time relative to the first length that is >= 2,000.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from ngrammar.args import add_engine_args, engine_kwargs


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(length)]


def run_prefill_benchmark(llm: Any, lengths: list[int], repeats: int) -> dict[str, Any]:
    from ngrammar import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = llm.engine.tokenizer.vocab_size
    llm.generate([_prompt(64, 0, vocab)], params)  # warm-up
    rows: dict[str, Any] = {}
    for n in lengths:
        times = []
        for r in range(repeats):
            prompt = _prompt(n, 1000 * n + r, vocab)
            t = time.perf_counter()
            llm.generate([prompt], params)
            times.append(time.perf_counter() - t)
        best = min(times)
        rows[str(n)] = {"seconds": best, "tok_per_s": n / best}
        print(f"prefill {n:>6} tokens: {best:8.2f} s  {n / best:8.1f} tok/s", flush=True)
    base = next((n for n in lengths if n >= 2000), None)
    if base is not None:
        for n in lengths:
            ratio = rows[str(n)]["seconds"] / rows[str(base)]["seconds"]
            rows[str(n)][f"x_{base}"] = ratio
            print(f"time({n}) / time({base}) = {ratio:.2f}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefill", description=__doc__)
    p.add_argument("--lengths", default="500,2000,8000")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None)
    add_engine_args(p)
    args = p.parse_args()
    from ngrammar.llm import LLM

    kw = {"device": "cpu", "dtype": "float32", **engine_kwargs(args)}
    kw.setdefault("kv_cache_tokens", 16384)
    llm = LLM(**kw)
    result = run_prefill_benchmark(llm, [int(x) for x in args.lengths.split(",")], args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
