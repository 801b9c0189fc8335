"""Trie storage for the n-gram corpus: parallel lists indexed by node id, LRU eviction of leaves.

A node at depth n spells the n-gram on its root path; its count is how many occurrences of that
n-gram have been indexed. ``capacity`` bounds the number of nodes (root excluded); creating or
bumping a node touches it, and when the trie is full the least recently touched leaf is evicted.
Drafting over this storage lives in ``corpus.py``.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from itertools import chain, count
from typing import Any

import numpy as np

from ngrammar.speculative.tree import PAD_TOKEN

ROOT = 0
# Shortest run of new tokens worth the bulk insert path (below it, per-position inserts are cheaper).
BULK_MIN_TOKENS = 20
# Log entries tolerated beyond the live ones before the touch log is tidied (amortizes the tidying).
_LOG_SLACK = 4096
# A permanent, dead, childless node id standing for "this n-gram is not in the trie" inside cursors:
# lookups through it simply miss, and being dead it is never extended by inserts.
ABSENT = 1
# Shared by every childless node and never mutated.
NO_CHILDREN: dict[int, int] = {}
# A node's children: NO_CHILDREN (a leaf), the id of its only child, or a dict token -> child,
# least recently touched first (the root always has its own dict). See Trie.
# dict[int, int] | int, told apart by ``__class__ is int`` on the hot paths (which mypy cannot narrow).
Kids = Any


class Trie:
    """Trie storage as parallel lists indexed by node id.

    No per-node Python objects beyond ints and dicts of ints, which the cyclic GC does not track,
    so a large trie adds no GC pauses. An evicted id is recycled only after the current
    insert call (``release``), so inside a call ``alive`` says whether an id still names the node
    a caller saw. Across calls, ``evicted_at`` does: it holds the eviction counter's value at the
    id's last eviction, so an id recorded when the counter read E still names the same
    node iff evicted_at[id] <= E.

    Children (``Kids``): a leaf has NO_CHILDREN, a node with one child usually holds that child's
    id, and the root and branching nodes hold a dict token -> child, least recently touched first.
    Most nodes of a window trie sit on chains (once a text departs from what was indexed, every
    longer window is new), and a dict per node used to dominate the cost of indexing.

    Recency: a touch (creating or bumping a node) appends the node to ``log`` and records that
    entry's position in ``stamp``, so the entry at a node's stamp is current and its older entries
    are stale. The current entries from ``head`` on are the LRU, least recently touched first.
    Unlike moving a node within an ordered dict, appending can be batched: an insert call logs its
    touches when it ends or before it evicts (eviction is the only reader of the log), a bulk
    insert with numpy. ``release`` drops consumed entries and, when most entries are stale,
    compacts the log.

    Eviction order: a touch refreshes only the touched node, not its ancestors, so the LRU front
    can be an interior node. Such a node leaves the LRU, stamped with ``drop_seq``, and re-enters
    eviction through the ``cold`` heap once its last child is evicted. A cold leaf is older than
    every LRU member (it was the LRU's oldest when dropped and has not been touched since) and cold
    leaves are ordered by drop_seq, so popping cold leaves first keeps exact LRU order over leaves.

    Two insert paths give the same trie, counts, child order and LRU order: ``extend`` inserts the
    windows position by position (in any state, evicting as it goes) and ``insert_bulk`` inserts a
    long run of positions at once when no eviction can happen.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0  # live nodes, root excluded
        # Per node id. Machine ints where bulk inserts write with numpy; they also stay dense in
        # memory (in a large trie, per-node int objects cost more in cache misses than they save).
        # Lists for the rest: the walks read tokens and children at every step, and evictions
        # read evicted_at and drop_seq.
        self.token: list[int] = [PAD_TOKEN, PAD_TOKEN]
        self.children: list[Kids] = [{}, NO_CHILDREN]
        self.alive = bytearray([True, False])
        self.parent: array[int] = array("q", [-1, -1])
        self.count: array[int] = array("q", [0, 0])  # indexed occurrences of the node's n-gram
        self.stamp: array[int] = array("q", [-1, -1])  # position of the node's latest touch in the log
        self.evicted_at: list[int] = [0, 0]
        self.drop_seq: list[int] = [0, 0]
        self.log: array[int] = array("q")  # touched ids, oldest first; log[i] is at position log_base + i
        self.log_base = 0
        self.head = 0  # index of the first log entry eviction has not consumed
        self.cold: list[tuple[int, int, int]] = []  # heap of (drop_seq, evicted_at, id)
        self.top: dict[int, list[tuple[int, int, float]]] = {}  # PROB cache: id -> [(child, token, share)]
        self.free: list[int] = []  # ids ready for reuse
        self.freed: list[int] = []  # ids evicted during the current call
        self.creations = 0  # monotone counters that let cursors detect trie changes cheaply
        self.evictions = 0
        self._drop_seqs = count(1)

    # ------------------------------------------------------------------------------ reading

    def child(self, node: int, token: int) -> int:
        """``node``'s child for ``token``, ABSENT if none."""
        kids = self.children[node]
        if kids.__class__ is int:
            return kids if self.token[kids] == token else ABSENT
        return kids.get(token, ABSENT)

    def kid_items(self, node: int) -> list[tuple[int, int]]:
        """``node``'s (token, child) pairs, least recently touched first."""
        kids = self.children[node]
        if kids.__class__ is int:
            return [(self.token[kids], kids)]
        return list(kids.items())

    def lookup(self, ngram: Sequence[int]) -> int:
        node = ROOT
        for token in ngram:
            node = self.child(node, int(token))
        return node

    def in_lru(self, node: int) -> bool:
        """Whether ``node``'s latest touch is still in the LRU (not consumed by eviction)."""
        return self.stamp[node] >= self.log_base + self.head

    # ----------------------------------------------------------------------------- inserting

    def extend(self, windows: list[int], tokens: list[int], keep: int) -> list[int]:
        """For each of ``tokens`` in turn, count it after each window ending at the previous
        position (``windows[n-1]`` has length n; only the first ``keep`` can grow) and after the
        empty window. Returns the nodes of the windows ending at the last token.

        The hot loop of per-step indexing. Bumping a child and creating one while there is room
        are inlined, and touches are logged in one go at the end (or before an eviction, the only
        reader of the log); creations that need an eviction or a recycled id go through
        ``new_child``.
        """
        children, alive, count_, top = self.children, self.alive, self.count, self.top
        token_, parent_, stamp = self.token, self.parent, self.stamp
        evicted_at, drop_seq = self.evicted_at, self.drop_seq
        room = 0 if self.free else self.capacity - self.size  # creations that can simply append an id
        created = 0
        touched: list[int] = []  # not logged yet, in touch order
        row = [ROOT, *windows]  # row[n]: the window of length n ending at the previous position
        for token in tokens:
            if len(row) > keep + 1:
                row.pop()  # the longest window cannot grow
            grown = [ROOT]
            for parent in row:
                if not alive[parent]:  # a skipped or evicted window cannot grow
                    grown.append(ABSENT)
                    continue
                kids = children[parent]
                if kids.__class__ is int:
                    child = kids if token_[kids] == token else None
                else:
                    child = kids.get(token)
                    if child is not None and len(kids) > 1:
                        del kids[token]  # re-append: children stay least-recently-touched first
                        kids[token] = child
                if child is not None:
                    count_[child] += 1
                elif room > created:
                    # ``_append_node`` + ``attach`` inlined: calling them here costs ~15% of update.
                    created += 1
                    child = len(token_)
                    token_.append(token)
                    parent_.append(parent)
                    count_.append(1)
                    children.append(NO_CHILDREN)
                    alive.append(True)
                    stamp.append(-1)  # set when logged
                    evicted_at.append(0)
                    drop_seq.append(0)
                    if kids is NO_CHILDREN:
                        children[parent] = child
                    elif kids.__class__ is int:
                        children[parent] = {token_[kids]: kids, token: child}
                    else:
                        kids[token] = child
                else:
                    self.size += created
                    self.creations += created
                    room = created = 0
                    self._log_touches(touched)  # the eviction must see every touch so far
                    touched = []
                    child = self.new_child(parent, token)
                    if child == ABSENT:
                        grown.append(ABSENT)
                        continue
                if top:
                    top.pop(parent, None)
                grown.append(child)
                touched.append(child)
            row = grown
        self.size += created
        self.creations += created
        self._log_touches(touched)
        return row[1:]

    def _append_node(self, parent: int, token: int) -> int:
        """A new id at the end of every per-node column (count 1, no children, not logged yet)."""
        node = len(self.token)
        self.token.append(token)
        self.parent.append(parent)
        self.count.append(1)
        self.children.append(NO_CHILDREN)
        self.alive.append(True)
        self.stamp.append(-1)  # set when logged
        self.evicted_at.append(0)
        self.drop_seq.append(0)
        return node

    def _log_touches(self, nodes: list[int]) -> None:
        """Append touches to the log, in order."""
        stamp = self.stamp
        for position, node in enumerate(nodes, self.log_base + len(self.log)):
            stamp[node] = position
        self.log.extend(nodes)

    def insert_bulk(self, windows: list[int], tokens: list[int], depth: int) -> list[int]:
        """Same result as ``extend(windows, tokens, depth - 1)`` for a caller that guarantees no
        eviction can happen (room for one new node per window), in far fewer Python steps.

        Windows are walked once per start position instead of once per end position: a start's
        windows are one root path, and once a child is missing the rest of that path is a chain
        of new nodes, created with a few list extends (new ids are consecutive, chain after
        chain). The walk order changes nothing observable: counts do not depend on order; siblings
        all have the same length, so walking starts in order touches them in the same relative
        order as walking ends in order (and children are re-appended on each touch, as in
        ``extend``); the touch log, which orders nodes of every length, gets the touches appended
        afterwards in ``extend``'s order (end position, then length).
        """
        children, token_ = self.children, self.token
        k0 = min(len(windows), depth - 1)  # windows ending before tokens[0] that can still grow
        m = len(tokens)
        first_new = len(token_)  # this call only appends ids
        walked: list[int] = []  # the nodes met that existed, row after row (a row = one start)
        row_walked: list[int] = []  # per row: how many of its windows existed, -1 if skipped
        heads: list[int] = []  # per chain of new nodes: the existing node it hangs from
        for r in range(-k0, m):  # start position, relative to tokens[0]
            if r >= 0:
                node, j = ROOT, r
            else:
                node, j = windows[-r - 1], 0  # the window tokens[r:0] is known: continue from it
                if not self.alive[node]:  # a skipped window: its extensions are skipped too
                    row_walked.append(-1)
                    continue
            stop = min(m, r + depth)
            met = len(walked)
            for token in tokens[j:stop]:
                kids = children[node]
                if kids.__class__ is int:
                    if token_[kids] != token:
                        break
                    child = kids
                else:
                    child = kids.get(token)
                    if child is None:
                        break
                    if len(kids) > 1:  # re-append: children stay least-recently-touched first
                        del kids[token]
                        kids[token] = child
                walked.append(child)
                node = child
            met = len(walked) - met
            row_walked.append(met)
            j += met
            if j == stop:
                continue
            # tokens[j:stop] are new below ``node``: a chain whose nodes each hold the next's id.
            first = len(token_)
            kids = children[node]
            if kids is NO_CHILDREN:
                children[node] = first
            elif kids.__class__ is int:
                children[node] = {token_[kids]: kids, tokens[j]: first}
            else:
                kids[tokens[j]] = first
            token_ += tokens[j:stop]
            children += range(first + 1, first + stop - j + 1)
            children[-1] = NO_CHILDREN
            heads.append(node)
        if self.top:  # the parents of the touched nodes (and a few more) lose their ranking
            pop = self.top.pop
            for node in chain((ROOT,), windows, walked, heads):
                pop(node, None)
        return self._finish_bulk(walked, row_walked, heads, k0, m, depth, first_new)

    def _finish_bulk(
        self,
        walked: list[int],
        row_walked: list[int],
        heads: list[int],
        k0: int,
        m: int,
        depth: int,
        first_new: int,
    ) -> list[int]:
        """The per-window rest of ``insert_bulk``, vectorized: counts, the new nodes' parents, the
        touches appended to the log in ``extend``'s order, stamps, and the nodes of the windows
        ending at the last token (shortest first)."""
        created = len(self.token) - first_new
        self.size += created
        self.creations += created
        self.alive += b"\x01" * created
        self.evicted_at += [0] * created
        self.drop_seq += [0] * created
        met = np.frombuffer(array("q", walked), dtype=np.int64)
        self.count.frombytes(np.ones(created, dtype=np.int64).tobytes())
        counts = np.frombuffer(self.count, dtype=np.int64)  # a view: no resizing while it lives
        np.add.at(counts, met, 1)  # a node met twice counts twice
        del counts
        starts = np.arange(-k0, m)
        counted = np.array(row_walked, dtype=np.int64)
        windows = np.where(counted < 0, 0, np.minimum(m, starts + depth) - np.maximum(starts, 0))
        existing = np.maximum(counted, 0)
        new = windows - existing  # a row's new windows form one chain
        # A new node hangs from the previous id, except the first of a chain from the chain's head.
        parents = np.arange(first_new - 1, first_new - 1 + created)
        chain_lengths = new[new > 0]
        parents[np.cumsum(chain_lengths) - chain_lengths] = heads
        self.parent.frombytes(parents.tobytes())
        # A table with one row per start r from -(depth - 1) and one column per length 1..depth:
        # the node of window tokens[r : r + length], ABSENT where this call did not touch it.
        row_offset = (starts + depth - 1) * depth + np.maximum(-starts, 0)  # a row < 0 starts at tokens[0]
        table = np.full((m + depth - 1) * depth, ABSENT, dtype=np.int64)
        table[_ranges(row_offset, existing)] = met
        table[_ranges(row_offset + existing, new)] = np.arange(first_new, first_new + created)
        # extend's order: end position e, then length c + 1, i.e. row e - c, column c.
        ends = np.arange(m)[:, None]
        columns = np.arange(depth)
        touched = table[((ends - columns + depth - 1) * depth + columns).ravel()]
        touched = touched[touched != ABSENT]
        positions = np.arange(len(touched)) + (self.log_base + len(self.log))
        self.log.frombytes(touched.tobytes())
        # A node touched more than once keeps its last (largest) position.
        self.stamp.frombytes(np.full(created, -1, dtype=np.int64).tobytes())
        stamps = np.frombuffer(self.stamp, dtype=np.int64)  # a view: no resizing while it lives
        np.maximum.at(stamps, touched, positions)
        del stamps
        # The windows ending at the last token: rows m-1, m-2, ..., each at its last column.
        rows = np.arange(m - 1, m - 1 - min(k0 + m, depth), -1)
        return table[(rows + depth - 1) * depth + (m - 1 - rows)].tolist()

    def new_child(self, parent: int, token: int) -> int:
        """Create parent's child for ``token``, evicting when full; ABSENT if that is impossible.
        The caller touches it."""
        if self.size >= self.capacity and not self.evict_one():
            return ABSENT
        if not self.alive[parent]:  # the eviction took the parent itself (it was the oldest leaf)
            return ABSENT
        self.size += 1
        self.creations += 1
        children, token_ = self.children, self.token
        if self.free:  # a released id
            node = self.free.pop()
            token_[node] = token
            self.parent[node] = parent
            self.count[node] = 1
            children[node] = NO_CHILDREN
            self.alive[node] = True
        else:
            node = self._append_node(parent, token)
        attach(children, token_, parent, children[parent], node, token)
        if self.top:
            self.top.pop(parent, None)
        return node

    # ------------------------------------------------------------------------------ evicting

    def evict_one(self) -> bool:
        """Evict the least recently touched leaf; False only when the trie is empty."""
        while self.cold:
            seq, evicted_at, node = heapq.heappop(self.cold)
            if (
                self.evicted_at[node] == evicted_at
                and self.alive[node]
                and self.stamp[node] < self.log_base + self.head  # not in the LRU: see in_lru
                and not self.children[node]
                and self.drop_seq[node] == seq
            ):
                self._detach(node)
                return True
        log, stamp, children = self.log, self.stamp, self.children
        head, end = self.head, len(log)
        position = self.log_base + head  # of log[head]
        while head < end:
            node = log[head]
            head += 1
            if stamp[node] != position:
                position += 1
                continue  # a stale entry: the node was touched again since
            position += 1
            if children[node]:  # interior: evictable again once its subtree is gone
                self.drop_seq[node] = next(self._drop_seqs)
                continue
            self.head = head  # before detaching: the entry is consumed
            self._detach(node)
            return True
        self.head = head
        return False

    def _detach(self, leaf: int) -> None:
        children, top = self.children, self.top
        parent = self.parent[leaf]
        kids = children[parent]
        if kids.__class__ is int:  # the leaf was the only child
            kids = children[parent] = NO_CHILDREN
        else:
            del kids[self.token[leaf]]
            if not kids and parent != ROOT:
                children[parent] = NO_CHILDREN
        if top:
            top.pop(parent, None)
            top.pop(leaf, None)
        self.alive[leaf] = False
        self.freed.append(leaf)
        self.size -= 1
        self.evictions += 1
        self.evicted_at[leaf] = self.evictions
        if not kids and parent != ROOT and self.stamp[parent] < self.log_base + self.head:
            # a dropped interior node just became a leaf (out of the LRU: see in_lru)
            heapq.heappush(self.cold, (self.drop_seq[parent], self.evicted_at[parent], parent))

    def release(self) -> None:
        """End of an insert call: ids evicted during it may now be reused, and the log is tidied."""
        if self.freed:
            self.free += self.freed
            self.freed.clear()
        log = self.log
        if self.head > _LOG_SLACK and self.head > len(log) // 2:  # entries eviction consumed: drop them
            del log[: self.head]
            self.log_base += self.head
            self.head = 0
        if len(log) - self.head > 2 * self.size + _LOG_SLACK:  # mostly stale: keep only current entries
            self._compact_log()

    def _compact_log(self) -> None:
        """Re-append the current entries (in order) after the end of the log and drop everything
        else. New positions exceed every old one, so nodes out of the LRU stay out of it."""
        entries = np.frombuffer(self.log, dtype=np.int64)[self.head :]
        stamps = np.frombuffer(self.stamp, dtype=np.int64)  # a view: no resizing while it lives
        current = entries[stamps[entries] == np.arange(len(entries)) + (self.log_base + self.head)]
        end = self.log_base + len(self.log)
        stamps[current] = np.arange(end, end + len(current))  # current entries name distinct nodes
        del stamps
        self.log, self.log_base, self.head = array("q", current.tobytes()), end, 0

    # ------------------------------------------------------------------------------- ranking

    def top_children(self, node: int, k: int) -> list[tuple[int, int, float]]:
        """The k most frequent children (ties: smaller token) as (child, token, share of their counts)."""
        kids = self.children[node]
        if kids.__class__ is int:  # the common case on long matches: nothing to rank or cache
            return [(kids, self.token[kids], 1.0)]
        top = self.top.get(node)
        if top is None:
            top = self.top[node] = self._rank_children(node, k)
        return top

    def _rank_children(self, node: int, k: int) -> list[tuple[int, int, float]]:
        kids = self.children[node]
        if len(kids) == 1:
            ((token, child),) = kids.items()
            return [(child, token, 1.0)]
        count_ = self.count
        best = heapq.nsmallest(k, kids.items(), key=lambda item: (-count_[item[1]], item[0]))
        total = sum(count_[child] for _, child in best)
        return [(child, token, count_[child] / total) for token, child in best]


def attach(children: list[Kids], token_: list[int], parent: int, kids: Kids, child: int, token: int) -> None:
    """Record ``child`` (spelling ``token``) under ``parent``, whose children are ``kids``."""
    if kids is NO_CHILDREN:
        children[parent] = child
    elif kids.__class__ is int:
        children[parent] = {token_[kids]: kids, token: child}
    else:
        kids[token] = child


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ranges [starts[i], starts[i] + lengths[i]) as one int64 array."""
    total = int(lengths.sum())
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total)
