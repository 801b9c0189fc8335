"""Row invariance on the CPU's default paths: a row's numbers are bitwise the same computed alone,
inside a batch of 2-64 rows, inside a verify tree of 2-64 nodes and inside a prefill chunk, for the
4-bit model (the default) and the float32 one; so greedy NGRAM equals plain decoding, a batch equals
its requests one at a time, and two processes give the same tokens (tests/test_lossless_default.py).

Kernels first (small shapes, hypothesis), then the embedded model's logits through the runner.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention import PS, meta_for

from ngrammar import LLM
from ngrammar.attention.metadata import AttentionMetadata
from ngrammar.attention.sdpa import TorchSDPABackend
from ngrammar.kernels import cpu as cpu_kernels
from ngrammar.model.quant import PackedWeight, Q4Weight
from ngrammar.runner.model_runner import StepInput

ROWS = st.integers(2, 64)


def random_q4(n: int, k: int, seed: int) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().float()
    zero = (torch.randn(n, k // 32, generator=g) * 0.05).half().float() + 8 * scale
    return Q4Weight(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g), scale, zero)


def assert_rows_alone_equal(fn: object, x: torch.Tensor) -> None:
    """fn(x)[r] == fn(x[r:r+1]) bitwise for every r, and every prefix of x gives the same rows."""
    assert callable(fn)
    full = fn(x)
    for r in range(x.shape[0]):
        assert torch.equal(fn(x[r : r + 1]), full[r : r + 1]), r
    m = max(1, x.shape[0] // 2)
    assert torch.equal(fn(x[:m]), full[:m])


# scalar, AVX2, AVX-512 VNNI: those this CPU runs. Where the extension is not built (a GPU image
# running `pytest -m gpu`, which collects this module) the list is empty and its tests are skipped;
# `make setup` builds it for every CPU run.
PATHS = cpu_kernels.block_linear_paths() if cpu_kernels.built() else []


def random_q8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return codes, (torch.rand(n, k // 32, generator=g) * 0.01).half().float()


def block_inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows of mixed magnitudes, with an all-zero block and a row of one repeated value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 10
    x[0, :32] = 0
    x[-1] = x[-1, 0]
    return x


@settings(max_examples=15, deadline=None)
@given(
    rows=ROWS,
    n=st.sampled_from([16, 48, 96, 100]),
    groups=st.integers(1, 6),
    q8=st.booleans(),
    seed=st.integers(0, 99),
)
def test_block_kernel_rows_do_not_depend_on_the_batch_nor_the_isa(
    rows: int, n: int, groups: int, q8: bool, seed: int
) -> None:
    """Q4_1 projections and the Q8_0 head: a row alone == the row in a batch of 2-64, bitwise, on
    every ISA path this CPU runs, and every path gives the same bits."""
    k = 32 * groups
    weight = PackedWeight.q8_0(*random_q8(n, k, seed)) if q8 else PackedWeight(random_q4(n, k, seed))
    x = block_inputs(rows, k, seed)
    results = []
    for path in PATHS:

        def fn(t: torch.Tensor, path: int = path) -> torch.Tensor:
            return cpu_kernels.block_linear(t, weight.packed, weight.format, path)

        assert_rows_alone_equal(fn, x)
        results.append(fn(x))
    assert all(torch.equal(r, results[0]) for r in results)
    assert_rows_alone_equal(weight, x)  # the default path through the weight's own call


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 64), n=st.sampled_from([16, 80]), groups=st.integers(1, 6), seed=st.integers(0, 99)
)
def test_block_kernel_matches_a_float_reference(rows: int, n: int, groups: int, seed: int) -> None:
    """Within the bound of int8 activations (half a block step each) of x @ w.T in float64."""
    k = 32 * groups
    q4 = random_q4(n, k, seed)
    codes, d = random_q8(n, k, seed)
    x = block_inputs(rows, k, seed)
    half_step = (x.abs().view(rows, -1, 32).amax(-1) / 254).repeat_interleave(32, 1).double()
    for weight, dense in (
        (PackedWeight(q4), q4.dequantize()),
        (PackedWeight.q8_0(codes, d), (codes.float().view(n, -1, 32) * d[..., None]).view(n, k)),
    ):
        ref = x.double() @ dense.double().T
        bound = half_step @ dense.abs().double().T + 1e-5 * (x.abs().double() @ dense.abs().double().T)
        assert ((weight(x).double() - ref).abs() <= bound + 1e-6).all()


@settings(max_examples=15, deadline=None)
@given(rows=ROWS, n=st.integers(1, 70), k=st.integers(1, 100), seed=st.integers(0, 99))
def test_float32_linear_rows_do_not_depend_on_the_batch(rows: int, n: int, k: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    assert_rows_alone_equal(lambda t: cpu_kernels.linear(t, w), x)
    torch.testing.assert_close(cpu_kernels.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


def tree_parents(nodes: int, seed: int) -> list[int]:
    """A random draft tree: node 0 the root, node i's parent a random earlier node."""
    rng = np.random.default_rng(seed)
    return [-1] + [int(rng.integers(0, i)) for i in range(1, nodes)]


def ancestor_mask(parents: list[int]) -> np.ndarray:
    """[D, D] bool ancestor-or-self."""
    mask = np.eye(len(parents), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def depth(parents: list[int], i: int) -> int:
    return 0 if parents[i] < 0 else 1 + depth(parents, parents[i])


@settings(max_examples=15, deadline=None)
@given(nodes=ROWS, prefix=st.integers(1, 40), node=st.integers(0, 63), seed=st.integers(0, 99))
def test_a_tree_node_attends_as_the_decode_row_of_its_path(
    nodes: int, prefix: int, node: int, seed: int
) -> None:
    """Node ``node`` of a verify tree gets the attention output of a one-row decode step over the
    prefix and its path (the same K/V), bitwise; fp32 and bf16 caches."""
    node %= nodes
    parents = tree_parents(nodes, seed)
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    path.reverse()
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        keys = torch.randn(prefix + nodes, 2, 16, generator=g).to(dtype)
        values = torch.randn(prefix + nodes, 2, 16, generator=g).to(dtype)
        q = torch.randn(nodes, 6, 16, generator=g).to(dtype)
        mask = torch.from_numpy(ancestor_mask(parents))[None]
        tree = dataclasses.replace(meta_for([prefix + nodes], [nodes], seed=seed), tree_mask=mask)
        out_tree = attend(tree, q, keys[prefix:], values[prefix:], keys[:prefix], values[:prefix])
        line = meta_for([prefix + len(path)], [1], seed=seed + 1)
        rows = [prefix + i for i in path]  # the decode row's context: prefix, then the path in order
        kv_k, kv_v = (
            torch.cat([keys[:prefix], keys[rows[:-1]]]),
            torch.cat([values[:prefix], values[rows[:-1]]]),
        )
        out_line = attend(line, q[node : node + 1], keys[rows[-1:]], values[rows[-1:]], kv_k, kv_v)
        assert torch.equal(out_tree[node], out_line[0])


def attend(
    meta: AttentionMetadata,
    q: torch.Tensor,  # [T, 6, 16]
    k_new: torch.Tensor,  # [T, 2, 16]
    v_new: torch.Tensor,
    k_old: torch.Tensor,  # [committed, 2, 16]: kv indices 0.. of request 0
    v_old: torch.Tensor,
) -> torch.Tensor:
    """Write the committed K/V of request 0 into a fresh pool, then run the step."""
    cache = torch.zeros(2, int(meta.page_table.max()) + 1, PS, 2, 16, dtype=q.dtype)
    flat = cache.view(2, -1, 2, 16)
    table = meta.page_table[0].tolist()
    slots = [table[i // PS] * PS + i % PS for i in range(k_old.shape[0])]
    flat[0, slots], flat[1, slots] = k_old, v_old
    backend = TorchSDPABackend()
    return backend.forward(q, k_new, v_new, cache, backend.plan(meta), 0.25)


@settings(max_examples=10, deadline=None)
@given(lens=st.lists(st.integers(1, 50), min_size=2, max_size=64), member=st.integers(0, 63))
def test_a_decode_row_attends_alike_in_any_batch(lens: list[int], member: int) -> None:
    member %= len(lens)
    batch = meta_for(lens, [1] * len(lens), seed=len(lens))
    g = torch.Generator().manual_seed(member)
    pages = int(batch.page_table.max()) + 1
    cache = torch.randn(2, pages, PS, 2, 16, generator=g)
    q, k, v = (torch.randn(len(lens), h, 16, generator=g) for h in (6, 2, 2))
    backend = TorchSDPABackend()
    full = backend.forward(q, k, v, cache.clone(), backend.plan(batch), 0.25)
    b = torch.tensor([member])
    alone = AttentionMetadata(
        slot_mapping=batch.slot_mapping[b],
        page_table=batch.page_table[b],
        kv_lens=batch.kv_lens[b],
        q_lens=batch.q_lens[b],
        q_start=torch.tensor([0, 1]),
        max_q_len=1,
        max_kv_len=lens[member],
        page_size=PS,
    )
    one = backend.forward(q[b], k[b], v[b], cache.clone(), backend.plan(alone), 0.25)
    assert torch.equal(full[member], one[0])


# The embedded model through the runner: a row alone, in a batch, in a verify tree, in a chunk.


@pytest.fixture(scope="module")
def int4_llm() -> LLM:
    """The CPU default: the GGUF's 4-bit weights."""
    return LLM(device="cpu", kv_cache_tokens=16384)


class Pages:
    """Pages of the engine's pool for a test, freed at the end."""

    def __init__(self, llm: LLM) -> None:
        self.allocator = llm.engine.blocks.allocator
        self.page_size = llm.engine.blocks.page_size
        self.held: list[list[int]] = []

    def take(self, tokens: int) -> list[int]:
        pages = self.allocator.allocate(-(-tokens // self.page_size))
        self.held.append(pages)
        return pages

    def free(self) -> None:
        for pages in self.held:
            self.allocator.free(pages)


def prefill(llm: LLM, pages: list[int], ids: list[int]) -> torch.Tensor:
    step = StepInput([ids], [list(range(len(ids)))], [0], [pages], list(range(len(ids))))
    return llm.engine.runner.forward(step).clone()


def copy_pages(llm: LLM, src: list[int], dst: list[int]) -> None:
    kv = llm.engine.runner.kv_cache  # [layers, 2, pages, page_size, Hkv, d]
    kv[:, :, dst[: len(src)]] = kv[:, :, src]


def model_invariance(llm: LLM, batch: int, nodes: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = llm.tokenizer.encode("Row invariance: the same token, the same logits, whatever shares its step.")
    n, x, y = len(ids), int(rng.integers(3, 5000)), int(rng.integers(3, 5000))
    room = n + nodes + 2
    pages = Pages(llm)
    try:
        base = pages.take(room)
        chunk = prefill(llm, base, ids + [x, y])  # x and y inside a prefill chunk
        alone = pages.take(room)
        copy_pages(llm, base, alone)
        run = llm.engine.runner.forward
        x_alone = run(StepInput([[x]], [[n]], [n], [alone], [0])).clone()
        y_alone = run(StepInput([[y]], [[n + 1]], [n + 1], [alone], [0])).clone()
        assert torch.equal(chunk[n], x_alone[0]) and torch.equal(chunk[n + 1], y_alone[0])
        # A batch: member 0 decodes x; the others random tokens after prefixes of other lengths.
        members = [alone] + [pages.take(room) for _ in range(batch - 1)]
        for m in members[1:]:
            copy_pages(llm, base, m)
        lens = [n] + [int(rng.integers(1, n + 1)) for _ in range(batch - 1)]
        toks = [[x]] + [[int(t)] for t in rng.integers(3, 5000, batch - 1)]
        out = run(StepInput(toks, [[p] for p in lens], lens, members, list(range(batch))))
        assert torch.equal(out[0], x_alone[0])
        # A verify tree: root x, node 1 y (x's child), other nodes random tokens with random parents.
        parents = [-1, 0] + tree_parents(nodes, seed)[2:] if nodes > 1 else [-1]
        tree_toks = [x, y][:nodes] + [int(t) for t in rng.integers(3, 5000, max(0, nodes - 2))]
        positions = [n + depth(parents, i) for i in range(nodes)]
        tree = pages.take(room)
        copy_pages(llm, base, tree)
        step = StepInput(
            [tree_toks], [positions], [n], [tree], list(range(nodes)), ancestor_mask(parents)[None]
        )
        out = run(step)
        assert torch.equal(out[0], x_alone[0])
        if nodes > 1:
            assert torch.equal(out[1], y_alone[0])
    finally:
        pages.free()


@settings(max_examples=3, deadline=None)
@given(batch=ROWS, nodes=ROWS, seed=st.integers(0, 999))
def test_model_rows_alone_in_a_batch_in_a_tree_and_in_a_chunk_int4(
    int4_llm: LLM, batch: int, nodes: int, seed: int
) -> None:
    assert int4_llm.engine.runner.quantized
    model_invariance(int4_llm, batch, nodes, seed)


@settings(max_examples=3, deadline=None)
@given(batch=ROWS, nodes=ROWS, seed=st.integers(0, 999))
def test_model_rows_alone_in_a_batch_in_a_tree_and_in_a_chunk_float32(
    llm: LLM, batch: int, nodes: int, seed: int
) -> None:
    assert not llm.engine.runner.quantized
    model_invariance(llm, batch, nodes, seed)
