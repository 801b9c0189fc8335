"""KV page accounting: a reference-counted pool with a prefix cache, and each sequence's page table.

Prefix cache (chained page keys, as vLLM's automatic prefix caching): a page whose ``page_size``
tokens all have their KV computed is registered under the key (key id of the page before it,
its tokens), so a page's key names its whole prefix. A new sequence walks its prompt page by page
through that table and shares every page it finds (reference count + 1) instead of computing it.
Only full pages are shared, so nobody ever writes to a shared page: a sequence writes only at kv
indices >= ``num_cached`` (prefill chunks, decode tokens, tree-verify nodes and the KV compaction
of accepted paths), which lie on its own partially filled last page or on pages after it. A page
whose last reader leaves stays in the table, evictable (least recently released first), until the
pool needs a page and has no free one.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from ngrammar.engine.sequence import Sequence

ROOT_KEY = -1  # the key id the chain of a sequence's first page hangs off

PageKey = tuple[int, tuple[int, ...]]  # (key id of the previous page, this page's tokens)


class OutOfPagesError(RuntimeError):
    pass


class PageAllocator:
    """Page ids of the pool. Each page is exactly one of: free (no content anyone can find),
    used (``refcount`` > 0: in that many page tables), or cached (refcount 0, registered: a prefix
    a later sequence may share; evicted LRU when the free list is empty)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("the KV pool needs at least one page of at least one token")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # stack: low ids handed out first
        self.refcount: list[int] = [0] * num_pages
        self._cached: OrderedDict[int, None] = OrderedDict()  # refcount-0 registered pages, LRU first
        self._page_of: dict[PageKey, int] = {}  # registered content -> page
        self._key_of: dict[int, PageKey] = {}  # page -> its key (registered pages only)
        self._id_of: dict[int, int] = {}  # page -> its key id (unique per registration)
        self._key_ids = itertools.count()
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out: free ones and cached ones nobody reads."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfPagesError(f"need {count} KV pages, {self.num_free} free")
        pages = []
        for _ in range(count):
            page = self._free.pop() if self._free else self._evict_lru()
            self.refcount[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page nobody reads is cached if registered, else free."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise ValueError(f"double free of KV page {p}")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                if p in self._key_of:
                    self._cached[p] = None  # most recently released: evicted last
                else:
                    self._free.append(p)

    def share(self, page: int) -> None:
        """One more reader of a registered page (taken back from the cached set if nobody read it)."""
        if self.refcount[page] == 0:
            del self._cached[page]
        self.refcount[page] += 1

    def lookup(self, key: PageKey) -> int | None:
        return self._page_of.get(key)

    def key_id(self, page: int) -> int:
        return self._id_of[page]

    def register(self, page: int, key: PageKey) -> int:
        """Make ``page`` (used, full, its KV computed) findable under ``key``; returns the key id
        the next page's key chains on. Content already registered on another page keeps that page
        (this one stays private and is freed as usual): returns the existing key id."""
        existing = self._page_of.get(key)
        if existing is not None:
            return self._id_of[existing]
        assert self.refcount[page] > 0 and page not in self._key_of, "registering a page nobody holds"
        key_id = next(self._key_ids)
        self._page_of[key] = page
        self._key_of[page] = key
        self._id_of[page] = key_id
        return key_id

    def _unregister(self, page: int) -> None:
        del self._page_of[self._key_of.pop(page)]
        del self._id_of[page]

    def _evict_lru(self) -> int:
        page, _ = self._cached.popitem(last=False)
        self._unregister(page)
        self.evictions += 1
        return page

    def evict_all(self) -> int:
        """Drop every cached page (nobody reads them) to the free list; returns how many."""
        n = len(self._cached)
        while self._cached:
            self._free.append(self._evict_lru())
        return n

    def check_integrity(self) -> None:
        free = set(self._free)
        cached = set(self._cached)
        used = {p for p in range(self.num_pages) if self.refcount[p] > 0}
        assert len(free) == len(self._free), "duplicate page on the free list"
        assert all(r >= 0 for r in self.refcount), "negative reference count"
        assert not (free & used) and not (free & cached) and not (cached & used), "page in two states"
        assert len(free) + len(cached) + len(used) == self.num_pages, "pages lost"
        assert cached <= set(self._key_of), "a cached page that nobody can find"
        assert not (free & set(self._key_of)), "a free page still registered"
        assert all(self._page_of[k] == p for p, k in self._key_of.items()), "key table out of sync"
        assert len(self._page_of) == len(self._key_of) == len(self._id_of), "key tables out of sync"


class BlockManager:
    """Grows and shrinks sequences' page tables on top of a ``PageAllocator``; with
    ``prefix_cache`` also shares full pages by content (``match`` / ``acquire``) and registers
    each sequence's newly full pages (``register_full_pages``)."""

    def __init__(self, allocator: PageAllocator, prefix_cache: bool = False) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.prefix_cache = prefix_cache
        # Prompt tokens of first admissions looked up in the cache, and of those found there.
        self.query_tokens = 0
        self.hit_tokens = 0

    # ------------------------------------------------------------ prefix cache
    def match(self, seq: Sequence) -> list[int]:
        """Registered pages holding ``seq``'s leading tokens (no references taken). At most
        ``len(token_ids) - 1`` tokens: the last one's logits (or, recomputing, its KV as the next
        root) must come from a forward, which must not write into a shared page."""
        if not self.prefix_cache or seq.pages:
            return []
        ps, alloc = self.page_size, self.allocator
        ids = seq.token_ids
        pages: list[int] = []
        parent = ROOT_KEY
        for start in range(0, (len(ids) - 1) // ps * ps, ps):
            page = alloc.lookup((parent, tuple(ids[start : start + ps])))
            if page is None:
                break
            pages.append(page)
            parent = alloc.key_id(page)
        return pages

    def acquire(self, seq: Sequence, pages: list[int]) -> None:
        """Start ``seq`` (no pages yet) on the shared ``pages`` from ``match``: their KV is its first
        ``len(pages) * page_size`` tokens'."""
        assert not seq.pages and seq.num_cached == 0
        for page in pages:
            self.allocator.share(page)
        seq.pages = list(pages)
        seq.page_key_ids = [self.allocator.key_id(p) for p in pages]
        seq.num_cached = len(pages) * self.page_size

    def count_hit(self, seq: Sequence, hit_pages: int) -> None:
        """Account a first admission's lookup (a preempted sequence's recompute is not counted)."""
        if seq.cached_tokens is None:
            seq.cached_tokens = hit_pages * self.page_size
            self.query_tokens += seq.num_prompt_tokens
            self.hit_tokens += seq.cached_tokens

    def register_full_pages(self, seq: Sequence) -> None:
        """Register ``seq``'s pages that became full of computed KV since the last call. Only tokens
        in ``token_ids`` count (a chained decode step counts its token in flight in ``num_cached``
        before the token is committed)."""
        if not self.prefix_cache:
            return
        ps = self.page_size
        full = min(seq.num_cached, len(seq.token_ids)) // ps
        keys = seq.page_key_ids
        if full <= len(keys):
            return
        ids = seq.token_ids
        for i in range(len(keys), full):
            parent = keys[-1] if keys else ROOT_KEY
            keys.append(self.allocator.register(seq.pages[i], (parent, tuple(ids[i * ps : (i + 1) * ps]))))

    def evictable_pages(self, pages: list[int]) -> int:
        """How many of ``pages`` are cached with no reader (sharing them takes them off ``num_free``)."""
        rc = self.allocator.refcount
        return sum(1 for p in pages if rc[p] == 0)

    # ------------------------------------------------------------- page tables
    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(-(-num_tokens // self.page_size) - len(seq.pages), 0)

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(seq, num_tokens) <= self.allocator.num_free

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq``'s page table cover ``num_tokens`` tokens (raises OutOfPagesError). Every step
        reserves first, so this is also where the pages the last step filled are registered."""
        self.register_full_pages(seq)
        need = self.pages_needed(seq, num_tokens)
        if need:  # (most steps of most sequences need none)
            seq.pages.extend(self.allocator.allocate(need))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release pages beyond what ``num_tokens`` tokens need (rejected draft slots: the
        sequence's own tail, never a registered page)."""
        keep = -(-num_tokens // self.page_size)
        if len(seq.pages) > keep:
            assert keep >= len(seq.page_key_ids), "trimming a registered page"
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, registering its full pages first (a finished or preempted
        sequence's KV stays findable until evicted). The tail goes first, so the LRU evicts a
        prefix's later pages before its earlier ones."""
        self.register_full_pages(seq)
        self.allocator.free(seq.pages[::-1])
        seq.pages = []
        seq.page_key_ids = []
        seq.num_cached = 0
