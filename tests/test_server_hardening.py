"""Hostile and heavy input: every request error is a 4xx in OpenAI's shape, with bounded time and
memory, and no request can stall the others (one test per gap the hardening issue found).

Apps run in-process (``TestClient``) around one engine, one app at a time; the HTTP-level limits
(header and body timeouts, the connection cap, malformed requests) use a real uvicorn server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.bench_bombs import BOMBS, Watch

# The server speaks msgspec over ZeroMQ: an image without them skips these tests, named in the summary.
pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from ngrammar.engine.engine import LLMEngine
from ngrammar.grammar import GrammarSpec
from ngrammar.grammar.backend import GrammarBackend
from ngrammar.llm import build_engine_config
from ngrammar.model import loader
from ngrammar.sampling_params import SamplingParams
from ngrammar.server import create_app
from ngrammar.server.config import ServerConfig
from ngrammar.server.engine_loop import AsyncEngine
from ngrammar.server.http import uvicorn_kwargs
from tests.grammar_oracles import cached_specs

ENGINE_KWARGS: dict[str, Any] = dict(device="cpu", dtype="float32", kv_cache_tokens=4096)
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}
KEY = {"Authorization": "Bearer sekrit"}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(build_engine_config(**ENGINE_KWARGS))


@contextmanager
def serving(engine: LLMEngine, **limits: Any) -> Iterator[TestClient]:
    with TestClient(create_app(engine, config=ServerConfig(**limits))) as client:
        yield client


def assert_error(response: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    for word in words:
        assert word in error["message"], error
    return error


def assert_idle(client: TestClient, headers: dict[str, str] | None = None) -> None:
    """Nothing in flight and every KV page free (polled: the loop thread releases them)."""
    deadline = time.monotonic() + 30
    while True:
        info = client.get("/server_info", headers=headers).json()
        if info["num_inflight"] == 0 and info["kv_pages_free"] == info["kv_pages_total"]:
            return
        assert time.monotonic() < deadline, info
        time.sleep(0.05)


def assert_serves(client: TestClient, headers: dict[str, str] | None = None) -> None:
    ok = client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"], ok.text


def post_raw(client: TestClient, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": "application/json"})


# ------------------------------------------------------------ 1. surrogates

SURROGATE = b'"\\ud800"'
SURROGATE_BODIES = {
    "user": (
        "/v1/chat/completions",
        b'{"messages":[{"role":"user","content":' + SURROGATE + b'}],"max_tokens":2}',
    ),
    "system": (
        "/v1/chat/completions",
        b'{"messages":[{"role":"system","content":' + SURROGATE + b'},{"role":"user","content":"hi"}]}',
    ),
    "part": (
        "/v1/chat/completions",
        b'{"messages":[{"role":"user","content":[{"type":"text","text":' + SURROGATE + b"}]}]}",
    ),
    "prompt": ("/v1/completions", b'{"prompt":' + SURROGATE + b',"max_tokens":2}'),
    "stop": ("/v1/completions", b'{"prompt":"a","stop":[' + SURROGATE + b'],"max_tokens":2}'),
    "generate": ("/generate", b'{"text":' + SURROGATE + b',"sampling_params":{"max_new_tokens":2}}'),
    "key": ("/generate", b'{"text":"a","sampling_params":{"json_schema":{' + SURROGATE + b":1}}}"),
}


def test_a_lone_surrogate_is_a_400_and_the_connection_lives(engine: LLMEngine) -> None:
    with serving(engine) as client:
        for path, body in SURROGATE_BODIES.values():
            assert_error(post_raw(client, path, body), 400, "surrogate")
        assert_serves(client)
        assert_idle(client)


# ---------------------------------------------------------- 2. deep nesting


def _deep_schema(levels: int) -> str:
    return '{"type":"array","items":' * levels + '{"type":"string"}' + "}" * levels


def test_deep_nesting_is_a_400(engine: LLMEngine) -> None:
    text = _deep_schema(1000)
    as_dict = json.loads(_deep_schema(80))  # 81 JSON levels: within the body's bound, past the schema's
    with serving(engine) as client:
        for path, body in [
            ("/v1/chat/completions", {**CHAT, "json_schema": text}),
            ("/v1/completions", {"prompt": "a", "max_tokens": 2, "json_schema": text}),
            ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2, "json_schema": text}}),
            ("/v1/chat/completions", {**CHAT, "json_schema": as_dict}),
            ("/v1/chat/completions", {**CHAT, "metadata": json.loads("[" * 150 + "]" * 150)}),
        ]:
            assert_error(client.post(path, json=body), 400, "nested")
        assert_error(post_raw(client, "/v1/chat/completions", b"[" * 5000 + b"]" * 5000), 400)
        assert_serves(client)


# ------------------------------------------------------------ strict types


@pytest.mark.parametrize(
    "field,value",
    [
        ("stream", "yes"),
        ("max_tokens", "3"),
        ("n", 1.5),
        ("temperature", "0"),
        ("logprobs", 1),
        ("seed", True),
    ],
)
def test_types_are_strict(engine: LLMEngine, field: str, value: Any) -> None:
    with serving(engine) as client:
        error = assert_error(client.post("/v1/chat/completions", json={**CHAT, field: value}), 400)
        assert error["param"] == field


# ------------------------------------------------- 3. compile budget and pool


def _wide_schema(properties: int, tag: str) -> dict[str, Any]:
    props = {f"{tag}{i}": {"type": "string"} for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_slow_grammar_gets_a_400_and_does_not_hold_other_requests(engine: LLMEngine) -> None:
    backend = engine.grammar_backend
    heavy = {**CHAT, "json_schema": _wide_schema(4000, f"s{time.time_ns() % 10**6}_")}  # ~200 KB
    result: list[httpx.Response] = []
    with serving(engine, grammar_compile_timeout_s=0.3) as client:
        thread = threading.Thread(
            target=lambda: result.append(client.post("/v1/chat/completions", json=heavy))
        )
        thread.start()
        deadline = time.monotonic() + 60
        while not backend._in_flight:  # the heavy grammar is compiling on the grammar pool
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        assert_serves(client)  # a plain request meanwhile: the compile holds no thread it needs
        plain_done_while_compiling = bool(backend._in_flight)
        thread.join()
        assert_error(result[0], 400, "budget")
        assert plain_done_while_compiling
        assert_idle(client)


def test_grammar_larger_than_the_limit_is_a_400(engine: LLMEngine) -> None:
    with serving(engine, max_grammar_kb=1) as client:
        body = {"prompt": "a", "max_tokens": 2, "regex": "a" * 2000}
        assert_error(client.post("/v1/completions", json=body), 400, "limit")
        schema = _wide_schema(100, "p")
        assert_error(client.post("/v1/chat/completions", json={**CHAT, "json_schema": schema}), 400, "limit")


# ------------------------------------------------------ 4. byte-bounded cache


def test_grammar_cache_is_bounded_by_bytes_and_keeps_pinned_entries(engine: LLMEngine) -> None:
    probe = engine.grammar_backend.compile(GrammarSpec("json_schema", json.dumps(_wide_schema(60, "z"))))
    size = int(probe.memory_size_bytes)
    backend = GrammarBackend(
        engine.tokenizer, engine.model_config.vocab_size, cache_max_bytes=int(size * 2.5)
    )
    specs = [GrammarSpec("json_schema", json.dumps(_wide_schema(60, tag))) for tag in "abcd"]
    first = backend.compile(specs[0])
    for spec in specs[1:3]:
        backend.compile(spec)
    assert cached_specs(backend) == specs[1:3]  # the oldest went: three do not fit in 2.5
    assert backend.cache_bytes <= backend.cache_max_bytes
    backend.pin(specs[0], first)  # back in, and kept while pinned whatever else arrives
    backend.compile(specs[3])
    assert specs[0] in cached_specs(backend)
    backend.unpin(specs[0])
    assert backend.cache_bytes <= backend.cache_max_bytes
    backend.close()


# ------------------------------------------------------------ 5. body limit


def test_a_body_over_the_limit_is_a_413_before_it_is_read(engine: LLMEngine) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    with serving(engine, max_body_mb=1) as client:
        assert_error(client.post("/v1/chat/completions", json=big), 413, "limit")

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
            yield json.dumps(big).encode()

        streamed = client.post(
            "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert_error(streamed, 413, "limit")
        assert_serves(client)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(engine: LLMEngine) -> None:
    with serving(engine) as client:
        body = {"prompt": "hello " * 200_000, "max_tokens": 1}  # 1.2 MB: under the body limit
        assert_error(client.post("/v1/completions", json=body), 400, "at least")


# -------------------------------------------------------- 6. sequence caps


def test_admission_counts_sequences(engine: LLMEngine) -> None:
    with serving(engine, max_queue=8, max_n=4, max_prompts=4) as client:
        r = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1})
        assert_error(r, 400, "9 sequences")
        assert assert_error(client.post("/v1/completions", json={"prompt": "a", "n": 5}), 400)["param"] == "n"
        r = client.post("/v1/completions", json={"prompt": ["a"] * 5, "max_tokens": 1})
        assert assert_error(r, 400)["param"] == "prompt"
        ok = client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 4, "max_tokens": 1})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 8
        assert_idle(client)


def test_a_fan_out_request_does_not_go_ahead_of_later_ones(engine: LLMEngine) -> None:
    """Engine requests are handed to the scheduler round-robin over requests, not in arrival order."""
    import asyncio

    order: list[str] = []

    async def run() -> None:
        loop = AsyncEngine(engine, max_queue=64)
        loop.feed_below = 1  # the scheduler takes one more only when nothing waits
        loop.start()
        try:
            params = SamplingParams(max_tokens=2, temperature=0)
            ids = [engine.tokenize("Count: 1, 2,")]
            fan = loop.submit(ids * 6, [params] * 6, "fan", on_admitted=lambda: order.append("fan"))
            late = loop.submit(ids, [params], "late", on_admitted=lambda: order.append("late"))
            for group in (fan, late):
                while not group.done:
                    await group.wait_update(0.5)
        finally:
            await asyncio.to_thread(loop.stop)

    asyncio.run(run())
    assert len(order) == 7 and order.index("late") <= 2, order


# ------------------------------------------------------------ 7. $ref


@pytest.mark.parametrize("ref", ["https://example.com/s.json", "file:///etc/passwd", "other.json#/defs/a"])
def test_remote_and_file_refs_are_refused(engine: LLMEngine, ref: str) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}
    with serving(engine) as client:
        assert_error(client.post("/v1/chat/completions", json={**CHAT, "json_schema": schema}), 400, "local")


def test_local_refs_and_look_alikes_still_work(engine: LLMEngine) -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/n"},
            "$ref": {"type": "string"},
            "c": {"const": {"$ref": "x:y"}},
        },
        "required": ["a"],
        "$defs": {"n": {"type": "integer"}},
    }
    with serving(engine) as client:
        body = {**CHAT, "max_tokens": 8, "json_schema": schema}
        assert client.post("/v1/chat/completions", json=body).status_code == 200


# -------------------------------------------------------- 9. docs, the key


def test_docs_are_behind_the_key_and_the_key_precedes_the_body(engine: LLMEngine) -> None:
    with serving(engine, api_key="sekrit") as client:
        for path in ("/docs", "/redoc", "/openapi.json", "/v1/models", "/server_info", "/metrics"):
            assert_error(client.get(path), 401)
            assert client.get(path, headers=KEY).status_code == 200
        assert_error(post_raw(client, "/v1/chat/completions", b"{not json"), 401)
        assert client.get("/health").status_code == 200
    with serving(engine, docs=False) as client:
        assert client.get("/docs").status_code == 404
    with serving(engine) as client:
        assert client.get("/openapi.json").status_code == 200


def test_health_reports_a_step_that_does_not_finish(engine: LLMEngine) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 30  # ~300 tokens: a prefill of ~1 s
    with serving(engine, stall_timeout_s=0.05) as client:
        result: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: result.append(
                client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            )
        )
        thread.start()
        seen: set[int] = set()
        while thread.is_alive():
            seen.add(client.get("/health").status_code)
            time.sleep(0.01)
        thread.join()
        assert result[0].status_code == 200
        assert 503 in seen, seen
        assert client.get("/health").status_code == 200


# ------------------------------------------------------ temp-file cleanup


def test_temp_files_of_a_killed_conversion_are_removed_on_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = next(loader.cache_root().glob("gguf-*"))  # the embedded model's, converted by now
    folder = tmp_path / source.name
    folder.mkdir()
    for f in source.iterdir():
        if f.is_file():
            (folder / f.name).symlink_to(f)
    dead = 2**22 + 12345  # above Linux's pid_max default: no such process
    stale = folder / f"model.safetensors.tmp-{dead}-0123abcd"
    stale.write_bytes(b"\0" * 1024)
    stale_dir = folder / f"tokenizer.tmp-{dead}-89abcdef"
    stale_dir.mkdir()
    (stale_dir / "tokenizer.json").write_text("{")
    live = folder / f"config.json.tmp-{os.getpid()}-0123abcd"  # a conversion still running
    live.write_text("{")
    monkeypatch.setenv("NGRAMMAR_CACHE_DIR", str(tmp_path))
    loader.resolve_checkpoint(None)
    assert not stale.exists() and not stale_dir.exists()
    assert live.exists()


# ------------------------------------------------------- grammar bombs

BOMB_SECONDS = 60  # generous: the box is shared; a bomb took minutes and 18 GB before the bound
BOMB_GROWTH_MB = 1500  # RSS growth allowed per bomb
BOMB_KILL_MB = 4000  # past this the watchdog kills the test process rather than the machine


@pytest.fixture(scope="module")
def bomb_engines(engine: LLMEngine, spec_llm: Any) -> dict[str, LLMEngine]:
    """Plain, NGRAM with n-gram drafts only, NGRAM with grammar drafts (forced text)."""
    ngram = build_engine_config(**ENGINE_KWARGS, speculative="ngram", spec_grammar_drafts=False)
    return {"plain": engine, "ngram": LLMEngine(ngram), "ngram+grammar": spec_llm.engine}


@pytest.mark.parametrize("mode", ["plain", "ngram", "ngram+grammar"])
def test_grammar_bombs_are_answered_in_bounded_time_and_memory(
    bomb_engines: dict[str, LLMEngine], mode: str
) -> None:
    with serving(bomb_engines[mode]) as client:
        for name, grammar in BOMBS.items():
            body = {"prompt": "Output:", "max_tokens": 8, "temperature": 0, **grammar}
            with Watch(os.getpid(), BOMB_KILL_MB) as watch:
                start = time.monotonic()
                r = client.post("/v1/completions", json=body)
                seconds = time.monotonic() - start
            assert r.status_code in (200, 400), (name, r.text[:300])
            assert seconds < BOMB_SECONDS, (name, seconds)
            assert watch.peak - watch.base < BOMB_GROWTH_MB, (name, watch.peak - watch.base)
            assert client.get("/health").status_code == 200, name
        assert_serves(client)
        assert_idle(client)


# ------------------------------------------------------------ shutdown


SIGNALS = [signal.SIGTERM, signal.SIGINT]
EXIT_WITHIN_S = 15


@dataclass
class Drained:
    """What one ``ngrammar serve`` did when its signal came with a long request in flight."""

    log: str
    exited_in_time: bool  # within EXIT_WITHIN_S of the signal
    returncode: int | None
    replies: list[int | str]  # the request in flight: its status, or the client's error
    client_done: bool


@pytest.fixture(scope="module")
def drained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[signal.Signals, Drained]]:
    """One ``ngrammar serve`` process per signal, started at once and each sent its own signal
    while a 3,000-token request is in flight, so the starts and the drains overlap."""
    root = Path(__file__).resolve().parent.parent
    procs: dict[signal.Signals, tuple[subprocess.Popen[bytes], str, Path]] = {}
    logs = []
    try:
        for sig in SIGNALS:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = str(s.getsockname()[1])
            cmd = [sys.executable, "-m", "ngrammar.cli", "serve", "--port", port, "--device", "cpu"]
            cmd += ["--dtype", "float32", "--kv-cache-tokens", "4096"]
            path = tmp_path_factory.mktemp(sig.name) / "serve.log"
            logs.append(log := path.open("w"))
            proc = subprocess.Popen(
                cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=log, stderr=log
            )
            procs[sig] = (proc, f"http://127.0.0.1:{port}", path)
        deadline = time.monotonic() + 900
        for proc, url, path in procs.values():
            while not _healthy(url):
                assert proc.poll() is None and time.monotonic() < deadline, path.read_text()
                time.sleep(0.5)
        long = {"prompt": "Count to a thousand:", "max_tokens": 3000, "temperature": 0}
        clients: dict[signal.Signals, tuple[threading.Thread, list[int | str], float]] = {}
        for sig, (proc, url, _) in procs.items():
            replies: list[int | str] = []
            streaming = threading.Event()  # SIGINT's request streams: signalled after its first event
            if sig == signal.SIGINT:
                body = {**long, "stream": True}
                target = lambda url=url, replies=replies: replies.append(_stream_end(url, body, streaming))  # noqa: E731
            else:
                streaming.set()
                target = lambda url=url, replies=replies: replies.append(_post_status(url, long))  # noqa: E731
            client = threading.Thread(target=target, daemon=True)
            client.start()
            while (
                httpx.get(url + "/server_info", timeout=10).json()["num_inflight"] == 0
                or not streaming.is_set()
            ):
                assert client.is_alive()
                time.sleep(0.05)
            proc.send_signal(sig)
            clients[sig] = (client, replies, time.monotonic())
        runs = {}
        for sig, (proc, _, path) in procs.items():
            client, replies, signalled = clients[sig]
            try:
                proc.wait(max(0.0, signalled + EXIT_WITHIN_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            exited = proc.poll() is not None
            client.join(EXIT_WITHIN_S)
            runs[sig] = Drained(path.read_text(), exited, proc.returncode, replies, not client.is_alive())
        yield runs
    finally:
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


@pytest.mark.parametrize("sig", SIGNALS, ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_the_server_and_it_exits_within_15_s(
    drained: dict[signal.Signals, Drained], sig: signal.Signals
) -> None:
    run = drained[sig]
    assert run.exited_in_time, run.log  # the server was still up 15 s after its signal
    assert run.replies and run.client_done  # the request in flight was answered or cut off
    assert run.returncode != -signal.SIGALRM, "the drain did not finish: the exit alarm ended it"


def test_a_stream_cut_by_the_drain_ends_with_an_error_event_and_done(
    drained: dict[signal.Signals, Drained],
) -> None:
    # Regression (bug hunt): the stream stopped mid-chunk (curl: partial transfer) and the server
    # logged "Exception in ASGI application".
    run = drained[signal.SIGINT]
    assert run.replies and isinstance(run.replies[0], str), run.replies
    lines = run.replies[0].split("\n")  # the data lines, or the client's error name
    assert lines[-1] == "data: [DONE]", lines[-2:]
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert "Exception in ASGI application" not in run.log, run.log


def _stream_end(url: str, body: dict[str, Any], first: threading.Event) -> str:
    """The stream's data lines, or the client's error; ``first`` is set at its first event."""
    events: list[str] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    first.set()
    except httpx.HTTPError as e:
        return type(e).__name__
    finally:
        first.set()
    return "\n".join(events)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _post_status(url: str, body: dict[str, Any]) -> int | str:
    try:
        return httpx.post(url + "/v1/completions", json=body, timeout=120).status_code
    except httpx.HTTPError as e:
        return type(e).__name__


# ---------------------------------------------------- HTTP-level limits


def _whole_reply(reply: bytes) -> bool:
    head, sep, body = reply.partition(b"\r\n\r\n")
    for line in head.lower().split(b"\r\n")[1:] if sep else ():
        name, _, value = line.partition(b":")
        if name.strip() == b"content-length":
            return len(body) >= int(value)
    return False


class _Uvicorn:
    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        kwargs = uvicorn_kwargs(config) | {"port": self.port}
        self.server = uvicorn.Server(
            uvicorn.Config(create_app(engine, config=config), log_level="warning", **kwargs)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.05)

    def exchange(self, data: bytes, wait_s: float = 30, closes: bool = False) -> tuple[int, dict[str, Any]]:
        """Send raw bytes; (status, JSON body) of the reply the server sends on its own. Read until
        the body's content-length is in (a connection kept alive is not waited out) or the close;
        with ``closes``, also assert that the server says so and closes well before keep-alive ends."""
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            s.settimeout(wait_s)
            s.sendall(data)
            reply = b""
            while not _whole_reply(reply) and (chunk := s.recv(65536)):
                reply += chunk
            if closes:
                s.settimeout(1.0)  # the keep-alive timeout is 5 s: a 1 s wait tells the two apart
                assert s.recv(1) == b"", "the server kept the connection open"
        head, _, body = reply.partition(b"\r\n\r\n")
        assert b"content-type: application/json" in head.lower(), head
        assert not closes or b"connection: close" in head.lower(), head
        return int(head.split()[1]), json.loads(body)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_http_timeouts_connection_cap_and_malformed_requests_get_json(engine: LLMEngine) -> None:
    config = ServerConfig(header_timeout_s=0.5, read_timeout_s=0.5, max_connections=3, max_body_mb=1)
    server = _Uvicorn(engine, config)
    try:
        status, body = server.exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow")
        assert status == 408 and "headers" in body["error"]["message"]
        stalled = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
        # The unread rest of a timed-out body must not be read as the connection's next request.
        status, body = server.exchange(stalled, closes=True)
        assert status == 408 and "body" in body["error"]["message"]
        announced = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n{"
        status, body = server.exchange(announced, closes=True)  # refused before the body is read
        assert status == 413 and "limit" in body["error"]["message"]
        chunk = b"x" * ((1 << 20) + 1)  # no Content-Length: the limit is met while the body streams
        grown = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        status, body = server.exchange(grown + b"%x\r\n" % len(chunk) + chunk + b"\r\n", closes=True)
        assert status == 413 and "limit" in body["error"]["message"]
        status, body = server.exchange(b"GARBAGE\r\n\r\n")
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        time.sleep(0.2)  # accepted by the server
        try:
            status, body = server.exchange(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status == 503 and "connections" in body["error"]["message"]
        finally:
            for s in held:
                s.close()
        time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200
    finally:
        server.stop()


# --------------------------------------------------------------- fuzzing

SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udbff"])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and infinities too: Python's JSON reads them
    st.text(max_size=12),
    SURROGATES,
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
HUGE = st.sampled_from(["x" * 300_000, ["a"] * 5_000, list(range(20_000))])
DEEP = st.integers(60, 400).map(lambda d: json.loads("[" * d + "]" * d))
HOSTILE = st.one_of(JSON, HUGE, DEEP)
SMALL_LIMIT = st.one_of(st.integers(1, 3), HOSTILE)  # output limits: tiny when valid, so runs stay short
MESSAGES = st.one_of(
    st.just([{"role": "user", "content": "Hi"}]),
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), HOSTILE),
                "content": HOSTILE,
            }
        ),
        max_size=3,
    ),
    HOSTILE,
)
SCHEMAS = st.one_of(
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}}),
    st.dictionaries(
        st.sampled_from(["type", "properties", "items", "$ref", "enum", "required"]), HOSTILE, max_size=3
    ),
    HOSTILE,
)
SHARED_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(st.just("default"), HOSTILE),
    "max_tokens": SMALL_LIMIT,
    "temperature": st.one_of(st.floats(0, 2), HOSTILE),
    "top_p": st.one_of(st.floats(0, 1), HOSTILE),
    "top_k": HOSTILE,
    "min_p": HOSTILE,
    "seed": HOSTILE,
    "stop": st.one_of(st.just(["\n"]), HOSTILE),
    "stop_token_ids": HOSTILE,
    "ignore_eos": HOSTILE,
    "n": st.one_of(st.integers(1, 2), HOSTILE),
    "stream": st.one_of(st.booleans(), HOSTILE),
    "stream_options": st.one_of(st.just({"include_usage": True}), HOSTILE),
    "response_format": st.one_of(
        st.just({"type": "json_object"}),
        st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, SCHEMAS),
        HOSTILE,
    ),
    "regex": st.one_of(st.just("[0-9]{2}"), HOSTILE),
    "ebnf": st.one_of(st.just('root ::= "a"'), HOSTILE),
    "json_schema": SCHEMAS,
    "logit_bias": HOSTILE,
    "tools": HOSTILE,
}
CHAT_FIELDS = SHARED_FIELDS | {
    "messages": MESSAGES,
    "max_completion_tokens": SMALL_LIMIT,
    "logprobs": HOSTILE,
    "top_logprobs": HOSTILE,
}
COMPLETION_FIELDS = SHARED_FIELDS | {
    "prompt": st.one_of(st.just("Hi"), st.just([[1, 2], [3]]), HOSTILE),
    "logprobs": HOSTILE,
    "echo": HOSTILE,
    "suffix": HOSTILE,
    "best_of": HOSTILE,
}
NATIVE_FIELDS = {k: v for k, v in SHARED_FIELDS.items() if k not in ("model", "max_tokens", "n", "stream")}
NATIVE_FIELDS |= {"max_new_tokens": SMALL_LIMIT, "json_object": HOSTILE, "typo": HOSTILE}


def _body(
    base: dict[str, Any], fields: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    """``base`` with a few of ``fields`` set to drawn values (an output limit is never left unset)."""
    picked = st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)
    return picked.flatmap(lambda names: st.fixed_dictionaries({n: fields[n] for n in names})).map(
        lambda drawn: base | drawn
    )


REQUESTS = st.one_of(
    _body({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, CHAT_FIELDS).map(
        lambda b: ("/v1/chat/completions", b)
    ),
    _body({"prompt": "Hi", "max_tokens": 2}, COMPLETION_FIELDS).map(lambda b: ("/v1/completions", b)),
    st.tuples(
        _body({"max_new_tokens": 2}, NATIVE_FIELDS),
        st.one_of(
            st.just({"text": "Hi"}),
            st.just({"input_ids": [[1, 2]]}),
            st.fixed_dictionaries({"text": HOSTILE}),
        ),
        st.one_of(st.just(False), HOSTILE),
    ).map(lambda t: ("/generate", {**t[1], "sampling_params": t[0], "stream": t[2]})),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate"]), HOSTILE),
)


def test_fuzzed_requests_never_get_a_5xx_and_leave_nothing_behind(engine: LLMEngine) -> None:
    with serving(engine) as client:

        @settings(max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(request=REQUESTS)
        def check(request: tuple[str, Any]) -> None:
            path, body = request
            content = json.dumps(body).encode()  # ASCII: lone surrogates travel as \\ud800 escapes
            r = client.post(path, content=content, headers={"content-type": "application/json"})
            assert r.status_code < 500, (path, body, r.text[:300])
            if r.status_code >= 400:
                assert r.json()["error"]["message"]

        check()
        assert_serves(client)
        assert_idle(client)


def test_a_request_cut_by_the_shutdown_drain_is_a_json_503_not_a_plain_text_500() -> None:
    """uvicorn cancels what still runs when the drain ends; before its response started, a request
    gets OpenAI's error shape (503, retry) from ``Guard``; after, the cancellation goes on up."""
    import asyncio

    from ngrammar.server.config import ServerConfig
    from ngrammar.server.http import Guard

    async def run(start_first: bool) -> tuple[list[dict[str, Any]], bool]:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            if start_first:
                await send({"type": "http.response.start", "status": 200, "headers": []})
            await asyncio.Event().wait()  # a request still running

        sent: list[dict[str, Any]] = []

        async def send(message: Any) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "path": "/v1/completions", "headers": []}
        task = asyncio.ensure_future(Guard(app, ServerConfig())(scope, receive, send))
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return sent, True
        return sent, False

    sent, cancelled = asyncio.run(run(start_first=False))
    assert not cancelled and sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"] == "shutting_down"
    sent, cancelled = asyncio.run(run(start_first=True))
    assert cancelled and [m["status"] for m in sent] == [200]
