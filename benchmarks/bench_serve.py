"""Serving benchmark: latency and throughput of ``ngrammar serve`` under concurrent streaming clients,
beside the offline engine on the same requests.

For each mode (plain: no grammar, no speculation; off: 1 in 4 requests JSON-schema constrained;
ngram; ngram+grammar: all constrained) and each concurrency level, a fresh server subprocess is
started (so the n-gram corpus holds nothing from an earlier level), ``num_requests`` streaming chat
requests (distinct prompts) are sent with at most ``concurrency`` in flight by several client
processes (a raw HTTP client that only searches the SSE bytes), and each request's TTFT (first
content chunk), TPOT ((end - first token) / (tokens - 1)) and end-to-end latency are recorded.
Unconstrained requests ignore EOS, so their length is exactly ``max_tokens``. Beside each level:
the offline engine on the same requests, ``concurrency`` at a time, prefill included, not
streaming (``LLM.chat``) and streaming (the engine core's delta loop in-process). Before the
levels the client checks itself against a null server streaming twice the fastest offline rate.

Prompts come from ``benchmarks/data/serve_prompts.jsonl`` (first turns of Spec-Bench subset
questions: MT-bench categories plus short summarization and RAG items).

Run from the repo root:
  .venv/bin/python -m benchmarks.bench_serve --concurrency 64 --num-requests 64 --max-tokens 64 \\
      --spec plain --tiny-layers 2 \\
      --server-args "--device cpu --dtype float32 --kv-cache-tokens 65536 --max-running-requests 64"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
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
_STARTUP_TIMEOUT_S = 600.0
CLIENT_PROCESSES = 4


@dataclass(frozen=True)
class RequestRecord:
    structured: bool
    ok: bool
    ttft_s: float
    e2e_s: float
    completion_tokens: int
    end_at: float = 0.0  # time.time() at the end (client processes share this clock)

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

    def __init__(self, server_args: Sequence[str], speculative: bool, server_path: str | None = None) -> None:
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
        self.server_path = server_path

    def __enter__(self) -> ServerProcess:
        env = None
        if self.server_path is not None:  # first on the path; what it does not hold (deps) still resolves
            inherited = os.environ.get("PYTHONPATH")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [self.server_path, inherited]))}
        # ``python -m`` puts the working directory first on sys.path: run another checkout from its root.
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=self.server_path
        )
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


def _request_bytes(body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + payload


_CONTENT = re.compile(rb'"content":"[^"]')  # a chunk that carries text (the role chunk's is "")
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')


async def _one_request(port: int, request: bytes, structured: bool) -> RequestRecord:
    """One streamed request over a raw HTTP/1.1 connection; the SSE events are only searched (no
    JSON parsing, no line splitting): the client must stay far cheaper than the server it times."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    first: float | None = None
    tail = b""
    try:
        ok = b" 200 " in await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers
        while chunk := await reader.read(65536):
            if first is None and _CONTENT.search(tail[-16:] + chunk):
                first = time.perf_counter()
            tail = (tail + chunk)[-4096:]  # the usage event and [DONE] end the stream
    finally:
        writer.close()
    end = time.perf_counter()
    ok = ok and b'"error"' not in tail and b"data: [DONE]" in tail
    found = _COMPLETION_TOKENS.findall(tail)
    tokens = int(found[-1]) if ok and found else 0
    return RequestRecord(structured, ok, (first or end) - start, end - start, tokens, time.time())


async def _run_client(port: int, bodies: list[tuple[bytes, bool]], concurrency: int) -> list[RequestRecord]:
    gate = asyncio.Semaphore(concurrency)

    async def gated(request: bytes, structured: bool) -> RequestRecord:
        async with gate:
            return await _one_request(port, request, structured)

    return list(await asyncio.gather(*(gated(r, s) for r, s in bodies)))


def _client_process(
    port: int, bodies: list[tuple[bytes, bool]], concurrency: int, start_at: float
) -> list[RequestRecord]:
    time.sleep(max(start_at - time.time(), 0.0))  # every client process starts at once
    return asyncio.run(_run_client(port, bodies, concurrency))


def run_level(
    port: int, bodies: list[tuple[dict[str, Any], bool]], concurrency: int, clients: int = CLIENT_PROCESSES
) -> tuple[list[RequestRecord], float]:
    """``bodies`` sent by ``clients`` processes (each its own interpreter and event loop), at most
    ``concurrency`` in flight in all; returns the records and the wall time."""
    from concurrent.futures import ProcessPoolExecutor

    clients = max(1, min(clients, concurrency))
    shares = [bodies[k::clients] for k in range(clients)]
    gates = [concurrency // clients + (k < concurrency % clients) for k in range(clients)]
    with ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(time.sleep, 0).result()  # the pool's processes are up before the clock starts
        start_at = time.time() + 1.0
        futures = [
            pool.submit(_client_process, port, [(_request_bytes(b), st) for b, st in share], gate, start_at)
            for share, gate in zip(shares, gates)
        ]
        records = [r for f in futures for r in f.result()]
    return records, max(r.end_at for r in records) - start_at if records else 0.0


def workload(
    prompts: list[str], num_requests: int, max_tokens: int, every: int = STRUCTURED_EVERY
) -> list[tuple[dict[str, Any], bool]]:
    """``num_requests`` chat requests; every ``every``-th is JSON-schema constrained (1: all, 0: none)."""
    out = []
    for i in range(num_requests):
        structured = every > 0 and i % every == every - 1
        prompt = f"Request {i}. {prompts[i % len(prompts)]}"  # distinct: no prefix-cache hit across requests
        out.append((request_body(prompt, structured, max_tokens), structured))
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


# "+grammar": every request JSON-schema constrained; "plain" and "free": none (no speculation
# either; "free" is the unconstrained twin of "off+grammar"); "off" and "ngram": every fourth
MODES = ("plain", "off", "ngram", "ngram+grammar", "off+grammar", "free")


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
    server_path: str | None = None,
    clients: int = CLIENT_PROCESSES,
) -> dict[str, Any]:
    """Every (mode, concurrency) level on a fresh server, beside the offline engine on the same
    requests (``offline_figures``); returns the figures and prints a table. The client first checks
    itself against a null server at twice the fastest offline rate (``check_client``).

    ``num_requests`` per level defaults to 4x the concurrency (at least 8). ``modes`` (``MODES``)
    replaces ``speculative`` where given. ``server_path``: the servers import ``ngrammar`` from
    there (another checkout: the same client times two versions)."""
    prompts = load_prompts()
    results: dict[str, Any] = {"max_tokens": max_tokens, "server_args": list(server_args), "levels": []}
    if modes is None:
        modes = ["ngram" if s else "off" for s in speculative]
    levels = list(_levels(modes, concurrency))
    sizes = {c: num_requests or max(4 * c, 8) for _, c in levels}
    offline = {
        (mode, c): offline_figures(
            server_args, mode, workload(prompts, sizes[c], max_tokens, _every(mode)), c
        )
        for mode, c in levels
    }
    results["client_check"] = check_client(
        2 * max(f["offline_tok_s"] for f in offline.values()), max(concurrency), max_tokens, clients
    )
    for mode, c in levels:
        bodies = workload(prompts, sizes[c], max_tokens, _every(mode))
        with ServerProcess(server_args, mode.startswith("ngram"), server_path) as server:
            if warmup:  # first-request costs (grammar compile, allocator) are not serving costs
                run_level(server.port, workload(prompts[:1], STRUCTURED_EVERY, 4), 2, clients)
            before = server.server_info()["stats"]
            records, wall = run_level(server.port, bodies, c, clients)
            after = server.server_info()["stats"]
        steps = after["verify_steps"] - before["verify_steps"]
        accept = (after["verify_emitted"] - before["verify_emitted"]) / steps if steps else 0.0
        level = {
            "mode": mode,
            "concurrency": c,
            **summarize(records, wall, accept),
            **offline[mode, c],
            **step_kinds(before, after),
        }
        results["levels"].append(level)
    print_results(results)
    return results


def step_kinds(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The engine's steps between two ``/server_info`` stats and the shares of them that were mixed
    (decode rows + prefill chunks: no whole-step graph, no chain) and chained plain steps."""
    steps = after["steps"] - before["steps"]
    share = {k: (after[k] - before[k]) / steps if steps else 0.0 for k in ("mixed_steps", "chained_steps")}
    return {
        "engine_steps": steps,
        "mixed_share": share["mixed_steps"],
        "chained_share": share["chained_steps"],
    }


def _every(mode: str) -> int:
    return 1 if mode.endswith("+grammar") else 0 if mode in ("plain", "free") else STRUCTURED_EVERY


def offline_figures(
    server_args: Sequence[str], mode: str, bodies: list[tuple[dict[str, Any], bool]], batch: int
) -> dict[str, float]:
    """The offline engine (built from the servers' flags) on the level's requests, ``batch`` at a
    time, prefill included: not streaming (``LLM.chat``: one output per request) and streaming (the
    engine core's loop in this process: one delta per step, as a server's core sends it)."""
    from ngrammar import LLM
    from ngrammar.args import engine_kwargs
    from ngrammar.cli import build_parser
    from ngrammar.server.core import EngineCore
    from ngrammar.server.core_messages import Add
    from ngrammar.server.warmup import CompileCounter

    args = build_parser().parse_args(
        ["serve", *server_args, *(["--speculative", "ngram"] if mode.startswith("ngram") else [])]
    )
    llm = LLM(**engine_kwargs(args))
    convs = [b["messages"] for b, _ in bodies]
    params = [_sampling(b) for b, _ in bodies]
    # First-use costs (a grammar, the CPU kernels' batch shapes): one batch, not timed.
    llm.chat(convs[:batch], params[:batch], use_tqdm=False)
    start, tokens = time.perf_counter(), 0
    for k in range(0, len(convs), batch):
        outs = llm.chat(convs[k : k + batch], params[k : k + batch], use_tqdm=False)
        tokens += sum(len(o.token_ids) for o in outs)
    plain = tokens / (time.perf_counter() - start)
    core = EngineCore(llm.engine, CompileCounter())
    ids = [llm.engine.tokenize(c) for c in convs]
    start, tokens = time.perf_counter(), 0
    for k in range(0, len(ids), batch):
        for j in range(k, min(k + batch, len(ids))):
            core.handle(Add(f"offline-{j}", f"offline-{j}", ids[j], params[j]))
        while core.busy:
            tokens += sum(len(s.token_ids) for d in core.turn() for r in d.requests for s in r.seqs)
    streaming = tokens / (time.perf_counter() - start)
    llm.engine.close()
    return {"offline_tok_s": plain, "offline_stream_tok_s": streaming}


def _sampling(body: dict[str, Any]) -> Any:
    from ngrammar import SamplingParams

    schema = body.get("response_format", {}).get("json_schema", {}).get("schema")
    return SamplingParams(
        max_tokens=body["max_tokens"],
        temperature=0,
        ignore_eos=body.get("ignore_eos", False),
        json_schema=schema,
    )


# ------------------------------------------------------------ self-check


def _null_server(port: int, tokens: int, interval_s: float, ready: Any) -> None:
    """Answers every request with a stream of ``tokens`` content chunks, one per ``interval_s``, then
    the usage chunk and [DONE] (the shape a chat stream has), and nothing else."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))  # type: ignore[union-attr]
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        event = b'data: {"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'
        chunk = b"%x\r\n%s\r\n" % (len(event), event)
        next_at = time.perf_counter()
        for _ in range(tokens):
            writer.write(chunk)
            next_at += interval_s
            await asyncio.sleep(max(next_at - time.perf_counter(), 0.0))
        end = b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % tokens
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(end), end))
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", port, backlog=1024)
        ready.set()
        await server.serve_forever()

    asyncio.run(main())


def check_client(rate_tok_s: float, concurrency: int, max_tokens: int, clients: int) -> dict[str, float]:
    """The client against a null server streaming ``rate_tok_s`` in all (``concurrency`` streams):
    it must measure that rate, or its own cost, not the server's, bounds the figures."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    port = _free_port()
    interval = concurrency / rate_tok_s
    proc = ctx.Process(target=_null_server, args=(port, max_tokens, interval, ready), daemon=True)
    proc.start()
    try:
        ready.wait(30)
        bodies = [(request_body("x", False, max_tokens), False) for _ in range(2 * concurrency)]
        records, wall = run_level(port, bodies, concurrency, clients)
    finally:
        proc.terminate()
    measured = sum(r.completion_tokens for r in records if r.ok) / wall
    print(
        f"client self-check: a null server streams {rate_tok_s:.0f} tok/s over {concurrency} streams; "
        f"the client measured {measured:.0f} tok/s ({measured / rate_tok_s:.2f}x)"
    )
    return {"target_tok_s": rate_tok_s, "measured_tok_s": measured}


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
        "offline tok/s",
        "offline stream tok/s",
        "server/offline",
        "server/stream",
        "steps mixed / chained",
    ]
    rows = [
        [
            lv["mode"],
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
            lv["offline_tok_s"],
            lv["offline_stream_tok_s"],
            lv["throughput_tok_s"] / lv["offline_tok_s"],
            lv["throughput_tok_s"] / lv["offline_stream_tok_s"],
            f"{lv['mixed_share']:.0%} / {lv['chained_share']:.0%} of {lv['engine_steps']}",
        ]
        for lv in results["levels"]
    ]
    print_table(
        f"Serving, chat streaming, max_tokens={results['max_tokens']}: off / ngram 1 in {STRUCTURED_EVERY} "
        "JSON-schema constrained, +grammar all, plain / free none; offline: same requests, same batch",
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
    p.add_argument("--clients", type=int, default=CLIENT_PROCESSES, help="client processes")
    p.add_argument(
        "--no-warmup", action="store_true", help="time a fresh server's first requests (compile stalls count)"
    )
    p.add_argument("--server-path", default=None, help="PYTHONPATH of the servers (another checkout)")
    p.add_argument(
        "--tiny-layers",
        type=int,
        default=0,
        help="serve a host-bound random-weight Llama of this many 16-wide layers (the real tokenizer)",
    )
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.spec.split(",") if m.strip()]
    if not set(modes) <= set(MODES):
        p.error(f"--spec takes {', '.join(MODES)}")
    server_args = shlex.split(args.server_args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny_layers:
            from benchmarks.bench_host import tiny_checkpoint

            server_args += ["--model", str(tiny_checkpoint(Path(tmp) / "tiny", args.tiny_layers))]
        result = run_serve_benchmark(
            concurrency=tuple(int(c) for c in args.concurrency.split(",")),
            num_requests=args.num_requests,
            modes=modes,
            max_tokens=args.max_tokens,
            server_args=server_args,
            server_path=args.server_path,
            clients=args.clients,
            warmup=not args.no_warmup,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
