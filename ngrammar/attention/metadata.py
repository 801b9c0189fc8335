"""The attention contract: per-step metadata and the backend protocol every backend implements.

One step batches B requests; request b brings ``q_lens[b]`` new query tokens (packed request-major
into T = sum(q_lens) rows) whose K/V are written at ``slot_mapping`` before attending. After the
write, request b has ``kv_lens[b]`` cached tokens, laid out in its page table in sequence order; its
queries are the last ``q_lens[b]`` of them.

Masking: query i of request b sees every kv index < kv_lens[b] - q_lens[b] (the committed prefix)
and, inside its own block of q_lens[b] new tokens, column j iff ``tree_mask[b, i, j]``. When
``tree_mask`` is None the block is causal (prefill and plain decode). Tree verify passes the draft
tree's ancestor-or-self mask there.

A backend (``attention.sdpa``: torch SDPA; ``attention.triton``: Triton on CUDA) implements ``plan``
once per step and ``forward`` once per layer. ``forward`` also applies the rotary embedding to q and
k when given its tables, so a backend can fuse the rotation into its K/V write (one kernel instead
of two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step inputs of attention; tensors live on the model's device."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (page * page_size + offset) of each new token
    page_table: torch.Tensor  # [B, max_pages] int64: pages of each request in order, padded with 0
    kv_lens: torch.Tensor  # [B] int64: cached length after this step's writes
    q_lens: torch.Tensor  # [B] int64: new tokens per request
    q_start: torch.Tensor  # [B + 1] int64: exclusive prefix sum of q_lens
    max_q_len: int  # host copies of the maxima, so no backend reads a device tensor back
    max_kv_len: int
    page_size: int
    tree_mask: torch.Tensor | None = None  # [B, max_q_len, max_q_len] bool, or None for causal

    @property
    def batch_size(self) -> int:
        return int(self.q_lens.shape[0])


class AttentionBackend(Protocol):
    def plan(self, meta: AttentionMetadata) -> Any:
        """Precompute what every layer of this step shares (indices, masks)."""

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, d]
        k: torch.Tensor,  # [T, Hkv, d]
        v: torch.Tensor,  # [T, Hkv, d]
        layer_cache: torch.Tensor,  # [2, pages, page_size, Hkv, d]
        plan: Any,
        scale: float,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # cos, sin [T, 1, d/2] fp32
    ) -> torch.Tensor:  # [T, Hq, d]
        """Rotate q and k by ``rope`` if given (may rotate q in place: it is a fresh projection),
        write k/v at the plan's slots, then attend."""


def shift_rows(
    offsets: torch.Tensor,
    positions: torch.Tensor,
    kv_lens: torch.Tensor,
    slots: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
) -> None:
    """A one-token-per-row step whose rows sit ``offsets`` [B] further than the host knew (a plain
    step chained out of a verify step, launched before its accepted lengths are read back): the
    first B positions and kv lengths grow by them and the slots follow from the page table
    [>= B, pages], in place, on the device; no host read."""
    b = offsets.shape[0]
    positions[:b] += offsets
    kv_lens[:b] += offsets
    pos = positions[:b]
    page = page_table[:b].gather(1, torch.div(pos, page_size, rounding_mode="floor")[:, None])[:, 0]
    slots[:b] = page * page_size + pos % page_size
