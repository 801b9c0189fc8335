"""Settling matchers and filling their bitmask rows on persistent threads, in chunks of requests.

xgrammar releases the GIL inside its calls, so threads fill rows in parallel. The threads are
created once (per engine) and live until ``close``; xgrammar's own multi-threaded batch fill starts
its threads on every call, which costs more than it saves at the engine's batch sizes. A plain
step's chunk is two batched xgrammar calls (accept each matcher's deferred token, fill the rows) and
no Python per matcher, so a worker holds the GIL only to start and end its chunk. Below
``serial_below`` matchers one chunk runs on the caller's thread (no hand-off).

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
# the workers contended for the GIL, each settling its matchers one Python call at a time), so the
# pool only takes batches past that (python -m benchmarks.gpu_bench --parts smollm2, equal-work
# json_object pairs; LOG.md). Measured before the chunks became two batched calls: A/B it again
# with NGRAMMAR_FILL_SERIAL_BELOW (and NGRAMMAR_FILL_THREADS), which override the defaults.
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

    def __init__(self, threads: int | None = None, serial_below: int | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        if threads is None:
            threads = int(os.environ.get("NGRAMMAR_FILL_THREADS", fill_threads()))
        if serial_below is None:
            serial_below = int(os.environ.get("NGRAMMAR_FILL_SERIAL_BELOW", SERIAL_BELOW))
        self.threads = threads
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
        row (its sequence finishes; the token drawn there is dropped at commit).

        Each chunk is two batched xgrammar calls, which run without the GIL: accept the matchers'
        one deferred token (a plain step's), then fill the rows of those that took it. Everything
        per matcher in Python (sorting them out, the cached start rows, matchers with no or several
        deferred tokens, the wrappers' bookkeeping, the empty rows) stays on the caller's thread:
        on the workers it made them contend for the GIL around every xgrammar call."""
        words = bitmask.numpy()
        out = FillOutcome()
        settled: list[int] = []  # the matchers that settled, and their rows
        filled: list[int] = []
        # the matchers the chunks take: index, xgrammar matcher, deferred token (-1: none), row
        index: list[int] = []
        inner: list[xgr.GrammarMatcher] = []
        tokens: list[int] = []
        work_rows: list[int] = []
        for i, matcher in enumerate(matchers):
            row = int(rows[i])
            token = matcher.lone_deferred()
            if token is None:
                rejected = matcher.settle()
                if rejected is not None:
                    out.rejected.append((i, rejected))
                    words[row] = -1
                    continue
                start = matcher.start_row()
                if start is not None:
                    words[row] = start
                    settled.append(i)
                    filled.append(row)
                    continue
            index.append(i)
            inner.append(matcher.unsettled)
            tokens.append(-1 if token is None else token)
            work_rows.append(row)
        if index:
            parts = self._map(
                len(index),
                lambda lo, hi: self._settle_and_fill(inner[lo:hi], tokens[lo:hi], work_rows[lo:hi], bitmask),
            )
            accepted = [ok for part in parts for ok in part]
            for k, i in enumerate(index):
                if tokens[k] >= 0:
                    matchers[i].took_deferred(accepted[k])
                if accepted[k]:
                    settled.append(i)
                    filled.append(work_rows[k])
                else:
                    out.rejected.append((i, tokens[k]))
                    words[work_rows[k]] = -1
        if filled:
            out.dead = sorted(settled[k] for k in np.flatnonzero(~words[filled].any(axis=1)).tolist())
        out.rejected.sort()
        return out

    def _settle_and_fill(
        self, matchers: list[xgr.GrammarMatcher], tokens: list[int], rows: list[int], bitmask: torch.Tensor
    ) -> list[bool]:
        """One chunk: each matcher takes its token (-1: none), then the rows of those that took it
        are filled; returns which took it."""
        xgr = self._xgr
        take = [k for k, t in enumerate(tokens) if t >= 0]
        if len(take) == len(tokens):
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        else:
            accepted = [True] * len(tokens)
            if take:
                took = xgr.BatchGrammarMatcher.batch_accept_token(
                    [matchers[k] for k in take], [tokens[k] for k in take]
                )
                for k, ok in zip(take, took):
                    accepted[k] = ok
        if all(accepted):
            self._batch_matcher().batch_fill_next_token_bitmask(matchers, bitmask, rows)
        else:
            keep = [k for k, ok in enumerate(accepted) if ok]
            if keep:
                self._batch_matcher().batch_fill_next_token_bitmask(
                    [matchers[k] for k in keep], bitmask, [rows[k] for k in keep]
                )
        return accepted

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
