"""Lossless acceptance of draft trees against the target model, on the device.

Tree contract (per request, D nodes): node 0 is the root (the last committed token); every other
node's parent has a smaller index; siblings are ordered by index (the "sibling order"). Trees are
padded to D nodes with extra root children of token 0, so siblings may share a token.
``tree_mask[b, i, j]`` is true iff node j is an ancestor-or-self of node i.

Both acceptance rules walk the tree from the root, taking at each level the first child (in sibling
order) that passes a test which depends only on that child, its earlier siblings and its parent.
That makes the walk vectorizable without loops: every node gets a static "chosen" flag (it passes
and no earlier sibling does), and the accepted path is the set of nodes whose ancestors-or-self are
all chosen (or the root). These sets come from the ancestor mask with [bs, D, D] boolean ops, so
nothing here loops over nodes or requests, reads a value back to the host, or produces a tensor
whose shape depends on data: the functions run unchanged on CPU and CUDA and inside CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# threshold_acc divides the accumulated probability; keep it away from 0 like the reference design.
_MIN_THRESHOLD_ACC = 1e-9


@dataclass
class TreeAcceptResult:
    """Outcome of one verify step for bs requests; every tensor is int64, -1 marks padding."""

    accept_index: torch.Tensor  # [bs, D]: flat rows b*D+node of the accepted path, root first
    accept_len: torch.Tensor  # [bs]: accepted drafts + 1 = tokens emitted this step (1..D)
    accept_tokens: torch.Tensor  # [bs, D]: accepted draft tokens in path order, then the bonus
    accept_nodes: torch.Tensor  # [bs, D]: local node indices of the path, root first
    bonus: torch.Tensor  # [bs]: the token emitted after the last accepted node

    @classmethod
    def of(cls, fused: Any) -> TreeAcceptResult:
        """The result fields of the fused kernel's ``GreedyAccept``."""
        return cls(fused.accept_index, fused.accept_len, fused.accept_tokens, fused.accept_nodes, fused.bonus)

    def head(self, bs: int) -> TreeAcceptResult:
        """The first ``bs`` requests (drops CUDA-graph padding rows; flat rows stay valid)."""
        return TreeAcceptResult(
            self.accept_index[:bs],
            self.accept_len[:bs],
            self.accept_tokens[:bs],
            self.accept_nodes[:bs],
            self.bonus[:bs],
        )

    def packed(self) -> torch.Tensor:
        """[bs, 2D + 1] int64: accept_tokens | accept_len | accept_nodes, what the host reads of a
        verify step, in one tensor so that the read is one copy (``unpack_accepted``)."""
        return torch.cat([self.accept_tokens, self.accept_len[:, None], self.accept_nodes], dim=1)


def unpack_accepted(packed: torch.Tensor) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Host lists (accept_tokens [bs][D], accept_len [bs], accept_nodes [bs][D]) of a
    ``TreeAcceptResult.packed`` tensor read back to the host."""
    d = (packed.shape[1] - 1) // 2
    rows = packed.tolist()
    return [r[:d] for r in rows], [r[d] for r in rows], [r[d + 1 :] for r in rows]


@dataclass
class _TreeStructure:
    """Relations derived once from the ancestor mask; all [bs, D] or [bs, D, D]."""

    depth: torch.Tensor  # [bs, D] int64: root has depth 0
    parent: torch.Tensor  # [bs, D] int64: -1 for the root
    is_child: torch.Tensor  # [bs, D] bool: every node but the root
    earlier_sibling: torch.Tensor  # [bs, D, D] bool: [b,i,j] iff j<i and j, i share a parent


def _node_range(tree_mask: torch.Tensor) -> torch.Tensor:
    """[D] int64 node indices on the mask's device."""
    return torch.arange(tree_mask.shape[-1], device=tree_mask.device)


def _tree_structure(tree_mask: torch.Tensor) -> _TreeStructure:
    """Depth, parent and sibling relations, read from the ancestor-or-self mask."""
    mask = tree_mask.bool()
    nodes = _node_range(mask)
    strict = mask & (nodes[:, None] != nodes[None, :])
    depth = strict.sum(-1)
    # Ancestors have smaller indices than their descendants, so the parent is the largest one.
    parent = torch.where(strict, nodes, -1).amax(-1)
    is_child = parent >= 0
    same_parent = parent[:, :, None] == parent[:, None, :]
    before = nodes[None, :] < nodes[:, None]
    earlier_sibling = same_parent & before & is_child[:, :, None]
    return _TreeStructure(depth, parent, is_child, earlier_sibling)


def _first_in_sibling_order(passes: torch.Tensor, tree: _TreeStructure) -> torch.Tensor:
    """[bs, D] bool: nodes that pass while none of their earlier siblings does."""
    blocked = (tree.earlier_sibling & passes[:, None, :]).any(-1)
    return passes & ~blocked


def _path_from_chosen(chosen: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
    """[bs, D] bool: nodes whose every ancestor-or-self is chosen or the root.

    At most one child per parent is chosen, so this is a single root-to-node chain.
    """
    ok = chosen | (_node_range(chosen) == 0)
    broken = (tree_mask.bool() & ~ok[:, None, :]).any(-1)
    return ~broken


def _gather_nodes(values: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """values[b, nodes[b, k]] with -1 entries of ``nodes`` mapped to -1."""
    picked = values.gather(1, nodes.clamp(min=0))
    return torch.where(nodes >= 0, picked, -1)


def _build_result(
    candidates: torch.Tensor,
    on_path: torch.Tensor,
    depth: torch.Tensor,
    bonus: torch.Tensor,
) -> TreeAcceptResult:
    """Pack the accepted chain into the padded output tensors."""
    bs, d = candidates.shape
    nodes = _node_range(candidates)
    # Path nodes have distinct depths 0..len-1; slot k holds the node at depth k.
    at_depth = on_path[:, :, None] & (depth[:, :, None] == nodes[None, None, :])
    accept_nodes = torch.where(at_depth, nodes[None, :, None], -1).amax(1)
    accept_len = on_path.sum(-1)
    row_base = (torch.arange(bs, device=candidates.device) * d)[:, None]
    accept_index = torch.where(accept_nodes >= 0, accept_nodes + row_base, -1)
    # Emitted token k is the draft at path slot k+1; the bonus takes slot accept_len-1.
    next_nodes = torch.cat([accept_nodes[:, 1:], accept_nodes.new_full((bs, 1), -1)], dim=1)
    drafts = _gather_nodes(candidates, next_nodes)
    is_bonus_slot = nodes[None, :] == (accept_len - 1)[:, None]
    accept_tokens = torch.where(is_bonus_slot, bonus.to(torch.int64)[:, None], drafts)
    return TreeAcceptResult(accept_index, accept_len, accept_tokens, accept_nodes, bonus)


def _last_path_node(on_path: torch.Tensor) -> torch.Tensor:
    """[bs] int64: the deepest accepted node, which is the largest index on the chain."""
    return torch.where(on_path, _node_range(on_path), -1).amax(-1)


def verify_tree_greedy(
    candidates: torch.Tensor,
    tree_mask: torch.Tensor,
    target_predict: torch.Tensor,
) -> TreeAcceptResult:
    """Greedy tree acceptance: follow the first child equal to the target argmax at its parent.

    candidates [bs, D] int64 draft tokens (column 0 is the root and is not emitted);
    tree_mask [bs, D, D] bool ancestor-or-self; target_predict [bs, D] int64 argmax after each node.
    The bonus token is the target argmax at the last accepted node.
    """
    tree = _tree_structure(tree_mask)
    candidates = candidates.to(torch.int64)
    predict = target_predict.to(torch.int64)
    expected = predict.gather(1, tree.parent.clamp(min=0))
    matches = tree.is_child & (candidates == expected)
    chosen = _first_in_sibling_order(matches, tree)
    on_path = _path_from_chosen(chosen, tree_mask)
    bonus = predict.gather(1, _last_path_node(on_path)[:, None]).squeeze(1)
    return _build_result(candidates, on_path, tree.depth, bonus)


def verify_tree_greedy_from_logits(
    candidates: torch.Tensor, tree_mask: torch.Tensor, logits: torch.Tensor
) -> TreeAcceptResult:
    """``verify_tree_greedy`` with the argmax taken here: logits [bs * D, V], row b*D+i after node i."""
    bs, d = candidates.shape
    return verify_tree_greedy(candidates, tree_mask, logits.argmax(dim=-1).view(bs, d))


def sample_from_probs(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row n takes the token whose CDF interval holds coins[n] * total.

    probs [N, V] non-negative (need not be normalized); coins [N] in [0, 1). Zero-probability
    tokens own empty intervals and are never drawn; a rounding overflow past the end is clamped
    to the last token with nonzero probability (token 0 for an all-zero row).
    """
    work = probs.to(torch.promote_types(probs.dtype, torch.float32))
    cdf = work.cumsum(-1)
    target = coins.to(cdf.dtype)[:, None] * cdf[:, -1:]
    # right=True counts the CDF entries <= target, i.e. the first index whose CDF exceeds it.
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    vocab = torch.arange(probs.shape[-1], device=probs.device)
    last_nonzero = torch.where(work > 0, vocab, 0).amax(-1)
    return torch.minimum(index, last_nonzero)


def _child_probs(target_probs: torch.Tensor, candidates: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """[bs, D]: target_probs[b, parent[b,c], candidates[b,c]] (the root reads its own row)."""
    bs, d, v = target_probs.shape
    rows = torch.arange(bs, device=target_probs.device)[:, None] * d + parent.clamp(min=0)
    flat = rows * v + candidates
    return target_probs.reshape(-1).gather(0, flat.reshape(-1)).reshape(bs, d)


def _residual_row(
    target_probs: torch.Tensor,
    candidates: torch.Tensor,
    tree: _TreeStructure,
    last: torch.Tensor,
) -> torch.Tensor:
    """[bs, V]: the target row of ``last`` without the tokens of last's children.

    Falls back to the plain target row when nothing is left (only possible through rounding).
    """
    bs, d, v = target_probs.shape
    rows = torch.arange(bs, device=target_probs.device) * d + last
    row = target_probs.reshape(bs * d, v).index_select(0, rows)
    is_last_child = tree.parent == last[:, None]
    # Non-children write into a spare column V, so every write is True and the result is
    # deterministic even when a token repeats.
    slots = torch.where(is_last_child, candidates, v)
    removed = torch.zeros(bs, v + 1, dtype=torch.bool, device=target_probs.device)
    removed.scatter_(1, slots, True)
    residual = row.masked_fill(removed[:, :v], 0)
    empty = residual.sum(-1, keepdim=True) <= 0
    return torch.where(empty, row, residual)


def tree_speculative_sampling_target_only(
    candidates: torch.Tensor,
    tree_mask: torch.Tensor,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    final_coins: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> TreeAcceptResult:
    """Tree speculative sampling with deterministic drafts (draft probability 0).

    candidates [bs, D] int64; tree_mask [bs, D, D] bool; target_probs [bs, D, V] normalized rows
    (row i = distribution after node i); coins [bs, D] in [0, 1) (the coin of node p decides among
    p's children); final_coins [bs] in [0, 1).

    At an accepted node p the children c are scanned in sibling order with a running sum of
    q_p(tok c); c is accepted when coin_p < sum / threshold_acc or q_p(tok c) >= threshold_single.
    A child repeating an earlier sibling's token counts 0 and is never accepted, and a child of
    probability 0 is never accepted. If no child is accepted, the bonus is drawn from q_p with all
    child tokens removed. With both thresholds 1 every emitted token is an exact draw from the
    target: P(child c) = q_p(tok c), and the residual carries exactly the remaining mass.
    """
    tree = _tree_structure(tree_mask)
    candidates = candidates.to(torch.int64)
    acc_dtype = torch.promote_types(target_probs.dtype, torch.float32)
    probs = _child_probs(target_probs, candidates, tree.parent).to(acc_dtype)
    same_token = candidates[:, :, None] == candidates[:, None, :]
    repeated = (tree.earlier_sibling & same_token).any(-1)
    counted = tree.is_child & ~repeated
    own = torch.where(counted, probs, 0)
    # Running sum over earlier siblings and self (in sibling order), per child.
    prob_acc = own + (tree.earlier_sibling.to(acc_dtype) * own[:, None, :]).sum(-1)
    coin = coins.to(acc_dtype).gather(1, tree.parent.clamp(min=0))
    scale = max(threshold_acc, _MIN_THRESHOLD_ACC)
    # Strict '<' with coins in [0, 1) gives P(accept) = the CDF interval length exactly.
    passes = counted & (own > 0) & ((coin < prob_acc / scale) | (own >= threshold_single))
    chosen = _first_in_sibling_order(passes, tree)
    on_path = _path_from_chosen(chosen, tree_mask)
    last = _last_path_node(on_path)
    residual = _residual_row(target_probs, candidates, tree, last)
    bonus = sample_from_probs(residual, final_coins)
    return _build_result(candidates, on_path, tree.depth, bonus)
