"""The CPU KV pool takes memory as its pages are written, not for its capacity."""

from __future__ import annotations

import ctypes
import os

import torch

from ngrammar.runner.model_runner import zeroed_pool


def _resident_mb(pool: torch.Tensor) -> float:
    """Resident size of the whole pages under ``pool``'s bytes (``mincore``): the pool's own pages,
    which threads that other tests left running in this process cannot move, as they move VmRSS."""
    page = os.sysconf("SC_PAGE_SIZE")
    low = (pool.data_ptr() + page - 1) // page * page
    pages = (pool.data_ptr() + pool.numel() * pool.element_size() - low) // page
    flags = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(low), ctypes.c_size_t(pages * page), flags) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(f & 1 for f in flags) * page / 2**20


def test_a_cpu_pool_is_zero_and_resident_only_where_written() -> None:
    pool = zeroed_pool((4, 2, 4096, 16, 4, 64), torch.float32, torch.device("cpu"))  # 512 MiB
    assert pool.shape == (4, 2, 4096, 16, 4, 64) and pool.dtype == torch.float32
    assert _resident_mb(pool) < 1
    pool[:, :, :64] = 1.0  # the first 64 pages of every layer's K and V: 8 runs of 1 MiB
    # transparent huge pages may round each 1 MiB run out to one or two 2 MiB pages
    assert 7.9 <= _resident_mb(pool) < 8 * 2 * 2 + 1
    assert not pool[:, :, 64:128].any() and bool((pool[:, :, :64] == 1).all())
    bf16 = zeroed_pool((2, 3, 5), torch.bfloat16, torch.device("cpu"))
    assert bf16.dtype == torch.bfloat16 and not bf16.any()
