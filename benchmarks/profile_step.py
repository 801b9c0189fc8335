"""Where a decode step's time goes: host Python vs GPU, plain and NGRAM, at small batch sizes.

Prints, per variant: tok/s, the step time, the time the engine spends inside ``runner.forward``
(staging + launch; with CUDA graphs the GPU runs asynchronously), the GPU-bound time of the same
step (the captured graph replayed back to back), the host time left over, and the top functions of
a cProfile run. Writes the profiles under --out.

    python -m benchmarks.profile_step --model /tmp/ngm/model.gguf --out $OUT/profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_grammar import extraction_prompts
from benchmarks.common import chat, decode_seconds, forget_outputs, load_workload, machine, print_table
from benchmarks.host_phases import ENGINE_PHASES, PhaseTimer, graph_launch_us, op_costs
from ngrammar import LLM, SamplingParams


def _prompts(kind: str, bs: int) -> list[Any]:
    items = [w.prompt for w in load_workload() if (w.kind == "open") == (kind == "open")]
    return [chat(items[i % len(items)]) for i in range(bs)]


def _generate(llm: LLM, prompts: list[Any], max_tokens: int, grammar: bool = False) -> tuple[float, int]:
    """Greedy decoding of ``prompts``: to max_tokens, or with ``grammar`` under "any JSON object"
    until the JSON ends."""
    forget_outputs(llm)
    params = (
        SamplingParams(max_tokens=max_tokens, temperature=0, json_object=True)
        if grammar
        else SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    eng = llm.engine
    steps0 = eng.stats.steps
    outs = llm.chat(prompts, params, use_tqdm=False)
    seconds = decode_seconds(outs)
    tokens = sum(len(o.token_ids) - 1 for o in outs)
    return tokens / seconds, eng.stats.steps - steps0


def _padding_graph(llm: LLM, bs: int, width: int) -> Any:
    """The captured (bucket, width) graph over padding-only buffers (short contexts on the dummy page),
    or None without captured graphs."""
    graphs = llm.engine.runner.graphs
    return None if graphs is None or not graphs.capture else graphs.padding_graph(bs, width)


def _graph_replay_ms(llm: LLM, bs: int, width: int, n: int = 50) -> float | None:
    """GPU-bound time of one (bucket, width) graph: replays launched back to back, one sync."""
    graph = _padding_graph(llm, bs, width)
    if graph is None:
        return None
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def kernel_table(llm: LLM, bs: int, width: int, out: Path, replays: int = 10) -> None:
    """CUDA kernel times inside one captured graph (CUPTI sees the kernels a replay runs)."""
    graph = _padding_graph(llm, bs, width)
    if graph is None:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    (out / f"kernels_b{bs}_w{width}.txt").write_text(f"{replays} replays\n{table}")
    print(f"kernels b{bs} w{width}\n{table}", flush=True)


def profile_variant(llm: LLM, label: str, prompts: list[Any], max_tokens: int, out: Path) -> dict[str, Any]:
    _generate(llm, prompts, 16)
    stats = llm.engine.stats
    f0, s0, v0, e0, k0 = (
        stats.forward_seconds,
        stats.step_seconds,
        stats.spec_steps,
        stats.verify_emitted,
        stats.verify_steps,
    )
    vs0, d0, c0 = stats.verify_seconds, stats.draft_seconds, stats.chained_steps
    tok_s, steps = _generate(llm, prompts, max_tokens)
    chained = stats.chained_steps - c0
    verify_steps = stats.spec_steps - v0
    accept = (stats.verify_emitted - e0) / max(stats.verify_steps - k0, 1)
    step_ms = (stats.step_seconds - s0) / steps * 1e3
    forward_ms = (stats.forward_seconds - f0) / steps * 1e3
    # A verify step's own time (drafting to commit) and its drafting + corpus indexing share.
    verify_ms = (stats.verify_seconds - vs0) / max(verify_steps, 1) * 1e3
    draft_ms = (stats.draft_seconds - d0) / max(verify_steps, 1) * 1e3
    prof = cProfile.Profile()
    prof.enable()
    _generate(llm, prompts, max_tokens)
    prof.disable()
    text = io.StringIO()
    ps = pstats.Stats(prof, stream=text)
    ps.sort_stats("tottime").print_stats(40)
    ps.sort_stats("cumtime").print_stats(60)
    (out / f"{label}.prof.txt").write_text(text.getvalue())
    width = _max_width(llm)
    res = {
        "tok_s": tok_s,
        "steps": steps,
        "verify_steps": verify_steps,
        "chained_steps": chained,
        "accept_len": accept,
        "step_ms": step_ms,
        "forward_call_ms": forward_ms,
        "verify_step_ms": verify_ms,
        "draft_ms_per_verify": draft_ms,
        "graph_replay_ms": _graph_replay_ms(llm, len(prompts), 1),
        "graph_replay_verify_ms": None if width == 1 else _graph_replay_ms(llm, len(prompts), width),
    }
    print(label, json.dumps(res), flush=True)
    return res


def _variants(
    plain: LLM, spec: LLM, batch_sizes: list[int], grammar: bool = False
) -> Iterator[tuple[str, LLM, list[Any]]]:
    """("plain|ngram/b{bs}/{grounded|open|json}", engine, prompts) for every batch size, in table
    order; with ``grammar`` only the extraction prompts that the JSON grammar runs on."""
    for bs in batch_sizes:
        for kind in ("json",) if grammar else ("grounded", "open"):
            prompts = extraction_prompts(bs) if kind == "json" else _prompts(kind, bs)
            for name, llm in (("plain", plain), ("ngram", spec)):
                yield f"{name}/b{bs}/{kind}", llm, prompts


def _max_width(llm: LLM) -> int:
    """The widest verify step the engine may run (1 without speculation)."""
    return 1 if llm.engine.ngram is None else llm.engine.ngram.policy.max_width


def phase_variant(llm: LLM, prompts: list[Any], max_tokens: int, grammar: bool = False) -> dict[str, Any]:
    """Host µs per engine step of each engine phase (``PhaseTimer``) over one generation."""
    _generate(llm, prompts, 16, grammar)
    with PhaseTimer() as timer:
        tok_s, steps = _generate(llm, prompts, max_tokens, grammar)
    return {
        "tok_s": tok_s,
        "steps": steps,
        "phases": {name: [us, calls] for name, us, calls in timer.per_step(steps)},
    }


def run_phases(
    plain: LLM, spec: LLM, batch_sizes: list[int], max_tokens: int, grammar: bool = False
) -> dict[str, Any]:
    """The phase table of plain and NGRAM decoding at each batch size, plus single CUDA call costs."""
    log: dict[str, Any] = {
        label: phase_variant(llm, prompts, max_tokens, grammar)
        for label, llm, prompts in _variants(plain, spec, batch_sizes, grammar)
    }
    names = [n for n, _, _ in ENGINE_PHASES if any(n in v["phases"] for v in log.values())]
    rows = [
        [n]
        + [
            f"{v['phases'][n][0]:.0f} ({v['phases'][n][1]:.2f})" if n in v["phases"] else ""
            for v in log.values()
        ]
        for n in names
    ]
    rows.append(["tok/s"] + [f"{v['tok_s']:.0f}" for v in log.values()])
    print_table(
        "host phases: µs per engine step (calls per step), inclusive, nested", ["phase"] + list(log), rows
    )
    ops = op_costs()
    graphs = plain.engine.runner.graphs
    if graphs is not None and graphs.capture:
        ops["graph replay() b1 W1"] = graph_launch_us(_padding_graph(plain, 1, 1))
        width = _max_width(spec)
        if width > 1:
            ops[f"graph replay() b1 W{width}"] = graph_launch_us(_padding_graph(spec, 1, width))
    if ops:
        print_table("host µs per CUDA call", ["call", "µs"], [[k, v] for k, v in ops.items()])
    log["op_costs_us"] = ops
    return log


def run_profile(
    plain: LLM, spec: LLM, batch_sizes: list[int], max_tokens: int, out: Path, kernels: bool = False
) -> dict[str, Any]:
    """Profile plain and NGRAM decoding at each batch size; prints the breakdown table last."""
    out.mkdir(parents=True, exist_ok=True)
    log: dict[str, Any] = {
        label: profile_variant(llm, label.replace("/", "_"), prompts, max_tokens, out)
        for label, llm, prompts in _variants(plain, spec, batch_sizes)
    }
    if kernels:
        for bs, width in ((1, 1), (8, 1), (1, _max_width(spec))):
            kernel_table(spec if width > 1 else plain, bs, width, out)
    rows = [
        [
            k,
            v["tok_s"],
            f"{v['verify_steps']}/{v['chained_steps']}/{v['steps']}",
            v["accept_len"],
            v["step_ms"],
            v["forward_call_ms"],
            v["verify_step_ms"] if v["verify_steps"] else "",
            v["draft_ms_per_verify"] if v["verify_steps"] else "",
            v["graph_replay_ms"] or "",
            v["graph_replay_verify_ms"] or "",
        ]
        for k, v in log.items()
    ]
    print_table(
        "decode step breakdown",
        [
            "variant",
            "tok/s",
            "verify/chained/steps",
            "accept len",
            "step ms",
            "in forward() ms",
            "verify step ms",
            "draft+index ms",
            "replay ms (W=1)",
            "replay ms (W=D)",
        ],
        rows,
    )
    return log


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="profile")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kernels", action="store_true", help="also print the kernels of the b=1 and b=8 graphs")
    p.add_argument(
        "--fixed-width",
        action="store_true",
        help="NGRAM always verifies at D=16 (policy off; trees still trimmed of padding)",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="only the host phase table (benchmarks/host_phases.py), no cProfile or kernels",
    )
    p.add_argument(
        "--grammar",
        action="store_true",
        help="with --phases: extraction prompts under the json_object grammar",
    )
    args = p.parse_args()
    out = Path(args.out)
    plain = LLM(args.model, device=args.device)
    spec = LLM(
        args.model,
        device=args.device,
        speculative="ngram",
        num_draft_tokens=16,
        spec_policy="fixed" if args.fixed_width else "adaptive",
    )
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    out.mkdir(parents=True, exist_ok=True)
    result = (
        run_phases(plain, spec, sizes, args.max_tokens, args.grammar)
        if args.phases
        else run_profile(plain, spec, sizes, args.max_tokens, out, args.kernels)
    )
    log = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "result": result,
    }
    (out / "profile.json").write_text(json.dumps(log, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
