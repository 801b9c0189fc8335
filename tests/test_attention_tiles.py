"""Long causal steps on a CPU run in query tiles (fused SDPA over the kv each tile can see); the
result equals one masked pass over everything, for a lone request and for a padded batch."""

from __future__ import annotations

import dataclasses

import torch

from ngrammar.attention.metadata import AttentionMetadata
from ngrammar.attention.sdpa import TorchSDPABackend, causal_tiles


def _meta(kv_lens: list[int], q_lens: list[int], ps: int = 8) -> AttentionMetadata:
    pages_each = [-(-n // ps) for n in kv_lens]
    first = [sum(pages_each[:b]) + 1 for b in range(len(kv_lens))]  # consecutive pages, from 1
    tables = [list(range(f, f + p)) for f, p in zip(first, pages_each)]
    width = max(pages_each)
    slots = [tables[b][i // ps] * ps + i % ps for b, n in enumerate(kv_lens) for i in range(n - q_lens[b], n)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        page_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        kv_lens=torch.tensor(kv_lens),
        q_lens=torch.tensor(q_lens),
        q_start=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]),
        max_q_len=max(q_lens),
        max_kv_len=max(kv_lens),
        page_size=ps,
    )


def _run(meta: AttentionMetadata, tiled: bool) -> torch.Tensor:
    torch.manual_seed(0)
    t = int(meta.slot_mapping.shape[0])
    q, k, v = torch.randn(t, 6, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16)
    cache = torch.randn(2, 300, meta.page_size, 2, 16)
    backend = TorchSDPABackend()
    plan = backend.plan(meta)
    if not tiled:
        plan = dataclasses.replace(plan, causal_prefix=None)  # one masked pass
    return backend.forward(q, k, v, cache, plan, 0.25)


def test_tiles_skip_the_masked_triangle_and_cover_every_row() -> None:
    tiles = causal_tiles(max_q_len=600, max_kv_len=1000, prefix=400)
    assert tiles[0] == (0, 256, 656) and tiles[-1] == (512, 600, 1000)
    assert [t[0] for t in tiles[1:]] == [t[1] for t in tiles[:-1]]
    assert causal_tiles(max_q_len=256, max_kv_len=1000, prefix=744) == []  # one tile: one pass


def test_a_long_chunk_after_a_prefix_matches_one_pass() -> None:
    meta = _meta([1000], [600])
    assert TorchSDPABackend().plan(meta).causal_prefix == 400
    torch.testing.assert_close(_run(meta, True), _run(meta, False), rtol=1e-5, atol=1e-5)


def test_a_padded_batch_with_different_prefixes_matches_one_pass() -> None:
    meta = _meta([700, 330], [500, 300])
    torch.testing.assert_close(_run(meta, True), _run(meta, False), rtol=1e-5, atol=1e-5)
