"""Mixed-step CUDA graphs (runner/mixed_graphs.py): prefill and mixed steps replay whole from graphs
per token bucket; they must change no token, no logit and no KV entry. The captured path needs CUDA
(`pytest -m gpu`); the attention grid they rely on is tested in tests/test_triton_attention.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ngrammar import LLM, SamplingParams
from ngrammar.runner.cuda_graph import bucket_table
from ngrammar.runner.mixed_graphs import kv_buckets, token_buckets
from ngrammar.runner.model_runner import StepInput
from tests.test_cuda_graph import PROMPTS


def test_token_buckets() -> None:
    assert token_buckets(512) == [16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512]
    assert token_buckets(100) == [16, 32, 64, 96, 100]
    assert token_buckets(16) == [16]
    assert token_buckets(5) == [5]
    with pytest.raises(ValueError):
        token_buckets(0)
    assert bucket_table([16, 32, 40]) == [16] * 17 + [32] * 16 + [40] * 8
    assert kv_buckets(8200) == [2048, 8200] and kv_buckets(1000) == [1000]


def test_cpu_engines_have_no_mixed_graphs(llm: LLM) -> None:
    assert llm.engine.runner.mixed is None


def _staggered(llm: LLM, params: SamplingParams) -> dict[str, list[int]]:
    """Each prompt added three engine steps after the one before; finished outputs by request id."""
    eng, done = llm.engine, dict[str, list[int]]()
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(prompt, params, request_id=f"r{i}")
        for _ in range(3):
            done |= {o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished}
    while eng.has_unfinished():
        done |= {o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished}
    return done


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_graph_steps_match_eager() -> None:
    kw = dict(device="cuda", dtype="float32", kv_cache_tokens=16384, cuda_graph_max_bs=8)
    eager = LLM(**kw, cuda_graph=False)  # type: ignore[arg-type]
    graphed = LLM(**kw)  # type: ignore[arg-type]
    mixed = graphed.engine.runner.mixed
    assert eager.engine.runner.mixed is None and mixed is not None
    assert set(mixed.replays) == set()
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    # Staggered arrivals: later requests prefill inside the earlier ones' decode steps (mixed steps).
    staggered = [_staggered(llm, greedy) for llm in (eager, graphed)]
    assert staggered[0] == staggered[1] and len(staggered[0]) == len(PROMPTS)
    assert eager.engine.stats.mixed_steps > 0 and graphed.engine.stats.mixed_steps > 0
    assert sum(mixed.replays.values()) > 0
    want = [eager.generate([p], greedy)[0].token_ids for p in PROMPTS]
    assert [graphed.generate([p], greedy)[0].token_ids for p in PROMPTS] == want

    # Runner level: one mixed step's logits and KV writes, bitwise those of the eager step.
    eng, runner = graphed.engine, graphed.engine.runner
    ids = [eng.tokenizer.encode(p) for p in PROMPTS[:3]]
    pages = [eng.blocks.allocator.allocate(-(-(len(t) + 8) // eng.blocks.page_size)) for t in ids]
    try:
        decode = ids[0]
        runner.forward(StepInput([decode], [list(range(len(decode)))], [0], [pages[0]], [len(decode) - 1]))
        step = StepInput(
            [[decode[-1]], ids[1], ids[2]],
            [[len(decode)], list(range(len(ids[1]))), list(range(len(ids[2])))],
            [len(decode), 0, 0],
            pages,
            [0, len(ids[1]), len(ids[1]) + len(ids[2])],
        )
        before, kv_before = dict(mixed.replays), runner.kv_cache.clone()
        got = runner.forward(step).clone()
        kv_got = runner.kv_cache.clone()
        assert sum(mixed.replays.values()) == sum(before.values()) + 1
        # [layers, 2, pages, ...]: the graphed step wrote only its own pages and the dummy page
        dummy = eng.blocks.allocator.num_pages
        changed = set((kv_got != kv_before).flatten(3).any(-1).any(0).any(0).nonzero().flatten().tolist())
        assert changed and changed <= {p for pg in pages for p in pg} | {dummy}
        runner.kv_cache.copy_(kv_before)
        saved, runner.mixed = runner.mixed, None
        try:
            want_logits = runner.forward(step)
        finally:
            runner.mixed = saved
        assert torch.equal(got, want_logits)
        real = [p for p in range(runner.kv_cache.shape[2]) if p != dummy]
        assert torch.equal(kv_got[:, :, real], runner.kv_cache[:, :, real])
    finally:
        for pg in pages:
            eng.blocks.allocator.free(pg)
    for llm in (eager, graphed):
        alloc = llm.engine.blocks.allocator
        alloc.check_integrity()
        assert alloc.num_free == alloc.num_pages


def _reference_slots(step: StepInput, page_size: int) -> list[int]:
    """Each new token's KV slot, token by token: what ``ModelRunner.metadata`` vectorizes."""
    return [
        step.page_tables[b][i // page_size] * page_size + i % page_size
        for b in range(step.batch_size)
        for i in range(step.starts[b], step.starts[b] + len(step.tokens[b]))
    ]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20), st.integers(0, 3)), min_size=1, max_size=6))
def test_metadata_of_a_mixed_step(llm: LLM, rows: list[tuple[int, int, int]]) -> None:
    """Decode rows and prefill chunks of any lengths: slots, page table and lengths as built by hand."""
    runner = llm.engine.runner
    ps = runner.page_size
    starts = [s for s, _, _ in rows]
    tokens = [[7] * q for _, q, _ in rows]
    tables = [
        [(17 * b + j) % 97 for j in range(-(-(s + q) // ps) + extra)] for b, (s, q, extra) in enumerate(rows)
    ]
    step = StepInput(
        tokens, [list(range(s, s + len(t))) for s, t in zip(starts, tokens)], starts, tables, [0]
    )
    meta = runner.metadata(step)
    assert meta.slot_mapping.tolist() == _reference_slots(step, ps)
    assert meta.kv_lens.tolist() == [s + q for s, q, _ in rows]
    assert meta.q_lens.tolist() == [q for _, q, _ in rows]
    assert meta.q_start.tolist() == [0, *itertools.accumulate(q for _, q, _ in rows)]
    width = max(len(t) for t in tables)
    assert meta.page_table.tolist() == [t + [0] * (width - len(t)) for t in tables]
    assert (meta.max_q_len, meta.max_kv_len) == (max(q for _, q, _ in rows), max(s + q for s, q, _ in rows))
