"""CUDA graphs for uniform decode and tree-verify steps.

A step is *uniform* when every one of its B sequences brings the same number W of new tokens and
logits are wanted for all B * W rows, in order: plain decode (W = 1, causal) and NGRAM tree verify
(W = D, with a [B, D, D] tree mask). Such a step is padded up to a batch-size bucket and runs
``model.forward + compute_logits`` as one captured graph per (bucket, W). Every other step (prefill,
mixed widths, batches beyond the largest bucket) stays eager in ``ModelRunner``.

Static inputs
-------------
All per-step inputs live in one byte buffer on the device, mirrored by one (pinned) host buffer, so a
step costs one host->device copy and never a device->host read. Regions, sized for the largest
bucket and width: ids, positions, slot_mapping ([max_tokens] int64), kv_lens, q_lens ([max_bs]),
q_start ([max_bs + 1]), the flat tree mask (max_bs * W_max^2 bools, viewed as [bucket, W, W]) and
last the step's page tables packed [bucket, width] (width: its longest), so a step's copy stops there;
one device copy then puts them into the static [max_bs, max_pages] table the graphs read.
Logits land in a shared [max_tokens, V] float32 buffer; a step returns a view of its first B * W
rows, valid until the next step.

Padding rows
------------
Rows B..bucket-1 are dummy sequences of W tokens that only touch the *dummy page*: a page of the KV
pool that the allocator never hands out. Their q_len = kv_len = W, every page-table entry is the dummy
page, their slots are dummy-page offsets, and their tree mask is lower-triangular, so every query
sees at least itself (no all-masked softmax row). Real sequences never read the dummy page, so what
padding rows write there is harmless. Invariant: every page-table entry of the static buffers always
names a page of the pool (stale entries past a row's length are never read unmasked).

Acceptance graphs
-----------------
With an ``acceptor`` (the NGRAM worker's greedy tree acceptance), every verify width W > 1 also gets a
second, small graph per bucket: ``acceptor(ids [bucket, W], tree mask [bucket, W, W], logits
[bucket * W, V], slots [bucket, W])`` over the same static buffers, replayed after the host has
masked the logits in place with the grammar (``accept``). It turns the ~45 tiny acceptance kernels,
the KV compaction after them and the packing of what the host reads into one launch (eagerly, the
compaction kernels alone cost a large share of a batch-1 verify step's host time).

Host maxima and the attention plan
----------------------------------
A captured graph bakes in the launch shapes, so its metadata has max_q_len = W and max_kv_len =
kv_len_bound, and its plan comes from ``backend.plan(meta, kv_len_bound=...)``; real lengths are read
from the tensors inside the kernels. The plan (and the split scratch it allocates during the eager
warm-up) stays alive as long as its graph.

No-capture mode (``capture=False``) runs exactly the same static buffers and padding eagerly, planning
each step afresh: this is how the path is tested on the CPU with ``TorchSDPABackend``. There the host
max_kv_len is the step's own maximum, because SDPA's cost grows with it and no graph needs it fixed.
"""

from __future__ import annotations

import inspect
import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ngrammar.attention.metadata import AttentionBackend, AttentionMetadata, shift_rows
from ngrammar.runner.transfer import Staging, scatter_table

if TYPE_CHECKING:
    from ngrammar.runner.model_runner import ModelRunner, StepInput

STANDARD_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)
_LARGE_BUCKET_STEP = 32  # beyond 64 sequences, buckets every 32


def buckets(limit: int, small: tuple[int, ...], step: int) -> list[int]:
    """Ascending bucket sizes: the ``small`` ones below ``limit``, then every ``step`` past the
    last of them; ``limit`` is always the last (exact) bucket."""
    if limit < 1:
        raise ValueError(f"a bucket limit must be positive, got {limit}")
    sizes = [b for b in small if b < limit]
    size = small[-1] + step
    while size < limit:
        sizes.append(size)
        size += step
    return sizes + [limit]


def bucket_table(sizes: list[int]) -> list[int]:
    """table[n] = the smallest of the ascending ``sizes`` that holds n, for n in 0..sizes[-1]
    (index 0: the first)."""
    table, i = [], 0
    for n in range(sizes[-1] + 1):
        while sizes[i] < n:
            i += 1
        table.append(sizes[i])
    return table


def batch_buckets(max_batch_size: int) -> list[int]:
    """Batch-size buckets of the uniform graphs."""
    return buckets(max_batch_size, STANDARD_BUCKETS, _LARGE_BUCKET_STEP)


def page_table(tables: list[list[int]]) -> np.ndarray:
    """[B, longest] int64: each sequence's pages, zero-padded (entries past a row's length are
    never read unmasked)."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    total = int(lens.sum())
    table = np.zeros((len(tables), int(lens.max())), dtype=np.int64)
    rows = np.repeat(np.arange(len(tables)), lens)
    cols = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    table[rows, cols] = np.fromiter(itertools.chain.from_iterable(tables), np.int64, total)
    return table


def graph_capturable(backend: AttentionBackend) -> bool:
    """Whether the backend's plan can be made launch-stable (it takes a ``kv_len_bound``).

    TorchSDPABackend cannot be captured: its plan sizes tensors from device values.
    """
    return "kv_len_bound" in inspect.signature(backend.plan).parameters


@dataclass(frozen=True)
class _Layout:
    """Byte offsets of the static regions; int64 regions stay 8-byte aligned."""

    max_tokens: int
    max_bs: int
    max_width: int
    max_pages: int

    @property
    def mask_offset(self) -> int:
        return 8 * (3 * self.max_tokens + 3 * self.max_bs + 1)

    @property
    def page_table_offset(self) -> int:
        mask_bytes = self.max_bs * self.max_width * self.max_width
        return self.mask_offset + -(-mask_bytes // 8) * 8

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.max_bs, self.max_pages)

    def bytes_for(self, bucket: int, table_width: int) -> int:
        """Prefix of the buffer that a step of this bucket, with page tables packed this wide, reads."""
        return self.page_table_offset + 8 * bucket * table_width


@dataclass(frozen=True)
class _Regions:
    """Typed views of one raw buffer (torch on the device, numpy on the host)."""

    ids: Any  # [max_tokens] int64
    positions: Any  # [max_tokens] int64
    slots: Any  # [max_tokens] int64
    kv_lens: Any  # [max_bs] int64
    q_lens: Any  # [max_bs] int64
    q_start: Any  # [max_bs + 1] int64
    tree_mask: Any  # [max_bs * max_width^2] bool, viewed per step as [bucket, W, W]
    page_table: Any  # [max_bs * max_pages] int64: a step's tables packed [bucket, width]


def _carve(raw: Any, layout: _Layout, i64: Any, b8: Any) -> _Regions:
    """Slice ``raw`` (uint8, torch or numpy; ``i64``/``b8`` are that library's dtypes) into regions."""

    def ints(offset: int, count: int) -> Any:
        return raw[offset : offset + 8 * count].view(i64)

    t, bs = layout.max_tokens, layout.max_bs
    small = [8 * t, 8 * t, 8 * t, 8 * bs, 8 * bs, 8 * (bs + 1)]
    starts = np.cumsum([0] + small).tolist()
    mask_bytes = bs * layout.max_width * layout.max_width
    mo, po = layout.mask_offset, layout.page_table_offset
    return _Regions(
        ids=ints(starts[0], t),
        positions=ints(starts[1], t),
        slots=ints(starts[2], t),
        kv_lens=ints(starts[3], bs),
        q_lens=ints(starts[4], bs),
        q_start=ints(starts[5], bs + 1),
        tree_mask=raw[mo : mo + mask_bytes].view(b8),
        page_table=ints(po, bs * layout.max_pages),
    )


@dataclass
class _Entry:
    """One (bucket, width): its graph and what the graph references (kept alive together)."""

    bucket: int
    width: int
    meta: AttentionMetadata | None = None  # the captured metadata (capture mode only)
    plan: Any = None
    graph: Any = None  # torch.cuda.CUDAGraph, or None in no-capture mode
    accept_graph: Any = None  # the acceptor's graph (widths > 1, capture mode with an acceptor)
    accept_out: Any = None  # what the captured acceptor returned (its tensors live in the pool)

    @property
    def tokens(self) -> int:
        return self.bucket * self.width


class CUDAGraphRunner:
    """Runs uniform steps of ``runner`` through static buffers, replaying one graph per (bucket, W).

    widths: the q widths to serve ({1} is always added).
    max_batch_size: the largest bucket; bigger batches stay eager.
    kv_len_bound: the longest kv length a step may have; sizes the page table and steers the Triton
        split count of captured plans.
    dummy_page: a pool page that no sequence ever owns; padding rows write and read only there.
    capture: True: capture CUDA graphs (CUDA device and a capturable backend). False: run the same
        static path eagerly.
    acceptor: optional device-only function (candidates [bucket, W] int64, tree mask [bucket, W, W]
        bool, logits [bucket * W, V] float32, KV slots [bucket, W] int64 of the step's tokens) ->
        result, captured per (bucket, W > 1); see ``accept``.
    """

    def __init__(
        self,
        runner: ModelRunner,
        widths: Iterable[int],
        max_batch_size: int,
        kv_len_bound: int,
        dummy_page: int,
        capture: bool = True,
        acceptor: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Any] | None = None,
    ) -> None:
        self.runner = runner
        self.acceptor = acceptor
        self.widths = sorted(set(widths) | {1})
        if self.widths[0] < 1 or kv_len_bound < 1:
            raise ValueError(f"widths and kv_len_bound must be positive, got {self.widths}, {kv_len_bound}")
        num_pages = int(runner.kv_cache.shape[2])
        if not 0 <= dummy_page < num_pages:
            raise ValueError(f"dummy_page {dummy_page} is outside the KV pool of {num_pages} pages")
        if capture and (runner.device.type != "cuda" or not graph_capturable(runner.backend)):
            raise ValueError("CUDA graph capture needs a CUDA device and a capturable attention backend")
        self.capture = capture
        self.buckets = batch_buckets(max_batch_size)
        self.max_batch_size = self.buckets[-1]
        self.kv_len_bound = kv_len_bound
        self.dummy_page = dummy_page
        self.page_size = runner.page_size
        self.layout = _Layout(
            max_tokens=self.max_batch_size * self.widths[-1],
            max_bs=self.max_batch_size,
            max_width=self.widths[-1],
            max_pages=-(-kv_len_bound // self.page_size),
        )
        self._bucket_of = bucket_table(self.buckets)
        self._init_buffers()
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays: Counter[tuple[int, int]] = Counter()  # steps served per (bucket, width)
        self._last_tokens = 0  # real tokens of the last step served
        self.accept_replays: Counter[tuple[int, int]] = Counter()  # acceptor runs per (bucket, width)

    # ------------------------------------------------------------- set-up
    def _init_buffers(self) -> None:
        device = self.runner.device
        self._staging = Staging(self.layout.nbytes, torch.uint8, device)
        self._host = _carve(self._staging.host.numpy(), self.layout, np.int64, np.bool_)
        self._dev = _carve(self._staging.dev, self.layout, torch.int64, torch.bool)
        # The page table the graphs read. The invariant: every entry names a pool page.
        self._table = torch.full(
            (self.max_batch_size, self.layout.max_pages), self.dummy_page, dtype=torch.int64, device=device
        )
        self._logits = torch.empty(
            (self.layout.max_tokens, self.runner.vocab_size), dtype=torch.float32, device=device
        )
        self._arange = np.arange(self.widths[-1], dtype=np.int64)  # [W_max] token index inside a row
        self._rows = np.arange(self.max_batch_size, dtype=np.int64)[:, None]  # [max_bs, 1] row index
        # (first, bucket, width) of the padding now staged: a step with the same triple skips
        # re-staging it (real rows only write rows < first; other triples restage).
        self._padded: tuple[int, int, int] | None = None
        # Padding token i writes dummy-page offset i % page_size.
        self._pad_slots = self.dummy_page * self.page_size + self._arange % self.page_size

    # ----------------------------------------------------------- dispatch
    def accepts(self, step: StepInput) -> bool:
        """Whether ``step`` is uniform and fits a bucket (host-only checks)."""
        b = step.batch_size
        if not 0 < b <= self.max_batch_size:
            return False
        w = len(step.tokens[0])
        if w not in self.widths or any(len(t) != w for t in step.tokens):
            return False
        if w == 1:
            if step.tree_mask is not None:
                return False
        elif step.tree_mask is None or tuple(step.tree_mask.shape) != (b, w, w):
            return False
        if max(len(p) for p in step.page_tables) > self.layout.max_pages:
            return False
        n = b * w
        return len(step.logits_rows) == n and step.logits_rows == list(range(n))

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Logits [B * W, V] float32 of an accepted step: a view valid until the next step."""
        b, w = step.batch_size, len(step.tokens[0])
        entry = self._entry(self._bucket_of[b], w)
        max_kv_len = self._stage(step, entry.bucket, w)
        d = self._dev
        if step.input_ids is not None:  # a chained step: its tokens are still on the device
            d.ids[: b * w].copy_(step.input_ids)
        if step.device_positions is not None:  # (and a verify step's trees picked there)
            d.positions[: b * w].copy_(step.device_positions)
        if step.device_tree_mask is not None:
            d.tree_mask[: b * w * w].copy_(step.device_tree_mask.reshape(-1))
        if step.offsets is not None:  # chained out of a verify step: its accepted lengths too
            shift_rows(step.offsets, d.positions, d.kv_lens, d.slots, self._table, self.page_size)
        if entry.graph is not None:
            entry.graph.replay()
        else:
            meta = self._metadata(entry.bucket, w, max_kv_len)
            self._compute(entry.tokens, meta, self.runner.backend.plan(meta))
        self.replays[(entry.bucket, w)] += 1
        self._last_tokens = b * w
        return self._logits[: b * w]

    def last_slots(self) -> torch.Tensor:
        """[B * W] int64: the KV slots of the last served step's real tokens (a view of the static
        buffer, valid until the next step is staged)."""
        return self._dev.slots[: self._last_tokens]

    @torch.inference_mode()
    def accept(self, batch_size: int, width: int) -> Any:
        """Run the acceptor on the last step served by ``forward`` (which must have been a verify of
        ``batch_size`` sequences at ``width``), after any in-place masking of its logits. Returns
        the acceptor's result for the whole bucket (padding rows last); valid until the next call."""
        if self.acceptor is None or width == 1:
            raise ValueError("accept() needs an acceptor and a verify width > 1")
        entry = self._entry(self._bucket_of[batch_size], width)
        self.accept_replays[(entry.bucket, width)] += 1
        if entry.accept_graph is not None:
            entry.accept_graph.replay()
            return entry.accept_out
        return self._run_acceptor(entry)

    def _run_acceptor(self, entry: _Entry) -> Any:
        d, tokens, w = self._dev, entry.tokens, entry.width
        candidates = d.ids[:tokens].view(entry.bucket, w)
        mask = d.tree_mask[: tokens * w].view(entry.bucket, w, w)
        assert self.acceptor is not None
        return self.acceptor(candidates, mask, self._logits[:tokens], d.slots[:tokens].view(entry.bucket, w))

    def padding_graph(self, batch_size: int, width: int) -> Any:
        """For benchmarks: the captured graph of (bucket of ``batch_size``, ``width``) with every row of
        the static buffers turned into padding, so it can be replayed on its own (whatever the last
        step left there may belong to another width). None when that graph was not captured (the
        buffers are still refilled if the pair was prepared in no-capture mode)."""
        entry = self._entries.get((self._bucket_of[batch_size], width))
        if entry is None:
            return None
        self._claim_host()
        self._upload_padding(entry.bucket, width)
        return entry.graph

    @torch.inference_mode()
    def profile(self, repeats: int = 5) -> dict[tuple[int, int], float]:
        """Device seconds of one step per captured (bucket, width): the lower median of ``repeats``
        replays on all-padding rows, a verify width's acceptor graph included (what the draft policy
        prices widths by before their steps are timed: ``StepCosts.set_profile``). Only rank 0's
        graphs: not for tensor-parallel runners, whose replays need every rank."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        out: dict[tuple[int, int], float] = {}
        for key, entry in sorted(self._entries.items()):
            graph = self.padding_graph(*key)
            if graph is None:
                continue
            times = []
            for _ in range(repeats + 1):  # the first replay warms caches: dropped
                start.record()
                graph.replay()
                if entry.accept_graph is not None:
                    entry.accept_graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            ordered = sorted(times[1:])
            out[key] = ordered[(len(ordered) - 1) // 2]
        return out

    @property
    def prepared(self) -> list[tuple[int, int]]:
        """(bucket, width) pairs set up so far (captured, in capture mode)."""
        return sorted(self._entries)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Prepare every (bucket, width) now, widest and largest first so later captures reuse the
        shared pool's memory."""
        for w in reversed(self.widths):
            for bucket in reversed(self.buckets):
                self._entry(bucket, w)

    def _entry(self, bucket: int, width: int) -> _Entry:
        entry = self._entries.get((bucket, width))
        if entry is None:
            entry = _Entry(bucket, width)
            if self.capture:
                self._capture(entry)
            self._entries[(bucket, width)] = entry
        return entry

    # ------------------------------------------------------------ capture
    def _capture(self, entry: _Entry) -> None:
        """Warm up eagerly on all-padding inputs (compiles kernels, sizes the plan's scratch), then
        capture the same computation into the shared pool."""
        self._claim_host()
        self._upload_padding(entry.bucket, entry.width)
        meta = self._metadata(entry.bucket, entry.width, self.kv_len_bound)
        plan = self.runner.backend.plan(meta, kv_len_bound=self.kv_len_bound)  # type: ignore[call-arg]
        self._compute(entry.tokens, meta, plan)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._compute(entry.tokens, meta, plan)
        entry.meta, entry.plan, entry.graph = meta, plan, graph
        if self.acceptor is not None and entry.width > 1:
            self._run_acceptor(entry)  # warm-up on the padding rows just computed
            accept_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(accept_graph, pool=self._pool):
                entry.accept_out = self._run_acceptor(entry)
            entry.accept_graph = accept_graph

    def _compute(self, tokens: int, meta: AttentionMetadata, plan: Any) -> None:
        """The captured region: model forward over the static ids/positions, then the logits copied
        into the shared buffer, so one [max_tokens, V] buffer serves every graph rather than each
        graph keeping its own output alive in the pool (costs one extra pass over the logits)."""
        model, d = self.runner.model, self._dev
        hidden = model(d.ids[:tokens], d.positions[:tokens], self.runner.kv_cache, plan)
        self._logits[:tokens].copy_(model.compute_logits(hidden))

    def _metadata(self, bucket: int, width: int, max_kv_len: int) -> AttentionMetadata:
        d, tokens = self._dev, bucket * width
        tree = None if width == 1 else d.tree_mask[: tokens * width].view(bucket, width, width)
        return AttentionMetadata(
            slot_mapping=d.slots[:tokens],
            page_table=self._table[:bucket],
            kv_lens=d.kv_lens[:bucket],
            q_lens=d.q_lens[:bucket],
            q_start=d.q_start[: bucket + 1],
            max_q_len=width,
            max_kv_len=max_kv_len,
            page_size=self.page_size,
            tree_mask=tree,
        )

    # ------------------------------------------------------------ staging
    def _stage(self, step: StepInput, bucket: int, width: int) -> int:
        """Fill the host buffer with ``step`` plus padding and upload it; returns the step's largest
        kv length (host value, known without any device read)."""
        self._claim_host()
        b, h = step.batch_size, self._host
        n = b * width
        starts = np.asarray(step.starts, dtype=np.int64)
        last_page = (starts + width - 1) // self.page_size
        if (last_page >= np.fromiter(map(len, step.page_tables), np.int64, b)).any():
            raise ValueError("a page table does not cover its step's new tokens")  # (before any write)
        h.ids[:n] = np.asarray(step.tokens, dtype=np.int64).reshape(-1)
        h.positions[:n] = np.asarray(step.positions, dtype=np.int64).reshape(-1)
        h.kv_lens[:b] = starts + width
        ps = self.page_size
        real = page_table(step.page_tables)  # [B, longest]
        table_width = max(real.shape[1], -(-width // ps))
        table = self._stage_table(b, bucket, table_width)
        table[:b, : real.shape[1]] = real
        kv_idx = starts[:, None] + self._arange[:width]  # [B, W] kv index of each new token
        h.slots[:n] = (table[self._rows[:b], kv_idx // ps] * ps + kv_idx % ps).reshape(-1)
        if width > 1:
            h.tree_mask[: n * width] = np.asarray(step.tree_mask, dtype=np.bool_).reshape(-1)
        if self._padded != (b, bucket, width):  # else rows b..bucket-1 still hold this padding
            self._stage_padding(b, bucket, width)
        self._upload(bucket, table_width)
        return int(starts.max()) + width + step.max_offset

    def _stage_padding(self, first: int, bucket: int, width: int) -> None:
        """Rows first..bucket-1 become dummy sequences on the dummy page; q_lens/q_start of the bucket."""
        self._padded = (first, bucket, width)
        h, pad = self._host, bucket - first
        lo, hi = first * width, bucket * width
        h.ids[lo:hi] = 0
        h.positions[lo:hi] = np.tile(self._arange[:width], pad)
        h.slots[lo:hi] = np.tile(self._pad_slots[:width], pad)
        h.kv_lens[first:bucket] = width
        h.q_lens[:bucket] = width
        h.q_start[: bucket + 1] = np.arange(0, (bucket + 1) * width, width, dtype=np.int64)
        if width > 1:
            mask = h.tree_mask[: hi * width].reshape(bucket, width, width)
            mask[first:] = np.tri(width, dtype=np.bool_)

    def _upload_padding(self, bucket: int, width: int) -> None:
        """Every row of the bucket a dummy sequence, uploaded."""
        self._stage_padding(0, bucket, width)
        table_width = -(-width // self.page_size)
        self._stage_table(0, bucket, table_width)
        self._upload(bucket, table_width)

    def _stage_table(self, first: int, bucket: int, width: int) -> np.ndarray:
        """The host's packed [bucket, width] page tables, rows first.. on the dummy page."""
        table = self._host.page_table[: bucket * width].reshape(bucket, width)
        table[first:] = self.dummy_page
        return table

    def _claim_host(self) -> None:
        """Wait until the last upload has read the host buffer (normally long done: a step's upload
        is queued right after the previous step's sampling, which the host has waited for, or is
        about to, before it stages again)."""
        self._staging.claim()

    def _upload(self, bucket: int, table_width: int) -> None:
        """One host->device copy of the step's prefix of the buffer (non-blocking from pinned), then
        its packed page tables into the static table, on the device."""
        self._staging.upload(self.layout.bytes_for(bucket, table_width))
        scatter_table(self._table, self._dev.page_table, bucket, table_width)


__all__ = ["CUDAGraphRunner", "STANDARD_BUCKETS", "batch_buckets", "graph_capturable"]
