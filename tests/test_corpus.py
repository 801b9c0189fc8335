"""NgramCorpus: hand-worked golden drafts, capacity, incremental state and the tree contract."""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Sequence
from fractions import Fraction
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ngrammar.speculative import corpus as corpus_module
from ngrammar.speculative.corpus import NgramCorpus
from ngrammar.speculative.tree import DraftTree, mask_from_parents

# ------------------------------------------------------------------------------------- helpers


def rows(tree: DraftTree) -> list[tuple[list[int], list[int]]]:
    """(tokens, parents) per request."""
    tokens, parents = tree.tokens_2d(), tree.parents()
    return [(tokens[b].tolist(), parents[b].tolist()) for b in range(tree.bs)]


def assert_tree_contract(tree: DraftTree, contexts: Sequence[Sequence[int]], corpus: NgramCorpus) -> None:
    """Node 0 = last token; parent < child; BFS order before the padding; exact ancestor mask; padding
    = token-0 root leaves; no duplicate (parent, token); every drafted path continues some suffix."""
    d = tree.draft_token_num
    assert tree.tokens.shape == (len(contexts) * d,) and tree.tokens.dtype == np.int64
    assert tree.mask.shape == (len(contexts), d, d) and tree.mask.dtype == np.bool_
    for (tokens, parents), context, mask in zip(rows(tree), contexts, tree.mask):
        assert tokens[0] == context[-1] and parents[0] == -1
        assert all(0 <= parents[i] < i for i in range(1, d))
        assert np.array_equal(mask, mask_from_parents(np.array([parents]))[0])
        has_child = {p for p in parents if p >= 0}
        real = d
        while real > 1 and parents[real - 1] == 0 and tokens[real - 1] == 0 and real - 1 not in has_child:
            real -= 1  # trailing padding
        assert parents[1:real] == sorted(parents[1:real]), "not in BFS order"
        edges = [(parents[i], tokens[i]) for i in range(1, real)]
        assert len(edges) == len(set(edges)), "identical paths were not merged"
        paths: list[list[int]] = [[]]
        for i in range(1, real):
            paths.append(paths[parents[i]] + [tokens[i]])
            assert any(
                corpus.ngram_count(list(context[len(context) - n :]) + paths[i]) > 0
                for n in range(1, min(len(context), corpus.max_trie_depth) + 1)
            ), f"drafted path {paths[i]} continues no suffix of the context"


def golden_corpus(match_type: str) -> NgramCorpus:
    corpus = NgramCorpus(
        max_trie_depth=12, draft_token_num=8, min_bfs_breadth=1, max_bfs_breadth=8, match_type=match_type
    )
    corpus.update("a", list(range(1, 11)))
    corpus.update("b", [1, 2, 3, 44, 55, 66, 77, 88, 99, 100])
    return corpus


def windows(history: Sequence[int], depth: int) -> set[tuple[int, ...]]:
    return {tuple(history[s:e]) for e in range(1, len(history) + 1) for s in range(max(0, e - depth), e)}


# ------------------------------------------------------------------------------------ goldens


def test_golden_bfs() -> None:
    # Anchors of [1,2,3]: [1,2,3], [2,3], [3]; every one continues with 4 (from "a") and 44 (from
    # "b", touched later, so first). Scale = 7/11; the depth-3 anchor's breadth is 6.09, enough for
    # both children at every level, so the longest anchor alone fills the 7 slots level by level:
    # 44, 4 | 55, 5 | 66, 6 | 77. Shorter anchors would only re-walk the same paths.
    corpus = golden_corpus("BFS")
    tree = corpus.batch_get(["q"], [[1, 2, 3]])
    assert tree.tokens.tolist() == [3, 44, 4, 55, 5, 66, 6, 77]
    assert tree.parents().tolist() == [[-1, 0, 0, 1, 2, 3, 4, 5]]
    expected = [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 2, 4}, {0, 1, 3, 5}, {0, 2, 4, 6}, {0, 1, 3, 5, 7}]
    assert [set(np.flatnonzero(row).tolist()) for row in tree.mask[0]] == expected


def test_golden_prob() -> None:
    # [1,2,3] occurred twice, each continuation once: 4 and 44 share 1/2 (tie: smaller token
    # first), and every later step is a single child with share 1, so all candidates tie at 1/2 and
    # pop in push order: 4, 44, 5, 55, 6, 66, 7.
    corpus = golden_corpus("PROB")
    tree = corpus.batch_get(["q"], [[1, 2, 3]])
    assert tree.tokens.tolist() == [3, 4, 44, 5, 55, 6, 66, 7]
    assert tree.parents().tolist() == [[-1, 0, 0, 1, 2, 3, 4, 5]]
    expected = [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 2, 4}, {0, 1, 3, 5}, {0, 2, 4, 6}, {0, 1, 3, 5, 7}]
    assert [set(np.flatnonzero(row).tolist()) for row in tree.mask[0]] == expected


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_golden_chain_then_padding(match_type: str) -> None:
    # [3,44] continues only as 55..100: a 6-node chain, then one padding node under the root.
    tree = golden_corpus(match_type).batch_get(["q"], [[3, 44]])
    assert tree.tokens.tolist() == [44, 55, 66, 77, 88, 99, 100, 0]
    assert tree.parents().tolist() == [[-1, 0, 1, 2, 3, 4, 5, 0]]
    assert tree.mask[0, 7].tolist() == [True] + [False] * 6 + [True]


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_no_match_and_empty_corpus_give_a_star(match_type: str) -> None:
    corpus = golden_corpus(match_type)
    empty = NgramCorpus(draft_token_num=5, match_type=match_type)
    for tree in (corpus.batch_get(["q"], [[3, 6, 999]]), empty.batch_get(["q"], [[7]])):
        d = tree.draft_token_num
        assert tree.tokens.tolist()[1:] == [0] * (d - 1)
        assert tree.parents().tolist() == [[-1] + [0] * (d - 1)]
        assert tree.mask[0].sum() == 2 * d - 1  # diagonal plus the root column
    assert corpus.batch_get(["q"], [[3, 6, 999]]).tokens[0] == 999


def test_batch_mixes_requests_and_overrides_draft_token_num() -> None:
    corpus = golden_corpus("BFS")
    tree = corpus.batch_get(["x", "y"], [[1, 2, 3], [3, 44]], draft_token_num=4)
    assert tree.bs == 2 and tree.draft_token_num == 4
    assert tree.tokens_2d().tolist() == [[3, 44, 4, 55], [44, 55, 66, 77]]


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_paths_from_different_anchors_merge(match_type: str) -> None:
    # Depth-4 trie over "a" = 1 2 3 4 5 and "b" = 8 2 3 6. Context [1,2]: anchor [1,2] drafts 3 -> 4
    # (its subtree ends at depth 4); anchor [2] re-walks 3 and 4 (merged, no new slots) and adds 6
    # under 3 and 5 under 4. BFS takes [2,3]'s children most recent first (6, then 4 merged); PROB
    # takes them in a 1/2 tie, smaller token first (4 merged, then 6). Either way 6 enters the draft
    # after 4, so the output order is the same.
    corpus = NgramCorpus(
        max_trie_depth=4, draft_token_num=8, min_bfs_breadth=1, max_bfs_breadth=8, match_type=match_type
    )
    corpus.index_prompt("a", [1, 2, 3, 4, 5])  # all windows (update would index only the last 4 positions)
    corpus.index_prompt("b", [8, 2, 3, 6])
    tree = corpus.batch_get(["q"], [[1, 2]])
    assert rows(tree)[0] == ([2, 3, 4, 6, 5, 0, 0, 0], [-1, 0, 1, 1, 2, 0, 0, 0])
    assert_tree_contract(tree, [[1, 2]], corpus)


def test_bfs_prefers_recent_and_prob_prefers_frequent() -> None:
    for match_type, expected in (("BFS", [5, 7, 6]), ("PROB", [5, 6, 7])):
        corpus = NgramCorpus(max_trie_depth=4, draft_token_num=3, match_type=match_type)
        for req in range(3):
            corpus.update(f"six{req}", [5, 6])
        corpus.update("seven", [5, 7])  # rarer but more recent
        assert corpus.batch_get(["q"], [[5]]).tokens.tolist() == expected


def test_bfs_breadth_one_follows_the_latest_continuation() -> None:
    corpus = NgramCorpus(max_trie_depth=4, draft_token_num=2, min_bfs_breadth=1, max_bfs_breadth=1)
    corpus.update("r1", [5, 6])
    corpus.update("r2", [5, 7])
    assert corpus.batch_get(["q"], [[5]]).tokens.tolist() == [5, 7]
    corpus.update("r3", [5, 6])  # touching 5 -> 6 makes it the most recent again
    assert corpus.batch_get(["q"], [[5]]).tokens.tolist() == [5, 6]


def test_prob_counts_each_occurrence_once() -> None:
    corpus = NgramCorpus(max_trie_depth=3, match_type="PROB")
    history = [1, 2, 1, 2]
    corpus.update("r", history[:2])
    corpus.update("r", history)  # only the windows ending at the two new tokens are added
    assert corpus.ngram_count([1, 2]) == 2
    assert corpus.ngram_count([2, 1]) == 1
    assert corpus.ngram_count([1, 2, 1]) == 1
    assert corpus.ngram_count([2, 1, 2]) == 1
    assert corpus.ngram_count([1, 2, 1, 2]) == 0  # longer than max_trie_depth
    assert corpus.num_nodes == 6  # 1, 2, 12, 21, 121, 212


# ---------------------------------------------------------------------------------- prompts


def test_prompt_indexing_drafts_a_copy_of_the_prompt() -> None:
    prompt = list(range(100, 160))
    copied = prompt + prompt[:10]  # the model started repeating its prompt
    indexed = NgramCorpus(draft_token_num=8)
    indexed.index_prompt("r", prompt)
    indexed.update("r", copied)
    assert indexed.batch_get(["r"], [copied]).tokens.tolist() == [109] + prompt[10:17]

    tail_only = NgramCorpus(draft_token_num=8)  # without it only the last max_trie_depth positions count
    tail_only.update("r", copied)
    assert tail_only.batch_get(["r"], [copied]).tokens.tolist() == [109] + [0] * 7


def test_update_indexes_only_new_windows() -> None:
    corpus = NgramCorpus(max_trie_depth=3)
    corpus.index_prompt("r", [1, 2, 3])
    assert corpus.num_nodes == 6  # 1 2 3 12 23 123
    corpus.update("r", [1, 2, 3])
    assert corpus.num_nodes == 6 and corpus.ngram_count([1, 2, 3]) == 1
    corpus.update("r", [1, 2, 3, 4, 5])
    assert corpus.ngram_count([2, 3, 4]) == 1 and corpus.ngram_count([3, 4, 5]) == 1
    assert corpus.ngram_count([1, 2]) == 1


def test_bounded_catch_up_indexes_only_the_recent_windows() -> None:
    history = [1, 2, 3]
    unbounded, bounded = NgramCorpus(max_trie_depth=3), NgramCorpus(max_trie_depth=3)
    for corpus in (unbounded, bounded):
        corpus.update("r", history)
    grown = history + list(range(10, 20))  # 10 new tokens
    unbounded.update("r", grown)
    bounded.update("r", grown, max_catch_up=4)
    assert unbounded.ngram_count([10, 11, 12]) == 1
    # More than max_catch_up new tokens: only windows starting in the last max_trie_depth positions.
    assert bounded.ngram_count([10, 11, 12]) == 0 and bounded.ngram_count([11]) == 0
    assert bounded.ngram_count([17, 18, 19]) == 1 and bounded.ngram_count([19]) == 1
    within = grown + [20, 21]  # two more tokens: within the bound, indexed incrementally
    bounded.update("r", within, max_catch_up=4)
    assert bounded.ngram_count([19, 20, 21]) == 1 and bounded.ngram_count([18, 19, 20]) == 1


@pytest.mark.parametrize("grown_by", [5, 6, 7, 9, 12])
def test_a_catch_up_never_indexes_a_position_twice(grown_by: int) -> None:
    # Growth between max_catch_up and max_trie_depth: the catch-up must start where indexing
    # stopped, not max_trie_depth back (which re-inserted windows and doubled their counts).
    depth = 8
    history = list(range(100, 120))
    corpus = NgramCorpus(max_trie_depth=depth)
    corpus.update("r", history)
    grown = history + list(range(200, 200 + grown_by))
    corpus.update("r", grown, max_catch_up=depth // 2)
    naive = Counter(
        tuple(grown[s : e + 1]) for e in range(len(grown)) for s in range(max(0, e - depth + 1), e + 1)
    )
    for ngram, count in corpus.ngrams():
        assert count <= naive[ngram], ngram
    assert corpus.ngram_count(grown[-1:]) == 1  # the newest position is indexed


# ---------------------------------------------------------------------------------- capacity


def test_tiny_capacity_keeps_recent_windows_and_never_raises() -> None:
    corpus = NgramCorpus(max_trie_depth=4, capacity=40, draft_token_num=4)
    history: list[int] = []
    for token in range(1, 301):  # all-distinct tokens: every window is new
        history.append(token)
        corpus.update("r", history)
        assert corpus.num_nodes <= 40
    recent = history[-5:]
    for length in range(1, 5):
        for start in range(len(recent) - length + 1):
            assert corpus.ngram_count(recent[start : start + length]) > 0
    assert corpus.ngram_count([1]) == 0 and corpus.ngram_count([100, 101]) == 0
    assert corpus.batch_get(["q"], [[297]]).tokens.tolist() == [297, 298, 299, 300]


@pytest.mark.parametrize("capacity", [1, 2, 3, 7])
def test_capacity_smaller_than_a_window(capacity: int) -> None:
    corpus = NgramCorpus(max_trie_depth=6, capacity=capacity)
    history = [int(t) for t in np.random.default_rng(capacity).integers(1, 4, size=200)]
    for end in range(1, len(history) + 1, 3):
        corpus.update("r", history[:end])
        assert corpus.num_nodes <= capacity
        assert_tree_contract(corpus.batch_get(["r"], [history[:end]]), [history[:end]], corpus)


def test_stale_match_state_rebuilds_after_eviction() -> None:
    corpus = NgramCorpus(max_trie_depth=4, capacity=12, draft_token_num=3)
    corpus.update("a", [1, 2, 3, 4])
    assert corpus.batch_get(["q"], [[1, 2]]).tokens.tolist() == [2, 3, 4]
    corpus.update("b", [20, 21, 22, 23, 24, 25])  # evicts the old windows
    assert corpus.ngram_count([2, 3]) == 0
    assert corpus.batch_get(["q"], [[1, 2]]).tokens.tolist() == [2, 0, 0]
    corpus.update("a", [1, 2, 3, 4, 9, 2, 3, 7])  # re-learns 2 -> 3 -> 7
    assert corpus.batch_get(["q"], [[1, 2]]).tokens.tolist() == [2, 3, 7]


def test_match_state_sees_ngrams_created_after_a_miss() -> None:
    corpus = NgramCorpus(max_trie_depth=4, draft_token_num=2)
    assert corpus.batch_get(["q"], [[1, 2]]).tokens.tolist() == [2, 0]  # every suffix missed
    corpus.index_prompt("a", [1, 2, 3, 4])
    corpus.index_prompt("b", [9, 3, 5])  # [3] -> 5 is the most recent, [2,3] -> 4 the longest
    assert corpus.batch_get(["q"], [[1, 2]]).tokens.tolist() == [2, 3]
    assert corpus.batch_get(["q"], [[1, 2, 3]]).tokens.tolist() == [3, 4]


def test_match_state_follows_a_rewritten_history() -> None:
    corpus = NgramCorpus(max_trie_depth=4, draft_token_num=2)
    corpus.index_prompt("a", [1, 2, 3, 4])
    corpus.index_prompt("b", [5, 6])
    assert corpus.batch_get(["q"], [[1, 2, 3]]).tokens.tolist() == [3, 4]
    assert corpus.batch_get(["q"], [[1, 2, 5]]).tokens.tolist() == [5, 6]  # same length, new last token
    assert corpus.batch_get(["q"], [[1, 2]]).tokens.tolist() == [2, 3]  # shrank


def test_leaf_anchor_becomes_expandable() -> None:
    corpus = NgramCorpus(max_trie_depth=4, draft_token_num=2)
    corpus.update("a", [1, 2])
    assert corpus.batch_get(["q"], [[5, 1, 2]]).tokens.tolist() == [2, 0]  # [2] and [1,2] are leaves
    corpus.update("a", [1, 2, 8])
    assert corpus.batch_get(["q"], [[5, 1, 2]]).tokens.tolist() == [2, 8]


def test_reset_and_erase() -> None:
    corpus = golden_corpus("BFS")
    corpus.batch_get(["q"], [[1, 2, 3]])
    corpus.erase_match_state(["q", "a", "unknown"])
    assert corpus.batch_get(["q"], [[1, 2, 3]]).tokens.tolist()[:3] == [3, 44, 4]
    corpus.reset()
    assert corpus.num_nodes == 0
    assert corpus.batch_get(["q"], [[1, 2, 3]]).tokens.tolist() == [3] + [0] * 7


def test_validation() -> None:
    for kwargs in (
        {"max_trie_depth": 1},
        {"min_bfs_breadth": 0},
        {"min_bfs_breadth": 5, "max_bfs_breadth": 4},
        {"draft_token_num": 0},
        {"match_type": "DFS"},
        {"capacity": 0},
        {"capacity": 2.5},
        {"max_trie_depth": True},
    ):
        with pytest.raises(ValueError):
            NgramCorpus(**kwargs)
    corpus = NgramCorpus()
    with pytest.raises(ValueError):
        corpus.batch_get(["a"], [[1], [2]])
    with pytest.raises(ValueError):
        corpus.batch_get(["a"], [[]])
    with pytest.raises(ValueError):
        corpus.batch_get(["a"], [[1]], draft_token_num=0)


def test_numpy_histories_work_like_lists() -> None:
    as_list, as_numpy = golden_corpus("BFS"), golden_corpus("BFS")
    history = [1, 2, 3, 4, 1, 2, 3]
    as_list.update("r", history)
    as_numpy.update("r", np.array(history))
    a = as_list.batch_get(["r"], [history])
    b = as_numpy.batch_get(["r"], [np.array(history)])
    assert a.tokens.tolist() == b.tokens.tolist()


# -------------------------------------------------------------- incremental vs from scratch

streams = st.lists(st.integers(1, 4), min_size=1, max_size=60)
ops = st.lists(
    st.tuples(
        st.sampled_from(["append", "grow", "get", "rewind", "erase"]), st.integers(0, 2), st.integers(1, 6)
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(streams, min_size=3, max_size=3),
    script=ops,
    match_type=st.sampled_from(["BFS", "PROB"]),
    capacity=st.sampled_from([8, 30, 1_000_000]),
    depth=st.integers(2, 7),
    d=st.integers(1, 10),
)
def test_incremental_matches_from_scratch(
    prompts: list[list[int]],
    script: list[tuple[str, int, int]],
    match_type: str,
    capacity: int,
    depth: int,
    d: int,
) -> None:
    corpus = NgramCorpus(max_trie_depth=depth, draft_token_num=d, match_type=match_type, capacity=capacity)
    rng = np.random.default_rng(len(script))
    histories = [list(p) for p in prompts]
    seen: set[tuple[int, ...]] = set()  # every window of every history the corpus was shown
    for req, history in enumerate(histories):
        corpus.index_prompt(req, history)
        seen |= windows(history, depth)
    for op, req, amount in script:
        history = histories[req]
        if op == "append":
            history += [int(t) for t in rng.integers(1, 5, size=amount)]
            corpus.update(req, history)
        elif op == "grow":  # tokens not indexed yet (the engine indexes after the next launch)
            history += [int(t) for t in rng.integers(1, 5, size=amount)]
        elif op == "rewind":
            del history[max(1, len(history) - amount) :]
            history += [int(t) for t in rng.integers(1, 5, size=rng.integers(0, amount + 1))]
            corpus.update(req, history)
        elif op == "erase":
            corpus.erase_match_state([req])
        seen |= windows(history, depth)
        live = corpus.batch_get([0, 1, 2], histories)
        fresh = corpus.batch_get(["s0", "s1", "s2"], histories)  # no state: matched from scratch
        corpus.erase_match_state(["s0", "s1", "s2"])
        assert live.tokens.tolist() == fresh.tokens.tolist()
        assert np.array_equal(live.mask, fresh.mask)
        assert_tree_contract(live, histories, corpus)
    trie = dict(corpus.ngrams())
    assert len(trie) == corpus.num_nodes <= capacity
    assert set(trie) <= seen, "the trie holds an n-gram no history contains"


def test_a_match_starts_from_the_insert_cursor_a_step_behind() -> None:
    # The engine indexes a step's history after launching it, so at the next draft the insert
    # cursor lags the newest token: the match advances it by that token, not rebuilding 18.
    corpus = NgramCorpus(max_trie_depth=18)
    history = [int(t) for t in np.random.default_rng(0).integers(1, 50, size=200)]
    corpus.index_prompt("r", history)
    advanced: list[int] = []
    advance = corpus._advance_match
    with mock.patch.object(
        corpus,
        "_advance_match",
        side_effect=lambda nodes, appended: advanced.append(len(appended)) or advance(nodes, appended),
    ):
        for token in (3, 7, 3):
            history.append(token)
            corpus.batch_get(["r"], [history])
            corpus.update("r", history)
    assert advanced == [1, 1, 1]
    fresh = corpus.batch_get(["s"], [history])
    assert np.array_equal(corpus.batch_get(["r"], [history]).mask, fresh.mask)


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=5), min_size=1, max_size=25),
    depth=st.integers(2, 6),
)
def test_counts_equal_naive_window_counts(chunks: list[list[int]], depth: int) -> None:
    corpus = NgramCorpus(max_trie_depth=depth)
    history: list[int] = []
    for chunk in chunks:
        history += chunk
        if len(history) == len(chunk):
            corpus.index_prompt("r", history)
        else:
            corpus.update("r", history)
    naive = Counter(
        tuple(history[start : end + 1])
        for end in range(len(history))
        for start in range(max(0, end - depth + 1), end + 1)
    )
    assert corpus.num_nodes == len(naive)
    for ngram, occurrences in naive.items():
        assert corpus.ngram_count(ngram) == occurrences


def test_match_length_golden() -> None:
    corpus = NgramCorpus(max_trie_depth=8)
    corpus.index_prompt("p", [1, 2, 3, 4, 1, 2, 3])
    assert (
        corpus.match_length([9, 4, 1, 2, 3], 8) == 3
    )  # "1 2 3" was followed by 4; "4 1 2 3" never continued
    assert corpus.match_length([9, 4, 1, 2, 3], 2) == 2  # capped
    assert corpus.match_length([3, 2], 8) == 1  # "2" was followed by 3; "3 2" was never seen
    assert corpus.match_length([4, 1], 8) == 2  # "4 1" was followed by 2
    assert corpus.match_length([5], 8) == 0  # unseen token
    assert NgramCorpus().match_length([1, 2], 4) == 0  # empty corpus


@settings(max_examples=60, deadline=None)
@given(
    history=st.lists(st.integers(1, 4), min_size=1, max_size=40),
    context=st.lists(st.integers(1, 4), min_size=1, max_size=12),
    depth=st.integers(2, 6),
    cap=st.integers(1, 6),
)
def test_match_length_equals_naive_longest_continued_suffix(
    history: list[int], context: list[int], depth: int, cap: int
) -> None:
    corpus = NgramCorpus(max_trie_depth=depth)
    corpus.index_prompt("r", history)
    continued = windows(history, depth)  # an n-gram is continued iff its (n+1)-gram is a window
    naive = max(
        (
            n
            for n in range(1, min(cap, len(context)) + 1)
            if any(w[:-1] == tuple(context[-n:]) for w in continued if len(w) == n + 1)
        ),
        default=0,
    )
    assert corpus.match_length(context, cap) == naive


# ------------------------------------------------------------------ bulk vs per-position indexing


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["prompt", "extend"]),
            st.integers(0, 2),
            st.lists(st.integers(1, 4), min_size=1, max_size=30),
        ),
        min_size=1,
        max_size=8,
    ),
    fillers=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=6), min_size=1, max_size=12),
    depth=st.integers(2, 7),
    match_type=st.sampled_from(["BFS", "PROB"]),
    headroom=st.integers(0, 40),
)
def test_bulk_indexing_equals_per_position_indexing(
    ops: list[tuple[str, int, list[int]]],
    fillers: list[list[int]],
    depth: int,
    match_type: str,
    headroom: int,
) -> None:
    """Long inserts (prompts, big catch-ups) take a bulk path that walks windows by start position;
    it must leave exactly the trie, counts, child order and LRU order that inserting position by
    position does. Fillers then overflow a tight capacity, so any LRU difference would change
    which n-grams get evicted."""
    capacity = sum(len(chunk) for _, _, chunk in ops) * depth + headroom  # room for every bulk insert

    def run() -> list[object]:
        corpus = NgramCorpus(
            max_trie_depth=depth, draft_token_num=6, match_type=match_type, capacity=capacity
        )
        histories: dict[int, list[int]] = {}
        seen: list[object] = []

        def observe() -> None:
            reqs = sorted(histories)
            tree = corpus.batch_get(reqs, [histories[r] for r in reqs])
            seen.append((list(corpus.ngrams()), corpus.num_nodes, rows(tree)))

        for op, req, chunk in ops:
            if op == "prompt" or req not in histories:
                histories[req] = list(chunk)
                corpus.index_prompt(req, histories[req])
            else:
                histories[req] += chunk
                corpus.update(req, histories[req])
            observe()
        for filler in fillers:  # fresh n-grams: the trie fills up and evicts in LRU order
            histories[9] = histories.get(9, []) + filler
            corpus.update(9, histories[9])
            observe()
        return seen

    with mock.patch.object(corpus_module, "BULK_MIN_TOKENS", 1):
        bulk = run()
    with mock.patch.object(corpus_module, "BULK_MIN_TOKENS", 10**9):
        per_position = run()
    assert bulk == per_position


# ------------------------------------------------------------------ independent reference drafter


class NaiveModel:
    """The corpus semantics spelled out with plain n-gram dicts (no capacity limit)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.count: Counter[tuple[int, ...]] = Counter()
        self.touched: dict[tuple[int, ...], int] = {}  # n-gram -> position stamp of its last insert
        self.stamp = 0

    def index(self, history: Sequence[int], start: int) -> None:
        """Insert the windows ending at history[start:]."""
        for end in range(start, len(history)):
            self.stamp += 1
            for begin in range(max(0, end - self.depth + 1), end + 1):
                ngram = tuple(history[begin : end + 1])
                self.count[ngram] += 1
                self.touched[ngram] = self.stamp

    def children(self, ngram: tuple[int, ...]) -> list[int]:
        return [g[-1] for g in self.count if len(g) == len(ngram) + 1 and g[:-1] == ngram]


def naive_draft(
    model: NaiveModel, context: Sequence[int], d: int, min_b: int, max_b: int, mode: str
) -> list[tuple[int, int]]:
    """(token, parent) per node in output order: a literal FIFO-queue BFS or a probability heap."""
    depth = model.depth
    anchors = [
        (tuple(context[len(context) - n :]), n)
        for n in range(min(len(context), depth), 0, -1)
        if model.children(tuple(context[len(context) - n :]))
    ]
    nodes = [(int(context[-1]), -1)]
    edge: dict[tuple[int, int], int] = {}

    def child_slot(parent: int, token: int) -> int | None:
        if (parent, token) in edge:
            return edge[(parent, token)]
        if len(nodes) >= d:
            return None
        edge[(parent, token)] = len(nodes)
        nodes.append((token, parent))
        return len(nodes) - 1

    if mode == "BFS":
        max_depth = max(1, depth - 1)
        scale = Fraction(max_b - min_b, max_depth)
        for anchor, n in anchors:
            queue = deque([(0, (max_depth - n) * scale + min_b, anchor)])
            while queue and len(nodes) < d:
                parent, breadth, ngram = queue.popleft()
                recent = sorted(model.children(ngram), key=lambda t: -model.touched[ngram + (t,)])
                for token in recent[: max(1, int(breadth))]:
                    slot = child_slot(parent, token)
                    if slot is None:
                        break
                    queue.append((slot, breadth - scale, ngram + (token,)))
    else:
        heap: list[tuple[float, int, int, tuple[int, ...]]] = []
        pushes = 0

        def push_children(parent: int, ngram: tuple[int, ...], prob: float) -> None:
            nonlocal pushes
            top = sorted(model.children(ngram), key=lambda t: (-model.count[ngram + (t,)], t))[:max_b]
            total = sum(model.count[ngram + (t,)] for t in top)
            for t in top:
                pushes += 1
                share = model.count[ngram + (t,)] / total  # parent_prob * (count / sum), in that float order
                heapq.heappush(heap, (-(prob * share), pushes, parent, ngram + (t,)))

        for anchor, _ in anchors:
            if len(nodes) >= d:
                break
            push_children(0, anchor, 1.0)
            while heap and len(nodes) < d:
                neg_prob, _, parent, ngram = heapq.heappop(heap)
                slot = child_slot(parent, ngram[-1])
                if slot is not None:
                    push_children(slot, ngram, -neg_prob)

    kids: dict[int, list[int]] = {i: [] for i in range(len(nodes))}
    for i, (_, parent) in enumerate(nodes[1:], start=1):
        kids[parent].append(i)
    order = [0]
    for node in order:
        order += kids[node]
    index = {node: i for i, node in enumerate(order)}
    out = [(nodes[node][0], index[nodes[node][1]] if node else -1) for node in order]
    return out + [(0, 0)] * (d - len(out))


@settings(max_examples=80, deadline=None)
@given(
    chunks=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(1, 4), min_size=1, max_size=6)),
        min_size=3,
        max_size=20,
    ),
    match_type=st.sampled_from(["BFS", "PROB"]),
    depth=st.integers(2, 6),
    d=st.integers(1, 12),
    breadths=st.tuples(st.integers(1, 4), st.integers(0, 5)),
)
def test_drafts_equal_a_naive_reference(
    chunks: list[tuple[int, list[int]]], match_type: str, depth: int, d: int, breadths: tuple[int, int]
) -> None:
    min_b, max_b = breadths[0], breadths[0] + breadths[1]
    corpus = NgramCorpus(
        max_trie_depth=depth,
        draft_token_num=d,
        min_bfs_breadth=min_b,
        max_bfs_breadth=max_b,
        match_type=match_type,
    )
    model = NaiveModel(depth)
    histories: dict[int, list[int]] = {}
    for req, chunk in chunks:
        history = histories.setdefault(req, [])
        start = len(history)
        history += chunk
        if start == 0:
            corpus.index_prompt(req, history)
        else:
            corpus.update(req, history)
        model.index(history, start)
        reqs = sorted(histories)
        tree = corpus.batch_get(reqs, [histories[r] for r in reqs])
        for (tokens, parents), r in zip(rows(tree), reqs):
            expected = naive_draft(model, histories[r], d, min_b, max_b, match_type)
            assert list(zip(tokens, parents)) == expected
