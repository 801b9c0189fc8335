"""The torch SDPA backend's paged attention: a lone request with consecutive pages reads its K/V as a
slice of the pool (no gather), with the same result as the gather."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ngrammar.attention.metadata import AttentionMetadata
from ngrammar.attention.sdpa import TorchSDPABackend, contiguous_first_slot, kv_slot_indices


def _meta(page_tables: list[list[int]], kv_lens: list[int], q_len: int, tree: bool) -> AttentionMetadata:
    ps = 4
    slots = [
        pages[i // ps] * ps + i % ps for pages, n in zip(page_tables, kv_lens) for i in range(n - q_len, n)
    ]
    width = max(len(p) for p in page_tables)
    table = torch.tensor([p + [0] * (width - len(p)) for p in page_tables])
    mask = None
    if tree:  # node i sees the root and itself (a star)
        mask = torch.eye(q_len, dtype=torch.bool).expand(len(kv_lens), q_len, q_len).clone()
        mask[:, :, 0] = True
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        page_table=table,
        kv_lens=torch.tensor(kv_lens),
        q_lens=torch.full((len(kv_lens),), q_len),
        q_start=torch.arange(len(kv_lens) + 1) * q_len,
        max_q_len=q_len,
        max_kv_len=max(kv_lens),
        page_size=ps,
        tree_mask=mask,
    )


@pytest.mark.parametrize("q_len,tree", [(1, False), (5, False), (4, True)])
def test_consecutive_pages_read_a_slice_with_the_gathers_result(q_len: int, tree: bool) -> None:
    torch.manual_seed(q_len)
    backend = TorchSDPABackend()
    meta = _meta([[3, 4, 5, 6]], [14], q_len, tree)
    plan = backend.plan(meta)
    assert plan.first_slot == 12  # page 3, offset 0
    cache = torch.randn(2, 8, 4, 2, 8)  # [k/v, pages, page size, kv heads, d]
    q, k, v = torch.randn(q_len, 4, 8), torch.randn(q_len, 2, 8), torch.randn(q_len, 2, 8)
    sliced = backend.forward(q.clone(), k, v, cache.clone(), plan, 0.35)
    gathered = backend.forward(
        q.clone(),
        k,
        v,
        cache.clone(),
        dataclasses.replace(plan, first_slot=None, kv_slots=kv_slot_indices(meta)),
        0.35,
    )
    torch.testing.assert_close(sliced, gathered, rtol=1e-6, atol=1e-6)


def test_only_a_lone_request_on_consecutive_pages_gets_a_slice() -> None:
    assert contiguous_first_slot(_meta([[3, 4, 6]], [10], 1, False)) is None  # a gap
    assert contiguous_first_slot(_meta([[3, 4], [5, 6]], [8, 8], 1, False)) is None  # two requests
    assert contiguous_first_slot(_meta([[7, 8, 1]], [8], 1, False)) == 28  # the unused third page is ignored
