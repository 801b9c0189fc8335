"""Overlap scheduling: a plain decode step launches before the previous one is read back.

On a CPU the forward is synchronous, so nothing overlaps, but the engine takes exactly the same
path as on a GPU (``overlap_schedule=True``): these tests check that it loses, duplicates and
reorders nothing against the engine that commits every step before the next launch.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from device_events import device_events
from policy_pins import pin_step_costs

from ngrammar import LLM, SamplingParams
from ngrammar.outputs import RequestOutput
from ngrammar.speculative.acceptance import SeqBias
from ngrammar.speculative.policy import MAX_MATCH, AdaptiveDraftPolicy, bucket_of

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "List three colors:",
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": r"^[\w]+$"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def overlap_llm() -> LLM:
    return LLM(device="cpu", dtype="float32", kv_cache_tokens=16384, overlap_schedule=True)


def _summary(outs: list[RequestOutput]) -> list[Any]:
    return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]


def test_overlap_is_on_by_default_only_on_cuda(llm: LLM, overlap_llm: LLM) -> None:
    assert not llm.engine.overlap and overlap_llm.engine.overlap


def test_greedy_outputs_equal_the_step_by_step_engine(llm: LLM, overlap_llm: LLM) -> None:
    """EOS, max_tokens, stop strings and logprobs, in one batch whose members finish at different steps."""
    params = [
        SamplingParams(max_tokens=40, temperature=0),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0, stop=[","]),
        SamplingParams(max_tokens=1, temperature=0),
    ]
    before = overlap_llm.engine.stats.chained_steps
    got = overlap_llm.generate(PROMPTS, params)
    assert overlap_llm.engine.stats.chained_steps > before
    assert _summary(got) == _summary(llm.generate(PROMPTS, params))


def test_seeded_sampling_equals_the_step_by_step_engine(llm: LLM, overlap_llm: LLM) -> None:
    """Sampling offsets come from committed lengths: a chained step must draw the same coins."""
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=5, n=2, ignore_eos=True)
    assert _summary(overlap_llm.generate(PROMPTS[:2], params)) == _summary(llm.generate(PROMPTS[:2], params))


def test_a_chained_step_launches_before_the_read_of_the_step_before(overlap_llm: LLM) -> None:
    with device_events(overlap_llm.engine.runner) as events:
        out = overlap_llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[
            0
        ]
    assert len(out.token_ids) == 12
    # prefill, then 11 decode steps: every token is read exactly once, and every decode step, the
    # first included, launches its forward while the step before is still unread.
    assert events.count("read") == 12 and events.count("forward") == 12
    assert events[:5] == ["forward", "forward", "read", "forward", "read"]


def test_a_step_left_in_flight_by_a_finished_batch_is_dropped(overlap_llm: LLM) -> None:
    """When the batch ends on EOS while its next step runs, that step is dropped at once: it must
    not wait for the next request (its drain would time the idle gap as a step)."""
    eng = overlap_llm.engine
    out = overlap_llm.generate("Say hi.", SamplingParams(max_tokens=200, temperature=0))[0]
    assert out.finish_reason == "stop" and eng.stats.chained_steps > 0
    assert eng._in_flight is None
    # A member ending on EOS while the other runs on: the step in flight is drained with it
    # finished, and its dropped token is not counted as decoded.
    before = eng.stats.decode_tokens
    outs = overlap_llm.generate(
        ["Say hi.", "Count to fifty:"],
        [
            SamplingParams(max_tokens=200, temperature=0),
            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        ],
    )
    assert outs[0].outputs[0].finish_reason == "stop" and len(outs[0].token_ids) < len(outs[1].token_ids)
    assert eng.stats.decode_tokens - before == sum(
        len(o.token_ids) - 1 for o in outs
    )  # the first is prefill's


@pytest.mark.parametrize("sampled", [False, True])
def test_members_that_finish_leave_the_chain_without_breaking_it(
    llm: LLM, overlap_llm: LLM, sampled: bool
) -> None:
    """A member whose token in flight is its last (max_tokens), or that ended on a stop string while
    its next token was in flight, is left out of the next launch; the others go on chained (each
    such drain cost about half a step on the H200). Seeded sampling and logprobs come out as in the
    step-by-step engine."""
    eng = overlap_llm.engine
    extra = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "logprobs": 2} if sampled else {"temperature": 0}
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **extra) for n in (4, 9, 6)]
    params.insert(2, SamplingParams(max_tokens=40, stop=[",", ".", " a "], **extra))
    before = eng.stats.decode_tokens
    eng.step_trace = trace = []
    try:
        got = overlap_llm.generate(PROMPTS, params)
    finally:
        eng.step_trace = None
    want = llm.generate(PROMPTS, params)
    # Tokens, text and finish reasons are exact; logprobs within fp32 noise: the step after the
    # stop runs one row more than the step-by-step engine's (the stopped member's token in flight).
    assert [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in got] == [
        [(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in want
    ]
    for a, b in zip(got, want):
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert x.top[0][0] == y.top[0][0] and x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert got[2].outputs[0].finish_reason == "stop" and len(got[2].token_ids) < 40  # ended mid-batch
    if trace[-1].kind == "idle":  # the last member ended at max_tokens (drained), not on a stop
        trace.pop()
    kinds = [r.kind for r in trace]
    # Every decode step is chained, the first after prefill included; the batch shrinks.
    assert kinds[0] == "prefill" and set(kinds[1:]) == {"chain"}
    sizes = [r.batch_size for r in trace[1:]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 4 and sizes[-1] == 1
    assert eng.stats.decode_tokens - before == sum(len(o.token_ids) - 1 for o in got)
    assert eng._in_flight is None and not eng.scheduler.running


def test_members_reaching_max_tokens_leave_one_at_a_time() -> None:
    """The exact launch sizes when members end at 4, 9, 6 and 13 tokens."""
    overlap = LLM(device="cpu", dtype="float32", kv_cache_tokens=4096, overlap_schedule=True)
    eng = overlap.engine
    eng.step_trace = trace = []
    overlap.generate(
        PROMPTS, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 9, 6, 13)]
    )
    assert [r.kind for r in trace] == ["prefill"] + ["chain"] * 12 + ["idle"]
    assert [r.batch_size for r in trace[1:-1]] == [4, 4, 4, 3, 3, 2, 2, 2, 1, 1, 1, 1]


def test_a_member_leaving_lets_a_waiting_request_in_at_once(llm: LLM) -> None:
    """Under load a member that finishes frees a slot: the next request takes it in the step
    launched while that member's last token is in flight (a chained mixed step), not one step
    later, and without draining the chain."""
    capped = LLM(
        device="cpu", dtype="float32", kv_cache_tokens=4096, overlap_schedule=True, max_running_requests=2
    )
    eng = capped.engine
    eng.step_trace = trace = []
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 8, 4)]
    got = capped.generate(PROMPTS[:3], params)
    # The first member's last token is in flight at the third chained step: it carries the second
    # member's decode row and the third request's prompt.
    assert [r.kind for r in trace] == ["prefill"] + ["chain"] * 7 + ["idle"]
    assert [r.batch_size for r in trace[:-1]] == [2] * 7 + [1] and eng.stats.mixed_steps == 1
    assert [o.token_ids for o in got] == [o.token_ids for o in llm.generate(PROMPTS[:3], params)]


def test_a_full_batch_keeps_chaining_while_requests_wait(llm: LLM) -> None:
    """Requests that cannot be admitted (the batch is at max_running_requests) do not stop overlap."""
    capped = LLM(
        device="cpu", dtype="float32", kv_cache_tokens=16384, overlap_schedule=True, max_running_requests=2
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = capped.generate(PROMPTS, params)
    assert capped.engine.stats.chained_steps >= 2 * 8  # the first two pairs chain while others wait
    assert [o.token_ids for o in got] == [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_a_full_kv_pool_keeps_chaining_while_requests_wait(llm: LLM) -> None:
    """A request the pool has no room for (here one preempted when the pool ran out, which waits
    until its whole context fits) does not stop overlap: each drain would only schedule the same
    batch again. Before, every step of the two running requests drained (21 chained steps)."""
    small = LLM(device="cpu", dtype="float32", kv_cache_tokens=64, page_size=16, overlap_schedule=True)
    prompts = ["Once upon a time there", "The capital of France", "List three colors:"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got = small.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in llm.generate(prompts, params)]
    assert small.engine.stats.chained_steps >= 28


def test_requests_joining_and_aborting_mid_flight(llm: LLM, overlap_llm: LLM) -> None:
    """A request joining or aborting while a step is in flight drains it; nothing is lost or leaked."""
    eng = overlap_llm.engine
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    decoded = eng.stats.decode_tokens
    first = eng.add_request("Tell me about the moon.", params)
    doomed = eng.add_request("Write a long poem about the sea.", params)
    results: dict[str, RequestOutput] = {}
    second = None
    for steps in range(1, 200):
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out
        if steps == 4:
            second = eng.add_request("Why is the sky blue?", params)
        if steps == 7:
            eng.abort(doomed)
        if not eng.has_unfinished():
            break
    assert second is not None and results[doomed].finish_reason == "abort"
    assert results[first].token_ids == llm.generate("Tell me about the moon.", params)[0].token_ids
    assert results[second].token_ids == llm.generate("Why is the sky blue?", params)[0].token_ids
    assert eng.blocks.allocator.num_free == eng.blocks.allocator.num_pages
    # decode tokens are those committed (each request's first came from its prefill)
    assert eng.stats.decode_tokens - decoded == sum(len(o.token_ids) - 1 for o in results.values())


def test_grammar_under_overlap_equals_the_step_by_step_engine(llm: LLM, overlap_llm: LLM) -> None:
    """The next step's grammar row needs the token in flight: it is committed before sampling.
    Each step's forward is launched before its rows are settled and filled (on a GPU the host's
    grammar work runs while the device computes), and a chained step's rows after the read of
    the step before."""
    prompt = [{"role": "user", "content": "Paris has 2161000 people. Give name and population as JSON."}]
    params = SamplingParams(max_tokens=48, temperature=0, json_schema=SCHEMA)
    rows = overlap_llm.engine.grammar_rows
    with device_events(overlap_llm.engine.runner) as events:
        fill = rows.apply_plain
        rows.apply_plain = lambda *a: (events.append("fill"), fill(*a))[1]  # type: ignore[method-assign]
        try:
            got = overlap_llm.chat([prompt, prompt], params)
        finally:
            del rows.apply_plain
    assert _summary(got) == _summary(llm.chat([prompt, prompt], params))
    assert got[0].outputs[0].finish_reason == "stop"
    launches = [e for e in events if e != "read"]
    assert launches == ["forward", "fill"] * (len(launches) // 2)  # one fill per forward, after it
    trace = "".join({"forward": "F", "read": "r", "fill": "m"}[e] for e in events)
    # chained: forward, the read of the step before, then the rows
    assert trace.count("Frm") >= len(got[0].outputs[0].token_ids) - 3


def test_ngram_with_overlap_is_lossless() -> None:
    """The adaptive policy decides a chained step from the committed tokens (one behind); verify
    steps drain the step in flight first. Greedy output stays identical to plain decoding."""
    plain = LLM(device="cpu", dtype="float32", kv_cache_tokens=16384)
    spec = LLM(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=16384,
        overlap_schedule=True,
        speculative="ngram",
        num_draft_tokens=8,
    )
    pin_step_costs(spec)  # both kinds of step run whatever the machine's load
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    prompts = [
        f"Repeat this code exactly:\n{text}",
        "Tell me a short story about a cat.",
        f"Copy:\n{text}\nNow copy it again:\n",
    ]
    params = SamplingParams(max_tokens=48, temperature=0)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, params)]
    stats = spec.engine.stats
    assert stats.spec_steps > 0 and stats.chained_steps > 0  # both kinds of step ran
    assert stats.shadow_samples > 0  # plain steps taught the policy through shadow drafts ...
    assert (
        spec.engine.ngram is not None and len(spec.engine.ngram.upkeep.shadows) == 0
    )  # ... and none outlives its request
    assert spec.engine.blocks.allocator.num_free == spec.engine.blocks.allocator.num_pages


def test_preemption_under_a_tiny_pool_with_overlap() -> None:
    """A chained step reserves KV without preempting; when that fails it drains and schedules."""
    kw: dict[str, Any] = dict(
        device="cpu", dtype="float32", kv_cache_tokens=256, page_size=16, max_prefill_tokens=64
    )
    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    small = LLM(**kw, overlap_schedule=True)
    reserved: list[bool] = []
    reserve = small.engine.scheduler.reserve_decode

    def recording(seqs: Any, width: int) -> bool:
        reserved.append(reserve(seqs, width))
        return reserved[-1]

    small.engine.scheduler.reserve_decode = recording  # type: ignore[method-assign]
    together = [o.token_ids for o in small.generate(prompts, params)]
    assert True in reserved and False in reserved  # chained, and fell back to scheduling (preemption)
    assert together == [o.token_ids for o in LLM(**kw).generate(prompts, params)]
    small.engine.blocks.allocator.check_integrity()
    assert small.engine.blocks.allocator.num_free == small.engine.blocks.allocator.num_pages


def test_a_decision_ahead_sees_the_committed_match_lengths(spec_llm: LLM) -> None:
    """With a token in flight the policy decides for the step after it from the match lengths of
    the committed tokens (it prices the token in flight itself, see the next test)."""
    eng = spec_llm.engine
    assert eng.ngram is not None
    worker = eng.ngram
    rid = eng.add_request([5, 6, 7, 8, 2, 5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    seq = eng.requests[rid].seqs[0]
    other = eng.add_request([5, 6, 7, 8, 9, 5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0))
    longer = eng.requests[other].seqs[0]
    seen: list[tuple[list[int], bool]] = []

    def record(
        seq_ids: Any,
        lengths: Any,
        grammar: str = "none",
        remaining: Any = None,
        ahead: bool = False,
        cap: Any = None,
        final: bool = False,
    ) -> int:
        seen.append((list(lengths()), ahead))
        return 1

    worker.policy.choose = record  # type: ignore[method-assign]
    try:
        worker.choose_width([seq, longer], draining=False)
        worker.choose_width([seq, longer], draining=False, ahead=True)
    finally:
        del worker.policy.choose  # the class's method again
        eng.abort(rid)
        eng.abort(other)
        eng.step()
    # "5 6 7" was followed by 8 (length 3), "5 6 7 8" by 9 (4 = MAX_MATCH, the cap)
    assert seen == [([3, 4], False), ([3, 4], True)]


def _timed_policy(plain: float, verify: float) -> AdaptiveDraftPolicy:
    """A policy with every width timed twice (decisions go through the probe) and no re-try due
    (decisions are the exploit branch's)."""
    policy = AdaptiveDraftPolicy(8)
    for w in policy.widths:
        for _ in range(2):
            policy.observe(1, w, plain if w == 1 else verify)
    policy._explore_at[bucket_of(1)] = 10**9
    return policy


def test_ahead_a_member_is_priced_by_what_the_token_in_flight_may_make_of_its_match() -> None:
    """At committed length n > 0 the token in flight continues the match (length n + 1) with the
    first-draft rate of length n, else the member is priced at length 1; from n = 0 it reaches
    length 1 at most. Values are the policy's own for observed lengths, the member's bias included."""
    policy = _timed_policy(0.01, 0.016)
    policy.acceptance.seq_bias["a"] = SeqBias(
        hits=3.0, predicted=2.0, trials=6.0
    )  # copies a little better than most
    shift = policy.acceptance.seq_bias["a"].value
    assert shift > 0

    def observed(n: int) -> float:
        return policy.acceptance.expected(["a"], [n], (8,))[8][0]

    assert policy.acceptance.expected(["a"], [0], (8,), ahead=True)[8][0] == pytest.approx(observed(1))
    for n in range(1, MAX_MATCH + 1):
        hit = min(policy.acceptance.first[(policy.widths[-1], n)].p + shift, 0.97)
        up = min(n + 1, MAX_MATCH)
        got = policy.acceptance.expected(["a"], [n], (8,), ahead=True)[8][0]
        assert got == pytest.approx(hit * observed(up) + (1 - hit) * observed(1))
        assert got < observed(up) or n == MAX_MATCH and hit == 0.97  # below the bound it replaces


def test_a_committed_length_one_does_not_drain_the_chain_when_only_its_bound_would_pay(spec_llm: LLM) -> None:
    """Regression: priced at the bound (length 2), a member at committed length 1 made the ahead
    decision break the overlap chain for a verify step that the committed token then called off
    (length 1 again): 3 times per 64-token batch-1 run of open-ended text on the H200. Now a member
    at length 1 decides plain ahead, while one observed at length 2 speculates. (With a verify
    step costing 1.6 plain ones, length 2 clears the policy's bar by 8% and the mixture at length 1
    misses it by 8%.)"""
    eng = spec_llm.engine
    assert eng.ngram is not None
    worker = eng.ngram
    one = eng.add_request([40001, 40002, 40003, 40004, 40002], SamplingParams(max_tokens=4, temperature=0))
    two = eng.add_request([40011, 40012, 40013, 40011, 40012], SamplingParams(max_tokens=4, temperature=0))
    at_one, at_two = eng.requests[one].seqs[0], eng.requests[two].seqs[0]
    policy = worker.policy
    try:
        assert [worker.corpus.match_length(s.token_ids, 4) for s in (at_one, at_two)] == [1, 2]
        worker.policy = _timed_policy(0.01, 0.016)
        assert (
            worker.choose_width([at_two], draining=False) > 1
        )  # the bound's case, observed: speculation pays
        worker.policy = _timed_policy(0.01, 0.016)
        assert worker.choose_width([at_one], draining=False, ahead=True) == 1
    finally:
        worker.policy = policy
        eng.abort(one)
        eng.abort(two)
        eng.step()


def test_decisions_ahead_do_not_feed_the_outlook() -> None:
    """The outlook (drafts a member tends to offer, which ranks a draining batch) is observed only."""
    policy = AdaptiveDraftPolicy(8)
    for w in policy.widths:  # every width timed: decisions go through the probe
        for _ in range(2):
            policy.observe(1, w, 0.01 if w == 1 else 0.012)
    policy.choose(["a"], lambda: [1])
    seen = policy._outlook["a"]
    policy.choose(["a"], lambda: [4], ahead=True)
    assert policy._outlook["a"] == seen
    policy.choose(["a"], lambda: [4])
    assert policy._outlook["a"] > seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_on_cuda_emits_exactly_the_step_by_step_tokens() -> None:
    """bf16 with CUDA graphs: overlap runs the same kernels in the same order, so not one token may differ."""
    kw: dict[str, Any] = dict(device="cuda", kv_cache_tokens=16384, cuda_graph_max_bs=8)
    overlapped, stepwise = LLM(**kw), LLM(**kw, overlap_schedule=False)
    assert overlapped.engine.overlap and not stepwise.engine.overlap
    # Members finish only at max_tokens, which never chains: both engines run the same batches. (A
    # member ending on EOS mid-chain leaves the others one step at the larger batch, another graph
    # bucket, whose bf16 GEMMs need not round alike.)
    params = [
        SamplingParams(max_tokens=48, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
    ]
    got = overlapped.generate(PROMPTS, params)
    assert overlapped.engine.stats.chained_steps > 0
    assert _summary(got) == _summary(stepwise.generate(PROMPTS, params))


def test_the_plain_step_restarting_the_chain_carries_the_verify_steps_tail() -> None:
    """The host work after a verify step's commit (the rest of its engine step) runs while the
    device idles, where a chain would overlap it: the plain step restarting the chain hands that
    tail to the policy, which charges it to the verify step. Time between engine steps is not
    the engine's, and the restarting step itself is timed as any plain step."""
    # Sleeps well above a plain step's time on a busy CPU (with 0.2 s inside, CI once failed on a
    # 0.21 s plain step).
    INSIDE, BETWEEN = 0.5, 0.8
    spec = LLM(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=4096,
        overlap_schedule=True,
        pipeline_verify=False,  # the verify step commits inside its own engine step
        speculative="ngram",
        num_draft_tokens=4,
    )
    eng = spec.engine
    assert eng.ngram is not None
    widths = [4, 4]  # the first decode step verifies (asked ahead, then afresh), every later one is plain
    eng.ngram.choose_width = lambda seqs, draining, ahead=False, final=False: widths.pop() if widths else 1  # type: ignore[method-assign]
    observed: list[tuple[int, float, float | None]] = []
    observe = eng.ngram.observe_step
    eng.ngram.observe_step = lambda bs, width, seconds, restart=None, result=None: (  # type: ignore[method-assign]
        observed.append((width, seconds, restart)),
        observe(bs, width, seconds, restart, result),
    )
    collect = eng._collect_outputs
    kinds: list[str] = []

    def slow_collect() -> Any:
        if eng.step_trace and eng.step_trace[-1].kind == "verify":  # recorded before the outputs
            time.sleep(INSIDE)  # host work after the verify's commit, inside its engine step
        return collect()

    eng._collect_outputs = slow_collect  # type: ignore[method-assign]
    eng.add_request("Count: 1, 2, 3, 4,", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step_trace = []
        eng.step()
        kinds.append(eng.step_trace[0].kind)
        if kinds[-1] == "verify":
            time.sleep(BETWEEN)  # between engine steps: nobody's cost
    assert kinds[:4] == ["prefill", "verify", "decode", "chain"]
    assert [(w, r is not None) for w, _, r in observed[:3]] == [(4, False), (1, True), (1, False)]
    tail = observed[1][2]
    assert tail is not None and INSIDE <= tail < BETWEEN  # the sleep inside the step, not the one after it
    assert all(s < INSIDE for _, s, _ in observed[1:]), observed  # plain steps: neither sleep


def _arrivals(llm: LLM, prompts: list[Any], params: list[SamplingParams], concurrency: int) -> list[Any]:
    """Requests at most ``concurrency`` at a time, each finished one replaced at once (a serving
    engine's load: prompts join running batches); outputs in request order."""
    eng = llm.engine
    done: dict[str, RequestOutput] = {}
    ids = [f"arrival-{i}-{time.perf_counter_ns()}" for i in range(len(prompts))]
    added = 0
    while added < min(concurrency, len(prompts)):
        eng.add_request(prompts[added], params[added], request_id=ids[added])
        added += 1
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
                if added < len(prompts):
                    eng.add_request(prompts[added], params[added], request_id=ids[added])
                    added += 1
    return [done[i] for i in ids]


def test_prompts_arriving_ride_along_chained_steps(llm: LLM, overlap_llm: LLM) -> None:
    """Under continuous arrivals a newcomer's prompt is prefilled in a step launched before the
    step in flight is read back (a chained mixed step), a long prompt chunk by chunk across such
    steps: greedy, seeded sampling, logprobs, a stop string and a grammar come out as in the
    step-by-step engine, and every page is free after."""
    eng = overlap_llm.engine
    story = "Once upon a time, in a small village by the sea, there lived an old fisherman. " * 6
    prompts: list[Any] = [*PROMPTS, story + "What happened next?", "Name a fruit:", "Why is the sky blue?"]
    prompts.append(
        [{"role": "user", "content": "Paris has 2161000 people. Give name and population as JSON."}]
    )
    params = [
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, stop=[","]),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.7, seed=9, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, json_schema=SCHEMA),
    ]
    before = (eng.stats.chained_mixed, eng.stats.mixed_steps)
    got = _arrivals(overlap_llm, prompts, params, concurrency=3)
    chained = eng.stats.chained_mixed - before[0]
    # every mixed step was chained: one per newcomer, and more for the long prompt's chunks (the
    # CPU's mixed step carries 64 prompt tokens)
    assert chained == eng.stats.mixed_steps - before[1] >= len(prompts) - 3 + 1
    want = _arrivals(llm, prompts, params, concurrency=3)
    assert [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in got] == [
        [(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in want
    ]
    for a, b in zip(got, want):
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert x.top[0][0] == y.top[0][0] and x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert got[-1].outputs[0].finish_reason == "stop"  # the grammar's JSON ended
    assert eng._in_flight is None and not eng.scheduler.running
    eng.blocks.allocator.check_integrity()
    assert eng.blocks.allocator.num_free == eng.blocks.allocator.num_pages


def test_prompts_waiting_to_share_a_mixed_step_change_no_token(llm: LLM) -> None:
    """``prefill_wait_steps`` (a GPU's default: 4) only moves when a prompt is prefilled: the
    outputs are the step-by-step engine's, with fewer mixed steps than taking each arrival at once."""
    prompts = [*PROMPTS, "Name a fruit:", "Why is the sky blue?", "Count to five:"]
    params = [
        SamplingParams(max_tokens=5 + 2 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))
    ]
    want = [o.token_ids for o in _arrivals(llm, prompts, params, 3)]
    mixed = {}
    for wait in (0, 4):
        waiting = LLM(
            device="cpu",
            dtype="float32",
            kv_cache_tokens=4096,
            overlap_schedule=True,
            prefill_wait_steps=wait,
        )
        got = _arrivals(waiting, prompts, params, concurrency=3)
        assert [o.token_ids for o in got] == want
        mixed[wait] = waiting.engine.stats.mixed_steps
        waiting.close()
    assert 0 < mixed[4] < mixed[0]


def test_a_chained_mixed_launch_is_not_charged_to_the_plain_step_before() -> None:
    """A chained mixed step launches (eager attention, prompt uploads) before the plain step in
    flight is committed: that commit must not be timed for the draft policy, or the launch's host
    time would be read as a slow plain step. No step is observed between such a launch and its
    sampling."""
    spec = LLM(
        device="cpu", dtype="float32", kv_cache_tokens=4096, overlap_schedule=True, speculative="ngram"
    )
    eng = spec.engine
    assert eng.ngram is not None
    launching: list[bool] = []  # a chained mixed step launched and not sampled yet
    charged: list[int] = []
    observe = eng.ngram.observe_step
    eng.ngram.observe_step = lambda bs, width, *a, **k: (  # type: ignore[method-assign]
        launching and charged.append(width),
        observe(bs, width, *a, **k),
    )
    launch, sample = eng._launch_prefill, eng._sample_prefill

    def launch_prefill(chunks: Any, decode: Any, decode_ids: Any) -> Any:
        if decode_ids is not None:
            launching.append(True)
        return launch(chunks, decode, decode_ids)

    def sample_prefill(*a: Any) -> Any:
        launching.clear()
        return sample(*a)

    eng._launch_prefill, eng._sample_prefill = launch_prefill, sample_prefill  # type: ignore[method-assign]
    prompts = [*PROMPTS, "Name a fruit:"]
    params = [
        SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))
    ]
    _arrivals(spec, prompts, params, concurrency=2)
    assert eng.stats.chained_mixed > 0 and not charged
    spec.close()
