"""NGRAM speculation in the engine: lossless greedy output, KV integrity, stop handling, metrics."""

from __future__ import annotations

import copy
import gc
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ngrammar import LLM, SamplingParams
from ngrammar.config import SpeculativeConfig
from ngrammar.engine.sequence import Sequence
from ngrammar.engine.stats import EngineStats
from ngrammar.speculative.corpus import NgramCorpus
from ngrammar.speculative.policy import REASONS, AdaptiveDraftPolicy, bucket_of
from ngrammar.speculative.step_costs import NO_GRAMMAR, StepCosts, grammar_class
from ngrammar.speculative.upkeep import CorpusUpkeep

GROUNDED = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.\n",
    "Copy the list: apples, bananas, cherries, dates, elderberries, figs, grapes.\nList: apples,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    'Name: Alice Smith\nAge: 34\nCity: Paris\n\nExtract the fields as JSON: {"name": "',
]
OPEN_ENDED = [
    "Write a short poem about autumn leaves.",
    "The meaning of life is",
    "Explain why the sky is blue in simple words.",
    "My favourite recipe for dinner is",
]
PROMPTS = GROUNDED + OPEN_ENDED
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
@pytest.mark.parametrize("width", [2, 8, 16])
def test_greedy_speculation_is_lossless(plain_outputs: list[list[int]], width: int, match_type: str) -> None:
    spec = LLM(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=8192,
        speculative="ngram",
        num_draft_tokens=width,
        ngram_match_type=match_type,
        spec_policy="fixed",
    )
    outs = spec.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_outputs
    assert spec.engine.stats.verify_steps > 0
    if width == 8 and match_type == "BFS":
        alone = [spec.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
        assert alone == plain_outputs
        grounded_accept = [o.metrics["spec_accept_length"] for o in outs[: len(GROUNDED)]]
        assert max(grounded_accept) > 1.5  # copying prompts: drafts do get accepted
    alloc = spec.engine.blocks.allocator
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_pages
    del spec
    gc.collect()


def test_spec_metrics_and_stop_inside_accepted_run(spec_llm: LLM, llm: LLM) -> None:
    prompt = GROUNDED[0]
    full = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0))[0]
    out = spec_llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0))[0]
    assert out.token_ids == full.token_ids
    m = out.metrics
    assert (
        m["spec_verify_steps"] >= 1 and 1 <= m["spec_accept_length"] <= 8 and 0 <= m["spec_accept_rate"] <= 1
    )
    # max_tokens and stop strings cut an accepted run exactly where plain decoding stops
    for n in (3, 5, 11):
        cut = spec_llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0))[0]
        assert cut.token_ids == full.token_ids[:n]
    stop = full.text[12:16]
    plain_stop = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, stop=[stop]))[0]
    spec_stop = spec_llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, stop=[stop]))[0]
    assert spec_stop.text == plain_stop.text and spec_stop.finish_reason == "stop"


def test_the_step_trace_records_every_step_by_kind(spec_llm: LLM) -> None:
    eng = spec_llm.engine
    steps, spec_steps = eng.stats.steps, eng.stats.spec_steps
    eng.step_trace = trace = []
    try:
        spec_llm.generate(GROUNDED[:2], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    finally:
        eng.step_trace = None
    assert len(trace) == eng.stats.steps - steps
    assert trace[0].kind == "prefill" and trace[0].batch_size == 2
    verify = [r for r in trace if r.kind == "verify"]
    assert len(verify) == eng.stats.spec_steps - spec_steps > 0  # copying prompts are verified
    assert all(r.width > 1 and r.batch_size in (1, 2) for r in verify)
    assert {r.reason for r in trace if r.kind != "prefill"} == {"fixed"}  # the fixture is not adaptive
    assert all(r.reason == "" for r in trace if r.kind in ("prefill", "idle"))
    assert all(r.width == 1 for r in trace if r.kind != "verify")
    assert all(
        r.seconds > 0 and 0 <= r.shadow_seconds <= r.host_seconds + 1e-9 and r.host_seconds <= r.seconds
        for r in trace
    )
    assert all(a.start + a.seconds <= b.start for a, b in zip(trace, trace[1:]))


def test_trees_are_trimmed_to_their_drafts_before_the_verify_launch(spec_llm: LLM, llm: LLM) -> None:
    """Padding cannot be accepted: a tree with few real drafts is verified at the narrowest width
    that holds them (the fixture drafts D = 8), a step with none runs plain, and the output is
    plain decoding's either way."""
    eng = spec_llm.engine
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = OPEN_ENDED[:2] + GROUNDED[:1]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    trimmed = eng.stats.trimmed_nodes
    eng.step_trace = trace = []
    try:
        outs = [spec_llm.generate(p, params)[0] for p in prompts]  # batch 1
    finally:
        eng.step_trace = None
    assert [o.token_ids for o in outs] == expected
    widths = {r.width for r in trace if r.kind == "verify"}
    assert eng.stats.trimmed_nodes > trimmed and min(widths) < 8 and max(widths) <= 8


def test_the_policy_says_why_it_chose_a_width() -> None:
    policy = AdaptiveDraftPolicy(max_width=4)  # widths 1 and 4
    seen = []

    def choose(length: int) -> int:
        width = policy.choose(["s"], lambda: [length])
        seen.append(policy.reason)
        assert policy.reason in REASONS
        return width

    assert choose(3) == 1 and seen[-1] == "time"  # plain is timed first
    policy.observe(1, 1, 0.010)
    policy.observe(1, 1, 0.010)
    assert choose(3) == 4 and seen[-1] == "time"  # then each width
    for _ in range(2):
        policy._lengths["s"] = 3
        policy.observe(1, 4, 0.011, {"s": 3}, censored={"s"})
    assert choose(3) == 4 and seen[-1] == "exploit"  # 4 tokens for 1.1 steps
    assert policy.priced == {"s": (3, pytest.approx(policy.expected_drafts("s", 3, 4)))}  # what it paid for
    assert choose(0) == 1 and seen[-1] == "no match"
    costly = AdaptiveDraftPolicy(max_width=4)
    for width, seconds in ((1, 0.01), (1, 0.01), (4, 1.0), (4, 1.0)):
        costly.observe(1, width, seconds, {"s": 0} if width > 1 else None)  # a verify step: re-try later
    assert costly.choose(["s"], lambda: [3]) == 1 and costly.reason == "hopeless"  # 100 steps' cost
    assert costly.choose([], lambda: []) == 1 and costly.reason == "empty"


def test_the_policy_prices_each_grammar_kind_at_its_own_cost() -> None:
    """A schema's verify steps cost 100 plain steps, a regex's barely more than one: the policy
    declines the schema's constrained verify (nothing it can accept pays for it) and takes the
    regex's; a batch mixing kinds is a class of its own, not yet timed."""
    assert grammar_class([None, None]) == "none"
    assert grammar_class(["regex", None, "regex"]) == "regex"
    assert grammar_class(["regex", "json_schema"]) == "mixed"
    policy = AdaptiveDraftPolicy(max_width=4)
    for kind, verify in (("json_schema", 1.0), ("regex", 0.011)):
        for width, seconds in ((1, 0.01), (1, 0.01), (4, verify), (4, verify)):
            policy._lengths["s"] = 3
            policy.observe(1, width, seconds, {"s": 3} if width > 1 else None, grammar=kind, censored={"s"})
    assert policy.step_cost(bucket_of(1, "json_schema"), 4) == pytest.approx(1.0)
    assert policy.step_cost(bucket_of(1, "regex"), 4) == pytest.approx(0.011)
    policy._explore_at = {bucket_of(1, k): 10**9 for k in ("json_schema", "regex")}
    assert policy.choose(["s"], lambda: [3], grammar="json_schema") == 1 and policy.reason == "hopeless"
    assert policy.choose(["s"], lambda: [3], grammar="regex") == 4 and policy.reason == "exploit"
    assert policy.choose(["s"], lambda: [3], grammar="mixed") == 1 and policy.reason == "time"


def test_a_real_end_of_text_draft_with_children_verifies_like_any_draft(llm: LLM) -> None:
    """Regression: the prompt holds <|endoftext|> (token 0, the padding token) inside a sentence the
    model then repeats, so a tree drafts 0 with children under its root. Read as padding, it left
    its children without a kept parent, and the trimmed verify step raised in ``keep_nodes``."""
    # " Berlin" <|endoftext|> "." ... "The capital of France is Paris. The capital of Germany is"
    prompt = [11452, 0, 30, 17, 504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314]
    params = SamplingParams(max_tokens=8, temperature=0)
    short = LLM(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=2048,
        speculative="ngram",
        num_draft_tokens=8,
        spec_policy="fixed",
        ngram_max_trie_depth=4,
    )  # short windows: the tree is trimmed
    assert short.generate(prompt, params)[0].token_ids == llm.generate(prompt, params)[0].token_ids
    assert short.engine.stats.trimmed_nodes > 0


def test_speculation_stops_at_the_end_of_the_context_as_plain_decoding_does(llm: LLM) -> None:
    """Regression: a verify step's run was committed whole, past ``max_model_len`` (a 51-token
    prompt under a 64-token context came out 70 tokens long), and its tree's positions ran past the
    context's end (at the model's own 8,192 that indexed past the RoPE table and raised)."""
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5)
    params = SamplingParams(max_tokens=32, temperature=0)
    spec = LLM(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=2048,
        max_model_len=64,
        speculative="ngram",
        num_draft_tokens=8,
        spec_policy="fixed",
    )
    out = spec.generate([ids], params)[0]
    room = 64 - len(ids)
    reference = llm.generate([ids], SamplingParams(max_tokens=room, temperature=0))[0]
    assert 0 < room < 32 and out.finish_reason == "length" and out.token_ids == reference.token_ids
    assert spec.engine.stats.verify_steps > 0
    alloc = spec.engine.blocks.allocator
    assert alloc.num_free == alloc.num_pages


def test_speculation_does_not_fail_a_request_that_plain_decoding_has_room_for(llm: LLM) -> None:
    """Regression: with the KV pool nearly full, the reservation for a verify step's D tokens
    failed the last running request ("the KV cache is too small") where a plain step fits."""
    prompt = "Copy the list: apples, bananas, cherries, dates, elderberries, figs, grapes.\nList: apples,"
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    small = LLM(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=64,
        page_size=16,
        speculative="ngram",
        num_draft_tokens=16,
        spec_policy="fixed",
    )
    out = small.generate(prompt, params)[0]
    assert out.finish_reason == "length" and out.token_ids == llm.generate(prompt, params)[0].token_ids
    alloc = small.engine.blocks.allocator
    assert alloc.num_free == alloc.num_pages


def test_speculative_sampling_respects_top_k(spec_llm: LLM) -> None:
    # Draft trees depend on the shared corpus, so seeded sampled outputs are reproducible only for
    # the same corpus state; the distribution itself is exact (tests/test_verify.py).
    p = SamplingParams(max_tokens=20, temperature=0.7, top_k=1, seed=5, ignore_eos=True)
    greedy = spec_llm.generate(GROUNDED[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    sampled = spec_llm.generate([GROUNDED[1], OPEN_ENDED[0]], [p, p])[0]
    assert sampled.token_ids == greedy.token_ids  # top_k=1 leaves only the argmax


def test_many_speculative_requests_free_all_pages(spec_llm: LLM) -> None:
    params = [
        SamplingParams(
            max_tokens=8 + i % 5, temperature=0 if i % 2 else 0.8, seed=i, logprobs=1 if i % 3 else None
        )
        for i in range(16)
    ]
    outs = spec_llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(16)], params)
    assert all(o.finished for o in outs)
    for o in outs:
        lp = o.logprobs
        if lp is not None:
            assert len(lp) == len(o.token_ids)
    alloc = spec_llm.engine.blocks.allocator
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_pages


def _run_policy(
    policy: AdaptiveDraftPolicy,
    seq_ids: list[str],
    spec_time: float,
    spec_accept: float,
    steps: int = 100,
    match_length: int = 4,
    probes: list[int] | None = None,
) -> list[int]:
    """Drive the policy with synthetic steps: plain costs 0.05 s, a verify ``spec_time`` and emits
    ``spec_accept`` tokens per sequence on average (drafts drawn reproducibly); every sequence has
    ``match_length``. Each probe of the match lengths is counted in ``probes``."""
    import random

    rng = random.Random(0)
    chosen = []

    def lengths() -> list[int]:
        if probes is not None:
            probes.append(1)
        return [match_length] * len(seq_ids)

    for _ in range(steps):
        w = policy.choose(seq_ids, lengths)
        extra = spec_accept - 1
        drafts = {s: int(extra) + (rng.random() < extra - int(extra)) for s in seq_ids}
        policy.observe(len(seq_ids), w, 0.05 if w == 1 else spec_time, None if w == 1 else drafts)
        chosen.append(w)
    return chosen


def test_adaptive_policy_follows_measured_payoff() -> None:
    ids = ["a", "b", "c", "d"]
    bad = _run_policy(AdaptiveDraftPolicy(max_width=8), ids, spec_time=0.08, spec_accept=1.05)[-48:]
    assert bad.count(1) >= 0.85 * len(bad)  # verify costs 1.6x, drafts rarely accepted
    good = _run_policy(AdaptiveDraftPolicy(max_width=8), ["a"], spec_time=0.065, spec_accept=3.0)[-48:]
    assert sum(w > 1 for w in good) >= 0.85 * len(good)  # 3 tokens for 1.3x the time
    assert good.count(1) >= 3  # ... while the plain cost is still re-measured now and then


def test_one_slow_first_verify_step_does_not_switch_speculation_off() -> None:
    policy = AdaptiveDraftPolicy(max_width=8)
    for _ in range(2):  # plain steps are timed first
        assert policy.choose(["a"], lambda: [4]) == 1
        policy.observe(1, 1, 0.05)
    first = policy.choose(["a"], lambda: [4])
    assert first == 4
    policy.observe(1, first, 5.0, {"a": 2})  # e.g. a first launch or a page fault: 100x a normal step
    chosen = _run_policy(policy, ["a"], spec_time=0.065, spec_accept=3.0, steps=30)
    assert sum(w > 1 for w in chosen[8:]) >= 0.8 * len(chosen[8:])


def test_sequences_without_a_match_are_not_verified_and_rarely_probed() -> None:
    policy = AdaptiveDraftPolicy(max_width=8)
    ids = [f"s{i}" for i in range(32)]
    probes: list[int] = []
    chosen = _run_policy(
        policy, ids, spec_time=0.06, spec_accept=1.0, steps=200, match_length=0, probes=probes
    )
    timing = len(policy.widths) * 2  # every width is timed twice first
    assert all(w == 1 for w in chosen[timing:])
    # A probe that found nothing holds the next ones off for bucket // 4 = 8 steps at batch 32.
    assert len(probes) <= timing + (200 - timing) / 8 + 1


def test_probes_are_spaced_to_cost_a_small_share_of_plain_steps() -> None:
    """A probe that finds nothing holds the next ones off for bucket // 4 steps, or for as many as
    keep the probes' host time under ``probe_share`` of plain decoding: with plain steps timed at a
    microsecond (far less than any probe's host time), probes become rare."""
    ids = [f"s{i}" for i in range(8)]
    counts = []
    for plain_seconds in (1.0, 1e-6):
        policy = AdaptiveDraftPolicy(max_width=8)
        probes: list[int] = []
        for step in range(200):
            width = policy.choose(ids, lambda: probes.append(step) or [0] * len(ids))
            policy.observe(
                8,
                width,
                plain_seconds if width == 1 else 3 * plain_seconds,
                None if width == 1 else {s: 0 for s in ids},
            )
        assert policy.probe_cost[bucket_of(8)] > 0
        counts.append(len(probes))
    timing = 3 * 2  # widths 4 and 8 and plain, each timed twice
    # bucket // 4 = 2 steps apart while a probe costs far under 2% of a 1 s plain step
    assert (200 - timing) / 2 - 5 <= counts[0] <= timing + (200 - timing) / 2 + 1
    assert counts[1] <= timing + 10


def test_a_slow_first_probe_does_not_lock_probing_out() -> None:
    """A cold first probe (here 50 ms against 1 ms plain steps) would space probes thousands of
    steps apart by ``probe_share`` alone; the gap is capped (``max_probe_gap``), so a match that
    shows up later is still found and verified."""
    import time as _time

    policy = AdaptiveDraftPolicy(max_width=8)
    policy.costs.set_profile({(1, 1): 1e-3, (1, 2): 1.1e-3, (1, 4): 1.2e-3, (1, 8): 1.3e-3})
    calls: list[int] = []

    def lengths() -> list[int]:
        calls.append(1)
        if len(calls) == 1:
            _time.sleep(0.05)
            return [0]
        return [4]

    widths = []
    for _ in range(policy.params.max_probe_gap + 10):
        w = policy.choose(["s"], lengths)
        widths.append(w)
        policy.observe(1, w, 1e-3 if w == 1 else 1.3e-3, None if w == 1 else {"s": w - 1})
    assert any(w > 1 for w in widths)


def test_losing_widths_are_retried_less_often_the_more_a_retry_costs() -> None:
    ids = [f"s{i}" for i in range(32)]
    timing = 3 * 2  # widths 4 and 8 and plain, each timed twice
    cheap = _run_policy(
        AdaptiveDraftPolicy(max_width=8), ids, spec_time=0.06, spec_accept=1.0, steps=300, match_length=2
    )
    dear = _run_policy(
        AdaptiveDraftPolicy(max_width=8), ids, spec_time=0.2, spec_accept=1.0, steps=300, match_length=2
    )
    cheap_retries = sum(w > 1 for w in cheap[timing:])
    dear_retries = sum(w > 1 for w in dear[timing:])
    # 1.2x plain: every max(8, 0.2 / 0.02) = 10 steps; 4x plain: every 3 / 0.02 = 150 steps.
    assert 15 <= cheap_retries <= 40
    assert 1 <= dear_retries <= 3


def test_the_step_restarting_the_chain_charges_the_break_to_the_verify_step() -> None:
    # With overlap a verify step breaks the chain: its host work after its commit (the tail) and
    # what the plain step restarting the chain takes beyond a plain step are the verify's cost
    # (uncharged, explorations on the H200 ran once per 64-token run at batch 8, each costing the
    # run 3-7%). The engine says which plain step restarts the chain (``restart``).
    policy = AdaptiveDraftPolicy(max_width=16)
    b = bucket_of(8)
    for _ in range(3):
        policy.observe(8, 1, 0.001)
    for _ in range(2):
        policy.observe(8, 16, 0.002, drafts={"a": 0})
        # a 0.3 ms tail, and the restarting step took 0.5 ms beyond a plain step
        policy.observe(8, 1, 0.0015, restart=0.0003)
    assert policy.step_cost(b, 16) == pytest.approx(0.0028)
    # The restarting steps were recorded at a plain step's cost: their excess is the verify's.
    assert list(policy.costs.step_time[(b, 1)].samples)[-2:] == [pytest.approx(0.001)] * 2
    # The next exploration waits (2.8 - 1) / 0.02 = 90 steps after the verify step (step 5), not 50.
    assert policy._explore_at[b] == 5 + 1 + 90
    policy.observe(8, 1, 0.005)  # not restarting a chain: a plain sample, nothing charged
    assert policy.costs.step_time[(b, 16)].samples[-1] == pytest.approx(0.0028)
    assert policy.costs.step_time[(b, 1)].samples[-1] == pytest.approx(0.005)
    policy.observe(8, 16, 0.002, drafts={"a": 0})
    policy.observe(8, 1, 0.001, restart=1.0)  # a long tail: at most the verify's own time
    assert policy.costs.step_time[(b, 16)].samples[-1] == pytest.approx(0.004)
    policy.observe(8, 16, 0.002, drafts={"a": 0})
    policy.observe(16, 1, 0.005, restart=0.001)  # the batch changed bucket: nothing to charge
    assert policy.costs.step_time[(b, 16)].samples[-1] == pytest.approx(0.002)
    policy.observe(6, 16, 0.0015, drafts={"a": 0})  # 6 of a bucket of 8: times scale by 8 / 6
    policy.observe(6, 1, 0.00075, restart=0.0003)
    assert policy.costs.step_time[(b, 16)].samples[-1] == pytest.approx((0.0015 + 0.0003) * 8 / 6)


def test_a_draining_batch_speculates_for_its_critical_members_only() -> None:
    policy = AdaptiveDraftPolicy(max_width=8)
    ids = ["copy", "prose"]
    for _ in range(6):  # time plain (0.05 s) and verify steps (0.06 s)
        w = policy.choose(ids, lambda: [4, 4])
        policy.observe(2, w, 0.05 if w == 1 else 0.06, None if w == 1 else {"copy": 3, "prose": 3})
    lengths = lambda: [4, 0]  # noqa: E731 - "prose" has no match: its tree is padding
    for _ in range(5):  # "prose" keeps finding no match: its outlook falls
        policy._probe(ids, lengths)
    # More requests waiting: finished ones are replaced, so the mean (drafts of "copy" / 2) pays.
    assert policy.choose(ids, lengths) > 1
    # Draining with equal budgets: "prose" is projected to need the most steps and gains nothing
    # from a verify step, which would only make the batch's last member slower.
    assert policy.choose(ids, lengths, remaining=lambda: [50, 50]) == 1
    assert policy.choose(ids, lengths, remaining=lambda: [20, 200]) == 1
    # "copy" has ten times as much left: even copying it needs the most steps, so it decides.
    assert policy.choose(ids, lengths, remaining=lambda: [200, 20]) > 1
    # Both critical and both matching: speculate.
    assert policy.choose(ids, lambda: [4, 4], remaining=lambda: [50, 50]) > 1


def test_a_new_batch_bucket_borrows_the_verify_cost_ratio_of_a_timed_one() -> None:
    policy = AdaptiveDraftPolicy(max_width=8)
    eight = [f"s{i}" for i in range(8)]
    _run_policy(policy, eight, spec_time=0.2, spec_accept=1.0, steps=10, match_length=0)
    # The batch drains to 3 sequences (bucket 4): only its plain cost is measured, not its verify cost.
    three = eight[:3]
    chosen = _run_policy(policy, three, spec_time=0.2, spec_accept=1.0, steps=10, match_length=0)
    assert chosen == [1] * 10
    assert policy.step_cost((4, NO_GRAMMAR), 8) == pytest.approx(0.05 * 4 / 3 * 0.2 / 0.05)
    # A larger bucket never borrows a smaller one's (optimistic) ratio: its verify cost is measured.
    sixteen = [f"t{i}" for i in range(16)]
    grown = _run_policy(policy, sixteen, spec_time=0.3, spec_accept=1.0, steps=6, match_length=0)
    assert grown.count(1) == 2 and sorted(grown[2:]) == [4, 4, 8, 8]


def test_a_width_timed_while_the_host_was_busy_is_not_priced_out_for_good() -> None:
    # Regression: a 4-node verify timed twice during a stall (1.1 s against 25 ms for 8 nodes) kept
    # that cost, so 4 was never chosen again and never re-timed.
    costs = StepCosts([1, 4, 8])
    bucket = bucket_of(1, "json_schema")
    for width, seconds in ((1, 0.010), (1, 0.012), (4, 1.1), (4, 1.4), (8, 0.025), (8, 0.024)):
        costs.record(bucket, width, seconds)
    assert costs.bucket_costs(bucket) == {1: 0.010, 4: 0.024, 8: 0.024}
    for _ in range(3):  # chosen again, its own steps decide once they outnumber the stalled ones
        costs.record(bucket, 4, 0.016)
    assert costs.cost(bucket, 4) == 0.016
    costs.record(bucket, 8, 0.5)  # one slow step moves a lower median only to the next sample
    assert costs.bucket_costs(bucket) == {1: 0.010, 4: 0.016, 8: 0.025}
    policy = AdaptiveDraftPolicy(max_width=8)
    for width, seconds in ((1, 0.010), (1, 0.010), (4, 1.1), (4, 1.1), (8, 0.02), (8, 0.02)):
        policy.costs.record(bucket_of(1), width, seconds)
    assert policy.step_cost(bucket_of(1), 4) == 0.02


def test_acceptance_is_learned_per_match_length_and_biased_per_request() -> None:
    policy = AdaptiveDraftPolicy(max_width=8)
    # Verify costs 1.2x plain. A story at match length 1 accepts nothing: after a few tries,
    # length-1 steps are decoded plainly (re-tried only when a longer match shows up).
    story = _run_policy(policy, ["story"], spec_time=0.06, spec_accept=1.0, steps=100, match_length=1)
    assert story[-60:].count(1) == 60
    # (Each width learns from its own trees; width 8 ran only a few of them: well below its prior's 0.54.)
    assert policy.expected_drafts("story", 1, 8) < 0.2
    # A code edit copying at match length 4 speculates from its first step (the table, not its
    # history, says length 4 pays) ...
    code = _run_policy(policy, ["code"], spec_time=0.06, spec_accept=5.0, steps=40, match_length=4)
    assert code[0] > 1 and sum(w > 1 for w in code) >= 0.8 * len(code)
    policy.forget(["story", "code"])
    assert not policy.acceptance.seq_bias


def test_constrained_batches_learn_acceptance_apart_from_free_text() -> None:
    # Regression: one model served both, and free text's low acceptance at short matches priced
    # JSON-schema steps (forced text, forbidden drafts dropped) at a third of what they accepted.
    policy = AdaptiveDraftPolicy(max_width=8)
    json = "json_schema"
    assert policy.expected_drafts("j", 1, 8, json) > 2 * policy.expected_drafts("t", 1, 8)
    free = policy.expected_drafts("t", 1, 8)
    for _ in range(6):  # constrained verify steps at match length 1 that accept nothing ...
        w = policy.choose(["j"], lambda: [1], json)
        policy.observe(1, w, 0.05, None if w == 1 else {"j": 0}, json)
    assert policy.expected_drafts("j", 1, 8, json) < policy.params.prior_continue_constrained[1]
    assert policy.expected_drafts("t", 1, 8) == free  # ... teach the free-text model nothing
    policy.forget(["j"])
    assert not policy.constrained.seq_bias


def test_a_called_off_verify_step_teaches_acceptance_only_where_it_drained_a_chain() -> None:
    # Without overlap (a CPU) a call-off costs only the drafting: a plain step runs instead, so the
    # width was as good as plain there, and the verify steps that do launch price it. Taught as
    # zero accepted, it priced constrained steps (whose trees are often all forbidden drafts) low.
    policy = AdaptiveDraftPolicy(max_width=8)
    policy._lengths["j"] = 1
    json = "json_schema"
    before = policy.expected_drafts("j", 1, 8, json)
    for _ in range(5):
        policy.observe_vetoed(1, 8, json, ["j"])
    assert policy.expected_drafts("j", 1, 8, json) == before
    for _ in range(5):
        policy.observe_vetoed(1, 8, json, ["j"], drained=True)
    assert policy.expected_drafts("j", 1, 8, json) < before / 2


def test_each_request_keeps_its_own_bias_at_the_same_match_length() -> None:
    policy = AdaptiveDraftPolicy(max_width=8)
    for _ in range(12):  # the timing steps verify at every width
        w = policy.choose(["copy", "prose"], lambda: [2, 2])
        drafts = None if w == 1 else {"copy": min(5, w - 1), "prose": 0}
        policy.observe(2, w, 0.05, drafts)
    assert policy.expected_drafts("copy", 2, 8) > policy.expected_drafts("prose", 2, 8) + 2
    assert policy.expected_drafts("new", 0, 8) == 0.0  # no match: a padding-only tree


def test_a_width_that_accepts_all_its_drafts_makes_way_for_a_wider_one() -> None:
    # Regression: acceptance was averaged per width, so a code edit accepting 3 of 3 drafts at
    # D = 4 stayed at D = 4; a continuation rate per match length, shared by every width, prices them.
    policy = AdaptiveDraftPolicy(max_width=16)
    chosen = []
    for step in range(60):
        w = policy.choose(["code"], lambda: [4])
        # The first steps (when every width is timed) accept 2 drafts; then the request copies and
        # every draft is accepted: its verify steps end at the tree's last node.
        accepted = min(2, w - 1) if step < 12 else w - 1
        policy.observe(1, w, 0.05 if w == 1 else 0.05 + 0.001 * w, None if w == 1 else {"code": accepted})
        chosen.append(w)
    assert chosen[-20:].count(16) >= 16
    assert policy.expected_drafts("code", 4, 16) > 10


def test_a_run_ending_at_a_leaf_is_not_counted_as_a_rejection() -> None:
    def learn(censored: set[str]) -> float:
        policy = AdaptiveDraftPolicy(max_width=8)
        for _ in range(5):  # 2 of 7 drafts accepted: the tree (a short chain) had no more
            policy._lengths["s"] = 2
            policy.observe(1, 8, 0.05, {"s": 2}, censored=censored)
        return policy.expected_drafts("s", 2, 8)

    assert learn({"s"}) > learn(set()) + 1


def test_all_or_nothing_runs_are_priced_by_a_first_draft_rate() -> None:
    # Regression: one continuation rate per match length read a request that either copies on
    # (15 of 15 drafts) or departs at once (0), in equal shares, as p = 0.93: 9 drafts expected
    # from a width-16 tree instead of 7.5. A first-draft rate (0.5) and a continuation rate keep
    # the two apart.
    policy = AdaptiveDraftPolicy(max_width=16)
    for i in range(40):
        policy._lengths["s"] = 4
        policy.observe(1, 16, 0.05, {"s": 15 if i % 2 else 0})
    assert policy.acceptance.first[(16, 4)].p == pytest.approx(0.5, abs=0.05)
    policy.acceptance.seq_bias.clear()
    assert 5.5 < policy.expected_drafts("s", 4, 16) < 8.0


def test_a_sequence_bias_shifts_the_first_draft_rate_only() -> None:
    # Added to a continuation rate near 1, a small bias promised long runs: CPU exploit steps at
    # match length 4 were expected to accept 10-12 drafts and accepted ~5.
    policy = AdaptiveDraftPolicy(max_width=16)
    plain = policy.expected_drafts("s", 4, 16)
    for _ in range(3):
        policy._lengths["s"] = 4
        policy.observe(1, 16, 0.05, {"s": 2})  # first drafts accepted beyond the prior's 0.8
    bias = policy.acceptance.seq_bias["s"].value
    assert bias > 0
    first, p = policy.acceptance.first[(16, 4)].p, policy.acceptance.cont[4].p
    levels = policy.acceptance.levels(16)[4]
    f = min(first + bias, 0.97)
    assert policy.expected_drafts("s", 4, 16) == pytest.approx(
        f * (1 + p * (1 - p ** (levels - 1)) / (1 - p))
    )
    unbiased = first * (1 + p * (1 - p ** (levels - 1)) / (1 - p))
    assert policy.expected_drafts("s", 4, 16) > unbiased + 0.1 and plain > 0


def test_a_shallow_tree_is_not_priced_as_a_chain() -> None:
    # A BFS tree from a short match is wide: its runs end at leaves (censored), so p alone would
    # promise a width-16 tree a 15-draft run. The learned depth caps the run.
    policy = AdaptiveDraftPolicy(max_width=16)
    for _ in range(10):
        policy._lengths["s"] = 1
        policy.observe(1, 16, 0.05, {"s": 1}, censored={"s"}, depths={"s": 2})
    assert policy.expected_drafts("s", 1, 16) <= 2.0
    assert (
        policy.acceptance.levels(4)[1] == 3.0
    )  # width 4 has no depth learned: priced as a chain of 3 levels


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 15), st.booleans(), st.integers(0, 9)),
        min_size=1,
        max_size=12,
    ),
    st.lists(st.integers(0, 6), min_size=1, max_size=6),
    st.booleans(),
)
def test_expected_drafts_equal_the_two_rate_run_formula(
    steps: list[tuple[int, int, bool, int]], lengths: list[int], ahead: bool
) -> None:
    """``_expected`` prices each member from precomputed (rate, gain) tables with the clamp inlined;
    it must equal the two-rate run ``_run2(clamp(f + bias), clamp(p), levels)`` written out, and,
    ``ahead``, its mix of the member's match continuing (length n + 1) or not (length 1)."""
    from ngrammar.speculative.acceptance import run_length2 as _run2
    from ngrammar.speculative.policy import MAX_MATCH
    from ngrammar.speculative.policy_params import AdaptiveParams

    PRIOR_CONTINUE = AdaptiveParams().prior_continue
    policy = AdaptiveDraftPolicy(max_width=16)
    _clamp = policy.acceptance.clamp
    ids = [f"s{i}" for i in range(len(lengths))]

    def rates(width: int, n: int) -> tuple[float, float, float]:  # f, p, levels from the learned state itself
        f = (
            policy.acceptance.first[(width, n)].p
            if (width, n) in policy.acceptance.first
            else PRIOR_CONTINUE[n]
        )
        depth = policy.acceptance._depth.get((width, n))
        levels = width - 1.0 if depth is None else min(width - 1.0, max(depth.value, 0.0))
        return f, policy.acceptance.cont[n].p, levels

    def run(width: int, n: int, shift: float) -> float:
        f, p, levels = rates(width, n)
        return _run2(_clamp(f + shift), _clamp(p), levels)

    def check() -> None:
        got = policy.acceptance.expected(ids, lengths, ahead=ahead)
        for w in policy.widths[1:]:
            for i, (seq, n) in enumerate(zip(ids, lengths)):
                shift = policy.acceptance.seq_bias[seq].value if seq in policy.acceptance.seq_bias else 0.0
                if ahead:
                    hit = _clamp(rates(16, min(n, MAX_MATCH))[0] + shift) if n else 0.0
                    want = hit * run(w, min(n + 1, MAX_MATCH), shift) + (1 - hit) * run(w, 1, shift)
                else:
                    want = run(w, min(n, MAX_MATCH), shift) if n else 0.0
                assert got[w][i] == pytest.approx(want, rel=1e-12, abs=1e-12)

    check()
    for k, (n, accepted, censored, depth) in enumerate(steps):  # each observe must refresh the cached tables
        seq = ids[k % len(ids)]
        policy._lengths[seq] = n
        width = policy.widths[1 + k % (len(policy.widths) - 1)]
        policy.observe(
            1,
            width,
            0.05,
            {seq: min(accepted, width - 1)},
            censored={seq} if censored else set(),
            depths={seq: depth},
        )
        check()


def test_plain_steps_index_the_output_so_a_repetition_is_matched() -> None:
    # Regression: only verify steps indexed outputs, so a request that started repeating itself
    # while decoding plainly never found the repetition in the corpus and never speculated again.
    # D = 1: every step is a plain decode step; the prompt is not indexed, so all n-grams are output.
    spec = LLM(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=2048,
        speculative="ngram",
        spec_policy="fixed",
        num_draft_tokens=1,
        ngram_index_prompt=False,
    )
    out = spec.generate(GROUNDED[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    corpus = spec.engine.ngram.corpus
    # A step indexes the tokens committed before it: all but the last output token.
    tokens = list(out.prompt_token_ids) + out.token_ids[:-1]
    assert corpus.ngram_count(tuple(tokens[-4:])) >= 1
    assert corpus.match_length(tokens[:-1], 4) >= 3  # the last 3 tokens were seen followed by the next


def test_plain_steps_skip_indexing_where_it_would_cost_a_share_of_the_step() -> None:
    spec = LLM(
        device="cpu",
        dtype="float32",
        kv_cache_tokens=2048,
        speculative="ngram",
        spec_policy="fixed",
        num_draft_tokens=1,
    )
    upkeep = spec.engine.ngram.upkeep
    calls = []
    index = upkeep.index_outputs
    upkeep.index_outputs = lambda seqs, budget=None: (calls.append(len(seqs)), index(seqs, budget))  # type: ignore[method-assign]
    prompts = [GROUNDED[1], GROUNDED[2]]
    spec.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert calls == [2] * 11  # cheap next to a CPU step: every decode step indexes
    calls.clear()
    upkeep._index_cost = 10.0  # seconds per token: a host far slower than the step
    spec.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert calls == []  # the plain step cost is known by now: no step indexes
    # ... until PLAIN_INDEX_RETRY skipped steps re-measure it on one sequence: cheap after all, so
    # the steps after that index the whole batch again.
    spec.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert calls[0] == 1 and calls[1:] and set(calls[1:]) == {2}
    assert upkeep._index_cost < 1.0


def test_constrained_plain_steps_draft_no_shadow_trees(spec_llm: LLM) -> None:
    # Shadow trees are corpus trees; a constrained verify step drafts under its grammar and
    # accepts far more: their walks would teach the constrained model too little.
    eng = spec_llm.engine
    config = eng.config.speculative
    assert config is not None
    policy = AdaptiveDraftPolicy(max_width=8)
    for grammar in (NO_GRAMMAR, NO_GRAMMAR, "json_schema", "json_schema"):
        policy.observe(1, 1, 0.004, grammar=grammar)  # plain steps timed: shadows get a budget
    seq = Sequence("shadow-0", 0, list(range(200, 230)), SamplingParams(max_tokens=4), eng.tokenizer, 0, 512)
    upkeep = CorpusUpkeep(
        config, NgramCorpus.from_config(config), policy, copy.copy(eng.stats), torch.device("cpu")
    )
    shadowed: list[str] = []
    upkeep._shadow_step = lambda seqs, budget: shadowed.append("step")  # type: ignore[method-assign]
    upkeep.index_plain_step([seq], 0.0, "json_schema")
    assert shadowed == []
    upkeep.index_plain_step([seq], 0.0, NO_GRAMMAR)
    assert shadowed == ["step"]


def test_plain_steps_index_while_the_host_would_wait_for_the_device(spec_llm: LLM) -> None:
    # With overlap on a GPU the host waits for the device on every chained step (LLMEngine.read_wait):
    # indexing there is free, however dear next to the step, as long as it fits in the wait.
    eng = spec_llm.engine
    config = eng.config.speculative
    assert config is not None
    policy = AdaptiveDraftPolicy(max_width=16)
    for _ in range(2):
        policy.observe(2, 1, 0.004)  # a plain step: 4 ms at batch 2
    seqs = [
        Sequence(
            f"idle-{i}",
            0,
            list(range(200 + i, 230 + i)),
            SamplingParams(max_tokens=4),
            eng.tokenizer,
            seed=0,
            max_len=eng.max_model_len,
        )
        for i in range(2)
    ]
    stats = copy.copy(eng.stats)
    stats.last_step_seconds = 0.004  # the last plain step took a plain step's time: its work was hidden
    stub = SimpleNamespace(read_wait=0.0)  # what the engine's last commit waited for the device

    # The engine's own upkeep is left alone: this one has its own corpus, policy, stats and device.
    upkeep = CorpusUpkeep(config, NgramCorpus.from_config(config), policy, stats, torch.device("cpu"))

    def indexed() -> list[int]:
        return [len(s.token_ids) - upkeep.corpus.indexed_length(s.seq_id) for s in seqs]  # tokens behind

    upkeep._index_cost = 1e-3  # 1 ms per token: 2 ms for the batch, half the step
    upkeep.index_plain_step(seqs, stub.read_wait, NO_GRAMMAR)
    assert indexed() == [30, 30]  # no wait: skipped
    stub.read_wait = 0.0035  # the host waited 3.5 ms: 2 ms of indexing fits, with the 1 ms margin
    upkeep.index_plain_step(seqs, stub.read_wait, NO_GRAMMAR)
    assert indexed() == [0, 0]
    for s in seqs:
        s.token_ids.append(7)
    upkeep._index_cost, stub.read_wait = (
        1e-3,
        0.001,
    )  # what indexing left of the wait, plus its own time: too little
    upkeep._plain_host_seconds = 0.0005
    upkeep.index_plain_step(seqs, stub.read_wait, NO_GRAMMAR)
    assert indexed() == [1, 1]
    # The last engine step's own work counts as idle time when it was hidden (the step took a
    # plain step's time): 1 + 2.5 - 1 ms leaves room for 2 ms of indexing ...
    upkeep._index_cost, stub.read_wait, upkeep._plain_host_seconds = 1e-3, 0.001, 0.0025
    upkeep._plain_host_step = stats.steps - 1
    upkeep.index_plain_step(seqs, stub.read_wait, NO_GRAMMAR)
    assert indexed() == [0, 0]
    # ... not when that step took longer than plain steps do (the work delayed it) ...
    for s in seqs:
        s.token_ids.append(7)
    stats.last_step_seconds = 0.0065
    upkeep._index_cost, stub.read_wait, upkeep._plain_host_seconds = 1e-3, 0.001, 0.0025
    upkeep._plain_host_step = stats.steps - 1
    upkeep.index_plain_step(seqs, stub.read_wait, NO_GRAMMAR)
    assert indexed() == [1, 1]
    stats.last_step_seconds = 0.004
    # ... and not when it was spent before the last engine step (a prefill or verify step since).
    upkeep._index_cost, stub.read_wait, upkeep._plain_host_seconds = 1e-3, 0.001, 0.0025
    upkeep._plain_host_step = stats.steps - 2
    upkeep.index_plain_step(seqs, stub.read_wait, NO_GRAMMAR)
    assert indexed() == [1, 1]
    # A host-bound step (no wait) whose indexing took long: that time was not idle, no indexing.
    upkeep._plain_host_seconds, stub.read_wait, upkeep._index_cost = 0.01, 0.0, 1e-3
    upkeep.index_plain_step(seqs, stub.read_wait, NO_GRAMMAR)
    assert indexed() == [1, 1]
    # On CUDA the time allowed is the catch-up's budget too: the idle time less the margin, and
    # never more than a plain step's (a prefill's commit waited for the whole prefill).
    budgets: list[float | None] = []
    upkeep.index_outputs = lambda seqs, budget=None: budgets.append(budget)  # type: ignore[method-assign]
    upkeep.device = torch.device("cuda")
    for wait in (0.0035, 0.05):
        stub.read_wait, upkeep._index_cost, upkeep._plain_host_seconds = wait, 1e-3, 0.0
        upkeep.index_plain_step(seqs, stub.read_wait, NO_GRAMMAR)
    assert budgets == [pytest.approx(0.0025), pytest.approx(0.003)]


def test_a_budgeted_catch_up_indexes_the_sequences_furthest_behind_first(spec_llm: LLM) -> None:
    # A verify step on a GPU indexes only while its forward runs (the budget); the members cut off
    # stay behind and must come first next time, or the same members would never be indexed.
    eng = spec_llm.engine
    config = eng.config.speculative
    assert config is not None
    upkeep = CorpusUpkeep(
        config, NgramCorpus.from_config(config), AdaptiveDraftPolicy(16), EngineStats(), eng.device
    )
    seqs = [
        Sequence(
            f"budget-{i}",
            0,
            list(range(100 + i, 140 + i)),
            SamplingParams(max_tokens=4),
            eng.tokenizer,
            seed=0,
            max_len=eng.max_model_len,
        )
        for i in range(3)
    ]
    corpus = upkeep.corpus
    for turn in range(3):
        upkeep.index_outputs(seqs, budget=0.0)  # spent at once: one sequence per call
        assert [corpus.indexed_length(s.seq_id) > 0 for s in seqs] == [i <= turn for i in range(3)]
    seqs[0].token_ids.append(7)
    seqs[2].token_ids.extend([7, 8, 9])
    upkeep.index_outputs(seqs, budget=0.0)
    assert [corpus.indexed_length(s.seq_id) == len(s.token_ids) for s in seqs] == [False, True, True]
    upkeep.index_outputs(seqs, budget=None)
    assert all(corpus.indexed_length(s.seq_id) == len(s.token_ids) for s in seqs)


def test_the_catch_up_budget_is_a_plain_step_at_the_batch_size_and_only_on_cuda() -> None:
    policy = AdaptiveDraftPolicy(max_width=16)
    for _ in range(2):
        policy.observe(6, 1, 0.003)  # 3 ms for 6 sequences: 4 ms per step of the bucket of 8
    config = SpeculativeConfig()
    stats = EngineStats()
    upkeep = CorpusUpkeep(config, NgramCorpus.from_config(config), policy, stats, torch.device("cuda"))
    assert upkeep.index_budget(5, NO_GRAMMAR) == pytest.approx(0.0025)
    assert upkeep.index_budget(16, NO_GRAMMAR) is None  # bucket not timed
    cpu = CorpusUpkeep(config, NgramCorpus.from_config(config), policy, stats, torch.device("cpu"))
    assert cpu.index_budget(5, NO_GRAMMAR) is None


def test_freed_pages_are_never_read(spec_llm: LLM, llm: LLM) -> None:
    """Poison every page as it is freed: a verify step must move accepted KV before trimming.

    The poison is large but finite: masked (unwritten) slots are multiplied by an exact 0."""
    eng = spec_llm.engine
    alloc = eng.blocks.allocator
    original_free = alloc.free

    def poisoning_free(pages: list[int]) -> None:
        eng.runner.kv_cache[:, :, pages] = 1000.0
        original_free(pages)

    alloc.free = poisoning_free  # type: ignore[method-assign]
    try:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        prompts = GROUNDED[:3]
        spec = [o.token_ids for o in spec_llm.generate(prompts, params)]
    finally:
        alloc.free = original_free  # type: ignore[method-assign]
        eng.runner.kv_cache.zero_()
    assert spec == [o.token_ids for o in llm.generate(prompts, params)]


def test_policy_prices_and_times_widths_it_does_not_pick() -> None:
    """The per-bucket caches cover the policy's own widths; other widths are answered directly."""
    policy = AdaptiveDraftPolicy(16)
    assert 5 not in policy.widths
    for _ in range(2):
        policy.observe(1, 5, 0.002, {"s": 2}, depths={"s": 4})
    assert policy.step_cost(bucket_of(1), 5) == pytest.approx(0.002)
    assert policy.step_cost(bucket_of(1), 3) is None
    assert 0.0 < policy.expected_drafts("s", 2, 5) <= 4.0
    assert policy.expected_drafts("s", 0, 5) == 0.0


def test_accepted_path_kv_is_compacted_on_the_device_as_the_host_loop_would() -> None:
    """compact_accepted_kv moves, per request, path position j's node KV into slot j (1 <= j < len)
    and leaves every other slot as it was: checked against a per-token host loop on paths that
    jump across siblings, a path whose source slot is another position's own slot, and a request
    that accepted nothing."""
    import types

    import torch

    from ngrammar.runner.model_runner import ModelRunner

    torch.manual_seed(0)
    cache = torch.randn(2, 2, 4, 8, 1, 3)  # [layers, k/v, pages, page size, kv heads, d]
    runner = types.SimpleNamespace(kv_cache=cache.clone())
    # Request 0 on page 2 at kv 3..8 (slot = page * 8 + index % 8), request 1 on pages 0, 1 at kv 6..11.
    slots = torch.tensor([[19, 20, 21, 22, 23, 16 + 8 + 0], [6, 7, 8, 9, 10, 11]])
    nodes = torch.tensor(
        [
            [0, 2, 5, -1, -1, -1],  # root, then nodes 2 and 5 (not in place)
            [0, -1, -1, -1, -1, -1],
        ]
    )  # nothing accepted
    lens = torch.tensor([3, 1])
    narrow = types.SimpleNamespace(kv_cache=cache.clone())
    ModelRunner.compact_accepted_kv(runner, slots, nodes, lens)  # type: ignore[arg-type]
    # Only the first 3 positions can be on a path this deep; node 5 still lies beyond them.
    ModelRunner.compact_accepted_kv(narrow, slots, nodes[:, :3], lens)  # type: ignore[arg-type]
    want = cache.clone()
    flat_want = want.view(2, 2, 32, 1, 3)
    flat_old = cache.view(2, 2, 32, 1, 3)
    for b in range(2):
        for j in range(1, int(lens[b])):
            flat_want[:, :, slots[b, j]] = flat_old[:, :, slots[b, nodes[b, j]]]
    assert torch.equal(runner.kv_cache, want) and torch.equal(narrow.kv_cache, want)
    assert not torch.equal(want, cache)  # something did move


def test_a_start_up_profile_prices_widths_before_they_are_timed() -> None:
    """With each graph's device cost profiled at start-up, no verify width is chosen just to time
    it: after two plain steps each width is priced at plain x the profile's ratio, and a width's own
    steps then replace the profile's price (bucket 1, no grammar); a constrained bucket, whose host
    cost the profile lacks, is still timed."""
    policy = AdaptiveDraftPolicy(max_width=8)
    policy.costs.set_profile({(1, 1): 1e-3, (1, 2): 1.05e-3, (1, 4): 1.1e-3, (1, 8): 1.2e-3})
    chosen = _run_policy(policy, ["copy"], spec_time=0.06, spec_accept=5.0, steps=6, match_length=4)
    assert chosen[:2] == [1, 1]  # plain is timed first
    assert all(w > 1 for w in chosen[2:]) and policy.reason != "time"
    b = (1, NO_GRAMMAR)
    timed = {w for w in (2, 4, 8) if (rec := policy.costs.step_time.get((b, w))) and len(rec.samples) >= 2}
    assert timed, "a width that ran twice is priced by its own steps"
    for w in (2, 4, 8):
        expected = 0.06 if w in timed else 0.05 * policy.costs._profile[(1, w)] / 1e-3
        assert policy.step_cost(b, w) == pytest.approx(expected)
    assert policy.step_cost((1, "json_schema"), 8) is None  # no grammar's host cost in the profile
