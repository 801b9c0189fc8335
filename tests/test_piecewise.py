"""Piecewise CUDA graphs (runner/piecewise.py): prefill and mixed steps replay the layers between
attention calls from graphs; they must change no token. The captured path needs CUDA (`pytest -m gpu`)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ngrammar import LLM, SamplingParams
from ngrammar.attention.metadata import SegmentCut
from ngrammar.runner.cuda_graph import bucket_table
from ngrammar.runner.model_runner import StepInput
from ngrammar.runner.piecewise import token_buckets
from tests.test_cuda_graph import PROMPTS


def test_token_buckets() -> None:
    assert token_buckets(512) == [16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512]
    assert token_buckets(100) == [16, 32, 64, 96, 100]
    assert token_buckets(16) == [16]
    assert token_buckets(5) == [5]
    with pytest.raises(ValueError):
        token_buckets(0)
    assert bucket_table([16, 32, 40]) == [16] * 17 + [32] * 16 + [40] * 8


def test_cpu_engines_have_no_piecewise_graphs(llm: LLM) -> None:
    assert llm.engine.runner.pieces is None


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
def test_piecewise_steps_match_eager() -> None:
    kw = dict(device="cuda", dtype="float32", kv_cache_tokens=16384, cuda_graph_max_bs=8)
    eager = LLM(**kw, cuda_graph=False)  # type: ignore[arg-type]
    graphed = LLM(**kw)  # type: ignore[arg-type]
    pieces = graphed.engine.runner.pieces
    assert eager.engine.runner.pieces is None and pieces is not None
    assert set(pieces.replays) == set()
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    # Staggered arrivals: later requests prefill inside the earlier ones' decode steps (mixed steps).
    staggered = [_staggered(llm, greedy) for llm in (eager, graphed)]
    assert staggered[0] == staggered[1] and len(staggered[0]) == len(PROMPTS)
    assert eager.engine.stats.mixed_steps > 0 and graphed.engine.stats.mixed_steps > 0
    assert sum(pieces.replays.values()) > 0
    want = [eager.generate([p], greedy)[0].token_ids for p in PROMPTS]
    assert [graphed.generate([p], greedy)[0].token_ids for p in PROMPTS] == want

    # Runner level: one mixed step's logits and KV writes, piecewise against eager.
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
        before = dict(pieces.replays)
        got = runner.forward(step).clone()
        kv_got = runner.kv_cache.clone()
        assert sum(pieces.replays.values()) == sum(before.values()) + 1
        saved, runner.pieces = runner.pieces, None
        try:
            want_logits = runner.forward(step)
        finally:
            runner.pieces = saved
        torch.testing.assert_close(got, want_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv_got, runner.kv_cache, rtol=1e-4, atol=1e-4)
    finally:
        for pg in pages:
            eng.blocks.allocator.free(pg)
    for llm in (eager, graphed):
        alloc = llm.engine.blocks.allocator
        alloc.check_integrity()
        assert alloc.num_free == alloc.num_pages


class _Through(SegmentCut):
    """Each attention call run for real with the step's plan, and counted: the piecewise capture's
    contract (one call per layer, in layer order, through the backend) checked without CUDA."""

    def __init__(self, backend: Any, plan: Any) -> None:
        self.backend, self.plan, self.layers = backend, plan, 0

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        scale: float,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        self.layers += 1
        return self.backend.forward(q, k, v, layer_cache, self.plan, scale, rope)


def test_every_attention_call_reaches_the_cut(llm: LLM) -> None:
    eng, runner = llm.engine, llm.engine.runner
    ids = [eng.tokenizer.encode(p) for p in PROMPTS[:2]]
    pages = [eng.blocks.allocator.allocate(-(-len(t) // eng.blocks.page_size)) for t in ids]
    try:
        step = StepInput(ids, [list(range(len(t))) for t in ids], [0, 0], pages, [len(ids[0]) - 1])
        meta = runner.metadata(step)
        tokens = torch.tensor([t for toks in ids for t in toks])
        positions = torch.tensor([p for toks in ids for p in range(len(toks))])
        with torch.inference_mode():
            want = runner.model(tokens, positions, runner.kv_cache, runner.backend.plan(meta)).clone()
            cut = _Through(runner.backend, runner.backend.plan(meta))
            got = runner.model(tokens, positions, runner.kv_cache, cut)
    finally:
        for pg in pages:
            eng.blocks.allocator.free(pg)
    assert cut.layers == runner.config.num_layers
    assert torch.equal(got, want)


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
