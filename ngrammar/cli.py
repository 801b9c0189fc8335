"""Command line: ``ngrammar generate | serve`` (benchmarks: ``python -m benchmarks``). Errors print one line and exit 2."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from ngrammar.args import add_config_args, add_engine_args, engine_kwargs
from ngrammar.sampling_params import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--json-schema", default=None, help="JSON schema (inline JSON or @file)")
    p.add_argument("--regex", default=None)
    p.add_argument(
        "--ignore-eos", action="store_true", help="generate max-tokens tokens whatever the model ends with"
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    schema = args.json_schema
    if schema is not None and schema.startswith("@"):
        with open(schema[1:]) as f:
            schema = f.read()
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        json_schema=schema,
        regex=args.regex,
        ignore_eos=args.ignore_eos,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ngrammar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for a prompt or a JSONL file of prompts")
    gen.add_argument("prompt", nargs="?", default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--stream", action="store_true")
    gen.add_argument("--input", default=None, help="JSONL with {prompt | messages, optional sampling fields}")
    gen.add_argument("--output", default=None, help="JSONL results (default: stdout)")
    add_sampling_args(gen)
    add_engine_args(gen)

    from ngrammar.server.config import ServerConfig  # (ngrammar.server's package imports the web stack)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_config_args(srv, ServerConfig, "server")
    add_engine_args(srv)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "node_rank", None):  # another node of a multi-node engine: its ranks only
            from ngrammar.distributed.driver import run_node
            from ngrammar.llm import build_engine_config

            return run_node(build_engine_config(**engine_kwargs(args)))
        if args.command == "generate":
            return _generate(args)
        from ngrammar.args import config_kwargs
        from ngrammar.server.config import ServerConfig

        config = ServerConfig(**config_kwargs(args, ServerConfig))  # (validated: bad flags exit 2 here)
        if config.api_server_count > 1:
            from ngrammar.server.api_servers import serve_processes

            return serve_processes(args)
        from ngrammar.server.app import serve

        return serve(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the CLI's contract: one clear line, exit code 2, no traceback
        print(f"ngrammar: error: {e}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from ngrammar.llm import LLM

    if (args.prompt is None) == (args.input is None):
        raise ValueError("give either a PROMPT or --input prompts.jsonl")
    params = sampling_params(args)
    rows = (
        _read_rows(args.input, args.chat) if args.input is not None else None
    )  # checked before the model loads
    llm = LLM(**engine_kwargs(args))
    if rows is not None:
        return _generate_batch(llm, args, params, rows)
    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    if args.stream:
        return _stream(llm, prompt, params)
    out = llm.chat(prompt, params)[0] if args.chat else llm.generate(prompt, params)[0]
    if out.outputs[0].error:
        raise ValueError(out.outputs[0].error)
    print(out.text)
    return 0


def _stream(llm: Any, prompt: Any, params: SamplingParams) -> int:
    engine = llm.engine
    rid = engine.add_request(prompt, params)
    shown, error = 0, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                text = out.text
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
                error = out.outputs[0].error
    sys.stdout.write("\n")
    if error:  # the same contract as without --stream: one error line, exit code 2
        raise ValueError(error)
    return 0


# JSONL rows may set any sampling field; anything else in a row is a mistake, not a silent no-op.
_ROW_PARAMS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.name != "extra")


def _read_rows(path: str, chat: bool) -> list[tuple[int, dict[str, Any], Any]]:
    """(line number, row, prompt) for each non-empty line; ``chat`` wraps plain prompts in a user
    message, as ``--chat`` does for one prompt."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: a row must be a JSON object, got {type(row).__name__}")
            if ("prompt" in row) == ("messages" in row):
                raise ValueError(f"{path}:{n}: a row needs exactly one of 'prompt' and 'messages'")
            unknown = sorted(set(row) - _ROW_PARAMS - {"prompt", "messages"})
            if unknown:
                raise ValueError(f"{path}:{n}: unknown field(s) {', '.join(unknown)}")
            if "messages" in row and not isinstance(row["messages"], list):
                raise ValueError(f"{path}:{n}: 'messages' must be a list of {{role, content}} objects")
            prompt = row["messages"] if "messages" in row else row["prompt"]
            if chat and isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            rows.append((n, row, prompt))
    return rows


def _generate_batch(
    llm: Any, args: argparse.Namespace, params: SamplingParams, rows: list[tuple[int, dict[str, Any], Any]]
) -> int:
    plist = []
    for n, row, _ in rows:
        overrides = {k: v for k, v in row.items() if k in _ROW_PARAMS}
        try:
            plist.append(dataclasses.replace(params, **overrides))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{args.input}:{n}: {e}") from e
    labels = [f"{args.input}:{n}" for n, _, _ in rows]  # a bad prompt or grammar names its line
    outs = llm._run([prompt for _, _, prompt in rows], plist, None, labels)
    sink = open(args.output, "w") if args.output else sys.stdout
    failed = 0
    try:
        for (_, row, _), out in zip(rows, outs):
            record: dict[str, Any] = {
                "prompt": row.get("prompt", row.get("messages")),
                "text": out.text,
                "finish_reason": out.finish_reason,
                "metrics": out.metrics,
            }
            if len(out.outputs) > 1:
                record["outputs"] = [{"text": c.text, "finish_reason": c.finish_reason} for c in out.outputs]
            if out.outputs[0].logprobs is not None:  # [token id, logprob, [[id, logprob] of the top ones]]
                record["logprobs"] = [
                    [lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in out.outputs[0].logprobs
                ]
            errors = [c.error for c in out.outputs if c.error]
            if errors:
                record["error"] = errors[0]
                failed += 1
            sink.write(json.dumps(record) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    if failed:
        raise ValueError(f"{failed} of {len(rows)} requests failed (see their 'error' fields)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
