"""Prefix cache and mixed steps on the real model: greedy outputs are those of an engine with
neither (shared-prefix batches, n > 1, multi-turn chats, NGRAM, grammars, arrivals and aborts)."""

from __future__ import annotations

import pytest

from ngrammar import LLM, SamplingParams
from ngrammar.outputs import CompletionOutput, RequestOutput

# Several engines with the cache on and off: run with `pytest -m slow` (the page state machine,
# tests/test_prefix_cache_state.py, runs in every CI run).
pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a careful assistant for a shop that sells bicycles, helmets and locks. Answer briefly, "
    "in plain words, and never invent a product. Reply in JSON when asked."
)
QUESTIONS = ["Which lock is best?", "Do you sell red helmets?", "How much is a bicycle?", "Are you open?"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def ref() -> LLM:
    """The same model without a prefix cache or mixed steps."""
    return LLM(device="cpu", dtype="float32", kv_cache_tokens=4096, prefix_cache=False, mixed_steps=False)


def _tokens(outs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _check_pool(llm: LLM) -> None:
    alloc = llm.engine.blocks.allocator
    alloc.check_integrity()
    assert alloc.num_used == 0  # every page is free or cached


def test_shared_prefixes_n_and_chats_match_no_cache(llm: LLM, ref: LLM) -> None:
    prompts = [f"{SYSTEM}\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
    blocks = llm.engine.blocks
    hits = blocks.hit_tokens
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts[::-1], GREEDY)
    expected = ref.generate(prompts, GREEDY)
    assert _tokens(first) == _tokens(expected) == _tokens(again[::-1])
    assert blocks.hit_tokens - hits >= 6 * 16  # the system prompt's pages, shared
    assert all(o.metrics["cached_tokens"] >= 32 for o in again)
    assert all(o.metrics["cached_tokens"] == 0 for o in expected)
    # n > 1: the samples share the prompt's pages (seeded sampling: the same draws)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, n=3, seed=11, ignore_eos=True)
    assert _tokens(llm.generate(prompts[:2], sampled)) == _tokens(ref.generate(prompts[:2], sampled))
    # a multi-turn chat: turn 2's prompt holds turn 1 (template, question and answer)
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    one = llm.chat(chat, GREEDY)[0]
    chat2 = chat + [{"role": "assistant", "content": one.text}, {"role": "user", "content": QUESTIONS[1]}]
    two = llm.chat(chat2, GREEDY)[0]
    assert one.token_ids == ref.chat(chat, GREEDY)[0].token_ids
    assert two.token_ids == ref.chat(chat2, GREEDY)[0].token_ids
    assert two.metrics["cached_tokens"] >= 32
    _check_pool(llm)


def test_ngram_and_grammars_match_no_cache(spec_llm: LLM, ref: LLM) -> None:
    prompts = [f"{SYSTEM}\nQuestion: {q}\nAnswer in JSON:" for q in QUESTIONS[:3]]
    params = [
        SamplingParams(max_tokens=16, temperature=0, json_schema=SCHEMA),
        SamplingParams(max_tokens=16, temperature=0, regex=r"(yes|no), [a-z ]{3,20}\."),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    ]
    expected = _tokens(ref.generate(prompts, params))
    assert _tokens(spec_llm.generate(prompts, params)) == expected
    assert _tokens(spec_llm.generate(prompts, params)) == expected  # now from the cache
    assert spec_llm.engine.stats.verify_steps > 0
    _check_pool(spec_llm)


def test_ngram_and_grammars_with_arrivals_mid_flight(spec_llm: LLM, ref: LLM) -> None:
    """Requests join NGRAM / grammar-constrained requests mid-flight (their prefill rides along the
    others' plain steps); every output is still plain greedy decoding's."""
    eng = spec_llm.engine
    prompts = [f"{SYSTEM}\nQuestion: {q}\nAnswer in JSON:" for q in QUESTIONS]
    params = [
        SamplingParams(max_tokens=14, temperature=0, json_schema=SCHEMA),
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
    ]
    mixed = eng.stats.mixed_steps
    ids: list[str] = []
    done: dict[str, list[int]] = {}
    for k in range(300):
        if k in (0, 2, 4, 6):
            i = len(ids)
            ids.append(eng.add_request(prompts[i], params[i % 2]))
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if len(ids) == 4 and not eng.has_unfinished():
            break
    assert eng.stats.mixed_steps > mixed
    expected = ref.generate(prompts, [params[i % 2] for i in range(4)])
    assert [done[i] for i in ids] == [list(o.outputs[0].token_ids) for o in expected]
    _check_pool(spec_llm)


def test_arrivals_and_aborts_mid_flight(llm: LLM, ref: LLM) -> None:
    """Requests sharing a prefix join while others decode (mixed steps) and leave by abort; the
    survivors' outputs are unchanged and every reference is released exactly."""
    eng = llm.engine
    prompts = [f"{SYSTEM} Tell me a story number {i} about a red bicycle." for i in range(4)]
    long_prompt = " ".join([SYSTEM] * 12) + " Summarize."  # longer than a mixed step's budget
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    results: dict[str, list[int]] = {}
    ids = [eng.add_request(prompts[0], params), eng.add_request(prompts[1], params)]
    mixed = eng.stats.mixed_steps
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 3:
            ids.append(eng.add_request(long_prompt, params))
            ids.append(eng.add_request(prompts[2], params))
        if steps == 4:
            eng.abort(ids[1])
        if steps == 5:
            ids.append(eng.add_request(prompts[3], params))
            ids.append(eng.add_request(prompts[0], params))
    assert eng.stats.mixed_steps > mixed
    survivors = [prompts[0], long_prompt, prompts[2], prompts[3], prompts[0]]
    expected = [o.outputs[0].token_ids for o in ref.generate(survivors, params)]
    assert [results[i] for i in ids[:1] + ids[2:]] == expected
    assert len(results[ids[1]]) < 10  # aborted mid-flight
    _check_pool(llm)
    evicted = eng.blocks.allocator.evict_all()
    assert evicted > 0 and eng.blocks.allocator.num_free == eng.blocks.allocator.num_pages


def test_mixed_steps_match_separate_steps(llm: LLM, ref: LLM) -> None:
    """Decode streams keep going while a long prompt prefills in chunks riding along their steps
    (the CPU's mixed step holds 64 tokens); every greedy token is what separate prefill and decode
    steps give."""
    streams = [f"Count slowly from {i} to one hundred:" for i in (1, 20, 40)]
    long_prompt = " ".join([SYSTEM] * 4) + " Summarize."
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    before = llm.engine.stats.mixed_steps
    outs = []
    for engine in (llm, ref):
        eng = engine.engine
        ids = [eng.add_request(p, params) for p in streams]
        done: dict[str, list[int]] = {}
        for k in range(200):
            if k == 2:
                ids.append(eng.add_request(long_prompt, params))
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            if not eng.has_unfinished():
                break
        outs.append([done[i] for i in ids])
    assert outs[0] == outs[1]
    assert llm.engine.stats.mixed_steps - before >= 2  # the long prompt took several mixed steps
    assert ref.engine.stats.mixed_steps == 0


def test_usage_reports_cached_tokens() -> None:
    from ngrammar.server.rendering import outputs_usage

    def out(prompt: int, cached: int) -> RequestOutput:
        c = CompletionOutput(0, "x", [1, 2], "stop", None, None, False)
        return RequestOutput("r", list(range(prompt)), [c], True, {"cached_tokens": cached})

    usage = outputs_usage([out(40, 32), out(10, 0)])
    assert usage.prompt_tokens == 50 and usage.completion_tokens == 4
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 32
