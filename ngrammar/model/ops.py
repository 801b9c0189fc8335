"""The decoder layer's non-attention ops behind one interface: torch reference or fused GPU kernels.

``TorchOps`` is the reference (and the CPU path); ``ngrammar.kernels.fused_ops.TritonOps`` computes
the same values with fused Triton kernels and rounds where this reference rounds. Projections are
part of the interface so that an implementation may fuse the elementwise op feeding a projection
into it (the norm into q/k/v and gate/up, SiLU·mul into down).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ngrammar.model.quant import PackedWeight, project


class LayerOps(Protocol):
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, n] -> (weight * norm(x + residual), x + residual or None)."""
        ...

    def norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, K] -> (linear(rms_norm(x + residual)) [T, N], x + residual or None); weight [N, K]."""
        ...

    def silu_mul_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, 2K] (gate | up) -> linear(silu(gate) * up) [T, N]; weight [N, K]."""
        ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] -> x @ weight.T + bias [T, N]."""
        ...


class TorchOps:
    """Plain torch ops; rounding to the storage dtype happens after the residual sum, the normalised
    row, its product with the norm weight, the SiLU and the SiLU·up product, as in Hugging Face's
    Llama. A projection's weight may also be a ``PackedWeight`` (quantized, CPU): with float32 rows
    its norm or SiLU·mul runs in the same kernel call (``PackedWeight.norm_linear``)."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if residual is not None:
            x = x + residual
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return weight * normed, (x if residual is not None else None)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor | PackedWeight,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(weight, PackedWeight) and _fusable(x, residual, norm_weight):
            return weight.norm_linear(x, residual, norm_weight, eps, bias)
        normed, summed = self.rms_norm(x, norm_weight, eps, residual)
        return project(normed, weight, bias), summed

    def silu_mul_linear(self, x: torch.Tensor, weight: torch.Tensor | PackedWeight) -> torch.Tensor:
        if isinstance(weight, PackedWeight) and _fusable(x):
            return weight.silu_mul_linear(x)
        return project(self.silu_and_mul(x), weight, None)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return project(x, weight, bias)


def _fusable(*tensors: torch.Tensor | None) -> bool:
    """A packed projection takes its norm or SiLU·mul in the same kernel call (float32 rows)."""
    return all(t is None or t.dtype == torch.float32 for t in tensors)


def default_ops(device: torch.device, invariant: bool = False) -> LayerOps:
    """Fused Triton kernels on CUDA (``invariant``: the row-invariant ones), torch elsewhere."""
    if device.type == "cuda":
        from ngrammar.kernels.fused_ops import InvariantOps, TritonOps

        return InvariantOps() if invariant else TritonOps()
    return TorchOps()
