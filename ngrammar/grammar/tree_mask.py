"""Token bitmasks: allocation, application to logits, and per-node masks for draft trees.

A bitmask row is int32 [ceil(V/32)]; bit (t % 32) of word (t // 32) is set iff token t is allowed.
-1 (all bits set) means "no constraint", which is how every row starts and how rows that need no
grammar (or that can never be reached) stay.

Draft tree contract (per request, D nodes): node 0 is the last committed token, already accepted
by the matcher; the other nodes are BFS-ordered with parent < child. ``next_token[i]`` is i's first
child and ``next_sibling[i]`` its next sibling (-1 where none); ``draft_tokens[i]`` is i's token.
Row i of a request's block is the mask for the token that follows node i, so the verify step can
mask the target's logits at every node and accept only grammar-valid paths.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from ngrammar.grammar.backend import GrammarMatcher

BITS = 32
_LITTLE_ENDIAN = sys.byteorder == "little"


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


def allocate_bitmask(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """CPU int32 [rows, ceil(V/32)], all allowed. Pinning is skipped where there is no CUDA."""
    pin = pin_memory and torch.cuda.is_available()
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


@lru_cache(maxsize=8)
def _bit_weights(device: torch.device) -> torch.Tensor:
    """[32] int32 with only bit k set at index k (index 31 is INT32_MIN, the sign bit); cached per
    device so applying a mask launches no set-up kernels."""
    one = torch.ones(BITS, dtype=torch.int32, device=device)
    return torch.bitwise_left_shift(one, torch.arange(BITS, dtype=torch.int32, device=device))


def _forbidden(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool, True where the token is NOT allowed."""
    clear = torch.bitwise_and(bitmask.unsqueeze(-1), _bit_weights(bitmask.device)) == 0  # [R, W, 32]
    return clear.reshape(bitmask.shape[0], -1)[:, :vocab_size]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool (True = allowed), on the bitmask's device."""
    return ~_forbidden(bitmask, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed logits to -inf in place. logits [R, V] float; bitmask [R, ceil(V/32)] int32.

    Plain tensor ops (three kernels), so it runs on any device; the bitmask must be on the logits'
    device. The bitmask must cover every logits column: a column without a bit would escape the
    grammar. (xgrammar's one-launch Triton kernel was tried on CUDA and not adopted: see
    benchmarks/results/LOG.md.) On a CPU the bits are unpacked by numpy instead: the tensor ops'
    [R, W, 32] int32 intermediate made masking 64 rows cost 4-7 ms there, twice numpy's.
    """
    rows, vocab = logits.shape
    if bitmask.shape[0] != rows or bitmask.shape[1] * BITS < vocab:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}")
    if bitmask.device.type == "cpu" and _LITTLE_ENDIAN:
        words = bitmask.numpy()
        if words.dtype == np.int32 and words.flags.c_contiguous:
            # bit t % 32 of word t // 32 is bit t % 8 of byte t // 8 in little-endian memory
            forbidden = np.unpackbits((~words).view(np.uint8), axis=1, count=vocab, bitorder="little")
            logits.masked_fill_(torch.from_numpy(forbidden.view(np.bool_)), float("-inf"))
            return
    logits.masked_fill_(_forbidden(bitmask, vocab), float("-inf"))


def grammar_valid_nodes(
    matcher: GrammarMatcher, tokens: Sequence[int], parents: Sequence[int], max_depth: int | None = None
) -> list[bool]:
    """Which nodes of one draft tree the grammar allows: node i is valid iff its parent is, the
    grammar accepts its token after the parent's path, and that path did not terminate the grammar.
    The root (node 0, already committed) is valid unless the grammar has terminated.

    ``max_depth``: only nodes up to this depth are checked; a deeper node is reported valid when
    its ancestor at that depth is (not known to be forbidden). Only ``accept_token`` / ``rollback``
    calls: about a microsecond each for the benchmark's JSON schema on the CPU box, and several
    times that for some states (a whole 16-node tree per member before each launch makes large constrained
    verify steps markedly longer on a GPU host). ``parents`` [D] with parent < child; the
    matcher ends as it started."""
    d = len(tokens)
    valid = [False] * d
    if d == 0 or matcher.is_terminated():
        return valid
    valid[0] = True
    limit = d if max_depth is None else max_depth
    depth = [0] * d
    children: list[list[int]] = [[] for _ in range(d)]
    for i in range(1, d):
        children[parents[i]].append(i)
        depth[i] = depth[parents[i]] + 1
    stack = children[0][::-1]  # popped in pre-order
    held = 0  # tokens the matcher holds beyond the committed state: the last visited node's depth
    while stack:
        node = stack.pop()
        matcher.rollback(held - (depth[node] - 1))  # back to the parent's state
        held = depth[node] - 1
        if not matcher.accept_token(int(tokens[node])):
            continue
        held += 1
        valid[node] = True
        # Nothing follows a stop token (its subtree stays invalid); past the limit nothing is walked.
        if not matcher.is_terminated() and held < limit:
            stack.extend(reversed(children[node]))
    matcher.rollback(held)
    for i in range(1, d):  # parent < child: a parent's verdict is final before its children's
        if depth[i] > limit:
            valid[i] = valid[parents[i]]
    return valid


def fill_tree_bitmask(
    matcher: GrammarMatcher,
    next_token: torch.Tensor,
    next_sibling: torch.Tensor,
    draft_tokens: torch.Tensor,
    bitmask: torch.Tensor,
    row_offset: int,
) -> None:
    """Fill rows ``row_offset + i`` of a CPU bitmask with node i's next-token mask, by xgrammar's C++
    ``traverse_draft_tree`` (a DFS over the tree; tests/grammar_oracles.py holds the same DFS in Python).

    A child whose token is out of range or not allowed by its parent's row is skipped with its
    subtree: its rows stay all-allowed, harmless because the parent's row already forbids it. The D
    rows are reset to all-allowed first, so a reused buffer holds no stale rows. The matcher ends in
    the state it started in. The links and tokens are 1-D CPU int64 tensors of length D.
    """
    d = draft_tokens.shape[0]
    rows = bitmask[row_offset : row_offset + d]
    rows.fill_(-1)
    if d == 0 or matcher.is_terminated():
        return
    matcher.xgrammar_matcher.traverse_draft_tree(
        _int64(next_token), _int64(next_sibling), _int64(draft_tokens), rows
    )
    # xgrammar writes an empty row for a rejected node (unreachable either way) and for a node
    # that terminated the grammar. The latter is reachable: after an accepted stop token the bonus
    # would be drawn from all -inf logits (NaN probabilities), so such rows become unconstrained,
    # and the commit drops whatever follows the stop token.
    words = rows.numpy()
    words[~words.any(axis=1)] = -1


def _int64(values: torch.Tensor) -> torch.Tensor:
    return values.to(dtype=torch.int64).contiguous()


def build_tree_bitmask(
    matchers: Sequence[GrammarMatcher | None],
    next_token: torch.Tensor,
    next_sibling: torch.Tensor,
    draft_tokens: torch.Tensor,
    bitmask: torch.Tensor,
) -> bool:
    """Fill a batch's tree masks: request b owns rows [b*D, (b+1)*D) of ``bitmask`` [bs*D, W].

    ``next_token``, ``next_sibling`` and ``draft_tokens`` are CPU int64 [bs, D]. Rows of requests
    without a matcher are set to all-allowed. Returns whether any request has a grammar (if not,
    the caller can skip applying the mask).
    """
    bs, d = draft_tokens.shape
    if bitmask.shape[0] != bs * d:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, expected bs*D = {bs * d}")
    any_grammar = False
    for b, matcher in enumerate(matchers):
        if matcher is None:
            bitmask[b * d : (b + 1) * d] = -1
            continue
        any_grammar = True
        fill_tree_bitmask(matcher, next_token[b], next_sibling[b], draft_tokens[b], bitmask, b * d)
    return any_grammar
