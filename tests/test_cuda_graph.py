"""CUDA-graph runner: the static-buffer + padding path must change no token.

On the CPU the runner runs in no-capture mode (``enable_cuda_graphs(capture=False)``): the same static
buffers, bucket padding and dummy page as the captured path, executed eagerly with TorchSDPABackend.
The GPU test at the end captures and replays for real.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from ngrammar import LLM, SamplingParams
from ngrammar.config import EngineConfig
from ngrammar.runner.cuda_graph import CUDAGraphRunner, batch_buckets, graph_capturable
from ngrammar.runner.model_runner import StepInput

PROMPTS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.\n",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Copy the list: apples, bananas, cherries, dates, elderberries, figs, grapes.\nList: apples,",
    "Once upon a time, in a small village by the sea, there lived",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SMALL_POOL = 2048  # tokens: keeps the extra engines' KV pools small


def _static(llm: LLM) -> LLM:
    llm.engine.enable_cuda_graphs(capture=False)
    return llm


def _graphs(llm: LLM) -> CUDAGraphRunner:
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    return graphs


@pytest.fixture(scope="module")
def static_llm() -> Iterator[LLM]:
    llm = _static(LLM(device="cpu", dtype="float32", kv_cache_tokens=SMALL_POOL))
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def static_spec_llm() -> Iterator[LLM]:
    llm = _static(
        LLM(
            device="cpu",
            dtype="float32",
            kv_cache_tokens=SMALL_POOL,
            speculative="ngram",
            num_draft_tokens=8,
            spec_policy="fixed",
        )
    )
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def eager_outputs(llm: LLM) -> dict[int, list[list[int]]]:
    return {bs: [o.token_ids for o in llm.generate(PROMPTS[:bs], GREEDY)] for bs in (1, 3, 5)}


def _record_allocations(llm: LLM) -> list[int]:
    """Every page the allocator hands out from now on (the wrapper stays for the engine's life)."""
    alloc = llm.engine.blocks.allocator
    handed: list[int] = []
    allocate = alloc.allocate

    def recording(count: int) -> list[int]:
        pages = allocate(count)
        handed.extend(pages)
        return pages

    alloc.allocate = recording  # type: ignore[method-assign]
    return handed


def _assert_pool_clean(llm: LLM, handed: list[int]) -> None:
    alloc = llm.engine.blocks.allocator
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_pages
    dummy = _graphs(llm).dummy_page
    assert dummy == alloc.num_pages < llm.engine.runner.kv_cache.shape[2]
    assert handed and dummy not in handed


def test_batch_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert batch_buckets(130) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 130]
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_config_validation() -> None:
    assert EngineConfig().cuda_graph and EngineConfig().cuda_graph_max_bs == 256
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(cuda_graph_max_bs=0)


def test_the_acceptor_kernel_is_cuda_only(static_spec_llm: LLM) -> None:
    # Triton compiles for CUDA only: a CPU engine's graph path (no capture) keeps the torch ops.
    worker = static_spec_llm.engine.ngram
    assert worker is not None and not worker.accept_kernel


def test_cpu_engines_stay_eager(llm: LLM) -> None:
    assert llm.engine.runner.graphs is None  # no CUDA: nothing is captured unless forced
    assert not graph_capturable(llm.engine.runner.backend)
    with pytest.raises(ValueError, match="capture"):
        CUDAGraphRunner(llm.engine.runner, [1], 4, 64, llm.engine.blocks.allocator.num_pages, capture=True)


@pytest.mark.parametrize("bs,bucket", [(1, 1), (3, 4), (5, 8)])
def test_static_decode_matches_eager(
    static_llm: LLM, eager_outputs: dict[int, list[list[int]]], bs: int, bucket: int
) -> None:
    graphs = _graphs(static_llm)
    handed = _record_allocations(static_llm)
    before = graphs.replays[(bucket, 1)]
    outs = static_llm.generate(PROMPTS[:bs], GREEDY)
    assert [o.token_ids for o in outs] == eager_outputs[bs]
    assert graphs.replays[(bucket, 1)] - before >= GREEDY.max_tokens - 1  # every decode step went static
    _assert_pool_clean(static_llm, handed)


@pytest.mark.parametrize("bs,bucket", [(1, 1), (5, 8)])
def test_static_tree_verify_matches_eager(
    static_spec_llm: LLM, eager_outputs: dict[int, list[list[int]]], bs: int, bucket: int
) -> None:
    graphs = _graphs(static_spec_llm)
    assert graphs.widths == [1, 4, 8]  # D = 8 and the narrower width a trimmed tree may take

    def verify_replays() -> tuple[int, int]:
        return (
            sum(graphs.replays[(bucket, w)] for w in (4, 8)),
            sum(graphs.accept_replays[(bucket, w)] for w in (4, 8)),
        )

    handed = _record_allocations(static_spec_llm)
    before, accepts_before = verify_replays()
    outs = static_spec_llm.generate(PROMPTS[:bs], GREEDY)
    assert [o.token_ids for o in outs] == eager_outputs[bs]
    after, accepts_after = verify_replays()
    served = after - before
    assert served > 0
    # Greedy verify steps accept through the runner's acceptor on the static buffers.
    assert accepts_after - accepts_before == served
    _assert_pool_clean(static_spec_llm, handed)


def test_static_path_under_preemption() -> None:
    kw = dict(device="cpu", dtype="float32", kv_cache_tokens=256, page_size=16, max_prefill_tokens=64)
    prompts = [f"Story number {i}: once upon a time" for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    eager = [o.token_ids for o in LLM(**kw).generate(prompts, params)]  # type: ignore[arg-type]
    static = _static(LLM(**kw))  # type: ignore[arg-type]
    handed = _record_allocations(static)
    assert [o.token_ids for o in static.generate(prompts, params)] == eager
    assert sum(_graphs(static).replays.values()) > 0
    _assert_pool_clean(static, handed)


def test_static_path_with_overlap(eager_outputs: dict[int, list[list[int]]]) -> None:
    """Chained decode steps copy their input tokens device->device into the static ids buffer."""
    static = _static(LLM(device="cpu", dtype="float32", kv_cache_tokens=SMALL_POOL, overlap_schedule=True))
    handed = _record_allocations(static)
    assert [o.token_ids for o in static.generate(PROMPTS[:5], GREEDY)] == eager_outputs[5]
    assert static.engine.stats.chained_steps > 0 and _graphs(static).replays[(8, 1)] > 0
    _assert_pool_clean(static, handed)


CITY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
    "additionalProperties": False,
}
CITY_PROMPT = [{"role": "user", "content": "Paris has 2161000 people. Give its name and population as JSON."}]


def test_grammar_logprobs_and_sampling_on_static_logits(
    llm: LLM, static_llm: LLM, static_spec_llm: LLM
) -> None:
    # Grammar masks are applied in place to the returned logits view, logprobs read it afterwards.
    greedy = SamplingParams(max_tokens=32, temperature=0, json_schema=CITY_SCHEMA, logprobs=2)
    want = llm.chat(CITY_PROMPT, greedy)[0]
    for static in (static_llm, static_spec_llm):
        got = static.chat(CITY_PROMPT, greedy)[0]
        assert got.token_ids == want.token_ids
        assert got.logprobs is not None and want.logprobs is not None
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=7, n=2, ignore_eos=True)
    want_sampled = llm.generate(PROMPTS[1], sampled)[0]
    got_sampled = static_llm.generate(PROMPTS[1], sampled)[0]
    assert [c.token_ids for c in got_sampled.outputs] == [c.token_ids for c in want_sampled.outputs]


# --------------------------------------------------------------- runner level
def _prefill(llm: LLM, prompts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Eagerly cache each prompt in fresh pages (room for 8 more tokens); returns (ids, pages)."""
    eng, runner = llm.engine, llm.engine.runner
    ids = [eng.tokenizer.encode(p) for p in prompts]
    pages = [eng.blocks.allocator.allocate(-(-(len(t) + 8) // eng.blocks.page_size)) for t in ids]
    for toks, pg in zip(ids, pages):
        runner.forward(StepInput([toks], [list(range(len(toks)))], [0], [pg], [len(toks) - 1]))
    return ids, pages


def _tree_masks(bs: int, width: int, seed: int) -> np.ndarray:
    """Random ancestor-style masks: lower-triangular with a full diagonal and the root column set."""
    rng = np.random.default_rng(seed)
    mask = np.tril(rng.random((bs, width, width)) < 0.5)
    idx = np.arange(width)
    mask[:, idx, idx] = True
    mask[:, :, 0] = True
    return mask


def _step(ids: list[list[int]], pages: list[list[int]], width: int, mask: np.ndarray | None) -> StepInput:
    """A uniform step of ``width`` new tokens per sequence (a tree verify when ``mask`` is given)."""
    starts = [len(t) for t in ids]
    depths = np.zeros((len(ids), width), dtype=np.int64) if mask is None else mask.sum(-1) - 1
    tokens = [[(t[-1] + 7 * j) % 1000 for j in range(width)] for t in ids]
    positions = (np.asarray(starts)[:, None] + depths).tolist()
    return StepInput(tokens, positions, starts, pages, list(range(len(ids) * width)), mask)


@pytest.mark.parametrize("width", [1, 8])
def test_static_logits_and_kv_writes_match_eager(static_spec_llm: LLM, width: int) -> None:
    runner = static_spec_llm.engine.runner
    graphs = _graphs(static_spec_llm)
    alloc = static_spec_llm.engine.blocks.allocator
    ids, pages = _prefill(static_spec_llm, PROMPTS[:3])
    try:
        step = _step(ids, pages, width, None if width == 1 else _tree_masks(3, width, seed=width))
        assert graphs.accepts(step)
        before = runner.kv_cache.clone()
        before_replays = graphs.replays[(4, width)]
        static = runner.forward(step).clone()
        assert graphs.replays[(4, width)] == before_replays + 1  # B = 3 padded to bucket 4
        # Only the new tokens' slots and the dummy page may change: padding rows stay on the dummy page.
        touched = runner.kv_cache.ne(before).flatten(4).any(-1).any(1).any(0)  # [pages, page_size]
        touched[graphs.dummy_page] = False
        ps = static_spec_llm.engine.blocks.page_size
        allowed = torch.zeros_like(touched)
        for start, pg in zip(step.starts, pages):
            for i in range(start, start + width):
                allowed[pg[i // ps], i % ps] = True
        assert touched.any() and not (touched & ~allowed).any()
        graphs_saved, runner.graphs = runner.graphs, None
        try:
            eager = runner.forward(step)
        finally:
            runner.graphs = graphs_saved
    finally:
        for pg in pages:
            alloc.free(pg)
    assert static.shape == eager.shape == (3 * width, runner.vocab_size)
    torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)


def test_a_narrower_step_after_a_wider_one_reads_its_own_pages(static_spec_llm: LLM) -> None:
    """Page tables travel packed at each step's own width: after a step whose tables were wider,
    the static table's first columns and the slots are the new step's, and its logits are eager's."""
    runner, graphs = static_spec_llm.engine.runner, _graphs(static_spec_llm)
    alloc = static_spec_llm.engine.blocks.allocator
    ids, pages = _prefill(static_spec_llm, PROMPTS[:2])
    wide = [alloc.allocate(len(pg) + 3) for pg in pages]  # other pages, and more of them
    try:
        runner.forward(_step(ids, wide, 1, None))
        step = _step(ids, pages, 1, None)
        got = runner.forward(step).clone()
        width = max(map(len, pages))
        table = graphs._table[:2, :width].tolist()
        assert [row[: len(pg)] for row, pg in zip(table, pages)] == pages
        ps = graphs.page_size
        assert graphs.last_slots().tolist() == [
            pg[s // ps] * ps + s % ps for pg, s in zip(pages, step.starts)
        ]
        saved, runner.graphs = runner.graphs, None
        try:
            want = runner.forward(step)
        finally:
            runner.graphs = saved
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        for pg in wide + pages:
            alloc.free(pg)


def test_a_page_table_short_of_its_new_tokens_is_refused(static_llm: LLM) -> None:
    """An upstream bug (a table without the page of a new token) fails loudly, never writes page 0."""
    runner = static_llm.engine.runner
    ps = static_llm.engine.blocks.page_size
    with pytest.raises(ValueError, match="does not cover"):
        runner.forward(StepInput([[1], [2]], [[3], [ps]], [3, ps], [[5], [6]], [0, 1]))


def test_padding_graph_refills_the_static_buffers(static_spec_llm: LLM) -> None:
    """The benchmark hook stages all-padding rows, so a lone replay never reads another width's layout."""
    graphs = _graphs(static_spec_llm)
    ids, pages = _prefill(static_spec_llm, PROMPTS[:3])
    try:
        runner = static_spec_llm.engine.runner
        runner.forward(_step(ids, pages, 1, None))  # prepares (bucket 4, width 1)
        runner.forward(_step(ids, pages, 8, _tree_masks(3, 8, seed=3)))  # leaves the verify layout behind
    finally:
        for pg in pages:
            static_spec_llm.engine.blocks.allocator.free(pg)
    assert graphs.padding_graph(3, 1) is None  # nothing is captured in no-capture mode ...
    host = graphs._host  # ... but the buffers of bucket 4, width 1 now hold only padding
    assert (host.q_lens[:4] == 1).all() and (host.kv_lens[:4] == 1).all()
    assert host.q_start[:5].tolist() == [0, 1, 2, 3, 4]
    assert (graphs._table[:4, 0] == graphs.dummy_page).all()  # the static table the graphs read


def test_non_uniform_steps_run_eagerly(static_spec_llm: LLM) -> None:
    graphs = _graphs(static_spec_llm)
    mask = _tree_masks(2, 8, seed=1)
    pages = [[0], [1]]
    uniform = StepInput([[1] * 8, [2] * 8], [list(range(8))] * 2, [0, 0], pages, list(range(16)), mask)
    assert graphs.accepts(uniform)
    big = graphs.buckets[-1] + 1
    cases = [
        StepInput([[1], [2, 3]], [[0], [0, 1]], [0, 0], pages, [0, 1, 2]),  # mixed widths
        StepInput(
            [[1] * 2] * 2, [list(range(2))] * 2, [0, 0], pages, list(range(4)), _tree_masks(2, 2, 0)
        ),  # width 2
        StepInput([[1] * 8, [2] * 8], [list(range(8))] * 2, [0, 0], pages, [7, 15], mask),  # some rows
        StepInput([[1] * 8, [2] * 8], [list(range(8))] * 2, [0, 0], pages, list(range(16))),  # no tree
        StepInput([[1], [2]], [[0], [0]], [0, 0], pages, [0, 1], mask),  # decode with a mask
        StepInput(
            [[1]] * big, [[0]] * big, [0] * big, [[0]] * big, list(range(big))
        ),  # beyond the largest bucket
        StepInput([[1]], [[0]], [0], [[0] * (graphs.layout.max_pages + 1)], [0]),  # beyond the kv bound
    ]
    assert not any(graphs.accepts(s) for s in cases)


# ------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_replay_matches_eager() -> None:
    kw = dict(device="cuda", dtype="float32", kv_cache_tokens=16384, cuda_graph_max_bs=8)
    eager = LLM(**kw, cuda_graph=False)  # type: ignore[arg-type]
    graphed = LLM(**kw)  # type: ignore[arg-type]
    spec = LLM(**kw, speculative="ngram", num_draft_tokens=8, spec_policy="fixed")  # type: ignore[arg-type]
    assert eager.engine.runner.graphs is None
    graphs = _graphs(graphed)
    assert graphs.capture and graphs.prepared == [(b, 1) for b in graphs.buckets]  # captured at start-up
    for bs, bucket in [(1, 1), (3, 4), (5, 8)]:
        want = [o.token_ids for o in eager.generate(PROMPTS[:bs], GREEDY)]
        before = graphs.replays[(bucket, 1)]
        assert [o.token_ids for o in graphed.generate(PROMPTS[:bs], GREEDY)] == want
        assert graphs.replays[(bucket, 1)] > before
        assert [o.token_ids for o in spec.generate(PROMPTS[:bs], GREEDY)] == want
    assert sum(n for (_, w), n in _graphs(spec).replays.items() if w == 8) > 0
    for llm in (graphed, spec):
        alloc = llm.engine.blocks.allocator
        alloc.check_integrity()
        assert alloc.num_free == alloc.num_pages

    runner = spec.engine.runner
    for width in (1, 8):
        ids, pages = _prefill(spec, PROMPTS[:3])
        try:
            step = _step(ids, pages, width, None if width == 1 else _tree_masks(3, width, seed=width))
            runner.forward(step)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                static = runner.forward(step)  # replay: H2D copies only, no device->host sync
            finally:
                torch.cuda.set_sync_debug_mode(0)
            static = static.clone()
            saved, runner.graphs = runner.graphs, None
            try:
                ref = runner.forward(step)
            finally:
                runner.graphs = saved
        finally:
            for pg in pages:
                spec.engine.blocks.allocator.free(pg)
        torch.testing.assert_close(static, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_acceptor_and_torch_acceptor_give_the_same_tokens() -> None:
    # The CUDA-graph acceptor (the one-launch kernel) against an eager engine's torch ops, on
    # prompts that copy (long accepted runs, KV moves) and at batch sizes that pad their bucket.
    kw = dict(
        device="cuda",
        dtype="float32",
        kv_cache_tokens=16384,
        cuda_graph_max_bs=8,
        speculative="ngram",
        num_draft_tokens=16,
        spec_policy="fixed",
    )
    fused = LLM(**kw)  # type: ignore[arg-type]
    ops = LLM(**kw, cuda_graph=False)  # type: ignore[arg-type]
    assert fused.engine.ngram.accept_kernel and ops.engine.runner.graphs is None
    copy = [f"Repeat this list exactly: {', '.join(str(i) for i in range(k, k + 30))}." for k in range(5)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for prompts in (copy[:1], copy[:3], copy + PROMPTS[:2]):
        want = [o.token_ids for o in ops.generate(prompts, params)]
        assert [o.token_ids for o in fused.generate(prompts, params)] == want
    assert sum(_graphs(fused).accept_replays.values()) > 0
    for llm in (fused, ops):
        alloc = llm.engine.blocks.allocator
        alloc.check_integrity()
        assert alloc.num_free == alloc.num_pages
