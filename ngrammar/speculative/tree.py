"""The draft-tree contract shared by the drafter, the verifier and attention.

A step drafts one tree per request, each with exactly D nodes (D = ``draft_token_num``):

* node 0 is the root: the last committed token, whose KV is computed in this verify step;
* the other nodes follow in BFS order, so every parent index is smaller than its child's;
* trees with fewer real nodes are padded to D with extra root children (token 0), appended last;
* ``mask[b, i, j]`` is true iff node j is an ancestor-or-self of node i (so column 0 is all true
  and the diagonal is true);
* node i of request b sits at position ``seq_len[b] + depth(i)``, depth = number of strict
  ancestors.

Links used by tree verification (local node indices, -1 where none):

* ``next_token[i]``: the first child of i, i.e. its smallest-index child;
* ``next_sibling[i]``: the next larger index with the same parent as i (the root has none).

Two derivations of the links exist on purpose: ``derive_tree_links`` on the host (numpy, for the
grammar mask, which is built on the CPU while the verify forward runs) and
``reconstruct_indices_from_tree_mask`` on the device (torch, without any device->host sync). They
use the same formulas so they agree on every mask, valid or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

PAD_TOKEN = 0  # the token of padding nodes (extra root children)


@dataclass(frozen=True)
class DraftTree:
    """A batch of ``bs`` draft trees with exactly ``draft_token_num`` nodes each."""

    tokens: np.ndarray  # [bs * D] int64: node tokens, request-major
    mask: np.ndarray  # [bs, D, D] bool: ancestor-or-self mask
    bs: int
    draft_token_num: int  # D, root included
    # [bs, D] int64 parent indices (read-only) when the builder knew them (``from_parents``, which
    # requires parent < child like every tree here); else derived from the mask on demand. Either
    # way they agree: the mask is built from them.
    parent_index: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        d = self.draft_token_num
        if self.tokens.shape != (self.bs * d,) or self.tokens.dtype != np.int64:
            raise ValueError(
                f"tokens must be int64 [{self.bs * d}], got {self.tokens.dtype} {self.tokens.shape}"
            )
        if self.mask.shape != (self.bs, d, d) or self.mask.dtype != np.bool_:
            raise ValueError(
                f"mask must be bool [{self.bs}, {d}, {d}], got {self.mask.dtype} {self.mask.shape}"
            )

    @classmethod
    def from_parents(cls, tokens: np.ndarray, parents: np.ndarray) -> DraftTree:
        """Build a tree batch from node tokens [bs*D] and parent indices [bs, D] (-1 at the root)."""
        bs, d = parents.shape
        parents = np.array(parents, dtype=np.int64)  # a copy: the tree keeps it
        if d:
            parents[:, 0] = -1  # the root's entry is ignored by the mask, so it reads as the mask does
        parents.flags.writeable = False  # shared by parents(): the mask was built from it
        return cls(np.asarray(tokens, dtype=np.int64), mask_from_parents(parents), bs, d, parents)

    def tokens_2d(self) -> np.ndarray:
        """[bs, D] view of the node tokens."""
        return self.tokens.reshape(self.bs, self.draft_token_num)

    def depths(self) -> np.ndarray:
        """[bs, D] int64: number of strict ancestors of each node."""
        return self.mask.sum(axis=-1, dtype=np.int64) - 1

    def parents(self) -> np.ndarray:
        """[bs, D] int64: parent of each node, -1 at the root."""
        if self.parent_index is not None:
            return self.parent_index
        return _parents_np(self.mask)

    def has_child(self) -> np.ndarray:
        """[bs, D] bool: node i has a child in its tree."""
        out = np.zeros((self.bs, self.draft_token_num + 1), dtype=np.bool_)
        out[np.arange(self.bs)[:, None], self.parents() + 1] = True  # column 0 collects the roots' -1
        return out[:, 1:]

    def padding(self) -> np.ndarray:
        """[bs, D] bool: padding nodes, ``PAD_TOKEN`` root children without children. A drafted
        token can be ``PAD_TOKEN`` too (SmolLM2's ``<|endoftext|>``, indexed from a prompt that
        holds it): as a leaf root child it reads as padding, which costs at most one draft; one with
        children is a real draft, or the nodes not padding would not be closed under ancestors
        (``keep_nodes`` raised on such a tree and took the engine step down)."""
        return (self.tokens_2d() == PAD_TOKEN) & (self.parents() == 0) & ~self.has_child()

    def keep_nodes(self, keep: np.ndarray, width: int) -> DraftTree:
        """The subtrees of kept nodes, renumbered in their order and padded to ``width`` nodes.

        ``keep`` [bs, D] bool must hold each root and be closed under ancestors (a kept node's
        parent is kept), and no row may keep more than ``width`` nodes. Relative order is kept, so
        the result is BFS-ordered with parent < child and every kept node keeps its first-child /
        next-sibling order among the kept nodes: a verify walk that could never accept the
        dropped nodes accepts the same path in both trees. This runs before a verify launch, so it
        is one Python pass over the nodes: at the small batches a trimmed step mostly has (one wide
        member keeps the width), that beats whole-batch numpy passes."""
        bs, d = self.bs, self.draft_token_num
        keep = np.asarray(keep, dtype=np.bool_)
        if keep.shape != (bs, d) or not keep[:, 0].all():
            raise ValueError(f"keep must be bool [{bs}, {d}] and keep every root")
        tokens_out: list[int] = []
        parents_out: list[list[int]] = []
        for kept, tokens, parents in zip(keep.tolist(), self.tokens_2d().tolist(), self.parents().tolist()):
            index = [-1] * d  # old node -> its index in the new tree
            row_tokens, row_parents = [tokens[0]], [-1]
            index[0] = 0
            for i in range(1, d):
                if not kept[i]:
                    continue
                parent = index[parents[i]]
                if parent < 0:
                    raise ValueError("keep must hold the parent of every kept node")
                index[i] = len(row_tokens)
                row_tokens.append(tokens[i])
                row_parents.append(parent)
            if len(row_tokens) > width:
                raise ValueError(f"a tree keeps {len(row_tokens)} nodes, more than width {width}")
            pad = width - len(row_tokens)
            tokens_out += row_tokens + [PAD_TOKEN] * pad
            parents_out.append(row_parents + [0] * pad)
        return DraftTree.from_parents(
            np.array(tokens_out, dtype=np.int64), np.array(parents_out, dtype=np.int64)
        )


@dataclass(frozen=True)
class Outcomes:
    """Trees drafted one token behind (``subtree_outcomes``): for each request, the subtree under
    each first-level draft, re-rooted there, for the case that its token is the one in flight, and
    a last tree of the root alone for none of them.

    ``children`` [bs, K] int64: each request's first-level draft tokens in node order (-1 past
    them; K at least 1); ``trees``: bs * (K + 1) trees of ``width`` nodes, request-major, tree k
    of request b (row b * (K + 1) + k) rooted at its child k, tree K the root alone (its root
    token a placeholder: the token in flight takes its place)."""

    children: np.ndarray
    trees: DraftTree

    @property
    def per_request(self) -> int:
        return self.children.shape[1] + 1

    def picked(self, tokens: list[int]) -> tuple[np.ndarray, DraftTree]:
        """The outcome each request's token in flight picks (``tokens`` [bs]: the first child of
        that token, else the root alone) and the trees picked, their roots set to the tokens."""
        k, children = self.per_request, self.children
        pick = np.full(len(tokens), k - 1, dtype=np.int64)
        for b, token in enumerate(tokens):
            hit = np.flatnonzero(children[b] == token)
            if hit.size:
                pick[b] = hit[0]
        rows = np.arange(len(tokens)) * k + pick
        d = self.trees.draft_token_num
        out = self.trees.tokens_2d()[rows].copy()
        out[:, 0] = tokens
        parents = self.trees.parents()[rows]
        return pick, DraftTree(out.reshape(-1), self.trees.mask[rows], len(tokens), d, parents)


def subtree_outcomes(tree: DraftTree, widths: list[int], width: int) -> Outcomes | None:
    """``Outcomes`` of trees drafted from the committed tokens (each root: the last committed
    token; its children: drafts of the token in flight), each subtree cut to its first ``width``
    nodes in node order (closed under ancestors: a parent precedes its child) and padded to the
    narrowest of ``widths`` that holds the largest (else ``width``). None: no subtree holds a
    draft below its root."""
    d = tree.draft_token_num
    padding = tree.padding()
    # per request, each first-level draft's (token, subtree tokens, subtree parents)
    subtrees: list[list[tuple[int, list[int], list[int]]]] = []
    for b, (tokens, parents) in enumerate(zip(tree.tokens_2d().tolist(), tree.parents().tolist())):
        row = []
        for c in (i for i in range(1, d) if parents[i] == 0 and not padding[b, i]):
            index = {c: 0}
            sub_tokens, sub_parents = [tokens[c]], [-1]
            for i in range(c + 1, d):
                if len(sub_tokens) == width:
                    break
                parent = index.get(parents[i])
                if parent is not None:
                    index[i] = len(sub_tokens)
                    sub_tokens.append(tokens[i])
                    sub_parents.append(parent)
            row.append((tokens[c], sub_tokens, sub_parents))
        subtrees.append(row)
    most = max((len(t) for row in subtrees for _, t, _ in row), default=1)
    if most < 2:  # no subtree holds a draft below its root
        return None
    k = max(len(row) for row in subtrees)
    narrow = min((w for w in widths if most <= w <= width), default=width)
    # Trees no child fills (a request with fewer children, and tree K) stay the root alone.
    tokens_out = np.full((len(subtrees), k + 1, narrow), PAD_TOKEN, dtype=np.int64)
    parents_out = np.zeros((len(subtrees), k + 1, narrow), dtype=np.int64)
    kids = np.full((len(subtrees), k), -1, dtype=np.int64)
    for b, row in enumerate(subtrees):
        for j, (child, sub_tokens, sub_parents) in enumerate(row):
            kids[b, j] = child
            tokens_out[b, j, : len(sub_tokens)] = sub_tokens
            parents_out[b, j, : len(sub_parents)] = sub_parents
    trees = DraftTree.from_parents(tokens_out.reshape(-1), parents_out.reshape(-1, narrow))
    return Outcomes(kids, trees)


def carry_to_kept(values: np.ndarray, keep: np.ndarray, width: int, fill: int | bool) -> np.ndarray:
    """Per-node values [bs, D] of a tree moved onto the nodes of ``keep_nodes(keep, width)``
    [bs, width] (kept nodes in order, then ``fill`` at the padding)."""
    out = np.full((keep.shape[0], width), fill, dtype=values.dtype)
    rows, cols = np.nonzero(keep)
    out[rows, (np.cumsum(keep, axis=1) - 1)[rows, cols]] = values[rows, cols]
    return out


def mask_from_parents(parents: np.ndarray) -> np.ndarray:
    """Ancestor-or-self mask [bs, D, D] bool from parent indices [bs, D].

    Requires parent < child (node 0 is the root, its parent entry is ignored): then row i is row
    parent(i) plus the diagonal, so rows can be filled in index order. This runs on every verify
    step before its launch, so small batches build each row as an int bit set (one Python
    operation per node, cheaper than a numpy pass per node index at that size); larger ones, or trees too wide for a 64-bit word, take one numpy pass per node index
    over the whole batch. Raises ValueError when a parent is not before its child.
    """
    bs, d = parents.shape
    if d == 0:
        return np.zeros((bs, d, d), dtype=np.bool_)
    if d <= 64 and bs * d <= _BITSET_NODES:
        return _mask_by_bitsets(parents.tolist(), bs, d)
    below = parents[:, 1:]
    if ((below < 0) | (below >= np.arange(1, d))).any():
        raise ValueError(_BAD_PARENT)
    mask = np.zeros((bs, d, d), dtype=np.bool_)
    rows = np.arange(bs)
    mask[:, 0, 0] = True
    for i in range(1, d):
        mask[:, i, :] = mask[rows, parents[:, i], :]
        mask[:, i, i] = True
    return mask


_BITSET_NODES = 256  # up to this many nodes per batch the bit-set loop beats the numpy one
_BAD_PARENT = "parent indices must satisfy 0 <= parent(i) < i for every node i >= 1"


def _mask_by_bitsets(parents: list[list[int]], bs: int, d: int) -> np.ndarray:
    """``mask_from_parents`` with row i of a tree as the bits of one int (bit j: node j)."""
    bits = [0] * (bs * d)
    base = 0
    for row in parents:
        bits[base] = 1
        for i in range(1, d):
            p = row[i]
            if not 0 <= p < i:
                raise ValueError(_BAD_PARENT)
            bits[base + i] = bits[base + p] | (1 << i)
        base += d
    words = np.array(bits, dtype=np.uint64).astype("<u8", copy=False)  # little-endian: bit j in byte j // 8
    unpacked = np.unpackbits(words.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
    return unpacked[:, :d].astype(np.bool_).reshape(bs, d, d)


@lru_cache(maxsize=64)
def _strictly_lower(d: int) -> np.ndarray:
    """[D, D] bool, true where j < i. Read-only: it is shared between calls."""
    lower = np.tri(d, d, k=-1, dtype=np.bool_)
    lower.flags.writeable = False
    return lower


def _parents_np(mask: np.ndarray) -> np.ndarray:
    """Parent = largest j < i with mask[b, i, j]; -1 where i has no strict ancestor. [bs, D] int64."""
    d = mask.shape[-1]
    strict = mask & _strictly_lower(d)
    largest = d - 1 - strict[..., ::-1].argmax(axis=-1)  # argmax finds the first True of the reversed row
    return np.where(strict.any(axis=-1), largest, -1).astype(np.int64, copy=False)


def _links_np(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first child, next sibling) [bs, D] int64 from parent indices [bs, D], -1 where none.

    Nodes are grouped by (request, parent) with one stable sort of the flat batch, so inside a group
    children sit in index order: a group's head is its parent's first child and each member's
    successor is its next sibling. Nodes without a parent (-1) form no links.
    """
    bs, d = parents.shape
    n = bs * d
    flat_parent = parents.reshape(-1)
    key = (parents + np.arange(0, bs * (d + 1), d + 1)[:, None]).reshape(-1)  # unique per (b, parent)
    order = np.argsort(key, kind="stable")  # flat node ids b*D + i, grouped
    same_group = key[order[1:]] == key[order[:-1]]
    has_parent = flat_parent[order] >= 0

    next_sibling = np.full(n, -1, dtype=np.int64)
    linked = same_group & has_parent[1:]
    next_sibling[order[:-1][linked]] = order[1:][linked] % d

    is_head = has_parent.copy()
    is_head[1:] &= ~same_group
    heads = order[is_head]
    local = heads % d
    next_token = np.full(n, -1, dtype=np.int64)
    next_token[heads - local + flat_parent[heads]] = local  # flat id of the parent gets its first child
    return next_token.reshape(bs, d), next_sibling.reshape(bs, d)


def derive_tree_links(mask: np.ndarray, bs: int, draft_token_num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host-side tree links (next_token, next_sibling), CPU int64 tensors [bs, D].

    ``mask`` is the ancestor-or-self mask shaped [bs*D*D] or [bs, D, D], bool or 0/1 integers.
    Equal to the links of ``reconstruct_indices_from_tree_mask`` on the same mask.
    """
    d = draft_token_num
    m = np.asarray(mask).reshape(bs, d, d)
    if m.dtype != np.bool_:
        m = m != 0
    next_token, next_sibling = _links_np(_parents_np(m))
    return torch.from_numpy(next_token), torch.from_numpy(next_sibling)


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor, seq_lens: torch.Tensor, bs: int, draft_token_num: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-side positions and tree links from the ancestor mask.

    Args:
        tree_mask: [bs*D*D] or [bs, D, D], bool or 0/1 integers, on any device.
        seq_lens: [bs] committed length of each request (the root's position), same device.

    Returns (all int64 on the mask's device):
        positions [bs*D]: seq_lens[b] + depth(i);
        retrive_index [bs, D]: b*D + i, the node's flat row in the verify batch;
        next_token [bs, D]: first child, or -1;
        next_sibling [bs, D]: next sibling, or -1.

    Pure broadcasted tensor ops with shapes fixed by (bs, D): no host sync, no Python loop over
    nodes or requests, so it can run inside a CUDA graph.
    """
    d = draft_token_num
    device = tree_mask.device
    m = tree_mask.reshape(bs, d, d).to(torch.bool)
    ar = torch.arange(d, device=device, dtype=torch.int64)
    below = ar[:, None] > ar[None, :]  # [D(i), D(j)]: j < i

    strict = m & below  # strict ancestors only
    depth = strict.sum(dim=-1)  # [bs, D]
    parents = torch.where(strict, ar, -1).amax(dim=-1)  # largest strict ancestor, -1 if none

    # First child: the smallest index among the nodes naming i as parent. Column 0 of the scatter
    # target collects the parentless nodes (parent -1) and is dropped.
    first_child = torch.full((bs, d + 1), d, device=device, dtype=torch.int64)
    first_child.scatter_reduce_(1, parents + 1, ar.expand(bs, d), reduce="amin")
    next_token = torch.where(first_child[:, 1:] == d, -1, first_child[:, 1:])

    # Next sibling: after a stable sort by parent, the children of one parent are adjacent and in
    # index order, so each node's successor in the sorted row is its next sibling.
    sorted_parents, order = torch.sort(parents, dim=1, stable=True)
    linked = (sorted_parents[:, 1:] == sorted_parents[:, :-1]) & (sorted_parents[:, 1:] >= 0)
    next_sibling = torch.full((bs, d), -1, device=device, dtype=torch.int64)
    next_sibling.scatter_(1, order[:, :-1], torch.where(linked, order[:, 1:], -1))  # order is a permutation

    positions = (seq_lens.to(device=device, dtype=torch.int64)[:, None] + depth).reshape(-1)
    retrive_index = torch.arange(bs * d, device=device, dtype=torch.int64).reshape(bs, d)
    return positions, retrive_index, next_token, next_sibling
