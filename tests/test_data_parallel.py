"""Data-parallel replicas behind the one OpenAI server, on the CPU: two engine processes.

Greedy outputs equal the one-process engine's (the session ``llm``, what a ``--dp 1`` server
serves: ``test_server`` checks that server against it), requests spread over both replicas, the
metrics sum them, and a replica killed mid-run fails only its own requests while the other keeps
serving.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# The server speaks msgspec over ZeroMQ: an image without them skips these tests, named in the summary.
pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from ngrammar import LLM, SamplingParams
from ngrammar.server import create_app
from tests.serving import UvicornThread

# The OpenAI client is a test extra: where it is missing (the GPU image) this module is skipped.
openai = pytest.importorskip("openai")

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "The best way to learn is"]


class LiveServer(UvicornThread):
    def __init__(self, **engine: Any) -> None:
        super().__init__(create_app({"device": "cpu", "dtype": "float32", "kv_cache_tokens": 4096, **engine}))
        self.start()

    @property
    def router(self) -> Any:
        return self.app.state.server.loop


@pytest.fixture(scope="module")
def dp2() -> Iterator[LiveServer]:
    server = LiveServer(data_parallel_size=2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(dp2: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dp2.url}/v1", api_key="unused", max_retries=0, timeout=300)


def complete(oai: openai.OpenAI, prompt: str, max_tokens: int) -> str:
    r = oai.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text


def test_greedy_outputs_equal_one_engine_and_both_replicas_serve(
    dp2: LiveServer, oai: openai.OpenAI, llm: LLM
) -> None:
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: complete(oai, p, 12), PROMPTS))
    assert got == want
    assert all(r.routed >= 1 for r in dp2.router.replicas)


def test_metrics_and_server_info_sum_the_replicas(dp2: LiveServer, oai: openai.OpenAI) -> None:
    # two prompts, one per replica (least loaded first), of two sequences each
    r = oai.completions.create(model="default", prompt=PROMPTS[:2], max_tokens=4, temperature=0, n=2)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts[0] == texts[1] and texts[2] == texts[3]
    with httpx.Client(base_url=dp2.url, timeout=60) as http:
        deadline = time.monotonic() + 10
        # both sequences released (the snapshot is refreshed right after the outputs are delivered)
        while (info := http.get("/server_info").json())["num_inflight"]:
            assert time.monotonic() < deadline, info
            time.sleep(0.05)
        text = http.get("/metrics").text
        assert http.get("/health").status_code == 200
        assert "--speculative ngram" in http.get("/v1/draft_corpora").json()["error"]["message"]
    pages = [r.load.kv_pages_total for r in dp2.router.replicas]
    assert info["kv_pages_total"] == sum(pages) == 2 * 4096 // 16
    assert info["step_running_s"] == 0.0  # no replica holds a request
    metrics = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert metrics["ngrammar_dp_replicas_alive"] == 2
    assert metrics["ngrammar_generation_tokens_total"] >= 4


def test_a_killed_replica_fails_only_its_requests(dp2: LiveServer, oai: openai.OpenAI, llm: LLM) -> None:
    """Last in the module: it leaves one replica."""
    router = dp2.router
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    def run(prompt: str) -> str | Exception:
        try:
            r = oai.completions.create(
                model="default", prompt=prompt, max_tokens=32, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.choices[0].text
        except openai.APIError as e:
            return e

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(run, p) for p in PROMPTS]
        deadline = time.monotonic() + 120
        victim = router.replicas[1]
        while not (victim.load is not None and victim.load.stats.decode_tokens > 0 and victim.requests):
            assert time.monotonic() < deadline, "replica 1 never started decoding"
            time.sleep(0.02)
        os.kill(victim.pid, signal.SIGKILL)
        results = [f.result(timeout=300) for f in futures]
    failed = [r for r in results if isinstance(r, Exception)]
    served = [(p, r) for p, r in zip(PROMPTS, results) if not isinstance(r, Exception)]
    assert failed and served
    assert all("data-parallel replica 1" in str(e) for e in failed), failed
    want = llm.generate([p for p, _ in served], params)
    assert [r for _, r in served] == [w.outputs[0].text for w in want]
    assert not victim.alive and router.replicas[0].alive
    assert (
        complete(oai, PROMPTS[0], 12)
        == llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    )
    with httpx.Client(base_url=dp2.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        text = http.get("/metrics").text
    metrics = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert metrics["ngrammar_dp_replicas_alive"] == 1
