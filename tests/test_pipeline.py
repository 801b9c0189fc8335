"""Pipelined verify steps: a verify step is left in flight and committed first thing by the next
engine step, while the trees for its likely outcome are drafted ahead (``pipeline_verify``).

On a CPU the forward is synchronous, so nothing overlaps, but the engine takes exactly the same
path as on a GPU: these tests check that it emits, token for token, what the step-by-step engine
emits (the trees drafted ahead are only taken where they are the trees drafting then would give),
and that the host work for step N + 1 comes between step N's launch and its read.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from device_events import device_events
from policy_pins import pin_step_costs

from ngrammar import LLM, SamplingParams
from ngrammar.outputs import RequestOutput

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
PROMPTS = [
    f"Repeat this code exactly:\n{CODE}",
    f"Copy:\n{CODE}\nNow copy it again:\n",
    "Tell me a short story about a cat.",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat sat on the mat.",
]
# The model copies this exactly, so whole draft paths are accepted and the trees drafted ahead hit.
COUNT = (
    "Count: " + ", ".join(str(i) for i in range(1, 21)) + ", " + ", ".join(str(i) for i in range(1, 13)) + ","
)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
    "additionalProperties": False,
}
KW: dict[str, Any] = dict(
    device="cpu", dtype="float32", speculative="ngram", num_draft_tokens=8, spec_policy="fixed"
)


@pytest.fixture(scope="module")
def pipe_llm() -> LLM:
    return LLM(kv_cache_tokens=16384, pipeline_verify=True, **KW)


@pytest.fixture(scope="module")
def step_llm() -> LLM:
    """Step by step, otherwise the same, and as fresh: both corpora see the same history, so both
    draft the same trees (the session's ``spec_llm`` has indexed earlier modules' text)."""
    return LLM(kv_cache_tokens=16384, pipeline_verify=False, **KW)


def _summary(outs: list[RequestOutput]) -> list[Any]:
    return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]


def _all_free(llm: LLM) -> bool:
    alloc = llm.engine.blocks.allocator
    alloc.check_integrity()
    return alloc.num_free == alloc.num_pages and llm.engine._in_flight is None


def test_pipelining_is_on_only_where_asked_or_with_overlap(step_llm: LLM, pipe_llm: LLM) -> None:
    assert not step_llm.engine.pipeline and pipe_llm.engine.pipeline


def test_greedy_pipelined_equals_step_by_step_and_plain(step_llm: LLM, pipe_llm: LLM, llm: LLM) -> None:
    """EOS, max_tokens, stop strings (cut inside accepted runs) and logprobs, members finishing at
    different steps; trees are drafted ahead while the verify forwards run."""
    params = [
        SamplingParams(max_tokens=48, temperature=0, logprobs=2),
        SamplingParams(max_tokens=40, temperature=0, stop=["mul"]),
        SamplingParams(max_tokens=30, temperature=0),
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
    ]
    stats = pipe_llm.engine.stats
    before = (stats.pipelined_steps, stats.prepared_trees, stats.prepared_hits)
    prompts = [*PROMPTS[:3], COUNT]
    got = pipe_llm.generate(prompts, params)
    assert stats.pipelined_steps > before[0] and stats.prepared_trees > before[1]
    # (How often a tree drafted ahead comes true is a speed figure: the benchmark reports it.)
    assert _summary(got) == _summary(step_llm.generate(prompts, params))
    assert [o.token_ids for o in got] == [o.token_ids for o in llm.generate(prompts, params)]
    assert got[1].outputs[0].finish_reason == "stop" and "mul" not in got[1].outputs[0].text
    assert _all_free(pipe_llm)


def test_seeded_sampling_pipelined_equals_step_by_step(step_llm: LLM, pipe_llm: LLM) -> None:
    """Tree sampling depends on the drafts: equal outputs say the trees were the same."""
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=7, n=2, logprobs=1)
    got = pipe_llm.generate(PROMPTS[:3], params)
    assert _summary(got) == _summary(step_llm.generate(PROMPTS[:3], params))
    assert _all_free(pipe_llm)


def test_grammar_pipelined_equals_step_by_step(step_llm: LLM, pipe_llm: LLM, llm: LLM) -> None:
    """The grammar terminates inside an accepted run (the closing brace then the stop token)."""
    source = '{"name": "Paris", "population": 2161000}'
    prompt = [{"role": "user", "content": f"Copy this JSON exactly: {source}\nAgain: {source}"}]
    params = SamplingParams(max_tokens=64, temperature=0, json_schema=SCHEMA)
    got = pipe_llm.chat([prompt, prompt], params)
    assert _summary(got) == _summary(step_llm.chat([prompt, prompt], params))
    assert [o.token_ids for o in got] == [o.token_ids for o in llm.chat([prompt, prompt], params)]
    assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].text.endswith("}")
    assert _all_free(pipe_llm)


def _drive(llm: LLM, joins: dict[int, str], abort_at: int) -> dict[str, RequestOutput]:
    """Step by hand: two requests, a third joining at step 4, the second aborted at step ``abort_at``."""
    eng = llm.engine
    params = SamplingParams(max_tokens=32, temperature=0)
    ids = [eng.add_request(PROMPTS[0], params, "first"), eng.add_request(PROMPTS[3], params, "doomed")]
    results: dict[str, RequestOutput] = {}
    for steps in range(1, 300):
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out
        if steps in joins:
            ids.append(eng.add_request(joins[steps], params, f"joined-{steps}"))
        if steps == abort_at:
            eng.abort("doomed")
        if not eng.has_unfinished():
            break
    assert set(results) == set(ids)
    return results


def test_arrivals_and_aborts_mid_flight(step_llm: LLM, pipe_llm: LLM) -> None:
    joins = {4: PROMPTS[1], 6: "Why is the sky blue?"}
    got = _drive(pipe_llm, joins, abort_at=5)
    want = _drive(step_llm, joins, abort_at=5)
    assert got["doomed"].outputs[0].finish_reason == "abort"
    # (The pipelined engine commits one verify step later: the abort cuts the doomed one elsewhere.)
    assert {k: v.outputs[0].token_ids for k, v in got.items() if k != "doomed"} == {
        k: v.outputs[0].token_ids for k, v in want.items() if k != "doomed"
    }
    assert _all_free(pipe_llm)


def test_preemption_under_a_tiny_pool() -> None:
    kw: dict[str, Any] = dict(KW, kv_cache_tokens=256, page_size=16, max_prefill_tokens=64)
    prompts = [f"Story number {i}: once upon a time, once upon a time" for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    pipe = LLM(**kw, pipeline_verify=True)
    got = [o.token_ids for o in pipe.generate(prompts, params)]
    assert pipe.engine.stats.pipelined_steps > 0
    assert got == [o.token_ids for o in LLM(**kw).generate(prompts, params)]
    assert _all_free(pipe)


def test_plain_chain_and_pipelined_verify_mix_losslessly(llm: LLM) -> None:
    """The adaptive policy with overlap: chained plain steps and pipelined verify steps in one stream."""
    mixed = LLM(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=16384,
        overlap_schedule=True,
        speculative="ngram",
        num_draft_tokens=8,
    )
    pin_step_costs(mixed)  # both kinds of step run whatever the machine's load
    assert mixed.engine.pipeline  # on with overlap
    params = SamplingParams(max_tokens=48, temperature=0)
    got = mixed.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in llm.generate(PROMPTS, params)]
    stats = mixed.engine.stats
    assert stats.pipelined_steps > 0 and stats.chained_steps > 0
    assert _all_free(mixed)


def test_the_next_trees_are_drafted_between_a_launch_and_its_read(pipe_llm: LLM, step_llm: LLM) -> None:
    """Each verify launch is preceded by one read only, the previous step's, and the trees for
    step N + 1 are drafted after step N's launch and before its read (where on a GPU its
    forward runs); the step-by-step engine reads each step back before drafting anything."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    worker = pipe_llm.engine.ngram
    assert worker is not None
    stamps: list[tuple[str, float]] = []
    worker.on_prepare = lambda: stamps.append(("prepare", time.perf_counter()))
    hits = pipe_llm.engine.stats.prepared_hits
    try:
        with device_events(pipe_llm.engine.runner) as events:
            runner = pipe_llm.engine.runner
            forward, read = runner.on_forward, runner.on_to_host
            assert forward is not None and read is not None
            runner.on_forward = lambda: (forward(), stamps.append(("forward", time.perf_counter())))  # type: ignore[func-returns-value]
            runner.on_to_host = lambda: (read(), stamps.append(("read", time.perf_counter())))  # type: ignore[func-returns-value]
            pipe_llm.generate(COUNT, params)
    finally:
        worker.on_prepare = None
    assert pipe_llm.engine.stats.prepared_hits > hits
    kinds = [k for k, _ in stamps]
    assert kinds[:2] == ["forward", "read"]  # the prefill, then one verify step after another
    verify = kinds[2:]
    # forward N, prepare N + 1, read N; then forward N + 1: never a read between a read and a launch
    assert verify == ["forward", "prepare", "read"] * (len(verify) // 3) and len(verify) >= 6
    times = [t for _, t in stamps]
    assert times == sorted(times)
    assert events.count("read") == events.count("forward")
    with device_events(step_llm.engine.runner) as events:
        step_llm.generate(COUNT, params)
    assert events == ["forward", "read"] * (len(events) // 2)  # step by step: nothing drafted ahead


def test_at_parity_with_plain_the_policy_verifies_whenever_a_draft_exists() -> None:
    """A pipelined verify step can cost about a plain step: then each member with a draft is worth
    a verify step, however rarely its drafts are accepted; without a draft it is not."""
    from ngrammar.speculative.policy import AdaptiveDraftPolicy

    def run(verify_cost: float, length: int) -> list[tuple[int, str]]:
        policy, out = AdaptiveDraftPolicy(8), []
        for _ in range(60):  # drafts are never accepted
            w = policy.choose(["a"], lambda: [length])
            policy.observe(1, w, 0.010 if w == 1 else verify_cost, None if w == 1 else {"a": 0})
            out.append((w, policy.reason))
        return out[-30:]

    at_par = run(0.0102, 1)
    assert sum(w > 1 for w, _ in at_par) >= 24 and "parity" in {r for _, r in at_par}
    assert all(w > 1 or r == "baseline" for w, r in at_par)  # plain only to re-time plain
    assert all(w == 1 for w, _ in run(0.0102, 0))  # no draft: plain
    assert sum(w > 1 for w, _ in run(0.013, 1)) <= 6  # 1.3 plain steps for rejected drafts: plain
