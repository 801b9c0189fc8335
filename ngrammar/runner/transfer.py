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
