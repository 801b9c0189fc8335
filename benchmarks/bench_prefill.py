"""Prefill cost against prompt length (CPU): ``python -m benchmarks.bench_prefill [--lengths 500,2000,8000]``.

Each prompt is ``length`` distinct-looking token ids (no prefix shared with the others, so no cache
can help), generated with ``max_tokens=1``: the time is the prefill's, plus one sampled token.
Prints tok/s per length and each length's time relative to the first length that is >= 2,000.

``--baseline-attention OLD/ngrammar/attention/sdpa.py`` also times the same engine with another
checkout's ``TorchSDPABackend`` swapped in, alternating with this one per length and repeat, so
both see the same machine load (an A/B of an attention change on a shared box).
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


def _use_backend(llm: Any, backend: Any) -> None:
    llm.engine.runner.backend = backend
    for module in llm.engine.runner.model.modules():
        if hasattr(module, "backend"):
            module.backend = backend


def _load_backend(path: str) -> Any:
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("baseline_attention", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module.TorchSDPABackend()


def run_prefill_benchmark(
    llm: Any, lengths: list[int], repeats: int, baseline: Any | None = None
) -> dict[str, Any]:
    from ngrammar import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = llm.engine.tokenizer.vocab_size
    llm.generate([_prompt(64, 0, vocab)], params)  # warm-up
    variants = {"this": llm.engine.runner.backend}
    if baseline is not None:
        variants["baseline"] = baseline
    result: dict[str, Any] = {name: {} for name in variants}
    for n in lengths:
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(repeats):
            prompt = _prompt(n, 1000 * n + r, vocab)
            for name, backend in variants.items():
                _use_backend(llm, backend)
                t = time.perf_counter()
                llm.generate([prompt], params)
                times[name].append(time.perf_counter() - t)
        for name in variants:
            best = min(times[name])
            result[name][str(n)] = {"seconds": best, "tok_per_s": n / best}
            print(f"{name:>8} prefill {n:>6} tokens: {best:8.2f} s  {n / best:8.1f} tok/s", flush=True)
    _use_backend(llm, variants["this"])
    base = next((n for n in lengths if n >= 2000), None)
    if base is not None:
        for name, rows in result.items():
            for n in lengths:
                ratio = rows[str(n)]["seconds"] / rows[str(base)]["seconds"]
                rows[str(n)][f"x_{base}"] = ratio
                print(f"{name:>8} time({n}) / time({base}) = {ratio:.2f}")
    return result


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefill", description=__doc__)
    p.add_argument("--lengths", default="500,2000,8000")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--baseline-attention",
        default=None,
        help="another checkout's attention/sdpa.py (runner/attention.py before the move)",
    )
    add_engine_args(p)
    args = p.parse_args()
    from ngrammar.llm import LLM

    kw = {"device": "cpu", "dtype": "float32", **engine_kwargs(args)}
    kw.setdefault("kv_cache_tokens", 16384)
    llm = LLM(**kw)
    baseline = _load_backend(args.baseline_attention) if args.baseline_attention else None
    result = run_prefill_benchmark(llm, [int(x) for x in args.lengths.split(",")], args.repeats, baseline)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
