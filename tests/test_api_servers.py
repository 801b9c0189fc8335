"""``ngrammar serve --api-server-count 2``: two API server processes in front of one engine core.
Outputs equal the offline engine's whichever process answers, the sequence queue is one limit
across processes, /metrics counts every process's requests, and SIGTERM ends every process."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from benchmarks.bench_serve import ServerProcess
from ngrammar import LLM, SamplingParams
from ngrammar.server.admission import SharedInflightCount
from ngrammar.server.api_servers import share

PROMPTS = ["The capital of France is", "def fib(n):", "Count: 1, 2,", "Colors: red, green,"]
MAX_QUEUE = 2


def test_a_shared_count_is_one_limit_across_its_holders(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "inflight")
    a, b = SharedInflightCount(path), SharedInflightCount(path)
    assert a.take(2, 3) and not b.take(2, 3) and b.take(1, 3)
    assert (a.count, b.count, a.own, b.own) == (3, 3, 2, 1)
    a.give(2)
    assert b.take(2, 3) and a.count == 3


def test_connections_split_evenly() -> None:
    assert [share(512, 3, i) for i in range(3)] == [171, 171, 170] and share(1, 4, 3) == 1


def _children(pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    flags = ["--api-server-count", "2", "--device", "cpu", "--dtype", "float32", "--kv-cache-tokens", "8192"]
    with ServerProcess([*flags, "--max-queue", str(MAX_QUEUE)], speculative=False) as server:
        assert server.proc is not None
        yield server.proc, server.url


def _complete(url: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_outputs_equal_the_offline_engine_whichever_process_answers(
    served: tuple[subprocess.Popen[bytes], str], llm: LLM
) -> None:
    _, url = served
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))]
    for _ in range(2):  # (new connections: both processes accept)
        with ThreadPoolExecutor(MAX_QUEUE) as pool:
            got = list(pool.map(lambda p: _complete(url, p), PROMPTS))
        assert [r.status_code for r in got] == [200] * len(PROMPTS), [r.text for r in got]
        assert [r.json()["choices"][0]["text"] for r in got] == want
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    answered = sum(
        s.value
        for s in families["ngrammar_http_requests"].samples
        if s.name.endswith("_total") and s.labels["endpoint"] == "/v1/completions"
    )
    assert answered >= 2 * len(PROMPTS)  # every process's requests, whichever answers /metrics


def test_the_queue_is_one_limit_across_processes(served: tuple[subprocess.Popen[bytes], str]) -> None:
    _, url = served
    with ThreadPoolExecutor(8) as pool:  # long requests: none finishes before the others arrive
        statuses = [r.status_code for r in pool.map(lambda p: _complete(url, p, 96), PROMPTS * 2)]
    assert statuses.count(200) <= MAX_QUEUE and set(statuses) <= {200, 503}, statuses


def test_sigterm_ends_every_process(served: tuple[subprocess.Popen[bytes], str]) -> None:
    server, _ = served
    children = _children(server.pid)
    assert len(children) == 3  # two API server processes and the engine core
    server.send_signal(signal.SIGTERM)
    assert server.wait(60) == 0
    deadline = time.monotonic() + 30
    while not all(_gone(p) for p in children):
        assert time.monotonic() < deadline, "a process outlived the server"
        time.sleep(0.1)
