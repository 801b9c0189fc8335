"""The engine on the row-invariant attention launches (``numerics invariant``): greedy NGRAM equals
plain decoding and a batch its requests one at a time, token for token, through real draft trees,
pipelined verify steps and chunked prefills.

On a CUDA machine the engine runs its default CUDA numerics (invariant ops and attention):
``pytest -m gpu tests/test_invariant_engine.py``. Without a GPU the attention kernel runs under
Triton's CPU interpreter (``NGRAMMAR_TRITON_INTERPRET=1``) beside the CPU's own row-invariant float32
projections, which checks the kernel's tree paths and splits inside the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from triton_env import INTERPRET

from benchmarks.bench_host import shape_checkpoint
from ngrammar import LLM, SamplingParams
from ngrammar.attention.triton import TritonAttentionBackend

pytestmark = pytest.mark.gpu

# A small model whose heads the Triton kernel takes (head_dim >= 16), GQA of 2.
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
PROMPTS = [
    "Copy this list twice: apples, pears, plums, apples, pears, plums.",
    "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
    "Count: one two three four five six seven eight nine ten.",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shape_checkpoint(tmp_path_factory.mktemp("invariant") / "model", SHAPE)


def build(folder: Path, **extra: Any) -> LLM:
    kw: dict[str, Any] = dict(model=str(folder), load_format="dummy", kv_cache_tokens=4096, **extra)
    if not INTERPRET:
        llm = LLM(**kw, device="cuda", numerics="invariant")
        assert llm.engine.runner.invariant
        return llm
    # The CPU keeps its own projections; only the attention is swapped for the invariant launches.
    llm = LLM(**kw, device="cpu", dtype="float32", attention_backend="triton", max_prefill_tokens=32)
    backend = TritonAttentionBackend(invariant=True)
    llm.engine.runner.backend = backend
    for module in llm.engine.runner.model.modules():
        if hasattr(module, "backend"):
            module.backend = backend
    return llm


def ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_ngram_and_batches_equal_plain_one_at_a_time(folder: Path) -> None:
    plain = build(folder)
    alone = [ids(plain, [p])[0] for p in PROMPTS]
    assert ids(plain, PROMPTS) == alone
    # Pipelined verify steps (the CUDA default): each committed in the next engine step.
    spec = build(folder, speculative="ngram", num_draft_tokens=8, spec_policy="fixed", pipeline_verify=True)
    assert ids(spec, PROMPTS) == alone
    assert [ids(spec, [p])[0] for p in PROMPTS] == alone
    stats = spec.engine.stats
    assert stats.verify_emitted > stats.verify_steps > 0  # drafts were accepted
    assert stats.pipelined_steps > 0
