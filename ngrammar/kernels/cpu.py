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
