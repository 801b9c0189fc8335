"""Tensor parallelism: the rank's place in the group, its share of the model, and the collectives.

A model of H heads, Hkv KV heads, an MLP of width I and a vocabulary of V rows is split N ways:
rank r holds heads [r H/N, (r+1) H/N) of q and KV heads [r Hkv/N, ...) of k / v (column-parallel
q/k/v, so its KV pool holds only those heads), rows [r I/N, ...) of gate / up (column-parallel),
the matching input columns of o and down (row-parallel: each rank's product is a partial sum, one
all-reduce per projection), and vocabulary rows [r V/N, ...) of the embedding and the LM head
(vocab-parallel: an id outside the shard embeds to zero before the all-reduce; logits are
all-gathered). Norms, RoPE tables and q/k norms are replicated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ngrammar.model.config import ModelConfig

# NVLink multicast (NVLS) and the symmetric-memory paths that use it stay off in every process the
# engine starts: the lent multi-GPU hosts do not support it (set before any NCCL communicator exists).
MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


# torch 2.13 renamed all_gather_into_tensor (same collective, [size * rows, ...] out)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ParallelConfigError(ValueError):
    """A tensor-parallel size the model or the machine cannot run; raised before any process starts."""


def check_tensor_parallel(config: ModelConfig, tp: int, device: torch.device, nnodes: int = 1) -> None:
    """Every split must be even, and each node must have a device per local rank."""
    if tp == 1:
        return
    splits = {
        "attention heads": config.num_heads,
        "KV heads": config.num_kv_heads,
        "vocabulary rows": config.vocab_size,
        "MLP columns (intermediate_size)": config.intermediate_size,
    }
    for what, n in splits.items():
        if n % tp:
            raise ParallelConfigError(
                f"--tp {tp}: the model's {n} {what} do not divide by {tp} "
                f"(each rank must hold an equal share; try a divisor of {n})"
            )
    per_node = tp // nnodes
    if device.type == "cuda":
        have = torch.cuda.device_count()
        if have < per_node:
            raise ParallelConfigError(
                f"--tp {tp} needs {per_node} CUDA devices on this node, but {have} are visible"
            )
    elif device.type != "cpu":
        raise ParallelConfigError(f"tensor parallelism runs on cuda (NCCL) or cpu (gloo), not {device.type}")


def tensor_parallel_quantization(quantization: str, tp: int) -> str:
    """``quantization`` (as ``resolve_quantization`` returns it) at ``tp`` ranks: the 4-bit weights
    (``model/quant.py``) are not sharded, so ``int4`` is refused and ``auto`` keeps dense weights."""
    if tp > 1 and quantization == "int4":
        raise ParallelConfigError(
            f"--quantization int4 does not run with --tp {tp} (4-bit weights are not sharded across "
            "ranks); use --quantization none"
        )
    if tp > 1 and quantization == "auto":
        from ngrammar.model.quant import notice

        notice(f"--quantization auto: dense weights at --tp {tp} (4-bit weights are not sharded)")
        return "none"
    return quantization


def local_model_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one rank's modules have: heads, KV heads, MLP width and vocabulary divided by tp."""
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tp,
        num_kv_heads=config.num_kv_heads // tp,
        intermediate_size=config.intermediate_size // tp,
        vocab_size=config.vocab_size // tp,
    )


@dataclass
class TensorParallel:
    """One rank's view of the tensor-parallel group; the model calls these inside its forward.

    ``group`` carries the activations (NCCL on CUDA, gloo on CPU); every rank calls the same
    collectives in the same order, so CUDA graphs capture them like any kernel."""

    rank: int
    size: int
    vocab_size: int  # the full vocabulary
    group: Any = None  # None: the default process group

    @property
    def vocab_start(self) -> int:
        return self.rank * (self.vocab_size // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel projection's partial products over the ranks (in place)."""
        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """ids [T] (global) -> [T, hidden]: this rank's vocabulary rows, zero elsewhere, summed."""
        rows = weight.shape[0]
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < rows)
        h = F.embedding(local.clamp(0, rows - 1), weight) * inside[:, None].to(weight.dtype)
        return self.all_reduce(h)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[R, V/N] per rank -> [R, V] (every rank gets them; only rank 0 reads them)."""
        rows = local.shape[0]
        out = torch.empty((self.size * rows, local.shape[1]), dtype=local.dtype, device=local.device)
        _all_gather_single(out, local.contiguous(), group=self.group)
        return out.view(self.size, rows, -1).permute(1, 0, 2).reshape(rows, -1)
