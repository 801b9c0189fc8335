"""Reproducers of the hardening issue's gaps against a real ``ngrammar serve`` (not a test: it prints).

``python -m benchmarks.repro_hardening [--root DIR] [--only R1,R5]`` starts ``python -m ngrammar.cli
serve`` from ``--root`` (default: this checkout; give an older checkout to see the behaviour before
a fix) with an API key, runs each reproducer and prints one line per check: what was sent and what
came back (status, content type, seconds). Scaled down from the issue's figures to suit a small CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

KEY = "sk-repro"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, root: Path, extra: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(root)}
        cmd = [sys.executable, "-m", "ngrammar.cli", "serve", "--port", str(self.port), "--api-key", KEY]
        cmd += ["--device", "cpu", "--dtype", "float32", "--kv-cache-tokens", "16384", *extra]
        self.proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _post(url: str, body: Any, timeout: float = 300, raw: bytes | None = None, **kw: Any) -> str:
    t = time.perf_counter()
    try:
        content = raw if raw is not None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **kw.pop("headers", AUTH)}
        r = httpx.post(url, content=content, headers=headers, timeout=timeout, **kw)
        kind = r.headers.get("content-type", "").split(";")[0]
        detail = r.text[:110].replace("\n", " ")
        return f"{r.status_code} {kind} {time.perf_counter() - t:.2f}s {detail}"
    except httpx.HTTPError as e:
        return f"{type(e).__name__} {time.perf_counter() - t:.2f}s"


def _say(name: str, what: str, result: str) -> None:
    print(f"{name} {what}: {result}", flush=True)


def r1_surrogates(url: str) -> None:
    raw = b'"\\ud800"'
    bodies = {
        "chat": b'{"messages":[{"role":"user","content":' + raw + b'}],"max_tokens":2}',
        "chat system": b'{"messages":[{"role":"system","content":'
        + raw
        + b'},{"role":"user","content":"hi"}],"max_tokens":2}',
        "chat parts": b'{"messages":[{"role":"user","content":[{"type":"text","text":' + raw + b"}]}],"
        b'"max_tokens":2}',
        "completions": b'{"prompt":' + raw + b',"max_tokens":2}',
        "generate": b'{"text":' + raw + b',"sampling_params":{"max_new_tokens":2}}',
    }
    paths = {"completions": "/v1/completions", "generate": "/generate"}
    for name, body in bodies.items():
        _say("R1", name, _post(url + paths.get(name, "/v1/chat/completions"), None, raw=body))


def _deep(n: int) -> str:
    return '{"type":"array","items":' * n + '{"type":"string"}' + "}" * n


def r2_deep(url: str) -> None:
    s = _deep(1000)
    _say("R2", "chat json_schema 1000 deep", _post(url + "/v1/chat/completions", {**CHAT, "json_schema": s}))
    _say("R2", "completions 1000 deep", _post(url + "/v1/completions", {"prompt": "a", "json_schema": s}))
    body = {"text": "a", "sampling_params": {"json_schema": s, "max_new_tokens": 2}}
    _say("R2", "generate 1000 deep", _post(url + "/generate", body))
    _say(
        "R2",
        "body nested 5000 deep",
        _post(url + "/v1/chat/completions", None, raw=b"[" * 5000 + b"]" * 5000),
    )


def _wide_schema(n: int, tag: int) -> dict[str, Any]:
    props = {f"p{tag}_{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def r3_slow_compiles(url: str, props: int = 2000, count: int = 6) -> None:
    results: list[str] = []

    def heavy(i: int) -> None:
        body = {**CHAT, "json_schema": _wide_schema(props, i)}
        results.append(_post(url + "/v1/chat/completions", body, timeout=600)[:40])

    threads = [threading.Thread(target=heavy, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    _say(
        "R3",
        f"plain chat during {count} x {props}-property compiles",
        _post(url + "/v1/chat/completions", CHAT),
    )
    t0 = time.perf_counter()
    h = httpx.get(url + "/health", timeout=60)
    _say("R3", "health during compiles", f"{h.status_code} {time.perf_counter() - t0:.2f}s")
    for t in threads:
        t.join()
    _say("R3", "the heavy requests", " | ".join(results))


def r4_cache_bytes(root: Path) -> None:
    """In-process: compile 8 distinct ~1,000-property schemas (~7 MB compiled each) with a 32 MiB
    cache budget where the backend takes one, and total what the cache holds."""
    code = (
        "import json,inspect;from ngrammar.model.loader import resolve_checkpoint as r;"
        "from ngrammar.model.tokenizer import Tokenizer as T;from ngrammar.grammar.backend import *;"
        "c=r(None);kw={'cache_max_bytes':32<<20} if 'cache_max_bytes' in "
        "inspect.signature(GrammarBackend).parameters else {};"
        "b=GrammarBackend(T(c.tokenizer_dir,c.config.eos_token_ids),c.config.vocab_size,**kw);"
        "[b.compile(GrammarSpec('json_schema',json.dumps({'type':'object','properties':"
        "{f'q{k}_{i}':{'type':'string'} for i in range(1000)}}))) for k in range(8)];"
        "print(len(list(b._cache)),'entries',sum(b.compile(s).memory_size_bytes for s in list(b._cache))"
        "//2**20,'MiB cached; byte budget',kw.get('cache_max_bytes'))"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    _say("R4", "8 x 1000-property schemas", (out.stdout.strip() or out.stderr.strip()[-200:]))


def r5_body(url: str, mb: int = 20) -> None:
    body = {"messages": [{"role": "user", "content": "hi " * (mb * 2**20 // 3)}], "max_tokens": 1}
    _say("R5", f"{mb} MB chat body", _post(url + "/v1/chat/completions", body))


def r6_sequences(url: str) -> None:
    body = {"prompt": ["hi"] * 64, "n": 64, "max_tokens": 1}
    results: list[str] = []
    t = threading.Thread(
        target=lambda: results.append(_post(url + "/v1/completions", body, timeout=600)[:80])
    )
    t.start()
    time.sleep(1.0)
    _say("R6", "plain chat during 64 prompts x n=64", _post(url + "/v1/chat/completions", CHAT, timeout=600))
    t.join()
    _say("R6", "64 prompts x n=64 (4,096 sequences)", results[0])


def r7_refs(url: str) -> None:
    for ref in ("https://example.com/s.json", "file:///etc/passwd"):
        schema = {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}
        _say("R7", f"$ref {ref}", _post(url + "/v1/chat/completions", {**CHAT, "json_schema": schema}))


def _raw_exchange(url: str, data: bytes, wait: float) -> str:
    port = int(url.rsplit(":", 1)[1])
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(wait)
        s.sendall(data)
        try:
            reply = s.recv(4096)
        except TimeoutError:
            return f"still open after {wait:.0f}s, no answer"
    head = reply.split(b"\r\n\r\n")[0].decode(errors="replace").splitlines()
    ctype = next((h for h in head if h.lower().startswith("content-type")), "no content-type")
    return f"{head[0] if head else 'closed'} [{ctype}] {time.perf_counter() - t:.2f}s"


def r9_small(url: str) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        r = httpx.get(url + path)
        _say("R9", f"GET {path} without key", str(r.status_code))
    _say("R9", "bad JSON without key", _post(url + "/v1/chat/completions", None, raw=b"{bad", headers={}))
    _say("R9", '"stream":"yes"', _post(url + "/v1/chat/completions", {**CHAT, "stream": "yes"}))
    _say("R9", 'max_tokens:"3"', _post(url + "/v1/chat/completions", {**CHAT, "max_tokens": "3"}))
    _say("R9", "garbage request line", _raw_exchange(url, b"GARBAGE\r\n\r\n", 5))
    _say(
        "R9", "slow client (partial headers)", _raw_exchange(url, b"POST /v1/completions HTTP/1.1\r\nHo", 40)
    )
    socks = []
    port = int(url.rsplit(":", 1)[1])
    for _ in range(1100):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:
            break
    time.sleep(0.5)
    r = _post(url + "/v1/chat/completions", CHAT, timeout=30)
    _say("R9", f"a request while {len(socks)} idle connections are open", r)
    for s in socks:
        s.close()


def r9_temp_file(root: Path) -> None:
    """A conversion killed mid-write leaves ``model.safetensors.tmp-<pid>-<hex>``; start again and look."""
    from ngrammar.model.loader import cache_root

    with tempfile.TemporaryDirectory() as tmp:
        folder = next(cache_root().glob("gguf-*"))
        copy = Path(tmp) / folder.name
        copy.mkdir()
        for f in folder.iterdir():
            (copy / f.name).symlink_to(f)
        stale = copy / "model.safetensors.tmp-999999-deadbeef"
        stale.write_bytes(b"\0" * 1024)
        code = "from ngrammar.model.loader import resolve_checkpoint; resolve_checkpoint(None)"
        env = {**os.environ, "PYTHONPATH": str(root), "NGRAMMAR_CACHE_DIR": tmp}
        subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, timeout=600)
        _say("R9", "temp file of a killed conversion after the next start", f"exists={stale.exists()}")


SERVER: dict[str, Callable[[str], None]] = {
    "R1": r1_surrogates,
    "R2": r2_deep,
    "R3": r3_slow_compiles,
    "R5": r5_body,
    "R6": r6_sequences,
    "R7": r7_refs,
    "R9": r9_small,
}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.repro_hardening", description=__doc__)
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--only", default="R1,R2,R3,R4,R5,R6,R7,R9,T")
    p.add_argument("--server-args", default="")
    args = p.parse_args()
    root = Path(args.root)
    only = args.only.split(",")
    if "R4" in only:
        r4_cache_bytes(root)
    if "T" in only:
        r9_temp_file(root)
    wanted = [k for k in only if k in SERVER]  # in the order given
    if wanted:
        server = Server(root, args.server_args.split())
        try:
            for k in wanted:
                SERVER[k](server.url)
                try:
                    status = str(httpx.get(server.url + "/health", timeout=60).status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                _say(k, "health afterwards", status)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
