"""The one-launch greedy tree acceptance kernel (``ngrammar.kernels.tree_accept``) against
``verify_tree_greedy``: identical results on random valid trees, padded trees and the golden tree.

On a CUDA machine: ``pytest -m gpu tests/test_tree_accept_kernel.py``; without a GPU, under Triton's
CPU interpreter: ``NGRAMMAR_TRITON_INTERPRET=1 pytest -m gpu tests/test_tree_accept_kernel.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_env import DEVICE

from ngrammar.kernels.tree_accept import GreedyAccept, greedy_tree_accept
from ngrammar.runner.acceptance import TreeAcceptResult, verify_tree_greedy
from ngrammar.runner.model_runner import compact_path_kv, move_kv_slots
from ngrammar.speculative.tree import mask_from_parents

pytestmark = pytest.mark.gpu


def _random_trees(rng: np.random.Generator, bs: int, d: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """Random parents (each < its child), tokens from a small vocabulary (so siblings repeat and
    matches are frequent), the ancestor-or-self mask, and a random target argmax per node."""
    parents = np.array(
        [[-1] + [int(rng.integers(0, i)) for i in range(1, d)] for _ in range(bs)], dtype=np.int64
    )
    mask = mask_from_parents(parents)
    tokens = rng.integers(0, vocab, size=(bs, d))
    predict = rng.integers(0, vocab, size=(bs, d))
    return (torch.as_tensor(tokens), torch.as_tensor(mask), torch.as_tensor(predict))


def _same(got: GreedyAccept, want: TreeAcceptResult) -> None:
    for name in ("accept_index", "accept_len", "accept_tokens", "accept_nodes", "bonus"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    assert torch.equal(got.packed.cpu(), want.packed())


def _same_moves(slots: torch.Tensor, kv_src: torch.Tensor | None, want: TreeAcceptResult) -> None:
    """Moving a KV pool by the kernel's source slots (``move_kv_slots``) leaves it as the torch
    path's ``compact_path_kv`` does."""
    assert kv_src is not None
    pool = torch.randn(2, 2, 1000 // 8, 8, 1, 4)  # [layers, k/v, pages, page size, kv heads, d]: 1000 slots
    want_pool, got_pool = pool.clone(), pool.clone()
    compact_path_kv(want_pool, slots, want.accept_nodes, want.accept_len)
    move_kv_slots(got_pool, slots, kv_src.cpu())
    assert torch.equal(got_pool, want_pool)


@pytest.mark.parametrize("d", [1, 2, 5, 8, 16, 33])
@pytest.mark.parametrize("bs", [1, 3, 8])
def test_kernel_accepts_what_the_torch_walk_accepts(bs: int, d: int) -> None:
    rng = np.random.default_rng(bs * 100 + d)
    for _ in range(4):
        tokens, mask, predict = _random_trees(rng, bs, d, vocab=3)
        want = verify_tree_greedy(tokens, mask, predict)
        slots = torch.as_tensor(rng.permutation(1000)[: bs * d].reshape(bs, d))
        got = greedy_tree_accept(tokens.to(DEVICE), mask.to(DEVICE), predict.to(DEVICE), slots.to(DEVICE))
        _same(got, want)
        _same_moves(slots, got.kv_src, want)
        bare = greedy_tree_accept(tokens.to(DEVICE), mask.to(DEVICE), predict.to(DEVICE))
        _same(bare, want)
        assert bare.kv_src is None


def test_kernel_on_chains_padding_and_the_golden_tree() -> None:
    # A chain that accepts everything, the graph runner's padding row (a chain of token 0 on a
    # lower-triangular mask), and the reference design's golden tree (rows 1000/1100/1010/1011).
    chain = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    golden = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = torch.stack([chain, chain, golden])
    tokens = torch.tensor([[5, 6, 7, 8], [0, 0, 0, 0], [9, 4, 7, 3]])
    predict = torch.tensor([[6, 7, 8, 11], [0, 0, 0, 0], [7, 2, 3, 1]])
    want = verify_tree_greedy(tokens, mask, predict)
    got = greedy_tree_accept(tokens.to(DEVICE), mask.to(DEVICE), predict.to(DEVICE))
    _same(got, want)
    assert got.accept_len.tolist() == [4, 4, 3]  # golden: root -> node 2 (7) -> node 3 (3), bonus 1
    assert got.accept_tokens[2].tolist() == [7, 3, 1, -1]


def test_kernel_rejects_mismatched_shapes() -> None:
    tokens = torch.zeros(2, 4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="shapes disagree"):
        greedy_tree_accept(tokens, torch.ones(2, 4, 3, dtype=torch.bool, device=DEVICE), tokens)
    with pytest.raises(ValueError, match="shapes disagree"):
        greedy_tree_accept(tokens, torch.ones(2, 4, 4, dtype=torch.bool, device=DEVICE), tokens, tokens[:1])
