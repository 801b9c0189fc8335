"""The host-cost benchmark's tiny model is a real checkpoint the engine loads and decodes with."""

from __future__ import annotations

from pathlib import Path

from benchmarks.bench_host import tiny_checkpoint
from ngrammar import LLM, SamplingParams


def test_tiny_checkpoint_loads_and_decodes(tmp_path: Path) -> None:
    folder = tiny_checkpoint(tmp_path / "tiny")
    llm = LLM(model=str(folder), device="cpu", dtype="float32", kv_cache_tokens=1024, overlap_schedule=True)
    assert llm.engine.model_config.num_layers == 1 and llm.engine.model_config.hidden_size == 16
    out = llm.chat([[{"role": "user", "content": "Say hi."}]], SamplingParams(max_tokens=6, temperature=0,
                                                                               ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 6 and out.prompt_token_ids  # the embedded chat template and tokenizer
    assert llm.engine.stats.chained_steps > 0  # overlap scheduling ran on the CPU too
