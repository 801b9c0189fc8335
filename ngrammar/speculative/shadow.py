"""Shadow drafts: learn what a verify step would accept from plain steps, without verifying.

A plain step commits the target's own choice: with greedy decoding its argmax, so a tree drafted
before the step would have accepted exactly the longest root path of it that the tokens committed
after the root spell. With sampling the committed token takes each child of a node with its target
probability, which is the chance target-only tree sampling (thresholds 1) accepts that child: the
path the committed tokens spell has the distribution of the accepted path. A grammar changes
neither: its mask rejects the drafts a grammar-abiding output never contains. So a tree drafted on
the host during a plain step and walked against the tokens that follow is a sample of a verify
step's acceptance that costs the device nothing.

The draft policy otherwise learns acceptance only from verify steps, so while plain decoding wins
it has to verify now and then to keep its estimates from getting stuck ("explore"), and at larger
batches those verify steps on open-ended text are expensive.
``ShadowDrafts`` drafts trees (one per draft width) for a few members of a plain batch in the
host's spare time and hands each resolved walk to ``AdaptiveDraftPolicy.observe_shadow``, which
then skips its explorations while such samples keep coming (but for one now and then that
re-times the verify steps).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ngrammar.speculative.corpus import NgramCorpus

if TYPE_CHECKING:
    from ngrammar.speculative.request import DraftRequest

RETRY = 64  # calls without trees after which one member's are drafted anyway, re-measuring the cost


@dataclass(frozen=True)
class ShadowSample:
    """What a verify step at the shadow tree's width would have accepted for one sequence."""

    seq_id: str
    width: int  # the tree's nodes, root included
    match_length: int  # of the context the tree was drafted from (uncapped)
    accepted: int  # drafts on the path the committed tokens spell (the bonus token excluded)
    censored: bool  # the path ended at a leaf: the run was not stopped by a rejection
    depth: int  # levels below the tree's root


Kids = list[dict[int, int]]  # tree node -> {token: child}; of equal tokens (padding) the first child


def tree_kids(tokens: Seq[int], parents: Seq[int]) -> tuple[Kids, int]:
    """A tree (tokens [D], parents [D], parent < child) as each node's children by token, and the
    number of levels below its root."""
    kids: Kids = [{} for _ in tokens]
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        kids[parents[i]].setdefault(tokens[i], i)
        depth[i] = depth[parents[i]] + 1
    return kids, max(depth)


def walk_tree(kids: Kids, following: Seq[int]) -> tuple[int, bool] | None:
    """(accepted drafts, censored) of a tree against the tokens that followed its root, or None
    while they do not decide it yet (the path is still inside the tree, at a node with children).
    Greedy verify accepts the first child equal to the target's argmax, which is what follows
    when decoding plainly: the same path."""
    node, accepted = 0, 0
    for token in following:
        child = kids[node].get(token)
        if child is None:
            return accepted, not kids[node]
        node, accepted = child, accepted + 1
    return (accepted, True) if not kids[node] else None


@dataclass(frozen=True)
class _Shadow:
    width: int
    start: int  # the context's length when drafted: the tree hangs from token_ids[start - 1]
    match_length: int
    kids: Kids
    depth: int


class ShadowDrafts:
    """Pending shadow trees: for a sequence, one per draft width the policy picks from (a narrow
    tree is not the top of a wide one: its first level is narrower, and so is its acceptance)."""

    def __init__(self, corpus: NgramCorpus, widths: Seq[int]) -> None:
        self.corpus = corpus
        self.widths = list(widths)
        self._pending: dict[str, list[_Shadow]] = {}  # seq id -> its trees still undecided
        self._turn = 0  # rotates which members a budget-limited step drafts for first
        self.tree_cost: float | None = None  # seconds per member's trees drafted (moving average)
        self._idle = 0  # calls since trees were last drafted (or a re-measurement tried)

    def __len__(self) -> int:
        return len(self._pending)

    def resolve(self, seqs: Seq[DraftRequest]) -> list[ShadowSample]:
        """Walk each member's pending trees against its committed tokens; the decided walks."""
        out = []
        pending = self._pending
        for seq in seqs:
            shadows = pending.get(seq.seq_id)
            if shadows is None:
                continue
            left = []
            following = seq.token_ids[shadows[0].start :]  # a member's trees share their root
            for shadow in shadows:
                walked = walk_tree(shadow.kids, following)
                if walked is None:
                    left.append(shadow)
                else:
                    out.append(
                        ShadowSample(
                            seq.seq_id, shadow.width, shadow.match_length, walked[0], walked[1], shadow.depth
                        )
                    )
            if left:
                pending[seq.seq_id] = left
            else:
                del pending[seq.seq_id]
        return out

    def draft(self, seqs: Seq[DraftRequest], budget: float) -> int:
        """Draft trees (one per width) for members without pending ones (in turn) while the
        measured cost of the next member's fits in ``budget`` seconds; returns how many trees. A
        member without a match gets none: its trees would be padding, which teaches nothing.
        Until the cost is measured, and every ``RETRY`` calls that drafted nothing, one member's
        trees are drafted whatever the budget (members without a match tried before it count
        against the budget), so that one inflated measurement cannot stop shadowing for good."""
        if not seqs:
            return 0
        t = time.perf_counter()
        n = len(seqs)
        self._turn = (self._turn + 1) % n
        self._idle += 1
        probing = self.tree_cost is None or self._idle >= RETRY  # one member's trees, whatever the budget
        if probing:
            self._idle = 0
        cost = 0.0 if self.tree_cost is None else self.tree_cost
        drafted = 0
        for k in range(n):
            start = time.perf_counter()
            if probing and not drafted:
                if k and start - t > budget:
                    break  # members without a match cost little each, but not without bound
            elif start - t + cost > budget:
                break
            seq = seqs[(self._turn + k) % n]
            if seq.seq_id in self._pending or seq.is_finished:
                continue
            trees, match_length = self.corpus.drafts(seq.seq_id, seq.token_ids, self.widths)
            if match_length == 0:
                continue  # (cheap, and not measured: it would pull the cost of real trees down)
            shadows = [
                _Shadow(width, len(seq.token_ids), match_length, *tree_kids(tokens, parents))
                for width, (tokens, parents) in zip(self.widths, trees)
            ]
            self._measure(time.perf_counter() - start)
            cost = self.tree_cost or 0.0
            self._idle = 0
            self._pending[seq.seq_id] = shadows
            drafted += len(shadows)
        return drafted

    def _measure(self, seconds: float) -> None:
        # Drafting time only spikes upwards (a page fault, a GC pause): follow a cheaper sample at
        # once, a dearer one slowly.
        old = self.tree_cost
        self.tree_cost = seconds if old is None or seconds < old else old + 0.2 * (seconds - old)

    def forget(self, seq_ids: Seq[str]) -> None:
        for seq_id in seq_ids:
            self._pending.pop(seq_id, None)
