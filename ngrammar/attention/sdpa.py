"""The torch SDPA attention backend (CPU / reference) over the paged KV cache.

The metadata contract (what a step's ``AttentionMetadata`` means, how masking works) lives in
``attention.metadata``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ngrammar.attention.metadata import AttentionMetadata


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, d] with cos / sin [T, 1, d/2] fp32: (x1, x2) -> (x1 c - x2 s,
    x2 c + x1 s), computed in fp32 and rounded once to x's dtype (as Hugging Face's Llama does)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def write_kv(layer_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter this step's K/V into the paged pool (slots are flat page*page_size+offset)."""
    _, pages, page_size, heads, dim = layer_cache.shape
    flat = layer_cache.view(2, pages * page_size, heads, dim)
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))


@dataclass(frozen=True)
class SDPAPlan:
    meta: AttentionMetadata
    bias: torch.Tensor  # [B, 1, 1, Qm, Lk] float32: 0 where attention is allowed, -inf elsewhere
    q_rows: torch.Tensor  # [T] int64: padded row (b * Qm + i) of each packed query
    # Where each request's K/V is, exactly one of the two set. On a CPU, a single request whose
    # pages are consecutive has its K/V in slots first_slot..first_slot+Lk-1, a slice of the pool;
    # otherwise kv_slots [B, Lk] int64 holds the cache slot of each kv index (padding -> slot 0),
    # gathered once per layer.
    first_slot: int | None
    kv_slots: torch.Tensor | None
    # A causal step on a CPU: max_b(kv_lens[b] - q_lens[b]), the longest committed prefix, from
    # which ``causal_tiles`` cuts its query tiles; None (tree masks, device metadata): one pass.
    causal_prefix: int | None = None


def build_attention_mask(meta: AttentionMetadata) -> torch.Tensor:
    """[B, Qm, Lk] bool mask implementing the contract above (padding rows see kv 0 only)."""
    device = meta.kv_lens.device
    qm, lk = meta.max_q_len, meta.max_kv_len
    q_idx = torch.arange(qm, device=device)
    kv_idx = torch.arange(lk, device=device)
    prefix = (meta.kv_lens - meta.q_lens)[:, None, None]  # [B,1,1] first kv index of the new block
    rel = kv_idx[None, None, :] - prefix  # [B,1,Lk] position inside the new block (<0: prefix)
    if meta.tree_mask is None:
        in_block = rel <= q_idx[None, :, None]
    else:
        gather_at = rel.clamp(0, qm - 1).expand(-1, qm, -1)
        in_block = torch.gather(meta.tree_mask, 2, gather_at)
    valid_kv = kv_idx[None, None, :] < meta.kv_lens[:, None, None]
    mask = torch.where(rel < 0, True, in_block) & valid_kv
    valid_q = q_idx[None, :, None] < meta.q_lens[:, None, None]
    pad_row = torch.zeros(lk, dtype=torch.bool, device=device)
    pad_row[0] = True
    return torch.where(valid_q, mask, pad_row)


def contiguous_first_slot(meta: AttentionMetadata) -> int | None:
    """The first cache slot of a lone request whose kv indices map to consecutive slots (its pages
    are consecutive), else None. Reads the page table, so only for host (CPU) metadata."""
    if meta.batch_size != 1 or meta.page_table.device.type != "cpu":
        return None
    pages = meta.page_table[0, : -(-meta.max_kv_len // meta.page_size)].tolist()
    if any(b != a + 1 for a, b in zip(pages, pages[1:])):
        return None
    return pages[0] * meta.page_size


def kv_slot_indices(meta: AttentionMetadata) -> torch.Tensor:
    """[B, Lk] flat cache slot of every kv index of every request."""
    kv_idx = torch.arange(meta.max_kv_len, device=meta.kv_lens.device)
    page_col = (kv_idx // meta.page_size).clamp(max=meta.page_table.shape[1] - 1)
    pages = meta.page_table[:, page_col]  # [B, Lk]
    return pages * meta.page_size + (kv_idx % meta.page_size)[None, :]


_TILE_ROWS = 256  # query rows per tile of a long causal step (CPU)


def causal_tiles(max_q_len: int, max_kv_len: int, prefix: int) -> list[tuple[int, int, int]]:
    """(first row, end row, kv end) query tiles of a causal step longer than one tile, else [].

    Row i of request b sees kv < prefix_b + i + 1, so rows < end never need kv past
    max_b(prefix_b) + end: the tiles skip the masked upper triangle, and torch's fused SDPA never
    materializes scores. (One pass over a 2,048 x 8,192 chunk allocated and streamed four 600 MB
    score tensors per layer, which made prefill cost superlinear in the prompt's length.)
    """
    if max_q_len <= _TILE_ROWS:
        return []
    return [
        (i, min(i + _TILE_ROWS, max_q_len), min(max_kv_len, prefix + min(i + _TILE_ROWS, max_q_len)))
        for i in range(0, max_q_len, _TILE_ROWS)
    ]


def causal_prefix(meta: AttentionMetadata) -> int | None:
    """The longest committed prefix of a causal step with host (CPU) metadata, else None."""
    if meta.tree_mask is not None or meta.kv_lens.device.type != "cpu" or meta.max_q_len == 1:
        return None
    return int((meta.kv_lens - meta.q_lens).max())


@dataclass(frozen=True)
class SplitSDPAPlan:
    """A step mixing one-token rows (decode) with longer ones (prefill chunks), attended as two
    groups so the decode rows are not padded to the longest chunk: ``groups`` holds each group's
    packed token rows [T_g] int64 and its own plan. K/V are written once, for all rows."""

    meta: AttentionMetadata
    groups: list[tuple[torch.Tensor, SDPAPlan]]


def _select_requests(
    meta: AttentionMetadata, idx: list[int], q_lens: list[int], kv_lens: list[int]
) -> tuple[AttentionMetadata, torch.Tensor]:
    """The metadata of requests ``idx`` alone (host tensors) and their packed token rows."""
    starts = meta.q_start.tolist()
    rows = torch.tensor([t for b in idx for t in range(starts[b], starts[b] + q_lens[b])], dtype=torch.int64)
    sel = torch.tensor(idx, dtype=torch.int64)
    sub_q = meta.q_lens[sel]
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows],
        page_table=meta.page_table[sel],
        kv_lens=meta.kv_lens[sel],
        q_lens=sub_q,
        q_start=torch.cat([sub_q.new_zeros(1), sub_q.cumsum(0)]),
        max_q_len=max(q_lens[b] for b in idx),
        max_kv_len=max(kv_lens[b] for b in idx),
        page_size=meta.page_size,
    )
    return sub, rows


class TorchSDPABackend:
    """Gathers each request's K/V into a padded batch and runs scaled dot-product attention per layer.

    Simple and exact; the gather costs B * max_kv_len rows per layer, fine on the CPU and as the
    reference the GPU kernel is checked against. Long causal steps on a CPU run in query tiles
    (``causal_tiles``), so prefill costs what attention's own quadratic term costs and no more.
    """

    def plan(self, meta: AttentionMetadata) -> SDPAPlan | SplitSDPAPlan:
        if meta.max_q_len > 1 and meta.tree_mask is None and meta.q_lens.device.type == "cpu":
            q_lens = meta.q_lens.tolist()
            single = [b for b, q in enumerate(q_lens) if q == 1]
            if single and len(single) < len(q_lens):  # a mixed step (host metadata: reading it is free)
                kv_lens = meta.kv_lens.tolist()
                multi = [b for b, q in enumerate(q_lens) if q > 1]
                groups = []
                for idx in (single, multi):
                    sub, rows = _select_requests(meta, idx, q_lens, kv_lens)
                    groups.append((rows, self._plan(sub)))
                return SplitSDPAPlan(meta, groups)
        return self._plan(meta)

    def _plan(self, meta: AttentionMetadata) -> SDPAPlan:
        b = torch.repeat_interleave(torch.arange(meta.batch_size, device=meta.q_lens.device), meta.q_lens)
        within = torch.arange(int(meta.slot_mapping.shape[0]), device=b.device) - meta.q_start[b]
        mask = build_attention_mask(meta)[:, None, None]
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
            ~mask, float("-inf")
        )
        first = contiguous_first_slot(meta)
        return SDPAPlan(
            meta,
            bias,
            b * meta.max_q_len + within,
            first,
            None if first is not None else kv_slot_indices(meta),
            causal_prefix(meta),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: SDPAPlan | SplitSDPAPlan,
        scale: float,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if rope is not None:
            q, k = rotate_half(q, *rope), rotate_half(k, *rope)
        write_kv(layer_cache, plan.meta.slot_mapping, k, v)
        if isinstance(plan, SDPAPlan):
            return self._attend(q, layer_cache, plan, scale)
        out = torch.empty_like(q)
        for rows, sub in plan.groups:
            out[rows] = self._attend(q[rows], layer_cache, sub, scale)
        return out

    @staticmethod
    def _attend(q: torch.Tensor, layer_cache: torch.Tensor, plan: SDPAPlan, scale: float) -> torch.Tensor:
        """Attention of the queries ``q`` [T, Hq, d] over the pool (their K/V already written)."""
        meta = plan.meta
        _, pages, page_size, hkv, d = layer_cache.shape
        flat = layer_cache.view(2, pages * page_size, hkv, d)
        if plan.kv_slots is None:  # a view, no copy: [2, 1, Lk, Hkv, d]
            assert plan.first_slot is not None
            kv = flat[:, plan.first_slot : plan.first_slot + meta.max_kv_len].unsqueeze(1)
        else:
            kv = flat[:, plan.kv_slots]  # one gather for K and V: [2, B, Lk, Hkv, d]
        keys = kv[0].permute(0, 2, 3, 1)  # [B, Hkv, d, Lk]
        values = kv[1].transpose(1, 2)  # [B, Hkv, Lk, d]
        bsz, qm, hq = meta.batch_size, meta.max_q_len, q.shape[1]
        if qm == 1:
            qp = q.view(bsz, 1, hq, d)
        else:
            qp = q.new_zeros(bsz * qm, hq, d)
            qp[plan.q_rows] = q
            qp = qp.view(bsz, qm, hq, d)
        tiles = [] if plan.causal_prefix is None else causal_tiles(qm, meta.max_kv_len, plan.causal_prefix)
        if tiles:
            out = _attend_tiles(qp, kv[0].transpose(1, 2), values, plan.bias, scale, tiles)
        else:
            out = _attend(qp, keys, values, plan.bias, scale)
        out = out.reshape(bsz * qm, hq, d)
        return out if qm == 1 else out[plan.q_rows]


def _attend_tiles(
    qp: torch.Tensor,  # [B, Qm, Hq, d]
    keys: torch.Tensor,  # [B, Hkv, Lk, d]
    values: torch.Tensor,  # [B, Hkv, Lk, d]
    bias: torch.Tensor,  # [B, 1, 1, Qm, Lk] float32
    scale: float,
    tiles: list[tuple[int, int, int]],
) -> torch.Tensor:  # [B, Qm, Hq, d]
    """A long causal step in query tiles, each one fused SDPA call over the kv it can see."""
    qh = qp.transpose(1, 2).to(keys.dtype)  # [B, Hq, Qm, d]
    out = qh.new_empty(qh.shape)
    mask = bias[:, 0]  # [B, 1, Qm, Lk]
    for i0, i1, end in tiles:
        out[:, :, i0:i1] = F.scaled_dot_product_attention(
            qh[:, :, i0:i1],
            keys[:, :, :end],
            values[:, :, :end],
            attn_mask=mask[..., i0:i1, :end].to(qh.dtype),
            scale=scale,
            enable_gqa=True,  # query head h reads kv head h // (Hq / Hkv), as below
        )
    return out.transpose(1, 2)


def _attend(
    qp: torch.Tensor,  # [B, R, Hq, d] query rows
    keys: torch.Tensor,  # [B, Hkv, d, L]
    values: torch.Tensor,  # [B, Hkv, L, d]
    bias: torch.Tensor,  # [B, 1, 1, R, L] float32
    scale: float,
) -> torch.Tensor:  # [B, R, Hq, d]
    bsz, rows, hq, d = qp.shape
    hkv = keys.shape[1]
    group = hq // hkv
    # Query heads h = j * group + g share kv head j: fold the group into the query axis so one
    # batched matmul per step serves GQA without repeating K/V (torch's masked SDPA is slow on CPU).
    qg = qp.reshape(bsz, rows, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(bsz, hkv, group * rows, d)
    scores = torch.matmul(qg.to(keys.dtype), keys)  # [B, Hkv, G*R, L]
    scores = scores.float() if scores.dtype != torch.float32 else scores
    scores.mul_(scale)
    scores = scores.view(bsz, hkv, group, rows, -1).add_(bias)
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(bsz, hkv, group * rows, -1)
    out = torch.matmul(probs, values).view(bsz, hkv, group, rows, d).permute(0, 3, 1, 2, 4)
    return out.reshape(bsz, rows, hq, d)
