"""The torch SDPA attention backend (CPU / reference) over the paged KV cache.

The metadata contract (what a step's ``AttentionMetadata`` means, how masking works) lives in
``attention.metadata``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ngrammar.attention.metadata import AttentionMetadata
from ngrammar.kernels import cpu as cpu_kernels


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
    kv_slots: torch.Tensor  # [B, Lk] int64: the cache slot of each kv index (padding -> slot 0)


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


def kv_slot_indices(meta: AttentionMetadata) -> torch.Tensor:
    """[B, Lk] flat cache slot of every kv index of every request."""
    kv_idx = torch.arange(meta.max_kv_len, device=meta.kv_lens.device)
    page_col = (kv_idx // meta.page_size).clamp(max=meta.page_table.shape[1] - 1)
    pages = meta.page_table[:, page_col]  # [B, Lk]
    return pages * meta.page_size + (kv_idx % meta.page_size)[None, :]


@dataclass(frozen=True)
class RowPlan:
    """A step with host metadata (the CPU): every row attends alone over its visible keys in
    sequence order, RoPE and the K/V write in the same call (``kernels.cpu.rope_paged_attention``),
    so its output does not depend on the rows, requests or tree nodes beside it."""

    meta: AttentionMetadata
    row_req: torch.Tensor  # [T] int64: each packed row's request
    row_idx: torch.Tensor  # [T] int64: its index in the request's new block


def row_plan(meta: AttentionMetadata) -> RowPlan:
    b = torch.repeat_interleave(torch.arange(meta.batch_size), meta.q_lens)
    return RowPlan(meta, b, torch.arange(int(meta.slot_mapping.shape[0])) - meta.q_start[b])


def sdpa_plan(meta: AttentionMetadata) -> SDPAPlan:
    b = torch.repeat_interleave(torch.arange(meta.batch_size, device=meta.q_lens.device), meta.q_lens)
    within = torch.arange(int(meta.slot_mapping.shape[0]), device=b.device) - meta.q_start[b]
    mask = build_attention_mask(meta)[:, None, None]
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return SDPAPlan(meta, bias, b * meta.max_q_len + within, kv_slot_indices(meta))


class TorchSDPABackend:
    """Paged attention in torch. A step with host metadata (the CPU) runs the row-invariant kernel
    (``RowPlan``); device metadata gathers each request's K/V into a padded batch and runs one
    masked matmul-softmax-matmul per layer (the reference the GPU kernels are checked against).
    """

    def plan(self, meta: AttentionMetadata) -> RowPlan | SDPAPlan:
        return row_plan(meta) if meta.q_lens.device.type == "cpu" else sdpa_plan(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: RowPlan | SDPAPlan,
        scale: float,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        m = plan.meta
        if isinstance(plan, RowPlan):
            return cpu_kernels.rope_paged_attention(
                q,
                k,
                v,
                rope,
                m.slot_mapping,
                layer_cache,
                plan.row_req,
                plan.row_idx,
                m.page_table,
                m.kv_lens,
                m.q_lens,
                m.tree_mask,
                scale,
            )
        if rope is not None:
            q, k = rotate_half(q, *rope), rotate_half(k, *rope)
        write_kv(layer_cache, m.slot_mapping, k, v)
        _, pages, page_size, hkv, d = layer_cache.shape
        kv = layer_cache.view(2, pages * page_size, hkv, d)[:, plan.kv_slots]  # [2, B, Lk, Hkv, d]
        keys = kv[0].permute(0, 2, 3, 1)  # [B, Hkv, d, Lk]
        values = kv[1].transpose(1, 2)  # [B, Hkv, Lk, d]
        bsz, qm, hq = m.batch_size, m.max_q_len, q.shape[1]
        qp = q.new_zeros(bsz * qm, hq, d)
        qp[plan.q_rows] = q
        out = _attend(qp.view(bsz, qm, hq, d), keys, values, plan.bias, scale)
        return out.reshape(bsz * qm, hq, d)[plan.q_rows]


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
