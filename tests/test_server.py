"""The HTTP server end to end: a real uvicorn server on 127.0.0.1 with the embedded model.

One server (NGRAM speculation on, so structured requests exercise the tree-verify paths) is
started per module in a daemon thread; tests talk to it with the official ``openai`` client and
plain ``httpx``. Outputs stay short (<= 32 tokens): CPU decoding costs tens of ms per token.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

# The server speaks msgspec over ZeroMQ: an image without them skips these tests, named in the summary.
pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from ngrammar import LLM, SamplingParams
from ngrammar.engine.engine import LLMEngine
from ngrammar.llm import build_engine_config
from ngrammar.server import create_app
from tests.serving import wait_idle

# The OpenAI client is a test extra: where it is missing (the GPU image) this module is skipped.
openai = pytest.importorskip("openai")

ENGINE_KWARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", kv_cache_tokens=16384, speculative="ngram"
)

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE_REGEX = r"[0-9]{3}-[0-9]{4}"


class LiveServer:
    def __init__(self) -> None:
        # Overlap scheduling on (the CUDA default): requests join, finish and get cancelled while
        # a plain step is in flight, and outputs must still equal the offline engine's.
        # An engine instance: served in this process, so tests can reach into it (the engine-core
        # process is tested in test_engine_core.py).
        self.app = create_app(LLMEngine(build_engine_config(**ENGINE_KWARGS, overlap_schedule=True)))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            assert self.thread.is_alive(), "the server thread died"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def state(self) -> Any:
        return self.app.state.server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    server = LiveServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline() -> LLM:
    """A second, offline copy of the same engine configuration, to compare greedy outputs with."""
    return LLM(**ENGINE_KWARGS)


def assert_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


def chat_messages(text: str) -> list[Any]:
    # list[Any]: the openai client wants its TypedDicts, the offline API plain dicts.
    return [{"role": "user", "content": text}]


# ----------------------------------------------------------- openai client


def test_chat_completion_with_openai_client(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(
        model="default", messages=chat_messages("Say hello."), max_tokens=12, temperature=0
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.completion_tokens <= 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_text_completion_with_openai_client(oai: openai.OpenAI, live: LiveServer) -> None:
    model = live.state.model_name
    resp = oai.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert resp.model == model
    assert resp.choices[0].text
    assert resp.usage is not None and resp.usage.completion_tokens == 8  # no EOS that early: length


def test_streaming_joins_to_the_non_streaming_text(oai: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(
        model="default", messages=chat_messages("Name three colors."), max_tokens=24, temperature=0
    )
    full = oai.chat.completions.create(**args)
    chunks = list(oai.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens  # type: ignore[union-attr]


def test_completion_stream_usage(oai: openai.OpenAI) -> None:
    chunks = list(
        oai.completions.create(
            model="default",
            prompt="One, two, three,",
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 10


def test_response_format_json_schema(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(
        model="default",
        messages=chat_messages("Give me a JSON object for Alice, 30 years old."),
        max_tokens=32,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
    )
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content or ""), PERSON_SCHEMA)


def test_regex_via_extra_body(oai: openai.OpenAI) -> None:
    resp = oai.completions.create(
        model="default",
        prompt="My phone number is",
        max_tokens=16,
        temperature=0,
        extra_body={"regex": PHONE_REGEX},
    )
    assert re.fullmatch(PHONE_REGEX, resp.choices[0].text)


def test_json_object_response_format(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(
        model="default",
        messages=chat_messages("Reply with a JSON object holding a key 'ok'."),
        max_tokens=32,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = resp.choices[0].message.content or ""
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut at max_tokens: still a prefix of a JSON object
        assert text.lstrip().startswith("{")


def test_chat_logprobs_and_n(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(
        model="default",
        messages=chat_messages("Pick a number."),
        max_tokens=6,
        temperature=0.8,
        seed=7,
        n=2,
        logprobs=True,
        top_logprobs=2,
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    for choice in resp.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        assert all(len(t.top_logprobs) <= 2 and t.logprob <= 0 for t in choice.logprobs.content)
    assert resp.usage is not None
    assert resp.usage.completion_tokens == sum(
        len(c.logprobs.content or []) for c in resp.choices if c.logprobs
    )


def test_batched_prompts_and_n_map_to_choice_indices(http: httpx.Client) -> None:
    body = {"prompt": ["Red, green,", "One, two,"], "max_tokens": 3, "temperature": 0.7, "seed": 1, "n": 2}
    out = http.post("/v1/completions", json=body).json()
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2, 3]
    assert out["usage"]["completion_tokens"] == 12
    events = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finished = [c["index"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert sorted(finished) == [0, 1, 2, 3]


# ----------------------------------------------------------------- native


def test_generate_native(http: httpx.Client) -> None:
    body = {
        "text": "My phone number is",
        "sampling_params": {"max_new_tokens": 16, "temperature": 0, "regex": PHONE_REGEX},
    }
    out = http.post("/generate", json=body).json()
    assert re.fullmatch(PHONE_REGEX, out["text"])
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop"}
    assert meta["completion_tokens"] == len(out["output_ids"]) and meta["prompt_tokens"] > 0
    assert meta["e2e_latency"] > 0 and "spec_accept_length" in meta and "spec_verify_steps" in meta


def test_generate_native_stream_and_input_ids(http: httpx.Client, live: LiveServer) -> None:
    ids = live.state.tokenizer.encode("Once upon a time")
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "stream": True}
    events = []
    with http.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["completion_tokens"] == 8 and len(last["output_ids"]) == 8
    plain = http.post("/generate", json={**body, "stream": False}).json()
    assert plain["text"] == last["text"]


def test_models_health_and_server_info(http: httpx.Client, live: LiveServer) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [live.state.model_name]
    info = wait_idle(http)
    assert info["stats"]["steps"] > 0
    assert info["avg_spec_accept_length"] >= 0
    assert info["config"]["speculative"]["num_draft_tokens"] >= 1


# -------------------------------------------------------------- concurrency


def mixed_workload() -> list[tuple[str, dict[str, Any], Any, SamplingParams]]:
    """32 greedy requests (endpoint, body, offline prompt, offline params), half structured."""
    topics = ["the sea", "a robot", "winter", "coffee", "a city", "music", "a cat", "the moon"]
    work = []
    for _i, topic in enumerate(topics):
        params = SamplingParams(max_tokens=20, temperature=0)
        msgs = chat_messages(f"Write one sentence about {topic}.")
        work.append(
            ("/v1/chat/completions", {"messages": msgs, "max_tokens": 20, "temperature": 0}, msgs, params)
        )
        prompt = f"Here is a short story about {topic}:"
        work.append(
            ("/v1/completions", {"prompt": prompt, "max_tokens": 20, "temperature": 0}, prompt, params)
        )
        schema_params = SamplingParams(max_tokens=32, temperature=0, json_schema=PERSON_SCHEMA)
        msgs = chat_messages(f"Describe a person who loves {topic} as JSON with name and age.")
        body = {
            "messages": msgs,
            "max_tokens": 32,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_SCHEMA}},
        }
        work.append(("/v1/chat/completions", body, msgs, schema_params))
        regex_params = SamplingParams(max_tokens=16, temperature=0, regex=PHONE_REGEX)
        prompt = f"Call the {topic} hotline at"
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "regex": PHONE_REGEX}
        work.append(("/v1/completions", body, prompt, regex_params))
    return work


def response_text(endpoint: str, body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return str(choice["message"]["content"] if endpoint == "/v1/chat/completions" else choice["text"])


def offline_texts(llm: LLM, work: list[tuple[str, dict[str, Any], Any, SamplingParams]]) -> list[str]:
    """The offline API's texts for the workload, in one batch: chats as the ids ``LLM.chat`` renders
    them to (``LLMEngine.tokenize``), plain prompts as text."""
    prompts = [llm.engine.tokenize(w[2]) if isinstance(w[2], list) else w[2] for w in work]
    return [o.text for o in llm.generate(prompts, [w[3] for w in work])]


def test_concurrent_mixed_requests_match_offline(http: httpx.Client, offline: LLM) -> None:
    work = mixed_workload()
    with ThreadPoolExecutor(len(work)) as pool:
        responses = list(pool.map(lambda w: http.post(w[0], json=w[1]), work))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    served = [response_text(w[0], r.json()) for w, r in zip(work, responses)]
    assert served == offline_texts(offline, work)
    for (_, _, _, params), text in zip(work, served):
        if params.json_schema is not None:
            jsonschema.validate(json.loads(text), PERSON_SCHEMA)
        if params.regex is not None:
            assert re.fullmatch(PHONE_REGEX, text)
    wait_idle(http)


# ------------------------------------------------------------ cancellation


def test_cancelled_stream_frees_kv_pages(http: httpx.Client, live: LiveServer) -> None:
    wait_idle(http)
    body = {
        "messages": chat_messages("Tell me a very long story."),
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=live.url, timeout=60) as own:
        with own.stream("POST", "/v1/chat/completions", json=body) as r:
            received = 0
            for line in r.iter_lines():
                received += line.startswith("data: ")
                if received >= 4:  # the role chunk and three content chunks: generation is under way
                    break
            busy = http.get("/server_info").json()
            assert busy["num_inflight"] == 1 and busy["kv_pages_free"] < busy["kv_pages_total"]
    info = wait_idle(http, timeout_s=10)  # 2000 tokens would take minutes: only an abort is this fast
    assert info["kv_pages_free"] == info["kv_pages_total"]


def test_disconnected_non_streaming_request_is_aborted(http: httpx.Client, live: LiveServer) -> None:
    wait_idle(http)
    body = {"prompt": "Count to a thousand:", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=live.url, timeout=1.5) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json=body)
    wait_idle(http, timeout_s=10)


# ----------------------------------------------------------------- errors


def test_invalid_inputs_get_openai_errors(http: httpx.Client) -> None:
    msgs = chat_messages("hi")
    bad_schema = {"type": "object", "properties": {"a": {"type": "strin"}}}
    cases: list[tuple[str, dict[str, Any], int, str | None]] = [
        ("/v1/chat/completions", {"messages": msgs, "json_schema": bad_schema}, 400, None),
        (
            "/v1/chat/completions",
            {
                "messages": msgs,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": bad_schema},
                },
            },
            400,
            None,
        ),
        ("/v1/completions", {"prompt": "x", "regex": "(unclosed"}, 400, None),
        ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= oops("}}, 400, None),
        ("/v1/completions", {"prompt": "hello " * 9000, "max_tokens": 4}, 400, None),
        ("/v1/chat/completions", {"messages": msgs, "temperature": -1}, 400, "temperature"),
        ("/v1/chat/completions", {"messages": msgs, "top_p": 0}, 400, "top_p"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/completions", {"prompt": [10**9], "max_tokens": 4}, 400, None),
        # Regression: outside int64 these failed inside an engine step (a 500, for the whole batch).
        ("/v1/completions", {"prompt": "x", "max_tokens": 4, "seed": 2**64}, 400, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": 4, "top_k": 2**70}, 400, None),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, "seed": 2**64}}, 400, None),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, "typo": 1}}, 400, None),
        # Regression (bug hunt): a text part without its text was told only text parts are supported.
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            400,
            None,
        ),
        # Regression (bug hunt): an empty batch of texts answered 200 [] (``prompt: []`` is a 400).
        ("/generate", {"text": []}, 400, None),
        ("/generate", {"input_ids": []}, 400, None),
        ("/v1/chat/completions", {"model": "gpt-4o", "messages": msgs}, 404, "model"),
        # Regression: a grammar matching nothing masked every token and failed in the engine (500).
        ("/v1/completions", {"prompt": "x", "max_tokens": 4, "regex": "[^\\s\\S]"}, 400, None),
        ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= [^\\x00-\\U0010FFFF]"}}, 400, None),
        # A grammar that reaches a dead end after "a": the request's fault too (it was a 500).
        (
            "/v1/completions",
            {"prompt": "Say a", "max_tokens": 8, "temperature": 0, "regex": "a[^\\s\\S]"},
            400,
            None,
        ),
    ]
    for path, body, status, param in cases:
        error = assert_error(http.post(path, json=body), status)
        if param is not None:
            assert error["param"] == param, (path, body, error)
    assert "prompt is" in assert_error(http.post("/v1/completions", json=cases[4][1]), 400)["message"]
    textless = {"messages": [{"role": "user", "content": [{"type": "text"}]}]}
    assert "needs its text" in assert_error(http.post("/v1/chat/completions", json=textless), 400)["message"]
    image = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert "image_url" in assert_error(http.post("/v1/chat/completions", json=image), 400)["message"]
    malformed = http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    error = assert_error(malformed, 400)  # (its param was the character offset of the error)
    assert error["param"] is None and "not valid JSON" in error["message"], error
    assert_error(http.get("/no/such/route"), 404)
    ok = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    wait_idle(http)


def test_openai_client_raises_typed_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="default", prompt="x", max_tokens=2, extra_body={"regex": "[a-"})


def test_engine_failure_is_a_500_and_the_server_survives(http: httpx.Client, live: LiveServer) -> None:
    wait_idle(http)
    engine = live.state.engine

    def failing_step() -> Any:
        vars(engine).pop("step", None)  # fail once; then the class's step is found again
        raise RuntimeError("injected failure")

    engine.step = failing_step
    try:
        error = assert_error(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}), 500)
        assert error["type"] == "server_error" and "injected failure" in error["message"]
    finally:
        vars(engine).pop("step", None)
    ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200
    wait_idle(http)
    # Regression: the failed request's abort, reported by the next step, re-created its entry.
    assert live.state.loop._emitted == {}


def test_queue_bound_answers_503_with_retry_after(http: httpx.Client, live: LiveServer) -> None:
    wait_idle(http)
    loop = live.state.loop
    saved, loop.max_queue = loop.max_queue, 2
    body = {"prompt": "Tell me about the weather", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda _: http.post("/v1/completions", json=body), range(8)))
    finally:
        loop.max_queue = saved
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 503} and statuses.count(200) >= 2, statuses
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert assert_error(r, 503)["code"] == "queue_full"
    wait_idle(http)
    assert http.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200


def test_a_batch_larger_than_the_queue_is_a_400(http: httpx.Client, live: LiveServer) -> None:
    """Regression: it was a 503 with Retry-After, which no retry can ever satisfy."""
    loop = live.state.loop
    saved, loop.max_queue = loop.max_queue, 2
    try:
        r = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
    finally:
        loop.max_queue = saved
    assert "queue" in assert_error(r, 400)["message"]
    wait_idle(http)


def test_without_max_tokens_each_prompt_runs_to_its_own_context_end() -> None:
    """Regression: every prompt of a batch got the room the longest one left (a 4-token prompt
    stopped after 18 tokens under a 48-token context); and, as in vLLM, a prompt plus max_tokens past
    the context is refused instead of being cut short silently."""
    app = create_app(LLMEngine(build_engine_config(**ENGINE_KWARGS, max_model_len=48)))
    with TestClient(app) as client:
        tokenizer = app.state.server.engine.tokenizer
        prompts = ["Hi", "Tell me a story about a dragon and a knight, with a castle and a quest, please"]
        r = client.post(
            "/v1/completions",
            json={"prompt": prompts, "max_tokens": None, "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        room = [48 - len(tokenizer.encode(p)) for p in prompts]
        assert r.json()["usage"]["completion_tokens"] == sum(room) and room[0] > room[1]
        assert all(c["finish_reason"] == "length" for c in r.json()["choices"])
        error = assert_error(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 48}), 400)
        assert "max_tokens" in error["message"]
        error = assert_error(
            client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 48}}), 400
        )
        assert "max_new_tokens" in error["message"]
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        # Review: a limit the client did not send (/generate's default of 128 new tokens, the
        # completions endpoint's 16) is capped to the room left, not refused.
        native = client.post(
            "/generate", json={"text": prompts[1], "sampling_params": {"temperature": 0, "ignore_eos": True}}
        )
        assert native.status_code == 200 and native.json()["meta_info"]["completion_tokens"] == room[1]


def test_stream_chunks_carry_openai_null_fields(http: httpx.Client) -> None:
    """Regression: nulls were dropped from every body (``finish_reason``, ``logprobs``, ``usage``),
    which strict typed clients need; a delta still carries only what it adds."""
    body = {
        "messages": chat_messages("Say hi"),
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["choices"][0]["finish_reason"] is None and "logprobs" in chunks[0]["choices"][0]
    assert all("usage" in c and (c["usage"] is None) == (i < len(chunks) - 1) for i, c in enumerate(chunks))
    plain = http.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert plain["choices"][0]["logprobs"] is None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream_options": None}) as r:
        assert all(
            "usage" not in json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")
        )


def test_logprob_tokens_keep_their_bytes() -> None:
    """Regression: each token was decoded alone, so a token holding part of a character read as
    U+FFFD: its ``bytes`` were U+FFFD's, distinct tokens merged into one top_logprobs key, and the
    text offsets drifted. Completions logprobs also left out the sampled token itself."""
    from ngrammar.model.loader import resolve_checkpoint
    from ngrammar.model.tokenizer import Tokenizer
    from ngrammar.outputs import TokenLogprob
    from ngrammar.server.rendering import TextOffsets, chat_logprobs, completion_logprobs

    tokenizer = Tokenizer(resolve_checkpoint(None).tokenizer_dir)
    text = "ok 🙃🙏 é"
    ids = tokenizer.encode(text)
    alternatives = list(dict.fromkeys(ids[:3]))
    lps = [
        TokenLogprob(t, -0.5, tuple((a, -1.0 - k) for k, a in enumerate(alternatives) if a != t)) for t in ids
    ]
    chat = chat_logprobs(tokenizer, lps)
    assert b"".join(bytes(c.bytes or []) for c in chat.content).decode() == text
    legacy = completion_logprobs(tokenizer, lps, TextOffsets())
    assert any(t.startswith("bytes:") for t in legacy.tokens)
    assert all(
        len(top) == len(lp.top) + 1 and top[tok] == -0.5
        for top, lp, tok in zip(legacy.top_logprobs, lps, legacy.tokens)
    )
    for k, offset in enumerate(legacy.text_offset):
        assert offset == len(tokenizer.decode(ids[:k]).rstrip("\ufffd"))


def test_api_key_is_checked(live: LiveServer) -> None:
    # A second app on the same engine; its loop never starts, which the auth check precedes.
    app = create_app(live.state.engine, api_key="sekrit")
    client = TestClient(app)
    assert_error(client.get("/v1/models"), 401)
    assert_error(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert client.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    assert client.get("/health").status_code != 401


# ----------------------------------------------------------------- metrics


def test_metrics_parse_and_count(http: httpx.Client) -> None:
    before = scrape(http)
    for _ in range(2):
        r = http.post(
            "/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        )
        assert r.status_code == 200
    wait_idle(http)
    after = scrape(http)
    key = ("ngrammar_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert after[key] - before.get(key, 0) == 2
    assert (
        after[("ngrammar_generation_tokens_total", ())] - before[("ngrammar_generation_tokens_total", ())]
        == 10
    )
    assert after[("ngrammar_prompt_tokens_total", ())] > before[("ngrammar_prompt_tokens_total", ())]
    assert after[("ngrammar_step_seconds_count", ())] > before[("ngrammar_step_seconds_count", ())]
    assert after[("ngrammar_requests_finished_total", (("finish_reason", "length"),))] >= 2
    assert after[("ngrammar_kv_cache_usage", ())] == 0.0
    assert after[("ngrammar_num_inflight", ())] == 0.0
    assert ("ngrammar_spec_accept_length_count", ()) in after
    assert ("ngrammar_queue_depth", ()) in after


def scrape(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_prefix_cache_hits_reach_usage_server_info_and_metrics(
    oai: openai.OpenAI, http: httpx.Client
) -> None:
    """A repeated long system prompt is served from the prefix cache: the second request's
    ``usage.prompt_tokens_details.cached_tokens``, /server_info's hit counts and the Prometheus
    counters say so."""
    system = "You answer questions about the solar system in one short sentence. " * 6
    before = scrape(http)
    usages = []
    for question in ("How far is Mars?", "How big is Jupiter?"):
        resp = oai.chat.completions.create(
            model="default",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
        )
        usages.append(resp.usage)
    first, second = usages
    assert first is not None and second is not None and second.prompt_tokens_details is not None
    assert second.prompt_tokens_details.cached_tokens >= 64  # the system prompt's full pages
    assert second.prompt_tokens_details.cached_tokens < second.prompt_tokens
    info = wait_idle(http)
    assert info["prefix_cache"]["enabled"] and info["prefix_cache"]["hit_tokens"] >= 64
    assert 0 < info["prefix_cache"]["hit_rate"] <= 1
    after = scrape(http)
    hits = after[("ngrammar_prefix_cache_hits_total", ())] - before.get(
        ("ngrammar_prefix_cache_hits_total", ()), 0
    )
    assert hits >= second.prompt_tokens_details.cached_tokens
    assert (
        after[("ngrammar_prefix_cache_queries_total", ())] >= after[("ngrammar_prefix_cache_hits_total", ())]
    )


def test_a_refused_draft_corpus_is_a_handled_400(live: LiveServer) -> None:
    """Regression (bug hunt): a DraftCorpusError (a bad name, a name taken, no document long
    enough) reached the catch-all handler outside the middleware: the client got its 400, but the
    server logged it as an unhandled error with two tracebacks and /metrics counted a 500 (and an
    in-process TestClient, which re-raises server errors, raised it)."""
    client = TestClient(create_app(live.state.engine))
    corpora = live.state.engine.ngram.proposer.corpora
    try:
        assert (
            client.post("/v1/draft_corpora", json={"name": "taken", "documents": ["a b c d"]}).status_code
            == 200
        )
        for body in (
            {"name": "a/b", "documents": ["a b c d"]},
            {"name": "taken", "documents": ["a b c d"]},
            {"name": "short", "documents": ["a"]},
        ):
            assert "draft corpus" in assert_error(client.post("/v1/draft_corpora", json=body), 400)["message"]
        counts = {
            s.labels["status"]: s.value
            for family in text_string_to_metric_families(client.get("/metrics").text)
            for s in family.samples
            if s.name == "ngrammar_http_requests_total" and s.labels.get("endpoint") == "/v1/draft_corpora"
        }
        assert counts == {"200": 1.0, "400": 3.0}
    finally:
        for name in corpora.names():
            corpora.remove(name)


def test_draft_corpus_endpoints_read_files_only_inside_the_configured_folder(
    live: LiveServer, tmp_path: Any
) -> None:
    """POST /v1/draft_corpora indexes documents from the body; a server file only from inside
    --draft-corpus-dir (a client must not index, and probe through speculation statistics, the
    server's other files). Bad bodies are 400s; DELETE of an unknown corpus is a 404."""
    from ngrammar.server.config import ServerConfig

    inside = tmp_path / "corpora"
    inside.mkdir()
    (inside / "units.txt").write_text("weight: 12 kg, count: 40 pcs, weight: 7 kg, count: 3 pcs")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for clients")
    closed = TestClient(create_app(live.state.engine))
    open_ = TestClient(create_app(live.state.engine, config=ServerConfig(draft_corpus_dir=str(inside))))
    corpora = live.state.engine.ngram.proposer.corpora
    try:
        assert (
            "draft-corpus-dir"
            in assert_error(closed.post("/v1/draft_corpora", json={"name": "u", "path": "units.txt"}), 403)[
                "message"
            ]
        )
        for path in ("../secret.txt", str(secret), "missing.txt"):
            assert_error(open_.post("/v1/draft_corpora", json={"name": "u", "path": path}), 400)
        assert corpora.names() == []
        r = open_.post("/v1/draft_corpora", json={"name": "units", "path": "units.txt"})
        assert r.status_code == 200, r.text
        r = closed.post("/v1/draft_corpora", json={"name": "docs", "documents": ["alpha beta gamma delta"]})
        assert r.status_code == 200, r.text
        assert [c["name"] for c in closed.get("/v1/draft_corpora").json()["data"]] == ["docs", "units"]
        assert_error(
            closed.post("/v1/draft_corpora", json={"name": "x", "documents": ["a b"], "replace": "yes"}), 400
        )
        assert_error(
            closed.post("/v1/draft_corpora", json={"name": "x", "documents": ["a b"], "extra": 1}), 400
        )
        assert closed.delete("/v1/draft_corpora/units").json() == {"name": "units", "removed": True}
        assert_error(closed.delete("/v1/draft_corpora/units"), 404)
    finally:
        for name in corpora.names():
            corpora.remove(name)
