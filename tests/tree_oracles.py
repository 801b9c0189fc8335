"""Test oracles for draft trees: what production derives with fused ops, written the plain way."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ngrammar.speculative.tree import derive_tree_links, mask_from_parents


def links_from_parents(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """(next_token, next_sibling) lists of one tree given by parent indices (parent < child)."""
    table = np.asarray(parents, dtype=np.int64).reshape(1, -1).copy()
    table[0, 0] = -1
    next_token, next_sibling = derive_tree_links(mask_from_parents(table), 1, table.shape[1])
    return next_token[0].tolist(), next_sibling[0].tolist()
