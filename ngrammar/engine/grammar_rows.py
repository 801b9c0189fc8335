"""Grammar bitmask rows of a step: one per sequence (plain), or one per draft-tree node (verify).

The matchers are the sequences' own (``Sequence.grammar``); rows are built on the host into a
(pinned) bitmask, copied in non-blocking and applied to the logits on the device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import torch

from ngrammar.engine.sequence import Sequence
from ngrammar.engine.stats import EngineStats
from ngrammar.speculative.tree import DraftTree, derive_tree_links


class GrammarRows:
    def __init__(self, vocab_size: int, device: torch.device, stats: EngineStats) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.stats = stats  # grammar_seconds: host time of the rows

    def settle(self, seqs: Seq[Sequence]) -> None:
        """The grammars take the tokens the last step committed (``Sequence.append_tokens`` with
        ``masked``). Called after the next forward is launched, so on a GPU it overlaps the device."""
        for seq in seqs:
            if seq.grammar is not None:
                seq.settle_grammar()

    def apply_plain(self, seqs: Seq[Sequence], logits: torch.Tensor) -> None:
        """Mask row i of ``logits`` [B, V] with sequence i's grammar (plain decoding: one row each)."""
        if not any(s.grammar is not None for s in seqs):
            return
        from ngrammar.grammar import allocate_bitmask, apply_bitmask

        t = time.perf_counter()
        self.settle(seqs)
        bitmask = allocate_bitmask(len(seqs), self.vocab_size, pin_memory=self.device.type == "cuda")
        for i, seq in enumerate(seqs):
            if seq.grammar is not None and not seq.is_finished:
                seq.grammar.fill_bitmask(bitmask, i)
        # An empty row is a grammar's dead end (rows without a grammar are all ones): that sequence
        # finishes now, and the token drawn for it anyway is dropped at commit. One check per step.
        for i in torch.nonzero(~bitmask.any(dim=1)).flatten().tolist():
            seqs[i].finish_at_dead_end()
        self.stats.grammar_seconds += time.perf_counter() - t
        apply_bitmask(logits, bitmask.to(self.device, non_blocking=True))

    def apply_tree(self, seqs: Seq[Sequence], tree: DraftTree, logits: torch.Tensor) -> None:
        """Mask the rows of ``logits`` [B*D, V] with each node's grammar state: one DFS over each
        member's tree (accept, fill the row, recurse, roll back)."""
        if not any(s.grammar is not None for s in seqs):
            return
        from ngrammar.grammar import allocate_bitmask, apply_bitmask, build_tree_bitmask

        t = time.perf_counter()
        self.settle(seqs)
        bs, d = tree.bs, tree.draft_token_num
        next_token, next_sibling = derive_tree_links(tree.mask, bs, d)
        bitmask = allocate_bitmask(bs * d, self.vocab_size, pin_memory=self.device.type == "cuda")
        drafts = torch.as_tensor(tree.tokens.reshape(bs, d))
        matchers = [None if s.is_finished else s.grammar for s in seqs]
        build_tree_bitmask(matchers, next_token, next_sibling, drafts, bitmask)
        self.stats.grammar_seconds += time.perf_counter() - t
        apply_bitmask(logits, bitmask.to(self.device, non_blocking=True))
