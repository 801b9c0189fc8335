"""Time the per-node grammar masks of draft trees: the Python DFS vs xgrammar's traverse_draft_tree.

Trees mimic n-gram drafts: from a committed state part-way through a valid output, each node's
first child continues that output (the "right" guess) and its other children are other tokens the
grammar allows there, plus about one token in eight that it does not (a wrong n-gram guess). The
tree is grown breadth-first to D nodes, so most nodes are grammar-valid and the DFS does real work.

Run from the repo root: .venv/bin/python -m benchmarks.bench_grammar_dfs [--trees 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ngrammar.grammar import (
    GrammarBackend,
    GrammarMatcher,
    GrammarSpec,
    allocate_bitmask,
    grammar_spec_from_request,
    unpack_bitmask,
)
from ngrammar.grammar.tree_mask import fill_tree_bitmask
from ngrammar.model.loader import resolve_checkpoint
from ngrammar.model.tokenizer import Tokenizer
from tests.grammar_oracles import commit, dfs_tree_bitmask, fork
from tests.tree_oracles import links_from_parents

CITY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": r"^[\w]+$"}, "population": {"type": "integer"}},
    "required": ["name", "population"],
    "additionalProperties": False,
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "email", "tags"],
}


def schema_spec(schema: dict[str, object]) -> GrammarSpec:
    spec = grammar_spec_from_request(json_schema=schema)
    assert spec is not None
    return spec


# (label, spec, a valid output the drafts follow)
CASES: list[tuple[str, GrammarSpec, str]] = [
    ("json city", schema_spec(CITY_SCHEMA), '{"name": "Paris", "population": 2148000}'),
    (
        "json person",
        schema_spec(PERSON_SCHEMA),
        '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "poetry"]}',
    ),
    ("regex phone", GrammarSpec("regex", r"^\(\d{3}\) \d{3}-\d{4}$"), "(555) 123-4567"),
    (
        "regex log",
        GrammarSpec("regex", r"^\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\] (INFO|WARN|ERROR): [a-z ]+$"),
        "[2024-03-15 10:42:07] ERROR: disk quota exceeded on node",
    ),
    # A bounded repetition: near its upper bound xgrammar re-checks every token that could overrun
    # it, so single masks there cost milliseconds whichever DFS runs (a heavy-tailed case).
    (
        "regex log40",
        GrammarSpec("regex", r"^\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\] (INFO|WARN|ERROR): [a-z ]{5,40}$"),
        "[2024-03-15 10:42:07] ERROR: disk quota exceeded on node",
    ),
]


@dataclass
class Tree:
    next_token: torch.Tensor  # [D] int64
    next_sibling: torch.Tensor  # [D] int64
    tokens: torch.Tensor  # [D] int64


def allowed_tokens(matcher: GrammarMatcher, vocab: int) -> list[int]:
    mask = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(mask, 0)
    return torch.nonzero(unpack_bitmask(mask, vocab)[0]).flatten().tolist()


def draft_tree(matcher: GrammarMatcher, truth: list[int], d: int, vocab: int, rng: random.Random) -> Tree:
    """A BFS tree of d nodes below the matcher's committed state (root token = last committed)."""
    parents, tokens = [-1], [truth[0] if truth else 0]
    states: list[GrammarMatcher | None] = [fork(matcher)]  # matcher after each node; None = invalid
    on_truth = [0]  # index into truth of the node's next true token, -1 when off the true path
    queue = [0]
    while queue and len(tokens) < d:
        node = queue.pop(0)
        state = states[node]
        wanted = rng.choice([1, 2, 2, 3])
        options = allowed_tokens(state, vocab) if state is not None and not state.is_terminated() else []
        for k in range(wanted):
            if len(tokens) >= d:
                break
            pos = on_truth[node]
            if k == 0 and pos >= 0 and pos + 1 < len(truth):
                token, next_pos = truth[pos + 1], pos + 1
            elif options and rng.random() > 0.125:
                token, next_pos = rng.choice(options), -1
            else:
                token, next_pos = rng.randrange(vocab), -1
            child_state = None
            if state is not None and not state.is_terminated():
                child_state = fork(state)
                if not child_state.accept_token(token):
                    child_state = None
            parents.append(node)
            tokens.append(token)
            states.append(child_state)
            on_truth.append(next_pos)
            queue.append(len(tokens) - 1)
    while len(tokens) < d:  # the drafter pads with extra root children of token 0
        parents.append(0)
        tokens.append(0)
    first, sibling = links_from_parents(parents)
    return Tree(torch.tensor(first), torch.tensor(sibling), torch.tensor(tokens))


def trees_for_case(
    backend: GrammarBackend, tokenizer: Tokenizer, spec: GrammarSpec, text: str, d: int, count: int, seed: int
) -> list[tuple[GrammarMatcher, Tree]]:
    """(matcher at a committed prefix, tree) pairs spread over the valid output's positions."""
    rng = random.Random(seed)
    compiled = backend.compile(spec)
    ids = tokenizer.encode(text) + [min(tokenizer.eos_token_ids)]
    out = []
    for _ in range(count):
        cut = rng.randrange(1, len(ids))  # committed = ids[:cut]; the root is ids[cut - 1]
        matcher = backend.new_matcher(compiled)
        retained, rejected = commit(matcher, ids[:cut])
        assert retained == cut and not rejected, "the valid output must be accepted"
        out.append((matcher, draft_tree(matcher, ids[cut - 1 :], d, backend.vocab_size, rng)))
    return out


def time_us(fn: Callable[[], None], repeats: int) -> float:
    """Best of ``repeats`` passes (the host is shared, so the minimum is the least noisy)."""
    fn()  # warm: xgrammar's first mask calls on a state are slower
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def run_python(pairs: list[tuple[GrammarMatcher, Tree]], bitmask: torch.Tensor, vocab: int) -> None:
    for matcher, t in pairs:
        dfs_tree_bitmask(matcher, t.next_token, t.next_sibling, t.tokens, bitmask, 0, vocab)


def run_native(pairs: list[tuple[GrammarMatcher, Tree]], bitmask: torch.Tensor) -> None:
    for matcher, t in pairs:
        fill_tree_bitmask(matcher, t.next_token, t.next_sibling, t.tokens, bitmask, 0)


def masks_agree(pairs: list[tuple[GrammarMatcher, Tree]], vocab: int, d: int) -> bool:
    a, b = allocate_bitmask(d, vocab), allocate_bitmask(d, vocab)
    for matcher, t in pairs:
        dfs_tree_bitmask(matcher, t.next_token, t.next_sibling, t.tokens, a, 0, vocab)
        fill_tree_bitmask(matcher, t.next_token, t.next_sibling, t.tokens, b, 0)
        if not torch.equal(a, b):
            return False
    return True


def valid_fraction(pairs: list[tuple[GrammarMatcher, Tree]], vocab: int, d: int) -> float:
    """Share of non-root nodes whose whole path is grammar-valid (rows the DFS had to visit)."""
    bitmask = allocate_bitmask(d, vocab)
    words = bitmask.numpy()
    visited = 0
    for matcher, t in pairs:
        dfs_tree_bitmask(matcher, t.next_token, t.next_sibling, t.tokens, bitmask, 0, vocab)
        visited += int(np.count_nonzero((words[1:] != -1).any(axis=1)))
    return visited / (len(pairs) * (d - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", type=int, default=300, help="trees per (grammar, D)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes over the trees")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    ckpt = resolve_checkpoint(None)
    tokenizer = Tokenizer(ckpt.tokenizer_dir, ckpt.config.eos_token_ids)
    vocab = ckpt.config.vocab_size
    backend = GrammarBackend(tokenizer, vocab)
    print(f"{args.trees} trees per row; microseconds per tree, best of {args.repeats} passes")
    print(f"{'grammar':<12} {'D':>3} {'valid':>6} {'python us':>10} {'native us':>10} {'speedup':>8} same")
    for label, spec, text in CASES:
        for d in (8, 16):
            pairs = trees_for_case(backend, tokenizer, spec, text, d, args.trees, args.seed)
            bitmask = allocate_bitmask(d, vocab)
            py = time_us(lambda: run_python(pairs, bitmask, vocab), args.repeats) / len(pairs)
            nat = time_us(lambda: run_native(pairs, bitmask), args.repeats) / len(pairs)
            same = masks_agree(pairs, vocab, d)
            frac = valid_fraction(pairs, vocab, d)
            print(f"{label:<12} {d:>3} {frac:>6.0%} {py:>10.1f} {nat:>10.1f} {py / nat:>7.1f}x {same}")
    backend.close()


if __name__ == "__main__":
    main()
