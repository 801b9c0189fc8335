"""The CPU KV pool takes memory as its pages are written, not for its capacity."""

from __future__ import annotations

from pathlib import Path

import torch

from ngrammar.runner.model_runner import zeroed_pool


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_cpu_pool_is_zero_and_resident_only_where_written() -> None:
    before = _rss_mb()
    pool = zeroed_pool((4, 2, 4096, 16, 4, 64), torch.float32, torch.device("cpu"))  # 1 GiB
    assert pool.shape == (4, 2, 4096, 16, 4, 64) and pool.dtype == torch.float32
    assert _rss_mb() - before < 64
    pool[:, :, :64] = 1.0  # the first 64 pages of every layer: 16 MiB
    assert _rss_mb() - before < 64 + 16
    assert not pool[:, :, 64:128].any() and bool((pool[:, :, :64] == 1).all())
    bf16 = zeroed_pool((2, 3, 5), torch.bfloat16, torch.device("cpu"))
    assert bf16.dtype == torch.bfloat16 and not bf16.any()
