"""Serving benchmark: latency and throughput of ``ngrammar serve`` under concurrent streaming clients.

For each speculation mode (off / NGRAM) and each concurrency level, a fresh server subprocess is
started (so the n-gram corpus holds nothing from an earlier level), ``num_requests`` streaming chat
requests are sent with at most ``concurrency`` in flight, and the client records per request:
TTFT (first content chunk), TPOT ((end - first token) / (tokens - 1)) and end-to-end latency.
Every fourth request asks for a JSON-schema-constrained answer; the others ignore EOS, so their
length is exactly ``max_tokens``.

Prompts come from ``benchmarks/data/serve_prompts.jsonl`` (first turns of Spec-Bench subset
questions: MT-bench categories plus short summarization and RAG items).

Run from the repo root:
  .venv/bin/python -m benchmarks.bench_serve --concurrency 1,4,16 --max-tokens 64 \\
      --server-args "--device cpu --dtype float32 --kv-cache-tokens 16384"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common import DATA, print_table

PROMPTS = DATA / "serve_prompts.jsonl"
STRUCTURED_EVERY = 4  # request i is structured when i % STRUCTURED_EVERY == STRUCTURED_EVERY - 1
SUMMARY_SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "key_points": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 3},
        "confidence": {"type": "number"},
    },
    "required": ["topic", "key_points", "confidence"],
    "additionalProperties": False,
}
_STARTUP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RequestRecord:
    structured: bool
    ok: bool
    ttft_s: float
    e2e_s: float
    completion_tokens: int

    @property
    def tpot_s(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


def load_prompts(path: Path = PROMPTS) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


# ---------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``ngrammar serve`` in a subprocess (its own interpreter: client and server do not share a GIL)."""

    def __init__(self, server_args: Sequence[str], speculative: bool) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "ngrammar.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *server_args,
            *(["--speculative", "ngram"] if speculative else []),
        ]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ngrammar-serve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)  # failures already quoted the log's tail

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(
            f"the server did not become healthy in {_STARTUP_TIMEOUT_S:.0f}s:\n{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def server_info(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/server_info", timeout=10).json())


# ---------------------------------------------------------------- client


def request_body(prompt: str, structured: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if structured:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "summary", "schema": SUMMARY_SCHEMA},
        }
    else:
        body["ignore_eos"] = True  # fixed output length: comparable TPOT and throughput
    return body


async def _one_request(client: httpx.AsyncClient, body: dict[str, Any], structured: bool) -> RequestRecord:
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    ok = True
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return RequestRecord(structured, False, 0.0, time.perf_counter() - start, 0)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                ok = False
                continue
            if first is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                first = time.perf_counter()
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    end = time.perf_counter()
    return RequestRecord(structured, ok, (first or end) - start, end - start, tokens)


async def _run_level(
    url: str, bodies: list[tuple[dict[str, Any], bool]], concurrency: int
) -> tuple[list[RequestRecord], float]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:

        async def gated(body: dict[str, Any], structured: bool) -> RequestRecord:
            async with gate:
                return await _one_request(client, body, structured)

        start = time.perf_counter()
        records = await asyncio.gather(*(gated(b, s) for b, s in bodies))
        return list(records), time.perf_counter() - start


def workload(
    prompts: list[str], num_requests: int, max_tokens: int, every: int = STRUCTURED_EVERY
) -> list[tuple[dict[str, Any], bool]]:
    """``num_requests`` chat requests; every ``every``-th is JSON-schema constrained (1: all)."""
    out = []
    for i in range(num_requests):
        structured = i % every == every - 1
        out.append((request_body(prompts[i % len(prompts)], structured, max_tokens), structured))
    return out


# --------------------------------------------------------------- figures


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(records: list[RequestRecord], wall_s: float, accept_length: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    e2e = [r.e2e_s for r in ok]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "structured": sum(r.structured for r in records),
        "wall_s": wall_s,
        "throughput_tok_s": tokens / wall_s if wall_s else 0.0,
        "requests_s": len(ok) / wall_s if wall_s else 0.0,
        "completion_tokens": tokens,
        "ttft_p50_ms": 1e3 * _pct(ttft, 50),
        "ttft_p99_ms": 1e3 * _pct(ttft, 99),
        "tpot_p50_ms": 1e3 * _pct(tpot, 50),
        "tpot_p99_ms": 1e3 * _pct(tpot, 99),
        "e2e_p50_s": _pct(e2e, 50),
        "e2e_p99_s": _pct(e2e, 99),
        "avg_spec_accept_length": accept_length,
    }


# "+grammar": every request JSON-schema constrained; "free": none is (the others: every fourth)
MODES = ("off", "ngram", "ngram+grammar", "off+grammar", "free")


def _levels(modes: Sequence[str], concurrency: Sequence[int]) -> Iterator[tuple[str, int]]:
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; use {', '.join(MODES)}")
        for c in concurrency:
            yield mode, c


def run_serve_benchmark(
    concurrency: Sequence[int] = (1, 4, 16),
    num_requests: int | None = None,
    speculative: Sequence[bool] = (False, True),
    max_tokens: int = 64,
    server_args: Sequence[str] = (),
    warmup: bool = True,
    modes: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run every (speculation, concurrency) level on a fresh server; returns the figures and prints a table.

    ``num_requests`` per level defaults to 4x the concurrency (at least 8), capped at the number of
    distinct prompts so no prompt repeats within a level. ``modes`` (``MODES``) replaces
    ``speculative`` where given.
    """
    prompts = load_prompts()
    results: dict[str, Any] = {"max_tokens": max_tokens, "server_args": list(server_args), "levels": []}
    if modes is None:
        modes = ["ngram" if s else "off" for s in speculative]
    for mode, c in _levels(modes, concurrency):
        spec = mode.startswith("ngram")
        n = num_requests or min(len(prompts), max(4 * c, 8))
        every = 1 if mode.endswith("+grammar") else n + 1 if mode == "free" else STRUCTURED_EVERY
        with ServerProcess(server_args, spec) as server:
            if warmup:  # first-request costs (grammar compile, allocator, kernels) are not serving costs
                asyncio.run(_run_level(server.url, workload(prompts[:1], STRUCTURED_EVERY, 4), 2))
            before = server.server_info()["stats"]
            records, wall = asyncio.run(_run_level(server.url, workload(prompts, n, max_tokens, every), c))
            after = server.server_info()["stats"]
        steps = after["verify_steps"] - before["verify_steps"]
        accept = (after["verify_emitted"] - before["verify_emitted"]) / steps if steps else 0.0
        level = {"mode": mode, "speculative": spec, "concurrency": c, **summarize(records, wall, accept)}
        results["levels"].append(level)
    print_results(results)
    return results


def print_results(results: dict[str, Any]) -> None:
    header = [
        "spec",
        "conc",
        "reqs",
        "err",
        "tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "e2e p50 s",
        "e2e p99 s",
        "accept len",
    ]
    rows = [
        [
            lv.get("mode", "ngram" if lv["speculative"] else "off"),
            lv["concurrency"],
            lv["requests"],
            lv["errors"],
            lv["throughput_tok_s"],
            lv["ttft_p50_ms"],
            lv["ttft_p99_ms"],
            lv["tpot_p50_ms"],
            lv["tpot_p99_ms"],
            lv["e2e_p50_s"],
            lv["e2e_p99_s"],
            lv["avg_spec_accept_length"],
        ]
        for lv in results["levels"]
    ]
    print_table(
        f"Serving, chat streaming, max_tokens={results['max_tokens']}, 1 in {STRUCTURED_EVERY} "
        "JSON-schema constrained (+grammar: all)",
        header,
        rows,
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    p.add_argument(
        "--num-requests", type=int, default=None, help="per level (default: 4x concurrency, 8..32)"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--spec", default="off,ngram", help="comma-separated: off, ngram, ngram+grammar")
    p.add_argument("--server-args", default="", help="extra 'ngrammar serve' flags, e.g. '--device cpu'")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.spec.split(",") if m.strip()]
    if not set(modes) <= set(MODES):
        p.error(f"--spec takes {', '.join(MODES)}")
    result = run_serve_benchmark(
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        num_requests=args.num_requests,
        modes=modes,
        max_tokens=args.max_tokens,
        server_args=shlex.split(args.server_args),
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
