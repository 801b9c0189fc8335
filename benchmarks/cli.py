"""``python -m benchmarks [engine|spec|policy|grammar|serve|profile|host|verify-host|calibration|drafts|tp|bombs|footprint]``: build the engines once and run a suite."""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import machine
from ngrammar.args import add_engine_args, engine_kwargs

SUITES = (
    "engine",
    "spec",
    "policy",
    "grammar",
    "serve",
    "profile",
    "host",
    "verify-host",
    "calibration",
    "drafts",
    "tp",
    "bombs",
    "footprint",
)


def build_parser() -> argparse.ArgumentParser:
    bench = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    bench.add_argument("suite", nargs="?", default="engine", choices=SUITES)
    bench.add_argument("--grammar", action="store_true", help="same as the 'grammar' suite")
    bench.add_argument("--batch-sizes", default=None, help="comma-separated, e.g. 1,8,32")
    bench.add_argument("--max-tokens", type=int, default=None)
    bench.add_argument("--repeats", type=int, default=None)
    bench.add_argument("--out", default=None, help="write the results as JSON here")
    bench.add_argument("--no-transformers", action="store_true")
    serve = bench.add_argument_group("serve suite")
    serve.add_argument(
        "--workload", default="sweep", choices=["sweep", "shared-prefix", "long-arrivals"], help="serve suite"
    )
    serve.add_argument(
        "--modes",
        default="off,ngram",
        help="sweep: comma-separated plain, off, ngram, ngram+grammar, off+grammar, free (bench_serve.MODES)",
    )
    serve.add_argument("--clients", type=int, default=None, help="sweep: client processes")
    serve.add_argument(
        "--no-serve-warmup", action="store_true", help="sweep: time a fresh server's first requests"
    )
    serve.add_argument(
        "--server-path", default=None, help="sweep: PYTHONPATH of the servers (another checkout)"
    )
    serve.add_argument(
        "--tiny-layers",
        type=int,
        default=0,
        help="sweep: serve a host-bound random-weight Llama of this many 16-wide layers (the real tokenizer)",
    )
    serve.add_argument(
        "--dummy-shape",
        action="store_true",
        help="sweep: serve the embedded model's architecture with seeded random weights (--load-format"
        " dummy): real step costs, no checkpoint to carry",
    )
    serve.add_argument(
        "--server-flags", default="", help="sweep: more 'ngrammar serve' flags, e.g. '--api-server-count 4'"
    )
    serve.add_argument("--num-requests", type=int, default=None, help="sweep: per level; shared-prefix: 64")
    serve.add_argument("--concurrency", type=int, default=8, help="shared-prefix clients")
    serve.add_argument("--streams", type=int, default=8, help="long-arrivals: decoding streams")
    serve.add_argument("--arrivals", type=int, default=4, help="long-arrivals: long prompts that arrive")
    serve.add_argument("--arrival-every", type=float, default=3.0, help="long-arrivals: seconds apart")
    bombs = bench.add_argument_group("bombs and footprint suites")
    bombs.add_argument("--root", default=None, help="the checkout to run (default: this one)")
    bombs.add_argument("--bomb-modes", default="plain,ngram,ngram+grammar", help="comma-separated")
    bombs.add_argument("--max-growth-mb", type=float, default=3000, help="server RSS growth that kills it")
    bombs.add_argument("--bomb-timeout", type=float, default=60, help="seconds a bomb request may take")
    bench.add_argument(
        "--structured", action="store_true", help="grammar: the structured-output workloads (draft sources)"
    )
    bench.add_argument(
        "--batch-job", type=int, default=0, help="grammar --structured: N same-schema requests"
    )
    bench.add_argument(
        "--host-fill",
        action="store_true",
        help="grammar: host time of a plain step's grammar work, one by one vs one call vs the fill pool vs the "
        "engine's whole path (upload and masking on --device)",
    )
    add_engine_args(bench)
    return bench


def _llm(args: argparse.Namespace, speculative: bool) -> Any:
    from ngrammar.llm import LLM

    kw = engine_kwargs(args)
    kw["speculative"] = "ngram" if speculative else None
    if not speculative:
        kw = {
            k: v for k, v in kw.items() if not k.startswith(("ngram_", "num_draft", "spec_", "draft_corpus"))
        }
    elif "num_draft_tokens" not in kw:
        kw["num_draft_tokens"] = 8
    return LLM(**kw)


def _sizes(args: argparse.Namespace, default: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(x) for x in args.batch_sizes.split(",")) if args.batch_sizes else default


def _serve_args(args: argparse.Namespace) -> list[str]:
    """Engine flags given to ``python -m benchmarks serve`` pass through to the servers it starts."""
    out = []
    for flag in (
        "model",
        "device",
        "dtype",
        "kv_cache_tokens",
        "max_running_requests",
        "max_prefill_tokens",
        "mixed_step_tokens",
    ):
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    for switch in ("prefix_cache", "mixed_steps"):  # on by default: given, they turn the feature off
        if getattr(args, switch) is False:
            out.append(f"--no-{switch.replace('_', '-')}")
    return out


def run_benchmark(args: argparse.Namespace) -> int:
    suite = "grammar" if args.grammar else args.suite
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if suite == "engine":
        from benchmarks.bench_engine import run_engine_benchmark

        result = run_engine_benchmark(_llm(args, False), args.max_tokens or 64, not args.no_transformers)
    elif suite == "spec" and args.device == "cpu" and args.batch_sizes is None:
        from benchmarks.bench_cpu import run_cpu_benchmark

        result = run_cpu_benchmark(
            engine_kwargs(args), args.max_tokens or 64, args.repeats or 1, not args.no_transformers
        )
    elif suite == "spec":
        from benchmarks.bench_spec import run_spec_benchmark

        result = run_spec_benchmark(
            _llm(args, False),
            _llm(args, True),
            _sizes(args, (1, 8, 32)),
            args.max_tokens or 64,
            args.repeats or 1,
        )
    elif suite == "policy":
        from benchmarks.bench_policy import POLICIES, run_policy_benchmark

        engines = {"plain": _llm(args, False)}
        for name in POLICIES:
            args.spec_policy = name
            engines[name] = _llm(args, True)
        result = run_policy_benchmark(engines, _sizes(args, (1, 8)), args.max_tokens or 64, args.repeats or 3)
    elif suite == "grammar":
        from benchmarks.bench_grammar import run_grammar_benchmark

        if args.host_fill:
            from benchmarks.bench_grammar import run_host_fill_benchmark

            result = run_host_fill_benchmark(
                args.model, _sizes(args, (8, 32, 64)), repeats=args.repeats or 3, device=args.device or "auto"
            )
        elif args.structured:
            from benchmarks.bench_grammar import run_structured_benchmark

            plain, spec = _llm(args, False), _llm(args, True)
            result = {
                f"b{b}": run_structured_benchmark(
                    plain, spec, b, args.max_tokens or 64, repeats=args.repeats or 3
                )
                for b in _sizes(args, (1, 8))
            }
            if args.batch_job:
                result["batch_job"] = run_structured_benchmark(
                    plain, spec, 0, args.max_tokens or 64, args.batch_job, args.repeats or 3
                )
        else:
            plain, spec = _llm(args, False), _llm(args, True)
            result = {
                f"b{b}": run_grammar_benchmark(plain, spec, b, args.max_tokens or 96, args.repeats or 2)
                for b in _sizes(args, (1,))
            }
    elif suite == "calibration":
        from benchmarks.bench_calibration import run_calibration

        result = run_calibration(_llm(args, True), max_tokens=args.max_tokens or 64)
    elif suite == "drafts":
        from benchmarks.bench_draft_quality import run_draft_quality

        result = run_draft_quality(_llm(args, False), args.max_tokens or 128)
    elif suite == "tp":  # --tp N (default 3: SmolLM2's 9 heads / 3 KV heads) and --dp N (default 2)
        from benchmarks.bench_tp import run_tp_benchmark

        kw = engine_kwargs(args)
        kw.pop("speculative", None)
        result = run_tp_benchmark(
            kw,
            kw.get("tensor_parallel_size", 3),
            kw.get("data_parallel_size", 2),
            _sizes(args, (1, 8, 32)),
            args.max_tokens or 16,
            args.repeats or 8,
        )
    elif suite == "host":
        from benchmarks.bench_host import run_host_benchmark

        result = run_host_benchmark(_sizes(args, (1, 8)), args.max_tokens or 128)
    elif suite == "verify-host":
        from benchmarks.bench_host import run_verify_host_benchmark

        result = run_verify_host_benchmark(_sizes(args, (1, 4)), args.max_tokens or 64)
    elif suite == "profile":
        from benchmarks.profile_step import run_profile

        out_dir = Path(args.out).with_suffix("") if args.out else Path("profile")
        result = run_profile(
            _llm(args, False), _llm(args, True), list(_sizes(args, (1, 8))), args.max_tokens or 128, out_dir
        )
    elif suite == "serve" and args.workload == "shared-prefix":
        from benchmarks.bench_serve_workloads import run_shared_prefix

        result = run_shared_prefix(
            _serve_args(args), args.num_requests or 64, args.concurrency, args.max_tokens or 24
        )
    elif suite == "serve" and args.workload == "long-arrivals":
        from benchmarks.bench_serve_workloads import run_long_arrivals

        result = run_long_arrivals(
            _serve_args(args), args.streams, args.max_tokens or 96, args.arrivals, args.arrival_every
        )
    elif suite in ("bombs", "footprint"):
        from benchmarks.bench_bombs import ROOT, run_bombs, run_footprint

        root = Path(args.root) if args.root else ROOT
        if suite == "footprint":
            result = run_footprint(root)
        else:
            modes = [m.strip() for m in args.bomb_modes.split(",") if m.strip()]
            result = run_bombs(root, modes, args.max_growth_mb, args.bomb_timeout)
    else:
        from benchmarks.bench_serve import CLIENT_PROCESSES, MODES, run_serve_benchmark

        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not set(modes) <= set(MODES):
            raise SystemExit(f"--modes takes {', '.join(MODES)}")
        server_args = _serve_args(args) + shlex.split(args.server_flags)
        with tempfile.TemporaryDirectory() as tmp:
            if args.tiny_layers and args.dummy_shape:
                raise SystemExit("--tiny-layers and --dummy-shape pick two different models")
            if args.tiny_layers:
                from benchmarks.bench_host import tiny_checkpoint

                server_args += ["--model", str(tiny_checkpoint(Path(tmp) / "tiny", args.tiny_layers))]
            if args.dummy_shape:
                from benchmarks.bench_host import shape_checkpoint

                server_args += [
                    "--model",
                    str(shape_checkpoint(Path(tmp) / "shape")),
                    "--load-format",
                    "dummy",
                ]
            result = run_serve_benchmark(
                concurrency=_sizes(args, (1, 4, 16)),
                num_requests=args.num_requests,
                max_tokens=args.max_tokens or 64,
                server_args=server_args,
                modes=modes,
                server_path=args.server_path,
                clients=args.clients or CLIENT_PROCESSES,
                warmup=not args.no_serve_warmup,
            )
    record = {"suite": suite, "date": started, "machine": machine(), "result": result}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return 0
