"""The torch backend's paged attention on a CPU: the row kernel (every row alone over its visible
keys, in sequence order) against the masked matmul-softmax-matmul reference, for causal chunks after a
prefix, tree masks, padded batches of unequal requests and a mixed decode + prefill step."""

from __future__ import annotations

import pytest
import torch

from ngrammar.attention.metadata import AttentionMetadata
from ngrammar.attention.sdpa import RowPlan, TorchSDPABackend, sdpa_plan

PS = 4


def meta_for(kv_lens: list[int], q_lens: list[int], tree: bool = False, seed: int = 0) -> AttentionMetadata:
    """Requests on scattered pages (a shuffled pool), each with its new block at the end; ``tree``:
    a random ancestor-closed mask per request (node i's parent is a random earlier node)."""
    g = torch.Generator().manual_seed(seed)
    pages_each = [-(-n // PS) for n in kv_lens]
    pool = (torch.randperm(sum(pages_each) + 3, generator=g) + 1).tolist()
    tables, at = [], 0
    for p in pages_each:
        tables.append(pool[at : at + p])
        at += p
    width = max(pages_each)
    slots = [tables[b][i // PS] * PS + i % PS for b, n in enumerate(kv_lens) for i in range(n - q_lens[b], n)]
    qm = max(q_lens)
    mask = None
    if tree:
        mask = torch.zeros(len(kv_lens), qm, qm, dtype=torch.bool)
        for b, q in enumerate(q_lens):
            for i in range(q):
                mask[b, i, i] = True
                if i:
                    parent = int(torch.randint(0, i, (1,), generator=g))
                    mask[b, i] |= mask[b, parent]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        page_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        kv_lens=torch.tensor(kv_lens),
        q_lens=torch.tensor(q_lens),
        q_start=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]),
        max_q_len=qm,
        max_kv_len=max(kv_lens),
        page_size=PS,
        tree_mask=mask,
    )


def run(meta: AttentionMetadata, dtype: torch.dtype, reference: bool, head_dim: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    t = int(meta.slot_mapping.shape[0])
    pages = int(meta.page_table.max()) + 1
    q, k, v = (torch.randn(t, h, head_dim, generator=g).to(dtype) for h in (6, 2, 2))
    cache = torch.randn(2, pages, PS, 2, head_dim, generator=g).to(dtype)
    backend = TorchSDPABackend()
    plan = sdpa_plan(meta) if reference else backend.plan(meta)
    assert isinstance(plan, RowPlan) != reference
    return backend.forward(q, k, v, cache, plan, 0.25).float()


CASES = [
    ([37], [1], False),  # decode
    ([300], [120], False),  # a chunk after a prefix
    ([40, 9, 23], [1, 1, 1], False),  # a padded decode batch
    ([30, 50], [8, 5], True),  # tree verify
    ([40, 70, 12], [1, 30, 1], False),  # a mixed step: decode rows and a prefill chunk
]


@pytest.mark.parametrize("kv_lens,q_lens,tree", CASES)
# head dim 16: the generic loops; 64 (float32): keys 16 at a time, outputs 64 at a time in registers;
# 72 and 80: those with a tail of dims (72: not a whole lane group, so keys one at a time)
@pytest.mark.parametrize(
    "dtype,head_dim",
    [
        (torch.float32, 16),
        (torch.bfloat16, 16),
        (torch.float32, 64),
        (torch.float32, 72),
        (torch.float32, 80),
    ],
)
def test_row_kernel_matches_the_masked_reference(
    kv_lens: list[int], q_lens: list[int], tree: bool, dtype: torch.dtype, head_dim: int
) -> None:
    meta = meta_for(kv_lens, q_lens, tree)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got, want = run(meta, dtype, False, head_dim), run(meta, dtype, True, head_dim)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_lens,q_lens,tree", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_the_row_kernel_equals_rotate_half_then_attention(
    kv_lens: list[int], q_lens: list[int], tree: bool, dtype: torch.dtype
) -> None:
    """The CPU backend rotates q / k and writes the step's K/V inside its one kernel call: the same
    bits (output and cache) as ``rotate_half`` + ``write_kv`` + ``paged_attention``, from q / k / v
    that are row-strided views of one fused projection."""
    from ngrammar.attention.sdpa import rotate_half, row_plan, write_kv
    from ngrammar.kernels import cpu as cpu_kernels

    meta = meta_for(kv_lens, q_lens, tree)
    g = torch.Generator().manual_seed(2)
    t = int(meta.slot_mapping.shape[0])
    qkv = torch.randn(t, (6 + 2 + 2) * 16, generator=g).to(dtype)
    q, k, v = (part.view(t, -1, 16) for part in qkv.split([96, 32, 32], dim=-1))
    angles = torch.rand(t, 1, 8, generator=g) * 50
    rope = (angles.cos(), angles.sin())
    cache = torch.randn(2, int(meta.page_table.max()) + 1, PS, 2, 16, generator=g).to(dtype)
    plan = row_plan(meta)
    fused_cache = cache.clone()
    fused = TorchSDPABackend().forward(q, k, v, fused_cache, plan, 0.25, rope)
    qr, kr = rotate_half(q, *rope), rotate_half(k, *rope)
    write_kv(cache, meta.slot_mapping, kr, v)
    ref = cpu_kernels.paged_attention(
        qr,
        cache,
        plan.row_req,
        plan.row_idx,
        meta.page_table,
        meta.kv_lens,
        meta.q_lens,
        meta.tree_mask,
        0.25,
    )
    assert torch.equal(fused, ref) and torch.equal(fused_cache, cache)
