"""Test oracles over ``GrammarMatcher``: operations the engine never needs, written from its public calls."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ngrammar.grammar import GrammarBackend, GrammarMatcher, GrammarSpec


def commit(matcher: GrammarMatcher, tokens: Sequence[int]) -> tuple[int, bool]:
    """Accept tokens in order; returns (number retained, rejected?).

    Stops right after the token that terminates the grammar (retained; the rest are past the end,
    not a rejection), or before the first forbidden token (rejected). A terminated matcher retains nothing."""
    if matcher.is_terminated():
        return 0, False
    for i, token in enumerate(tokens):
        if not matcher.accept_token(int(token)):
            return i, True
        if matcher.is_terminated():
            return i + 1, False
    return len(tokens), False


def fork(matcher: GrammarMatcher) -> GrammarMatcher:
    """An independent copy of the matcher's current state (same compiled grammar)."""
    return GrammarMatcher(matcher.xgrammar_matcher.fork(), matcher.vocab_size, matcher.stop_token_ids)


def is_completed(matcher: GrammarMatcher) -> bool:
    """Whether the text so far is a complete match (a stop token would be accepted now)."""
    return bool(matcher.xgrammar_matcher.is_completed())


def cached_specs(backend: GrammarBackend) -> list[GrammarSpec]:
    """The backend's cached specs, least recently used first."""
    with backend._lock:
        return list(backend._cache)


def _as_list(values: Sequence[int] | np.ndarray | torch.Tensor) -> list[int]:
    if isinstance(values, (np.ndarray, torch.Tensor)):
        return values.tolist()  # Python ints, one C call
    return [int(v) for v in values]


def _children_reversed(next_token: list[int], next_sibling: list[int], node: int) -> list[int]:
    children = []
    child = next_token[node]
    while child != -1:
        children.append(child)
        child = next_sibling[child]
    children.reverse()
    return children


def _bit_is_set(words: np.ndarray, row: int, token: int) -> bool:
    return bool((int(words[row, token >> 5]) >> (token & 31)) & 1)


def dfs_tree_bitmask(
    matcher: GrammarMatcher,
    next_token: Sequence[int] | np.ndarray | torch.Tensor,
    next_sibling: Sequence[int] | np.ndarray | torch.Tensor,
    draft_tokens: Sequence[int] | np.ndarray | torch.Tensor,
    bitmask: torch.Tensor,
    row_offset: int,
    vocab_size: int,
) -> None:
    """Fill rows ``row_offset + i`` of a CPU bitmask with node i's next-token mask (the Python DFS ``fill_tree_bitmask`` must equal).

    A child whose token is out of range or not allowed by its parent's row is skipped with its
    subtree: its rows stay all-allowed, which is harmless because the parent's row already forbids
    it, so verification can never reach it. A node after which the grammar is terminated (its token
    was a stop token) gets no row and no subtree either. The D rows are reset to all-allowed first,
    so a reused buffer holds no stale rows. The matcher ends in the state it started in.
    """
    nxt, sib, tok = _as_list(next_token), _as_list(next_sibling), _as_list(draft_tokens)
    bitmask[row_offset : row_offset + len(tok)] = -1
    if not tok or matcher.is_terminated():
        return
    words = bitmask.numpy()  # shares memory with the tensor: reads see the rows just filled
    matcher.fill_bitmask(bitmask, row_offset)
    depth = [0] * len(tok)  # tokens on the path from node 0 to a visited node (its tree depth)
    accepted = 0  # tokens the matcher holds beyond the committed state (= depth of the last visit)
    stack = [(child, 0) for child in _children_reversed(nxt, sib, 0)]  # pop order = pre-order
    while stack:
        node, parent = stack.pop()
        matcher.rollback(accepted - depth[parent])  # back to the parent's state
        accepted = depth[parent]
        token = tok[node]
        if not 0 <= token < vocab_size or not _bit_is_set(words, row_offset + parent, token):
            continue
        if not matcher.accept_token(token):
            continue  # unreachable if xgrammar's mask and matcher agree; skipping stays safe
        accepted += 1
        depth[node] = accepted
        if matcher.is_terminated():
            continue
        matcher.fill_bitmask(bitmask, row_offset + node)
        stack.extend((child, node) for child in _children_reversed(nxt, sib, node))
    matcher.rollback(accepted)
