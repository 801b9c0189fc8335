"""The server with its engine in an engine-core process (``create_app`` from keyword arguments, as
``ngrammar serve`` builds it): outputs rebuilt from the core's deltas equal the offline engine's,
streamed or not; cancellation frees KV pages in the core; the core's death is a 5xx, never a hang.

One server per module (its core's start loads the model once); the crash test runs last and kills it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# The server speaks msgspec over ZeroMQ: an image without them skips these tests, named in the summary.
pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from ngrammar import LLM, SamplingParams
from ngrammar.server import create_app
from ngrammar.server.core import EngineCore, profiled
from ngrammar.server.core_client import CoreClient
from ngrammar.server.core_messages import Abort, Add
from ngrammar.server.warmup import CompileCounter
from tests.serving import UvicornThread, wait_idle

ENGINE_KWARGS: dict[str, Any] = dict(device="cpu", dtype="float32", kv_cache_tokens=8192, speculative="ngram")
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
MULTI_BYTE = "ok 🙃🙏 é"  # byte-level BPE splits these characters over several tokens


class CoreServer(UvicornThread):
    def __init__(self) -> None:
        super().__init__(create_app(ENGINE_KWARGS))
        self.start()

    @property
    def core(self) -> CoreClient:
        loop = self.app.state.server.loop
        assert isinstance(loop, CoreClient)
        return loop


@pytest.fixture(scope="module")
def live() -> Iterator[CoreServer]:
    server = CoreServer()
    yield server
    server.stop()
    assert all(c.popen is not None and c.popen.poll() is not None for c in server.core.replicas), (
        "an engine core outlived its server"
    )


@pytest.fixture(scope="module")
def http(live: CoreServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{live.port}", timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(**ENGINE_KWARGS)


def streamed(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[dict[int, str], dict[int, str]]:
    """Each choice's joined text and finish reason from an SSE stream."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                part = c["delta"].get("content") if "delta" in c else c["text"]
                texts[c["index"]] = texts.get(c["index"], "") + (part or "")
                if c["finish_reason"] is not None:
                    finish[c["index"]] = c["finish_reason"]
    return texts, finish


CASES: list[tuple[str, dict[str, Any], SamplingParams]] = [
    ("Count: 1, 2,", {"max_tokens": 16}, SamplingParams(max_tokens=16, temperature=0)),
    (
        "Count: 1, 2,",
        {"max_tokens": 16, "stop": [" 5,", "9"]},
        SamplingParams(max_tokens=16, temperature=0, stop=[" 5,", "9"]),
    ),
    (
        "A person as JSON:",
        {"max_tokens": 32, "json_schema": SCHEMA},
        SamplingParams(max_tokens=32, temperature=0, json_schema=SCHEMA),
    ),
    (
        "Say:",
        {"max_tokens": 16, "regex": MULTI_BYTE},
        SamplingParams(max_tokens=16, temperature=0, regex=MULTI_BYTE),
    ),
    (
        "Say:",
        {"max_tokens": 16, "regex": MULTI_BYTE + " end", "stop": ["🙏"]},
        SamplingParams(max_tokens=16, temperature=0, regex=MULTI_BYTE + " end", stop=["🙏"]),
    ),
    (
        "The capital of France is",
        {"max_tokens": 8, "n": 2, "logprobs": 2},
        SamplingParams(max_tokens=8, temperature=0, n=2, logprobs=2),
    ),
    (  # 37 is "5": the stop token's text is left out, streamed or not
        "Count: 1, 2, 3,",
        {"max_tokens": 8, "stop_token_ids": [37]},
        SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[37]),
    ),
]


def test_the_core_sends_new_tokens_once_and_refusals_in_the_same_turn(offline: LLM) -> None:
    core = EngineCore(offline.engine, CompileCounter())
    ids = offline.engine.tokenize("Count: 1, 2,")
    core.handle(Add("bad", "g", ids, SamplingParams(max_tokens=4, draft_corpora=("nope",))))
    [refused] = core.turn()
    assert [f.request_id for f in refused.failed] == ["bad"] and not core.busy
    params = SamplingParams(max_tokens=8, temperature=0, n=2, logprobs=1)
    core.handle(Add("ok", "g", ids, params))
    tokens: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[int]] = {0: [], 1: []}
    finished = False
    while core.busy:
        for r in [r for delta in core.turn() for r in delta.requests]:
            for d in r.seqs:
                tokens[d.index] += d.token_ids
                logprobs[d.index] += [t for t, _, _ in d.logprobs or []]
            finished = r.finished
    want = offline.generate("Count: 1, 2,", params)[0].outputs
    assert finished and [tokens[0], tokens[1]] == [c.token_ids for c in want] == [logprobs[0], logprobs[1]]


def test_a_grammar_compiling_never_stalls_the_running_requests(
    offline: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new grammar compiles on the backend's threads: the running requests step meanwhile, the
    request joins once it is compiled (or is refused then, or aborted while it waits)."""
    backend = offline.engine.grammar_backend
    held: dict[Any, Future[Any]] = {}

    def compile_later(spec: Any) -> Future[Any]:
        return held.setdefault(spec, Future())

    monkeypatch.setattr(backend, "compile_async", compile_later)
    core = EngineCore(offline.engine, CompileCounter())
    plain = SamplingParams(max_tokens=8, temperature=0)
    schema = SamplingParams(max_tokens=32, temperature=0, json_schema=SCHEMA)
    core.handle(Add("plain", "a", offline.engine.tokenize("Count: 1, 2,"), plain))
    core.handle(Add("json", "b", offline.engine.tokenize("A person as JSON:"), schema))
    core.handle(Add("gone", "c", offline.engine.tokenize("A person as JSON:"), schema))
    tokens: dict[str, list[int]] = {"plain": [], "json": []}
    for _ in range(3):
        for r in [r for delta in core.turn() for r in delta.requests]:
            tokens[r.request_id] += r.seqs[0].token_ids
    assert tokens["plain"] and not tokens["json"] and core.busy and core.load().num_waiting == 2
    core.handle(Abort("gone"))
    [spec] = held
    held[spec].set_result(backend.compile(spec))
    failed = []
    while core.busy:
        for delta in core.turn():
            failed += delta.failed
            for r in delta.requests:
                tokens[r.request_id] += r.seqs[0].token_ids
    assert [(f.request_id, f.kind) for f in failed] == [("gone", "Aborted")]
    want = offline.generate(["Count: 1, 2,", "A person as JSON:"], [plain, schema])
    assert [tokens["plain"], tokens["json"]] == [o.outputs[0].token_ids for o in want]


def test_a_command_the_core_cannot_read_is_refused_and_the_core_lives_on(offline: LLM) -> None:
    """An ``Add`` whose fields do not decode (a type the API side let through, as ``"json_schema":
    true`` once was) is a 400 for its request in the next delta, not the core's death; other
    unreadable commands are dropped."""
    import msgspec

    from ngrammar.server.core_messages import command_decoder

    core = EngineCore(offline.engine, CompileCounter())
    ids = offline.engine.tokenize("Count: 1, 2,")
    raw = msgspec.msgpack.encode(["Add", "odd", "g", ids, {"max_tokens": "four"}, 1])
    with pytest.raises(msgspec.DecodeError) as error:
        command_decoder.decode(raw)
    core.refuse_unreadable(raw, error.value)
    core.refuse_unreadable(b"\xc1", error.value)  # not even msgpack: logged, dropped
    deltas = core.turn(2)
    assert not deltas[0].failed
    [failed] = deltas[1].failed
    assert (failed.request_id, failed.kind) == ("odd", "InvalidRequestError") and not core.busy
    core.handle(Add("ok", "g", ids, SamplingParams(max_tokens=2, temperature=0)))
    while core.busy:
        core.turn()


def test_a_core_loop_runs_under_cprofile_only_when_asked(tmp_path: Any) -> None:
    """``NGRAMMAR_CORE_PROFILE``: the loop's stats land in PREFIX.<index>.prof, also when it fails."""
    import pstats

    def loop() -> None:
        sum(range(1000))
        raise RuntimeError("the loop failed")

    with pytest.raises(RuntimeError):
        profiled(loop, str(tmp_path / "core"), 3)
    stats = pstats.Stats(str(tmp_path / "core.3.prof"))
    assert any(name == "loop" for _, _, name in stats.stats)  # type: ignore[attr-defined]
    ran: list[int] = []
    profiled(lambda: ran.append(1), None, 0)
    assert ran == [1] and sorted(p.name for p in tmp_path.iterdir()) == ["core.3.prof"]
    profiled(lambda: ran.append(2), str(tmp_path / "missing" / "core"), 0)  # unwritable: a warning
    assert ran == [1, 2]


def test_reports_to_an_api_process_that_stopped_reading_never_block_the_core(tmp_path: Any) -> None:
    """The core's report socket queues without limit: with ZeroMQ's default a core kept stepping
    requests for an API process that had gone, blocked in ``send`` after 1,000 deltas, and never
    read its ``Stop`` (killed 30 s later)."""
    import zmq

    from ngrammar.server.core import REPORTS_SOCKET, report_socket

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/{REPORTS_SOCKET}")
    push = report_socket(ctx, str(tmp_path))
    push.send(b"first")
    assert pull.recv() == b"first"
    pull.close(0)
    for _ in range(5000):
        push.send(b"delta", zmq.NOBLOCK)  # raises zmq.Again past a limit
    push.close(0)
    ctx.term()


def test_each_api_server_process_gets_its_own_requests_and_every_one_the_load(offline: LLM) -> None:
    core = EngineCore(offline.engine, CompileCounter())
    ids = offline.engine.tokenize("Count: 1, 2,")
    params = SamplingParams(max_tokens=4, temperature=0)
    core.handle(Add("a", "g1", ids, params, client=1))
    core.handle(Add("b", "g2", ids, params, client=0))
    seen: dict[int, set[str]] = {0: set(), 1: set()}
    while core.busy:
        deltas = core.turn(2)
        assert len(deltas) == 2 and all(d.load is deltas[0].load for d in deltas)
        assert deltas[1].step_seconds is None  # (each step is timed once server-wide)
        for client, d in enumerate(deltas):
            seen[client] |= {r.request_id for r in d.requests}
    assert seen == {0: {"b"}, 1: {"a"}}


def test_server_info_shows_the_kv_pool_before_any_request(http: httpx.Client) -> None:
    """The cores' Ready carries their idle load: before any step /server_info showed 0 pages of 0.
    (The first test of this module to use the server.)"""
    info = http.get("/server_info").json()
    assert info["kv_pages_total"] > 0 and info["kv_pages_free"] == info["kv_pages_total"]


def test_stop_token_ids_outside_the_vocabulary_are_a_400(http: httpx.Client) -> None:
    body = {"prompt": "Hi", "max_tokens": 4, "stop_token_ids": [-3, 99999999]}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 400 and "stop_token_ids" in reply.text


def test_streamed_equals_non_streamed_equals_offline(http: httpx.Client, offline: LLM) -> None:
    expected = offline.generate([c[0] for c in CASES], [c[2] for c in CASES])
    for (prompt, extra, _), out in zip(CASES, expected):
        body = {"prompt": prompt, "temperature": 0, **extra}
        plain = http.post("/v1/completions", json=body)
        assert plain.status_code == 200, plain.text
        choices = plain.json()["choices"]
        want = {c.index: c.text for c in out.outputs}
        assert {c["index"]: c["text"] for c in choices} == want, body
        assert {c["index"]: c["finish_reason"] for c in choices} == {
            c.index: c.finish_reason for c in out.outputs
        }
        texts, finish = streamed(http, "/v1/completions", body)
        assert texts == want and finish == {c.index: c.finish_reason for c in out.outputs}, body
    native = http.post(
        "/generate",
        json={
            "text": CASES[3][0],
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "regex": MULTI_BYTE},
        },
    )
    assert native.json()["output_ids"] == expected[3].token_ids
    assert expected[3].text == MULTI_BYTE
    wait_idle(http)


def test_multi_byte_tokens_stream_whole_characters_and_keep_their_logprob_bytes(http: httpx.Client) -> None:
    body = {"prompt": "Say:", "max_tokens": 16, "temperature": 0, "regex": MULTI_BYTE, "logprobs": 0}
    lps = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert any(t.startswith("bytes:") for t in lps["tokens"]), lps["tokens"]  # a character split over tokens
    chat = {
        "messages": [{"role": "user", "content": "Say it."}],
        "max_tokens": 16,
        "temperature": 0,
        "regex": MULTI_BYTE,
    }
    texts, _ = streamed(http, "/v1/chat/completions", chat)
    assert texts == {0: MULTI_BYTE}
    assert "\ufffd" not in texts[0]


def test_cancelled_stream_frees_kv_pages_in_the_core(http: httpx.Client, live: CoreServer) -> None:
    wait_idle(http)
    body = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=f"http://127.0.0.1:{live.port}", timeout=60) as own:
        with own.stream("POST", "/v1/completions", json=body) as r:
            received = 0
            for line in r.iter_lines():
                received += line.startswith("data: ")
                if received >= 3:
                    break
            busy = http.get("/server_info").json()
            assert busy["num_inflight"] == 1 and busy["kv_pages_free"] < busy["kv_pages_total"]
    wait_idle(http, timeout_s=10)  # 2000 tokens would take minutes: only an abort is this fast


def compiles(http: httpx.Client) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name == "ngrammar_kernel_compiles":
            return float(family.samples[0].value)
    raise AssertionError("no compile counter in /metrics")


def test_a_prefix_hit_prefill_compiles_nothing_after_the_start(http: httpx.Client) -> None:
    before = compiles(http)
    prompt = "The prefix cache keeps the pages of this prompt for the next request. " * 6
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    http.post("/v1/completions", json=body)
    again = http.post("/v1/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert compiles(http) == before


def test_queue_bound_and_bad_input_hold_across_the_process_boundary(
    http: httpx.Client, live: CoreServer
) -> None:
    core = live.core
    saved, core.max_queue = core.max_queue, 2
    try:
        r = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert r.status_code == 400 and "queue" in r.json()["error"]["message"]
    finally:
        core.max_queue = saved
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "regex": "a[^\\s\\S]"})
    assert r.status_code == 400, r.text
    wait_idle(http)


def test_draft_corpora_are_served_by_the_core(http: httpx.Client, offline: LLM) -> None:
    text = "The lighthouse keeper climbed the stairs every evening to light the lamp."
    added = http.post("/v1/draft_corpora", json={"name": "lore", "documents": [text]})
    assert added.status_code == 200 and added.json()["name"] == "lore", added.text
    assert [c["name"] for c in http.get("/v1/draft_corpora").json()["data"]] == ["lore"]
    body = {"prompt": "The lighthouse keeper", "max_tokens": 12, "temperature": 0, "draft_corpora": ["lore"]}
    served = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert (
        served
        == offline.generate("The lighthouse keeper", SamplingParams(max_tokens=12, temperature=0))[0].text
    )
    assert http.post("/v1/completions", json={**body, "draft_corpora": ["nope"]}).status_code == 400
    assert http.delete("/v1/draft_corpora/lore").json() == {"name": "lore", "removed": True}
    assert http.delete("/v1/draft_corpora/lore").status_code == 404


def test_a_dead_core_fails_requests_with_5xx_and_health_with_503(
    http: httpx.Client, live: CoreServer
) -> None:
    """Last in the module: it kills the shared server's core."""
    body = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True}
    results: dict[str, Any] = {}

    def plain() -> None:
        results["plain"] = http.post("/v1/completions", json=body)

    def stream() -> None:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while http.get("/server_info").json()["num_running"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(live.core.replicas[0].pid, signal.SIGKILL)
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a request hung after the core died"
    assert (
        results["plain"].status_code == 500 and "engine core" in results["plain"].json()["error"]["message"]
    )
    last = json.loads(results["stream"][-2][6:])
    assert "engine core" in last["error"]["message"] and results["stream"][-1] == "data: [DONE]"
    assert http.get("/health").status_code == 503
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 503


def test_every_schema_the_server_accepts_reaches_the_core() -> None:
    """``"json_schema": true`` passes the HTTP checks (any JSON schema, a boolean included): the
    core's decoder must take it too, or one request kills the engine-core process."""
    from ngrammar.server.core_messages import command_decoder, encoder

    for schema in (True, {"type": "object"}, '{"type": "string"}'):
        add = Add("r", "g", [1, 2], SamplingParams(max_tokens=4, json_schema=schema))
        assert command_decoder.decode(encoder.encode(add)).params.json_schema == schema


def test_a_request_that_cannot_be_sent_is_a_400_and_leaves_nothing_admitted(
    offline: LLM, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JSON schema may hold an integer msgpack cannot carry (past 64 bits): the request is refused
    before it is counted, instead of a 500 that kept its sequences admitted and its request "in flight"
    for good (the queue filled up with them; /health reported a stalled engine)."""
    import zmq

    from ngrammar.sampling_params import InvalidRequestError
    from ngrammar.server.core_client import CoreProcess
    from ngrammar.server.core_messages import command_decoder

    ctx = zmq.Context.instance()
    push, pull, reports = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    push.bind("inproc://unsendable")
    pull.connect("inproc://unsendable")
    core = CoreProcess(0, "the engine core", os.getpid(), push, None)
    client = CoreClient([core], reports, offline.engine.tokenizer, 2, None, str(tmp_path))
    monkeypatch.setattr(CoreClient, "alive", True)
    try:
        huge = SamplingParams(max_tokens=4, json_schema={"const": 10**30})
        for _ in range(3):  # more than the queue of 2 holds
            with pytest.raises(InvalidRequestError, match="cannot take"):
                client.submit([[1, 2], [3]], [SamplingParams(max_tokens=4), huge])
        assert client.admitted.count == 0 and not core.requests and not client._assemblies
        assert pull.poll(0) == 0  # nothing half-sent
        group = client.submit([[1, 2]], [SamplingParams(max_tokens=4)])
        assert client.admitted.count == 1
        assert command_decoder.decode(pull.recv()).request_id == group.request_ids[0]
    finally:
        client._close()
        pull.close(linger=0)


def test_server_info_counts_the_requests_of_every_api_server_process(tmp_path: Any) -> None:
    """With ``--api-server-count`` the admitted count is shared: /server_info's ``num_inflight``
    reads it when asked, not when this process last heard from a core (a process whose last report
    came before another process's requests finished showed them in flight for good)."""
    import zmq

    from ngrammar.server.admission import SharedInflightCount

    path = str(tmp_path / "inflight")
    reports = zmq.Context.instance().socket(zmq.PULL)
    mine = CoreClient([], reports, None, 8, None, str(tmp_path / "a"), admitted=SharedInflightCount(path))  # type: ignore[arg-type]
    other = SharedInflightCount(path)
    try:
        assert other.take(3, 8) and mine.snapshot.num_inflight == 3
        other.give(3)
        assert mine.snapshot.num_inflight == 0
    finally:
        mine._close()


def test_every_api_server_process_counts_the_tokens_of_its_requests(
    offline: LLM, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only client 0's deltas carry the step's time (one observation server-wide), but each process's
    deltas carry its own requests' tokens: process 1 dropped them from ngrammar_generation_tokens."""
    import zmq

    from ngrammar.engine.stats import EngineStats
    from ngrammar.server.core_client import CoreProcess
    from ngrammar.server.core_messages import Load, RequestDelta, SeqDelta, StepDelta
    from ngrammar.server.metrics import ServerMetrics

    ctx = zmq.Context.instance()
    push, pull, reports = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    push.bind("inproc://tokens-of-client-1")
    pull.connect("inproc://tokens-of-client-1")
    core = CoreProcess(0, "the engine core", os.getpid(), push, None)
    metrics = ServerMetrics()
    client = CoreClient([core], reports, offline.engine.tokenizer, 8, metrics, str(tmp_path), client=1)
    monkeypatch.setattr(CoreClient, "alive", True)
    try:
        [rid] = client.submit([[1, 2]], [SamplingParams(max_tokens=3)]).request_ids
        load = Load(1, 0, 511, 512, 0, EngineStats(), 0)
        for tokens, finish in (([5, 6], None), ([7], "length")):
            seq = SeqDelta(0, tokens, finish)
            client._on_step(StepDelta(0, [RequestDelta(rid, [seq], finish is not None)], [], load, None))
        assert metrics.registry.get_sample_value("ngrammar_generation_tokens_total") == 3
        assert metrics.registry.get_sample_value("ngrammar_step_seconds_count") in (None, 0)
    finally:
        client._close()
        pull.close(linger=0)


def test_server_processes_shorten_the_gil_switch_interval() -> None:
    """``tune_server_process`` (called first by the core, the API server and the single-process
    server entry points) sets CPython's switch interval to ``SWITCH_INTERVAL_S``."""
    import sys

    from ngrammar.server.process import SWITCH_INTERVAL_S, tune_server_process

    before = sys.getswitchinterval()
    try:
        tune_server_process()
        assert abs(sys.getswitchinterval() - SWITCH_INTERVAL_S) < 1e-9 < before - SWITCH_INTERVAL_S
    finally:
        sys.setswitchinterval(before)
