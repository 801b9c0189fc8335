"""Row-invariant CPU kernels (the C++ extension ``ngrammar._cpu_kernels``, ngrammar/csrc): every
output is one reduction in a fixed order, so a row's numbers do not depend on the rows computed
with it. Built by ``make setup``; loaded on first use, so a GPU run never needs it."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch


@functools.cache
def _ext() -> ModuleType:
    try:
        return importlib.import_module("ngrammar._cpu_kernels")
    except ImportError as e:
        raise ImportError(
            "ngrammar's CPU kernels are not built: run `make setup` (or `python ngrammar/csrc/build.py`)"
        ) from e


def built() -> bool:
    """Whether the extension is built here (``make setup``; a GPU image need not build it)."""
    try:
        _ext()
    except ImportError:
        return False
    return True


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ weight [N, K].T (row-major) -> [M, N]: each output a 16-lane dot over K."""
    return _ext().linear(x, weight)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, d]
    cache: torch.Tensor,  # [2, pages, page_size, Hkv, d] in q's dtype, this step's K/V written
    row_req: torch.Tensor,  # [T] int64: each row's request
    row_idx: torch.Tensor,  # [T] int64: each row's index in its request's new block
    page_table: torch.Tensor,  # [B, max_pages] int64
    kv_lens: torch.Tensor,  # [B] int64
    q_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor | None,  # [B, Qm, Qm] bool, None: causal
    scale: float,
) -> torch.Tensor:  # [T, Hq, d]
    """Each (row, head) attends over its visible keys in sequence order (the committed prefix,
    then its block's allowed columns): a tree node's row reduces exactly as the decode row of the
    same token would. Sums in float32, rounds the output to q's dtype."""
    mask = torch.empty(0, dtype=torch.bool) if tree_mask is None else tree_mask
    return _ext().paged_attention(q, cache, row_req, row_idx, page_table, kv_lens, q_lens, mask, scale)


Q4_1, Q8_0 = 0, 1  # block_linear's weight formats (records: ngrammar/csrc/quant_kernels.cpp)


def block_linear(x: torch.Tensor, packed: torch.Tensor, fmt: int, path: int = -1) -> torch.Tensor:
    """x [M, K] float32 against packed weight blocks [G, K / 32, record] -> [M, 16 G] float32.

    The activations are quantized per row and block of 32 to int8 (a step and the block's sum);
    each output sums its blocks' integer dots times the steps in block order. ``path``: -1 the
    best this CPU supports, else 0 scalar, 1 AVX2, 2 AVX-512 VNNI (bitwise the same numbers)."""
    return _ext().block_linear(x, packed, fmt, path)


def block_linear_paths() -> list[int]:
    """The ISA paths of ``block_linear`` this CPU runs, best last."""
    return list(_ext().block_linear_paths())


def rmsnorm_block_linear(
    x: torch.Tensor,  # [M, K] float32
    residual: torch.Tensor | None,  # [M, K] float32
    norm_weight: torch.Tensor,  # [K] float32
    eps: float,
    packed: torch.Tensor,
    fmt: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(block_linear(norm_weight * rms_norm(x + residual)), x + residual or None) in one call; the
    mean of squares over K sums 16 lanes, then the lanes in order."""
    res = torch.empty(0) if residual is None else residual
    out, summed = _ext().rmsnorm_block_linear(x, res, norm_weight, eps, packed, fmt)
    return out, (summed if residual is not None else None)


def silu_mul_block_linear(x: torch.Tensor, packed: torch.Tensor, fmt: int) -> torch.Tensor:
    """x [M, 2K] float32 (gate | up) -> block_linear(silu(gate) * up) in one call."""
    return _ext().silu_mul_block_linear(x, packed, fmt)


def rope_paged_attention(
    q: torch.Tensor,  # [T, Hq, d]
    k: torch.Tensor,  # [T, Hkv, d]
    v: torch.Tensor,  # [T, Hkv, d]
    rope: tuple[torch.Tensor, torch.Tensor] | None,  # cos, sin [T, 1, d/2] float32
    slots: torch.Tensor,  # [T] int64: each row's flat cache slot
    cache: torch.Tensor,
    row_req: torch.Tensor,
    row_idx: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:  # [T, Hq, d]
    """``paged_attention`` after rotating q and k (``attention.sdpa.rotate_half``'s numbers) and
    writing the step's K/V into the cache, in one call (q, k, v may be row-strided views)."""
    cos, sin = rope if rope is not None else (torch.empty(0), torch.empty(0))
    mask = torch.empty(0, dtype=torch.bool) if tree_mask is None else tree_mask
    return _ext().rope_paged_attention(
        q, k, v, cos, sin, slots, cache, row_req, row_idx, page_table, kv_lens, q_lens, mask, scale
    )
