"""Triton paged attention for CUDA: one kernel for prefill, decode and tree verify.

Semantics are exactly those of ``ngrammar.attention.metadata`` (read its module docstring): request b
attends over ``kv_lens[b]`` cached tokens; its ``q_lens[b]`` queries are the last ones; the committed
prefix is fully visible and the new block is causal or follows ``tree_mask``.

Kernel layout
-------------
One program handles (query block, request, kv head, kv split). GQA is folded into the row
dimension: a block of ``BLOCK_M`` rows holds ``BLOCK_M // G`` consecutive query tokens times the
``G = Hq // Hkv`` query heads that share one kv head, so K/V are loaded once per group. Each program
walks its request's pages (kv index n lives in page ``page_table[b, n // page_size]`` at offset
``n % page_size``) with an online softmax in fp32 (base-2 exponent, scale folded into ``qk_scale``).

Every length (q_len, kv_len, prefix) is read from the metadata tensors inside the kernel; the launch
grid depends only on host ints that are fixed for a CUDA-graph bucket: ``max_q_len`` (number of query
blocks), batch size, head counts and the number of kv splits. The split count is a performance
choice only: any value gives the same result, so a graph captured with one split count stays correct
for every kv length replayed through it.

Split-KV (flash decoding): with few programs (small batch decode), the kv range of each program is cut
into ``num_splits`` equal chunks of tiles; each chunk writes a normalised partial output and its
log-sum-exp. In decode steps (one query token per request) each split bumps a counter and the one that finishes last
merges the partials (at batch 1 a second launch costs more than the merge), and splits beyond the
kv length exit at once; bigger blocks are merged by a second small kernel, in parallel over tokens
and heads. With one split the kernel writes the output directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tcuda

from ngrammar.attention.metadata import AttentionMetadata
from ngrammar.kernels.device_info import num_sms, pdl_for_step

_LOG2E = 1.4426950408889634
# Splitting is only worth its merge pass when each split still covers a couple of 64-wide tiles.
_MIN_KV_PER_SPLIT = 128
# Below this many programs per SM the kv range is split; splitting then aims for the higher count.
# (Measured on an H200, bf16: bs=1 decode at 8k context is fastest near 64 splits.)
_SPLIT_BELOW_PROGRAMS_PER_SM = 2
_SPLIT_TARGET_PROGRAMS_PER_SM = 4


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, cos_ptr, sin_ptr,
    num_q_heads, num_kv_heads,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_cos_t, stride_sin_t,
    stride_c_page, stride_c_slot, stride_c_head,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROPE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # One program per new token. With ROPE, rotates its q heads in place (rotate-half, fp32, one
    # rounding, as ``ngrammar.attention.sdpa.rotate_half``) and its k heads on the way into the
    # paged pool; v is copied as is. Under PDL everything it reads was written by earlier kernels, so
    # it waits first: what it gains is the launch, done while the projection finishes.
    if PDL:
        tcuda.gdc_wait()
        tcuda.gdc_launch_dependents()
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0)
    half = tl.arange(0, HALF)
    if ROPE:
        c = tl.load(cos_ptr + t * stride_cos_t + half)[None, :]
        s = tl.load(sin_ptr + t * stride_sin_t + half)[None, :]
        hq = tl.arange(0, BLOCK_HQ)
        q_ok = (hq < num_q_heads)[:, None]
        q1_ptr = q_ptr + t * stride_q_t + hq[:, None] * stride_q_h + half[None, :]
        q1 = tl.load(q1_ptr, mask=q_ok).to(tl.float32)
        q2 = tl.load(q1_ptr + HALF, mask=q_ok).to(tl.float32)
        tl.store(q1_ptr, (q1 * c - q2 * s).to(q_ptr.dtype.element_ty), mask=q_ok)
        tl.store(q1_ptr + HALF, (q2 * c + q1 * s).to(q_ptr.dtype.element_ty), mask=q_ok)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Negative slots mark padding tokens (e.g. a CUDA-graph bucket larger than the batch): skip them.
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    head_ok = (heads < num_kv_heads)[:, None]
    dst = (slot // PAGE_SIZE) * stride_c_page + (slot % PAGE_SIZE) * stride_c_slot
    dst1 = dst + heads[:, None] * stride_c_head + half[None, :]
    k1_ptr = k_ptr + t * stride_k_t + heads[:, None] * stride_k_h + half[None, :]
    k1 = tl.load(k1_ptr, mask=head_ok)
    k2 = tl.load(k1_ptr + HALF, mask=head_ok)
    if ROPE:
        a, b = k1.to(tl.float32), k2.to(tl.float32)
        k1 = (a * c - b * s).to(k_ptr.dtype.element_ty)
        k2 = (b * c + a * s).to(k_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + dst1, k1.to(k_cache_ptr.dtype.element_ty), mask=head_ok)
    tl.store(k_cache_ptr + dst1 + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=head_ok)
    dims = tl.arange(0, HEAD_DIM)
    v = tl.load(v_ptr + t * stride_v_t + heads[:, None] * stride_v_h + dims[None, :], mask=head_ok)
    dst_v = dst + heads[:, None] * stride_c_head + dims[None, :]
    tl.store(v_cache_ptr + dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=head_ok)


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    lo,
    hi,
    prefix,
    tok,
    row_valid,
    k_base,
    v_base,
    page_row_ptr,
    tree_row_ptr,
    stride_c_page,
    stride_c_slot,
    stride_tm_i,
    stride_tm_j,
    qk_scale,
    path_bits,
    path_rank,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_TREE: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    TREE_PATH: tl.constexpr,
    TREE_POW2: tl.constexpr,
    INVARIANT: tl.constexpr,
):
    """Online-softmax accumulation over kv indices [lo, hi) in BLOCK_N tiles.

    TREE_PATH (row-invariant tree steps, one query token per program): the indices are logical, the
    token's own sequence: index prefix + i is its depth-i ancestor, the i-th node its tree-mask row
    ``path_bits`` [TREE_POW2] opens (``path_rank`` is that row's running count), so each kv row sits
    in the tile lane a decode step at that position would give it.

    MASKED=False is the fast path for tiles every row of the block fully sees (callers guarantee
    hi - lo is a multiple of BLOCK_N and hi <= kv_len there). MASKED=True handles the ragged end, the
    causal diagonal and the tree block. acc [BLOCK_M, HEAD_DIM], m_i / l_i [BLOCK_M], all fp32; m_i is
    in base-2 units of the scaled scores.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        kv_idx = start + offs_n
        in_range = kv_idx < hi
        phys = kv_idx
        if MASKED and TREE_PATH:
            depth = kv_idx - prefix  # >= 0: the ancestor at this depth, found by rank in the mask row
            nodes = tl.arange(0, TREE_POW2)
            hit = (path_bits[None, :] != 0) & (path_rank[None, :] == depth[:, None] + 1)
            node = tl.sum(tl.where(hit, nodes[None, :], 0), axis=1)
            phys = tl.where(depth >= 0, prefix + node, kv_idx)
        if MASKED:
            page = tl.load(page_row_ptr + phys // PAGE_SIZE, mask=in_range, other=0)
        else:
            page = tl.load(page_row_ptr + phys // PAGE_SIZE)
        # [BLOCK_N] element offset of each kv row inside one head's view of the pool.
        kv_off = page.to(tl.int64) * stride_c_page + (phys % PAGE_SIZE) * stride_c_slot
        if MASKED:
            k_t = tl.load(k_base + kv_off[None, :] + offs_d[:, None], mask=in_range[None, :], other=0.0)
        else:
            k_t = tl.load(k_base + kv_off[None, :] + offs_d[:, None])
        if IEEE_DOT:
            qk = tl.dot(q, k_t, input_precision="ieee")
        else:
            qk = tl.dot(q, k_t)
        qk = qk * qk_scale
        if MASKED and TREE_PATH:
            qk = tl.where(in_range[None, :], qk, float("-inf"))  # every logical index is visible
        elif MASKED:
            rel = kv_idx - prefix  # position inside the new block; negative inside the prefix
            if HAS_TREE:
                tree_ok = row_valid[:, None] & ((rel >= 0) & in_range)[None, :]
                tree_bits = tl.load(
                    tree_row_ptr + tok[:, None] * stride_tm_i + rel[None, :] * stride_tm_j,
                    mask=tree_ok,
                    other=0,
                )
                visible = (rel < 0)[None, :] | (tree_bits != 0)
            else:
                visible = rel[None, :] <= tok[:, None]
            visible = visible & in_range[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # Rows that have seen nothing yet keep m = -inf; shift them by 0 so exp2 yields 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        if INVARIANT:  # a tile that leaves the max alone must leave the row exactly as it was
            alpha = tl.where(m_i == m_shift, 1.0, alpha)
        p = tl.exp2(qk - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_base + kv_off[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
        else:
            v = tl.load(v_base + kv_off[:, None] + offs_d[None, :])
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _owner_request(q_start_ptr, pid, num_seqs, Q_PER_BLOCK: tl.constexpr):
    """The last request b < num_seqs whose first program, q_start[b] // Q_PER_BLOCK + b, is <= pid
    (a binary search: that first program grows strictly with b)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(q_start_ptr + mid).to(tl.int32) // Q_PER_BLOCK + mid
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# num_seqs is read only by VARLEN launches; unspecialized, so batch sizes of 1 or multiples of 16
# compile no kernel variants of their own.
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    counter_ptr,
    q_start_ptr,
    q_lens_ptr,
    kv_lens_ptr,
    page_table_ptr,
    tree_mask_ptr,
    qk_scale,
    num_kv_heads,
    num_splits,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_c_page,
    stride_c_slot,
    stride_c_head,
    stride_o_t,
    stride_o_h,
    stride_pt_b,
    stride_tm_b,
    stride_tm_i,
    stride_tm_j,
    stride_po_s,
    stride_po_t,
    stride_po_h,
    stride_pl_s,
    stride_pl_t,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MIN_TILES: tl.constexpr,
    SPLIT_OUTPUT: tl.constexpr,
    MERGE_IN_KERNEL: tl.constexpr,
    HAS_TREE: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    PDL: tl.constexpr,
    INVARIANT: tl.constexpr,
    SPLIT_TILES: tl.constexpr,
    TREE_POW2: tl.constexpr,
    VARLEN: tl.constexpr,
):
    if PDL:  # q and this token's K/V come from the kernel before: wait for it (see _rope_store_kv_kernel)
        tcuda.gdc_wait()
        tcuda.gdc_launch_dependents()
    # grid = (query blocks, B * Hkv, num_splits); query block fastest so programs sharing K/V run
    # together. SPLIT_OUTPUT: write normalised partials + log-sum-exp per split, merged by
    # _merge_splits_kernel or, with MERGE_IN_KERNEL, by the last split of a (query block, request,
    # kv head) to finish (num_splits is a runtime int so changing it costs no recompile).
    # INVARIANT: every row is computed as a decode row at its position would be (see
    # invariant_launch_config); tree steps then run one query token per program, walking its own path.
    TREE_PATH: tl.constexpr = INVARIANT and HAS_TREE
    Q_PER_BLOCK: tl.constexpr = 1 if TREE_PATH else BLOCK_M // GROUP
    split = tl.program_id(2)
    if VARLEN:
        # grid = (T // Q_PER_BLOCK + B, Hkv, num_splits), fixed by the token and request bounds of a
        # CUDA graph: request b owns programs q_start[b] // Q_PER_BLOCK + b onwards (at least its
        # ceil(q_len / Q_PER_BLOCK) blocks); the ones past its last block exit below.
        pid = tl.program_id(0)
        b = _owner_request(q_start_ptr, pid, num_seqs, Q_PER_BLOCK)
        q_block = pid - (tl.load(q_start_ptr + b).to(tl.int32) // Q_PER_BLOCK + b)
        kv_head = tl.program_id(1)
        counter_index = kv_head * tl.num_programs(0) + pid
    else:
        q_block = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // num_kv_heads
        kv_head = pid_bh % num_kv_heads
        counter_index = pid_bh * tl.num_programs(0) + q_block

    q_len = tl.load(q_lens_ptr + b).to(tl.int32)
    tok_begin = q_block * Q_PER_BLOCK
    if tok_begin >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + b).to(tl.int32)
    q_first = tl.load(q_start_ptr + b).to(tl.int64)
    prefix = kv_len - q_len

    tree_row_ptr = tree_mask_ptr + b.to(tl.int64) * stride_tm_b
    path_bits = tl.zeros([TREE_POW2], dtype=tl.int32)
    path_rank = path_bits
    if TREE_PATH:
        # The token's ancestors-or-self (a prefix-closed path, in BFS = depth order): its kv sequence
        # is the committed prefix, then the path.
        nodes = tl.arange(0, TREE_POW2)
        path_bits = tl.load(
            tree_row_ptr + tok_begin * stride_tm_i + nodes * stride_tm_j, mask=nodes < q_len, other=0
        ).to(tl.int32)
        path_bits = tl.where(path_bits != 0, 1, 0)
        path_rank = tl.cumsum(path_bits, 0)
        kv_end = prefix + tl.sum(path_bits, 0)
    elif HAS_TREE:
        # The tree mask may open any column of the new block, so scan to the end; only the prefix is
        # known visible to every row.
        kv_end = kv_len
        full_end = prefix
    else:
        # Causal: the block's last token sees up to its own index; its first token sees every column
        # before prefix + tok_begin + 1, so those tiles need no mask.
        kv_end = tl.minimum(kv_len, prefix + tok_begin + Q_PER_BLOCK)
        full_end = prefix + tok_begin + 1

    # This split's share of the tiles: contiguous, equal in tile count (at least MIN_TILES), possibly
    # empty. Only the first used_splits splits have tiles; with MERGE_IN_KERNEL the others exit here.
    num_tiles = (kv_end + BLOCK_N - 1) // BLOCK_N
    if INVARIANT:
        # A fixed split length, so a row's splits depend on its length alone; the last split of the
        # grid takes whatever is left (still exact, no longer row-invariant past the grid's reach).
        tiles_per_split = SPLIT_TILES
        used_splits = tl.minimum(tl.maximum((num_tiles + SPLIT_TILES - 1) // SPLIT_TILES, 1), num_splits)
    else:
        tiles_per_split = tl.maximum((num_tiles + num_splits - 1) // num_splits, MIN_TILES)
        used_splits = tl.maximum((num_tiles + tiles_per_split - 1) // tiles_per_split, 1)
    if MERGE_IN_KERNEL:
        if split >= used_splits:
            return
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(kv_end, lo + tiles_per_split * BLOCK_N)
    if INVARIANT:
        if split == num_splits - 1:
            hi = kv_end
    if INVARIANT:
        # One code path for every tile: whether a tile is a row's "full" one differs between a
        # decode row, a tree row and a prefill row at the same position, and the two loops may be
        # compiled with different floating-point contractions.
        full_hi = lo
    else:
        full_hi = lo + (tl.maximum(tl.minimum(hi, full_end) - lo, 0) // BLOCK_N) * BLOCK_N

    # Row r of the block is query token tok_begin + r // GROUP of head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    tok = tok_begin + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < Q_PER_BLOCK * GROUP) & (tok < q_len)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = q_first + tok
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    q = q.to(k_cache_ptr.dtype.element_ty)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_cache_ptr + kv_head * stride_c_head
    v_base = v_cache_ptr + kv_head * stride_c_head
    page_row_ptr = page_table_ptr + b.to(tl.int64) * stride_pt_b
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, lo, full_hi, prefix, tok, row_valid, k_base, v_base, page_row_ptr, tree_row_ptr,
        stride_c_page, stride_c_slot, stride_tm_i, stride_tm_j, qk_scale, path_bits, path_rank,
        BLOCK_N, HEAD_DIM, PAGE_SIZE, False, HAS_TREE, IEEE_DOT, TREE_PATH, TREE_POW2, INVARIANT,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, full_hi, hi, prefix, tok, row_valid, k_base, v_base, page_row_ptr, tree_row_ptr,
        stride_c_page, stride_c_slot, stride_tm_i, stride_tm_j, qk_scale, path_bits, path_rank,
        BLOCK_N, HEAD_DIM, PAGE_SIZE, True, HAS_TREE, IEEE_DOT, TREE_PATH, TREE_POW2, INVARIANT,
    )  # fmt: skip

    # A row that saw nothing (only possible for an empty split or a malformed tree row) outputs 0.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_offs = q_rows[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :]
    if not SPLIT_OUTPUT:
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    elif MERGE_IN_KERNEL:
        if used_splits == 1:  # a short kv range: this program had all of it
            tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
        else:
            po_offs = q_rows[:, None] * stride_po_t + head[:, None] * stride_po_h + offs_d[None, :]
            pl_offs = q_rows * stride_pl_t + head
            tl.store(part_o_ptr + split * stride_po_s + po_offs, out, mask=row_valid[:, None])
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            tl.store(part_lse_ptr + split * stride_pl_s + pl_offs, lse, mask=row_valid)
            # Count finished splits. The barrier puts every thread's partial stores before the
            # counter's release; the acquire side reads partials through L2 (.cg), never a stale L1
            # line.
            tl.debug_barrier()
            counter = counter_ptr + counter_index
            if tl.atomic_add(counter, 1, sem="acq_rel") == used_splits - 1:
                _merge_partials(
                    part_o_ptr,
                    part_lse_ptr,
                    out_ptr,
                    po_offs,
                    pl_offs,
                    o_offs,
                    row_valid,
                    used_splits,
                    stride_po_s,
                    stride_pl_s,
                    BLOCK_M,
                    HEAD_DIM,
                    INVARIANT,
                )
                tl.atomic_xchg(counter, 0)  # ready for the next layer (and the next CUDA-graph replay)
    else:
        po_offs = (
            split * stride_po_s
            + q_rows[:, None] * stride_po_t
            + head[:, None] * stride_po_h
            + offs_d[None, :]
        )
        tl.store(part_o_ptr + po_offs, out, mask=row_valid[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + split * stride_pl_s + q_rows * stride_pl_t + head, lse, mask=row_valid)


@triton.jit
def _merge_partials(
    part_o_ptr, part_lse_ptr, out_ptr, po_offs, pl_offs, o_offs, row_valid,
    num_splits, stride_po_s, stride_pl_s,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    INVARIANT: tl.constexpr,
):  # fmt: skip
    """out = sum_s exp2(lse_s) * o_s / sum_s exp2(lse_s) over the first num_splits splits, one pass
    with a running max; a split whose rows saw nothing carries lse = -inf and weighs 0."""
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(
            part_lse_ptr + s * stride_pl_s + pl_offs,
            mask=row_valid,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        part = tl.load(
            part_o_ptr + s * stride_po_s + po_offs, mask=row_valid[:, None], other=0.0, cache_modifier=".cg"
        )
        m_new = tl.maximum(m, lse)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_shift)
        if INVARIANT:  # an empty split (weight 0) leaves the sum exactly as it was
            alpha = tl.where(m == m_shift, 1.0, alpha)
        w = tl.exp2(lse - m_shift)
        acc = acc * alpha[:, None] + part * w[:, None]
        total = total * alpha + w
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _merge_splits_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    stride_po_s,
    stride_po_t,
    stride_po_h,
    stride_pl_s,
    stride_pl_t,
    stride_o_t,
    stride_o_h,
    num_splits,
    SPLITS_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid = (T, Hq): weights each split's normalised output by exp2(lse_s - max lse).
    if PDL:  # the partials come from the attention kernel just before
        tcuda.gdc_wait()
        tcuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    splits = tl.arange(0, SPLITS_POW2)
    split_ok = splits < num_splits
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(
        part_lse_ptr + splits * stride_pl_s + t * stride_pl_t + h, mask=split_ok, other=float("-inf")
    )
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)  # empty splits carry lse = -inf -> weight 0
    total = tl.sum(weight, 0)
    part = tl.load(
        part_o_ptr + splits[:, None] * stride_po_s + t * stride_po_t + h * stride_po_h + offs_d[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )
    out = tl.sum(part * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t * stride_o_t + h * stride_o_h + offs_d, out.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class LaunchConfig:
    """Host-side launch shape for one (step, head layout); every field is a plain int."""

    block_m: int
    block_n: int
    num_q_blocks: int
    num_splits: int
    num_warps: int
    num_stages: int
    # The last split merges (no merge kernel) in decode steps (one query token per request), where
    # the launch costs more than the merge. Tree verify and prefill blocks merge in
    # _merge_splits_kernel, in parallel over tokens and heads.
    merge_in_kernel: bool = False
    # Row-invariant launches: tiles per kv split (0: the split count divides the range adaptively).
    split_tiles: int = 0

    @property
    def min_tiles_per_split(self) -> int:
        return max(1, _MIN_KV_PER_SPLIT // self.block_n)


# Row-invariant launches: kv splits of this many 64-wide tiles.
INVARIANT_SPLIT_TILES = 8


def invariant_launch_config(
    max_q_len: int, group: int, kv_len_bound: int, max_splits: int, tree: bool
) -> LaunchConfig:
    """The launch of row-invariant attention: a query row's output does not depend on the rows
    beside it. The tile shapes and warps are constants (the dots and row reductions then run the same
    instructions for every row); kv splits cover a fixed number of tiles, so a row's split
    boundaries depend on its kv length alone, and the last split to finish always merges, with the
    same running-max loop; a tree step runs one query token per program over its own path (prefix,
    then ancestors by depth), which puts each kv row in the tile lane a decode step would. The grid
    holds enough splits for kv_len_bound (at most max_splits)."""
    block_m = max(64, _next_pow2(group))
    block_n = 64
    tokens_per_block = 1 if tree else block_m // group
    span = INVARIANT_SPLIT_TILES * block_n
    num_splits = max(1, min(-(-kv_len_bound // span), max_splits))
    return LaunchConfig(
        block_m, block_n, -(-max_q_len // tokens_per_block), num_splits, num_warps=4, num_stages=2,
        merge_in_kernel=True, split_tiles=INVARIANT_SPLIT_TILES,
    )  # fmt: skip


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def choose_launch_config(
    max_q_len: int,
    group: int,
    head_dim: int,
    batch_size: int,
    num_kv_heads: int,
    kv_len_bound: int,
    num_sms: int,
    num_splits: int | None = None,
    max_splits: int = 64,
    invariant: bool = False,
    tree: bool = False,
) -> LaunchConfig:
    """Tile sizes and split count from host ints only (no tensor is read).

    kv_len_bound only steers the split count; correctness never depends on it. Tile choices were
    picked from a sweep on an H200 (bf16); shared memory stays under ~130 KB so they also fit A100s.
    ``invariant``: one tiling for every step (``invariant_launch_config``).
    """
    if invariant:
        return invariant_launch_config(max_q_len, group, kv_len_bound, max_splits, tree)
    rows = max_q_len * group
    block_m = max(16, _next_pow2(rows), _next_pow2(group))
    small = block_m <= 64
    if small:
        # Decode / small tree verify: memory bound, one query block per (request, kv head).
        block_n, num_stages = 64, 2
    elif head_dim <= 64:
        block_m, block_n, num_stages = 64, 128, 3
    else:
        block_m, block_n, num_stages = 128, 64, 3
    block_m = max(block_m, _next_pow2(group))  # a block holds at least one token's whole head group
    num_q_blocks = -(-max_q_len // (block_m // group))
    programs = num_q_blocks * batch_size * num_kv_heads
    if num_splits is None:
        num_splits = 1
        if programs < _SPLIT_BELOW_PROGRAMS_PER_SM * num_sms:
            by_occupancy = -(-(_SPLIT_TARGET_PROGRAMS_PER_SM * num_sms) // programs)
            by_length = -(-kv_len_bound // _MIN_KV_PER_SPLIT)
            num_splits = max(1, min(by_occupancy, by_length, max_splits))
    if small:
        # Long streaming loops (big batch, little splitting) ran best with 2 warps; short split
        # chunks with 4.
        num_warps = 2 if kv_len_bound >= 1024 * num_splits else 4
    else:
        num_warps = 8 if block_m * head_dim >= 128 * 128 else 4
    # Decode steps only: merging in the kernel beats a separate merge kernel there; verify blocks
    # were not measured with it.
    merge_in_kernel = max_q_len == 1
    return LaunchConfig(block_m, block_n, num_q_blocks, num_splits, num_warps, num_stages, merge_in_kernel)


_Launch = tuple[LaunchConfig, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@dataclass(frozen=True)
class TritonAttentionPlan:
    """What every layer of one step shares. Holds only views of the metadata plus host ints, so a
    plan built around static metadata buffers stays valid when those buffers are refilled in place
    (CUDA-graph replay)."""

    meta: AttentionMetadata
    tree_mask_u8: torch.Tensor | None  # uint8 view of meta.tree_mask (same storage) or None
    kv_len_bound: int
    num_splits: int | None
    max_splits: int
    num_sms: int
    invariant: bool = False
    # > 0: a grid fixed by this many tokens and meta's batch size (``VARLEN``), whatever the step's
    # query lengths, so one CUDA graph serves every mix of decode rows and prompt chunks up to it.
    token_bound: int = 0
    # Split scratch shared with other plans (CUDA graphs of several buckets: views of the largest).
    scratch: dict[Any, torch.Tensor] | None = field(default=None, compare=False, repr=False)
    # Per (Hq, Hkv, d): the launch config and the split scratch buffers, filled by the first layer
    # and reused by the rest (layers run in order on one stream, so sharing scratch is safe).
    _cache: dict[tuple[int, int, int], _Launch] = field(default_factory=dict, compare=False, repr=False)

    def launch(self, num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> _Launch:
        """(config, part_o [S, T, Hq, d] fp32, part_lse [S, T, Hq] fp32, finished-split counters
        [B * Hkv * query blocks] int32, zero between kernels); the buffers are None when S = 1, the
        counters also when a merge kernel merges."""
        key = (num_q_heads, num_kv_heads, head_dim)
        hit = self._cache.get(key)
        if hit is None:
            meta, group = self.meta, num_q_heads // num_kv_heads
            varlen = self.token_bound > 0
            cfg = choose_launch_config(
                self.token_bound if varlen else meta.max_q_len, group, head_dim,
                1 if varlen else meta.batch_size, num_kv_heads, self.kv_len_bound, self.num_sms,
                self.num_splits, self.max_splits, self.invariant, meta.tree_mask is not None,
            )  # fmt: skip
            if varlen:  # every request's blocks fit: ceil(q_len / per block) <= its share + 1
                per_block = cfg.block_m // group
                cfg = replace(cfg, num_q_blocks=self.token_bound // per_block + meta.batch_size)
            part_o = part_lse = counters = None
            if cfg.num_splits > 1:
                tokens = int(meta.slot_mapping.shape[0])
                part_o = self._buffer((key, "o"), (cfg.num_splits, tokens, num_q_heads, head_dim), device)
                part_lse = self._buffer((key, "lse"), (cfg.num_splits, tokens, num_q_heads), device)
            if cfg.num_splits > 1 and cfg.merge_in_kernel:
                rows = num_kv_heads if varlen else meta.batch_size * num_kv_heads  # the grid's 2nd axis
                counters = self._buffer(
                    (key, "counters"),
                    (rows * cfg.num_q_blocks,),
                    device,
                    torch.int32,
                )
            hit = (cfg, part_o, part_lse, counters)
            self._cache[key] = hit
        return hit

    def _buffer(
        self, name: Any, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """A zeroed scratch buffer of ``shape``: a view of ``scratch[name]`` where that is at least as
        large in every dimension (split counters stay zero between kernels, so views share them)."""
        if self.scratch is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        held = self.scratch.get(name)
        if held is None or any(h < n for h, n in zip(held.shape, shape, strict=True)):
            # (grown to the larger of both in every dimension: fast launches pick more splits for
            # fewer tokens)
            grown = shape if held is None else tuple(map(max, held.shape, shape))
            held = self.scratch[name] = torch.zeros(grown, dtype=dtype, device=device)
        return held[tuple(slice(0, n) for n in shape)]


class TritonAttentionBackend:
    """Paged attention with Triton kernels; same results as ``TorchSDPABackend``.

    num_kv_splits: fix the split-KV count (None: pick from occupancy and the kv length bound).
    max_kv_splits: upper limit for the automatic choice.
    For CUDA graphs, build the plan with ``plan(meta, kv_len_bound=<bucket's max kv length>)`` (or fix
    num_kv_splits) so the captured split count suits every replay; correctness never depends on it.
    pdl: launch the RoPE/K-V write, attention and merge kernels with programmatic dependent launch;
    None: in one-token steps on devices that support it (``device_info.pdl_for_step``).
    invariant: each query row's output is independent of the step around it (decode, verify tree,
    prefill chunk, batch): ``invariant_launch_config``; num_kv_splits is then ignored.
    """

    def __init__(
        self,
        num_kv_splits: int | None = None,
        max_kv_splits: int = 64,
        pdl: bool | None = None,
        invariant: bool = False,
    ) -> None:
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError("num_kv_splits must be >= 1")
        self.num_kv_splits = num_kv_splits
        self.max_kv_splits = max_kv_splits
        self.pdl = pdl
        self.invariant = invariant

    def plan(
        self,
        meta: AttentionMetadata,
        kv_len_bound: int | None = None,
        token_bound: int = 0,
        scratch: dict[Any, torch.Tensor] | None = None,
    ) -> TritonAttentionPlan:
        """``token_bound`` > 0: a causal step's grid is fixed by it and ``meta.batch_size`` (rows past
        the real requests have q_len 0), not by ``meta.max_q_len`` (``MixedGraphs``); ``scratch``:
        split buffers shared with other plans, never run at the same time."""
        if meta.page_size & (meta.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {meta.page_size}")
        if token_bound and meta.tree_mask is not None:
            raise ValueError("a token-bound grid serves causal steps only")
        tree = meta.tree_mask
        tree_u8 = None
        if tree is not None:
            # A bool tensor reinterpreted byte for byte: no copy, so in-place refills stay visible.
            tree_u8 = tree.view(torch.uint8) if tree.dtype == torch.bool else tree
        return TritonAttentionPlan(
            meta=meta,
            tree_mask_u8=tree_u8,
            kv_len_bound=max(meta.max_kv_len, kv_len_bound or 0),
            num_splits=self.num_kv_splits,
            max_splits=self.max_kv_splits,
            num_sms=num_sms(meta.kv_lens.device),
            invariant=self.invariant,
            token_bound=token_bound,
            scratch=scratch,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: TritonAttentionPlan,
        scale: float,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        meta = plan.meta
        tokens, num_q_heads, head_dim = q.shape
        _, _, page_size, num_kv_heads, cache_dim = layer_cache.shape
        if cache_dim != head_dim or num_q_heads % num_kv_heads:
            raise ValueError(f"bad head layout: q {tuple(q.shape)} vs cache {tuple(layer_cache.shape)}")
        if head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
        if page_size != meta.page_size:
            raise ValueError(f"cache page size {page_size} != metadata page size {meta.page_size}")
        k_cache, v_cache = layer_cache[0], layer_cache[1]
        if k_cache.stride(-1) != 1:
            raise ValueError("layer_cache must be contiguous in head_dim")
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        if rope is not None and any(t.stride(-1) != 1 or t.dtype != torch.float32 for t in rope):
            raise ValueError("rope tables must be fp32 with unit stride along d/2")
        out = torch.empty((tokens, num_q_heads, head_dim), dtype=layer_cache.dtype, device=q.device)
        if tokens == 0:
            return out

        cos, sin = rope if rope is not None else (q, q)  # unused pointers without RoPE
        pdl = pdl_for_step(q.device, tokens) if self.pdl is None else self.pdl
        _rope_store_kv_kernel[(tokens,)](
            q, k, v, k_cache, v_cache, meta.slot_mapping, cos, sin, num_q_heads, num_kv_heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_HQ=_next_pow2(num_q_heads),
            BLOCK_H=_next_pow2(num_kv_heads), ROPE=rope is not None, PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip

        cfg, part_o, part_lse, counters = plan.launch(num_q_heads, num_kv_heads, head_dim, q.device)
        split = part_o is not None
        # Unused pointer arguments still need a tensor; their kernels never touch them.
        part_o_arg = part_o if split else out
        part_lse_arg = part_lse if split else out
        tree = plan.tree_mask_u8
        tree_arg = tree if tree is not None else meta.q_lens
        tree_strides = tree.stride() if tree is not None else (0, 0, 0)
        po_strides = part_o.stride()[:3] if part_o is not None else (0, 0, 0)
        pl_strides = part_lse.stride()[:2] if part_lse is not None else (0, 0)
        varlen = plan.token_bound > 0
        grid = (cfg.num_q_blocks, num_kv_heads if varlen else meta.batch_size * num_kv_heads, cfg.num_splits)
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, part_o_arg, part_lse_arg, counters if counters is not None else meta.q_lens,
            meta.q_start, meta.q_lens, meta.kv_lens, meta.page_table, tree_arg,
            scale * _LOG2E, num_kv_heads, cfg.num_splits, meta.batch_size,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            out.stride(0), out.stride(1),
            meta.page_table.stride(0),
            tree_strides[0], tree_strides[1], tree_strides[2],
            po_strides[0], po_strides[1], po_strides[2],
            pl_strides[0], pl_strides[1],
            GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            PAGE_SIZE=page_size, MIN_TILES=cfg.min_tiles_per_split, SPLIT_OUTPUT=split,
            MERGE_IN_KERNEL=cfg.merge_in_kernel, HAS_TREE=tree is not None,
            IEEE_DOT=layer_cache.dtype == torch.float32, PDL=pdl, INVARIANT=plan.invariant,
            SPLIT_TILES=cfg.split_tiles, TREE_POW2=_next_pow2(tree.shape[-1]) if tree is not None else 1,
            VARLEN=varlen,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
        )  # fmt: skip
        if split and not cfg.merge_in_kernel:
            _merge_splits_kernel[(tokens, num_q_heads)](
                part_o, part_lse, out,
                po_strides[0], po_strides[1], po_strides[2], pl_strides[0], pl_strides[1],
                out.stride(0), out.stride(1), cfg.num_splits,
                SPLITS_POW2=_next_pow2(cfg.num_splits), HEAD_DIM=head_dim, PDL=pdl,
                num_warps=1 if head_dim <= 64 else 2, launch_pdl=pdl,
            )  # fmt: skip
        return out


__all__ = ["LaunchConfig", "TritonAttentionBackend", "TritonAttentionPlan", "choose_launch_config"]
