"""The n-gram draft corpus: one trie of token windows shared by all requests.

Content. A node at depth n spells the n-gram on its root path; ``count`` is how many occurrences of
that n-gram have been indexed. Indexing position p of a history inserts every window ending at p
of length <= ``max_trie_depth``. Per request the corpus remembers how far it has indexed, so a step
only inserts the windows ending at the newly appended tokens, and one insert cursor (the nodes of
the windows ending at the previous position) makes that O(max_trie_depth) per token.

Recency and capacity. ``capacity`` bounds the number of nodes (root excluded). Creating or bumping
a node touches it; when full, the least recently touched leaf is evicted. Eviction never fails and
never raises: when nothing can be evicted the window is skipped, and windows extending a missing
(evicted or skipped) window are skipped too until the gap slides out of the window range.

Matching. The anchors of a context are the nodes spelling its suffixes of length 1..max_trie_depth,
longest first; only anchors with children add drafts. Each request keeps a match cursor (those
nodes, for the history seen at its last ``batch_get``) and advances it over the appended tokens.
A cursor is rebuilt from scratch when it may disagree with a fresh match: the history no longer
extends the one it consumed, a node it holds was evicted since, or it records a missing suffix and
nodes were created since.

Drafting. One budget of D-1 non-root nodes is shared by all anchors; a (draft parent, token) pair
already in the draft is reused, so identical continuations from different anchors merge.
``BFS`` expands recent children breadth-first with a breadth that shrinks for longer anchors and
deeper levels; ``PROB`` expands the most probable continuation first, probability being the
product of count shares among each node's top children. The result is emitted in BFS order (the
children of a draft node in the order they entered the draft), padded with token-0 root children.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import count, islice

import numpy as np

from ngrammar.spec.tree import DraftTree

MATCH_TYPES = ("BFS", "PROB")
PAD_TOKEN = 0


class _Node:
    """A trie node: the n-gram spelled by the tokens on its path from the root."""

    __slots__ = ("token", "parent", "children", "count", "alive", "in_lru", "drop_seq", "top")

    def __init__(self, token: int, parent: _Node | None) -> None:
        self.token = token
        self.parent = parent
        self.children: dict[int, _Node] = {}  # token -> child, least recently touched first
        self.count = 1  # indexed occurrences of this n-gram
        self.alive = True  # False once evicted; an evicted node is never reused, so holders can tell
        self.in_lru = False
        self.drop_seq = 0  # when it last left the LRU while it still had children (see _evict_one)
        self.top: list[tuple[_Node, float]] | None = None  # PROB cache: top children, count shares


# Stands for "this n-gram is not in the trie" inside cursors. Its children stay empty, so lookups
# through it miss without a branch, and it is never evicted.
_ABSENT = _Node(PAD_TOKEN, None)


@dataclass
class _Cursor:
    """The trie nodes of the suffixes ending at the last consumed token of one request's history.

    ``nodes[n-1]`` spells the last n consumed tokens (``_ABSENT`` if not in the trie); at most
    ``max_trie_depth`` entries. A fresh cursor starts with no nodes at some position of the history,
    so only suffixes starting at or after that position are known.
    """

    length: int  # tokens of the history consumed
    tail: list[int]  # the last <= max_trie_depth consumed tokens: detects rewritten histories
    nodes: list[_Node]
    creations: int = 0  # corpus counters when the nodes were last known valid
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

        # BFS breadth schedule: anchors of depth d start at (max_depth - d) * scale + min breadth, and
        # each level below loses `scale`. A depth-max_trie_depth anchor is always a leaf, hence -1.
        self._bfs_max_depth = max(1, self.max_trie_depth - 1)
        self._bfs_scale = (self.max_bfs_breadth - self.min_bfs_breadth) / self._bfs_max_depth
        self._creations = 0  # monotone counters that let cursors detect trie changes cheaply
        self._evictions = 0
        self._drop_seq = count(1)
        self._push_seq = count()
        self._clear()

    # ----------------------------------------------------------------------------- public API

    @property
    def num_nodes(self) -> int:
        """Trie nodes in use, root excluded (always <= capacity)."""
        return self._size

    def ngram_count(self, ngram: Sequence[int]) -> int:
        """Indexed occurrences of ``ngram`` (0 when it is not in the trie)."""
        node = self._root
        for token in ngram:
            node = node.children.get(int(token), _ABSENT)
        return 0 if node is _ABSENT or node is self._root else node.count

    def index_prompt(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Index every window of a whole prompt (at admission); later ``update`` calls continue it."""
        cursor = _Cursor(length=0, tail=[], nodes=[])
        self._insert_cursors[req_id] = cursor
        self._index(cursor, tokens)

    def update(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Index the windows ending at the tokens appended to ``req_id``'s full history since the last call.

        A request seen for the first time, or whose history no longer extends the indexed one, has
        only its last ``max_trie_depth`` positions indexed (windows starting inside them).
        """
        cursor = self._insert_cursors.get(req_id)
        if cursor is None or not self._extends(cursor, tokens):
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
        self._clear()

    # ---------------------------------------------------------------------------- cursors

    def _clear(self) -> None:
        self._root = _Node(PAD_TOKEN, None)
        self._size = 0
        self._lru: OrderedDict[_Node, None] = OrderedDict()  # least recently touched first
        self._cold: list[tuple[int, int, _Node]] = []  # heap of leaves that left the LRU (see _evict_one)
        self._insert_cursors: dict[Hashable, _Cursor] = {}
        self._match_cursors: dict[Hashable, _Cursor] = {}

    def _fresh_cursor(self, tokens: Sequence[int]) -> _Cursor:
        """A cursor knowing nothing, placed so that consuming the rest covers max_trie_depth tokens."""
        start = max(0, len(tokens) - self.max_trie_depth)
        return _Cursor(length=start, tail=self._tail(tokens, start), nodes=[])

    def _tail(self, tokens: Sequence[int], end: int) -> list[int]:
        return list(tokens[max(0, end - self.max_trie_depth) : end])

    @staticmethod
    def _extends(cursor: _Cursor, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` still starts with what the cursor consumed (its tail is all it depends on)."""
        end = cursor.length
        if end > len(tokens):
            return False
        return list(tokens[end - len(cursor.tail) : end]) == cursor.tail  # also right for numpy histories

    def _is_stale(self, cursor: _Cursor) -> bool:
        """Whether trie changes since the cursor was last valid may have changed its nodes."""
        if cursor.evictions != self._evictions and any(not node.alive for node in cursor.nodes):
            return True
        return cursor.creations != self._creations and _ABSENT in cursor.nodes

    # ------------------------------------------------------------------------------ insert

    def _index(self, cursor: _Cursor, tokens: Sequence[int]) -> None:
        """Insert the windows ending at tokens[cursor.length:], advancing the insert cursor.

        Hot loop (every generated token of every request): the bump of an existing child is inlined.
        """
        keep = self.max_trie_depth - 1  # windows ending at the previous position that can still grow
        lru = self._lru
        nodes = cursor.nodes
        for token in tokens[cursor.length :]:
            token = int(token)
            grown: list[_Node] = []
            for parent in [self._root, *nodes[:keep]]:
                if parent is _ABSENT or not parent.alive:  # a skipped or evicted window cannot grow
                    grown.append(_ABSENT)
                    continue
                siblings = parent.children
                child = siblings.get(token)
                if child is None:
                    grown.append(self._create(parent, token))
                    continue
                del siblings[token]  # re-append: children stay in least-recently-touched-first order
                siblings[token] = child
                parent.top = None
                child.count += 1
                if child.in_lru:
                    lru.move_to_end(child)
                else:
                    self._touch(child)
                grown.append(child)
            nodes = grown
        cursor.nodes = nodes
        cursor.length = len(tokens)
        cursor.tail = self._tail(tokens, cursor.length)

    def _create(self, parent: _Node, token: int) -> _Node:
        if self._size >= self.capacity and not self._evict_one():
            return _ABSENT
        if not parent.alive:  # the eviction took the parent itself (it was the oldest leaf)
            return _ABSENT
        child = _Node(token, parent)
        parent.children[token] = child
        parent.top = None
        self._size += 1
        self._creations += 1
        self._touch(child)
        return child

    def _touch(self, node: _Node) -> None:
        if node.in_lru:
            self._lru.move_to_end(node)
        else:
            self._lru[node] = None
            node.in_lru = True

    # ---------------------------------------------------------------------------- eviction

    def _evict_one(self) -> bool:
        """Evict the least recently touched leaf; False only when the trie is empty.

        A touch does not refresh the ancestors, so the LRU front can be an interior node. Such a
        node leaves the LRU (stamped with ``drop_seq``) and re-enters eviction through the ``cold``
        heap once its last child is evicted. Invariant: a cold leaf is older than every LRU member
        (it was the LRU's oldest when dropped and has not been touched since), and cold leaves are
        ordered by drop_seq, so popping cold leaves first keeps exact LRU order over leaves.
        """
        while self._cold:
            seq, _, node = heapq.heappop(self._cold)
            if node.alive and not node.in_lru and not node.children and node.drop_seq == seq:
                self._detach(node)
                return True
        while self._lru:
            node, _ = self._lru.popitem(last=False)
            node.in_lru = False
            if node.children:
                node.drop_seq = next(self._drop_seq)
                continue
            self._detach(node)
            return True
        return False

    def _detach(self, leaf: _Node) -> None:
        parent = leaf.parent
        assert parent is not None and not leaf.children
        del parent.children[leaf.token]
        parent.top = None
        leaf.alive = False
        leaf.parent = None
        self._size -= 1
        self._evictions += 1
        if parent is not self._root and not parent.children and not parent.in_lru:
            heapq.heappush(self._cold, (parent.drop_seq, next(self._push_seq), parent))

    # ------------------------------------------------------------------------------ match

    def _anchors(self, req_id: Hashable, context: Sequence[int]) -> list[tuple[_Node, int]]:
        """Expandable (node, suffix length) pairs for the context, longest suffix first."""
        cursor = self._match_cursor(req_id, context)
        nodes = cursor.nodes
        return [(nodes[n - 1], n) for n in range(len(nodes), 0, -1) if nodes[n - 1].children]

    def _match_cursor(self, req_id: Hashable, context: Sequence[int]) -> _Cursor:
        cursor = self._match_cursors.get(req_id)
        if (
            cursor is None
            or not self._extends(cursor, context)
            or len(context) - cursor.length > self.max_trie_depth  # rebuilding is no dearer
            or self._is_stale(cursor)
        ):
            cursor = self._fresh_cursor(context)
            self._match_cursors[req_id] = cursor
        self._advance_match(cursor, context)
        return cursor

    def _advance_match(self, cursor: _Cursor, context: Sequence[int]) -> None:
        keep = self.max_trie_depth - 1
        root_children = self._root.children
        nodes = cursor.nodes
        appended = context[cursor.length :]
        for token in appended:
            nodes = [root_children.get(token, _ABSENT)] + [node.children.get(token, _ABSENT) for node in nodes[:keep]]
        if len(appended):
            cursor.nodes = nodes
            cursor.length = len(context)
            cursor.tail = self._tail(context, cursor.length)
        cursor.creations = self._creations
        cursor.evictions = self._evictions

    # ------------------------------------------------------------------------------ draft

    def _draft(self, root_token: int, anchors: list[tuple[_Node, int]], d: int) -> tuple[list[int], list[int]]:
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
        self, anchors: list[tuple[_Node, int]], tokens: list[int], children: list[dict[int, int]], d: int
    ) -> None:
        """BFS from each anchor, level by level (the order of a FIFO queue): each node of a level takes
        its first int(breadth) children, most recent first, and the next level has breadth - scale."""
        scale = self._bfs_scale
        for anchor, depth in anchors:
            breadth = (self._bfs_max_depth - depth) * scale + self.min_bfs_breadth
            level = [(0, anchor)]  # (draft node, trie node)
            while level and len(tokens) < d:  # once full, nothing more can be added
                take = max(1, int(breadth))
                below: list[tuple[int, _Node]] = []
                for parent, node in level:
                    drafted = children[parent]
                    recent = node.children.values()
                    picked = reversed(recent) if len(recent) <= take else islice(reversed(recent), take)
                    for child in picked:
                        slot = drafted.get(child.token)
                        if slot is None:
                            if len(tokens) >= d:
                                return
                            slot = _add_draft_node(tokens, children, parent, child.token)
                        below.append((slot, child))
                level = below
                breadth -= scale

    def _grow_by_frequency(
        self, anchors: list[tuple[_Node, int]], tokens: list[int], children: list[dict[int, int]], d: int
    ) -> None:
        """Best-first over continuation probability; the heap is shared across anchors."""
        heap: list[tuple[float, int, int, _Node]] = []  # (-probability, push order, draft parent, trie node)
        pushes = count()
        for anchor, _ in anchors:
            if len(tokens) >= d:
                return
            for child, share in self._top_children(anchor):
                heapq.heappush(heap, (-share, next(pushes), 0, child))
            while heap:
                neg_prob, _, parent, node = heapq.heappop(heap)
                slot = children[parent].get(node.token)
                if slot is None:
                    if len(tokens) >= d:
                        return
                    slot = _add_draft_node(tokens, children, parent, node.token)
                for child, share in self._top_children(node):
                    heapq.heappush(heap, (neg_prob * share, next(pushes), slot, child))

    def _top_children(self, node: _Node) -> list[tuple[_Node, float]]:
        """The max_bfs_breadth most frequent children (ties: smaller token) with their count shares."""
        top = node.top
        if top is None:
            best = heapq.nsmallest(self.max_bfs_breadth, node.children.values(), key=_by_frequency)
            total = sum(child.count for child in best)
            top = node.top = [(child, child.count / total) for child in best]
        return top


def _by_frequency(node: _Node) -> tuple[int, int]:
    return -node.count, node.token


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
