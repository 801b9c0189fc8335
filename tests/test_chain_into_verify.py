"""Verify steps chained out of a plain step still in flight (``chain_into_verify``): the trees are
drafted from the committed tokens one level deeper, the subtree under the token in flight is
picked on the device (``NgramSpecWorker.launch_verify_ahead``), and that token is committed while
the verify forward runs (``LLMEngine._chain_into_verify``).

On a CPU the engine takes the GPU's path (overlap scheduling and pipelined verify forced on),
eagerly or through the graph runner's static buffers; the threshold policy decides ahead of the
token in flight wherever a match may reach its threshold.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from device_events import device_events
from hypothesis import given, settings
from hypothesis import strategies as st
from test_chain_verify import PROMPTS, _all_free, _ids, arrivals_aborts_and_preemption
from test_overlap import _timed_policy
from test_pipeline import SCHEMA

from ngrammar import LLM, SamplingParams
from ngrammar.engine.stats import timed_forward
from ngrammar.engine.verify_step import MAX_AHEAD_WIDTH, _Verified
from ngrammar.runner.transfer import to_device
from ngrammar.speculative.policy import MAX_MATCH, ThresholdDraftPolicy
from ngrammar.speculative.tree import PAD_TOKEN, DraftTree, subtree_outcomes

SPEC: dict[str, Any] = dict(
    device="cpu",
    dtype="float32",
    kv_cache_tokens=16384,
    speculative="ngram",
    num_draft_tokens=8,
    spec_policy="threshold",
    chain_into_verify=True,
)


def _chained(static: bool, **kw: Any) -> LLM:
    llm = LLM(**{**SPEC, **kw}, overlap_schedule=True, pipeline_verify=True)
    if static:
        llm.engine.enable_cuda_graphs(capture=False)  # the CUDA-graph path, run eagerly
    assert llm.engine.chain_into_verify
    return llm


@pytest.fixture(scope="module")
def chained() -> LLM:
    return _chained(static=True)


GREEDY = SamplingParams(max_tokens=40, temperature=0)


@pytest.fixture(scope="module")
def plain_greedy(llm: LLM) -> list[list[int]]:
    return _ids(llm.generate(PROMPTS, GREEDY))


# ----------------------------------------------------------------------------- the outcomes
def _paths(tokens: list[int], parents: list[int], padding: list[bool]) -> set[tuple[int, ...]]:
    """Every root-to-node token path below the root (padding skipped)."""
    out = set()
    for i in range(1, len(tokens)):
        if padding[i]:
            continue
        path, n = [], i
        while n > 0:
            path.append(tokens[n])
            n = parents[n]
        out.add(tuple(path[::-1]))
    return out


def _ancestors(parents: list[int], i: int) -> list[int]:
    out = []
    while parents[i] >= 0:
        i = parents[i]
        out.append(i)
    return out


def _path_below(tokens: list[int], parents: list[int], i: int, top: int) -> tuple[int, ...]:
    """The tokens from ``top``'s child on the way down to node ``i`` (``top`` excluded)."""
    path = []
    while i != top:
        path.append(tokens[i])
        i = parents[i]
    return tuple(path[::-1])


@st.composite
def _trees(draw: st.DrawFn) -> DraftTree:
    """A batch of BFS-ordered trees over a small alphabet, padded as the corpus pads them."""
    bs, d = draw(st.integers(1, 3)), draw(st.integers(2, 12))
    tokens, parents = [], []
    for _ in range(bs):
        real = draw(st.integers(1, d))
        row_parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, real)]
        order = sorted(range(real), key=lambda i: (_depth(row_parents, i), i))  # BFS: by depth
        new = {old: k for k, old in enumerate(order)}
        row_tokens = [draw(st.integers(1, 5)) for _ in range(real)]
        # children of one parent carry distinct tokens (a trie's do)
        kids: dict[int, set[int]] = {}
        out_tokens, out_parents = [], []
        for old in order:
            p = row_parents[old]
            token = row_tokens[old]
            if p >= 0:
                while token in kids.setdefault(new[p], set()):
                    token += 5
                kids[new[p]].add(token)
            out_tokens.append(token)
            out_parents.append(-1 if p < 0 else new[p])
        tokens += out_tokens + [PAD_TOKEN] * (d - real)
        parents.append(out_parents + [0] * (d - real))
    return DraftTree.from_parents(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64))


def _depth(parents: list[int], i: int) -> int:
    n = 0
    while parents[i] >= 0:
        i, n = parents[i], n + 1
    return n


@settings(max_examples=200, deadline=None, derandomize=True)
@given(tree=_trees(), width=st.sampled_from([2, 4, 8]), token=st.integers(0, 12))
def test_the_picked_tree_is_the_subtree_under_the_token_in_flight(
    tree: DraftTree, width: int, token: int
) -> None:
    """For any token in flight: the picked tree is rooted at it, and its paths are the drafted
    paths that start with it (less that first token), the first ``width`` nodes of the subtree in
    node order; a token no first-level draft holds picks the root alone."""
    outcomes = subtree_outcomes(tree, [2, 4, 8, 16], width)
    tokens, parents, padding = tree.tokens_2d().tolist(), tree.parents().tolist(), tree.padding().tolist()
    subtrees = [
        {p[1:] for p in _paths(tokens[b], parents[b], padding[b]) if p[0] == t and len(p) > 1}
        for b in range(tree.bs)
        for t in set(tokens[b][1:])
    ]
    if outcomes is None:
        assert not any(subtrees)  # no subtree has a draft below its root
        return
    assert outcomes.trees.draft_token_num <= width
    pick, picked = outcomes.picked([token] * tree.bs)
    for b in range(tree.bs):
        got = _paths(
            picked.tokens_2d()[b].tolist(), picked.parents()[b].tolist(), picked.padding()[b].tolist()
        )
        assert picked.tokens_2d()[b, 0] == token
        firsts = [
            tokens[b][i] for i in range(1, tree.draft_token_num) if parents[b][i] == 0 and not padding[b][i]
        ]
        if token not in firsts:
            assert pick[b] == outcomes.per_request - 1 and not got
            continue
        c = next(i for i in range(1, tree.draft_token_num) if parents[b][i] == 0 and tokens[b][i] == token)
        under = [i for i in range(c + 1, tree.draft_token_num) if c in _ancestors(parents[b], i)]
        below = {p[1:] for p in _paths(tokens[b], parents[b], padding[b]) if p[0] == token and len(p) > 1}
        # the first width - 1 nodes below the picked root, in node order: the paths down to them
        kept = {_path_below(tokens[b], parents[b], i, c) for i in under[: width - 1]}
        assert got == kept and got <= below


# ----------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static buffers"])
def test_greedy_chained_into_verify_equals_plain(
    static: bool, chained: LLM, plain_greedy: list[list[int]]
) -> None:
    chained = chained if static else _chained(static=False)
    before = chained.engine.stats.chained_into_verify
    got = chained.generate(PROMPTS, GREEDY)
    assert chained.engine.stats.chained_into_verify > before
    assert _ids(got) == plain_greedy
    assert _all_free(chained)
    ngram = chained.engine.ngram
    assert ngram is not None and not ngram.ran_to_leaf  # nothing of a member kept past its finish


def test_a_chained_into_step_teaches_at_the_length_with_its_token(chained: LLM) -> None:
    """Its samples are learned at each member's match length with the token that picked its tree
    (as a drained step is probed), and a member whose token left it the root alone teaches nothing."""
    ngram = chained.engine.ngram
    assert ngram is not None
    seen: list[tuple[dict[str, int], dict[str, int], dict[str, int]]] = []
    finish = ngram.finish_ahead

    def traced(ahead: Any, chain: bool = False) -> Any:
        pending = finish(ahead, chain)
        picks, _ = ahead.outcomes.picked([s.token_ids[-1] for s in ahead.seqs])
        hits = {
            s.seq_id: ngram.proposer.match_length(s, MAX_MATCH)
            for s, k in zip(ahead.seqs, picks)
            if k < ahead.outcomes.per_request - 1
        }
        observed = ngram.observe_step

        def check(
            batch_size: int, width: int, seconds: float, restart: Any = None, result: Any = None
        ) -> None:
            if result is not None:  # this verify step's commit
                seen.append((hits, result.lengths, result.drafts))
                ngram.observe_step = observed  # type: ignore[method-assign]
            observed(batch_size, width, seconds, restart, result)

        ngram.observe_step = check  # type: ignore[method-assign]
        return pending

    ngram.finish_ahead = traced  # type: ignore[method-assign]
    try:
        chained.generate(PROMPTS, GREEDY)
    finally:
        del ngram.finish_ahead
        ngram.__dict__.pop("observe_step", None)
    assert seen
    for hits, lengths, drafts in seen:
        assert lengths == hits and set(drafts) <= set(hits)


def test_with_plain_steps_chained_out_of_verify_too(plain_greedy: list[list[int]]) -> None:
    """Both chains on: plain -> verify -> plain, no step waiting for the host's read."""
    both = _chained(static=True, chain_verify=True)
    got = both.generate(PROMPTS, GREEDY)
    stats = both.engine.stats
    assert stats.chained_into_verify > 0 and stats.chained_out_of_verify > 0
    assert _ids(got) == plain_greedy
    assert _all_free(both)


def _same_steps_unchained(llm: LLM) -> None:
    """Make ``llm`` take the chained engine's steps one after another: where it would chain a
    verify step into the plain step in flight, it commits that step first, then picks the same
    trees on the host (``Outcomes.picked``) and launches them from committed state. A seeded
    sample depends on the tree it is drawn in, so only the same trees compare token for token."""
    eng = llm.engine
    ngram = eng.ngram
    assert ngram is not None

    def commit_then_verify(flight: Any, chain: Any) -> tuple[int, int]:
        seqs = chain.members
        drafted = ngram.corpus.batch_get(
            [s.seq_id for s in seqs], [s.token_ids for s in seqs], min(MAX_AHEAD_WIDTH, 2 * chain.width)
        )
        graphs = ngram.runner.graphs
        widths = [w for w in (graphs.widths if graphs is not None else ngram.policy.widths) if w > 1]
        outcomes = subtree_outcomes(drafted, widths, chain.width)
        if outcomes is None:
            eng._policy_drained = True
            return 0, 1
        eng._commit_decode(flight, timed=False)
        _, tree = outcomes.picked([s.token_ids[-1] for s in seqs])
        step = ngram._step_input(seqs, tree, tree.depths())
        inputs = None
        if not ngram._graph_accepts(seqs, step):
            d = tree.draft_token_num
            inputs = (
                to_device(tree.tokens.reshape(len(seqs), d), torch.int64, ngram.device),
                to_device(tree.mask, torch.bool, ngram.device),
            )
        logits = timed_forward(ngram.runner, step, eng.stats)
        verified = _Verified(
            seqs, chain.width, tree, tree.has_child(), tree.depths().max(axis=1).tolist(), logits, inputs, 0.0
        )
        eng._in_flight = ngram._accept_and_read(verified, False)
        eng.stats.chained_into_verify += 1
        return len(seqs), tree.draft_token_num

    eng._chain_into_verify = commit_then_verify  # type: ignore[method-assign]


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static buffers"])
def test_seeded_sampling_and_logprobs_equal_the_same_steps_unchained(static: bool) -> None:
    """Two fresh engines (the same corpus history, so the same drafts and the same steps): trees
    picked on the device by the token in flight, and the same trees picked on the host after it
    is committed, draw the same tokens and logprobs."""
    params = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=i, logprobs=2) for i in range(3)]
    chained, unchained = _chained(static=static), _chained(static=static)
    _same_steps_unchained(unchained)
    got, want = chained.generate(PROMPTS[1:], params), unchained.generate(PROMPTS[1:], params)
    assert chained.engine.stats.chained_into_verify > 0
    assert chained.engine.stats.chained_into_verify == unchained.engine.stats.chained_into_verify
    assert [(c.token_ids, c.logprobs) for o in got for c in o.outputs] == [
        (c.token_ids, c.logprobs) for o in want for c in o.outputs
    ]
    assert _all_free(chained)


def test_grammar_stops_and_short_budgets_equal_plain(chained: LLM, llm: LLM) -> None:
    """A member that ends on the token in flight (a stop string, EOS, max_tokens) keeps nothing of
    the verify step launched for it; a constrained batch drains as before."""
    params = [
        SamplingParams(max_tokens=60, temperature=0, json_schema=SCHEMA),
        SamplingParams(max_tokens=40, temperature=0, stop=["b):"]),
        SamplingParams(max_tokens=7, temperature=0),
        SamplingParams(max_tokens=40, temperature=0),
    ]
    prompts = ["Give the name and population of Paris as JSON.", *PROMPTS[:3]]
    got = chained.generate(prompts, params)
    want = llm.generate(prompts, params)
    assert [(c.token_ids, c.text, c.finish_reason) for o in got for c in o.outputs] == [
        (c.token_ids, c.text, c.finish_reason) for o in want for c in o.outputs
    ]
    assert _all_free(chained)
    ngram = chained.engine.ngram
    assert ngram is not None and not ngram.ran_to_leaf  # a member's state goes with its finish
    before = chained.engine.stats.chained_into_verify
    chained.generate(prompts[:1], params[:1])  # alone: a constrained batch
    assert chained.engine.stats.chained_into_verify == before


def test_chaining_into_verify_is_off_by_default() -> None:
    from ngrammar.config import EngineConfig

    assert EngineConfig().chain_into_verify is False
    assert not LLM(**{**SPEC, "chain_into_verify": False}, overlap_schedule=True).engine.chain_into_verify


def test_arrivals_aborts_and_preemption(llm: LLM) -> None:
    assert arrivals_aborts_and_preemption(llm, SPEC).engine.stats.chained_into_verify > 0


def test_no_read_between_the_plain_launch_and_the_verify_launch(chained: LLM) -> None:
    """Where a verify step is chained into a plain step in flight, the plain step's tokens are read
    only after the verify step was launched: forward (plain), forward (verify), then the read."""
    eng = chained.engine
    marks: list[str] = []
    launch = eng._chain_into_verify

    def traced(flight: Any, chain: Any) -> tuple[int, int]:
        marks.append("into verify")
        return launch(flight, chain)

    eng._chain_into_verify = traced  # type: ignore[method-assign]
    try:
        with device_events(eng.runner) as events:
            runner = eng.runner
            forward, read = runner.on_forward, runner.on_to_host
            assert forward is not None and read is not None
            runner.on_forward = lambda: (forward(), marks.append("forward"))  # type: ignore[func-returns-value]
            runner.on_to_host = lambda: (read(), marks.append("read"))  # type: ignore[func-returns-value]
            before = eng.stats.chained_into_verify
            chained.generate(PROMPTS[:3], SamplingParams(max_tokens=32, temperature=0))
    finally:
        del eng._chain_into_verify
    assert eng.stats.chained_into_verify > before and events
    seen = sum(
        m == "into verify" and marks[i + 1 : i + 3] == ["forward", "read"] for i, m in enumerate(marks)
    )
    assert seen == eng.stats.chained_into_verify - before > 0


# ----------------------------------------------------------------------------- the decision
def test_a_final_decision_prices_a_broken_match_at_nothing() -> None:
    """Ahead and final, a member whose token in flight breaks its match accepts nothing (its tree
    is the root alone), where a drain would have re-drafted it at length 1."""
    model = _timed_policy(0.01, 0.016).acceptance
    for n in range(0, MAX_MATCH + 1):
        hit = min(model.first[(8, n)].p, 0.97) if n else 0.0
        up = min(n + 1, MAX_MATCH)
        final = model.expected(["a"], [n], (8,), ahead=True, final=True)[8][0]
        assert final == pytest.approx(hit * model.expected(["a"], [up], (8,))[8][0])
        assert final < model.expected(["a"], [n], (8,), ahead=True)[8][0]


def test_final_ok_only_where_the_width_pays_without_a_drain() -> None:
    """A long match pays chained into the plain step in flight; one whose first draft is a coin
    flip pays only if a drain re-decides (the policy still verifies: it drains, ``final_ok`` off);
    the threshold policy chains into only a match already at its threshold."""
    policy = _timed_policy(0.01, 0.016)
    assert policy.choose(["a"], lambda: [MAX_MATCH], ahead=True, final=True) > 1 and policy.final_ok
    for n in range(1, MAX_MATCH + 1):  # first drafts at length 3 and less: accepted half the time
        for w in policy.widths[1:]:
            policy.acceptance.first[(w, n)] = type(policy.acceptance.first[(w, n)])(2.0, 2.0)
    policy.acceptance.learn(8, [])  # (clears the cached rates)
    width = policy.choose(["a"], lambda: [2], ahead=True, final=True)
    assert width > 1 and not policy.final_ok
    assert policy.choose(["a"], lambda: [2], ahead=True) == width and not policy.final_ok  # (not asked)
    threshold = ThresholdDraftPolicy(8, min_match=2)
    assert threshold.choose(["a"], lambda: [1], ahead=True, final=True) > 1 and not threshold.final_ok
    assert threshold.choose(["a"], lambda: [2], ahead=True, final=True) > 1 and threshold.final_ok
