"""Shadow drafts: trees walked against plain decoding's tokens teach the draft policy acceptance."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ngrammar.runner.acceptance import verify_tree_greedy
from ngrammar.speculative.corpus import NgramCorpus
from ngrammar.speculative.policy import AdaptiveDraftPolicy, bucket_of
from ngrammar.speculative.policy_params import AdaptiveParams
from ngrammar.speculative.shadow import RETRY, ShadowDrafts, tree_kids, walk_tree
from ngrammar.speculative.tree import DraftTree

COST_REFRESH = AdaptiveParams().cost_refresh


@st.composite
def trees_and_continuations(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """A tree (tokens, parents with parent < child, tokens from a small vocabulary so siblings
    repeat) and the tokens plain decoding committed after its root (often along a tree path)."""
    d = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, d)]
    tokens = [draw(st.integers(0, 3)) for _ in range(d)]
    following: list[int] = []
    node = 0
    for _ in range(draw(st.integers(0, d + 1))):
        kids = [c for c in range(d) if parents[c] == node]
        if kids and draw(st.booleans()):
            node = draw(st.sampled_from(kids))
            following.append(tokens[node])
        else:
            following.append(draw(st.integers(0, 3)))
            node = -2  # off the tree: later tokens may be anything
    return tokens, parents, following


@settings(max_examples=300, deadline=None)
@given(trees_and_continuations(), st.randoms(use_true_random=False))
def test_a_decided_walk_accepts_what_greedy_verify_would(
    case: tuple[list[int], list[int], list[int]], rng: random.Random
) -> None:
    tokens, parents, following = case
    d = len(tokens)
    tree = DraftTree.from_parents(torch.tensor(tokens).numpy(), torch.tensor([parents]).numpy())
    depth = tree.depths()[0].tolist()
    # The target's argmax after node i: what followed, where i's path spells what followed so far;
    # elsewhere anything (a greedy verify never reaches such a node through an accepted path).
    path = [[tokens[i]] for i in range(d)]
    for i in range(1, d):
        path[i] = path[parents[i]] + [tokens[i]]
    predict = [
        following[depth[i]]
        if depth[i] < len(following) and path[i][1:] == following[: depth[i]]
        else rng.randrange(4)
        for i in range(d)
    ]
    kids, levels = tree_kids(tokens, parents)
    assert levels == max(depth)
    walked = walk_tree(kids, following)
    result = verify_tree_greedy(torch.tensor([tokens]), torch.from_numpy(tree.mask), torch.tensor([predict]))
    accepted = int(result.accept_len[0]) - 1
    if walked is None:  # undecided: the verify path spells all that followed, to an inner node
        assert accepted >= len(following) and kids[int(result.accept_nodes[0, len(following)])]
        return
    assert walked == (accepted, not kids[int(result.accept_nodes[0, accepted])])


def test_a_walk_is_decided_by_a_miss_or_a_leaf() -> None:
    # root 0 -> 5 -> 6, root -> 7 (a chain of two levels and a sibling)
    kids, depth = tree_kids([0, 5, 7, 6], [-1, 0, 0, 1])
    assert depth == 2
    assert walk_tree(kids, []) is None
    assert walk_tree(kids, [5]) is None  # node 1 has a child: the next token decides
    assert walk_tree(kids, [9]) == (0, False)
    assert walk_tree(kids, [5, 9]) == (1, False)
    assert walk_tree(kids, [5, 6]) == (2, True)  # ran out of tree: censored
    assert walk_tree(kids, [7]) == (1, True)


def _seq(seq_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(seq_id=seq_id, token_ids=tokens, is_finished=False)


def test_shadow_drafts_sample_acceptance_and_forget_finished_sequences() -> None:
    corpus = NgramCorpus(max_trie_depth=6, draft_token_num=4)
    corpus.index_prompt("a", [1, 2, 3, 4, 5, 9, 1, 2])
    shadows = ShadowDrafts(corpus, [4])
    copying, lost = _seq("a", [1, 2, 3, 4, 5, 9, 1, 2]), _seq("b", [42])  # "b" matches nothing
    assert shadows.draft([copying, lost], budget=1.0) == 1 and len(shadows) == 1
    assert shadows.draft([copying, lost], budget=1.0) == 0  # one pending tree per sequence
    assert shadows.resolve([copying]) == []  # nothing committed since
    copying.token_ids += [3, 4, 8]
    (sample,) = shadows.resolve([copying, lost])
    assert (sample.seq_id, sample.match_length, sample.accepted, sample.censored) == ("a", 2, 2, False)
    assert sample.depth == 3 and len(shadows) == 0
    shadows.draft([copying], budget=1.0)
    shadows.forget(["a"])
    assert len(shadows) == 0


def test_shadow_drafting_keeps_to_its_budget_and_re_measures() -> None:
    corpus = NgramCorpus(max_trie_depth=6, draft_token_num=4)
    seqs = [_seq(f"s{i}", [1, 2, 3, 1, 2]) for i in range(4)]
    for s in seqs:
        corpus.index_prompt(s.seq_id, s.token_ids)
    shadows = ShadowDrafts(corpus, [4])
    assert shadows.draft(seqs, budget=0.0) == 1  # the cost is unknown: one tree measures it
    assert shadows.tree_cost is not None and shadows.tree_cost > 0
    shadows.tree_cost = 1.0  # an inflated measurement: nothing fits ...
    assert sum(shadows.draft(seqs, budget=0.01) for _ in range(RETRY - 1)) == 0
    assert shadows.draft(seqs, budget=0.01) >= 1  # ... until a retry re-measures it
    assert shadows.tree_cost < 1.0
    shadows.draft(seqs, budget=1.0)
    assert len(shadows) == 4  # one pending tree per member


def test_shadow_samples_stand_in_for_re_tries_of_a_losing_width() -> None:
    # Plain wins at batch 32 (a verify step costs 1.2x plain and accepts nothing). Without shadow
    # samples the policy re-tries width 8 every ~10 steps (test_spec_engine.py,
    # test_losing_widths_are_retried_less_often_the_more_a_retry_costs); with them, only to re-time
    # the verify steps every COST_REFRESH steps.
    ids = [f"s{i}" for i in range(32)]
    policy = AdaptiveDraftPolicy(max_width=8)
    chosen = []
    for _ in range(1200):
        w = policy.choose(ids, lambda: [2] * 32)
        policy.observe(32, w, 0.05 if w == 1 else 0.06, None if w == 1 else {s: 0 for s in ids})
        if w == 1:  # two members' shadow trees were walked: each stopped at its first draft
            policy.observe_shadow(8, [(ids[0], 2, 0, False, 3), (ids[1], 2, 0, False, 3)])
        chosen.append(w)
    retries = [i for i, w in enumerate(chosen) if w > 1][4:]  # after timing widths 4 and 8 twice each
    assert 1 <= len(retries) <= 3 and retries[0] >= COST_REFRESH
    assert policy.step_cost(bucket_of(32), 8) == pytest.approx(0.06)


def test_shadow_samples_teach_the_policy_to_speculate() -> None:
    # Priors say a 2-token match continues half the time; shadows of a copying request accept
    # every draft of their depth-3 trees: the policy learns that length 2 pays at width 8.
    policy = AdaptiveDraftPolicy(max_width=8)
    for w in (1, 1, 4, 4, 8, 8):
        policy.observe(1, w, 0.05 if w == 1 else 0.08, None if w == 1 else {"a": 0})
    policy.choose(["a"], lambda: [2])
    before = policy.expected_drafts("a", 2, 8)
    for _ in range(10):
        policy.observe_shadow(8, [("a", 2, 3, True, 3), ("a", 2, 7, True, 7)])
    assert policy.expected_drafts("a", 2, 8) > before + 2
    assert policy.choose(["a"], lambda: [2]) > 1


def test_an_engine_with_nothing_to_pick_drafts_no_shadows() -> None:
    # D = 1 (the benchmark's corpus-upkeep engine) and a fixed width never ask the policy for a
    # width, so shadow trees would only cost host time.
    from ngrammar import LLM, SamplingParams
    from ngrammar.engine.sequence import Sequence

    tokens = [5, 6, 7, 8] * 6
    for kw, trees in (
        ({"num_draft_tokens": 1}, 0),
        ({"num_draft_tokens": 4, "spec_policy": "fixed"}, 0),
        ({"num_draft_tokens": 4}, 1),
    ):
        llm = LLM(device="cpu", dtype="float32", kv_cache_tokens=1024, speculative="ngram", **kw)
        worker = llm.engine.ngram
        assert worker is not None
        seq = Sequence(
            "repeats",
            0,
            list(tokens),
            SamplingParams(max_tokens=4, temperature=0),
            llm.engine.tokenizer,
            seed=0,
            max_len=llm.engine.max_model_len,
        )
        worker.on_admit(seq)  # indexes the prompt: its last tokens have a match
        worker.upkeep._shadow_step([seq], budget=1.0)
        assert llm.engine.stats.shadow_trees == trees, kw


def test_each_width_learns_its_own_first_draft_rate() -> None:
    # Regression: one first-draft rate for every width, learned from width-16 shadow trees (up to
    # 10 candidates at the first level from a 1-token match), priced width-4 trees (3 candidates)
    # far above what they accept: batch-8 open-ended text on the CPU fell to 0.83x plain.
    policy = AdaptiveDraftPolicy(max_width=16)
    for _ in range(20):
        policy.observe_shadow(16, [("s", 1, 1, False, 1)])  # a wide first level catches the token
        policy.observe_shadow(4, [("s", 1, 0, False, 1)])  # a narrow one misses it
    assert policy.acceptance.first[(16, 1)].p > 0.9 and policy.acceptance.first[(4, 1)].p < 0.1
    assert policy.expected_drafts("s", 1, 4) < 0.2 < 0.8 < policy.expected_drafts("s", 1, 16)


def test_shadow_drafts_walk_a_tree_per_width() -> None:
    corpus = NgramCorpus(max_trie_depth=6, draft_token_num=16)
    corpus.index_prompt("a", [1, 2, 3, 4, 1, 2, 7, 8, 1, 2])
    shadows = ShadowDrafts(corpus, [4, 16])
    seq = _seq("a", [1, 2, 3, 4, 1, 2, 7, 8, 1, 2])
    assert shadows.draft([seq], budget=1.0) == 2  # trees
    seq.token_ids += [7, 8, 5]  # the most recent continuation of "1 2", then something new
    samples = {s.width: s for s in shadows.resolve([seq])}
    assert set(samples) == {4, 16} and len(shadows) == 0
    assert samples[16].accepted == samples[4].accepted == 2
    assert samples[4].censored and not samples[16].censored  # the width-4 tree ends at "8"; the wider goes on
