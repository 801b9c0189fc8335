"""Plain steps chained out of verify steps: the next plain step is launched from a pipelined verify
step's device result (bonus tokens, positions moved on by the accepted lengths) before the host
reads it (``LLMEngine._chain_out_of_verify``).

The threshold policy verifies where a match exists and decodes plainly elsewhere, so a stream
mixes both kinds of step; on a CPU the engine takes the GPU's path (overlap scheduling and
pipelined verify forced on), eagerly or through the graph runner's static buffers.
"""

from __future__ import annotations

from typing import Any

import pytest
from device_events import device_events
from test_pipeline import CODE, SCHEMA

from ngrammar import LLM, SamplingParams
from ngrammar.outputs import RequestOutput

PROMPTS = [
    f"Repeat this code exactly:\n{CODE}",
    "Tell me a short story about a cat.",
    f"Copy:\n{CODE}\nNow copy it again:\n",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat sat on the mat.",
]
SPEC: dict[str, Any] = dict(
    device="cpu",
    dtype="float32",
    kv_cache_tokens=16384,
    speculative="ngram",
    num_draft_tokens=8,
    spec_policy="threshold",
    chain_verify=True,
)


def _chained(static: bool) -> LLM:
    llm = LLM(**SPEC, overlap_schedule=True, pipeline_verify=True)
    if static:
        llm.engine.enable_cuda_graphs(capture=False)  # the CUDA-graph path, run eagerly
    assert llm.engine.chain_verify
    return llm


@pytest.fixture(scope="module")
def chained() -> LLM:
    return _chained(static=True)


def _ids(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _all_free(llm: LLM) -> bool:
    alloc = llm.engine.blocks.allocator
    alloc.check_integrity()
    return alloc.num_free == alloc.num_pages and llm.engine._in_flight is None


GREEDY = SamplingParams(max_tokens=40, temperature=0)


@pytest.fixture(scope="module")
def plain_greedy(llm: LLM) -> list[list[int]]:
    """The plain engine's greedy outputs for PROMPTS, which both variants below must equal."""
    return _ids(llm.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static buffers"])
def test_greedy_chained_out_of_verify_equals_plain(
    static: bool, chained: LLM, plain_greedy: list[list[int]]
) -> None:
    chained = chained if static else _chained(static=False)
    before = chained.engine.stats.chained_out_of_verify
    got = chained.generate(PROMPTS, GREEDY)
    assert chained.engine.stats.chained_out_of_verify > before
    assert _ids(got) == plain_greedy
    assert _all_free(chained)


def _same_steps_unchained(llm: LLM) -> None:
    """Make ``llm`` take the chained engine's steps one after another: where it would chain a plain
    step out of a verify step, it commits the verify step first and then launches the plain step
    from committed state (a seeded sample depends on the kind of step that draws it, so only the
    same steps can be compared token for token)."""
    eng = llm.engine

    def commit_then_plain() -> bool:
        flight = eng._in_flight
        assert flight is not None
        if not eng.speculator.chain_after_verify(flight.seqs):
            return False
        chain = eng._chainable(flight.seqs, ahead=flight.width, reserve=flight.width + 1, plain=True)
        if chain is None:
            return False
        eng._in_flight = None
        eng._commit_verify(flight)  # type: ignore[arg-type]
        live = [s for s in chain[1] if not s.is_finished]
        if not live or not eng.scheduler.reserve_decode(live, 1):
            return False  # (committed: the step goes on from committed state)
        eng._run_decode(live, None)
        return True

    eng._chain_out_of_verify = commit_then_plain  # type: ignore[method-assign]


def test_seeded_sampling_and_logprobs_equal_the_same_steps_unchained() -> None:
    """Two fresh engines (the same corpus history, so the same drafts and the same steps)."""
    params = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=i, logprobs=2) for i in range(3)]
    chained, unchained = _chained(static=True), _chained(static=True)
    _same_steps_unchained(unchained)
    before = chained.engine.stats.chained_out_of_verify
    got, want = chained.generate(PROMPTS[1:], params), unchained.generate(PROMPTS[1:], params)
    assert chained.engine.stats.chained_out_of_verify > before
    assert [(c.token_ids, c.logprobs) for o in got for c in o.outputs] == [
        (c.token_ids, c.logprobs) for o in want for c in o.outputs
    ]
    assert _all_free(chained)


def test_grammar_stops_and_short_budgets_equal_plain(chained: LLM, llm: LLM) -> None:
    """Runs cut inside an accepted run (a stop string, max_tokens, the grammar's end) finish the
    member while a chained step is in flight for it: its token is dropped, its pages freed."""
    params = [
        SamplingParams(max_tokens=60, temperature=0, json_schema=SCHEMA),
        SamplingParams(max_tokens=40, temperature=0, stop=["b):"]),
        SamplingParams(max_tokens=7, temperature=0),
    ]
    prompts = ["Give the name and population of Paris as JSON.", *PROMPTS[:2]]
    before = chained.engine.stats.chained_out_of_verify
    got = chained.generate(prompts, params)
    assert chained.engine.stats.chained_out_of_verify > before
    want = llm.generate(prompts, params)
    assert [(c.token_ids, c.text, c.finish_reason) for o in got for c in o.outputs] == [
        (c.token_ids, c.text, c.finish_reason) for o in want for c in o.outputs
    ]
    assert _all_free(chained)


def test_chaining_out_of_verify_is_off_by_default() -> None:
    assert not LLM(**{**SPEC, "chain_verify": False}, overlap_schedule=True).engine.chain_verify
    from ngrammar.config import EngineConfig

    assert EngineConfig().chain_verify is False


def arrivals_aborts_and_preemption(llm: LLM, spec: dict[str, Any]) -> LLM:
    """A small KV pool (preemption), a late arrival and an abort mid-run on an engine of ``spec``:
    every request's tokens equal plain decoding's (``llm``), every page is free after. Returns the
    engine, for its counters."""
    tiny = LLM(
        **{**spec, "kv_cache_tokens": 512},
        page_size=16,
        max_prefill_tokens=64,
        overlap_schedule=True,
        pipeline_verify=True,
    )
    eng = tiny.engine
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ids = [eng.add_request(p, params, f"r{i}") for i, p in enumerate(PROMPTS)]
    done: dict[str, RequestOutput] = {}
    for step in range(1, 2000):
        done.update({o.request_id: o for o in eng.step() if o.finished})
        if step == 6:
            ids.append(eng.add_request(PROMPTS[2], params, "late"))
        if step == 9:
            eng.abort("r1")
        if not eng.has_unfinished():
            break
    assert set(done) == set(ids) and done["r1"].outputs[0].finish_reason == "abort"
    keep = [i for i in ids if i != "r1"]
    prompts = [*PROMPTS, PROMPTS[2]]
    want = llm.generate([prompts[ids.index(i)] for i in keep], params)
    assert [done[i].outputs[0].token_ids for i in keep] == _ids(want)
    assert _all_free(tiny)
    assert eng.ngram is not None and not eng.ngram.ran_to_leaf  # nothing kept past a finish
    return tiny


def test_arrivals_aborts_and_preemption(llm: LLM) -> None:
    assert arrivals_aborts_and_preemption(llm, SPEC).engine.stats.chained_out_of_verify > 0


def test_no_read_between_a_verify_launch_and_the_next_launch(chained: LLM) -> None:
    """Where a plain step is chained out of a verify step, the verify step's result is read only
    after the plain step was launched: forward (verify), forward (chained), then its read."""
    eng = chained.engine
    params = SamplingParams(max_tokens=32, temperature=0)
    marks: list[str] = []
    launch = eng._chain_out_of_verify

    def traced() -> bool:
        marks.append("chain?")
        return launch()

    eng._chain_out_of_verify = traced  # type: ignore[method-assign]
    try:
        with device_events(eng.runner) as events:
            runner = eng.runner
            forward, read = runner.on_forward, runner.on_to_host
            assert forward is not None and read is not None
            runner.on_forward = lambda: (forward(), marks.append("forward"))  # type: ignore[func-returns-value]
            runner.on_to_host = lambda: (read(), marks.append("read"))  # type: ignore[func-returns-value]
            before = eng.stats.chained_out_of_verify
            chained.generate(PROMPTS[1:3], params)
    finally:
        del eng._chain_out_of_verify
    assert eng.stats.chained_out_of_verify > before and events
    # A chain that launched: its forward, then the verify result's read; one that did not: the read
    # (the drain), then the scheduled step's forward.
    seen = sum(m == "chain?" and marks[i + 1 : i + 3] == ["forward", "read"] for i, m in enumerate(marks))
    assert seen == eng.stats.chained_out_of_verify - before > 0
