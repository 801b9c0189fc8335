"""Grammar bombs and shutdown against a real ``ngrammar serve`` (prints; not a test).

``python -m benchmarks bombs [--root DIR] [--modes plain,ngram,ngram+grammar]`` starts ``python -m
ngrammar.cli serve`` from ``--root`` (default: this checkout; an older checkout shows the behaviour
before a fix) once per mode and sends each bomb of ``BOMBS`` (small requests whose grammar forces or
demands huge text), one at a time, printing status, seconds and the server's RSS growth (its peak
during the request, polled). The server never takes the box down: once up, its address space is
capped (``prlimit``) at its size then plus ``--max-growth-mb``, and a watchdog kills it past that
RSS growth. Then ``ngrammar serve`` is stopped with SIGTERM, and one more with SIGINT, each while a
long request is in flight, printing the seconds to exit. ``footprint`` prints ``LLM()``'s RSS.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.repro_hardening import _free_port

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "plain": [],
    "ngram": ["--speculative", "ngram", "--no-spec-grammar-drafts"],
    "ngram+grammar": ["--speculative", "ngram"],
}


def _doubling(levels: int) -> str:
    rules = "".join(f"a{i} ::= a{i + 1} a{i + 1}\n" for i in range(levels))
    return f'root ::= a0\n{rules}a{levels} ::= "x"\n'


# name -> grammar fields of a request: each one small, each forcing or demanding huge text
BOMBS: dict[str, dict[str, Any]] = {
    "regex a{10^8}": {"regex": "a{100000000}"},
    "regex a{99999999}b": {"regex": "a{99999999}b"},
    "nested quantifiers": {"regex": "((ab{1000}){1000}){100}"},
    "quantified choice": {"regex": "(x|y){100000000}"},
    "huge enum": {"json_schema": {"enum": [f"v{i}" for i in range(20000)]}},
    "schema pattern": {
        "json_schema": {
            "type": "object",
            "properties": {"k": {"type": "string", "pattern": "^z{99999999}$"}},
            "required": ["k"],
        }
    },
    "schema long const": {"json_schema": {"const": "c" * 200_000}},
    "schema minLength": {"json_schema": {"type": "string", "minLength": 99999999, "maxLength": 99999999}},
    "schema minItems": {"json_schema": {"type": "array", "items": {"const": "x"}, "minItems": 99999999}},
    "ebnf doubling": {"ebnf": _doubling(40)},
    "ebnf recursion": {"ebnf": 'root ::= "(" root "x"{100000} | "y"'},
    "ebnf 3,000 chained rules": {
        "ebnf": "root ::= r0\n"
        + "".join(f'r{i} ::= "x" r{i + 1} | "y"\n' for i in range(3000))
        + 'r3000 ::= "z"\n'
    },
}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _vm_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize"):
            return int(line.split()[1]) << 10
    raise RuntimeError(f"no VmSize for {pid}")


@dataclass
class Watch:
    """Polls a process' RSS (``peak``); kills it once it grew more than ``limit_mb`` over ``base``."""

    pid: int
    limit_mb: float
    base: float = 0.0
    peak: float = 0.0
    killed: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Watch:
        self.base = self.peak = rss_mb(self.pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, rss_mb(self.pid))
            except (OSError, RuntimeError):
                return
            if self.peak - self.base > self.limit_mb:
                self.killed = True
                os.kill(self.pid, signal.SIGKILL)
                return

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


class Server:
    def __init__(self, root: Path, extra: list[str], max_growth_mb: float) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ngrammar.cli", "serve", "--port", str(self.port), "--device", "cpu"]
        cmd += ["--kv-cache-tokens", "4096"]  # the bombs do not depend on the pool; the box is shared
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen(
            [*cmd, *extra], cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 900
        while not self.healthy():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        cap = _vm_bytes(self.proc.pid) + (int(max_growth_mb) << 20)
        resource.prlimit(self.proc.pid, resource.RLIMIT_AS, (cap, cap))
        self.max_growth_mb = max_growth_mb

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: signal.Signals = signal.SIGTERM, hard_s: float = 60) -> float:
        """Seconds from ``sig`` to the exit (killed after ``hard_s``)."""
        start = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(hard_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.monotonic() - start


def _request(grammar: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    return {"prompt": "Output:", "max_tokens": max_tokens, "temperature": 0, **grammar}


def run_bomb(server: Server, name: str, timeout_s: float) -> dict[str, Any]:
    body = json.dumps(_request(BOMBS[name], 16)).encode()
    with Watch(server.proc.pid, server.max_growth_mb) as watch:
        start = time.monotonic()
        try:
            r = httpx.post(
                server.url + "/v1/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=timeout_s,
            )
            status: int | str = r.status_code
            detail = r.json()["error"]["message"][:90] if r.status_code >= 400 else ""
        except httpx.HTTPError as e:
            status, detail = ("killed" if watch.killed else type(e).__name__), ""
        seconds = time.monotonic() - start
    return {
        "bomb": name,
        "status": status,
        "seconds": round(seconds, 2),
        "rss_growth_mb": round(watch.peak - watch.base, 1),
        "health_after": server.alive() and server.healthy(),
        "detail": detail,
    }


def _in_flight(server: Server) -> threading.Thread:
    body = _request({}, 4000)
    thread = threading.Thread(
        target=lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=120), daemon=True
    )
    thread.start()
    time.sleep(2)  # decoding by now
    return thread


def run_bombs(root: Path, modes: list[str], max_growth_mb: float, timeout_s: float) -> list[dict[str, Any]]:
    results = []
    for mode in modes:
        server = Server(root, MODES[mode], max_growth_mb)
        try:
            for name in BOMBS:
                if not server.alive():
                    server = Server(root, MODES[mode], max_growth_mb)
                row = {"mode": mode, **run_bomb(server, name, timeout_s)}
                print(json.dumps(row), flush=True)
                results.append(row)
            _in_flight(server)
            row = {"mode": mode, "signal": "SIGTERM", "exit_s": round(server.stop(signal.SIGTERM), 2)}
        finally:
            if server.alive():
                server.proc.kill()
        print(json.dumps(row), flush=True)
        results.append(row)
    server = Server(root, [], max_growth_mb)
    _in_flight(server)
    row = {"mode": "plain", "signal": "SIGINT", "exit_s": round(server.stop(signal.SIGINT), 2)}
    print(json.dumps(row), flush=True)
    results.append(row)
    return results


FOOTPRINT = """
from ngrammar.llm import LLM
llm = LLM(device="cpu")
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(status["VmRSS"].strip(), status["VmHWM"].strip())
"""


def run_footprint(root: Path) -> str:
    """``LLM()``'s RSS (now and peak) with the embedded model, in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", FOOTPRINT], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    line = out.stdout.strip().splitlines()[-1]
    print(f"LLM() RSS, peak: {line}", flush=True)
    return line
