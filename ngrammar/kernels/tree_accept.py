"""Greedy tree acceptance in one Triton launch: the candidate for CUDA-graph verify steps.

Why: ``ngrammar.spec.verify.verify_tree_greedy`` is vectorized over [bs, D, D] boolean tensors so it
runs anywhere without a host read, but on a GPU that is ~100 small kernels. On the H200 the greedy
acceptor graph (argmax, acceptance, KV compaction, packing) replayed in 0.29 ms at batch 1, against
1.02 ms for the D = 16 verify forward itself (BENCHMARKS.md, session 14). Here one program per
request walks its tree sequentially, which at D <= 64 nodes costs next to nothing.

Same contract and results as ``verify_tree_greedy`` (tests/test_tree_accept_kernel.py): from the
root, take the first child in sibling (index) order whose token equals the target argmax at its
parent; the bonus is the argmax at the last accepted node. The parent of node i is the largest
j < i with ``tree_mask[b, i, j]``, as everywhere else (``derive_tree_links``).

Not used by the engine yet: it replaces the torch acceptor only once an H200 run has compared the
two (``python -m benchmarks.gpu_bench --parts acceptor``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ngrammar.spec.verify import TreeAcceptResult


@triton.jit
def _greedy_tree_accept_kernel(
    cand_ptr, mask_ptr, pred_ptr,
    index_ptr, len_ptr, tokens_ptr, nodes_ptr, bonus_ptr,
    W: tl.constexpr,
    BLOCK_W: tl.constexpr,
):  # fmt: skip
    # grid = (bs,). Row b of candidates / predict / the outputs is [W]; the mask is [W, W] (uint8).
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_W)
    valid = offs < W
    row = b * W
    cand = tl.load(cand_ptr + row + offs, mask=valid, other=-1)
    pred = tl.load(pred_ptr + row + offs, mask=valid, other=-1)
    mask = tl.load(mask_ptr + b * W * W + offs[:, None] * W + offs[None, :],
                   mask=valid[:, None] & valid[None, :], other=0)
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
    tl.store(tokens_ptr + row + offs, tokens, mask=valid)
    tl.store(nodes_ptr + row + offs, nodes, mask=valid)
    tl.store(index_ptr + row + offs, tl.where(nodes >= 0, nodes + row, -1), mask=valid)
    tl.store(len_ptr + b, length.to(tl.int64))
    tl.store(bonus_ptr + b, bonus)


def greedy_tree_accept(candidates: torch.Tensor, tree_mask: torch.Tensor, predict: torch.Tensor) -> TreeAcceptResult:
    """``verify_tree_greedy`` in one launch: candidates [bs, D] int64, tree_mask [bs, D, D] bool,
    predict [bs, D] int64 (the target argmax after each node); all on the kernel's device. Fixed
    shapes and no host read, so it can be captured in a CUDA graph."""
    bs, d = candidates.shape
    if tree_mask.shape != (bs, d, d) or predict.shape != (bs, d):
        raise ValueError(f"shapes disagree: candidates {tuple(candidates.shape)}, mask {tuple(tree_mask.shape)}, "
                         f"predict {tuple(predict.shape)}")
    dev = candidates.device
    out = torch.empty((3, bs, d), dtype=torch.int64, device=dev)  # accept_index | accept_tokens | accept_nodes
    lens = torch.empty(bs, dtype=torch.int64, device=dev)
    bonus = torch.empty(bs, dtype=torch.int64, device=dev)
    _greedy_tree_accept_kernel[(bs,)](
        candidates.to(torch.int64).contiguous(), tree_mask.contiguous().view(torch.uint8),
        predict.to(torch.int64).contiguous(), out[0], lens, out[1], out[2], bonus,
        W=d, BLOCK_W=max(2, triton.next_power_of_2(d)),
    )  # fmt: skip
    return TreeAcceptResult(out[0], lens, out[1], out[2], bonus)
