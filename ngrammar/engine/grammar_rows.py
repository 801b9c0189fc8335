"""Grammar bitmask rows of a step: one per sequence (plain), or one per draft-tree node (verify).

The matchers are the sequences' own (``Sequence.grammar``); rows are settled and filled on a
persistent thread pool (``GrammarFillPool``) into persistent host bitmasks, copied in non-blocking
and applied to the logits on the device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import numpy as np
import torch

from ngrammar.engine.sequence import Sequence
from ngrammar.engine.stats import EngineStats
from ngrammar.grammar.fill_pool import GrammarFillPool
from ngrammar.speculative.tree import DraftTree, derive_tree_links


class BitmaskBuffers:
    """Two persistent host bitmasks (pinned on CUDA) and their device twins, used in turn.

    A step fills the host buffer its turn gives and copies it in without blocking; the buffer is
    written again two steps later, after the event recorded behind that copy (long done by then,
    as the step in between read its tokens back). Both grow (doubling) to the rows a step needs.
    """

    def __init__(self, width: int, device: torch.device) -> None:
        self.width = width  # int32 words per row: ceil(V/32)
        self.device = device
        self._pin = device.type == "cuda" and torch.cuda.is_available()
        self._host: list[torch.Tensor] = []
        self._dev: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def host(self, rows: int) -> torch.Tensor:
        """The next host buffer's first ``rows`` rows (CPU int32 [rows, W], contents stale)."""
        self._turn ^= 1
        if not self._host or self._host[0].shape[0] < rows:
            capacity = 1 << max(rows - 1, 0).bit_length()
            self._host = [self._alloc(capacity, "cpu") for _ in range(2)]
            self._dev = [self._alloc(capacity, self.device) for _ in range(2)] if self._pin else []
            self._copied = [None, None]
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()
        return self._host[self._turn][:rows]

    def to_device(self, rows: int) -> torch.Tensor:
        """This turn's first ``rows`` rows on the device (the host buffer itself off CUDA)."""
        if not self._pin:
            return self._host[self._turn][:rows]
        dev = self._dev[self._turn][:rows]
        dev.copy_(self._host[self._turn][:rows], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._turn] = event
        return dev

    def _alloc(self, rows: int, device: str | torch.device) -> torch.Tensor:
        pin = self._pin and device == "cpu"
        return torch.empty((rows, self.width), dtype=torch.int32, device=device, pin_memory=pin)


class GrammarRows:
    def __init__(self, vocab_size: int, device: torch.device, stats: EngineStats) -> None:
        from ngrammar.grammar import bitmask_width

        self.vocab_size = vocab_size
        self.device = device
        self.stats = stats  # grammar_seconds: host time of the rows
        self.buffers = BitmaskBuffers(bitmask_width(vocab_size), device)
        self._pool: GrammarFillPool | None = None  # started by the first constrained step

    @property
    def pool(self) -> GrammarFillPool:
        if self._pool is None:
            self._pool = GrammarFillPool()
        return self._pool

    def close(self) -> None:
        """Stop the fill threads (idempotent)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def settle(self, seqs: Seq[Sequence]) -> None:
        """The grammars take the tokens the last step committed (``Sequence.append_tokens`` with
        ``masked``). Called after the next forward is launched, so on a GPU it overlaps the device."""
        for seq in seqs:
            if seq.grammar is not None:
                seq.settle_grammar()

    def apply_plain(self, seqs: Seq[Sequence], logits: torch.Tensor) -> None:
        """Mask row i of ``logits`` [B, V] with sequence i's grammar (plain decoding: one row each).

        Settling and filling run on the pool. An empty row is a grammar's dead end: that sequence
        finishes now, and the token drawn for it anyway is dropped at commit."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None and not s.is_finished]
        if not rows:
            return
        from ngrammar.grammar import apply_bitmask

        t = time.perf_counter()
        bitmask = self.buffers.host(len(seqs))
        if len(rows) < len(seqs):  # rows without a live grammar allow everything
            bitmask.numpy()[np.setdiff1d(np.arange(len(seqs)), rows)] = -1
        matchers = [g for i in rows if (g := seqs[i].grammar) is not None]
        outcome = self.pool.fill_rows(matchers, rows, bitmask)
        for k, token in outcome.rejected:
            seqs[rows[k]].grammar_rejected(token)
        for k in outcome.dead:
            seqs[rows[k]].finish_at_dead_end()
        self.stats.grammar_seconds += time.perf_counter() - t
        apply_bitmask(logits, self.buffers.to_device(len(seqs)))

    def apply_tree(self, seqs: Seq[Sequence], tree: DraftTree, logits: torch.Tensor) -> None:
        """Mask the rows of ``logits`` [B*D, V] with each node's grammar state: one traversal of
        each member's tree (``fill_tree_bitmask``), the members in chunks on the pool."""
        if not any(s.grammar is not None for s in seqs):
            return
        from ngrammar.grammar import apply_bitmask

        t = time.perf_counter()
        self.settle(seqs)
        bs, d = tree.bs, tree.draft_token_num
        next_token, next_sibling = derive_tree_links(tree.mask, bs, d)
        bitmask = self.buffers.host(bs * d)
        drafts = torch.as_tensor(tree.tokens.reshape(bs, d))
        matchers = [None if s.is_finished else s.grammar for s in seqs]
        self.pool.fill_trees(matchers, next_token, next_sibling, drafts, bitmask)
        self.stats.grammar_seconds += time.perf_counter() - t
        apply_bitmask(logits, self.buffers.to_device(bs * d))
