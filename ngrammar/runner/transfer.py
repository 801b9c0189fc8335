"""Host->device copies that never stall the host on a running kernel.

A ``non_blocking`` copy from pageable memory is staged synchronously: the host waits until the
stream reaches the copy, i.e. until an in-flight verify forward finishes, which would serialize the
grammar work that is meant to overlap it. Copies from pinned memory are truly asynchronous.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[Sequence[float]] | np.ndarray | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    host = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))
    host = host.to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class Staging:
    """A host buffer mirrored on the device, for a graph's static inputs: a step fills the host
    side, then one copy uploads its first ``n`` elements. Pinned on CUDA (the copy is truly
    asynchronous), so the host refills the buffer only after the last copy has read it
    (``claim``: a host-side event wait, not a stream or device sync)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.host = torch.zeros(numel, dtype=dtype, pin_memory=pinned)
        self.dev = torch.zeros(numel, dtype=dtype, device=device)
        self._uploaded = torch.cuda.Event() if pinned else None

    def claim(self) -> None:
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def upload(self, n: int | None = None) -> None:
        """The first ``n`` elements (all by default) to the device, non-blocking."""
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()


def scatter_table(table: torch.Tensor, packed: torch.Tensor, rows: int, width: int) -> None:
    """``packed`` ([>= rows * width], device) holds page tables packed [rows, width]: into the
    static ``table``'s top-left corner, on the device (a step uploads its own width, not every
    row's max_pages entries)."""
    table[:rows, :width].copy_(packed[: rows * width].view(rows, width))
