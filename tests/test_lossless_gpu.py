"""Lossless in the default configuration on CUDA (bf16, ``numerics auto`` = row-invariant kernels):
greedy NGRAM equals plain decoding token for token, a batch equals its requests one at a time, with
and without grammars, CUDA graphs and overlap scheduling change nothing. ``pytest -m gpu
tests/test_lossless_gpu.py`` (the embedded model, or ``NGRAMMAR_DEFAULT_MODEL``)."""

from __future__ import annotations

import pytest
import torch
from test_grammar_engine import GRAMMAR_PROMPTS, GRAMMARS
from test_spec_engine import PROMPTS

from ngrammar import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GREEDY = SamplingParams(max_tokens=48, temperature=0)  # stops at EOS


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(device="cuda", kv_cache_tokens=16384)


@pytest.fixture(scope="module")
def spec() -> LLM:
    return LLM(
        device="cuda", kv_cache_tokens=16384, speculative="ngram", num_draft_tokens=16, spec_policy="fixed"
    )


def ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_the_default_is_row_invariant(plain: LLM, spec: LLM) -> None:
    assert plain.engine.runner.invariant and spec.engine.runner.invariant


def test_ngram_and_batches_equal_plain_one_at_a_time(plain: LLM, spec: LLM) -> None:
    alone = [ids(plain, [p])[0] for p in PROMPTS]
    assert ids(plain, PROMPTS) == alone
    assert [ids(spec, [p])[0] for p in PROMPTS] == alone
    assert ids(spec, PROMPTS) == alone
    assert spec.engine.stats.verify_steps > 0


def test_with_grammars_ngram_and_batches_equal_plain(plain: LLM, spec: LLM) -> None:
    params = [SamplingParams(max_tokens=48, temperature=0, **g) for g in GRAMMARS]  # type: ignore[arg-type]
    alone = [plain.chat([c], [p], use_tqdm=False)[0].token_ids for c, p in zip(GRAMMAR_PROMPTS, params)]
    assert [o.token_ids for o in plain.chat(GRAMMAR_PROMPTS, params, use_tqdm=False)] == alone
    assert [o.token_ids for o in spec.chat(GRAMMAR_PROMPTS, params, use_tqdm=False)] == alone


def test_graphs_and_overlap_change_nothing(plain: LLM) -> None:
    eager = LLM(device="cuda", kv_cache_tokens=16384, cuda_graph=False, overlap_schedule=False)
    try:
        assert ids(eager, PROMPTS) == ids(plain, PROMPTS)
    finally:
        eager.close()


def test_verify_steps_chained_into_and_out_of_plain_ones_equal_plain(plain: LLM) -> None:
    """``chain_into_verify`` (trees picked on the device, copied into the captured graphs' static
    buffers) with ``chain_verify``: greedy outputs equal plain decoding's, batched and alone."""
    both = LLM(
        device="cuda",
        kv_cache_tokens=16384,
        speculative="ngram",
        num_draft_tokens=16,
        spec_policy="threshold",
        chain_verify=True,
        chain_into_verify=True,
    )
    try:
        alone = [ids(plain, [p])[0] for p in PROMPTS]
        assert ids(both, PROMPTS) == alone
        assert [ids(both, [p])[0] for p in PROMPTS] == alone
        assert both.engine.stats.chained_into_verify > 0
    finally:
        both.close()
