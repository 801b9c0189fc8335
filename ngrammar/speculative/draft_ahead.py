"""Trees drafted ahead: while a verify step's forward runs, each member's next tree is drafted for
the outcome most worth betting on (its deepest path accepted, then the bonus token the corpus
expects after it), so the host work is off the path between two forwards.

The next step takes a tree only where that outcome came true and nothing changed the corpus in
between, so the trees verified are exactly those drafting then would give. A guess that fails costs
host time the device is busy through (on a GPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ngrammar.speculative.tree import PAD_TOKEN, DraftTree

if TYPE_CHECKING:
    from ngrammar.speculative.corpus import NgramCorpus
    from ngrammar.speculative.request import DraftRequest


@dataclass(frozen=True)
class _Prepared:
    """A tree drafted ahead for one member: valid for the context it was drafted from, at its
    width, while the corpus is unchanged."""

    length: int  # len(context)
    suffix: tuple[int, ...]  # the context's tokens past what was committed when it was drafted
    width: int
    version: int  # ``NgramCorpus.version`` it was drafted at
    tokens: np.ndarray  # [width] int64
    parents: np.ndarray  # [width] int64

    def matches(self, context: list[int], width: int, version: int) -> bool:
        n = len(self.suffix)
        return (
            self.width == width
            and self.version == version
            and len(context) == self.length
            and tuple(context[self.length - n :]) == self.suffix
        )


class DraftAhead:
    """The corpus' drafting call, with the trees drafted ahead for the next step (seq id -> tree)."""

    def __init__(self, corpus: NgramCorpus) -> None:
        self.corpus = corpus
        self._prepared: dict[str, _Prepared] = {}

    def draft(self, seq_ids: list[str], contexts: list[list[int]], width: int) -> DraftTree:
        """The one drafting call: a tree of ``width`` nodes per context (node 0: its last token)."""
        return self.corpus.batch_get(seq_ids, contexts, width)

    def forget(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            self._prepared.pop(seq_id, None)

    def trees_for(self, seqs: Sequence[DraftRequest], width: int) -> tuple[DraftTree, int]:
        """This step's trees and how many of them were drafted ahead: those drafted ahead where
        they were drafted for the context and width of now, on the corpus of now (so they are the
        trees drafting now would give); the others drafted now."""
        prepared, self._prepared = self._prepared, {}
        if not prepared:
            return self.draft([s.seq_id for s in seqs], [s.token_ids for s in seqs], width), 0
        version = self.corpus.version
        hits: dict[int, _Prepared] = {}
        for b, seq in enumerate(seqs):
            p = prepared.get(seq.seq_id)
            if p is not None and p.matches(seq.token_ids, width, version):
                hits[b] = p
        missing = [b for b in range(len(seqs)) if b not in hits]
        if not hits:
            return self.draft([s.seq_id for s in seqs], [s.token_ids for s in seqs], width), 0
        tokens = np.empty((len(seqs), width), dtype=np.int64)
        parents = np.empty((len(seqs), width), dtype=np.int64)
        for b, p in hits.items():
            tokens[b], parents[b] = p.tokens, p.parents
        if missing:
            fresh = self.draft([seqs[b].seq_id for b in missing], [seqs[b].token_ids for b in missing], width)
            tokens[missing], parents[missing] = fresh.tokens_2d(), fresh.parents()
        return DraftTree.from_parents(tokens.reshape(-1), parents), len(hits)

    def prepare(self, seqs: Sequence[DraftRequest], tree: DraftTree, width: int) -> int:
        """Draft each member's next tree for its deepest path accepted plus the corpus' first
        draft after it; returns how many trees were drafted ahead."""
        depths, parents, tokens = tree.depths(), tree.parents(), tree.tokens_2d()
        members: list[tuple[DraftRequest, list[int]]] = []
        for b, seq in enumerate(seqs):
            leaf = int(depths[b].argmax())
            if seq.is_finished or depths[b, leaf] == 0:
                continue
            path: list[int] = []
            node = leaf
            while node > 0:
                path.append(int(tokens[b, node]))
                node = int(parents[b, node])
            path.reverse()
            if seq.remaining_tokens > len(path) + 1:  # a run this long does not finish the member
                members.append((seq, path))
        if not members:
            return 0
        ids = [s.seq_id for s, _ in members]
        ahead = [s.token_ids + path for s, path in members]
        bonus = self.draft(ids, ahead, 2).tokens_2d()[:, 1]  # the corpus' first draft after the path
        guessed = [b for b in range(len(members)) if int(bonus[b]) != PAD_TOKEN]
        if not guessed:
            return 0
        contexts = [ahead[b] + [int(bonus[b])] for b in guessed]
        trees = self.draft([ids[b] for b in guessed], contexts, width)
        version = self.corpus.version
        for row, b in enumerate(guessed):
            seq, path = members[b]
            self._prepared[seq.seq_id] = _Prepared(
                len(contexts[row]),
                (*path, int(bonus[b])),
                width,
                version,
                trees.tokens_2d()[row].copy(),
                trees.parents()[row].copy(),
            )
        return len(guessed)
