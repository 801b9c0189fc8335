"""Settling matchers and filling their bitmask rows on persistent threads, in chunks of requests.

xgrammar releases the GIL inside its calls, so threads fill rows in parallel; but each call must
take the GIL back, and a thread that finds it held waits until the holder releases it (up to the
interpreter's switch interval, 5 ms, when the holder runs Python). So a plain step's workers make
one call each (a batched fill) and the Python per matcher (settling, start rows) stays on the
caller's thread. The threads are created once (per engine) and live until ``close``; xgrammar's own
multi-threaded batch fill starts its threads on every call, which costs more than it saves at the
engine's batch sizes. Below ``serial_below`` matchers one chunk runs on the caller's thread.

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

# Matchers below which one chunk on the caller's thread beats handing chunks to the pool. Plain
# rows: on an H200 host (16 cores) one batched xgrammar call beat the pool at every batch measured,
# 8 to 256 members, JSON schema and json_object alike (python -m benchmarks grammar --host-fill;
# LOG.md): a fill is a few µs per matcher and each worker's return waits for the GIL. Tree masks
# (a traversal of D nodes per member) keep the earlier threshold, unmeasured since. Both are A/B'd
# with NGRAMMAR_FILL_SERIAL_BELOW (and NGRAMMAR_FILL_THREADS), which override the defaults.
ROWS_SERIAL_BELOW = 512
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
        if serial_below is None and "NGRAMMAR_FILL_SERIAL_BELOW" in os.environ:
            serial_below = int(os.environ["NGRAMMAR_FILL_SERIAL_BELOW"])
        self.threads = threads
        # (trees, plain rows): one value given applies to both
        self.serial_below = SERIAL_BELOW if serial_below is None else serial_below
        self.rows_serial_below = ROWS_SERIAL_BELOW if serial_below is None else serial_below
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

        The caller's thread settles every matcher and copies the cached start rows; the rows left
        are filled in chunks, each one batched xgrammar call, then the empty rows are found. A
        worker makes that one call and nothing else: every xgrammar call releases the GIL and must
        take it back, and workers settling their own matchers (a call per token) queued for it
        behind each other and the caller (LOG.md, issue 41)."""
        words = bitmask.numpy()
        out = FillOutcome()
        settled: list[int] = []  # the matchers that settled, and their rows
        filled: list[int] = []
        fill: list[xgr.GrammarMatcher] = []  # the matchers to fill, and their rows
        fill_rows: list[int] = []
        for i, matcher in enumerate(matchers):
            row = int(rows[i])
            rejected = matcher.settle()
            if rejected is not None:
                out.rejected.append((i, rejected))
                words[row] = -1
                continue
            settled.append(i)
            filled.append(row)
            start = matcher.start_row()
            if start is not None:
                words[row] = start
            else:
                fill.append(matcher.xgrammar_matcher)
                fill_rows.append(row)
        if fill:
            self._map(
                len(fill),
                lambda lo, hi: self._batch_matcher().batch_fill_next_token_bitmask(
                    fill[lo:hi], bitmask, fill_rows[lo:hi]
                ),
                self.rows_serial_below,
            )
        if filled:
            out.dead = [settled[k] for k in np.flatnonzero(~words[filled].any(axis=1)).tolist()]
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

        self._map(len(matchers), chunk, self.serial_below)

    def _map(self, n: int, work: Callable[[int, int], T], serial_below: int) -> list[T]:
        """``work(lo, hi)`` over chunks covering [0, n): one on the caller's thread below
        ``serial_below`` (or without workers), else one per thread, the caller's last."""
        if self._pool is None or n < max(serial_below, 2):
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
