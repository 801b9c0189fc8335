"""The host-cost benchmark's tiny model is a real checkpoint the engine loads and decodes with."""

from __future__ import annotations

from pathlib import Path

from benchmarks.bench_host import tiny_checkpoint
from ngrammar import LLM, SamplingParams


def test_tiny_checkpoint_loads_and_decodes(tmp_path: Path) -> None:
    folder = tiny_checkpoint(tmp_path / "tiny")
    llm = LLM(model=str(folder), device="cpu", dtype="float32", kv_cache_tokens=1024, overlap_schedule=True)
    assert llm.engine.model_config.num_layers == 1 and llm.engine.model_config.hidden_size == 16
    out = llm.chat(
        [[{"role": "user", "content": "Say hi."}]],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.token_ids) == 6 and out.prompt_token_ids  # the embedded chat template and tokenizer
    assert llm.engine.stats.chained_steps > 0  # overlap scheduling ran on the CPU too


def test_phase_timer_times_engine_phases_and_restores_them(tmp_path: Path) -> None:
    from benchmarks.host_phases import ENGINE_PHASES, PhaseTimer
    from ngrammar.engine.engine import LLMEngine

    folder = tiny_checkpoint(tmp_path / "tiny")
    llm = LLM(
        model=str(folder),
        device="cpu",
        dtype="float32",
        kv_cache_tokens=1024,
        overlap_schedule=True,
        speculative="ngram",
        num_draft_tokens=4,
        spec_policy="fixed",
    )
    original = LLMEngine.__dict__["step"]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    steps0 = llm.engine.stats.steps
    with PhaseTimer() as timer:  # every listed owner and attribute must resolve
        assert LLMEngine.__dict__["step"] is not original
        llm.chat([[{"role": "user", "content": "Say hi."}]], params, use_tqdm=False)
    assert LLMEngine.__dict__["step"] is original
    steps = llm.engine.stats.steps - steps0
    table = {name: (us, calls) for name, us, calls in timer.per_step(steps)}
    assert table["step"][1] == 1.0 and table["step"][0] > 0
    stats = llm.engine.stats  # every decode step verified, or was called off for want of drafts
    assert timer.calls["  verify"] == stats.spec_steps + stats.vetoed_steps and stats.spec_steps > 0
    assert set(table) <= {name for name, _, _ in ENGINE_PHASES}


def test_phase_timer_times_grammar_functions_and_restores_them(tmp_path: Path) -> None:
    """Module functions (the bitmask helpers) are wrapped where they are defined; the engine imports
    them at each call, so the timed versions run, and the originals are back afterwards."""
    import ngrammar.grammar as grammar
    from benchmarks.host_phases import PhaseTimer

    folder = tiny_checkpoint(tmp_path / "tiny")
    llm = LLM(model=str(folder), device="cpu", dtype="float32", kv_cache_tokens=1024, overlap_schedule=True)
    original = grammar.apply_bitmask
    params = SamplingParams(max_tokens=5, temperature=0, json_object=True)
    with PhaseTimer() as timer:
        out = llm.chat([[{"role": "user", "content": "Say hi."}]], params, use_tqdm=False)[0]
    assert grammar.apply_bitmask is original
    sampled = len(out.token_ids)  # one masked sampling per token, the prefill's first one included
    assert timer.calls["      apply bitmask"] == timer.calls["    grammar rows"] == sampled
    assert timer.calls["      fill rows (pool)"] == sampled  # settle + fill: one call per masked step
