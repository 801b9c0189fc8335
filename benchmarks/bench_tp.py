"""Tensor and data parallelism: decode step time at TP=1 vs TP=N, and DP replicas' throughput.

Decode steps are timed from the engine's step trace (plain steps only: "decode" and "chain"), the
median per batch size. DP throughput: the same requests through the replica router (no HTTP) with
1 and with N replicas, tokens per second of wall time. On a CPU (gloo) these only have to run: a
step there is ~60 collectives across processes; the multi-GPU figures belong to a GPU run.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

from ngrammar import LLM, SamplingParams
from ngrammar.llm import build_engine_config

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "List five fruits:",
    "In 1969, the first humans",
    "A good breakfast includes",
]


def _prompts(batch_size: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(batch_size)]


def decode_step_ms(llm: LLM, batch_size: int, steps: int) -> float:
    """Median plain decode step (ms) of a batch of ``batch_size`` running ``steps`` tokens each."""
    eng = llm.engine
    eng.step_trace = []
    try:
        llm.generate(_prompts(batch_size), SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
        times = [
            r.seconds for r in eng.step_trace if r.kind in ("decode", "chain") and r.batch_size == batch_size
        ]
    finally:
        eng.step_trace = None
    return 1e3 * statistics.median(times) if times else float("nan")


def run_tp_step_times(
    kwargs: dict[str, Any], tp: int, batch_sizes: Sequence[int], steps: int
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for size in (1, tp):
        llm = LLM(**{**kwargs, "tensor_parallel_size": size})
        try:
            decode_step_ms(llm, 1, 4)  # warm-up
            out[f"tp{size}"] = {f"b{b}": decode_step_ms(llm, b, steps) for b in batch_sizes}
        finally:
            llm.engine.close()
        print(f"TP={size}: decode step ms " + "  ".join(f"{k} {v:.1f}" for k, v in out[f"tp{size}"].items()))
    return out


async def _router_throughput(kwargs: dict[str, Any], dp: int, requests: int, max_tokens: int) -> float:
    from ngrammar.server.core_client import start_cores

    config = build_engine_config(**{**kwargs, "data_parallel_size": dp})
    front, router = start_cores(config, max(requests, 1), None)
    router.start()
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        ids = [front.tokenize(p) for p in _prompts(requests)]
        t0 = time.perf_counter()
        group = router.submit(ids, [params] * len(ids))
        while not group.done:
            await group.wait_update(1.0)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in group.latest.values())
        return tokens / seconds
    finally:
        await asyncio.to_thread(router.stop)


def run_dp_throughput(kwargs: dict[str, Any], dp: int, requests: int, max_tokens: int) -> dict[str, float]:
    out = {}
    for size in (1, dp):
        out[f"dp{size}"] = asyncio.run(_router_throughput(kwargs, size, requests, max_tokens))
        print(f"DP={size}: {out[f'dp{size}']:.1f} tok/s ({requests} requests x {max_tokens} tokens)")
    return out


def run_tp_benchmark(
    kwargs: dict[str, Any], tp: int, dp: int, batch_sizes: Sequence[int], steps: int, requests: int
) -> dict[str, Any]:
    kwargs = {k: v for k, v in kwargs.items() if k not in ("tensor_parallel_size", "data_parallel_size")}
    return {
        "decode_step_ms": run_tp_step_times(kwargs, tp, batch_sizes, steps),
        "dp_tok_s": run_dp_throughput(kwargs, dp, requests, steps),
    }
