"""Settling matchers and filling their bitmask rows on persistent threads, in chunks of requests.

xgrammar releases the GIL inside ``accept_token``, ``fill_next_token_bitmask`` and
``traverse_draft_tree``, so threads fill rows in parallel. The threads are created once (per
engine) and live until ``close``; xgrammar's own multi-threaded batch fill starts its threads on
every call, which costs more than it saves at the engine's batch sizes. Below ``serial_below``
matchers one chunk runs on the caller's thread with one batched xgrammar call (no hand-off).

Each matcher sits in exactly one chunk, so no two threads touch the same matcher; chunks write
disjoint rows of the bitmask.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from ngrammar.grammar.backend import GrammarMatcher
from ngrammar.grammar.tree_mask import build_tree_bitmask

if TYPE_CHECKING:
    import xgrammar as xgr

# Matchers below which one chunk on the caller's thread beats handing chunks to the pool. On a GPU
# host the engine's batched xgrammar call beat the pool at every batch measured (64 and 128 members:
# the workers contend for the GIL between xgrammar calls), so the pool only takes batches past that
# (python -m benchmarks.gpu_bench --parts smollm2, equal-work json_object pairs; LOG.md).
SERIAL_BELOW = 192
MAX_FILL_THREADS = 8  # more threads than this only split a batch into chunks too small to pay

T = TypeVar("T")


def fill_threads(cores: int | None = None) -> int:
    """Pool threads for this machine: one core is the engine loop's (it runs a chunk itself)."""
    n = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(0, min(MAX_FILL_THREADS, n - 1))


@dataclass
class FillOutcome:
    """What filling a batch of rows found, by index into the matchers given."""

    rejected: list[tuple[int, int]] = field(default_factory=list)  # (index, token its grammar refused)
    dead: list[int] = field(default_factory=list)  # rows no token may follow: the grammar's dead end


class GrammarFillPool:
    """``threads`` workers (``fill_threads()`` by default) plus the caller's thread."""

    def __init__(self, threads: int | None = None, serial_below: int = SERIAL_BELOW) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.threads = fill_threads() if threads is None else threads
        self.serial_below = serial_below
        self._local = threading.local()  # each thread's own one-thread BatchGrammarMatcher
        self._pool = (
            ThreadPoolExecutor(self.threads, thread_name_prefix="grammar-fill") if self.threads > 0 else None
        )

    def close(self) -> None:
        """Stop the threads (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def fill_rows(self, matchers: Seq[GrammarMatcher], rows: Seq[int], bitmask: torch.Tensor) -> FillOutcome:
        """Settle each matcher (``GrammarMatcher.settle``) and fill ``bitmask[rows[i]]`` with its next
        tokens; CPU int32 bitmask [R, W]. A matcher whose settle rejects a token gets an all-allowed
        row (its sequence finishes; the token drawn there is dropped at commit)."""
        words = bitmask.numpy()
        outcomes = self._map(
            len(matchers), lambda lo, hi: self._fill_chunk(matchers, rows, words, bitmask, lo, hi)
        )
        out = FillOutcome()
        for part in outcomes:
            out.rejected += part.rejected
            out.dead += part.dead
        return out

    def fill_trees(
        self,
        matchers: Seq[GrammarMatcher | None],
        next_token: torch.Tensor,
        next_sibling: torch.Tensor,
        draft_tokens: torch.Tensor,
        bitmask: torch.Tensor,
    ) -> None:
        """``build_tree_bitmask`` with the requests split into chunks: request b's D rows are
        ``bitmask[b*D:(b+1)*D]``; links and tokens CPU int64 [bs, D]."""
        d = draft_tokens.shape[1]
        if bitmask.shape[0] != len(matchers) * d:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows, expected bs*D = {len(matchers) * d}")

        def chunk(lo: int, hi: int) -> None:
            build_tree_bitmask(
                matchers[lo:hi],
                next_token[lo:hi],
                next_sibling[lo:hi],
                draft_tokens[lo:hi],
                bitmask[lo * d : hi * d],
            )

        self._map(len(matchers), chunk)

    def _map(self, n: int, work: Callable[[int, int], T]) -> list[T]:
        """``work(lo, hi)`` over chunks covering [0, n): one on the caller's thread below
        ``serial_below`` (or without workers), else one per thread, the caller's last."""
        if self._pool is None or n < max(self.serial_below, 2):
            return [work(0, n)]
        parts = min(self.threads + 1, n)
        bounds = [n * k // parts for k in range(parts + 1)]
        # Inference mode is per thread: a worker writing the engine's bitmask (an inference tensor
        # when the engine's step made it) must run in the caller's mode.
        inference = torch.is_inference_mode_enabled()

        def in_callers_mode(lo: int, hi: int) -> T:
            with torch.inference_mode(inference):
                return work(lo, hi)

        futures: list[Future[T]] = [
            self._pool.submit(in_callers_mode, bounds[k], bounds[k + 1]) for k in range(parts - 1)
        ]
        mine = work(bounds[-2], bounds[-1])
        return [f.result() for f in futures] + [mine]

    def _batch_matcher(self) -> xgr.BatchGrammarMatcher:
        batch = getattr(self._local, "batch", None)
        if batch is None:
            batch = self._local.batch = self._xgr.BatchGrammarMatcher(max_threads=1)
        return batch

    def _fill_chunk(
        self,
        matchers: Seq[GrammarMatcher],
        rows: Seq[int],
        words: np.ndarray,
        bitmask: torch.Tensor,
        lo: int,
        hi: int,
    ) -> FillOutcome:
        """Matchers [lo, hi): settle, copy the cached start rows, fill the others in one batched
        xgrammar call on this thread, then find the empty rows."""
        out = FillOutcome()
        filled: list[int] = []
        batch: list[xgr.GrammarMatcher] = []
        batch_rows: list[int] = []
        for i in range(lo, hi):
            matcher, row = matchers[i], int(rows[i])
            rejected = matcher.settle()
            if rejected is not None:
                out.rejected.append((i, rejected))
                words[row] = -1
                continue
            filled.append(i)
            start = matcher.start_row()
            if start is not None:
                words[row] = start
            else:
                batch.append(matcher.xgrammar_matcher)
                batch_rows.append(row)
        if batch:
            self._batch_matcher().batch_fill_next_token_bitmask(batch, bitmask, batch_rows)
        if filled:
            empty = ~words[[int(rows[i]) for i in filled]].any(axis=1)
            out.dead = [filled[k] for k in np.flatnonzero(empty).tolist()]
        return out
