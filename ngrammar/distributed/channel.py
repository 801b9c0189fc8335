"""Rank 0 -> the other ranks: each step's command, then the device tensors it needs.

Commands are small picklable tuples broadcast over a CPU (gloo) group; device tensors (a chained
step's input ids sampled on rank 0's device, an accepted path's KV moves) are broadcast over the
device group (NCCL on CUDA: no host sync, so overlap scheduling keeps the device ahead).

Commands (the first element names it):
  ("forward", StepInput without input_ids, input_ids shape or None)   then the input ids
  ("compact", slots shape, (nodes shape, dtype), (lens shape, dtype)) then nodes, lens
  ("graphs", attach_graphs keyword arguments)
  ("stop",)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_DTYPES = {str(t): t for t in (torch.int64, torch.int32, torch.bool, torch.float32)}


class StepChannel:
    def __init__(self, cpu_group: Any, device_group: Any, device: torch.device) -> None:
        self.cpu_group = cpu_group
        self.device_group = device_group
        self.device = device

    def send(self, command: tuple[Any, ...]) -> None:
        """Rank 0: broadcast one command."""
        dist.broadcast_object_list([command], src=0, group=self.cpu_group)

    def recv(self) -> tuple[Any, ...]:
        """The other ranks: the next command (blocks until rank 0 sends one)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        command: tuple[Any, ...] = box[0]
        return command

    def send_tensor(self, t: torch.Tensor) -> None:
        dist.broadcast(t.contiguous(), src=0, group=self.device_group)

    def recv_tensor(self, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        t = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
        dist.broadcast(t, src=0, group=self.device_group)
        return t


def tensor_spec(t: torch.Tensor) -> tuple[tuple[int, ...], str]:
    """What a receiver needs to allocate ``t``: (shape, dtype name)."""
    if str(t.dtype) not in _DTYPES:
        raise TypeError(f"cannot send a {t.dtype} tensor to the other ranks")
    return tuple(t.shape), str(t.dtype)
