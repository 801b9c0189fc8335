"""KV page accounting: a free list over the preallocated pool and each sequence's page table."""

from __future__ import annotations

from ngrammar.engine.sequence import Sequence


class OutOfPagesError(RuntimeError):
    pass


class PageAllocator:
    """Hands out page ids of the pool; pages are owned by exactly one sequence or free."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("the KV pool needs at least one page of at least one token")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # stack: low ids handed out first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPagesError(f"need {count} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"double free of KV page {p}")
            self._used.remove(p)
            self._free.append(p)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate page on the free list"
        assert not (free & self._used), "page both free and used"
        assert len(free) + len(self._used) == self.num_pages, "pages lost"


class BlockManager:
    """Grows and shrinks sequences' page tables on top of a ``PageAllocator``."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(-(-num_tokens // self.page_size) - len(seq.pages), 0)

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(seq, num_tokens) <= self.allocator.num_free

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq``'s page table cover ``num_tokens`` tokens (raises OutOfPagesError)."""
        seq.pages.extend(self.allocator.allocate(self.pages_needed(seq, num_tokens)))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release pages beyond what ``num_tokens`` tokens need (rejected draft slots)."""
        keep = -(-num_tokens // self.page_size)
        if len(seq.pages) > keep:
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]

    def release(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.num_cached = 0
