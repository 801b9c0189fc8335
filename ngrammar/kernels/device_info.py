"""Device facts the kernels' launch heuristics read (host ints only, cached per device)."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device. The CPU (Triton's interpreter) has none; 4 keeps
    the multi-program paths (kv splits, several column blocks) exercised in tests."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.cache
def _cuda_smem(index: int) -> int:
    import triton  # the figure Triton checks a launch against

    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on a CUDA device (opt-in maximum)."""
    return _cuda_smem(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=1)
def _pdl_allowed() -> bool:
    """The process-wide switches, read once (each kernel launch asks)."""
    return os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("NGRAMMAR_PDL") != "0"


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` may be launched with programmatic dependent launch (PDL).

    PDL lets a kernel start while the one before it on the stream is still finishing: its
    programs may load what no kernel writes (weights), then wait (``gdc_wait``) for the previous
    grid to complete before touching activations. It needs Hopper or newer (sm_90+); Triton's CPU
    interpreter runs programs one by one and has no such instructions. ``NGRAMMAR_PDL=0`` turns it
    off (benchmarks compare; a way out should a driver misbehave); both variables are read once per
    process."""
    if device.type != "cuda" or not _pdl_allowed():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index) >= (9, 0)


def pdl_for_step(device: torch.device, tokens: int) -> bool:
    """Whether a step of ``tokens`` packed tokens launches its Triton kernels with PDL by default.

    One-token steps only. For SmolLM2 every projection is then a fused Triton kernel, so a layer is
    a chain of six Triton kernels, each overlapping the next (batch-1 decode is faster with it). In
    bigger steps cuBLAS sits between them, and with PDL the engine measured slower at batch 8 and 32
    (the measurements: benchmarks/results/LOG.md)."""
    return tokens == 1 and pdl_supported(device)
