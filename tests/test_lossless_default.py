"""Lossless in the default configuration (CPU, the GGUF's 4-bit weights, ``--quantization auto``):
greedy NGRAM equals plain decoding token for token, a batch equals its requests one at a time, with
and without grammars, and an engine in another process gives the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_grammar_engine import GRAMMAR_PROMPTS, GRAMMARS
from test_spec_engine import PROMPTS

from ngrammar import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0)  # stops at EOS


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(device="cpu", kv_cache_tokens=8192)


@pytest.fixture(scope="module")
def default_spec_llm() -> LLM:
    return LLM(device="cpu", kv_cache_tokens=8192, speculative="ngram", num_draft_tokens=8)


def one_at_a_time(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].token_ids for p in prompts]


def test_the_default_is_the_4bit_model(default_llm: LLM, default_spec_llm: LLM) -> None:
    assert default_llm.engine.runner.quantized and default_spec_llm.engine.runner.quantized


def test_ngram_and_batches_equal_plain_one_at_a_time(default_llm: LLM, default_spec_llm: LLM) -> None:
    plain = one_at_a_time(default_llm, PROMPTS)
    assert [o.token_ids for o in default_llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == plain
    assert one_at_a_time(default_spec_llm, PROMPTS) == plain
    assert [o.token_ids for o in default_spec_llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == plain
    assert default_spec_llm.engine.stats.verify_steps > 0


def test_with_grammars_ngram_and_batches_equal_plain(default_llm: LLM, default_spec_llm: LLM) -> None:
    params = [SamplingParams(max_tokens=32, temperature=0, **g) for g in GRAMMARS]  # type: ignore[arg-type]
    plain = [default_llm.chat([c], [p], use_tqdm=False)[0].token_ids for c, p in zip(GRAMMAR_PROMPTS, params)]
    assert [o.token_ids for o in default_llm.chat(GRAMMAR_PROMPTS, params, use_tqdm=False)] == plain
    assert [o.token_ids for o in default_spec_llm.chat(GRAMMAR_PROMPTS, params, use_tqdm=False)] == plain


def test_another_process_gives_the_same_tokens(default_llm: LLM) -> None:
    script = (
        "import json, sys\n"
        "from ngrammar import LLM, SamplingParams\n"
        "prompts = json.loads(sys.argv[1])\n"
        "llm = LLM(device='cpu', kv_cache_tokens=8192)\n"
        "outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)\n"
        "print(json.dumps([o.token_ids for o in outs]))\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs == [o.token_ids for o in default_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
