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
a missing suffix and nodes were created since.

Drafting. One budget of D-1 non-root nodes is shared by all anchors; a (draft parent, token) pair
already in the draft is reused, so identical continuations from different anchors merge.
``BFS`` expands recent children breadth-first with a breadth that shrinks for longer anchors and
deeper levels; ``PROB`` expands the most probable continuation first, probability being the
product of count shares among each node's top children. The result is emitted in BFS order (the
children of a draft node in the order they entered the draft), padded with token-0 root children.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import count, islice

import numpy as np

from ngrammar.spec.tree import DraftTree

MATCH_TYPES = ("BFS", "PROB")
PAD_TOKEN = 0

_ROOT = 0
# A permanent, dead, childless node id standing for "this n-gram is not in the trie" inside cursors:
# lookups through it simply miss, and being dead it is never extended by inserts.
_ABSENT = 1
# Shared by every childless node and never mutated: a node gets its own dict with its first child.
_NO_CHILDREN: dict[int, int] = {}


class _Trie:
    """Trie storage as parallel lists indexed by node id.

    No per-node Python objects: the dicts hold only ints, which the cyclic GC does not track, so
    a large trie adds no GC pauses. An evicted id is recycled only after the current insert call
    (``release``), so inside a call ``alive`` says whether an id still names the node a caller saw.
    Across calls, ``evicted_at`` does: it holds the eviction counter's value at the id's last
    eviction, so an id recorded when the counter read E still names the same node iff
    evicted_at[id] <= E.

    Eviction order: a touch refreshes only the touched node, not its ancestors, so the LRU front
    can be an interior node. Such a node leaves the LRU, stamped with ``drop_seq``, and re-enters
    eviction through the ``cold`` heap once its last child is evicted. A cold leaf is older than
    every LRU member (it was the LRU's oldest when dropped and has not been touched since) and cold
    leaves are ordered by drop_seq, so popping cold leaves first keeps exact LRU order over leaves.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0  # live nodes, root excluded
        self.token: list[int] = [PAD_TOKEN, PAD_TOKEN]
        self.parent: list[int] = [-1, -1]
        self.count: list[int] = [0, 0]  # indexed occurrences of the node's n-gram
        self.children: list[dict[int, int]] = [{}, _NO_CHILDREN]  # token -> child, least recently touched first
        self.alive: list[bool] = [True, False]
        self.evicted_at: list[int] = [0, 0]
        self.in_lru: list[bool] = [False, False]
        self.drop_seq: list[int] = [0, 0]
        self.lru: OrderedDict[int, None] = OrderedDict()  # least recently touched first
        self.cold: list[tuple[int, int, int]] = []  # heap of (drop_seq, evicted_at, id)
        self.top: dict[int, list[tuple[int, int, float]]] = {}  # PROB cache: id -> [(child, token, share)]
        self.free: list[int] = []  # ids ready for reuse
        self.freed: list[int] = []  # ids evicted during the current call
        self.creations = 0  # monotone counters that let cursors detect trie changes cheaply
        self.evictions = 0
        self._drop_seqs = count(1)

    def lookup(self, ngram: Sequence[int]) -> int:
        node = _ROOT
        for token in ngram:
            node = self.children[node].get(int(token), _ABSENT)
        return node

    def extend(self, windows: list[int], token: int, keep: int) -> list[int]:
        """Count ``token`` after each window ending at the previous position (``windows[n-1]`` has
        length n) and after the empty window; returns the nodes of the windows ending at ``token``.

        The hot loop of indexing (every token of every request), so bumping an existing child is
        inlined here.
        """
        children, alive, count_, in_lru, lru, top = self.children, self.alive, self.count, self.in_lru, self.lru, self.top
        grown: list[int] = []
        for parent in [_ROOT, *windows[:keep]]:
            if not alive[parent]:  # a skipped or evicted window cannot grow
                grown.append(_ABSENT)
                continue
            siblings = children[parent]
            child = siblings.get(token)
            if child is None:
                grown.append(self.new_child(parent, token))
                continue
            del siblings[token]  # re-append: children stay in least-recently-touched-first order
            siblings[token] = child
            count_[child] += 1
            if top:
                top.pop(parent, None)
            if in_lru[child]:
                lru.move_to_end(child)
            else:
                lru[child] = None
                in_lru[child] = True
            grown.append(child)
        return grown

    def new_child(self, parent: int, token: int) -> int:
        """Create parent's child for ``token``, evicting when full; _ABSENT if that is impossible."""
        if self.size >= self.capacity and not self.evict_one():
            return _ABSENT
        if not self.alive[parent]:  # the eviction took the parent itself (it was the oldest leaf)
            return _ABSENT
        node = self._allocate(parent, token)
        if self.children[parent] is _NO_CHILDREN:
            self.children[parent] = {}
        self.children[parent][token] = node
        self.top.pop(parent, None)
        self.lru[node] = None
        return node

    def _allocate(self, parent: int, token: int) -> int:
        """A fresh live leaf (count 1, in the LRU), reusing a released id when there is one."""
        self.size += 1
        self.creations += 1
        if not self.free:
            self.token.append(token)
            self.parent.append(parent)
            self.count.append(1)
            self.children.append(_NO_CHILDREN)
            self.alive.append(True)
            self.evicted_at.append(0)
            self.in_lru.append(True)
            self.drop_seq.append(0)
            return len(self.token) - 1
        node = self.free.pop()
        self.token[node], self.parent[node], self.count[node] = token, parent, 1
        self.children[node], self.alive[node], self.in_lru[node] = _NO_CHILDREN, True, True
        return node

    def evict_one(self) -> bool:
        """Evict the least recently touched leaf; False only when the trie is empty."""
        while self.cold:
            seq, evicted_at, node = heapq.heappop(self.cold)
            if (
                self.evicted_at[node] == evicted_at
                and self.alive[node]
                and not self.in_lru[node]
                and not self.children[node]
                and self.drop_seq[node] == seq
            ):
                self._detach(node)
                return True
        while self.lru:
            node, _ = self.lru.popitem(last=False)
            self.in_lru[node] = False
            if self.children[node]:  # interior: evictable again once its subtree is gone
                self.drop_seq[node] = next(self._drop_seqs)
                continue
            self._detach(node)
            return True
        return False

    def _detach(self, leaf: int) -> None:
        parent = self.parent[leaf]
        siblings = self.children[parent]
        del siblings[self.token[leaf]]
        if not siblings and parent != _ROOT:
            self.children[parent] = _NO_CHILDREN
        self.top.pop(parent, None)
        self.top.pop(leaf, None)
        self.alive[leaf] = False
        self.freed.append(leaf)
        self.size -= 1
        self.evictions += 1
        self.evicted_at[leaf] = self.evictions
        if parent != _ROOT and not self.children[parent] and not self.in_lru[parent]:
            heapq.heappush(self.cold, (self.drop_seq[parent], self.evicted_at[parent], parent))

    def release(self) -> None:
        """End of an insert call: ids evicted during it may now be reused."""
        self.free += self.freed
        self.freed.clear()

    def top_children(self, node: int, k: int) -> list[tuple[int, int, float]]:
        """The k most frequent children (ties: smaller token) as (child, token, share of their counts)."""
        top = self.top.get(node)
        if top is None:
            top = self.top[node] = self._rank_children(node, k)
        return top

    def _rank_children(self, node: int, k: int) -> list[tuple[int, int, float]]:
        siblings = self.children[node]
        if len(siblings) == 1:  # the common case on long matches
            ((token, child),) = siblings.items()
            return [(child, token, 1.0)]
        count_ = self.count
        best = heapq.nsmallest(k, siblings.items(), key=lambda item: (-count_[item[1]], item[0]))
        total = sum(count_[child] for _, child in best)
        return [(child, token, count_[child] / total) for token, child in best]


@dataclass
class _Cursor:
    """The trie nodes of the suffixes ending at the last consumed token of one request's history.

    ``nodes[n-1]`` spells the last n consumed tokens (_ABSENT if not in the trie); at most
    max_trie_depth entries. A fresh cursor starts with no nodes at some position of the history,
    so it only knows suffixes starting at or after that position.
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
        children, count_ = self._trie.children, self._trie.count
        stack = [((token,), child) for token, child in children[_ROOT].items()]
        while stack:
            ngram, node = stack.pop()
            yield ngram, count_[node]
            stack += [(ngram + (token,), child) for token, child in children[node].items()]

    def index_prompt(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Index every window of a whole prompt (at admission); later ``update`` calls continue it."""
        cursor = _Cursor(length=0, tail=[])
        self._insert_cursors[req_id] = cursor
        self._index(cursor, tokens)

    def update(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Index the windows ending at the tokens appended to ``req_id``'s full history since the last call.

        A request seen for the first time, or whose history no longer extends the indexed one, has
        only its last ``max_trie_depth`` positions indexed (windows starting inside them).
        """
        cursor = self._insert_cursors.get(req_id)
        if cursor is None or not _extends(cursor, tokens):
            cursor = self._fresh_cursor(tokens)
            self._insert_cursors[req_id] = cursor
        self._index(cursor, tokens)

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
            if len(context) == 0:
                raise ValueError(f"request {req_id!r} has an empty context; the root needs its last token")
            tree_tokens, tree_parents = self._draft(int(context[-1]), self._anchors(req_id, context), d)
            tokens += tree_tokens
            parents += tree_parents
        parent_array = np.array(parents, dtype=np.int64).reshape(len(contexts), d)
        return DraftTree.from_parents(np.array(tokens, dtype=np.int64), parent_array)

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

    def _fresh_cursor(self, tokens: Sequence[int]) -> _Cursor:
        """A cursor knowing nothing, placed so that consuming the rest covers max_trie_depth tokens."""
        start = max(0, len(tokens) - self.max_trie_depth)
        return _Cursor(length=start, tail=self._tail(tokens, start))

    def _tail(self, tokens: Sequence[int], end: int) -> list[int]:
        return list(tokens[max(0, end - self.max_trie_depth) : end])

    def _index(self, cursor: _Cursor, tokens: Sequence[int]) -> None:
        """Insert the windows ending at tokens[cursor.length:], advancing the insert cursor."""
        trie = self._trie
        windows = self._surviving(cursor)
        keep = self.max_trie_depth - 1  # windows ending at the previous position that can still grow
        for token in tokens[cursor.length :]:
            windows = trie.extend(windows, int(token), keep)
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
        return [(nodes[n - 1], n) for n in range(len(nodes), 0, -1) if children[nodes[n - 1]]]

    def _match(self, req_id: Hashable, context: Sequence[int]) -> list[int]:
        """The nodes of the context's suffixes (see _Cursor), advancing or rebuilding its match cursor."""
        cursor = self._match_cursors.get(req_id)
        if (
            cursor is None
            or not _extends(cursor, context)
            or len(context) - cursor.length > self.max_trie_depth  # rebuilding is no dearer
            or self._is_stale(cursor)
        ):
            cursor = self._fresh_cursor(context)
            self._match_cursors[req_id] = cursor
        self._record(cursor, self._advance_match(cursor.nodes, context[cursor.length :]), context)
        return cursor.nodes

    def _is_stale(self, cursor: _Cursor) -> bool:
        """Whether trie changes since the cursor was recorded may have changed its nodes."""
        trie = self._trie
        if cursor.evictions != trie.evictions and self._surviving(cursor) != cursor.nodes:
            return True
        return cursor.creations != trie.creations and _ABSENT in cursor.nodes

    def _advance_match(self, nodes: list[int], appended: Sequence[int]) -> list[int]:
        keep = self.max_trie_depth - 1
        children = self._trie.children
        root = children[_ROOT]
        for token in appended:
            nodes = [root.get(token, _ABSENT)] + [children[node].get(token, _ABSENT) for node in nodes[:keep]]
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
        children: list[dict[int, int]] = [{}]  # draft node -> {token: draft child}, in insertion order
        if anchors and d > 1:
            if self.match_type == "BFS":
                self._grow_by_recency(anchors, tokens, children, d)
            else:
                self._grow_by_frequency(anchors, tokens, children, d)
        return _bfs_order(tokens, children, d)

    def _grow_by_recency(
        self, anchors: list[tuple[int, int]], tokens: list[int], children: list[dict[int, int]], d: int
    ) -> None:
        """BFS from each anchor, level by level (the order of a FIFO queue): each node of a level takes
        its first ``take`` children, most recent first (see _bfs_schedule).

        Fast path, same result: while a level is one trie node with one child (long matches are
        chains) the walk needs no queue; the general BFS resumes at the first branching node.
        """
        trie_children = self._trie.children
        for anchor, depth in anchors:
            if len(tokens) >= d:
                return
            takes = self._bfs_takes[depth]
            levels = len(takes)
            parent, node, level = 0, anchor, 0
            successors = trie_children[node]
            while len(successors) == 1 and level < levels:
                ((token, child),) = successors.items()
                slot = children[parent].get(token)
                if slot is None:
                    if len(tokens) >= d:
                        return
                    slot = _add_draft_node(tokens, children, parent, token)
                parent, node, level = slot, child, level + 1
                successors = trie_children[node]
            if successors and level < levels:
                if not self._expand_levels([(parent, node)], takes[level:], tokens, children, d):
                    return

    def _expand_levels(
        self, level: list[tuple[int, int]], takes: list[int], tokens: list[int], children: list[dict[int, int]], d: int
    ) -> bool:
        """General BFS over (draft node, trie node) levels; False once the draft is full."""
        trie_children = self._trie.children
        for take in takes:
            below: list[tuple[int, int]] = []
            for parent, node in level:
                drafted = children[parent]
                recent = trie_children[node].items()
                for token, child in reversed(recent) if len(recent) <= take else islice(reversed(recent), take):
                    slot = drafted.get(token)
                    if slot is None:
                        if len(tokens) >= d:
                            return False
                        slot = _add_draft_node(tokens, children, parent, token)
                    below.append((slot, child))
            if not below:
                break
            level = below
        return True

    def _grow_by_frequency(
        self, anchors: list[tuple[int, int]], tokens: list[int], children: list[dict[int, int]], d: int
    ) -> None:
        """Best-first over continuation probability; the heap is shared across anchors.

        Fast path, same result: when the heap is empty and the node just drafted has a single
        child, that child (share 1.0, so the same probability) would be pushed and popped at once,
        so it is taken directly. Push order only breaks ties among entries present together, which
        skipping a push into an empty heap cannot reorder.
        """
        trie = self._trie
        k = self.max_bfs_breadth
        heap: list[tuple[float, int, int, int, int]] = []  # (-probability, push order, draft parent, node, token)
        pushes = 0  # tie-break: equal probabilities pop in push order
        for anchor, _ in anchors:
            if len(tokens) >= d:
                return
            for child, token, share in trie.top_children(anchor, k):
                pushes += 1
                heapq.heappush(heap, (-share, pushes, 0, child, token))
            while heap:
                neg_prob, _, parent, node, token = heapq.heappop(heap)
                while True:
                    slot = children[parent].get(token)
                    if slot is None:
                        if len(tokens) >= d:
                            return
                        slot = _add_draft_node(tokens, children, parent, token)
                    top = trie.top_children(node, k)
                    if heap or len(top) != 1:
                        break
                    parent, (node, token, _) = slot, top[0]
                for child, child_token, share in top:
                    pushes += 1
                    heapq.heappush(heap, (neg_prob * share, pushes, slot, child, child_token))


def _extends(cursor: _Cursor, tokens: Sequence[int]) -> bool:
    """Whether ``tokens`` still starts with what the cursor consumed (its tail is all that matters)."""
    end = cursor.length
    if end > len(tokens):
        return False
    return list(tokens[end - len(cursor.tail) : end]) == cursor.tail  # list(): numpy histories too


def _add_draft_node(tokens: list[int], children: list[dict[int, int]], parent: int, token: int) -> int:
    """Append a draft node for ``token`` under ``parent``; returns its index."""
    slot = len(tokens)
    tokens.append(token)
    children.append({})
    children[parent][token] = slot
    return slot


def _bfs_order(tokens: list[int], children: list[dict[int, int]], d: int) -> tuple[list[int], list[int]]:
    """Renumber a draft (node 0 = root) in BFS order and pad it with PAD_TOKEN root children to D nodes."""
    queue = [0]  # draft nodes in output order; a node's output index is its queue position
    out_tokens = [tokens[0]]
    out_parents = [-1]
    head = 0
    while head < len(queue):
        for child in children[queue[head]].values():
            queue.append(child)
            out_tokens.append(tokens[child])
            out_parents.append(head)
        head += 1
    pad = d - len(out_tokens)
    return out_tokens + [PAD_TOKEN] * pad, out_parents + [0] * pad
