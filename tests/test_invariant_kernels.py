"""The row-invariant CUDA kernels (``numerics invariant``): a row's output, bit for bit, whatever
shares its launch, and the right values.

On a CUDA machine: ``pytest -m gpu tests/test_invariant_kernels.py``; without a GPU, under Triton's
CPU interpreter: ``NGRAMMAR_TRITON_INTERPRET=1 pytest -m gpu tests/test_invariant_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_triton_attention import check_against_reference, make_case
from triton_env import DEVICE, INTERPRET

from ngrammar.attention.metadata import AttentionMetadata
from ngrammar.attention.triton import TritonAttentionBackend
from ngrammar.kernels.invariant_linear import InvariantTiles, invariant_linear

pytestmark = pytest.mark.gpu

# The interpreter computes in numpy, which has no bf16.
DTYPE = torch.float32 if INTERPRET else torch.bfloat16
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
HEADS = [(9, 3, 64)] if INTERPRET else [(9, 3, 64), (32, 8, 128)]
PS = 16


@pytest.mark.parametrize("m,n,k", [(1, 96, 576), (5, 70, 130), (70, 33, 64), (300, 40, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_invariant_linear_matches_torch(m: int, n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, DTYPE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, DTYPE)
    b = torch.randn(n, generator=gen).to(DEVICE, DTYPE) if with_bias else None
    got = invariant_linear(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == DTYPE and got.shape == (m, n)
    err = (got.float() - want).abs().max().item()
    assert err <= TOL[DTYPE] * max(want.abs().max().item(), 1.0), err


@settings(max_examples=6 if INTERPRET else 40, deadline=None)
@given(m=st.integers(2, 80 if INTERPRET else 700), row=st.integers(0, 699), seed=st.integers(0, 99))
def test_invariant_linear_row_alone_equals_row_in_any_batch(m: int, row: int, seed: int) -> None:
    """Bitwise: a row computed alone == the same row among m rows (a batch, a tree, a chunk), across
    the row counts where ``choose_tiles`` changes the tiling."""
    row %= m
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 200, generator=gen).to(DEVICE, DTYPE)
    w = (torch.randn(72, 200, generator=gen) / 15).to(DEVICE, DTYPE)
    b = torch.randn(72, generator=gen).to(DEVICE, DTYPE)
    assert torch.equal(invariant_linear(x, w, b)[row], invariant_linear(x[row : row + 1], w, b)[0])


def test_every_tiling_gives_the_same_numbers() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(130, 576, generator=gen).to(DEVICE, DTYPE)
    w = (torch.randn(200, 576, generator=gen) / 24).to(DEVICE, DTYPE)
    want = invariant_linear(x, w)
    for t in (
        InvariantTiles(64, 32, num_stages=6),
        InvariantTiles(64, 32),
        InvariantTiles(64, 64),
        InvariantTiles(128, 64, num_warps=8),
    ):
        assert torch.equal(invariant_linear(x, w, tiles=t), want), t


# Attention: reference values, then rows alike in a decode, a tree, a chunk and a batch.

INVARIANT = TritonAttentionBackend(invariant=True)


@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize(
    "q_lens,kv_lens,tree",
    [
        ([5, 17, 1], [5, 17, 1], False),
        ([7, 20, 3], [40, 20, 70 if INTERPRET else 1300], False),
        ([1, 1, 1], [1, 70, 600 if INTERPRET else 5000], False),
        ([4, 8, 2], [21, 58, 4 if INTERPRET else 3002], True),
    ],
    ids=["prefill", "chunk", "decode", "tree"],
)
def test_invariant_attention_matches_reference(
    heads: tuple[int, int, int], q_lens: list[int], kv_lens: list[int], tree: bool
) -> None:
    case = make_case(q_lens, kv_lens, page_size=PS, heads=heads, dtype=DTYPE, tree=tree, seed=len(q_lens))
    check_against_reference(*case, backend=INVARIANT)


def _meta(q_lens: list[int], kv_lens: list[int], tree_mask: torch.Tensor | None = None) -> AttentionMetadata:
    """Requests laid out one after another in pages 0.., each over its own pages."""
    pages = [-(-kv // PS) for kv in kv_lens]
    first = [sum(pages[:b]) for b in range(len(pages))]
    table = torch.zeros(len(pages), max(pages), dtype=torch.int64)
    slots = []
    for b, (ql, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        table[b, : pages[b]] = torch.arange(first[b], first[b] + pages[b])
        slots.append(first[b] * PS + torch.arange(kv - ql, kv))
    q_start = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    q_start[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(DEVICE),
        page_table=table.to(DEVICE),
        kv_lens=torch.tensor(kv_lens, device=DEVICE),
        q_lens=torch.tensor(q_lens, device=DEVICE),
        q_start=q_start.to(DEVICE),
        max_q_len=max(q_lens),
        max_kv_len=max(kv_lens),
        page_size=PS,
        tree_mask=None if tree_mask is None else tree_mask.to(DEVICE),
    )


def _attend(
    meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, old: torch.Tensor
) -> torch.Tensor:
    """One step of request 0..B over a pool whose first kv rows are ``old`` [2, n, Hkv, d] (request
    0's committed K/V; other requests' pages stay zero)."""
    hkv, d = k.shape[1:]
    pages = int(meta.page_table.max().item()) + 1
    cache = torch.zeros(2, pages * PS, hkv, d, dtype=DTYPE, device=DEVICE)
    cache[:, : old.shape[1]] = old
    cache = cache.view(2, pages, PS, hkv, d)
    return INVARIANT.forward(q, k, v, cache, INVARIANT.plan(meta), d**-0.5)


def _qkv(n: int, heads: tuple[int, int, int], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    hq, hkv, d = heads
    return tuple(torch.randn(n, h, d, generator=gen).to(DEVICE, DTYPE) for h in (hq, hkv, hkv))


def _history(n: int, heads: tuple[int, int, int], gen: torch.Generator) -> torch.Tensor:
    """[2, n, Hkv, d]: the K and V of n committed tokens."""
    return torch.stack([torch.randn(n, heads[1], heads[2], generator=gen).to(DEVICE, DTYPE) for _ in "kv"])


def _decode_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int, old: torch.Tensor) -> torch.Tensor:
    """Token i of q/k/v decoded alone after the committed K/V ``old``: its output [Hq, d]."""
    one = slice(i, i + 1)
    return _attend(_meta([1], [old.shape[1] + 1]), q[one], k[one], v[one], old)[0]


def _then(old: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[int] | slice) -> torch.Tensor:
    """``old`` with the K/V of ``rows`` of k/v appended (as decode steps would have written them)."""
    return torch.cat([old, torch.stack([k[rows], v[rows]])], dim=1)


@settings(max_examples=5 if INTERPRET else 25, deadline=None)
@given(
    prefix=st.integers(1, 140 if INTERPRET else 1400),
    nodes=st.integers(1, 12 if INTERPRET else 64),
    node=st.integers(0, 63),
    seed=st.integers(0, 99),
)
def test_a_tree_node_attends_as_the_decode_row_of_its_path(
    prefix: int, nodes: int, node: int, seed: int
) -> None:
    heads = HEADS[0]
    node %= nodes
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]
    mask = torch.eye(nodes, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    path = [i for i in range(nodes) if mask[node, i]]  # ancestors-or-self, by depth
    old = _history(prefix, heads, gen)
    q, k, v = _qkv(nodes, heads, gen)
    tree = _attend(_meta([nodes], [prefix + nodes], mask[None]), q, k, v, old)
    assert torch.equal(tree[node], _decode_row(q, k, v, node, _then(old, k, v, path[:-1])))


@settings(max_examples=5 if INTERPRET else 25, deadline=None)
@given(
    prefix=st.integers(0, 140 if INTERPRET else 1400),
    chunk=st.integers(2, 40 if INTERPRET else 600),
    row=st.integers(0, 599),
    seed=st.integers(0, 99),
)
def test_a_prefill_row_attends_as_a_decode_row(prefix: int, chunk: int, row: int, seed: int) -> None:
    heads = HEADS[-1]
    row %= chunk
    gen = torch.Generator().manual_seed(seed)
    old = _history(prefix, heads, gen)
    q, k, v = _qkv(chunk, heads, gen)
    full = _attend(_meta([chunk], [prefix + chunk]), q, k, v, old)
    assert torch.equal(full[row], _decode_row(q, k, v, row, _then(old, k, v, slice(0, row))))


@settings(max_examples=5 if INTERPRET else 25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 120 if INTERPRET else 3000), min_size=2, max_size=8 if INTERPRET else 64),
    seed=st.integers(0, 99),
)
def test_a_decode_row_attends_alike_in_any_batch(lens: list[int], seed: int) -> None:
    """Request 0 decoding alone == request 0 decoding beside others (of other lengths)."""
    heads = HEADS[-1]
    gen = torch.Generator().manual_seed(seed)
    old = _history(lens[0] - 1, heads, gen)
    q, k, v = _qkv(len(lens), heads, gen)
    batch = _attend(_meta([1] * len(lens), lens), q, k, v, old)
    assert torch.equal(batch[0], _decode_row(q, k, v, 0, old))


def test_invariant_ops_rows_alone_equal_rows_in_a_batch() -> None:
    """``InvariantOps``' three projections with their norm / SiLU·mul: bitwise per row whatever the
    batch, and the torch reference's values."""
    from ngrammar.kernels.fused_ops import InvariantOps
    from ngrammar.model.ops import TorchOps

    gen = torch.Generator().manual_seed(3)
    m, k, n = 90, 96, 80

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, DTYPE)

    x, res, x2, g = rand(m, k), rand(m, k), rand(m, 2 * k), rand(k).abs() + 0.5
    w, wd = rand(n, k) / 10, rand(n, k) / 10
    calls = {
        "norm_linear": lambda ops, r: ops.norm_linear(x[r], res[r], g, 1e-5, w, None)[0],
        "silu_mul_linear": lambda ops, r: ops.silu_mul_linear(x2[r], wd),
        "linear": lambda ops, r: ops.linear(x[r], w),
    }
    ops, ref = InvariantOps(), TorchOps()
    for name, call in calls.items():
        full = call(ops, slice(None))
        for row in (0, 37, m - 1):
            assert torch.equal(full[row], call(ops, slice(row, row + 1))[0]), name
        want = call(ref, slice(None)).float()
        err = (full.float() - want).abs().max().item()
        assert err <= TOL[DTYPE] * max(want.abs().max().item(), 1.0), (name, err)
