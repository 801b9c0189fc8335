"""Greedy tree acceptance in one Triton launch: what CUDA-graph verify steps accept with.

Why: ``ngrammar.runner.acceptance.verify_tree_greedy`` is vectorized over [bs, D, D] boolean tensors so it
runs anywhere without a host read, but on a GPU that is ~100 small kernels, a large share of a
small model's verify step. Here one program per
request walks its tree sequentially, which at D <= 64 nodes costs next to nothing, and writes what
the rest of the step needs in the layouts it needs: the packed row the host reads and the source
slot of every KV move, so the acceptor graph is the argmax, this kernel and one gather/scatter.

Same contract and results as ``verify_tree_greedy`` (tests/test_tree_accept_kernel.py): from the
root, take the first child in sibling (index) order whose token equals the target argmax at its
parent; the bonus is the argmax at the last accepted node. The parent of node i is the largest
j < i with ``tree_mask[b, i, j]``, as everywhere else (``derive_tree_links``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GreedyAccept:
    """What ``greedy_tree_accept`` returns; every tensor int64 on the kernel's device, -1 marks
    padding (the fields of ``runner.acceptance.TreeAcceptResult``, plus the packed row and moves)."""

    accept_index: torch.Tensor  # [bs, D]: flat rows b*D+node of the accepted path, root first
    accept_len: torch.Tensor  # [bs]: accepted drafts + 1 = tokens emitted this step (1..D)
    accept_tokens: torch.Tensor  # [bs, D]: accepted draft tokens in path order, then the bonus
    accept_nodes: torch.Tensor  # [bs, D]: local node indices of the path, root first
    bonus: torch.Tensor  # [bs]: the token emitted after the last accepted node
    packed: torch.Tensor  # [bs, 2D + 1]: tokens | len | nodes (``TreeAcceptResult.packed``)
    kv_src: torch.Tensor | None  # [bs, D]: the slot whose KV belongs at slots[b, j] (None without slots)


@triton.jit
def _greedy_tree_accept_kernel(
    cand_ptr, mask_ptr, pred_ptr, slots_ptr,
    packed_ptr, aux_ptr,
    W: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
):  # fmt: skip
    # grid = (bs,). Rows of candidates / predict / slots are [W]; the mask is [W, W] (uint8).
    # packed row [2W + 1]: accept_tokens | accept_len | accept_nodes (TreeAcceptResult.packed);
    # aux row [2W + 1]: accept_index | bonus | kv source slots.
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_W)
    valid = offs < W
    row = b * W
    out_row = b * (2 * W + 1)
    cand = tl.load(cand_ptr + row + offs, mask=valid, other=-1)
    pred = tl.load(pred_ptr + row + offs, mask=valid, other=-1)
    mask = tl.load(
        mask_ptr + b * W * W + offs[:, None] * W + offs[None, :],
        mask=valid[:, None] & valid[None, :],
        other=0,
    )
    # parent[i] = the largest ancestor index below i (-1 for the root).
    below = (mask != 0) & (offs[None, :] < offs[:, None])
    parent = tl.max(tl.where(below, offs[None, :], -1), axis=1)

    nodes = tl.where(offs == 0, 0, -1).to(tl.int64)
    tokens = tl.full([BLOCK_W], -1, tl.int64)
    node = 0
    length = 1
    searching = 1
    for depth in range(1, W):
        target = tl.sum(tl.where(offs == node, pred, 0), axis=0)  # argmax after the current node
        hit = valid & (parent == node) & (cand == target) & (searching != 0)
        first = tl.min(tl.where(hit, offs, BLOCK_W), axis=0)
        found = first < BLOCK_W
        # The accepted draft's token is the target itself; it is emitted at path slot depth - 1.
        tokens = tl.where((offs == depth - 1) & found, target, tokens)
        nodes = tl.where((offs == depth) & found, first.to(tl.int64), nodes)
        node = tl.where(found, first, node)
        length += found.to(tl.int32)
        searching = searching * found.to(tl.int32)
    bonus = tl.sum(tl.where(offs == node, pred, 0), axis=0)
    tokens = tl.where(offs == length - 1, bonus, tokens)
    tl.store(packed_ptr + out_row + offs, tokens, mask=valid)
    tl.store(packed_ptr + out_row + W, length.to(tl.int64))  # type: ignore[attr-defined]
    tl.store(packed_ptr + out_row + W + 1 + offs, nodes, mask=valid)
    tl.store(aux_ptr + out_row + offs, tl.where(nodes >= 0, nodes + row, -1), mask=valid)
    tl.store(aux_ptr + out_row + W, bonus)
    if HAS_SLOTS:
        # Path position j (1 <= j < length) takes node nodes[j]'s KV; every other position keeps
        # its own (moves onto itself), so the move has a fixed shape.
        on_path = valid & (offs >= 1) & (offs < length)
        src = tl.load(slots_ptr + row + tl.where(on_path, nodes, offs), mask=valid, other=0)
        tl.store(aux_ptr + out_row + W + 1 + offs, src, mask=valid)


def greedy_tree_accept(
    candidates: torch.Tensor,
    tree_mask: torch.Tensor,
    predict: torch.Tensor,
    slots: torch.Tensor | None = None,
) -> GreedyAccept:
    """``verify_tree_greedy`` in one launch: candidates [bs, D] int64, tree_mask [bs, D, D] bool,
    predict [bs, D] int64 (the target argmax after each node), optionally slots [bs, D] int64 (the
    step's KV slots: then ``kv_src`` names what ``move_kv_slots(kv_cache, slots, kv_src)`` must move);
    all on the kernel's device. Fixed shapes and no host read, so it can be captured in a CUDA graph."""
    bs, d = candidates.shape
    if (
        tree_mask.shape != (bs, d, d)
        or predict.shape != (bs, d)
        or (slots is not None and slots.shape != (bs, d))
    ):
        raise ValueError(
            f"shapes disagree: candidates {tuple(candidates.shape)}, mask {tuple(tree_mask.shape)}, "
            f"predict {tuple(predict.shape)}, slots {None if slots is None else tuple(slots.shape)}"
        )
    dev = candidates.device
    packed = torch.empty((bs, 2 * d + 1), dtype=torch.int64, device=dev)
    aux = torch.empty((bs, 2 * d + 1), dtype=torch.int64, device=dev)
    slot_rows = predict if slots is None else slots.to(torch.int64).contiguous()  # unread without slots
    _greedy_tree_accept_kernel[(bs,)](
        candidates.to(torch.int64).contiguous(), tree_mask.contiguous().view(torch.uint8),
        predict.to(torch.int64).contiguous(), slot_rows, packed, aux,
        W=d, BLOCK_W=max(2, triton.next_power_of_2(d)), HAS_SLOTS=slots is not None,
    )  # fmt: skip
    kv_src = None if slots is None else aux[:, d + 1 :]
    return GreedyAccept(
        aux[:, :d], packed[:, d], packed[:, :d], packed[:, d + 1 :], aux[:, d], packed, kv_src
    )
