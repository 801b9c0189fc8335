"""KV page allocator: property-based alloc/free sequences keep the pool consistent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngrammar.engine.block_manager import OutOfPagesError, PageAllocator


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=60))
def test_alloc_free_sequences_keep_integrity(ops: list[tuple[bool, int]]) -> None:
    alloc = PageAllocator(num_pages=32, page_size=16)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            if n <= alloc.num_free:
                held.append(alloc.allocate(n))
            else:
                with pytest.raises(OutOfPagesError):
                    alloc.allocate(n)
        elif held:
            alloc.free(held.pop(n % len(held)))
        alloc.check_integrity()
        assert alloc.num_free + sum(map(len, held)) == 32
    for pages in held:
        alloc.free(pages)
    assert alloc.num_free == 32


def test_double_free_is_refused() -> None:
    alloc = PageAllocator(4, 16)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages)
