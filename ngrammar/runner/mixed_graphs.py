"""CUDA graphs for the steps the uniform graphs cannot serve: prefill and mixed steps.

A mixed step (decode rows plus prompt chunks) has variable per-request query lengths; under
continuous arrivals (a server at 256 streams) nearly every step is one. Each is replayed whole from
one graph per (token bucket, kv bucket): the model and its attention, through static buffers.

Attention is the only op whose launch depends on the mix: its grid is fixed by the bucket's token
bound and request bound instead (``TritonAttentionPlan.token_bound``: a program finds its request by
a binary search over ``q_start``), so one graph serves every mix of up to Tb tokens and Sb requests.
Its kv splits are fixed by the kv bucket: a short-context step does not launch the splits a long
context needs (programs past a row's splits exit at once, but they still cost their launch).

Static inputs: one int64 device buffer, mirrored by one pinned host buffer, so a step costs one
host->device copy: ids, positions, slots ([max_tokens] each), kv_lens, q_lens ([max_seqs] each),
q_start ([max_seqs + 1]) and last the step's page tables packed [B, width], which one device copy
puts into the static [max_seqs, max_pages] table.

Padding: tokens T..Tb-1 belong to no request (every spare request has q_len 0 and starts at T), so no
query reads them; their K/V writes land on the *dummy page* (a pool page never handed out), and every
other op is row-wise, so their stale ids and positions never reach a real row. Spare requests' programs
exit before reading a page-table row. Rows past a request's pages in the page table are never read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ngrammar.attention.metadata import AttentionMetadata, shift_rows
from ngrammar.model.llama import LlamaForCausalLM
from ngrammar.runner.cuda_graph import bucket_table, buckets
from ngrammar.runner.transfer import Staging, scatter_table

# Token buckets: fine steps where small prefills land, every 64 tokens above 128.
_SMALL_BUCKETS = (16, 32, 64, 96, 128)
_LARGE_STEP = 64
# kv buckets below the longest context (each doubles the captures; only short ones pay).
_KV_BUCKETS = (2048,)


def token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets of the mixed-step graphs, up to and including ``max_tokens``."""
    return buckets(max_tokens, _SMALL_BUCKETS, _LARGE_STEP)


def kv_buckets(kv_len_bound: int) -> list[int]:
    return [b for b in _KV_BUCKETS if b < kv_len_bound] + [kv_len_bound]


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [Tb, hidden]: the graph's output
    plan: Any  # kept alive with the graph: its launch scratch is baked in


class MixedGraphs:
    """Steps of up to ``max_tokens`` tokens over up to ``max_seqs`` requests, any mix of query lengths,
    with kv lengths up to ``kv_len_bound`` (``forward``), replayed from captured graphs.

    backend: a Triton backend (its plan takes ``kv_len_bound`` and ``token_bound``).
    dummy_page: a pool page no sequence ever owns; padding tokens write only there.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: Any,
        kv_cache: torch.Tensor,
        max_tokens: int,
        max_seqs: int,
        kv_len_bound: int,
        dummy_page: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.page_size = int(kv_cache.shape[3])
        self.buckets = token_buckets(max_tokens)
        self.kv_buckets = kv_buckets(kv_len_bound)
        self.max_tokens = max_tokens
        self.max_seqs = min(max_seqs, max_tokens)
        self.max_pages = -(-kv_len_bound // self.page_size)
        self._bucket_of = bucket_table(self.buckets)
        self._init_buffers(kv_cache.device, dummy_page)
        self._pool = torch.cuda.graph_pool_handle()
        # Split scratch shared by every graph's plan (views of the largest, captured first).
        self._scratch: dict[Any, Any] = {}
        self._entries: dict[tuple[int, int], _Graph] = {}
        self.replays: Counter[tuple[int, int]] = Counter()  # per (token bucket, kv bucket)

    def _init_buffers(self, device: torch.device, dummy_page: int) -> None:
        t, s = self.max_tokens, self.max_seqs
        sizes = {"ids": t, "positions": t, "slots": t, "kv_lens": s, "q_lens": s, "q_start": s + 1}
        self._table_offset = sum(sizes.values())
        # the step's page tables, packed [B, width], then scattered into the static table on the
        # device: a step uploads its own width, not max_pages per row
        total = self._table_offset + s * self.max_pages
        self._staging = Staging(total, torch.int64, device)
        self._host, self._dev = {}, {}
        offset = 0
        for name, n in sizes.items():
            self._host[name] = self._staging.host.numpy()[offset : offset + n]
            self._dev[name] = self._staging.dev[offset : offset + n]
            offset += n
        # the invariant: every entry names a pool page (rows past a request's pages are never read)
        self._dev_table = torch.full((s, self.max_pages), dummy_page, dtype=torch.int64, device=device)
        ps = self.page_size
        # Padding token i writes dummy-page offset i % page_size.
        self._pad_slots = dummy_page * ps + np.arange(t, dtype=np.int64) % ps
        self._host["slots"][:] = self._pad_slots
        self._staging.upload()

    # ------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every (token bucket, kv bucket), largest first (the shared pool and split scratch are
        sized by the first), on a side stream."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for tokens in reversed(self.buckets):
                for kv in reversed(self.kv_buckets):
                    self._entries[(tokens, kv)] = self._capture(tokens, kv)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _seqs(self, tokens: int) -> int:
        return min(tokens, self.max_seqs)

    def _capture(self, tokens: int, kv: int) -> _Graph:
        """Warm up on padding (the first request holds as many tokens as the kv bucket and the page
        table allow, on the dummy page; the rest are spare tokens at position 0), then capture the
        same forward."""
        seqs, first = self._seqs(tokens), min(tokens, kv)
        h = self._host
        h["q_lens"][:seqs] = 0
        h["q_lens"][0] = first
        h["kv_lens"][:seqs] = 0
        h["kv_lens"][0] = first
        h["q_start"][: seqs + 1] = first
        h["q_start"][0] = 0
        h["positions"][:tokens] = 0
        h["slots"][:tokens] = self._pad_slots[:tokens]
        self._staging.upload(self._table_offset)
        meta = self._metadata(tokens, seqs, kv)
        plan = self.backend.plan(meta, kv_len_bound=kv, token_bound=tokens, scratch=self._scratch)
        torch.cuda.synchronize()
        self._compute(tokens, plan)  # compiles every kernel, allocates the plan's scratch views
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=torch.cuda.current_stream()):
            hidden = self._compute(tokens, plan)
        return _Graph(graph, hidden, plan)

    def _compute(self, tokens: int, plan: Any) -> torch.Tensor:
        d = self._dev
        return self.model(d["ids"][:tokens], d["positions"][:tokens], self.kv_cache, plan)

    def _metadata(self, tokens: int, seqs: int, kv: int) -> AttentionMetadata:
        d = self._dev
        return AttentionMetadata(
            slot_mapping=d["slots"][:tokens],
            page_table=self._dev_table[:seqs],
            kv_lens=d["kv_lens"][:seqs],
            q_lens=d["q_lens"][:seqs],
            q_start=d["q_start"][: seqs + 1],
            max_q_len=tokens,
            max_kv_len=kv,
            page_size=self.page_size,
        )

    # ------------------------------------------------------------ replay
    def accepts(self, tokens: int, seqs: int, max_kv_len: int, max_pages: int) -> bool:
        return (
            0 < tokens <= self.max_tokens
            and seqs <= self._seqs(self._bucket_of[tokens])
            and max_kv_len <= self.kv_buckets[-1]
            and max_pages <= self.max_pages
        )

    @torch.inference_mode()
    def forward(
        self,
        ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        q_lens: np.ndarray,
        kv_lens: np.ndarray,
        table: np.ndarray,
        input_ids: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        max_kv_len: int = 0,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of a step's T tokens over B requests (host arrays: ids,
        positions, slots [T]; q_lens, kv_lens [B]; page table [B, pages]). ``input_ids`` (device,
        [T]) replaces ids (a chained step); ``offsets`` ([B], device) shift a one-token-per-row
        step's rows (``shift_rows``). A view of the pool: read it before the next replay."""
        t, b = int(ids.shape[0]), int(q_lens.shape[0])
        tokens = self._bucket_of[t]
        seqs = self._seqs(tokens)
        kv = next(k for k in self.kv_buckets if k >= max_kv_len)
        entry = self._entries[(tokens, kv)]
        self._staging.claim()  # the last upload has read the host buffer (normally long done)
        h = self._host
        h["ids"][:t] = ids
        h["positions"][:t] = positions
        h["slots"][:t] = slots
        h["slots"][t:tokens] = self._pad_slots[t:tokens]
        h["q_lens"][:b] = q_lens
        h["q_lens"][b:seqs] = 0
        h["kv_lens"][:b] = kv_lens
        h["kv_lens"][b:seqs] = 0
        np.cumsum(q_lens, out=h["q_start"][1 : b + 1])
        h["q_start"][0] = 0
        h["q_start"][b + 1 : seqs + 1] = t
        width = table.shape[1]
        packed = b * width
        self._staging.host.numpy()[self._table_offset : self._table_offset + packed] = table.reshape(-1)
        self._staging.upload(self._table_offset + packed)
        scatter_table(self._dev_table, self._staging.dev[self._table_offset :], b, width)
        d = self._dev
        if input_ids is not None:
            d["ids"][:t].copy_(input_ids)
        if offsets is not None:
            shift_rows(offsets, d["positions"], d["kv_lens"], d["slots"], self._dev_table, self.page_size)
        entry.graph.replay()
        self.replays[(tokens, kv)] += 1
        return entry.hidden[:t]

    def last_slots(self, tokens: int) -> torch.Tensor:
        """[tokens] int64: the KV slots of the last replay's real tokens (valid until the next)."""
        return self._dev["slots"][:tokens]
