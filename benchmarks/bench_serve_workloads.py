"""Serving workloads of the scheduler: each runs on one server with the feature on and one with it off.

shared-prefix: one ~1,500-token system prompt (instructions and a JSON schema) with N distinct short
    questions (JSON-schema-constrained answers), C concurrent streaming clients: TTFT p50 / p99 and
    throughput with the prefix cache on and off (``--no-prefix-cache``).
long-arrivals: S streams decoding (fixed length) while ~2,000-token prompts arrive every few
    seconds: the streams' inter-token latency (ITL: the gap between two content chunks, one token
    each for plain decoding) p50 / p99, with mixed steps on and off (``--no-mixed-steps``), and the
    same streams without arrivals (the baseline the target compares against).

    python -m benchmarks serve --workload shared-prefix --num-requests 64 --concurrency 8
    python -m benchmarks serve --workload long-arrivals --streams 8 --arrival-every 3
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx

from benchmarks.bench_serve import ServerProcess, _one_request, _pct, _request_bytes, run_level
from benchmarks.common import print_table

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "intent": {"type": "string", "enum": ["order", "refund", "question", "complaint"]},
        "reply": {"type": "string", "maxLength": 60},
    },
    "required": ["intent", "reply"],
    "additionalProperties": False,
}
_TOPICS = ["order", "refund", "delivery", "warranty", "invoice", "size", "colour", "discount"]
_ASKS = [
    "Where is my {} ?",
    "Can you explain the {} rules?",
    "I have a problem with the {}.",
    "Is the {} free?",
]


def system_prompt(target_tokens: int = 1500) -> str:
    """Support-desk instructions plus a JSON schema of the records the desk knows, grown field by
    field to about ``target_tokens`` tokens of the embedded tokenizer."""
    from ngrammar.model.loader import resolve_checkpoint
    from ngrammar.model.tokenizer import Tokenizer

    ckpt = resolve_checkpoint(None)
    tok = Tokenizer(ckpt.tokenizer_dir, ckpt.config.eos_token_ids)
    head = (
        "You are the support desk of an online bicycle shop. Classify every customer message and "
        "answer in one short sentence, as JSON with the fields intent and reply. Never invent "
        "orders, prices or dates. The records you may refer to follow this JSON schema:\n"
    )
    props: dict[str, Any] = {}
    i = 0
    while True:
        text = head + json.dumps({"type": "object", "properties": props}, indent=1)
        if len(tok.encode(text)) >= target_tokens:
            return text
        topic = _TOPICS[i % len(_TOPICS)]
        props[f"{topic}_{i}"] = {
            "type": "string",
            "description": f"The customer's {topic} record number {i}, as printed on the {topic} slip.",
        }
        i += 1


def shared_prefix_bodies(
    system: str, num_requests: int, max_tokens: int
) -> list[tuple[dict[str, Any], bool]]:
    bodies = []
    for i in range(num_requests):
        question = f"Customer {i}: " + _ASKS[i % len(_ASKS)].format(_TOPICS[(i // len(_ASKS)) % len(_TOPICS)])
        body = {
            "model": "default",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}},
        }
        bodies.append((body, True))
    return bodies


def run_shared_prefix(
    server_args: Sequence[str], num_requests: int, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    system = system_prompt()
    results: dict[str, Any] = {"workload": "shared-prefix", "levels": []}
    for cache in (True, False):
        args = [*server_args, *([] if cache else ["--no-prefix-cache"])]
        with ServerProcess(args, False) as server:
            # warm-up (grammar compile, first-request costs) on another system prompt
            run_level(server.port, shared_prefix_bodies("Be brief.", 2, 4), 2)
            records, wall = run_level(
                server.port, shared_prefix_bodies(system, num_requests, max_tokens), concurrency
            )
            info = server.server_info()
        ok = [r for r in records if r.ok]
        ttft = [r.ttft_s for r in ok]
        results["levels"].append(
            {
                "prefix_cache": cache,
                "requests": len(records),
                "errors": len(records) - len(ok),
                "wall_s": wall,
                "throughput_tok_s": sum(r.completion_tokens for r in ok) / wall,
                "requests_s": len(ok) / wall,
                "ttft_p50_ms": 1e3 * _pct(ttft, 50),
                "ttft_p99_ms": 1e3 * _pct(ttft, 99),
                "hit_rate": info["prefix_cache"]["hit_rate"],
            }
        )
    rows = [
        [
            "on" if lv["prefix_cache"] else "off",
            lv["requests"],
            lv["errors"],
            lv["ttft_p50_ms"],
            lv["ttft_p99_ms"],
            lv["throughput_tok_s"],
            lv["requests_s"],
            lv["hit_rate"],
        ]
        for lv in results["levels"]
    ]
    print_table(
        f"Shared prefix: {num_requests} questions after one ~1,500-token system prompt, {concurrency} clients, "
        f"JSON-schema answers, max_tokens={max_tokens}",
        ["prefix cache", "reqs", "err", "TTFT p50 ms", "TTFT p99 ms", "tok/s", "req/s", "hit rate"],
        rows,
    )
    return results


async def _stream_gaps(client: httpx.AsyncClient, body: dict[str, Any]) -> list[float]:
    """Seconds between consecutive content chunks of one streaming request."""
    stamps: list[float] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


async def _long_arrivals(
    url: str, streams: int, stream_tokens: int, arrivals: int, every_s: float, prompt_tokens: int
) -> tuple[list[float], list[float]]:
    """The streams' chunk gaps, and the arriving requests' TTFTs (none when ``arrivals`` is 0)."""
    filler = "The committee reviewed the quarterly figures of every regional office in detail. "
    long_text = filler * (prompt_tokens // 14)
    stream_body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        "max_tokens": stream_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    limits = httpx.Limits(max_connections=streams + arrivals + 4)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        tasks = [asyncio.create_task(_stream_gaps(client, stream_body)) for _ in range(streams)]
        ttfts = []
        if arrivals:
            await asyncio.sleep(every_s)
            arriving = []
            for i in range(arrivals):
                body = {  # distinct from the first token on: nothing to share
                    "model": "default",
                    "messages": [{"role": "user", "content": f"Report {i}. {long_text} Summarize."}],
                    "max_tokens": 4,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                port = int(url.rsplit(":", 1)[1])
                arriving.append(asyncio.create_task(_one_request(port, _request_bytes(body), False)))
                await asyncio.sleep(every_s)
            ttfts = [r.ttft_s for r in await asyncio.gather(*arriving)]
        gaps = [g for t in await asyncio.gather(*tasks) for g in t]
    return gaps, ttfts


def run_long_arrivals(
    server_args: Sequence[str],
    streams: int,
    stream_tokens: int,
    arrivals: int,
    every_s: float,
    prompt_tokens: int = 2000,
) -> dict[str, Any]:
    results: dict[str, Any] = {"workload": "long-arrivals", "levels": []}
    for mixed in (True, False):
        args = [*server_args, *([] if mixed else ["--no-mixed-steps"])]
        with ServerProcess(args, False) as server:
            asyncio.run(_long_arrivals(server.url, 2, 4, 0, 0.0, prompt_tokens))  # warm-up
            cases = (
                [("streams alone", 0), ("with arrivals", arrivals)]
                if mixed
                else [("with arrivals", arrivals)]
            )
            for name, n in cases:
                gaps, ttfts = asyncio.run(
                    _long_arrivals(server.url, streams, stream_tokens, n, every_s, prompt_tokens)
                )
                results["levels"].append(
                    {
                        "mixed_steps": mixed,
                        "case": name,
                        "itl_p50_ms": 1e3 * _pct(gaps, 50),
                        "itl_p99_ms": 1e3 * _pct(gaps, 99),
                        "itl_max_ms": 1e3 * max(gaps, default=float("nan")),
                        "arrival_ttft_p50_ms": 1e3 * _pct(ttfts, 50),
                    }
                )
            info = server.server_info()
            results["levels"][-1]["mixed_step_count"] = info["stats"]["mixed_steps"]
    rows = [
        [
            "on" if lv["mixed_steps"] else "off",
            lv["case"],
            lv["itl_p50_ms"],
            lv["itl_p99_ms"],
            lv["itl_max_ms"],
            lv["arrival_ttft_p50_ms"],
        ]
        for lv in results["levels"]
    ]
    print_table(
        f"Long arrivals: {streams} streams of {stream_tokens} tokens, a ~{prompt_tokens}-token prompt every "
        f"{every_s:g} s ({arrivals} of them)",
        ["mixed steps", "case", "ITL p50 ms", "ITL p99 ms", "ITL max ms", "arrival TTFT p50 ms"],
        rows,
    )
    return results
