"""Engine foundation on the real embedded model: parity with transformers, batching, sampling."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngrammar import LLM, InvalidRequestError, SamplingParams
from ngrammar.runner.model_runner import StepInput

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "List three colors:",
]

GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


def test_logits_match_transformers(llm: LLM, hf_model) -> None:  # type: ignore[no-untyped-def]
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog because it")
    runner = llm.engine.runner
    blocks = llm.engine.blocks
    pages = blocks.allocator.allocate(-(-len(ids) // blocks.page_size))
    try:
        step = StepInput([ids], [list(range(len(ids)))], [0], [pages], list(range(len(ids))))
        ours = runner.forward(step)
    finally:
        blocks.allocator.free(pages)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel.item() <= 1e-4


def test_greedy_matches_transformers_generate(llm: LLM, hf_model) -> None:  # type: ignore[no-untyped-def]
    """Each of the 64 greedy tokens is transformers' argmax after the prompt and the tokens before
    it: what transformers' greedy ``generate`` emits, checked in one forward over the whole text per
    prompt rather than 64 decode steps."""
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        assert len(out.token_ids) == 64
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + out.token_ids[:-1]])).logits[0, len(ids) - 1 :]
        assert logits.argmax(-1).tolist() == out.token_ids, prompt


def test_batched_equals_one_at_a_time(llm: LLM) -> None:
    prompts = [("word " * n) + "The end of the story is" for n in (0, 3, 9, 17, 30, 55, 80, 120)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    assert together == alone


def test_joining_mid_flight_does_not_change_outputs(llm: LLM) -> None:
    eng = llm.engine
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    first = eng.add_request("Tell me about the moon.", params)
    results = {}
    steps = 0
    second = None
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        steps += 1
        if steps == 5:
            second = eng.add_request("Why is the sky blue?", params)
    assert second is not None
    assert results[first] == llm.generate("Tell me about the moon.", params)[0].token_ids
    assert results[second] == llm.generate("Why is the sky blue?", params)[0].token_ids


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = llm.generate("A story about a dragon:", p)[0].token_ids
    b = llm.generate(["A story about a dragon:", "Something else entirely"], [p, p])[0].token_ids
    assert a == b
    c = llm.generate("A story about a dragon:", SamplingParams(**{**_fields(p), "seed": 99}))[0].token_ids
    assert a != c


def test_n_completions_differ_and_min_p(llm: LLM) -> None:
    out = llm.generate(
        "My favourite animal is",
        SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=7, min_p=0.05, ignore_eos=True),
    )[0]
    assert len(out.outputs) == 3
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_max_tokens_and_stop_strings_exact(llm: LLM) -> None:
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    full = llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[
        0
    ].text
    stop = " 6,"
    assert stop in full
    stopped = llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=20, temperature=0, stop=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(stop)]


def test_lazy_text_is_exact_when_read_every_step_or_only_at_the_end(llm: LLM) -> None:
    """Text is detokenized on demand (every step only for stop strings): streamed deltas, the final
    text of a stream and of a non-streaming run agree, with and without a stop string."""
    eng = llm.engine
    prompt = "Count: 1, 2, 3,"
    for stop in ([], [" 6,"]):
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=stop)
        finals = {}
        for stream in (True, False):
            rid = eng.add_request(prompt, params, stream=stream)
            seen = ""
            while eng.has_unfinished():
                for out in eng.step():
                    if out.request_id == rid:
                        assert out.text.startswith(seen)  # visible text only ever grows
                        seen = out.text
                        if out.finished:
                            finals[stream] = out
        assert finals[True].text == finals[False].text
        assert finals[True].token_ids == finals[False].token_ids
        if not stop:
            assert finals[False].text == eng.tokenizer.decode(finals[False].token_ids)
        else:
            assert finals[False].finish_reason == "stop" and not finals[False].text.endswith(" 6,")


def test_stop_token_ids_and_logprobs(llm: LLM) -> None:
    base = llm.generate(
        "Count: 1, 2, 3,", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    )[0]
    assert base.logprobs is not None and len(base.logprobs) == 6
    for tok, lp in zip(base.token_ids, base.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0
        assert lp.top[0][0] == tok  # greedy: the chosen token is the most likely one
        assert len(lp.top) == 3
    j = next(i for i in range(1, 6) if base.token_ids[i] not in base.token_ids[:i])
    target = base.token_ids[j]
    out = llm.generate(
        "Count: 1, 2, 3,", SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[target])
    )[0]
    assert out.token_ids == base.token_ids[: j + 1] and out.finish_reason == "stop"
    # The stop token's text is not the output's (vLLM's default); a stop string's is cut too.
    before = llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=j, temperature=0, ignore_eos=True))[0]
    assert out.text == before.text


def test_chat_template(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        SamplingParams(max_tokens=8, temperature=0),
    )[0]
    assert "Paris" in out.text
    m = out.metrics
    assert m["prompt_tokens"] > 10 and m["completion_tokens"] >= 1
    # absolute stamps (the decode phase of a batch spans its last first token to its last finish)
    assert m["first_token_time"] <= m["finish_time"]
    assert m["finish_time"] - m["first_token_time"] == pytest.approx(m["e2e_latency_s"] - m["ttft_s"])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=-1),
        dict(max_tokens=0),
        dict(temperature=-0.5),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-3),
        dict(n=0),
        dict(logprobs=99),
        dict(regex="a", json_object=True),
        # Regression: these passed validation and then failed inside an engine step (int64 tensors,
        # torch.topk, a temperature that overflows the logits), which left the request queued.
        dict(seed=2**64),
        dict(seed=2**63 - 1, n=2),
        dict(seed=True),
        dict(top_k=2**70),
        dict(logprobs=1.5),
        dict(logprobs=True),
        dict(temperature=float("inf")),
        dict(temperature=float("nan")),
        dict(max_tokens=True),
        # ... and these raised TypeError rather than the request error
        dict(temperature="0.5"),
        dict(stop=[1]),
        dict(json_object="yes"),
    ],
)
def test_bad_sampling_params(kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_extreme_but_valid_sampling_params_run(llm: LLM) -> None:
    """The int64 bounds themselves are accepted, and a temperature too small to divide the logits
    by (1e-40 made every probability NaN and sampled token 0 over and over) decodes greedily."""
    SamplingParams(seed=2**63 - 1)
    SamplingParams(seed=-(2**63), n=64, top_k=2**31 - 1)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tiny = SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True, seed=3, top_k=2**31 - 1)
    assert tiny.greedy
    assert llm.generate("Hello", tiny)[0].token_ids == llm.generate("Hello", greedy)[0].token_ids
    out = llm.generate(
        "Give me a JSON object.", SamplingParams(max_tokens=8, temperature=1e-40, json_object=True)
    )[0]
    assert out.outputs[0].error is None and out.text.startswith("{")


def test_a_step_that_raises_leaves_nothing_queued(llm: LLM) -> None:
    """Regression: when an engine step raised inside ``generate``, its requests stayed queued with
    their KV pages, and every later call stepped them again and failed the same way."""
    engine = llm.engine
    steps = 0

    def failing_step() -> Any:
        nonlocal steps
        steps += 1
        if steps == 2:  # after the prefill: the request holds pages
            raise RuntimeError("injected failure")
        return type(engine).step(engine)

    engine.step = failing_step  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate(["Hello", "Tell me a story."], SamplingParams(max_tokens=8, temperature=0))
    finally:
        del engine.step
    assert not engine.requests and not engine.scheduler.has_work()
    alloc = engine.blocks.allocator
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_pages
    assert llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0))[0].finish_reason == "length"


def test_bad_prompts_fail_alone(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="role and content"):  # was a jinja UndefinedError
        llm.chat([{"role": "user"}], SamplingParams(max_tokens=2))
    too_long = [5] * (llm.engine.max_model_len + 10)
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate([too_long], SamplingParams(max_tokens=2))
    assert llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0))[0].finish_reason == "length"
    llm.engine.blocks.allocator.check_integrity()
    assert llm.engine.blocks.allocator.num_free == llm.engine.blocks.allocator.num_pages


def test_bad_model_paths(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ngrammar.model.loader import ModelLoadError, resolve_checkpoint

    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ModelLoadError, match="neither a GGUF"):
        resolve_checkpoint(junk)


def test_long_prompt_is_chunked(llm: LLM) -> None:
    # A small prefill budget: the same chunking as a prompt past the default 2,048 tokens, at a
    # fraction of the attention work.
    chunked = LLM(device="cpu", dtype="float32", kv_cache_tokens=4096, max_prefill_tokens=128)
    eng = chunked.engine
    prompt = " ".join(f"item{i}" for i in range(150))  # > max_prefill_tokens: several chunks
    assert len(chunked.tokenizer.encode(prompt)) > 3 * eng.config.max_prefill_tokens
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    a = chunked.generate(prompt, params)[0]
    assert a.token_ids == llm.generate(prompt, params)[0].token_ids  # one chunk there
    assert eng.blocks.allocator.num_free == eng.blocks.allocator.num_pages


def test_preemption_under_a_tiny_pool() -> None:
    small = LLM(device="cpu", dtype="float32", kv_cache_tokens=256, page_size=16, max_prefill_tokens=64)
    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    together = [o.token_ids for o in small.generate(prompts, params)]
    alone = [small.generate(p, params)[0].token_ids for p in prompts[:2]]
    assert together[:2] == alone
    small.engine.blocks.allocator.check_integrity()
    assert small.engine.blocks.allocator.num_free == small.engine.blocks.allocator.num_pages


NEWEST_PROMPTS = ["The meaning of life is", "My favourite recipe for dinner is"]  # ~45 tokens each in all
NEWEST_PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def newest_reference(llm: LLM) -> list[list[int]]:
    """The session engine's outputs (a pool with room for both) for NEWEST_PROMPTS."""
    return [o.token_ids for o in llm.generate(NEWEST_PROMPTS, NEWEST_PARAMS)]


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_the_newest_request_waits_rather_than_fails_when_older_ones_hold_the_pool(
    newest_reference: list[list[int]], speculative: str | None
) -> None:
    """Regression: when the sequence that could not grow was itself the newest running one, it
    failed ("the KV cache is too small") although it fits the pool alone; it is preempted now and
    recomputed once the older one has finished."""
    small = LLM(device="cpu", dtype="float32", kv_cache_tokens=64, page_size=16, speculative=speculative)
    outs = small.generate(NEWEST_PROMPTS, NEWEST_PARAMS)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert [o.token_ids for o in outs] == newest_reference
    alloc = small.engine.blocks.allocator
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_pages


def test_a_preempted_request_is_not_recomputed_at_every_step(llm: LLM) -> None:
    """Regression (review): re-admitted into just the pages it gave up, the preempted request was
    prefilled again and preempted again at every step until the older one had finished."""
    small = LLM(device="cpu", dtype="float32", kv_cache_tokens=80, page_size=16)
    prompts = [
        llm.tokenizer.encode("The quick brown fox jumps over the lazy dog and then"),
        llm.tokenizer.encode("Hello there my"),
    ]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, params)]
    # Both prompts once, then the newer one's context once more (it waited for the older one).
    assert small.engine.stats.prefill_tokens <= len(prompts[0]) + len(prompts[1]) + len(prompts[1]) + 60


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_a_request_outgrowing_the_pool_fails_and_frees_its_pages(speculative: str | None) -> None:
    small = LLM(device="cpu", dtype="float32", kv_cache_tokens=64, page_size=16, speculative=speculative)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    out = small.generate("Count from one to one hundred: one, two, three,", params)[0]
    assert out.finish_reason == "error"
    alloc = small.engine.blocks.allocator
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_pages  # the failed sequence's pages were released
    if small.engine.ngram is not None:
        assert not small.engine.ngram.policy.acceptance.seq_bias and not small.engine.ngram.policy._lengths


def _fields(p: SamplingParams) -> dict:  # type: ignore[type-arg]
    return {k: getattr(p, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "ignore_eos")}


def test_abort_before_prefill_is_not_revived(llm: LLM) -> None:
    eng = llm.engine
    rid = eng.add_request("Tell me a long story.", SamplingParams(max_tokens=8, temperature=0))
    eng.abort(rid)
    outs = eng.step()
    assert [o.request_id for o in outs] == [rid]
    assert outs[0].finished and outs[0].finish_reason == "abort" and outs[0].token_ids == []
    assert not eng.has_unfinished()
    assert eng.blocks.allocator.num_free == eng.blocks.allocator.num_pages


def test_sampling_uniforms_stay_strictly_inside_the_unit_interval() -> None:
    """A uniform of exactly 1.0 made -log(u) = 0, so a zero-probability (grammar-masked) token won the
    sampler's race as NaN; the extreme hashes must map strictly inside (0, 1)."""
    from ngrammar.runner.sampler import unit_interval

    bits = torch.tensor([0, 1, 2**9 - 1, 2**31, 2**32 - 2**9, 2**32 - 1], dtype=torch.int64)
    u = unit_interval(bits)
    assert u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert bool((-torch.log(u) > 0).all())


def test_a_sequence_stops_at_the_end_of_its_context(llm: LLM) -> None:
    """The context end is the sequence's own stop condition, like max_tokens: an appended run (a
    verify step's, or one token) keeps only what fits, finishing with "length"."""
    from ngrammar.engine.sequence import Sequence

    seq = Sequence(
        "ctx",
        0,
        [1, 2, 3],
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        llm.tokenizer,
        seed=0,
        max_len=6,
    )
    assert seq.remaining_tokens == 3
    assert seq.append_tokens([7, 8, 9, 10, 11]) == 3
    assert seq.token_ids == [1, 2, 3, 7, 8, 9] and seq.finish_reason == "length"


def test_plain_decoding_stops_at_the_end_of_the_context(llm: LLM) -> None:
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5)
    short = LLM(device="cpu", dtype="float32", kv_cache_tokens=2048, max_model_len=64)
    out = short.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    reference = llm.generate([ids], SamplingParams(max_tokens=64 - len(ids), temperature=0, ignore_eos=True))[
        0
    ]
    assert out.finish_reason == "length" and out.token_ids == reference.token_ids
    alloc = short.engine.blocks.allocator
    assert alloc.num_free == alloc.num_pages


MULTIBYTE = " 🙃🙃 🙏🙏🙏 naïve café 東京タワー — done ✓"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=1, max_value=40), max_size=12), drop=st.integers(0, 2))
def test_incremental_text_keeps_every_complete_character(llm: LLM, cuts: list[int], drop: int) -> None:
    """Regression: a step whose new tokens ended inside a character emitted nothing, not even the
    complete characters before it, and nothing flushed them at the finish: a verify step ending
    mid-emoji lost up to a whole run of text, and a non-streamed output decoded once could be empty."""
    from ngrammar.model.tokenizer import IncrementalDetokenizer

    ids = llm.tokenizer.encode(MULTIBYTE)
    ids = ids[: len(ids) - drop]  # may end inside a character: that one alone is held back
    detok = IncrementalDetokenizer(llm.tokenizer)
    deltas = [detok.step(ids[:k]) for k in sorted({min(c, len(ids)) for c in cuts} | {len(ids)})]
    assert "".join(deltas) == detok.text == llm.tokenizer.decode(ids).rstrip("\ufffd")


def test_a_run_appended_at_once_keeps_its_text(llm: LLM) -> None:
    from ngrammar.engine.sequence import Sequence

    ids = llm.tokenizer.encode(" 🙃🙃 🙏🙏🙏")  # 15 tokens, 3 per emoji
    seq = Sequence(
        "utf8",
        0,
        [1],
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
        llm.tokenizer,
        seed=0,
        max_len=64,
    )
    seq.append_tokens(ids)  # one verify-sized run, cut by max_tokens inside the last emoji
    assert seq.finish_reason == "length" and seq.text == " 🙃🙃 🙏🙏"


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    """Regression (bug hunt): stop_token_ids [-3, 99999999] were taken, and could never match."""
    vocab = llm.engine.model_config.vocab_size
    for bad in ([-3], [vocab], [2, 99_999_999]):
        with pytest.raises(InvalidRequestError, match="stop_token_ids"):
            llm.generate("Hi", SamplingParams(max_tokens=2, stop_token_ids=bad))
    assert llm.engine.requests == {}
    assert llm.generate("Hi", SamplingParams(max_tokens=2, stop_token_ids=[vocab - 1]))[0].outputs


def test_sampling_params_take_none_and_refuse_bad_types_as_request_errors(llm: LLM) -> None:
    """Regressions: stop=None was a TypeError (vLLM takes it as none); top_p="0.5" and
    stop_token_ids=["a"] raised TypeError / ValueError instead of a request error; a tuple of
    token ids was taken for a batch of prompts."""
    import numpy as np

    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()  # type: ignore[arg-type]
    # (Review) any iterable and numpy numbers still work, as before.
    numpy_made = SamplingParams(
        stop={"x"}, stop_token_ids=np.array([2, 3]), top_p=np.float32(0.5), max_tokens=np.int64(4)
    )
    assert numpy_made.stop == ("x",) and numpy_made.stop_token_ids == (2, 3)
    for bad in (dict(top_p="0.5"), dict(min_p="0"), dict(stop_token_ids=["a"]), dict(stop=5), dict(regex=5)):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    ids = tuple(llm.tokenizer.encode("The capital of France is"))
    params = SamplingParams(max_tokens=2, temperature=0)
    assert llm.generate(ids, params)[0].token_ids == llm.generate([list(ids)], params)[0].token_ids


def test_a_bad_tokenizer_fails_before_any_weight_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the builder loaded the tokenizer after the runner (weights read, TP ranks started)."""
    from ngrammar.config import EngineConfig
    from ngrammar.engine import builder

    built: list[str] = []

    def bad_tokenizer(*args: object, **kwargs: object) -> None:
        raise ValueError("bad tokenizer.json")

    monkeypatch.setattr(builder, "Tokenizer", bad_tokenizer)
    monkeypatch.setattr(builder, "ModelRunner", lambda *a, **k: built.append("runner"))
    with pytest.raises(ValueError, match="bad tokenizer"):
        builder.build_parts(EngineConfig(device="cpu", kv_cache_tokens=256))
    assert built == []


def test_offline_inputs_of_the_wrong_shape_are_refused_by_name(llm: LLM) -> None:
    """Regressions (bug hunt): llm.chat("hi") generated two plain prompts, "h" and "i", and
    llm.chat(["hi"]) one without the chat template; token ids 1.7, "12" and True were silently
    int()-ed into other tokens; params as a dict or a generator, and a prompt that was None or a
    dict, failed with an AttributeError / TypeError from deep inside."""
    import numpy as np

    params = SamplingParams(max_tokens=2, temperature=0)
    for bad in ("hi", ["hi"], [["hi"]], [1, 2, 3]):
        with pytest.raises((InvalidRequestError, TypeError), match="conversation"):
            llm.chat(bad, params)  # type: ignore[arg-type]
    for ids in ([1.7, 2.0], ["12", "13"], [True, False]):
        with pytest.raises(InvalidRequestError, match="token ids must be integers"):
            llm.generate([ids], params)  # type: ignore[list-item]
    for prompt in ([None], [{"role": "user", "content": "hi"}]):
        with pytest.raises(InvalidRequestError, match="a prompt is text"):
            llm.generate(prompt, params)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prompts must be a list"):
        llm.generate(None, params)  # type: ignore[arg-type]
    for bad_params in ({"max_tokens": 2}, [{"max_tokens": 2}]):
        with pytest.raises(TypeError, match="params must be a SamplingParams"):
            llm.generate(["Hi"], bad_params)  # type: ignore[arg-type]
    assert llm.engine.requests == {}
    # What is valid still runs: numpy / tensor ids, a generator of params, a tuple conversation.
    ref = llm.generate([[1, 2]], params)[0].token_ids
    assert llm.generate([np.int64(1), np.int64(2)], params)[0].token_ids == ref  # type: ignore[list-item]
    assert llm.generate([np.array([1, 2])], params)[0].token_ids == ref  # type: ignore[list-item]
    assert llm.generate([torch.tensor([1, 2])], params)[0].token_ids == ref  # type: ignore[list-item]
    outs = llm.generate(["Hi", "Yo"], (p for p in [params, params]))
    assert [len(o.token_ids) for o in outs] == [2, 2]
    msg = {"role": "user", "content": "Hi"}
    assert llm.chat((msg,), params)[0].token_ids == llm.chat([[msg]], params)[0].token_ids
