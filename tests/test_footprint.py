"""The CPU KV pool takes memory as its pages are written, not for its capacity."""

from __future__ import annotations

from pathlib import Path

import torch

from ngrammar.runner.model_runner import zeroed_pool


def _resident_mb(pool: torch.Tensor) -> float:
    """Resident size of the mappings under ``pool``'s bytes (from /proc/self/smaps; numpy's huge-page
    advice may split them): the pool's own pages, which threads that other tests left running in this
    process cannot move, as they move VmRSS."""
    low, high = pool.data_ptr(), pool.data_ptr() + pool.numel() * pool.element_size()
    kib, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < high and low < end
        elif inside and line.startswith("Rss:"):
            kib += int(line.split()[1])
    return kib / 1024


def test_a_cpu_pool_is_zero_and_resident_only_where_written() -> None:
    pool = zeroed_pool((4, 2, 4096, 16, 4, 64), torch.float32, torch.device("cpu"))  # 1 GiB
    assert pool.shape == (4, 2, 4096, 16, 4, 64) and pool.dtype == torch.float32
    assert _resident_mb(pool) < 8
    pool[:, :, :64] = 1.0  # the first 64 pages of every layer's K and V: 8 runs of 1 MiB
    # transparent huge pages may round each 1 MiB run out to one or two 2 MiB pages
    assert 7.5 <= _resident_mb(pool) < 8 * 2 * 2 + 8
    assert not pool[:, :, 64:128].any() and bool((pool[:, :, :64] == 1).all())
    bf16 = zeroed_pool((2, 3, 5), torch.bfloat16, torch.device("cpu"))
    assert bf16.dtype == torch.bfloat16 and not bf16.any()
