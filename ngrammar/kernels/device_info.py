"""Device facts the kernels' launch heuristics read (host ints only, cached per device)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device. The CPU (Triton's interpreter) has none; 4 keeps
    the multi-program paths (kv splits, several column blocks) exercised in tests."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4
