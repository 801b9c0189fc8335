"""The benchmark harness itself: what it pairs and in which order (no model needed)."""

from __future__ import annotations

from typing import Any

import pytest
from policy_pins import pin_step_costs

import benchmarks.bench_spec as bench_spec
from benchmarks.common import WorkItem


def test_paired_runs_alternate_which_side_goes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    plain, spec = object(), object()
    order: list[str] = []
    rates = {id(plain): 10.0, id(spec): 20.0}

    def measure(llm: Any, prompts: list[Any], max_tokens: int) -> bench_spec.RunFigures:
        if max_tokens == 64:  # the warm-up runs use 8 tokens
            order.append("plain" if llm is plain else "spec")
        return bench_spec.RunFigures(rates[id(llm)], 1.0, 0.0, 0.0, 0.0)

    monkeypatch.setattr(bench_spec, "measure", measure)
    monkeypatch.setattr(bench_spec, "load_workload", lambda: [WorkItem("rag", "grounded", "p")])
    out = bench_spec.run_spec_benchmark(plain, spec, batch_sizes=(8,), repeats=3)  # type: ignore[arg-type]
    assert order == ["plain", "spec", "spec", "plain", "plain", "spec"]
    assert out["b8/rag"]["pair_ratios"] == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("engine", ["llm", "spec_llm"])
def test_grammar_equal_work_emits_the_same_tokens_on_both_sides(
    engine: str, request: pytest.FixtureRequest
) -> None:
    """The equal-work grammar comparison (plain and NGRAM) is only fair if both sides emit the same tokens.

    The benchmark's extraction prompts, the first cut to its first person: its JSON ends (with EOS)
    after 27 tokens, the other's is cut at max_tokens (both full prompts need 96 tokens for that)."""
    from benchmarks.bench_grammar import PEOPLE, extraction_prompts
    from benchmarks.common import chat
    from benchmarks.gpu_bench import grammar_equal_work

    name, age, city = PEOPLE[0]
    one = chat(
        f"{name} is {age} years old and lives in {city}.\n\nExtract every person with name, age and city as JSON."
    )
    prompts = [one, extraction_prompts(2)[1]]
    out = grammar_equal_work(request.getfixturevalue(engine), prompts, max_tokens=32, repeats=1)
    assert out["identical"] == 1.0
    assert 32 < out["tokens"] < 2 * 32  # both ran, and one ended its JSON (with EOS) before max_tokens
    assert out["ratio"] > 0 and out["free_tok_s"] > 0
    assert "steps" in out  # what the runs were made of, step kinds with their policy reasons


def test_calibration_pairs_each_priced_verify_step_with_what_it_accepted() -> None:
    from benchmarks.bench_calibration import run_calibration
    from ngrammar import LLM

    spec = LLM(device="cpu", dtype="float32", kv_cache_tokens=4096, speculative="ngram", num_draft_tokens=8)
    pin_step_costs(spec)  # the policy verifies whatever the machine's load
    out = run_calibration(spec, categories=("code_edit",), max_tokens=24, per_category=1)
    lengths = [k for k in out if k.startswith("match ")]
    assert lengths and sum(out[k]["steps"] for k in lengths) > 0
    # One pair per exploit or explore verify step (batch 1: one member), never more than ran.
    assert sum(out[k]["steps"] for k in lengths) <= spec.engine.stats.spec_steps
    assert all(out[k]["expected"] > 0 and 0 <= out[k]["accepted"] <= 7 for k in lengths)


def test_links_equal_work_runs_both_link_paths_on_the_same_tokens(spec_llm: Any) -> None:
    """Host-derived links against the readback switch: a fair comparison only if both emit the same
    tokens, and the switch is off again afterwards."""
    from benchmarks.bench_grammar import extraction_prompts
    from benchmarks.gpu_bench import links_equal_work

    stats = spec_llm.engine.stats
    steps = stats.spec_steps
    out = links_equal_work(spec_llm, extraction_prompts(2), max_tokens=12, repeats=1)
    assert out["identical"] == 1.0
    assert out["host_links_tok_s"] > 0 and out["readback_tok_s"] > 0 and out["ratio"] > 0
    assert out["host_links_verify_ms"] > 0 and out["readback_verify_ms"] > 0
    assert stats.spec_steps >= steps + 4  # each of the four runs verified
    assert spec_llm.engine.ngram.readback_links is False


def test_draft_replay_accepts_copied_text_and_nothing_of_novel_text() -> None:
    from benchmarks.bench_draft_quality import Stream, accept_lengths, replay_steps

    prompt = list(range(100, 160))
    copy = Stream("copy", prompt, prompt[:40])  # the output repeats the prompt: drafts follow it
    novel = Stream("novel", prompt, list(range(1000, 1040)))  # tokens never seen: nothing accepted
    steps = replay_steps(copy, 8)
    assert sum(steps) == 39 and max(steps) == 8  # every step but the last emits a full chain
    assert replay_steps(novel, 8) == [1] * 39
    assert replay_steps(copy, 4, match_type="PROB") == [4] * 9 + [3]
    got = accept_lengths([copy, novel], 8)
    assert got["novel"] == 1.0 and got["copy"] == pytest.approx(39 / len(steps))


def test_the_oracle_chain_bounds_the_corpus_drafts() -> None:
    from benchmarks.bench_draft_quality import Stream, accept_lengths, oracle_steps, replay_steps

    prompt = list(range(100, 160))
    copy = Stream("copy", prompt, prompt[:40])
    assert oracle_steps(copy, 8) == replay_steps(copy, 8)  # a plain copy: both draft full chains
    assert oracle_steps(Stream("novel", prompt, list(range(1000, 1040))), 8) == [1] * 39
    # Two sources that share their first tokens: BFS follows the more recent one, the oracle the
    # right one; the oracle is never worse, and here better.
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 10, 11, 12, 13]
    mixed = Stream("mixed", a + [50] + b + [50], [1, 2, 3, 4, 5, 6, 7, 8, 60])
    ora, rep = accept_lengths([mixed], 8, oracle=True), accept_lengths([mixed], 8)
    assert ora["mixed"] > rep["mixed"]
    assert sum(oracle_steps(mixed, 8)) == sum(replay_steps(mixed, 8)) == 8


def test_the_serve_plot_groups_levels_by_mode_in_concurrency_order(tmp_path: Any) -> None:
    import json

    from benchmarks.plot_serve import main, series

    def level(mode: str, c: int, tok_s: float) -> dict[str, Any]:
        return {
            "mode": mode,
            "speculative": mode != "off",
            "concurrency": c,
            "throughput_tok_s": tok_s,
            "tpot_p50_ms": 10.0 * c,
            "tpot_p99_ms": 20.0 * c,
        }

    log = {"result": {"levels": [level("off", 4, 40.0), level("ngram", 1, 12.0), level("off", 1, 10.0)]}}
    assert series(log) == {
        "off": [(1, 10.0, 10.0, 20.0), (4, 40.0, 40.0, 80.0)],
        "ngram": [(1, 12.0, 10.0, 20.0)],
    }
    src, dst = tmp_path / "sweep.json", tmp_path / "sweep.png"
    src.write_text(json.dumps(log))
    main(str(src), str(dst))
    assert dst.stat().st_size > 0


def test_the_replay_benchmark_reproduces_its_recording_on_another_shape() -> None:
    """gpu_bench's replay part on a CPU, small: the other shape's NGRAM engine replays SmolLM2's
    recorded outputs exactly, and the controls are reported."""
    import dataclasses

    from benchmarks.gpu_bench import LLAMA3_8B, bench_replay

    shape = dataclasses.replace(
        LLAMA3_8B,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    res = bench_replay(None, [1], 24, 1, shape=shape, categories=("extraction",))
    cell = res["8b_replay/b1/extraction"]
    assert cell["replay_exact"] and cell["identical"] == 1.0
    assert res["smollm2_live/b1/extraction"]["identical"] == 1.0
    assert "live_ratio_error" in res["smollm2_replay/b1/extraction"]
    assert res["8b_replay_cost"]["free_tok_s"] > 0


def test_the_serve_benchmarks_offline_side_counts_the_cores_deltas() -> None:
    from benchmarks.bench_serve import offline_figures

    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "ignore_eos": True}
    figures = offline_figures(
        ["--device", "cpu", "--dtype", "float32", "--kv-cache-tokens", "2048"],
        "plain",
        [(body, False)] * 2,
        2,
    )
    assert figures["offline_tok_s"] > 0 and figures["offline_stream_tok_s"] > 0


def test_the_dummy_shape_is_the_embedded_architecture_without_weights(tmp_path: Any) -> None:
    """``serve --dummy-shape``'s folder: the embedded model's config and tokenizer, no weights; a dummy
    load of it builds the same architecture and renders chats to the same ids."""
    from benchmarks.bench_host import shape_checkpoint
    from ngrammar import LLM
    from ngrammar.model.loader import resolve_checkpoint
    from ngrammar.model.tokenizer import Tokenizer

    folder = shape_checkpoint(tmp_path / "shape")
    assert not list(folder.glob("*.safetensors"))
    embedded = resolve_checkpoint(None)
    assert resolve_checkpoint(folder, weights=False).config == embedded.config
    llm = LLM(str(folder), load_format="dummy", device="cpu", dtype="float32", kv_cache_tokens=1024)
    chat = [{"role": "user", "content": "Hello there"}]
    want = Tokenizer(embedded.tokenizer_dir, embedded.config.eos_token_ids).apply_chat_template(chat)
    assert llm.engine.tokenize(chat) == want
    llm.close()


def test_the_serve_benchmark_reports_the_share_of_mixed_steps() -> None:
    """A server's step kinds between two /server_info reads: mixed steps (no whole-step graph) and
    chained plain steps, as shares of the level's steps."""
    from benchmarks.bench_serve import step_kinds

    before = {"steps": 10, "mixed_steps": 2, "chained_steps": 5}
    after = {"steps": 110, "mixed_steps": 27, "chained_steps": 65}
    assert step_kinds(before, after) == {"engine_steps": 100, "mixed_share": 0.25, "chained_share": 0.6}
    assert step_kinds(after, after)["mixed_share"] == 0.0


def test_the_arrivals_benchmark_replaces_each_finished_stream() -> None:
    """Offline continuous arrivals: every request finishes with its tokens, most steps are mixed;
    on the CPU (no mixed-step graphs) only the eager variant runs."""
    from benchmarks.bench_arrivals import arrivals, bench_arrivals
    from ngrammar import LLM

    llm = LLM(device="cpu", dtype="float32", kv_cache_tokens=4096)
    try:
        prompts = [[{"role": "user", "content": f"Count to {n}."}] for n in (3, 5, 7)]
        ids = [llm.engine.tokenize(p) for p in prompts]
        run = arrivals(llm, ids, 2, 5, 4)
        assert [len(o) for o in run["outputs"]] == [4] * 5
        assert run["mixed_share"] > 0 and run["tok_s"] > 0
        res = bench_arrivals(llm, prompts, [2], 4)
        assert set(res["c2"]) == {"eager_tok_s", "mixed_share"}
    finally:
        llm.close()


def test_the_identity_benchmark_counts_identical_outputs_per_numerics(tmp_path: Any) -> None:
    """On the CPU (row-invariant kernels whatever the numerics) every comparison is whole."""
    from benchmarks.bench_host import tiny_checkpoint
    from benchmarks.bench_identity import VARIANTS, bench_identity

    folder = tiny_checkpoint(tmp_path / "tiny", layers=1)
    prompts = [[{"role": "user", "content": f"Repeat {w} {w} {w} {w}."}] for w in ("red", "blue")]
    # ``cuda_graph`` as gpu_bench passes it: the eager variant overrides it rather than repeat it
    kw = {
        "model": str(folder),
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_tokens": 4096,
        "cuda_graph": True,
    }
    res = bench_identity(kw, ["fast"], prompts, [2], 8)
    cell = res["fast"]
    assert cell["plain batch == alone"] == "2/2" and cell["ngram batch == plain"] == "2/2"
    assert all(cell[f"ngram {name} == plain"] == "2/2" for name in VARIANTS)
    assert cell["b2 plain tok/s"] > 0 and cell["b2 ngram tok/s"] > 0


def test_the_cpu_benchmark_repeats_a_prompt_from_an_empty_corpus(tmp_path: Any) -> None:
    """Best-of-N repeats of one prompt: each starts from an empty n-gram corpus, so the second
    cannot draft from the first's prompt and answer (it did, which made NGRAM's best of 3 a replay)."""
    from benchmarks.bench_cpu import chat_run
    from benchmarks.bench_host import tiny_checkpoint
    from ngrammar import LLM, SamplingParams

    folder = tiny_checkpoint(tmp_path / "tiny", layers=1)
    llm = LLM(model=str(folder), device="cpu", dtype="float32", kv_cache_tokens=1024, speculative="ngram")
    try:
        assert llm.engine.ngram is not None
        corpus = llm.engine.ngram.corpus
        seen: list[int] = []  # the corpus' size as each chat starts
        chat = llm.chat
        llm.chat = lambda *a, **k: (seen.append(corpus.num_nodes), chat(*a, **k))[1]  # type: ignore[method-assign]
        toks: list[list[int]] = []
        run = chat_run(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), toks)
        msgs = [{"role": "user", "content": "Repeat after me: one two three four."}]
        for _ in range(2):
            run(msgs)
        assert toks[0] == toks[1] and seen == [seen[0]] * 2 and corpus.num_nodes > seen[0]
    finally:
        llm.close()
