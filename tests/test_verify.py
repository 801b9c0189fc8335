"""Tests for tree acceptance: hand cases, naive link-walk references, and sampling unbiasedness."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from ngrammar.runner.acceptance import (
    TreeAcceptResult,
    sample_from_probs,
    tree_speculative_sampling_target_only,
    unpack_accepted,
    verify_tree_greedy,
)

# ---------------------------------------------------------------------------------------------
# Tree builders: a tree is (parents, tokens) with parents[0] == -1 and parents[i] < i.
# ---------------------------------------------------------------------------------------------


def mask_from_parents(parents: list[int]) -> torch.Tensor:
    """[D, D] bool ancestor-or-self mask."""
    d = len(parents)
    mask = torch.zeros(d, d, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def links_from_parents(parents: list[int]) -> tuple[list[int], list[int]]:
    """(next_token, next_sibling) lists as in the tree contract."""
    d = len(parents)
    next_token = [-1] * d
    next_sibling = [-1] * d
    last_child: dict[int, int] = {}
    for i in range(1, d):
        p = parents[i]
        if p in last_child:
            next_sibling[last_child[p]] = i
        else:
            next_token[p] = i
        last_child[p] = i
    return next_token, next_sibling


def random_tree(rng: random.Random, d: int, vocab: int) -> tuple[list[int], list[int]]:
    """A random tree of `real` nodes, then pads (root children of token 0) up to d nodes."""
    real = rng.randint(1, d)
    parents = [-1] + [rng.randrange(i) for i in range(1, real)]
    tokens = [rng.randrange(vocab) for _ in range(real)]
    parents += [0] * (d - real)
    tokens += [0] * (d - real)
    return parents, tokens


def batch_tensors(trees: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack trees into (candidates [bs, D], tree_mask [bs, D, D])."""
    candidates = torch.tensor([tokens for _, tokens in trees], dtype=torch.int64)
    mask = torch.stack([mask_from_parents(parents) for parents, _ in trees])
    return candidates, mask


# ---------------------------------------------------------------------------------------------
# Naive references: walk next_token / next_sibling links one request at a time.
# ---------------------------------------------------------------------------------------------


def reference_greedy(parents: list[int], tokens: list[int], predict: list[int]) -> tuple[list[int], int]:
    """(path nodes incl. root, bonus)."""
    next_token, next_sibling = links_from_parents(parents)
    path = [0]
    while True:
        cur = path[-1]
        child = next_token[cur]
        while child != -1 and tokens[child] != predict[cur]:
            child = next_sibling[child]
        if child == -1:
            return path, predict[cur]
        path.append(child)


def reference_inverse_cdf(row: list[float], coin: float) -> int:
    total = 0.0
    cdf = []
    for p in row:
        total += p
        cdf.append(total)
    target = coin * total
    last_nonzero = max((i for i, p in enumerate(row) if p > 0), default=0)
    for i, c in enumerate(cdf):
        if target < c:
            return min(i, last_nonzero)
    return last_nonzero


def reference_sampling(
    parents: list[int],
    tokens: list[int],
    probs: list[list[float]],
    coins: list[float],
    final_coin: float,
    threshold_single: float,
    threshold_acc: float,
) -> tuple[list[int], int]:
    """(path nodes incl. root, bonus) by the sequential target-only walk."""
    next_token, next_sibling = links_from_parents(parents)
    path = [0]
    while True:
        cur = path[-1]
        coin = coins[cur]
        prob_acc = 0.0
        seen: set[int] = set()
        accepted = -1
        child = next_token[cur]
        while child != -1:
            tok = tokens[child]
            if tok not in seen:
                seen.add(tok)
                p = probs[cur][tok]
                prob_acc += p
                if p > 0 and (coin < prob_acc / threshold_acc or p >= threshold_single):
                    accepted = child
                    break
            child = next_sibling[child]
        if accepted == -1:
            break
        path.append(accepted)
    last = path[-1]
    row = list(probs[last])
    child = next_token[last]
    while child != -1:
        row[tokens[child]] = 0.0
        child = next_sibling[child]
    if sum(row) <= 0:
        row = list(probs[last])
    return path, reference_inverse_cdf(row, final_coin)


def expected_result(paths: list[list[int]], bonuses: list[int], trees, d: int) -> dict[str, list]:
    """Padded lists of every TreeAcceptResult field from reference paths."""
    fields = ("accept_index", "accept_len", "accept_tokens", "accept_nodes")
    out: dict[str, list] = {k: [] for k in fields}
    for b, (path, bonus, (_, tokens)) in enumerate(zip(paths, bonuses, trees)):
        pad = [-1] * (d - len(path))
        out["accept_nodes"].append(path + pad)
        out["accept_index"].append([b * d + n for n in path] + pad)
        out["accept_len"].append(len(path))
        out["accept_tokens"].append([tokens[n] for n in path[1:]] + [bonus] + pad)
    out["bonus"] = bonuses
    return out


def assert_result(result: TreeAcceptResult, expected: dict[str, list]) -> None:
    for name, want in expected.items():
        got = getattr(result, name)
        assert got.dtype == torch.int64, name
        assert got.tolist() == want, name


# ---------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------

# Shared hand tree (D=6): 0 -> {1:"10", 2:"11"}, 1 -> {3:"12"}, 3 -> {4:"13"}, then pad 5 (token 0).
HAND_PARENTS = [-1, 0, 0, 1, 3, 0]
HAND_TOKENS = [99, 10, 11, 12, 13, 0]


def run_greedy(parents, tokens, predict) -> TreeAcceptResult:
    candidates, mask = batch_tensors([(parents, tokens)])
    return verify_tree_greedy(candidates, mask, torch.tensor([predict]))


def test_greedy_chain_fully_accepted() -> None:
    # predict after node i: 0->10, 1->12, 3->13, 4->7 (bonus)
    result = run_greedy(HAND_PARENTS, HAND_TOKENS, [10, 12, 0, 13, 7, 0])
    assert result.accept_nodes.tolist() == [[0, 1, 3, 4, -1, -1]]
    assert result.accept_index.tolist() == [[0, 1, 3, 4, -1, -1]]
    assert result.accept_len.tolist() == [4]
    assert result.accept_tokens.tolist() == [[10, 12, 13, 7, -1, -1]]
    assert result.bonus.tolist() == [7]


def test_greedy_second_sibling_accepted() -> None:
    result = run_greedy(HAND_PARENTS, HAND_TOKENS, [11, 12, 5, 13, 7, 0])
    assert result.accept_nodes.tolist() == [[0, 2, -1, -1, -1, -1]]
    assert result.accept_tokens.tolist() == [[11, 5, -1, -1, -1, -1]]
    assert result.accept_len.tolist() == [2]


def test_greedy_nothing_accepted() -> None:
    result = run_greedy(HAND_PARENTS, HAND_TOKENS, [42, 12, 5, 13, 7, 0])
    assert result.accept_nodes.tolist() == [[0, -1, -1, -1, -1, -1]]
    assert result.accept_len.tolist() == [1]
    assert result.accept_tokens.tolist() == [[42, -1, -1, -1, -1, -1]]
    assert result.bonus.tolist() == [42]


def test_greedy_duplicate_pads_take_first() -> None:
    parents = [-1, 0, 0, 0, 0]
    tokens = [5, 9, 0, 0, 0]
    result = run_greedy(parents, tokens, [0, 1, 3, 4, 6])
    assert result.accept_nodes.tolist() == [[0, 2, -1, -1, -1]]
    assert result.accept_tokens.tolist() == [[0, 3, -1, -1, -1]]


def test_greedy_batch_rows_differ() -> None:
    trees = [(HAND_PARENTS, HAND_TOKENS)] * 3
    candidates, mask = batch_tensors(trees)
    predict = torch.tensor([[10, 12, 0, 13, 7, 0], [11, 12, 5, 13, 7, 0], [42, 12, 5, 13, 7, 0]])
    result = verify_tree_greedy(candidates, mask, predict)
    assert result.accept_len.tolist() == [4, 2, 1]
    assert result.accept_index.tolist() == [
        [0, 1, 3, 4, -1, -1],
        [6, 8, -1, -1, -1, -1],
        [12, -1, -1, -1, -1, -1],
    ]
    assert result.bonus.tolist() == [7, 5, 42]


def test_packed_result_reads_back_as_its_three_tensors() -> None:
    """The one tensor a verify step reads back (CUDA-graph acceptance packs it on the device)
    unpacks into exactly accept_tokens, accept_len and accept_nodes, row by row."""
    candidates, mask = batch_tensors([(HAND_PARENTS, HAND_TOKENS)] * 3)
    predict = torch.tensor([[10, 12, 0, 13, 7, 0], [11, 12, 5, 13, 7, 0], [42, 12, 5, 13, 7, 0]])
    result = verify_tree_greedy(candidates, mask, predict)
    packed = result.packed()
    assert packed.shape == (3, 13) and packed.dtype == torch.int64
    tokens, lens, nodes = unpack_accepted(packed)
    assert tokens == result.accept_tokens.tolist()
    assert lens == result.accept_len.tolist() == [4, 2, 1]
    assert nodes == result.accept_nodes.tolist()
    head = unpack_accepted(result.head(2).packed())
    assert head == (tokens[:2], lens[:2], nodes[:2])


def test_greedy_matches_reference_on_random_trees() -> None:
    rng = random.Random(1234)
    checked = 0
    for _ in range(60):
        d = rng.randint(1, 12)
        bs = rng.randint(1, 10)
        vocab = rng.choice([2, 4, 16])
        trees = [random_tree(rng, d, vocab) for _ in range(bs)]
        # Bias the target towards some child's token so deep paths are common.
        predict = []
        for parents, tokens in trees:
            row = []
            for node in range(d):
                kids = [tokens[c] for c in range(d) if parents[c] == node]
                hit = kids and rng.random() < 0.8
                row.append(rng.choice(kids) if hit else rng.randrange(vocab))
            predict.append(row)
        candidates, mask = batch_tensors(trees)
        result = verify_tree_greedy(candidates, mask, torch.tensor(predict))
        refs = [reference_greedy(p, t, pr) for (p, t), pr in zip(trees, predict)]
        expected = expected_result([r[0] for r in refs], [r[1] for r in refs], trees, d)
        assert_result(result, expected)
        checked += bs
    assert checked >= 300


# ---------------------------------------------------------------------------------------------
# Sampling: exact agreement with the naive walk
# ---------------------------------------------------------------------------------------------


def random_probs(rng: random.Random, gen: torch.Generator, bs: int, d: int, vocab: int) -> torch.Tensor:
    """[bs, D, V] float64 rows, some peaked, some with zero entries."""
    scale = rng.choice([0.5, 2.0, 6.0])
    logits = torch.randn(bs, d, vocab, generator=gen, dtype=torch.float64) * scale
    probs = logits.softmax(-1)
    zero = torch.rand(bs, d, vocab, generator=gen, dtype=torch.float64) < 0.3
    probs = probs.masked_fill(zero, 0.0)
    probs[..., 0] += 1e-3  # keep every row nonzero
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("thresholds", [(1.0, 1.0), (0.5, 0.3), (0.0, 1.0)])
def test_sampling_matches_reference(thresholds: tuple[float, float]) -> None:
    threshold_single, threshold_acc = thresholds
    rng = random.Random(99)
    gen = torch.Generator().manual_seed(99)
    checked = 0
    for _ in range(60):
        d = rng.randint(1, 10)
        bs = rng.randint(1, 10)
        vocab = rng.choice([3, 6, 12])
        trees = [random_tree(rng, d, vocab) for _ in range(bs)]
        candidates, mask = batch_tensors(trees)
        probs = random_probs(rng, gen, bs, d, vocab)
        coins = torch.rand(bs, d, generator=gen, dtype=torch.float64)
        final_coins = torch.rand(bs, generator=gen, dtype=torch.float64)
        result = tree_speculative_sampling_target_only(
            candidates, mask, probs, coins, final_coins, threshold_single, threshold_acc
        )
        refs = [
            reference_sampling(p, t, probs[b].tolist(), coins[b].tolist(), final_coins[b].item(), *thresholds)
            for b, (p, t) in enumerate(trees)
        ]
        expected = expected_result([r[0] for r in refs], [r[1] for r in refs], trees, d)
        assert_result(result, expected)
        checked += bs
    assert checked >= 300


def test_sampling_zero_coin_skips_zero_probability_child() -> None:
    parents = [-1, 0, 0]
    tokens = [0, 1, 2]
    candidates, mask = batch_tensors([(parents, tokens)])
    probs = torch.zeros(1, 3, 4)
    probs[0, 0] = torch.tensor([0.5, 0.0, 0.5, 0.0])
    probs[0, 1:] = 0.25
    result = tree_speculative_sampling_target_only(candidates, mask, probs, torch.zeros(1, 3), torch.zeros(1))
    assert result.accept_nodes.tolist() == [[0, 2, -1]]


def test_sampling_residual_all_covered_falls_back_to_target() -> None:
    # Children cover all the mass; a coin just below 1 can slip past through rounding.
    parents = [-1, 0, 0]
    tokens = [0, 0, 1]
    candidates, mask = batch_tensors([(parents, tokens)])
    probs = torch.tensor([[[0.3, 0.7], [0.5, 0.5], [0.5, 0.5]]])
    result = tree_speculative_sampling_target_only(
        candidates, mask, probs, torch.tensor([[1.5, 0.0, 0.0]]), torch.tensor([0.9])
    )
    assert result.accept_len.tolist() == [1]
    assert result.bonus.tolist() == [1]


# ---------------------------------------------------------------------------------------------
# Sampling: unbiasedness
# ---------------------------------------------------------------------------------------------

# Toy tree (D=9) over V=8: root children 2, 5, 0 (pad), 0 (pad, duplicate); depth 2 and 3 below.
TOY_PARENTS = [-1, 0, 0, 1, 1, 3, 2, 0, 0]
TOY_TOKENS = [7, 2, 5, 1, 3, 6, 2, 0, 0]


def toy_probs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    rows = torch.rand(len(TOY_PARENTS), 8, generator=gen) + 0.05
    rows[0, 4] = 0.0  # a token no draw may ever produce
    rows[1, 6] = 0.0
    rows[0, 0] *= 3  # make the pad token likely at the root
    return rows / rows.sum(-1, keepdim=True)


def chi_square_p_value(counts: list[int], probs: list[float]) -> float:
    """Pearson goodness-of-fit p-value; zero-probability cells must have zero counts."""
    total = sum(counts)
    stat = 0.0
    cells = 0
    for count, p in zip(counts, probs):
        if p == 0:
            assert count == 0
            continue
        expected = total * p
        stat += (count - expected) ** 2 / expected
        cells += 1
    dof = cells - 1
    if dof <= 0:
        return 1.0
    # Survival function of chi-square(dof) = regularized upper incomplete gamma Q(dof/2, stat/2).
    half_dof = torch.tensor(dof / 2.0, dtype=torch.float64)
    return torch.special.gammaincc(half_dof, torch.tensor(stat / 2.0, dtype=torch.float64)).item()


def child_by_token(parents: list[int], tokens: list[int], node: int, token: int) -> int:
    """The first child of node carrying token, or -1."""
    for c in range(1, len(parents)):
        if parents[c] == node and tokens[c] == token:
            return c
    return -1


def draw_toy(
    n: int, seed: int, threshold_single: float = 1.0, threshold_acc: float = 1.0
) -> TreeAcceptResult:
    d = len(TOY_PARENTS)
    gen = torch.Generator().manual_seed(seed)
    candidates = torch.tensor(TOY_TOKENS).expand(n, d)
    mask = mask_from_parents(TOY_PARENTS).expand(n, d, d)
    probs = toy_probs().expand(n, d, 8)
    return tree_speculative_sampling_target_only(
        candidates,
        mask,
        probs,
        torch.rand(n, d, generator=gen),
        torch.rand(n, generator=gen),
        threshold_single,
        threshold_acc,
    )


def test_sampling_is_unbiased_at_every_node() -> None:
    """Each emitted token, given the emitted prefix, follows the target row of the node it reached.

    The node is recovered from the emitted tokens alone: emission continues past a token exactly
    when that token is a child of the current node.
    """
    n = 20000
    result = draw_toy(n, seed=0)
    probs = toy_probs()
    counts: dict[int, Counter] = {node: Counter() for node in range(len(TOY_PARENTS))}
    for tokens, length in zip(result.accept_tokens.tolist(), result.accept_len.tolist()):
        node = 0
        for k in range(length):
            counts[node][tokens[k]] += 1
            child = child_by_token(TOY_PARENTS, TOY_TOKENS, node, tokens[k])
            assert (child != -1) == (k < length - 1)
            node = child
    assert sum(counts[0].values()) == n
    tested = 0
    for node, counter in counts.items():
        if sum(counter.values()) < 1000:
            continue
        row = probs[node].tolist()
        p_value = chi_square_p_value([counter[t] for t in range(8)], row)
        assert p_value > 1e-3, (node, p_value, counter)
        tested += 1
    assert tested >= 4


def test_sampling_joint_of_first_two_tokens() -> None:
    """Over draws with accept_len >= 2, (t1, t2) follows q_root(t1) q_node(t1)(t2), renormalized."""
    n = 20000
    result = draw_toy(n, seed=1)
    probs = toy_probs()
    joint = Counter()
    for tokens, length in zip(result.accept_tokens.tolist(), result.accept_len.tolist()):
        if length >= 2:
            joint[(tokens[0], tokens[1])] += 1
    cells, expected = [], []
    for t1 in range(8):
        node = child_by_token(TOY_PARENTS, TOY_TOKENS, 0, t1)
        for t2 in range(8):
            cells.append(joint[(t1, t2)])
            expected.append(probs[0, t1].item() * probs[node, t2].item() if node != -1 else 0.0)
    total = sum(expected)
    assert chi_square_p_value(cells, [e / total for e in expected]) > 1e-3


def test_lenient_thresholds_are_lossy() -> None:
    result = draw_toy(20000, seed=2, threshold_single=1.0, threshold_acc=0.3)
    first = Counter(result.accept_tokens[:, 0].tolist())
    p_value = chi_square_p_value([first[t] for t in range(8)], toy_probs()[0].tolist())
    assert p_value < 1e-6


# ---------------------------------------------------------------------------------------------
# sample_from_probs and device independence
# ---------------------------------------------------------------------------------------------


def test_sample_from_probs_edges() -> None:
    half = [0.0, 0.5, 0.5, 0.0]
    probs = torch.tensor([half, half, [0.2, 0.0, 0.0, 0.0], [0.0] * 4])
    coins = torch.tensor([0.0, 1.0 - 1e-12, 0.999999, 0.5])
    assert sample_from_probs(probs, coins).tolist() == [1, 2, 0, 0]


def test_sample_from_probs_distribution() -> None:
    gen = torch.Generator().manual_seed(3)
    row = torch.tensor([0.1, 0.0, 0.4, 0.2, 0.0, 0.3])
    draws = sample_from_probs(row.expand(20000, 6), torch.rand(20000, generator=gen))
    counts = torch.bincount(draws, minlength=6).tolist()
    assert chi_square_p_value(counts, row.tolist()) > 1e-3


def test_runs_on_meta_tensors_without_reading_data() -> None:
    """Meta tensors hold no data, so any host read or data-dependent shape would raise here."""
    bs, d, vocab = 3, 5, 11
    candidates = torch.empty(bs, d, dtype=torch.int64, device="meta")
    mask = torch.empty(bs, d, d, dtype=torch.bool, device="meta")
    predict = torch.empty(bs, d, dtype=torch.int64, device="meta")
    greedy = verify_tree_greedy(candidates, mask, predict)
    sampled = tree_speculative_sampling_target_only(
        candidates,
        mask,
        torch.empty(bs, d, vocab, device="meta"),
        torch.empty(bs, d, device="meta"),
        torch.empty(bs, device="meta"),
    )
    for result in (greedy, sampled):
        assert result.accept_index.shape == (bs, d)
        assert result.accept_tokens.shape == (bs, d)
        assert result.accept_nodes.shape == (bs, d)
        assert result.accept_len.shape == (bs,)
        assert result.bonus.shape == (bs,)
