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
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np

from ngrammar.speculative.tree import PAD_TOKEN, DraftTree
from ngrammar.speculative.trie import ABSENT, BULK_MIN_TOKENS, ROOT, Trie

if TYPE_CHECKING:
    from ngrammar.config import SpeculativeConfig

MATCH_TYPES = ("BFS", "PROB")


@dataclass
class _Cursor:
    """The trie nodes of the suffixes ending at the last consumed token of one request's history.

    ``nodes[n-1]`` spells the last n consumed tokens (ABSENT if not in the trie); at most
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
            raise ValueError(
                f"max_bfs_breadth ({max_bfs_breadth}) must be >= min_bfs_breadth ({min_bfs_breadth})"
            )
        self.draft_token_num = _check_int("draft_token_num", draft_token_num, 1)
        if match_type not in MATCH_TYPES:
            raise ValueError(f"match_type must be one of {MATCH_TYPES}, got {match_type!r}")
        self.match_type = match_type
        self.capacity = _check_int("capacity", capacity, 1)
        self._bfs_takes = self._bfs_schedule()
        # Bumped by every change of the trie: a tree drafted ahead (``NgramSpecWorker``) is the
        # tree drafted now only while the version is the same.
        self.version = 0
        self.reset()

    @classmethod
    def from_config(cls, c: SpeculativeConfig) -> NgramCorpus:
        """A corpus with the trie and drafting settings of ``c``."""
        return cls(
            max_trie_depth=c.max_trie_depth,
            min_bfs_breadth=c.min_bfs_breadth,
            max_bfs_breadth=c.max_bfs_breadth,
            draft_token_num=c.num_draft_tokens,
            match_type=c.match_type,
            capacity=c.capacity,
        )

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
        stack: list[tuple[tuple[int, ...], int]] = [
            ((token,), child) for token, child in trie.kid_items(ROOT)
        ]
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
            node = ROOT
            for token in context[size - n - 1 :]:  # ``Trie.child`` inlined: this runs every step
                token = int(token)
                kids = children[node]
                if kids.__class__ is int:
                    node = kids if token_[kids] == token else ABSENT
                else:
                    node = kids.get(token, ABSENT)
                if node == ABSENT:
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
        d = (
            self.draft_token_num
            if draft_token_num is None
            else _check_int("draft_token_num", draft_token_num, 1)
        )
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
        self.version += 1
        self._trie = Trie(self.capacity)
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
        self.version += 1
        trie = self._trie
        windows = self._surviving(cursor)
        new_tokens = _int_list(tokens[cursor.length :])
        depth = self.max_trie_depth
        # The bulk path pays a fixed vectorized cost, so it only wins on long runs (prompts), and it
        # needs room for one new node per window, since it cannot interleave evictions.
        if len(new_tokens) >= BULK_MIN_TOKENS and trie.size + len(new_tokens) * depth <= trie.capacity:
            windows = trie.insert_bulk(windows, new_tokens, depth)
        else:
            windows = trie.extend(windows, new_tokens, depth - 1)  # windows of length depth cannot grow
        trie.release()
        self._record(cursor, windows, tokens)

    def _surviving(self, cursor: _Cursor) -> list[int]:
        """The cursor's nodes, with those evicted since it was recorded replaced by ABSENT."""
        trie = self._trie
        if cursor.evictions == trie.evictions:
            return cursor.nodes
        evicted_at, recorded = trie.evicted_at, cursor.evictions
        return [node if evicted_at[node] <= recorded else ABSENT for node in cursor.nodes]

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
        window skipped: ABSENT there means skipped, not missing) and nothing was evicted since,
        so each node still spells its suffix."""
        return (
            0 <= len(context) - indexed.length <= self.max_trie_depth
            and indexed.evictions == self._trie.evictions
            and len(indexed.nodes) == min(indexed.length, self.max_trie_depth)
            and ABSENT not in indexed.nodes
            and _extends(indexed, context)
        )

    def _is_stale(self, cursor: _Cursor) -> bool:
        """Whether trie changes since the cursor was recorded may have changed its nodes."""
        trie = self._trie
        if cursor.evictions != trie.evictions and self._surviving(cursor) != cursor.nodes:
            return True
        return cursor.creations != trie.creations and ABSENT in cursor.nodes

    def _advance_match(self, nodes: list[int], appended: Sequence[int]) -> list[int]:
        keep = self.max_trie_depth - 1
        children, token_ = self._trie.children, self._trie.token
        root = children[ROOT]
        for token in _int_list(appended):
            advanced = [root.get(token, ABSENT)]
            for node in nodes[:keep]:
                kids = children[node]
                if kids.__class__ is int:
                    advanced.append(kids if token_[kids] == token else ABSENT)
                else:
                    advanced.append(kids.get(token, ABSENT))
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
        scale = Fraction(
            self.max_bfs_breadth - self.min_bfs_breadth, max_depth
        )  # exact: int() sees no rounding
        takes = []
        for depth in range(self.max_trie_depth + 1):
            breadth = (max_depth - depth) * scale + self.min_bfs_breadth
            takes.append(
                [max(1, int(breadth - level * scale)) for level in range(self.max_trie_depth - depth)]
            )
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
            for level in range(len(takes)):  # noqa: B007 (read after the loop)
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
            if kids and not self._expand_levels(
                [(parent, node)], takes[level:], tokens, parents, children, d
            ):
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
        heap: list[
            tuple[float, int, int, int, int]
        ] = []  # (-probability, push order, draft parent, node, token)
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
