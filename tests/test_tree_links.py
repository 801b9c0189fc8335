"""Draft-tree links: host derivation vs device reconstruction vs a naive definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ngrammar.speculative.tree import (
    DraftTree,
    carry_to_kept,
    derive_tree_links,
    mask_from_parents,
    reconstruct_indices_from_tree_mask,
)

TREE_KINDS = ("star", "chain", "bfs", "padded", "any_order")


def random_parents(rng: np.random.Generator, d: int, kind: str) -> np.ndarray:
    """Parent indices [D] (-1 at the root) of one random tree with parent < child.

    star: every node under the root; chain: a path; bfs: random BFS-ordered tree (parents
    non-decreasing); padded: a BFS tree of random size followed by extra root children, as the
    drafter pads; any_order: parent < child but not BFS ordered.
    """
    parents = np.full(d, -1, dtype=np.int64)
    if d == 1:
        return parents
    if kind == "star":
        parents[1:] = 0
    elif kind == "chain":
        parents[1:] = np.arange(d - 1)
    elif kind in ("bfs", "padded"):
        real = d if kind == "bfs" else int(rng.integers(1, d + 1))
        for i in range(1, real):
            parents[i] = int(rng.integers(parents[i - 1] if i > 1 else 0, i))
        parents[real:] = 0
    elif kind == "any_order":
        parents[1:] = [int(rng.integers(0, i)) for i in range(1, d)]
    else:
        raise ValueError(kind)
    return parents


def naive_links(parents: np.ndarray) -> tuple[list[int], list[int]]:
    """First child and next sibling straight from their definitions, one node at a time."""
    d = len(parents)
    next_token = [next((c for c in range(d) if parents[c] == i), -1) for i in range(d)]
    next_sibling = [
        next((c for c in range(i + 1, d) if parents[i] >= 0 and parents[c] == parents[i]), -1)
        for i in range(d)
    ]
    return next_token, next_sibling


def naive_depths(parents: np.ndarray) -> list[int]:
    depths = []
    for i in range(len(parents)):
        depth, node = 0, i
        while parents[node] >= 0:
            depth, node = depth + 1, int(parents[node])
        depths.append(depth)
    return depths


def test_sglang_golden_case() -> None:
    mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=np.int64).reshape(-1)
    next_token, next_sibling = derive_tree_links(mask, 1, 4)
    positions, retrive_index, dev_next_token, dev_next_sibling = reconstruct_indices_from_tree_mask(
        torch.from_numpy(mask != 0), torch.tensor([12]), 1, 4
    )
    for token_links, sibling_links in ((next_token, next_sibling), (dev_next_token, dev_next_sibling)):
        assert token_links.tolist() == [[1, -1, 3, -1]]
        assert sibling_links.tolist() == [[-1, 2, -1, -1]]
    assert positions.tolist() == [12, 13, 13, 14]
    assert retrive_index.tolist() == [[0, 1, 2, 3]]


def test_host_device_and_naive_agree_on_random_trees() -> None:
    rng = np.random.default_rng(1234)
    trees = 0
    while trees < 1200:
        bs = int(rng.integers(1, 9))
        d = int(rng.integers(1, 33))
        parents = np.stack(
            [random_parents(rng, d, TREE_KINDS[int(rng.integers(len(TREE_KINDS)))]) for _ in range(bs)]
        )
        mask = mask_from_parents(parents)
        seq_lens = torch.from_numpy(rng.integers(0, 1000, size=bs))
        trees += bs

        host_next_token, host_next_sibling = derive_tree_links(mask.reshape(-1), bs, d)
        positions, retrive_index, dev_next_token, dev_next_sibling = reconstruct_indices_from_tree_mask(
            torch.from_numpy(mask.reshape(-1)), seq_lens, bs, d
        )
        assert host_next_token.dtype == host_next_sibling.dtype == torch.int64
        assert host_next_token.shape == host_next_sibling.shape == (bs, d)
        assert torch.equal(host_next_token, dev_next_token)
        assert torch.equal(host_next_sibling, dev_next_sibling)
        assert torch.equal(retrive_index, torch.arange(bs * d).reshape(bs, d))

        expected_positions = []
        for b in range(bs):
            next_token, next_sibling = naive_links(parents[b])
            assert host_next_token[b].tolist() == next_token
            assert host_next_sibling[b].tolist() == next_sibling
            expected_positions += [int(seq_lens[b]) + depth for depth in naive_depths(parents[b])]
        assert positions.tolist() == expected_positions


@pytest.mark.parametrize("dtype", [np.bool_, np.int64, np.int32, np.uint8])
@pytest.mark.parametrize("flat", [True, False])
def test_mask_layouts_and_dtypes(dtype: type, flat: bool) -> None:
    rng = np.random.default_rng(7)
    parents = np.stack([random_parents(rng, 6, "bfs") for _ in range(3)])
    mask = mask_from_parents(parents).astype(dtype)
    if flat:
        mask = mask.reshape(-1)
    expected = [naive_links(p) for p in parents]
    next_token, next_sibling = derive_tree_links(mask, 3, 6)
    assert next_token.tolist() == [links[0] for links in expected]
    assert next_sibling.tolist() == [links[1] for links in expected]
    _, _, dev_next_token, dev_next_sibling = reconstruct_indices_from_tree_mask(
        torch.from_numpy(mask), torch.zeros(3, dtype=torch.int32), 3, 6
    )
    assert torch.equal(dev_next_token, next_token) and torch.equal(dev_next_sibling, next_sibling)


def test_parents_kept_by_from_parents_equal_those_read_from_the_mask() -> None:
    rng = np.random.default_rng(99)
    for _ in range(300):
        bs, d = int(rng.integers(1, 9)), int(rng.integers(1, 33))
        parents = np.stack(
            [random_parents(rng, d, TREE_KINDS[int(rng.integers(len(TREE_KINDS)))]) for _ in range(bs)]
        )
        parents[:, 0] = rng.integers(-1, 5, size=bs)  # whatever a builder left at the root
        tree = DraftTree.from_parents(np.zeros(bs * d, dtype=np.int64), parents)
        from_mask = DraftTree(tree.tokens, tree.mask, bs, d)  # no parents given: read from the mask
        assert tree.parents().tolist() == from_mask.parents().tolist()
        assert from_mask.parents()[:, 0].tolist() == [-1] * bs


def test_mask_from_parents_is_ancestor_or_self() -> None:
    parents = np.array([[-1, 0, 0, 1, 2, 3, 0, 0]])
    mask = mask_from_parents(parents)[0]
    ancestors = {
        0: {0},
        1: {0, 1},
        2: {0, 2},
        3: {0, 1, 3},
        4: {0, 2, 4},
        5: {0, 1, 3, 5},
        6: {0, 6},
        7: {0, 7},
    }
    for i, row in ancestors.items():
        assert set(np.flatnonzero(mask[i]).tolist()) == row


@pytest.mark.parametrize(
    "bs,d", [(1, 1), (1, 16), (3, 33), (8, 16), (16, 16), (17, 16), (32, 16), (2, 64), (2, 65)]
)
def test_mask_from_parents_matches_walking_up_the_tree(bs: int, d: int) -> None:
    """Both ways of building the mask (int bit sets for small batches, a numpy pass per node index
    for large batches or trees wider than 64) against each node's ancestors found by walking up."""
    rng = np.random.default_rng(bs * 100 + d)
    parents = np.stack([random_parents(rng, d, TREE_KINDS[b % len(TREE_KINDS)]) for b in range(bs)])
    parents[:, 0] = rng.integers(-1, 3, size=bs)  # ignored at the root
    mask = mask_from_parents(parents)
    assert mask.dtype == np.bool_ and mask.shape == (bs, d, d)
    for b in range(bs):
        for i in range(d):
            ancestors, node = {i}, i
            while node > 0:
                node = int(parents[b, node])
                ancestors.add(node)
            assert set(np.flatnonzero(mask[b, i]).tolist()) == ancestors


@pytest.mark.parametrize("bad", [[-1, 0, 2], [-1, -1, 0], [-1, 0, 3]])
@pytest.mark.parametrize("bs", [1, 100])  # the bit-set path and the numpy one
def test_mask_from_parents_rejects_a_parent_not_before_its_child(bad: list[int], bs: int) -> None:
    with pytest.raises(ValueError, match="parent"):
        mask_from_parents(np.array([bad] * bs))


def test_draft_tree_helpers() -> None:
    parents = np.array([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    tree = DraftTree.from_parents(np.arange(8), parents)
    assert tree.tokens.dtype == np.int64 and tree.mask.dtype == np.bool_
    assert tree.parents().tolist() == parents.tolist()
    assert tree.depths().tolist() == [[0, 1, 1, 2], [0, 1, 2, 3]]
    assert tree.tokens_2d().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_draft_tree_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        DraftTree(np.zeros(3, dtype=np.int64), np.ones((1, 4, 4), dtype=np.bool_), 1, 4)
    with pytest.raises(ValueError):
        DraftTree(np.zeros(4, dtype=np.int64), np.ones((1, 4, 4), dtype=np.int64), 1, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks for device->host syncs")
def test_reconstruct_matches_cpu_without_syncing_on_cuda() -> None:
    rng = np.random.default_rng(99)
    parents = np.stack([random_parents(rng, 16, "padded") for _ in range(8)])
    mask = torch.from_numpy(mask_from_parents(parents).reshape(-1))
    seq_lens = torch.arange(8) * 10
    expected = reconstruct_indices_from_tree_mask(mask, seq_lens, 8, 16)
    mask_gpu, seq_lens_gpu = mask.cuda(), seq_lens.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = reconstruct_indices_from_tree_mask(mask_gpu, seq_lens_gpu, 8, 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, want in zip(result, expected):
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want)


def test_host_and_device_agree_on_arbitrary_masks() -> None:
    rng = np.random.default_rng(5)
    for _ in range(200):
        bs, d = int(rng.integers(1, 5)), int(rng.integers(1, 12))
        mask = rng.random((bs, d, d)) < 0.4  # not a tree: links follow the same definitions anyway
        host = derive_tree_links(mask, bs, d)
        _, _, *device = reconstruct_indices_from_tree_mask(torch.from_numpy(mask), torch.zeros(bs), bs, d)
        assert torch.equal(host[0], device[0]) and torch.equal(host[1], device[1])


# ------------------------------------------------------------------ keep_nodes (grammar pruning)


def _paths(parents: list[int], tokens: list[int]) -> list[tuple[int, ...]]:
    """Each node's token path from the root's first child down to itself."""
    out: list[tuple[int, ...]] = []
    for i in range(len(parents)):
        path, node = [], i
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        out.append(tuple(reversed(path)))
    return out


def test_keep_nodes_golden() -> None:
    # Root 7 with children 11, 12, 13; 21 under 11, 22 under 12, 31 under 22; node 7 is padding.
    parents = np.array([[-1, 0, 0, 0, 1, 2, 5, 0]])
    tokens = np.array([7, 11, 12, 13, 21, 22, 31, 0])
    tree = DraftTree.from_parents(tokens, parents)
    assert tree.padding().tolist() == [[False] * 7 + [True]]
    keep = np.array([[True, False, True, True, False, True, True, False]])  # 11's subtree and the pad go
    pruned = tree.keep_nodes(keep, 8)
    assert pruned.tokens.tolist() == [7, 12, 13, 22, 31, 0, 0, 0]
    assert pruned.parents().tolist() == [[-1, 0, 0, 1, 3, 0, 0, 0]]
    narrow = tree.keep_nodes(keep, 5)
    assert narrow.draft_token_num == 5 and narrow.tokens.tolist() == [7, 12, 13, 22, 31]
    assert np.array_equal(narrow.mask, mask_from_parents(np.array([[-1, 0, 0, 1, 3]])))
    # 11 kept without its child 21: as drafted it has a child (a run stopping there was rejected,
    # not censored), which the pruned tree alone cannot tell.
    keep[0, 1] = True
    pruned = tree.keep_nodes(keep, 6)
    assert pruned.tokens.tolist() == [7, 11, 12, 13, 22, 31]
    assert pruned.has_child().tolist() == [[True, False, True, False, True, False]]
    assert carry_to_kept(tree.has_child(), keep, 6, False).tolist() == [
        [True, True, True, False, True, False]
    ]


def test_a_drafted_pad_token_with_children_is_not_padding() -> None:
    """Regression: token 0 is also a real token (SmolLM2's <|endoftext|>, indexed from a prompt
    holding it). A root child with that token and children of its own read as padding, so the
    nodes not padding lost an ancestor and ``keep_nodes`` raised, taking the engine step down."""
    tree = DraftTree.from_parents(np.array([5, 0, 7, 0]), np.array([[-1, 0, 1, 0]]))
    assert tree.padding().tolist() == [[False, False, False, True]]  # only the leaf pad
    keep = ~tree.padding()
    pruned = tree.keep_nodes(keep, 3)
    assert pruned.tokens.tolist() == [5, 0, 7] and pruned.parents().tolist() == [[-1, 0, 1]]


def test_the_nodes_that_are_not_padding_form_a_tree() -> None:
    """Whatever the tokens, the nodes ``proposer.trim_drafted`` starts from (all but padding) are closed
    under ancestors: 500 random trees over tokens {0, 1, 2}, so token 0 appears at every depth."""
    rng = np.random.default_rng(17)
    for _ in range(500):
        bs, d = int(rng.integers(1, 4)), int(rng.choice([2, 4, 8, 16]))
        parents = np.stack([random_parents(rng, d, str(rng.choice(list(TREE_KINDS)))) for _ in range(bs)])
        tree = DraftTree.from_parents(rng.integers(0, 3, size=bs * d), parents)
        keep = ~tree.padding()
        assert keep[:, 0].all()
        for i in range(1, d):
            assert (~keep[:, i] | keep[np.arange(bs), parents[:, i]]).all()
        tree.keep_nodes(keep, int(keep.sum(axis=1).max()))


@pytest.mark.parametrize(
    "bad, message",
    [
        ([[False, True, True]], "keep every root"),
        ([[True, False, True]], "parent of every kept node"),
    ],
)
def test_keep_nodes_rejects_a_set_that_is_not_a_tree(bad: list[list[bool]], message: str) -> None:
    tree = DraftTree.from_parents(np.array([5, 6, 7]), np.array([[-1, 0, 1]]))
    with pytest.raises(ValueError, match=message):
        tree.keep_nodes(np.array(bad), 3)
    with pytest.raises(ValueError, match="more than width"):
        tree.keep_nodes(np.ones((1, 3), dtype=bool), 2)


def test_pruned_trees_accept_what_the_full_trees_accept() -> None:
    """Dropping nodes the target can never pick (as a grammar's bitmask guarantees) keeps every
    kept node's path and sibling order, so greedy verification accepts the same tokens."""
    from ngrammar.runner.acceptance import verify_tree_greedy

    rng = np.random.default_rng(11)
    for _ in range(300):
        bs, d = int(rng.integers(1, 5)), int(rng.choice([2, 4, 8, 16]))
        parents = np.stack(
            [random_parents(rng, d, str(rng.choice(["star", "chain", "bfs", "padded"]))) for _ in range(bs)]
        )
        tokens = rng.integers(1, 6, size=(bs, d))  # few distinct tokens: siblings often repeat
        keep = rng.random((bs, d)) < 0.7
        keep[:, 0] = True
        for i in range(1, d):  # closed under ancestors
            keep[:, i] &= keep[np.arange(bs), np.maximum(parents[:, i], 0)]
        tree = DraftTree.from_parents(tokens.reshape(-1), parents)
        width = int(keep.sum(axis=1).max())
        pruned = tree.keep_nodes(keep, width)
        # The target at a path: a token no dropped child of that path carries (a grammar's mask
        # would forbid those), drawn from the path so both trees see the same target.
        paths = [_paths(parents[b].tolist(), tokens[b].tolist()) for b in range(bs)]
        forbidden: dict[tuple[int, tuple[int, ...]], set[int]] = {}
        for b in range(bs):
            for i in range(1, d):
                if not keep[b, i]:
                    forbidden.setdefault((b, paths[b][int(parents[b, i])]), set()).add(int(tokens[b, i]))

        def target(b: int, path: tuple[int, ...]) -> int:
            options = [t for t in range(1, 6) if t not in forbidden.get((b, path), set())]
            return options[hash((b, path)) % len(options)] if options else 9

        def accepted(t: DraftTree) -> list[list[int]]:
            w = t.draft_token_num
            toks = t.tokens_2d()
            ps = [_paths(t.parents()[b].tolist(), toks[b].tolist()) for b in range(bs)]
            predict = torch.tensor([[target(b, ps[b][i]) for i in range(w)] for b in range(bs)])
            r = verify_tree_greedy(torch.from_numpy(toks), torch.from_numpy(t.mask), predict)
            return [r.accept_tokens[b, : int(r.accept_len[b])].tolist() for b in range(bs)]

        assert accepted(pruned) == accepted(tree)
        kept_paths = [sorted(p for p, k in zip(paths[b], keep[b]) if k) for b in range(bs)]
        new_paths = [
            sorted(_paths(pruned.parents()[b].tolist(), pruned.tokens_2d()[b].tolist())[: int(keep[b].sum())])
            for b in range(bs)
        ]
        assert new_paths == kept_paths  # (from_parents checked parent < child)
