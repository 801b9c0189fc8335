"""Identity and speed per numerics (``gpu_bench --parts identity``): for each ``--numerics`` choice,
one plain and one NGRAM engine on the same prompts (greedy, ``ignore_eos``), how many outputs are
token-identical (a batch against its requests one at a time, NGRAM against plain, NGRAM's variants:
eager, no pipelined verify), then plain and NGRAM tok/s per batch size. Works with
``--load-format dummy`` (identity does not depend on the weights; NGRAM's speed does).
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import print_table

# NGRAM variants, each checked against plain decoding one request at a time: the paths a
# mismatch could come from.
VARIANTS: dict[str, dict[str, Any]] = {
    "graphs": {},
    "eager": {"cuda_graph": False},
    "no pipelined verify": {"pipeline_verify": False},
}


def _ids(llm: Any, prompts: list[Any], params: Any) -> list[list[int]]:
    return [o.token_ids for o in llm.chat(prompts, params, use_tqdm=False)]


def _same(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def _tok_s(llm: Any, prompts: list[Any], params: Any) -> float:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    _ids(llm, prompts, params)  # first use of the batch's shapes
    sync()
    t = time.perf_counter()
    outs = _ids(llm, prompts, params)
    sync()
    return sum(map(len, outs)) / (time.perf_counter() - t)


def bench_identity(
    engine_kwargs: dict[str, Any], numerics: list[str], prompts: list[Any], sizes: list[int], max_tokens: int
) -> dict[str, Any]:
    from ngrammar import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    spec_kw = {"speculative": "ngram", "num_draft_tokens": 16, "spec_policy": "fixed"}
    res: dict[str, Any] = {}
    for num in numerics:
        kw = engine_kwargs | {"numerics": num}
        plain = LLM(**kw)
        alone = [_ids(plain, [p], greedy)[0] for p in prompts]
        cell: dict[str, Any] = {"plain batch == alone": _same(_ids(plain, prompts, greedy), alone)}
        for name, extra in VARIANTS.items():
            spec = LLM(**(kw | spec_kw | extra))
            cell[f"ngram {name} == plain"] = _same([_ids(spec, [p], greedy)[0] for p in prompts], alone)
            if name == "graphs":
                cell["ngram batch == plain"] = _same(_ids(spec, prompts, greedy), alone)
                for bs in sizes:
                    batch = [prompts[i % len(prompts)] for i in range(bs)]
                    cell[f"b{bs} plain tok/s"] = _tok_s(plain, batch, greedy)
                    cell[f"b{bs} ngram tok/s"] = _tok_s(spec, batch, greedy)
            spec.close()
        plain.close()
        res[num] = cell
    keys = list(next(iter(res.values())))
    print_table(
        f"identity and speed per numerics ({len(prompts)} prompts, {max_tokens} tokens, greedy)",
        ["", *res],
        [[k, *[res[n][k] for n in res]] for k in keys],
    )
    return res
