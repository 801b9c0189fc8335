"""The n-gram draft corpus: one trie of token windows shared by all requests.

Content. A node at depth n spells the n-gram on its root path; its count is how many occurrences
of that n-gram have been indexed. Indexing position p of a history inserts every window ending at
p of length <= ``max_trie_depth``. Per request the corpus remembers how far it has indexed, so a
step only inserts the windows ending at the newly appended tokens, and an insert cursor (the nodes
of the windows ending at the previous position) makes that O(max_trie_depth) per token.

Recency and capacity. ``capacity`` bounds the number of nodes (root excluded). Creating or bumping
a node touches it; when the trie is full, the least recently touched leaf is evicted. Eviction
never fails and never raises: when nothing can be evicted the window is skipped, and windows that
extend a missing (evicted or skipped) window are skipped too until the gap slides out of range.

Matching. The anchors of a context are the nodes spelling its suffixes of length
1..max_trie_depth, longest first; only anchors with children add drafts. Each request keeps a match
cursor (those nodes, for the history seen at its last ``batch_get``) and advances it over the
appended tokens. A cursor is rebuilt from scratch whenever it might disagree with a fresh match:
the history no longer extends the one it consumed, a node it holds was evicted since, or it records
a missing suffix and nodes were created since. When the context is exactly the history just
indexed, the insert cursor already holds the fresh match (unless it skipped a window or a node was
evicted since) and is copied instead.

Drafting. One budget of D-1 non-root nodes is shared by all anchors; a (draft parent, token) pair
already in the draft is reused, so identical continuations from different anchors merge.
``BFS`` expands recent children breadth-first with a breadth that shrinks for longer anchors and
deeper levels; ``PROB`` expands the most probable continuation first, probability being the
product of count shares among each node's top children. The result is emitted in BFS order (the
children of a draft node in the order they entered the draft), padded with token-0 root children.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import chain, count, islice

import numpy as np

from ngrammar.spec.tree import PAD_TOKEN, DraftTree

MATCH_TYPES = ("BFS", "PROB")

_ROOT = 0
# Shortest run of new tokens worth the bulk insert path (below it, per-position inserts are cheaper).
_BULK_MIN_TOKENS = 20
# Log entries tolerated beyond the live ones before the touch log is tidied (amortizes the tidying).
_LOG_SLACK = 4096
# A permanent, dead, childless node id standing for "this n-gram is not in the trie" inside cursors:
# lookups through it simply miss, and being dead it is never extended by inserts.
_ABSENT = 1
# Shared by every childless node and never mutated.
_NO_CHILDREN: dict[int, int] = {}
# A node's children: _NO_CHILDREN (a leaf), the id of its only child, or a dict token -> child,
# least recently touched first (the root always has its own dict). See _Trie.
_Kids = dict[int, int] | int


class _Trie:
    """Trie storage as parallel lists indexed by node id.

    No per-node Python objects beyond ints and dicts of ints, which the cyclic GC does not track,
    so a large trie adds no GC pauses. An evicted id is recycled only after the current
    insert call (``release``), so inside a call ``alive`` says whether an id still names the node
    a caller saw. Across calls, ``evicted_at`` does: it holds the eviction counter's value at the
    id's last eviction, so an id recorded when the counter read E still names the same
    node iff evicted_at[id] <= E.

    Children (``_Kids``): a leaf has _NO_CHILDREN, a node with one child usually holds that child's
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
        self.children: list[_Kids] = [{}, _NO_CHILDREN]
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
        """``node``'s child for ``token``, _ABSENT if none."""
        kids = self.children[node]
        if kids.__class__ is int:
            return kids if self.token[kids] == token else _ABSENT
        return kids.get(token, _ABSENT)

    def kid_items(self, node: int) -> list[tuple[int, int]]:
        """``node``'s (token, child) pairs, least recently touched first."""
        kids = self.children[node]
        if kids.__class__ is int:
            return [(self.token[kids], kids)]
        return list(kids.items())

    def lookup(self, ngram: Sequence[int]) -> int:
        node = _ROOT
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
        row = [_ROOT, *windows]  # row[n]: the window of length n ending at the previous position
        for token in tokens:
            if len(row) > keep + 1:
                row.pop()  # the longest window cannot grow
            grown = [_ROOT]
            for parent in row:
                if not alive[parent]:  # a skipped or evicted window cannot grow
                    grown.append(_ABSENT)
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
                    # ``_append_node`` + ``_attach`` inlined: calling them here costs ~15% of update.
                    created += 1
                    child = len(token_)
                    token_.append(token)
                    parent_.append(parent)
                    count_.append(1)
                    children.append(_NO_CHILDREN)
                    alive.append(True)
                    stamp.append(-1)  # set when logged
                    evicted_at.append(0)
                    drop_seq.append(0)
                    if kids is _NO_CHILDREN:
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
                    if child == _ABSENT:
                        grown.append(_ABSENT)
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
        self.children.append(_NO_CHILDREN)
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
                node, j = _ROOT, r
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
            if kids is _NO_CHILDREN:
                children[node] = first
            elif kids.__class__ is int:
                children[node] = {token_[kids]: kids, tokens[j]: first}
            else:
                kids[tokens[j]] = first
            token_ += tokens[j:stop]
            children += range(first + 1, first + stop - j + 1)
            children[-1] = _NO_CHILDREN
            heads.append(node)
        if self.top:  # the parents of the touched nodes (and a few more) lose their ranking
            pop = self.top.pop
            for node in chain((_ROOT,), windows, walked, heads):
                pop(node, None)
        return self._finish_bulk(walked, row_walked, heads, k0, m, depth, first_new)

    def _finish_bulk(
        self, walked: list[int], row_walked: list[int], heads: list[int], k0: int, m: int, depth: int, first_new: int
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
        # the node of window tokens[r : r + length], _ABSENT where this call did not touch it.
        row_offset = (starts + depth - 1) * depth + np.maximum(-starts, 0)  # a row < 0 starts at tokens[0]
        table = np.full((m + depth - 1) * depth, _ABSENT, dtype=np.int64)
        table[_ranges(row_offset, existing)] = met
        table[_ranges(row_offset + existing, new)] = np.arange(first_new, first_new + created)
        # extend's order: end position e, then length c + 1, i.e. row e - c, column c.
        ends = np.arange(m)[:, None]
        columns = np.arange(depth)
        touched = table[((ends - columns + depth - 1) * depth + columns).ravel()]
        touched = touched[touched != _ABSENT]
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
        """Create parent's child for ``token``, evicting when full; _ABSENT if that is impossible.
        The caller touches it."""
        if self.size >= self.capacity and not self.evict_one():
            return _ABSENT
        if not self.alive[parent]:  # the eviction took the parent itself (it was the oldest leaf)
            return _ABSENT
        self.size += 1
        self.creations += 1
        children, token_ = self.children, self.token
        if self.free:  # a released id
            node = self.free.pop()
            token_[node] = token
            self.parent[node] = parent
            self.count[node] = 1
            children[node] = _NO_CHILDREN
            self.alive[node] = True
        else:
            node = self._append_node(parent, token)
        _attach(children, token_, parent, children[parent], node, token)
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
            kids = children[parent] = _NO_CHILDREN
        else:
            del kids[self.token[leaf]]
            if not kids and parent != _ROOT:
                children[parent] = _NO_CHILDREN
        if top:
            top.pop(parent, None)
            top.pop(leaf, None)
        self.alive[leaf] = False
        self.freed.append(leaf)
        self.size -= 1
        self.evictions += 1
        self.evicted_at[leaf] = self.evictions
        if not kids and parent != _ROOT and self.stamp[parent] < self.log_base + self.head:
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


@dataclass
class _Cursor:
    """The trie nodes of the suffixes ending at the last consumed token of one request's history.

    ``nodes[n-1]`` spells the last n consumed tokens (_ABSENT if not in the trie); at most
    max_trie_depth entries. A fresh cursor starts with no nodes at some position of the history,
    so it only knows suffixes starting at or after that position. ``nodes`` and ``tail`` are
    replaced, never mutated, so cursors may share them.
    """

    length: int  # tokens of the history consumed
    tail: list[int]  # the last <= max_trie_depth consumed tokens, all the nodes depend on
    nodes: list[int] = field(default_factory=list)
    creations: int = 0  # trie counters when the nodes were recorded
    evictions: int = 0


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class NgramCorpus:
    """A shared n-gram trie that drafts token trees for speculative decoding."""

    def __init__(
        self,
        *,
        max_trie_depth: int = 18,
        min_bfs_breadth: int = 1,
        max_bfs_breadth: int = 10,
        draft_token_num: int = 8,
        match_type: str = "BFS",
        capacity: int = 1_000_000,
    ) -> None:
        self.max_trie_depth = _check_int("max_trie_depth", max_trie_depth, 2)
        self.min_bfs_breadth = _check_int("min_bfs_breadth", min_bfs_breadth, 1)
        self.max_bfs_breadth = _check_int("max_bfs_breadth", max_bfs_breadth, 1)
        if max_bfs_breadth < min_bfs_breadth:
            raise ValueError(f"max_bfs_breadth ({max_bfs_breadth}) must be >= min_bfs_breadth ({min_bfs_breadth})")
        self.draft_token_num = _check_int("draft_token_num", draft_token_num, 1)
        if match_type not in MATCH_TYPES:
            raise ValueError(f"match_type must be one of {MATCH_TYPES}, got {match_type!r}")
        self.match_type = match_type
        self.capacity = _check_int("capacity", capacity, 1)
        self._bfs_takes = self._bfs_schedule()
        self.reset()

    # ----------------------------------------------------------------------------- public API

    @property
    def num_nodes(self) -> int:
        """Trie nodes in use, root excluded (always <= capacity)."""
        return self._trie.size

    def ngram_count(self, ngram: Sequence[int]) -> int:
        """Indexed occurrences of ``ngram`` (0 when it is not in the trie or empty)."""
        return self._trie.count[self._trie.lookup(ngram)]

    def ngrams(self) -> Iterator[tuple[tuple[int, ...], int]]:
        """Every n-gram in the trie with its count, depth first (for debugging and tests)."""
        trie = self._trie
        stack = [((token,), child) for token, child in trie.kid_items(_ROOT)]
        while stack:
            ngram, node = stack.pop()
            yield ngram, trie.count[node]
            stack += [(ngram + (token,), child) for token, child in trie.kid_items(node)]

    def index_prompt(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Index every window of a whole prompt (at admission); later ``update`` calls continue it."""
        cursor = _Cursor(length=0, tail=[])
        self._insert_cursors[req_id] = cursor
        self._index(cursor, tokens)

    def update(self, req_id: Hashable, tokens: Sequence[int], max_catch_up: int | None = None) -> None:
        """Index the windows ending at the tokens appended to ``req_id``'s full history since the last call.

        A request seen for the first time, or whose history no longer extends the indexed one, has
        only its last ``max_trie_depth`` positions indexed (windows starting inside them). One that
        grew by more than ``max_catch_up`` tokens since the last call has only its new positions
        among the last ``max_trie_depth`` indexed (windows starting inside them): positions it
        already indexed are never indexed twice, which would double their n-grams' counts.
        """
        cursor = self._insert_cursors.get(req_id)
        if cursor is None or not _extends(cursor, tokens):
            cursor = self._fresh_cursor(tokens)
            self._insert_cursors[req_id] = cursor
        elif max_catch_up is not None and len(tokens) - cursor.length > max_catch_up:
            cursor = self._fresh_cursor(tokens, floor=cursor.length)
            self._insert_cursors[req_id] = cursor
        self._index(cursor, tokens)

    def indexed_length(self, req_id: Hashable) -> int:
        """How much of ``req_id``'s history is indexed (0 for a request not seen)."""
        cursor = self._insert_cursors.get(req_id)
        return 0 if cursor is None else cursor.length

    def match_length(self, context: Sequence[int], max_len: int) -> int:
        """The longest n <= max_len such that the context's last n tokens were indexed followed by
        something (so a draft from that suffix has real nodes); 0 when even the last token was not.

        A cheap per-step signal of how much a verify step may accept (no cursor, no drafting).
        Windows nest, so when a suffix has a continuation its shorter suffixes do too, and the scan
        goes up from 1 and stops at the first miss: O(n^2) lookups for a short n. (An eviction can
        break the nesting; then the scan only under-reports.)"""
        trie = self._trie
        children, token_ = trie.children, trie.token
        size, n = len(context), 0
        while n < max_len and n < size:
            node = _ROOT
            for token in context[size - n - 1 :]:  # ``_Trie.child`` inlined: this runs every step
                token = int(token)
                kids = children[node]
                if kids.__class__ is int:
                    node = kids if token_[kids] == token else _ABSENT
                else:
                    node = kids.get(token, _ABSENT)
                if node == _ABSENT:
                    return n
            if not children[node]:
                break
            n += 1
        return n

    def batch_get(
        self,
        req_ids: Sequence[Hashable],
        contexts: Sequence[Sequence[int]],
        draft_token_num: int | None = None,
    ) -> DraftTree:
        """Draft one tree of exactly D nodes per request; node 0 is the context's last token."""
        d = self.draft_token_num if draft_token_num is None else _check_int("draft_token_num", draft_token_num, 1)
        if len(req_ids) != len(contexts):
            raise ValueError(f"{len(req_ids)} req_ids but {len(contexts)} contexts")
        tokens: list[int] = []
        parents: list[int] = []
        for req_id, context in zip(req_ids, contexts):
            ((tree_tokens, tree_parents),), _ = self.drafts(req_id, context, (d,))
            tokens += tree_tokens
            parents += tree_parents
        parent_array = np.array(parents, dtype=np.int64).reshape(len(contexts), d)
        return DraftTree.from_parents(np.array(tokens, dtype=np.int64), parent_array)

    def drafts(
        self, req_id: Hashable, context: Sequence[int], widths: Sequence[int]
    ) -> tuple[list[tuple[list[int], list[int]]], int]:
        """One tree (tokens, parents) per width from one match of the context, and the length of
        the longest suffix they were drafted from (0: the trees are padding). That length is
        ``match_length`` uncapped, except where an eviction broke the nesting of windows."""
        if len(context) == 0:
            raise ValueError(f"request {req_id!r} has an empty context; the root needs its last token")
        anchors = self._anchors(req_id, context)
        root = int(context[-1])
        return [self._draft(root, anchors, d) for d in widths], anchors[0][1] if anchors else 0

    def erase_match_state(self, req_ids: Sequence[Hashable]) -> None:
        """Forget departed requests: their match and insert cursors (the trie keeps their n-grams)."""
        for req_id in req_ids:
            self._match_cursors.pop(req_id, None)
            self._insert_cursors.pop(req_id, None)

    def reset(self) -> None:
        """Empty the trie and forget every request."""
        self._trie = _Trie(self.capacity)
        self._insert_cursors: dict[Hashable, _Cursor] = {}
        self._match_cursors: dict[Hashable, _Cursor] = {}

    # ------------------------------------------------------------------------------ indexing

    def _fresh_cursor(self, tokens: Sequence[int], floor: int = 0) -> _Cursor:
        """A cursor knowing nothing, placed so that consuming the rest covers max_trie_depth tokens
        (fewer when ``floor``, the end of what is already indexed, lies inside them)."""
        start = max(floor, len(tokens) - self.max_trie_depth)
        return _Cursor(length=start, tail=self._tail(tokens, start))

    def _tail(self, tokens: Sequence[int], end: int) -> list[int]:
        tail = tokens[max(0, end - self.max_trie_depth) : end]
        return tail if tail.__class__ is list else list(tail)

    def _index(self, cursor: _Cursor, tokens: Sequence[int]) -> None:
        """Insert the windows ending at tokens[cursor.length:], advancing the insert cursor."""
        if cursor.length == len(tokens):  # nothing new (the cursor already holds its nodes)
            return
        trie = self._trie
        windows = self._surviving(cursor)
        new_tokens = _int_list(tokens[cursor.length :])
        depth = self.max_trie_depth
        # The bulk path pays a fixed vectorized cost, so it only wins on long runs (prompts), and it
        # needs room for one new node per window, since it cannot interleave evictions.
        if len(new_tokens) >= _BULK_MIN_TOKENS and trie.size + len(new_tokens) * depth <= trie.capacity:
            windows = trie.insert_bulk(windows, new_tokens, depth)
        else:
            windows = trie.extend(windows, new_tokens, depth - 1)  # windows of length depth cannot grow
        trie.release()
        self._record(cursor, windows, tokens)

    def _surviving(self, cursor: _Cursor) -> list[int]:
        """The cursor's nodes, with those evicted since it was recorded replaced by _ABSENT."""
        trie = self._trie
        if cursor.evictions == trie.evictions:
            return cursor.nodes
        evicted_at, recorded = trie.evicted_at, cursor.evictions
        return [node if evicted_at[node] <= recorded else _ABSENT for node in cursor.nodes]

    def _record(self, cursor: _Cursor, nodes: list[int], tokens: Sequence[int]) -> None:
        trie = self._trie
        cursor.nodes = nodes
        cursor.creations = trie.creations
        cursor.evictions = trie.evictions
        if cursor.length != len(tokens):
            cursor.length = len(tokens)
            cursor.tail = self._tail(tokens, cursor.length)

    # ------------------------------------------------------------------------------ matching

    def _anchors(self, req_id: Hashable, context: Sequence[int]) -> list[tuple[int, int]]:
        """Expandable (node, suffix length) pairs for the context, longest suffix first."""
        nodes = self._match(req_id, context)
        children = self._trie.children
        return [(node, n) for n, node in zip(range(len(nodes), 0, -1), reversed(nodes)) if children[node]]

    def _match(self, req_id: Hashable, context: Sequence[int]) -> list[int]:
        """The nodes of the context's suffixes (see _Cursor), advancing or rebuilding its match cursor."""
        cursor = self._match_cursors.get(req_id)
        indexed = self._insert_cursors.get(req_id)
        if indexed is not None and self._holds_match(indexed, context):
            # The usual step: the request's history was indexed up to the step in flight (or all of
            # it), so its insert cursor holds the match of all but the last few tokens.
            if cursor is None or not _extends(cursor, context) or cursor.length <= indexed.length:
                cursor = self._match_cursors[req_id] = _Cursor(
                    indexed.length, indexed.tail, indexed.nodes, indexed.creations, indexed.evictions
                )
        if (
            cursor is None
            or not _extends(cursor, context)
            or len(context) - cursor.length > self.max_trie_depth  # rebuilding is no dearer
            or self._is_stale(cursor)
        ):
            cursor = self._fresh_cursor(context)
            self._match_cursors[req_id] = cursor
        if cursor.length != len(context):
            self._record(cursor, self._advance_match(cursor.nodes, context[cursor.length :]), context)
        return cursor.nodes

    def _holds_match(self, indexed: _Cursor, context: Sequence[int]) -> bool:
        """Whether an insert cursor's nodes are exactly the fresh match of a prefix of the context
        at most max_trie_depth tokens short: it consumed that prefix, indexed every suffix (no
        window skipped: _ABSENT there means skipped, not missing) and nothing was evicted since,
        so each node still spells its suffix."""
        return (
            0 <= len(context) - indexed.length <= self.max_trie_depth
            and indexed.evictions == self._trie.evictions
            and len(indexed.nodes) == min(indexed.length, self.max_trie_depth)
            and _ABSENT not in indexed.nodes
            and _extends(indexed, context)
        )

    def _is_stale(self, cursor: _Cursor) -> bool:
        """Whether trie changes since the cursor was recorded may have changed its nodes."""
        trie = self._trie
        if cursor.evictions != trie.evictions and self._surviving(cursor) != cursor.nodes:
            return True
        return cursor.creations != trie.creations and _ABSENT in cursor.nodes

    def _advance_match(self, nodes: list[int], appended: Sequence[int]) -> list[int]:
        keep = self.max_trie_depth - 1
        children, token_ = self._trie.children, self._trie.token
        root = children[_ROOT]
        for token in _int_list(appended):
            advanced = [root.get(token, _ABSENT)]
            for node in nodes[:keep]:
                kids = children[node]
                if kids.__class__ is int:
                    advanced.append(kids if token_[kids] == token else _ABSENT)
                else:
                    advanced.append(kids.get(token, _ABSENT))
            nodes = advanced
        return nodes

    # ------------------------------------------------------------------------------ drafting

    def _bfs_schedule(self) -> list[list[int]]:
        """takes[d][level]: children BFS expands per node ``level`` steps below an anchor of depth d.

        Breadth starts at (max_depth - d) * scale + min_bfs_breadth and loses ``scale`` per level; a
        node takes max(1, int(breadth)) children. max_depth = max(1, max_trie_depth - 1) because a
        depth-max_trie_depth anchor is always a leaf, and scale = (max_bfs_breadth -
        min_bfs_breadth) / max_depth. Below an anchor of depth d the trie has at most
        max_trie_depth - d levels, which bounds each list.
        """
        max_depth = max(1, self.max_trie_depth - 1)
        scale = Fraction(self.max_bfs_breadth - self.min_bfs_breadth, max_depth)  # exact: int() sees no rounding
        takes = []
        for depth in range(self.max_trie_depth + 1):
            breadth = (max_depth - depth) * scale + self.min_bfs_breadth
            takes.append([max(1, int(breadth - level * scale)) for level in range(self.max_trie_depth - depth)])
        return takes

    def _draft(self, root_token: int, anchors: list[tuple[int, int]], d: int) -> tuple[list[int], list[int]]:
        """One request's tree as (tokens [D], parents [D]) in BFS order, padded."""
        tokens = [root_token]
        parents = [-1]  # draft node -> its parent; nodes are numbered in the order they enter
        children: list[dict[int, int]] = [{}]  # draft node -> {token: draft child}, in insertion order
        if anchors and d > 1:
            if self.match_type == "BFS":
                self._grow_by_recency(anchors, tokens, parents, children, d)
            else:
                self._grow_by_frequency(anchors, tokens, parents, children, d)
        if parents == sorted(parents):  # children come in blocks, by parent: already BFS order (common)
            pad = d - len(tokens)
            return tokens + [PAD_TOKEN] * pad, parents + [0] * pad
        return _bfs_order(tokens, children, d)

    def _grow_by_recency(
        self,
        anchors: list[tuple[int, int]],
        tokens: list[int],
        parents: list[int],
        children: list[dict[int, int]],
        d: int,
    ) -> None:
        """BFS from each anchor, level by level (the order of a FIFO queue): each node of a level takes
        its first ``take`` children, most recent first (see _bfs_schedule).

        Fast path, same result: while a level is one trie node with one child stored as an id
        (long matches are chains) the walk needs no queue; the general BFS resumes at the first
        other node.
        """
        trie_children, trie_token = self._trie.children, self._trie.token
        for anchor, depth in anchors:
            if len(tokens) >= d:
                return
            takes = self._bfs_takes[depth]
            parent, node = 0, anchor
            kids = trie_children[node]
            for level in range(len(takes)):
                if kids.__class__ is not int:
                    break
                token = trie_token[kids]
                drafted = children[parent]
                slot = drafted.get(token)
                if slot is None:  # a new draft node (inlined: the hottest loop of drafting)
                    slot = len(tokens)
                    if slot >= d:
                        return
                    tokens.append(token)
                    parents.append(parent)
                    children.append({})
                    drafted[token] = slot
                parent, node = slot, kids
                kids = trie_children[node]
            else:
                continue  # every level below the anchor was walked
            if kids and not self._expand_levels([(parent, node)], takes[level:], tokens, parents, children, d):
                return

    def _expand_levels(
        self,
        level: list[tuple[int, int]],
        takes: list[int],
        tokens: list[int],
        parents: list[int],
        children: list[dict[int, int]],
        d: int,
    ) -> bool:
        """General BFS over (draft node, trie node) levels; False once the draft is full."""
        trie_children, trie_token = self._trie.children, self._trie.token
        for take in takes:
            below: list[tuple[int, int]] = []
            for parent, node in level:
                drafted = children[parent]
                kids = trie_children[node]
                if kids.__class__ is int:
                    picked: Iterable[tuple[int, int]] = ((trie_token[kids], kids),)
                else:
                    recent = kids.items()
                    picked = reversed(recent) if len(recent) <= take else islice(reversed(recent), take)
                for token, child in picked:
                    slot = drafted.get(token)
                    if slot is None:
                        slot = len(tokens)
                        if slot >= d:
                            return False
                        tokens.append(token)
                        parents.append(parent)
                        children.append({})
                        drafted[token] = slot
                    below.append((slot, child))
            if not below:
                break
            level = below
        return True

    def _grow_by_frequency(
        self,
        anchors: list[tuple[int, int]],
        tokens: list[int],
        parents: list[int],
        children: list[dict[int, int]],
        d: int,
    ) -> None:
        """Best-first over continuation probability; the heap is shared across anchors.

        Fast path, same result: when the heap is empty and the node just drafted has a single
        child, that child (share 1.0, so the same probability) would be pushed and popped at once,
        so it is taken directly. Push order only breaks ties among entries present together, which
        skipping a push into an empty heap cannot reorder. A child stored as an id (a chain) is
        taken without ranking.
        """
        trie = self._trie
        trie_children, trie_token, top_children = trie.children, trie.token, trie.top_children
        heappush, heappop = heapq.heappush, heapq.heappop
        k = self.max_bfs_breadth
        heap: list[tuple[float, int, int, int, int]] = []  # (-probability, push order, draft parent, node, token)
        pushes = 0  # tie-break: equal probabilities pop in push order
        for anchor, _ in anchors:
            if len(tokens) >= d:
                return
            for child, token, share in top_children(anchor, k):
                pushes += 1
                heappush(heap, (-share, pushes, 0, child, token))
            while heap:
                neg_prob, _, parent, node, token = heappop(heap)
                while True:
                    drafted = children[parent]
                    slot = drafted.get(token)
                    if slot is None:
                        slot = len(tokens)
                        if slot >= d:
                            return
                        tokens.append(token)
                        parents.append(parent)
                        children.append({})
                        drafted[token] = slot
                    kids = trie_children[node]
                    if kids.__class__ is int:  # one child, share 1.0
                        if not heap:
                            parent, node, token = slot, kids, trie_token[kids]
                            continue
                        top = [(kids, trie_token[kids], 1.0)]
                        break
                    top = top_children(node, k)
                    if heap or len(top) != 1:
                        break
                    parent, (node, token, _) = slot, top[0]
                for child, child_token, share in top:
                    pushes += 1
                    heappush(heap, (neg_prob * share, pushes, slot, child, child_token))


def _attach(children: list[_Kids], token_: list[int], parent: int, kids: _Kids, child: int, token: int) -> None:
    """Record ``child`` (spelling ``token``) under ``parent``, whose children are ``kids``."""
    if kids is _NO_CHILDREN:
        children[parent] = child
    elif kids.__class__ is int:
        children[parent] = {token_[kids]: kids, token: child}
    else:
        kids[token] = child


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ranges [starts[i], starts[i] + lengths[i]) as one int64 array."""
    total = int(lengths.sum())
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total)


def _int_list(tokens: Sequence[int]) -> list[int]:
    """Plain Python ints (numpy histories too): dict keys and list items stay cheap to hash and compare."""
    return tokens.tolist() if isinstance(tokens, np.ndarray) else [int(token) for token in tokens]


def _extends(cursor: _Cursor, tokens: Sequence[int]) -> bool:
    """Whether ``tokens`` still starts with what the cursor consumed (its tail is all that matters)."""
    end = cursor.length
    if end > len(tokens):
        return False
    consumed = tokens[end - len(cursor.tail) : end]
    return (consumed if consumed.__class__ is list else list(consumed)) == cursor.tail  # numpy histories too


def _bfs_order(tokens: list[int], children: list[dict[int, int]], d: int) -> tuple[list[int], list[int]]:
    """Renumber a draft (node 0 = root) in BFS order and pad it with PAD_TOKEN root children to D nodes."""
    order = [0]  # draft nodes in output order; a node's output index is its position here
    out_parents = [-1]
    for head, node in enumerate(order):  # visits the nodes appended below as well
        for child in children[node].values():
            order.append(child)
            out_parents.append(head)
    pad = d - len(order)
    return [tokens[node] for node in order] + [PAD_TOKEN] * pad, out_parents + [0] * pad
