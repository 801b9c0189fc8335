"""The decoder's elementwise ops behind one interface: torch reference or fused GPU kernels.

``TorchOps`` is the reference (and the CPU path); ``ngrammar.kernels.fused_ops.TritonOps`` computes
the same values with one kernel per op and rounds where this reference rounds.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class ElementwiseOps(Protocol):
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, n] -> (weight * norm(x + residual), x + residual or None)."""
        ...

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half RoPE of q [T, Hq, d] and k [T, Hkv, d]; cos / sin [T, 1, d/2] fp32.
        May rotate q and k in place (they are fresh projections)."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2n] (gate | up) -> silu(gate) * up [T, n]."""
        ...


class TorchOps:
    """Plain torch ops; rounding to the storage dtype happens after the norm, the residual sum, each
    RoPE half and the SiLU, as in Hugging Face's Llama."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if residual is not None:
            x = x + residual
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return weight * normed, (x if residual is not None else None)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def default_ops(device: torch.device) -> ElementwiseOps:
    """Fused Triton kernels on CUDA, torch elsewhere."""
    if device.type == "cuda":
        from ngrammar.kernels.fused_ops import TritonOps

        return TritonOps()
    return TorchOps()
