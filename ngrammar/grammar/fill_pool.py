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
import sys
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


class _QuickSwitch:
    """While some fill runs on a worker, the interpreter's switch interval is cut to ``interval``:
    a waiting thread takes the GIL only once the holder releases it or the interval runs out, and
    the default 5 ms would let the worker start its fill only when the engine's thread waits for it
    (no overlap at all). Counted, so that engines sharing a process restore the interval once the
    last of them is done."""

    def __init__(self, interval: float = 1e-4) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._active = 0
        self._saved = 0.0

    def enter(self) -> None:
        with self._lock:
            if self._active == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self.interval, self._saved))
            self._active += 1

    def exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                sys.setswitchinterval(self._saved)


_QUICK_SWITCH = _QuickSwitch()


class _RowsWork:
    """One plain step's rows: settled on the caller's thread, some left to one batched fill."""

    def __init__(self, bitmask: torch.Tensor, batch_matcher: Callable[[], xgr.BatchGrammarMatcher]) -> None:
        self.bitmask = bitmask
        self.words = bitmask.numpy()
        self._batch_matcher = batch_matcher
        self.rejected: list[tuple[int, int]] = []  # (index, token its grammar refused)
        self.settled: list[int] = []  # the matchers that settled, and their rows
        self.filled: list[int] = []
        self.fill: list[xgr.GrammarMatcher] = []  # the matchers to fill, and their rows
        self.fill_rows: list[int] = []

    def fill_chunk(self, lo: int, hi: int) -> None:
        self._batch_matcher().batch_fill_next_token_bitmask(
            self.fill[lo:hi], self.bitmask, self.fill_rows[lo:hi]
        )

    def outcome(self) -> FillOutcome:
        """Rejections, and the rows left empty: dead ends (after the fill)."""
        out = FillOutcome(rejected=self.rejected)
        if self.filled:
            empty = np.flatnonzero(~self.words[self.filled].any(axis=1)).tolist()
            out.dead = [self.settled[k] for k in empty]
        return out


class RowsFill:
    """A plain step's rows being filled (``GrammarFillPool.start_rows``)."""

    def __init__(self, work: _RowsWork, future: Future[None] | None) -> None:
        self._work = work
        self._future = future
        self._outcome: FillOutcome | None = None

    def wait(self) -> FillOutcome:
        """Block until the rows are filled; the outcome (idempotent)."""
        if self._outcome is None:
            future, self._future = self._future, None
            if future is not None:
                try:
                    future.result()
                finally:
                    _QUICK_SWITCH.exit()
            self._outcome = self._work.outcome()
        return self._outcome


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
        prepared = self._prepare_rows(matchers, rows, bitmask)
        if prepared.fill:
            self._map(len(prepared.fill), prepared.fill_chunk, self.rows_serial_below)
        return prepared.outcome()

    def start_rows(self, matchers: Seq[GrammarMatcher], rows: Seq[int], bitmask: torch.Tensor) -> RowsFill:
        """``fill_rows`` with its batched fill left running on one worker: the caller settles and
        copies start rows now, and ``RowsFill.wait`` gives the outcome once the fill is done. The
        caller's thread goes on with other host work meanwhile (xgrammar fills without the GIL);
        until ``wait``, nothing may touch these matchers or the bitmask. Without workers the fill
        runs here and now."""
        prepared = self._prepare_rows(matchers, rows, bitmask)
        if not prepared.fill or self._pool is None:
            if prepared.fill:
                prepared.fill_chunk(0, len(prepared.fill))
            return RowsFill(prepared, None)
        inference = torch.is_inference_mode_enabled()

        def fill() -> None:
            with torch.inference_mode(inference):
                prepared.fill_chunk(0, len(prepared.fill))

        _QUICK_SWITCH.enter()  # released by RowsFill.wait
        return RowsFill(prepared, self._pool.submit(fill))

    def _prepare_rows(
        self, matchers: Seq[GrammarMatcher], rows: Seq[int], bitmask: torch.Tensor
    ) -> _RowsWork:
        """Settle every matcher and copy the start rows, on the caller's thread; what is left to
        fill (``_RowsWork.fill``) is the batched xgrammar call's."""
        work = _RowsWork(bitmask, self._batch_matcher)
        words = work.words
        for i, matcher in enumerate(matchers):
            row = int(rows[i])
            rejected = matcher.settle()
            if rejected is not None:
                work.rejected.append((i, rejected))
                words[row] = -1
                continue
            work.settled.append(i)
            work.filled.append(row)
            start = matcher.start_row()
            if start is not None:
                words[row] = start
            else:
                work.fill.append(matcher.xgrammar_matcher)
                work.fill_rows.append(row)
        return work

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
