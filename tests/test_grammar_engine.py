"""Grammar-constrained generation in the engine, plain and under NGRAM speculation."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from device_events import device_events

from ngrammar import LLM, SamplingParams

REGEXES = [
    (r"^user@example\.com$", "What is the example user's email address?"),
    (r"^(Hello|Hi|Hey)$", "Greet me with one word."),
    (r"^\d{3}$", "Give me a three digit number."),
    (r"^\(\d{3}\) \d{3}-\d{4}$", "Give me a US phone number."),
    (r"^2024-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$", "Give me a date in 2024."),
    (r"^#[0-9A-F]{6}$", "Give me a hex colour code."),
    (r'^\{"name": "[A-Za-z]+", "age": \d{1,3}, "city": "[A-Za-z ]+"\}$', "Describe a person as JSON."),
    (r"^\[(INFO|WARN|ERROR)\] \d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} - [A-Za-z ]{1,40}$", "Write one log line."),
]
CITY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": r"^[\w]+$"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
    "additionalProperties": False,
}
CITY_PROMPT = [
    {
        "role": "user",
        "content": "Paris is the capital of France; 2161000 people live there. "
        "Give the city's name and population as JSON.",
    }
]


def _chat(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


@pytest.fixture(params=["plain", "spec"])
def engine_llm(request, llm: LLM, spec_llm: LLM) -> LLM:  # type: ignore[no-untyped-def]
    return llm if request.param == "plain" else spec_llm


def test_regex_outputs_match(engine_llm: LLM) -> None:
    convs = [_chat(q) for _, q in REGEXES]
    greedy = [SamplingParams(max_tokens=64, temperature=0, regex=r) for r, _ in REGEXES]
    sampled = [SamplingParams(max_tokens=64, temperature=0.5, n=3, seed=3, regex=r) for r, _ in REGEXES]
    outs = engine_llm.chat(convs + convs, greedy + sampled)  # one batch: greedy and sampled members
    for (pattern, _), g, s in zip(REGEXES, outs[: len(REGEXES)], outs[len(REGEXES) :]):
        for c in g.outputs + s.outputs:
            assert c.text.strip() and re.match(pattern, c.text.strip()), (pattern, c.text)
            assert c.finish_reason == "stop"


def test_json_schema_outputs_validate(engine_llm: LLM) -> None:
    greedy, sampled = engine_llm.chat(  # one batch: the schema as a dict and as its JSON text
        [CITY_PROMPT, CITY_PROMPT],
        [
            SamplingParams(max_tokens=64, temperature=0, json_schema=CITY_SCHEMA),
            SamplingParams(max_tokens=64, temperature=0.5, n=3, seed=1, json_schema=json.dumps(CITY_SCHEMA)),
        ],
    )
    for c in greedy.outputs + sampled.outputs:
        obj = json.loads(c.text)
        jsonschema.validate(obj, CITY_SCHEMA)
        assert isinstance(obj["name"], str) and isinstance(obj["population"], int)


GRAMMARS = [
    dict(json_schema=CITY_SCHEMA),
    dict(json_object=True),
    dict(regex=REGEXES[6][0]),
    dict(regex=REGEXES[7][0]),
    dict(regex=r"(apples|bananas|cherries)(, (apples|bananas|cherries)){2,5}"),
    dict(ebnf='root ::= "The answer is " [0-9]+ "."'),
    dict(json_schema={"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4}),
]
GRAMMAR_PROMPTS = [
    CITY_PROMPT,
    _chat("Describe the fruit list apples, bananas, cherries as a JSON object with a key 'fruits'."),
    _chat("Describe Alice, 34, from Paris as JSON with name, age and city."),
    _chat("Write one log line saying the server started."),
    _chat("Repeat: apples, bananas, cherries, apples, bananas"),
    _chat("What is 6 times 7?"),
    _chat("List the fruits apples, bananas, cherries as a JSON array."),
]


def test_greedy_grammar_output_identical_with_and_without_speculation(llm: LLM, spec_llm: LLM) -> None:
    params = [SamplingParams(max_tokens=48, temperature=0, **g) for g in GRAMMARS]  # type: ignore[arg-type]
    plain = llm.chat(GRAMMAR_PROMPTS, params)
    spec = spec_llm.chat(GRAMMAR_PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.finish_reason in ("stop", "length") for o in plain)
    assert spec_llm.engine.stats.verify_steps > 0


def test_forty_mixed_requests(spec_llm: LLM) -> None:
    convs, params = [], []
    for i in range(40):
        if i % 2:
            convs.append(CITY_PROMPT)
            params.append(
                SamplingParams(
                    max_tokens=48, temperature=0 if i % 4 == 1 else 0.7, seed=i, json_schema=CITY_SCHEMA
                )
            )
        else:
            convs.append(_chat(f"Say something about the number {i}."))
            params.append(SamplingParams(max_tokens=12, temperature=0.7, seed=i))
    outs = spec_llm.chat(convs, params)
    for i, o in enumerate(outs):
        assert o.finished and o.outputs[0].error is None
        if i % 2:
            jsonschema.validate(json.loads(o.text), CITY_SCHEMA)
    alloc = spec_llm.engine.blocks.allocator
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_pages


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(json_schema="INVALID"), "invalid JSON schema"),
        (dict(json_schema={"type": "nonsense"}), "invalid JSON schema"),
        (dict(regex="(abc"), "invalid regex"),
        (dict(ebnf="root ::= ("), "invalid EBNF"),
        # Regression: grammars allowing no first token failed inside the engine (token 0 sampled).
        (dict(regex=r"[^\s\S]"), "matches no text"),
        (dict(ebnf="root ::= [^\\x00-\\U0010FFFF]"), "matches no text"),
    ],
)
def test_bad_grammar_fails_that_request(spec_llm: LLM, kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    from ngrammar.grammar import GrammarError

    with pytest.raises(GrammarError, match=message):
        spec_llm.generate("Hello", SamplingParams(max_tokens=4, **kwargs))
    ok = spec_llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))[0]
    assert ok.finished and len(ok.token_ids) >= 1


@pytest.mark.parametrize("which", ["plain", "ngram"])
def test_a_grammar_dead_end_says_so(llm: LLM, spec_llm: LLM, which: str) -> None:
    """A grammar can reach a state no token continues ("a" under ``a[^\\s\\S]``): every logit is
    masked there, and the request must end with an error that says why, not "rejected token 0"."""
    engine = llm if which == "plain" else spec_llm
    out = engine.generate(
        "Say a", SamplingParams(max_tokens=8, temperature=0, regex=r"a[^\s\S]", logprobs=2)
    )[0]
    assert out.outputs[0].finish_reason == "error" and out.text == "a"
    assert "no text can complete it" in (out.outputs[0].error or "") and out.outputs[0].request_error
    # (Review: the token drawn from the all-masked row, with NaN logprobs, stayed in the output,
    # and then in the streamed outputs until the next step.)
    assert out.token_ids == engine.tokenizer.encode("a") and len(out.outputs[0].logprobs or []) == 1
    eng = engine.engine
    rid = eng.add_request(
        "Say a", SamplingParams(max_tokens=8, temperature=0, regex=r"a[^\s\S]"), stream=True
    )
    streamed = []
    while eng.has_unfinished():
        streamed += [o.token_ids for o in eng.step() if o.request_id == rid]
    assert streamed and all(ids == engine.tokenizer.encode("a")[: len(ids)] for ids in streamed), streamed
    assert engine.generate("Hello", SamplingParams(max_tokens=2, temperature=0))[0].finished


def test_two_grammars_at_once_is_refused() -> None:
    from ngrammar import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="only one of"):
        SamplingParams(regex="a+", json_schema=CITY_SCHEMA)


def test_no_device_read_before_the_verify_launch(spec_llm: LLM) -> None:
    """The spec+grammar step launches the verify forward before any device->host read."""
    eng = spec_llm.engine
    with device_events(eng.runner, "to_host") as events:
        spec_llm.chat(CITY_PROMPT, SamplingParams(max_tokens=24, temperature=0, json_schema=CITY_SCHEMA))
        verify_steps = _split_steps(events)
        assert verify_steps and all(step == ["forward", "to_host"] for step in verify_steps)
        events.clear()
        assert eng.ngram is not None
        eng.ngram.readback_links = True  # the benchmark switch: the old readback path must show up
        try:
            spec_llm.chat(CITY_PROMPT, SamplingParams(max_tokens=8, temperature=0, json_schema=CITY_SCHEMA))
        finally:
            eng.ngram.readback_links = False
        assert ["to_host", "forward", "to_host"] in _split_steps(events)


def _split_steps(events: list[str]) -> list[list[str]]:
    """Group events into steps: every step ends with its one result read (the last to_host)."""
    steps, current = [], []
    for e in events:
        current.append(e)
        if e == "to_host" and current.count("forward") == 1:
            steps.append(current)
            current = []
    return steps


def test_a_grammar_rejecting_a_committed_token_fails_only_its_request(engine_llm: LLM) -> None:
    """Plain steps hand sampled tokens to the grammar after the next launch (a verify step's
    grammar DFS settles them too); should one be rejected there (an engine bug: it was drawn under
    that grammar's mask), its request ends with an error and the rest of the batch carries on."""
    eng = engine_llm.engine
    bad = eng.add_request(CITY_PROMPT, SamplingParams(max_tokens=16, temperature=0, json_schema=CITY_SCHEMA))
    good = eng.add_request(CITY_PROMPT, SamplingParams(max_tokens=16, temperature=0, json_schema=CITY_SCHEMA))
    while not any(s.num_output_tokens for s in eng.requests[bad].seqs):
        eng.step()
    eng.requests[bad].seqs[0].grammar.accept_masked(eng.tokenizer.encode("]]")[0])  # never valid here
    outs: dict[str, object] = {}
    while eng.has_unfinished():
        for out in eng.step():
            outs[out.request_id] = out
    failed, fine = outs[bad].outputs[0], outs[good].outputs[0]  # type: ignore[attr-defined]
    assert failed.finish_reason == "error" and "grammar rejected" in failed.error
    assert fine.finish_reason in ("stop", "length") and fine.error is None
    assert eng.blocks.allocator.num_free == eng.blocks.allocator.num_pages  # nothing leaked


def test_a_sequence_finishing_with_deferred_tokens_has_them_checked(llm: LLM) -> None:
    """A plain step's token reaches the grammar at the next step; a sequence that finishes first
    (max_tokens, a stop string, EOS) must still have it checked before its output is final."""
    eng = llm.engine
    rid = eng.add_request(CITY_PROMPT, SamplingParams(max_tokens=16, temperature=0, json_schema=CITY_SCHEMA))
    seq = eng.requests[rid].seqs[0]
    while not seq.num_output_tokens:
        eng.step()
    seq.grammar.accept_masked(eng.tokenizer.encode("]]")[0])  # as if a forbidden token had been drawn
    seq.finish("length")
    assert seq.finish_reason == "error" and "grammar rejected" in (seq.error or "")
    while eng.has_unfinished():
        eng.step()


def test_grammar_pruning_keeps_outputs_and_calls_off_hopeless_verify_steps(llm: LLM, spec_llm: LLM) -> None:
    """Constrained trees lose the drafts their grammar forbids before the launch: the output is
    plain decoding's, a step whose drafts are all forbidden runs as a plain step, and pruned trees
    are verified at a narrower width. Here the prompt's lowercase words are what the corpus
    drafts, and the grammar allows only capitals."""
    eng = spec_llm.engine
    assert eng.ngram is not None
    prompts = [_chat("Repeat exactly: apples, bananas, cherries, apples, bananas, cherries"), CITY_PROMPT]
    params = [
        SamplingParams(
            max_tokens=32, temperature=0, regex=r"(APPLES|BANANAS|CHERRIES)(, (APPLES|BANANAS|CHERRIES)){2,5}"
        ),
        SamplingParams(max_tokens=32, temperature=0, json_schema=CITY_SCHEMA),
    ]
    st = eng.stats
    vetoed, pruned = st.vetoed_steps, st.grammar_pruned_nodes
    eng.step_trace = trace = []
    try:
        spec = [spec_llm.chat(p, q)[0] for p, q in zip(prompts, params)]  # one at a time: batch 1
    finally:
        eng.step_trace = None
    plain = llm.chat(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec[0].text.startswith("APPLES")
    assert st.vetoed_steps > vetoed and st.grammar_pruned_nodes > pruned
    widths = {r.width for r in trace if r.kind == "verify"}
    assert widths and min(widths) < eng.ngram.config.num_draft_tokens  # fixed D = 8, pruned narrower
    alloc = eng.blocks.allocator
    assert alloc.num_free == alloc.num_pages
