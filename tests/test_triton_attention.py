"""Checks of the Triton paged-attention backend against TorchSDPABackend (the exact reference).

On a CUDA machine (bf16 and fp16, realistic shapes):
    pytest -m gpu tests/test_triton_attention.py
Without a GPU, the same checks run on small shapes (fp32 and fp16) under Triton's CPU interpreter:
    NGRAMMAR_TRITON_INTERPRET=1 pytest -m gpu tests/test_triton_attention.py
(``triton_env`` sets that up; anywhere else the module is skipped).
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, INTERPRET

from ngrammar.attention.metadata import AttentionMetadata
from ngrammar.attention.sdpa import TorchSDPABackend
from ngrammar.attention.triton import TritonAttentionBackend, choose_launch_config

pytestmark = pytest.mark.gpu

# The interpreter computes in numpy, which has no bf16; on the GPU fp32 caches are not a target.
DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]
# Max abs error allowed, relative to the reference output's largest magnitude.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (Hq, Hkv, d): the small model, a plain MHA layout, and the 8B-shaped layout.
HEADS = [(9, 3, 64), (2, 2, 64)] if INTERPRET else [(9, 3, 64), (4, 4, 64), (32, 8, 128)]


def random_tree_mask(q_len: int, max_q: int, gen: torch.Generator) -> torch.Tensor:
    """[max_q, max_q] ancestor-or-self mask of a random tree whose node 0 is the root and whose
    nodes are numbered so every parent precedes its children (rows/cols >= q_len stay False)."""
    mask = torch.zeros(max_q, max_q, dtype=torch.bool)
    for i in range(q_len):
        if i > 0:
            parent = int(torch.randint(0, i, (1,), generator=gen))
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def make_case(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    page_size: int,
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    tree: bool = False,
    seed: int = 0,
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random metadata over a shuffled page pool plus q/k/v and a pre-filled cache."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    pages_needed = [-(-kv // page_size) for kv in kv_lens]
    num_pages = sum(pages_needed) + 3  # spare pages, so unused garbage sits in the pool too
    order = torch.randperm(num_pages, generator=gen)
    page_table = torch.zeros(len(q_lens), max(pages_needed), dtype=torch.int64)
    slots = []
    used = 0
    for b, (ql, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        pages = order[used : used + pages_needed[b]]
        used += pages_needed[b]
        page_table[b, : len(pages)] = pages
        pos = torch.arange(kv - ql, kv)
        slots.append(pages[pos // page_size] * page_size + pos % page_size)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    q_start = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    q_start[1:] = torch.cumsum(q_lens_t, 0)
    max_q = max(q_lens)
    tree_mask = None
    if tree:
        tree_mask = torch.stack([random_tree_mask(ql, max_q, gen) for ql in q_lens]).to(DEVICE)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(DEVICE),
        page_table=page_table.to(DEVICE),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int64, device=DEVICE),
        q_lens=q_lens_t.to(DEVICE),
        q_start=q_start.to(DEVICE),
        max_q_len=max_q,
        max_kv_len=max(kv_lens),
        page_size=page_size,
        tree_mask=tree_mask,
    )
    tokens = sum(q_lens)
    q = torch.randn(tokens, hq, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(tokens, hkv, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(tokens, hkv, d, generator=gen).to(DEVICE, dtype)
    cache = torch.randn(2, num_pages, page_size, hkv, d, generator=gen).to(DEVICE, dtype)
    return meta, q, k, v, cache


def check_against_reference(
    meta: AttentionMetadata,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    backend: TritonAttentionBackend | None = None,
) -> None:
    """Runs both backends on copies of the cache; the reference runs in fp32 on exactly the same
    (already rounded) inputs, so only the kernel's own rounding shows in the error."""
    scale = q.shape[-1] ** -0.5
    ref_cache = cache.float()
    ref_backend = TorchSDPABackend()
    expected = ref_backend.forward(q.float(), k.float(), v.float(), ref_cache, ref_backend.plan(meta), scale)
    backend = backend or TritonAttentionBackend()
    tri_cache = cache.clone()
    got = backend.forward(q, k, v, tri_cache, backend.plan(meta), scale)
    assert got.shape == expected.shape and got.dtype == cache.dtype
    torch.testing.assert_close(tri_cache.float(), ref_cache, rtol=0, atol=0)
    err = (got.float() - expected).abs().max().item()
    bound = TOLERANCE[cache.dtype] * max(expected.abs().max().item(), 1e-3)
    assert err <= bound, f"max abs err {err:.3e} > {bound:.3e}"


if INTERPRET:
    # The last case puts the causal diagonal right at a tile edge (prefix 62, 63, 64 with 64-wide tiles).
    PREFILL_CASES = [([5, 17, 1], [5, 17, 1]), ([7, 20, 3], [40, 20, 70]), ([2, 2, 2, 2], [63, 64, 65, 66])]
    # Several query blocks per request, the first one full.
    PREFILL_CASES.append(([70, 5], [70, 90]))
    DECODE_KV = [1, 17, 70, 130]
    TREE_PREFIX = [0, 21, 50]
else:
    PREFILL_CASES = [
        ([5, 17, 1], [5, 17, 1]),
        ([100, 513, 1, 37], [100, 513, 1, 37]),
        ([64, 300, 7, 129], [64 + 700, 300, 7 + 1, 129 + 2000]),  # chunked prefill over a prefix
        ([2, 2, 2, 2, 70], [63, 64, 65, 66, 70 + 63]),  # causal diagonal at a tile edge
    ]
    DECODE_KV = [1, 17, 70, 130, 1000, 4097, 8192]
    TREE_PREFIX = [0, 21, 500, 3000]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_prefill_matches_reference(case: tuple[list[int], list[int]], heads: tuple[int, int, int], dtype):
    q_lens, kv_lens = case
    check_against_reference(*make_case(q_lens, kv_lens, page_size=16, heads=heads, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
# 16 splits: far more than the kv lengths fill, as in a CUDA graph captured for the longest context.
@pytest.mark.parametrize("splits", [None, 1, 3, 16], ids=lambda s: f"splits={s}")
def test_decode_matches_reference(heads: tuple[int, int, int], dtype, splits: int | None):
    kv_lens = DECODE_KV
    case = make_case([1] * len(kv_lens), kv_lens, page_size=16, heads=heads, dtype=dtype, seed=1)
    check_against_reference(*case, backend=TritonAttentionBackend(num_kv_splits=splits))


@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_decode_single_long_request(heads: tuple[int, int, int]):
    kv = 300 if INTERPRET else 8000
    dtype = DTYPES[-1]
    check_against_reference(*make_case([1], [kv], page_size=16, heads=heads, dtype=dtype, seed=2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("depth", [1, 4, 8, 16] if INTERPRET else [1, 4, 8, 16, 32], ids=lambda d: f"D={d}")
def test_tree_verify_matches_reference(heads: tuple[int, int, int], dtype, depth: int):
    # Ragged: the last request drafts a smaller tree than the step's max_q_len.
    q_lens = [depth, depth, max(1, depth // 2)]
    kv_lens = [p + ql for p, ql in zip(TREE_PREFIX, q_lens, strict=False)]
    case = make_case(q_lens, kv_lens, page_size=16, heads=heads, dtype=dtype, tree=True, seed=depth)
    check_against_reference(*case)
    if not INTERPRET:  # the interpreter's automatic choice already splits (it assumes 4 SMs)
        check_against_reference(*case, backend=TritonAttentionBackend(num_kv_splits=2))


@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_arbitrary_block_mask(heads: tuple[int, int, int]):
    """The contract allows any tree_mask, not only ancestor masks: columns of the new block that
    follow a row, and a root column hidden from some rows. Diagonals stay set so no row is empty."""
    # Request 2's prefix is 63, so its first 64-wide tile ends on the block's first column.
    meta, q, k, v, cache = make_case(
        [9, 16, 5], [9, 40, 68], page_size=16, heads=heads, dtype=DTYPES[0], seed=3
    )
    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(3, 16, 16, generator=gen) < 0.4
    mask |= torch.eye(16, dtype=torch.bool)
    meta = AttentionMetadata(**{**meta.__dict__, "tree_mask": mask.to(DEVICE)})
    check_against_reference(meta, q, k, v, cache)
    check_against_reference(meta, q, k, v, cache, backend=TritonAttentionBackend(num_kv_splits=3))


@pytest.mark.parametrize("page_size", [8, 32, 64])
def test_other_page_sizes(page_size: int):
    heads, dtype = HEADS[0], DTYPES[-1]
    check_against_reference(
        *make_case([7, 1, 12], [40, 90, 12], page_size=page_size, heads=heads, dtype=dtype)
    )
    tree_case = make_case([6, 3], [30, 3], page_size=page_size, heads=heads, dtype=dtype, tree=True, seed=5)
    check_against_reference(*tree_case)


def test_noncontiguous_q_from_fused_projection():
    # q/k/v as views into one fused projection output: row stride > Hq * d.
    hq, hkv, d = HEADS[0]
    dtype = DTYPES[-1]
    meta, q, k, v, cache = make_case([4, 9], [20, 9], page_size=16, heads=(hq, hkv, d), dtype=dtype, seed=7)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qv, kv_, vv = fused.split([hq * d, hkv * d, hkv * d], dim=1)
    check_against_reference(meta, qv.view(-1, hq, d), kv_.view(-1, hkv, d), vv.view(-1, hkv, d), cache)


def test_launch_config_is_host_only_and_splits_small_batches():
    decode = choose_launch_config(1, 4, 128, 1, 8, kv_len_bound=8192, num_sms=132)
    assert decode.num_q_blocks == 1 and decode.num_splits == 64
    big_batch = choose_launch_config(1, 4, 128, 64, 8, kv_len_bound=8192, num_sms=132)
    assert big_batch.num_splits == 1
    tree = choose_launch_config(32, 3, 64, 2, 3, kv_len_bound=100, num_sms=132)
    assert tree.block_m // 3 * tree.num_q_blocks >= 32
    # Decode steps merge their splits in the kernel; tree verify blocks, however small, keep the merge kernel.
    assert decode.merge_in_kernel and decode.min_tiles_per_split * decode.block_n == 128
    for width in (2, 8, 16):
        verify = choose_launch_config(width, 3, 64, 1, 3, kv_len_bound=8192, num_sms=132)
        assert verify.num_splits > 1 and not verify.merge_in_kernel


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs and sync checks need a GPU")
def test_plan_and_forward_do_not_sync():
    hq, hkv, d = HEADS[-1]
    meta, q, k, v, cache = make_case([3, 5], [100, 5], page_size=16, heads=(hq, hkv, d), dtype=torch.bfloat16)
    backend = TritonAttentionBackend()
    backend.forward(q, k, v, cache.clone(), backend.plan(meta), d**-0.5)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.forward(q, k, v, cache, backend.plan(meta), d**-0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("tree", [False, True], ids=["decode", "verify"])
def test_cuda_graph_replay_with_new_lengths(tree: bool):
    """Capture one step with static metadata buffers, then refill them in place with different kv
    lengths (and a different tree) and replay: the result must track the reference."""
    hq, hkv, d = HEADS[0]
    dtype = torch.bfloat16
    depth = 4 if tree else 1
    scale = d**-0.5
    first = make_case([depth] * 3, [50, 700, 9], page_size=16, heads=(hq, hkv, d), dtype=dtype, tree=tree)
    static_meta, static_q, static_k, static_v, cache = first
    max_pages = 4096 // 16
    page_table = torch.zeros(3, max_pages, dtype=torch.int64, device=DEVICE)
    page_table[:, : static_meta.page_table.shape[1]] = static_meta.page_table
    pool = torch.zeros(2, max_pages * 3 + 8, 16, hkv, d, dtype=dtype, device=DEVICE)
    pool[:, : cache.shape[1]] = cache
    static_meta = AttentionMetadata(
        slot_mapping=static_meta.slot_mapping.clone(),
        page_table=page_table,
        kv_lens=static_meta.kv_lens.clone(),
        q_lens=static_meta.q_lens.clone(),
        q_start=static_meta.q_start.clone(),
        max_q_len=depth,
        max_kv_len=4096,
        page_size=16,
        tree_mask=None if static_meta.tree_mask is None else static_meta.tree_mask.clone(),
    )
    backend = TritonAttentionBackend()
    plan = backend.plan(static_meta, kv_len_bound=4096)
    backend.forward(static_q, static_k, static_v, pool.clone(), plan, scale)  # compile + allocate scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(static_q, static_k, static_v, pool, plan, scale)

    for seed, kv_lens in [(11, [3000, 17, 4096]), (12, [depth, 1500, 260])]:
        meta, q, k, v, cache = make_case(
            [depth] * 3, kv_lens, page_size=16, heads=(hq, hkv, d), dtype=dtype, tree=tree, seed=seed
        )
        pool.zero_()
        pool[:, : cache.shape[1]] = cache
        static_meta.page_table.zero_()
        static_meta.page_table[:, : meta.page_table.shape[1]] = meta.page_table
        for name in ("slot_mapping", "kv_lens", "q_lens", "q_start"):
            getattr(static_meta, name).copy_(getattr(meta, name))
        if tree:
            static_meta.tree_mask.copy_(meta.tree_mask)
        static_q.copy_(q)
        static_k.copy_(k)
        static_v.copy_(v)
        expected_cache = pool.clone()
        ref_meta = AttentionMetadata(
            meta.slot_mapping, static_meta.page_table.clone(), meta.kv_lens, meta.q_lens, meta.q_start,
            meta.max_q_len, meta.max_kv_len, 16, meta.tree_mask,
        )  # fmt: skip
        ref = TorchSDPABackend()
        expected = ref.forward(
            q.float(), k.float(), v.float(), expected_cache.float(), ref.plan(ref_meta), scale
        )
        graph.replay()
        torch.cuda.synchronize()
        err = (static_out.float() - expected).abs().max().item()
        assert err <= 2e-2 * expected.abs().max().item(), f"replay err {err:.3e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("views", [True, False], ids=lambda v: "qkv_views" if v else "separate")
def test_rope_fused_into_the_kv_write(heads: tuple[int, int, int], dtype, views: bool):
    """With rotary tables the kernel rotates q in place and k on its way into the pool: the cache
    and the output equal the torch backend's (which rotates with ``rotate_half``) in the same dtype,
    up to one rounding of an fp32 contraction; v is stored untouched."""
    from ngrammar.model.config import ModelConfig
    from ngrammar.model.llama import RotaryEmbedding

    hq, hkv, d = heads
    meta, q, k, v, cache = make_case([1, 5, 3], [30, 5, 70], page_size=16, heads=heads, dtype=dtype, seed=8)
    config = ModelConfig(
        vocab_size=16,
        hidden_size=hq * d,
        intermediate_size=8,
        num_layers=1,
        num_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        max_position=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    positions = torch.tensor([29, 0, 1, 2, 3, 4, 67, 68, 69], device=DEVICE)
    rope = RotaryEmbedding(config).to(DEVICE).table(positions)
    if views:  # q/k/v as views of one projection row, as the model passes them
        row = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        q, k, v = (
            t.view(-1, h, d) for t, h in zip(row.split([hq * d, hkv * d, hkv * d], dim=1), (hq, hkv, hkv))
        )
    v_before = v.clone()
    scale = d**-0.5
    ref_backend, ref_cache = TorchSDPABackend(), cache.clone()
    want = ref_backend.forward(
        q.clone(), k.clone(), v.clone(), ref_cache, ref_backend.plan(meta), scale, rope
    )
    backend, got_cache = TritonAttentionBackend(), cache.clone()
    got = backend.forward(q, k, v, got_cache, backend.plan(meta), scale, rope)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got_cache.float(), ref_cache.float(), rtol=tol, atol=tol)
    assert (got.float() - want.float()).abs().max().item() <= tol * max(want.float().abs().max().item(), 1.0)
    assert torch.equal(v, v_before)


def test_split_counters_rearm_for_the_next_layer():
    """The last split merges and resets its counter, so every layer of a step (one plan, one set of
    counters) merges again: a second call through the same plan gives the same output."""
    meta, q, k, v, cache = make_case(
        [1, 1, 1], [40, 200, 90], page_size=16, heads=HEADS[0], dtype=DTYPES[-1], seed=9
    )
    backend = TritonAttentionBackend(num_kv_splits=3)
    plan = backend.plan(meta)
    first = backend.forward(q, k, v, cache.clone(), plan, 0.125)
    counters = plan.launch(q.shape[1], cache.shape[-2], q.shape[2], q.device)[3]
    assert counters is not None and int(counters.abs().sum()) == 0
    second = backend.forward(q, k, v, cache.clone(), plan, 0.125)
    assert torch.equal(first, second)
    check_against_reference(meta, q, k, v, cache, backend=backend)


@pytest.mark.parametrize("invariant", [False, True], ids=["fast", "invariant"])
def test_a_token_bound_grid_equals_the_request_grid(invariant: bool):
    """A mixed step (decode rows beside prompt chunks) launched on a grid fixed by a token bound and
    padded with spare requests (q_len 0) and spare tokens, as a CUDA graph of a bigger bucket runs
    it, writes the same K/V and gives bitwise the same rows as the step's own grid."""
    q_lens, kv_lens = [1, 23, 1, 45, 1], [40, 23, 130, 50, 2]
    meta, q, k, v, cache = make_case(q_lens, kv_lens, page_size=16, heads=HEADS[0], dtype=DTYPES[0], seed=3)
    backend = TritonAttentionBackend(invariant=invariant)
    want_cache = cache.clone()
    # Invariant launches: the eager plan (splits for the step's own kv lengths) against a graph's
    # (splits for its kv bucket); fast ones pick splits from occupancy, so both get the same bound.
    want_plan = backend.plan(meta) if invariant else backend.plan(meta, kv_len_bound=1500)
    want = backend.forward(q, k, v, want_cache, want_plan, 0.125)

    tokens, spare_tokens, spare_requests = sum(q_lens), 30, 3
    used = set(meta.page_table.flatten().tolist())
    spare_page = next(p for p in range(cache.shape[1]) if p not in used)
    spare_slots = spare_page * 16 + torch.arange(spare_tokens, device=DEVICE) % 16
    gen = torch.Generator().manual_seed(4)
    pad = [torch.randn(spare_tokens, *x.shape[1:], generator=gen).to(DEVICE, x.dtype) for x in (q, k, v)]
    zeros = torch.zeros(spare_requests, dtype=torch.int64, device=DEVICE)
    padded = AttentionMetadata(
        slot_mapping=torch.cat([meta.slot_mapping, spare_slots]),
        page_table=torch.cat([meta.page_table, meta.page_table[:spare_requests]]),
        kv_lens=torch.cat([meta.kv_lens, zeros]),
        q_lens=torch.cat([meta.q_lens, zeros]),
        q_start=torch.cat([meta.q_start, meta.q_start[-1:].repeat(spare_requests)]),
        max_q_len=tokens + spare_tokens,
        max_kv_len=1500,
        page_size=16,
    )
    got_cache = cache.clone()
    plan = backend.plan(padded, kv_len_bound=1500, token_bound=tokens + spare_tokens)
    qkv = [torch.cat([x, p]) for x, p in zip((q, k, v), pad, strict=True)]
    got = backend.forward(*qkv, got_cache, plan, 0.125)
    assert torch.equal(got[:tokens], want)
    keep = [p for p in range(cache.shape[1]) if p != spare_page]
    assert torch.equal(got_cache[:, keep], want_cache[:, keep])
    with pytest.raises(ValueError, match="causal"):
        tree_meta = make_case([2], [5], page_size=16, heads=HEADS[0], dtype=DTYPES[0], tree=True)[0]
        backend.plan(tree_meta, token_bound=8)
